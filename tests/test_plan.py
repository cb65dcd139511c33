"""The planner's figures against hand computations, its step model (compute, compression,
overlap, the transport's host time), its unit parsing, errors and CLI, its monotonic
properties, and its pick on the rows benchmarks/bench_network.py measured before and after the
exchange redesign."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsecomm.plan import (
    allgather_bytes,
    allreduce_bytes,
    bucket_caps,
    comm_time,
    crossover_density,
    format_plan,
    last_bucket_share,
    measure_compress_costs,
    num_buckets,
    parse_bandwidth,
    parse_compress_costs,
    parse_count,
    parse_latency,
    pick,
    plan,
    recommend,
)

REPO = Path(__file__).resolve().parents[1]
GBIT_25 = 25e9 / 8  # 25 Gbit/s = 3.125e9 bytes/s


def rows_by_name(rows):
    return {row.name: row for row in rows}


# --------------------------------------------------------------------------- the worked example
# 1e8 fp32 gradients on 8 ranks over 25 Gbit/s: about 220 ms dense, a crossover at 1/W.


def test_dense_allreduce_1e8_fp32_at_w8_25gbit_is_about_220ms():
    # 2 (W-1)/W * 4 B * n = 2 * 7/8 * 4 * 1e8 = 7e8 bytes; 7e8 B / 3.125e9 B/s = 0.224 s.
    nbytes = allreduce_bytes(1e8, 8, 4)
    assert nbytes == 7e8
    seconds = comm_time(nbytes, parse_bandwidth("25Gbit"))
    assert seconds == pytest.approx(0.224, rel=1e-12)
    assert 0.2 < seconds < 0.25  # "about 220 ms"


@pytest.mark.parametrize(
    "world_size, expected",
    [
        (8, 0.125),  # 1/8 = 12.5%
        (64, 0.015625),  # 1/64 = 1.5625%, "1.6%" rounded
        (2, 0.5),
    ],
)
def test_crossover_is_one_over_w_for_8_byte_pairs(world_size, expected):
    assert crossover_density(world_size) == expected
    # At the crossover the two byte counts are equal: (W-1) * (n/W) * 8 == 2 (W-1)/W * 4 n.
    n = 1e8
    assert allgather_bytes(expected * n, world_size, 8) == pytest.approx(
        allreduce_bytes(n, world_size, 4), rel=1e-12
    )


def test_crossover_general_formula():
    # k/n = 2e / (W b): fp32 against 6-byte pairs (half values) at W=8: 8 / 48 = 1/6.
    assert crossover_density(8, 4, 6) == pytest.approx(1 / 6, rel=1e-12)
    # 2-byte all-reduce against 8-byte pairs at W=64: 4 / 512 = 1/128.
    assert crossover_density(64, 2, 8) == 1 / 128


def test_crossover_with_latency_equalises_the_times():
    # n=1e6, W=4, 1 GB/s, 10 us, one bucket:
    # 1/4 + 1 * 1e-5 s * 1e9 B/s / (1e6 * 8 B) = 0.25 + 1e4 / 8e6 = 0.25 + 0.00125 = 0.25125.
    d = crossover_density(4, n=1e6, bandwidth=1e9, latency=10e-6, buckets=1)
    assert d == pytest.approx(0.25125, rel=1e-12)
    dense = comm_time(allreduce_bytes(1e6, 4), 1e9, 10e-6, 2 * 3)
    sparse = comm_time(allgather_bytes(d * 1e6, 4), 1e9, 10e-6, 3)
    assert sparse == pytest.approx(dense, rel=1e-12)


# --------------------------------------------------------------------------- plan() figures


def test_plan_w8_25gbit_no_latency():
    rows = rows_by_name(plan(1e8, 8, GBIT_25, densities=(0.01, 0.1)))
    # Dense: 7e8 B -> 0.224 s (above).
    assert rows["Dense fp32"].bytes_per_rank == 7e8
    assert rows["Dense fp32"].time_s == pytest.approx(0.224, rel=1e-12)
    # Cast: 2 * 7/8 * 2 B * 1e8 = 3.5e8 B -> 3.5e8 / 3.125e9 = 0.112 s, 2x.
    for name in ("Cast fp16", "Cast bf16"):
        assert rows[name].bytes_per_rank == 3.5e8
        assert rows[name].time_s == pytest.approx(0.112, rel=1e-12)
        assert rows[name].speedup == pytest.approx(2.0, rel=1e-12)
    # TopK 1%: k = 1e6; 7 * 1e6 * 8 B = 5.6e7 B -> 5.6e7 / 3.125e9 = 0.01792 s, 12.5x.
    assert rows["TopK 1%"].bytes_per_rank == 5.6e7
    assert rows["TopK 1%"].time_s == pytest.approx(0.01792, rel=1e-12)
    assert rows["TopK 1%"].speedup == pytest.approx(12.5, rel=1e-12)
    # TopK 10%: 7 * 1e7 * 8 = 5.6e8 B < 7e8 B: still below the 12.5% crossover.
    assert rows["TopK 10%"].bytes_per_rank == 5.6e8
    assert not rows["TopK 10%"].above_crossover


def test_half_values_price_topk_pairs_at_six_bytes_and_threshold_at_eight():
    rows = rows_by_name(plan(1e8, 8, GBIT_25, densities=(0.01,), pair_bytes=6))
    assert rows["TopK 1%"].bytes_per_rank == 7 * 1e6 * 6
    eight = rows_by_name(plan(1e8, 8, GBIT_25, densities=(0.01,)))["Threshold 1%"]
    assert eight.bytes_per_rank == 7 * 1e6 * 8 + 224  # its pairs, and the count all-gather
    assert rows["Threshold 1%"].bytes_per_rank == eight.bytes_per_rank  # float32 values
    text = format_plan(1e8, 8, GBIT_25, densities=(0.01,), pair_bytes=6)
    assert "8.33% (= 2*2/(W*6) in bytes)" in text, text
    assert "6.25% (= 2*2/(W*8) in bytes = 1/(2W))" in format_plan(1e8, 8, GBIT_25)


def test_plan_with_latency_and_one_bucket():
    # n=1e6, W=4, 1 GB/s, 10 us; 1e6 fp32 = 4 MB fits one 25 MiB bucket.
    rows = rows_by_name(plan(1e6, 4, 1e9, latency=10e-6, densities=(0.01,)))
    # Dense: 2 * 3/4 * 4 * 1e6 = 6e6 B -> 6e-3 s, + 2 (W-1) = 6 terms * 1e-5 s -> 6.06e-3 s.
    assert rows["Dense fp32"].bytes_per_rank == 6e6
    assert rows["Dense fp32"].latency_terms == 6
    assert rows["Dense fp32"].time_s == pytest.approx(6.06e-3, rel=1e-12)
    # TopK 1%: k = 1e4; 3 * 1e4 * 8 = 2.4e5 B -> 2.4e-4 s, + 3 terms * 1e-5 = 3e-5 -> 2.7e-4 s.
    assert rows["TopK 1%"].bytes_per_rank == 2.4e5
    assert rows["TopK 1%"].latency_terms == 3
    assert rows["TopK 1%"].time_s == pytest.approx(2.7e-4, rel=1e-12)
    # Threshold 1%: the same pairs + an all-gather of int64 counts: 2.4e5 + 3 * 8 = 240024 B,
    # two all-gathers = 6 terms: 2.40024e-4 + 6e-5 = 3.00024e-4 s.
    assert rows["Threshold 1%"].bytes_per_rank == 240024
    assert rows["Threshold 1%"].time_s == pytest.approx(3.00024e-4, rel=1e-12)


def test_plan_13b_w64_25gbit_20us_buckets():
    # 25 MiB buckets hold 25 * 2**20 / 4 = 6553600 fp32; 1.3e9 / 6553600 = 198.36 -> 199 buckets.
    assert num_buckets(1.3e9) == 199
    # The sparse rows in 100 MiB buckets, as given (by default a model this large gets 16
    # larger ones: below).
    rows = rows_by_name(plan(1.3e9, 64, GBIT_25, latency=20e-6, bucket_cap_mb=(25, 100)))
    # Dense: 2 * 63/64 * 4 * 1.3e9 = 1.02375e10 B -> 3.276 s; 2 * 63 * 199 = 25074 terms * 2e-5 s
    # = 0.50148 s; total 3.77748 s.
    dense = rows["Dense fp32"]
    assert dense.bytes_per_rank == pytest.approx(1.02375e10, rel=1e-12)
    assert dense.latency_terms == 25074
    assert dense.time_s == pytest.approx(3.77748, rel=1e-12)
    # TopK 0.1%: k = 1.3e6; 63 * 1.3e6 * 8 = 6.552e8 B -> 0.209664 s. Its buckets are 100 MiB
    # (26214400 fp32): 1.3e9 / 26214400 = 49.59 -> 50; 63 * 50 = 3150 terms * 2e-5 = 0.063 s;
    # total 0.272664 s.
    assert num_buckets(1.3e9, bucket_cap_mb=100) == 50
    topk = rows["TopK 0.1%"]
    assert topk.bytes_per_rank == pytest.approx(6.552e8, rel=1e-12)
    assert topk.latency_terms == 3150
    assert topk.time_s == pytest.approx(0.272664, rel=1e-12)
    # By default, 16 sparse buckets: 63 * 16 = 1008 terms * 2e-5 = 0.02016 s; 0.229824 s.
    default = rows_by_name(plan(1.3e9, 64, GBIT_25, latency=20e-6))
    assert default["TopK 0.1%"].latency_terms == 1008
    assert default["TopK 0.1%"].time_s == pytest.approx(0.229824, rel=1e-12)
    assert default["Dense fp32"].time_s == pytest.approx(3.77748, rel=1e-12)
    # In 25 MiB buckets like the dense rows': 63 * 199 = 12537 terms * 2e-5 = 0.25074 s; total
    # 0.460404 s. The dense rows do not change with the sparse rows' cap.
    same = rows_by_name(plan(1.3e9, 64, GBIT_25, latency=20e-6, bucket_cap_mb=25))
    assert same["TopK 0.1%"].time_s == pytest.approx(0.460404, rel=1e-12)
    assert same["Dense fp32"].time_s == pytest.approx(3.77748, rel=1e-12)
    # TopK 10% is above the 1/64 crossover: sparsecomm sends it dense, and the row says what
    # that costs: the dense all-reduce's bytes, over the 50 sparse buckets' 2 * 63 * 50 terms.
    assert rows["TopK 10%"].above_crossover and not rows["TopK 1%"].above_crossover
    dense = rows["Dense fp32"]
    assert rows["TopK 10%"].bytes_per_rank == dense.bytes_per_rank
    assert rows["TopK 10%"].latency_terms == 6300
    assert rows["TopK 10%"].time_s == pytest.approx(
        dense.bytes_per_rank / GBIT_25 + 6300 * 2e-5, rel=1e-12
    )
    # Threshold 10% too, but its counts are all-gathered before every rank switches to dense:
    # 63 * 8 B and 63 terms per sparse bucket on top of the dense all-reduce.
    threshold = rows["Threshold 10%"]
    assert threshold.above_crossover
    assert threshold.bytes_per_rank == dense.bytes_per_rank + 63 * 8 * 50
    assert threshold.latency_terms == 6300 + 63 * 50
    # Time crossover: 1/64 + 199 * 2e-5 * 3.125e9 / (1.3e9 * 8) = 0.015625 + 1.24375e7 / 1.04e10
    # = 0.015625 + 0.00119591346... = 0.01682091346...
    assert crossover_density(
        64, n=1.3e9, bandwidth=GBIT_25, latency=20e-6, buckets=199
    ) == pytest.approx(0.015625 + 1.24375e7 / 1.04e10, rel=1e-12)
    # With 50 all-gathers against 199 all-reduces: (2 * 199 - 50) = 348 latency terms' worth.
    assert crossover_density(
        64, n=1.3e9, bandwidth=GBIT_25, latency=20e-6, buckets=199, sparse_buckets=50
    ) == pytest.approx(0.015625 + 348 * 2e-5 * 3.125e9 / 1.04e10, rel=1e-12)


def test_num_buckets_edges():
    assert num_buckets(6553600) == 1
    assert num_buckets(6553601) == 2
    assert num_buckets(1, bucket_cap_mb=1) == 1


def test_single_rank_communicates_nothing():
    rows = plan(1e6, 1, GBIT_25)
    assert all(row.bytes_per_rank == 0 for row in rows)
    assert "Dense()" in recommend(rows, 1)


def test_recommendation_follows_the_model():
    # W=8, 1e8, communication only: TopK 0.1% (1.79 ms) < 1% (17.9 ms) < Cast bf16 (112 ms)
    # < TopK 10% (179 ms) < Dense (224 ms). The step is the exchange alone, so the least
    # communication wins; 1% is named only when it is within 10% of the pick.
    assert recommend(plan(1e8, 8, GBIT_25), 8).startswith("Use TopK(density=0.001)")
    assert recommend(plan(1e8, 8, GBIT_25, densities=(0.01, 0.1)), 8).startswith(
        "Use TopK(density=0.01)"
    )
    # W=64: 1% moves 63 * 0.01 * 8 = 5.04 B/element, more than bf16's 2 * 63/64 * 2 = 3.94:
    # only 0.1% beats bf16; without it the answer is Cast(torch.bfloat16).
    assert "TopK(density=0.001)" in recommend(plan(1.3e9, 64, GBIT_25), 64)
    assert (
        "Cast(torch.bfloat16)"
        in recommend(plan(1.3e9, 64, GBIT_25, densities=(0.01, 0.1)), 64).split(":")[0]
    )


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25Gbit", 25e9 / 8),
        ("100Gbit", 100e9 / 8),
        ("100Gbit/s", 100e9 / 8),
        ("25 Gbit", 25e9 / 8),
        ("25gbit", 25e9 / 8),
        ("400Gbps", 400e9 / 8),
        ("10Gb", 10e9 / 8),
        ("100Mbit", 100e6 / 8),
        ("10GB", 10e9),
        ("10GB/s", 10e9),
        ("12.5GBps", 12.5e9),
        ("1GiB", 2**30),
        ("1e3MB", 1e9),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    "text, expected",
    [("20us", 2e-5), ("20µs", 2e-5), ("5ms", 5e-3), ("800ns", 8e-7), ("1s", 1.0), ("0", 0.0)],
)
def test_parse_latency(text, expected):
    assert parse_latency(text) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    "text, expected", [("1.3e9", 1.3e9), ("350M", 3.5e8), ("7B", 7e9), ("125k", 1.25e5)]
)
def test_parse_count(text, expected):
    assert parse_count(text) == expected


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: parse_bandwidth("25"), ["bandwidth", "no unit", "25Gbit"]),
        (lambda: parse_bandwidth(25e9), ["bandwidth", "no unit"]),
        (lambda: parse_bandwidth("fast"), ["bandwidth", "25Gbit"]),
        (lambda: parse_bandwidth("-5Gbit"), ["bandwidth", "25Gbit"]),
        (lambda: parse_bandwidth("0Gbit"), ["bandwidth", "> 0"]),
        (lambda: parse_latency("20"), ["latency", "no unit", "20us"]),
        (lambda: parse_latency("20 parsecs"), ["latency", "20us"]),
        (lambda: parse_count("lots"), ["params", "1.3e9"]),
        (lambda: parse_count("0"), ["params", ">= 1"]),
        (lambda: parse_count("1e400"), ["params", "finite"]),
        (lambda: parse_bandwidth("1e400Gbit"), ["bandwidth", "finite"]),
        (lambda: parse_latency("1e400s"), ["latency", "finite", "20us"]),
        (lambda: plan(1e8, 0, GBIT_25), ["world_size", ">= 1"]),
        (lambda: plan(1e8, 8.0, GBIT_25), ["world_size", "integer"]),
        (lambda: plan(1e8, 8, 0.0), ["bandwidth", "parse_bandwidth"]),
        (lambda: plan(1e8, 8, GBIT_25, latency=-1.0), ["latency", ">= 0"]),
        (lambda: plan(1e8, 8, GBIT_25, densities=(1.0, 0.0)), ["densities", "0.01"]),
        (lambda: plan(1e8, 8, GBIT_25, densities=(1.5,)), ["densities", "0.01"]),
        (lambda: plan(0, 8, GBIT_25), ["params", ">= 1"]),
        (lambda: plan(1e8, 8, GBIT_25, bucket_cap_mb=0), ["bucket_cap_mb", "25"]),
        (lambda: crossover_density(1), ["world_size", ">= 2"]),
        (lambda: crossover_density(8, latency=1e-5), ["latency", "bandwidth"]),
        (lambda: comm_time(1.0, 0.0), ["bandwidth", "25Gbit"]),
    ],
)
def test_bad_input_raises_value_error_naming_argument_and_fix(call, words):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    missing = [word for word in words if word not in message]
    assert not missing, f"error message {message!r} lacks {missing}"


def test_format_plan_marks_crossover_and_recommends():
    text = format_plan(1.3e9, 64, GBIT_25, latency=20e-6)
    assert "1.56% = 1/W" in text
    assert "above crossover" in text  # TopK 10% at W=64
    assert "Recommendation: Use TopK(density=0.001)" in text


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "sparsecomm.plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_worked_example():
    result = run_cli("--params", "1e8", "--world-size", "8", "--bandwidth", "25Gbit")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    dense_line = next(line for line in out.splitlines() if line.startswith("| Dense fp32"))
    assert "700 MB" in dense_line and "224 ms" in dense_line, dense_line
    assert "12.5% = 1/W" in out
    assert "Recommendation: Use TopK(density=0.001)" in out  # 1.79 ms of communication
    assert "| compress |" not in out  # no step model asked for: the old table


def test_cli_no_time_crossover_when_latency_outweighs_every_byte():
    # 100 parameters, 1 ms a message: the dense all-reduce's 14 latency terms cost more than
    # any density's 7 all-gather terms and bytes, so there is no crossover to print.
    result = run_cli("--params", "100", "--world-size", "8", "--bandwidth", "25Gbit",
                     "--latency", "1ms")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "none: at every density the all-gather of the pairs takes less time" in (result.stdout)
    assert "e+05%" not in result.stdout


def test_cli_large_model_with_latency():
    result = run_cli(
        "--params", "1.3e9", "--world-size", "64", "--bandwidth", "25Gbit", "--latency", "20us"
    )
    assert result.returncode == 0, result.stderr
    # 1.3e9 fp32 is 4959 MiB: 16 sparse buckets of 309.944 MiB, not 50 of 100.
    assert "199 bucket(s) of <= 25 MiB (Dense, Cast), 16 of <= 309.944 MiB (TopK, Threshold)" in (
        result.stdout
    )
    # 63 * 16 all-gather terms against 2 * 63 * 199 all-reduce terms.
    assert "the all-gathers pay 1008 latency terms, the all-reduces 25074" in result.stdout
    assert "1.56% = 1/W" in result.stdout
    one_size = run_cli(
        "--params", "1.3e9", "--world-size", "64", "--bandwidth", "25Gbit",
        "--bucket-cap-mb", "25",
    )  # fmt: skip
    assert "199 bucket(s) of <= 25 MiB\n" in one_size.stdout
    assert "(TopK, Threshold)" not in one_size.stdout
    no_cap = run_cli("--params", "1.3e9", "--world-size", "64", "--bandwidth", "25Gbit",
                     "--bucket-cap-mb", "inf")  # fmt: skip
    assert no_cap.returncode == 0, no_cap.stderr
    assert "1 bucket(s) of <= inf MiB" in no_cap.stdout
    dense_line = next(
        line for line in result.stdout.splitlines() if line.startswith("| Dense fp32")
    )
    assert "3.78 s" in dense_line, dense_line  # 3.77748 s, computed above


@pytest.mark.parametrize(
    "args, words",
    [
        (["--bandwidth", "25"], ["bandwidth", "no unit", "25Gbit"]),
        (["--bandwidth", "25Gbit", "--latency", "20"], ["latency", "20us"]),
        (["--bandwidth", "25Gbit", "--densities", "1%"], ["densities", "0.001"]),
        (
            ["--bandwidth", "25Gbit", "--measure", "--measure-max-elements", "0.5"],
            ["--measure-max-elements", ">= 1"],
        ),
    ],
)
def test_cli_bad_input_exits_2_with_the_fix(args, words):
    result = run_cli("--params", "1e8", "--world-size", "8", *args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    missing = [word for word in words if word not in result.stderr]
    assert not missing, f"stderr {result.stderr!r} lacks {missing}"


# --------------------------------------------------------------------------- the step model


def test_step_model_adds_compute_compression_and_exposed_communication():
    # n=1e6, W=4, 1 GB/s, no latency; compute 50 ms; topk 10 ns/element, cast 2 ns; overlap 0.
    rows = rows_by_name(
        plan(
            1e6,
            4,
            1e9,
            densities=(0.01,),
            compress_ns_per_element={"topk": 10, "cast": 2},
            compute_seconds=0.05,
            backward_seconds=0.03,
            overlap=0.0,
        )
    )
    # Dense: 6e6 B -> 6 ms, nothing to compress: 50 + 6 = 56 ms.
    assert rows["Dense fp32"].compress_s == 0
    assert rows["Dense fp32"].step_s == pytest.approx(0.056, rel=1e-12)
    # Cast bf16: 3e6 B -> 3 ms; 2e-9 s * 1e6 = 2 ms: 50 + 2 + 3 = 55 ms.
    assert rows["Cast bf16"].compress_s == pytest.approx(2e-3, rel=1e-12)
    assert rows["Cast bf16"].step_s == pytest.approx(0.055, rel=1e-12)
    # TopK 1%: 2.4e5 B -> 0.24 ms; 10 ms compressing: 60.24 ms.
    assert rows["TopK 1%"].step_s == pytest.approx(0.06024, rel=1e-12)
    # Threshold is not in the mapping: costs nothing; 240024 B -> 50.240024 ms: the fastest.
    assert rows["Threshold 1%"].step_s == pytest.approx(0.050240024, rel=1e-12)
    assert pick(list(rows.values())).name == "Threshold 1%"
    # time_s and speedup stay the communication figures.
    assert rows["Dense fp32"].time_s == pytest.approx(6e-3, rel=1e-12)
    assert rows["Cast bf16"].speedup == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize(
    "overlap, backward, cap_mb, exposed",
    [
        # 1e6 fp32 in 1 MiB buckets of 262144: 3 full, then 213568 (21.3568%) sent last.
        (1.0, 0.004, 1, 0.002),  # 6 ms of communication, 4 ms hidden
        (0.5, 0.004, 1, 0.004),  # half of 4 ms hidden
        (1.0, 0.03, 1, 0.006 * 0.213568),  # all but the last bucket's share hidden
        (0.0, 0.03, 1, 0.006),  # an exchange after backward hides nothing
        (1.0, 0.03, 25, 0.006),  # one bucket: sent when backward ends, nothing hides
    ],
)
def test_overlap_hides_communication_up_to_backward(overlap, backward, cap_mb, exposed):
    (dense, *_) = plan(
        1e6,
        4,
        1e9,
        bucket_cap_mb=cap_mb,
        compute_seconds=0.05,
        backward_seconds=backward,
        overlap=overlap,
    )
    assert dense.exposed_s == pytest.approx(exposed, rel=1e-12)
    assert dense.step_s == pytest.approx(0.05 + exposed, rel=1e-12)


def test_compression_cost_decides_between_links():
    # 1.44e7 parameters on 2 ranks; compute 0.6 s; topk 10 ns/element, cast 3 ns.
    model = dict(
        densities=(0.01, 0.001),
        compress_ns_per_element={"topk": 10.0, "cast": 3.0, "threshold": 4.0},
        compute_seconds=0.6,
    )
    # 1.2 GB/s per rank: Dense 2 * 1/2 * 4 * 1.44e7 / 1.2e9 = 48 ms; Cast 24 + 43.2 ms;
    # TopK 1% 0.96 + 144 ms: compression costs more than it saves.
    fast = plan(1.44e7, 2, 1.2e9, **model)
    assert pick(fast).name == "Dense fp32"
    assert recommend(fast, 2).startswith("Use Dense() (or plain DistributedDataParallel)")
    # 150 Mbit/s per rank (1.875e7 B/s): Dense 3.07 s; Threshold 0.1%: 1.44e4 pairs * 8 B
    # + an 8-byte count for its one bucket (100 MiB: 26214400 fp32) = 115208 B -> 6.14 ms,
    # + 57.6 ms: the fastest; TopK 0.1% 6.14 + 144 ms.
    slow = plan(1.44e7, 2, 1.875e7, **model)
    best = pick(slow)
    assert best.name == "Threshold 0.1%"
    assert best.step_s == pytest.approx(0.6 + 0.0576 + 115208 / 1.875e7, rel=1e-12)
    assert rows_by_name(slow)["TopK 0.1%"].step_s == pytest.approx(
        0.6 + 0.144 + 115200 / 1.875e7, rel=1e-12
    )


def test_ties_go_to_the_less_aggressive_compressor():
    rows = plan(1e6, 4, 1e9, densities=(0.1, 0.01))
    # fp16 and bf16 move the same bytes; bf16 is named (no overflow to fear).
    tied = [r for r in rows if r.name.startswith("Cast")]
    assert pick(tied).name == "Cast bf16"
    # Everything but the last bucket hidden behind backward: Dense's 1.3 ms of 6 ms is left,
    # less than a compressor that costs 2 ns per element (2 ms); Dense wins.
    hidden = plan(
        1e6,
        4,
        1e9,
        bucket_cap_mb=1,
        compress_ns_per_element=2.0,
        compute_seconds=1.0,
        backward_seconds=0.5,
    )
    assert pick(hidden).name == "Dense fp32"


def test_a_gentler_density_within_ten_percent_is_named():
    # compute 1 s dominates: TopK 0.1% and 1% differ by (7e5 - 7e4) B... both within 10%.
    rows = plan(1e7, 8, 1e9, densities=(0.01, 0.001), compute_seconds=1.0)
    text = recommend(rows, 8)
    assert text.startswith("Use TopK(density=0.001)")
    assert "TopK(density=0.01) is within" in text and "10x more" in text


def test_parse_compress_costs():
    assert parse_compress_costs("4.5") == 4.5
    assert parse_compress_costs("topk=9, Cast=1.5,threshold=3") == {
        "topk": 9.0,
        "cast": 1.5,
        "threshold": 3.0,
    }
    # A single number applies to every compressor but Dense; a kind maps to its rows.
    rows = rows_by_name(plan(1e6, 4, 1e9, compress_ns_per_element=4.0))
    assert rows["Dense fp32"].compress_s == 0
    assert rows["TopK 1%"].compress_s == pytest.approx(4e-3, rel=1e-12)
    rows = rows_by_name(plan(1e6, 4, 1e9, compress_ns_per_element={"fp16": 1, "cast": 2}))
    assert rows["Cast fp16"].compress_s == pytest.approx(1e-3, rel=1e-12)
    assert rows["Cast bf16"].compress_s == pytest.approx(2e-3, rel=1e-12)
    rows = rows_by_name(plan(1e6, 4, 1e9, compress_ns_per_element={"TopK 1%": 7, "topk": 1}))
    assert rows["TopK 1%"].compress_s == pytest.approx(7e-3, rel=1e-12)
    assert rows["TopK 0.1%"].compress_s == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: plan(1e6, 4, 1e9, overlap=1.5), ["overlap", "[0, 1]"]),
        (lambda: plan(1e6, 4, 1e9, backward_seconds=0.1), ["backward_seconds", "compute"]),
        (lambda: plan(1e6, 4, 1e9, compute_seconds=-1.0), ["compute_seconds", ">= 0"]),
        (lambda: plan(1e6, 4, 1e9, host_bandwidth=0.0), ["host_bandwidth", "8Gbit"]),
        (lambda: plan(1e6, 4, 1e9, compress_ns_per_element=-1.0), ["compress", ">= 0"]),
        (lambda: plan(1e6, 4, 1e9, compress_ns_per_element={"topk": -1}), ["TopK", ">= 0"]),
        (lambda: plan(1e6, 4, 1e9, threshold_densities=(2.0,)), ["densities", "0.01"]),
        (lambda: parse_compress_costs("fast"), ["compress", "topk=9"]),
        (lambda: parse_compress_costs("gpu=3"), ["kinds", "threshold"]),
        (lambda: parse_compress_costs("topk=-2"), [">= 0"]),
    ],
)
def test_step_model_bad_input_raises_value_error(call, words):
    with pytest.raises(ValueError) as info:
        call()
    missing = [word for word in words if word not in str(info.value)]
    assert not missing, f"error message {info.value!s} lacks {missing}"


@pytest.mark.parametrize("cap", [0.5, (0.25, 1.0), float("inf")])
def test_measure_compress_costs_times_every_row(cap):
    # One size for every row, a size for the dense rows and one for the sparse rows (the
    # gradient split both ways), and no cap.
    costs = measure_compress_costs(3e5, densities=(0.01,), repeats=1, bucket_cap_mb=cap)
    assert list(costs) == ["Dense fp32", "Cast fp16", "Cast bf16", "TopK 1%", "Threshold 1%"]
    assert all(ns >= 0 for ns in costs.values()), costs
    assert costs["TopK 1%"] > costs["Dense fp32"], costs  # Dense compresses nothing


def test_measure_compress_costs_half_values_times_bfloat16_topk(monkeypatch):
    """``--half-values`` prices 6-byte pairs, so its measured TopK rows must round their
    values to bfloat16 as ``TopK(value_dtype=torch.bfloat16)`` does."""
    import torch

    from sparsecomm import compressors

    made = []

    class Recording(compressors.TopK):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.value_dtype)

    monkeypatch.setattr(compressors, "TopK", Recording)
    costs = measure_compress_costs(1e5, densities=(0.01, 0.1), repeats=1, half_values=True)
    assert made == [torch.bfloat16, torch.bfloat16]
    assert "TopK 10%" in costs and costs["TopK 10%"] > 0


def test_bucket_sizes_follow_the_library():
    import torch

    import sparsecomm
    from sparsecomm.plan import (
        DEFAULT_BUCKET_CAP_MB,
        SPARSE_BUCKET_CAP_MB,
        SPARSE_MAX_BUCKETS,
        bucket_caps,
    )

    assert bucket_caps() == (DEFAULT_BUCKET_CAP_MB, SPARSE_BUCKET_CAP_MB) == (25.0, 100.0)
    assert bucket_caps(50) == (50, 50) and bucket_caps((25, 200)) == (25, 200)
    # Over 16 sparse buckets of 100 MiB (~420M elements) the sparse ones grow, as the
    # library's do: a 1e9-element model in 16 buckets of 238 MiB, not 39 of 100.
    assert bucket_caps(None, 4e8) == (25.0, 100.0)
    assert bucket_caps(None, 1e9) == (25.0, (62_500_000 + 0.5) * 4 / 2**20)
    for n in (1e9, 1.3e9, 1.234567e9, 6.7e9 + 1, 4.2e8):  # never a 17th sliver
        assert num_buckets(n, bucket_caps(None, n)[1]) == 16, n
    for dense in (sparsecomm.Dense(), sparsecomm.Cast(torch.bfloat16)):
        assert dense.default_bucket_cap_mb == DEFAULT_BUCKET_CAP_MB
    for sparse in (sparsecomm.TopK(0.01), sparsecomm.Threshold(1e-3)):
        assert sparse.default_bucket_cap_mb == SPARSE_BUCKET_CAP_MB
        assert sparse.default_max_buckets == SPARSE_MAX_BUCKETS
    # No cap: one bucket, all of it sent when backward ends.
    assert num_buckets(1e9, float("inf")) == 1
    assert last_bucket_share(1e9, float("inf")) == 1.0
    rows = rows_by_name(plan(1e9, 8, GBIT_25, latency=1e-5, bucket_cap_mb=float("inf")))
    assert rows["TopK 1%"].latency_terms == 7 and rows["Dense fp32"].latency_terms == 14


def test_time_crossover_is_never_below_zero():
    # 1000 all-gathers against one all-reduce: the all-gathers' latency alone costs more.
    assert crossover_density(8, n=1e6, bandwidth=1e9, latency=1e-3, buckets=1,
                             sparse_buckets=1000) == 0.0  # fmt: skip


def test_cli_step_model():
    result = run_cli(
        "--params", "14.4M", "--world-size", "2", "--bandwidth", "150Mbit",
        "--densities", "0.01,0.001", "--compute-seconds", "600ms",
        "--compress-ns-per-element", "topk=10,cast=3,threshold=4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| compress |     step |" in result.stdout
    assert "step = compute 600 ms" in result.stdout
    # As computed above (test_compression_cost_decides_between_links).
    assert "Recommendation: Use Threshold(t) (t giving 0.1%) with error_feedback" in result.stdout


def test_cli_overlap_and_host_bandwidth():
    # The 1gbit row of the after-redesign run, without the measured costs: 14.4M fp32 on 2
    # ranks at 0.5 Gbit/s per rank, compute 421 ms of which backward 211 ms, overlap 0.61, the
    # unshaped loopback's 8.12 Gbit/s per rank as the host bandwidth.
    result = run_cli(
        "--params", "14417920", "--world-size", "2", "--bandwidth", "500Mbit",
        "--densities", "0.01", "--compute-seconds", "421ms", "--backward-seconds", "211ms",
        "--overlap", "0.61", "--host-bandwidth", "8.12Gbit",
        "--compress-ns-per-element", "topk=2.3,cast=2.5,threshold=1.4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "+ bytes / host 8.12 Gbit/s +" in result.stdout
    assert "not hidden behind 0.61 x backward 211 ms" in result.stdout
    # Dense: 57.7 MB -> 923 ms on the link, 129 ms of it hidden, 56.8 ms of host time.
    line = next(row for row in result.stdout.splitlines() if row.startswith("| Dense fp32"))
    step = 0.421 + 57671680 / 1.015e9 + 57671680 / 6.25e7 - 0.61 * 0.211
    assert f"{step:.3g} s" in line, (line, step)


def test_cli_measure():
    result = run_cli(
        "--params", "2e5", "--world-size", "2", "--bandwidth", "1Gbit", "--measure",
        "--densities", "0.01", "--compress-ns-per-element", "threshold=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Measured here (compress + aggregate, 2e+05 elements" in result.stdout
    line = next(row for row in result.stdout.splitlines() if row.startswith("| Threshold 1%"))
    compress_cell = line.split("|")[5]
    assert compress_cell.strip() == "0 us", line  # the given value overrides the measured one


@pytest.mark.parametrize(
    "args, words",
    [
        (["--compute-seconds", "0.5"], ["--compute-seconds", "0.8s"]),
        (["--compress-ns-per-element", "lots"], ["compress", "topk=9"]),
        (["--overlap", "2"], ["overlap", "[0, 1]"]),
        (["--host-bandwidth", "8"], ["bandwidth", "no unit"]),
    ],
)
def test_cli_step_model_bad_input_exits_2(args, words):
    result = run_cli("--params", "1e8", "--world-size", "8", "--bandwidth", "25Gbit", *args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    missing = [word for word in words if word not in result.stderr]
    assert not missing, f"stderr {result.stderr!r} lacks {missing}"


# --------------------------------------------------------------------------- measured rows
# benchmarks/RESULTS.md, "Training step over a shaped link, CPU (2026-12-03): before the
# exchange redesign": benchmarks/bench_network.py, 14417920 parameters on 2 gloo ranks,
# loopback shaped with tc; sparsecomm as committed at 0357e72 (exchange after backward:
# overlap 0, and no host bandwidth, as the planner had then). Per rate: per-rank bandwidth
# (measured through-lo rate / 2), the 1-float all-reduce (s), the `none` row's step (s), the
# compress + aggregate cost per element of each row from its profiled steps (ns), and each
# row's measured median step (s).
MEASURED = {
    "unshaped": (
        864926414.7,
        4.928e-4,
        0.4496,
        {"Dense fp32": 0.303, "Cast bf16": 9.935, "Threshold 1.02%": 8.228,
         "TopK 1%": 51.338, "TopK 0.1%": 36.913},
        {"Dense fp32": 0.5834, "Cast bf16": 0.6912, "Threshold 1.02%": 0.7377,
         "TopK 1%": 1.2863, "TopK 0.1%": 1.1008},
    ),
    "1gbit": (
        61416277.5,
        7.773e-4,
        0.4933,
        {"Dense fp32": 0.228, "Cast bf16": 10.923, "Threshold 1.02%": 9.041,
         "TopK 1%": 53.671, "TopK 0.1%": 43.11},
        {"Dense fp32": 1.462, "Cast bf16": 1.1211, "Threshold 1.02%": 0.8135,
         "TopK 1%": 1.3717, "TopK 0.1%": 1.2637},
    ),
    "300mbit": (
        18835871.7,
        2.120e-4,
        0.4136,
        {"Dense fp32": 0.3, "Cast bf16": 9.091, "Threshold 1.02%": 5.656,
         "TopK 1%": 48.056, "TopK 0.1%": 37.98},
        {"Dense fp32": 3.6444, "Cast bf16": 2.162, "Threshold 1.02%": 0.7428,
         "TopK 1%": 1.3872, "TopK 0.1%": 1.1296},
    ),
}  # fmt: skip


@pytest.mark.parametrize("rate", list(MEASURED))
def test_planner_picks_the_measured_fastest_row(rate):
    bandwidth, small_allreduce, compute, costs, measured = MEASURED[rate]
    rows = plan(
        14417920,
        2,
        bandwidth,
        latency=small_allreduce / 2,  # 2 (W-1) latency terms in one all-reduce
        densities=(0.01, 0.001),
        threshold_densities=(0.0102,),
        compress_ns_per_element=costs,
        compute_seconds=compute,
        overlap=0.0,
    )
    candidates = [r for r in rows if r.name in measured]
    assert len(candidates) == len(measured)
    fastest = min(measured, key=measured.get)
    assert pick(candidates).name == fastest
    # Dense() on the unshaped link, Threshold(t) on 1gbit and 300mbit.
    assert fastest == ("Dense fp32" if rate == "unshaped" else "Threshold 1.02%")


# --------------------------------------------------------------------------- after the redesign
# benchmarks/RESULTS.md, "Training step over a shaped link, CPU, after the exchange redesign"
# (tests/data/network_after_redesign.json): the same command and model on sparsecomm at
# e751649, which sends each bucket during backward. Per rate: per-rank bandwidth (measured
# through-lo rate / 2), the 1-float all-reduce (s), the `none` row's step and backward (s),
# each row's compress + aggregate cost per element from its profiled steps (ns), and each
# row's measured step (median, p20, p80; s). The unshaped loopback's per-rank rate is the
# host bandwidth.
AFTER = {
    "unshaped": (
        1014948346.5, 0.0002205, 0.3936, 0.2288,
        {"Dense fp32": 0.623, "Cast bf16": 2.247, "Threshold 1.02%": 1.298,
         "TopK 1%": 2.372, "TopK 0.1%": 1.693},
        {"Dense fp32": (0.5028, 0.4880, 0.5424), "Cast bf16": (0.4383, 0.4367, 0.4414),
         "Threshold 1.02%": (0.4573, 0.3956, 0.5354), "TopK 1%": (0.5111, 0.4878, 0.5233),
         "TopK 0.1%": (0.4874, 0.4580, 0.5218)},
    ),
    "1gbit": (
        62508108.9, 0.0003182, 0.4210, 0.2107,
        {"Dense fp32": 0.353, "Cast bf16": 2.508, "Threshold 1.02%": 1.409,
         "TopK 1%": 2.280, "TopK 0.1%": 1.960},
        {"Dense fp32": (1.2567, 1.2398, 1.2824), "Cast bf16": (0.8422, 0.8120, 0.8627),
         "Threshold 1.02%": (0.4747, 0.4507, 0.4969), "TopK 1%": (0.4524, 0.4392, 0.4704),
         "TopK 0.1%": (0.5302, 0.5274, 0.5466)},
    ),
    "300mbit": (
        18842092.6, 0.0004231, 0.4098, 0.2186,
        {"Dense fp32": 0.294, "Cast bf16": 2.546, "Threshold 1.02%": 1.488,
         "TopK 1%": 2.245, "TopK 0.1%": 2.073},
        {"Dense fp32": (3.3707, 3.3559, 3.4224), "Cast bf16": (1.8934, 1.8558, 1.9006),
         "Threshold 1.02%": (0.4891, 0.4583, 0.5078), "TopK 1%": (0.4786, 0.4598, 0.4844),
         "TopK 0.1%": (0.4911, 0.4703, 0.5165)},
    ),
}  # fmt: skip
AFTER_HOST_BANDWIDTH = AFTER["unshaped"][0]
# What planner_check fits to these rows (the Dense and Cast rows at 1gbit and 300mbit, whose
# communication outlasts backward): 0.614.
AFTER_OVERLAP = 0.61


def _bench_network():
    spec = importlib.util.spec_from_file_location(
        "bench_network_for_plan", REPO / "benchmarks" / "bench_network.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_after(rate, overlap=AFTER_OVERLAP, host_bandwidth=AFTER_HOST_BANDWIDTH, **changes):
    bandwidth, small_allreduce, compute, backward, costs, measured = AFTER[rate]
    model = dict(
        latency=small_allreduce / 2,  # 2 (W-1) latency terms in one all-reduce
        densities=(0.01, 0.001),
        threshold_densities=(0.0102,),
        compress_ns_per_element=costs,
        compute_seconds=compute,
        backward_seconds=backward,
        overlap=overlap,
        host_bandwidth=host_bandwidth,
        bucket_cap_mb=25.0,  # what those runs used for every row
    )
    model.update(changes)
    rows = plan(14417920, 2, bandwidth, **model)
    return [r for r in rows if r.name in measured]


def steps(rate):
    return {
        name: dict(zip(("median", "p20", "p80"), figures))
        for name, figures in AFTER[rate][5].items()
    }


def fastest_of(rate):
    measured = steps(rate)
    return measured[min(measured, key=lambda name: measured[name]["median"])]


def agrees_at(rate, name):
    """bench_network.agrees: the pick is the fastest row, or its p20-p80 overlaps it."""
    return _bench_network().agrees(steps(rate)[name], fastest_of(rate))


@pytest.mark.parametrize("rate", list(AFTER))
def test_planner_agrees_with_the_measured_fastest_after_the_redesign(rate):
    pick_name = pick(plan_after(rate)).name
    assert agrees_at(rate, pick_name), (rate, pick_name)
    # Threshold(t) at all three, 2-5% above the fastest median (Cast bf16 unshaped, TopK 1%
    # on both shaped rates): inside the run's noise, which cannot order these rows.
    assert pick_name == "Threshold 1.02%"
    gap = steps(rate)[pick_name]["median"] / fastest_of(rate)["median"] - 1
    assert 0 <= gap < 0.05, gap


@pytest.mark.parametrize("overlap", [0.25, 0.4, 0.6, 0.8, 1.0])
def test_the_agreement_does_not_hang_on_the_fitted_overlap(overlap):
    for rate in AFTER:
        pick_name = pick(plan_after(rate, overlap=overlap)).name
        assert agrees_at(rate, pick_name), (rate, overlap, pick_name)


def test_each_part_of_the_model_is_needed_on_these_rows():
    # Without overlap (the old model) the planner picks TopK 0.1% at 1gbit: 530 ms
    # [527-547], clear of the fastest TopK 1%'s 452 [439-470].
    assert pick(plan_after("1gbit", overlap=0.0, host_bandwidth=None)).name == "TopK 0.1%"
    assert not agrees_at("1gbit", "TopK 0.1%")
    # Without the host's cost of moving bytes, overlap hides Dense's 57 ms on the unshaped
    # link and the planner picks Dense (503 ms [488-542], against Cast bf16's 438 [437-441]).
    assert pick(plan_after("unshaped", host_bandwidth=None)).name == "Dense fp32"
    assert not agrees_at("unshaped", "Dense fp32")


def test_the_agreement_rule():
    bench = _bench_network()
    fastest = {"median": 1.0, "p20": 0.9, "p80": 1.1}
    assert bench.agrees(fastest, fastest)
    assert bench.agrees({"median": 1.3, "p20": 1.1, "p80": 1.4}, fastest)  # ranges touch
    assert not bench.agrees({"median": 1.3, "p20": 1.11, "p80": 1.4}, fastest)


@pytest.mark.parametrize("rate", ["1gbit", "300mbit"])
def test_dense_and_cast_steps_are_modelled_within_5_percent_on_the_shaped_links(rate):
    # The rows the overlap is fitted to; the sparse rows' steps are 20-80 ms above their
    # model (time the profile does not attribute), which moves them all alike.
    rows = rows_by_name(plan_after(rate))
    for name in ("Dense fp32", "Cast bf16"):
        measured = steps(rate)[name]["median"]
        assert rows[name].step_s == pytest.approx(measured, rel=0.05), name


def test_planner_check_fits_the_overlap_and_reads_the_host_bandwidth():
    bench = _bench_network()
    # That run's results.json, kept beside the tests (docs/network/ holds the latest run).
    results = json.loads((REPO / "tests" / "data" / "network_after_redesign.json").read_text())
    check = bench.planner_check(results)
    assert check["overlap"] == pytest.approx(AFTER_OVERLAP, abs=0.01)
    assert check["host_bandwidth"] == pytest.approx(AFTER_HOST_BANDWIDTH, rel=1e-9)
    assert [item["agree"] for item in check["rates"]] == ["yes"] * 3
    assert [item["recommended"] for item in check["rates"]] == ["Threshold(t)"] * 3
    assert "p20-p80" in check["how"] and "pick p20 <= fastest p80" in check["how"]


@pytest.mark.parametrize(
    "run",
    [
        "network_rounds_1647.json",
        "network_rounds_1719.json",
        "network_rounds_1729.json",
        "network_rounds_1836.json",
    ],
)
def test_planner_picks_the_fastest_on_runs_it_was_not_fitted_to(run):
    """Later runs of bench_network.py with the rows taking turns (--rounds 3; per-rank
    data stripped), after the planner was fitted to the run above: at every rate its pick
    is the measured fastest sparsecomm row or within that row's p20-p80 range."""
    bench = _bench_network()
    results = json.loads((REPO / "tests" / "data" / run).read_text())
    check = bench.planner_check(results)
    assert [item["rate"] for item in check["rates"]] == ["unshaped", "1gbit", "300mbit"]
    for item in check["rates"]:
        assert item["agree"] == "yes", item
        assert item["recommended"] in ("TopK(0.001)", "TopK(0.01)", "Threshold(t)"), item


# --------------------------------------------------------------------------- model properties

PROPERTY_CASES = [
    # params, W, latency, costs (ns/element), compute, backward, overlap, host bandwidth
    (14417920, 2, 2e-4, {"cast": 2.5, "topk": 2.3, "threshold": 1.4}, 0.4, 0.22, 0.6, 8e9),
    (1.3e9, 64, 2e-5, {"cast": 0.1, "topk": 0.5, "threshold": 0.3}, 2.0, 1.3, 1.0, None),
    (1e8, 8, 0.0, 4.0, 0.5, 0.3, 0.3, None),
    (1e6, 4, 1e-5, {"topk": 10, "threshold": 8, "cast": 2}, 0.05, 0.03, 0.0, 2e9),
]
BANDWIDTHS = [1e6 * 1.5**i for i in range(40)]  # 1 MB/s to 7 GB/s per rank


def _plan_case(case, **changes):
    params, world_size, latency, costs, compute, backward, overlap, host = case
    model = dict(
        latency=latency,
        densities=(0.1, 0.01, 0.001),
        compress_ns_per_element=costs,
        compute_seconds=compute,
        backward_seconds=backward,
        overlap=overlap,
        host_bandwidth=host,
    )
    bandwidth = changes.pop("bandwidth", 1e8)
    model.update(changes)
    return plan(params, world_size, bandwidth, **model)


@pytest.mark.parametrize("case", PROPERTY_CASES)
def test_more_bandwidth_never_slows_a_row_nor_unpicks_dense(case):
    previous = None
    dense_picked = False
    for bandwidth in BANDWIDTHS:
        rows = _plan_case(case, bandwidth=bandwidth)
        if previous is not None:
            for before, now in zip(previous, rows):
                assert now.step_s <= before.step_s * (1 + 1e-12), (now.name, bandwidth)
        best = pick(rows)
        if dense_picked:
            # Dense moves the most bytes, so its step falls fastest as the link speeds up.
            assert best.name == "Dense fp32", (bandwidth, best.name)
        dense_picked = best.name == "Dense fp32"
        previous = rows
    assert dense_picked, "the sweep should reach a link fast enough for Dense"


@pytest.mark.parametrize("case", PROPERTY_CASES)
def test_more_overlap_backward_or_host_bandwidth_never_slows_a_row(case):
    for field, values in (
        ("overlap", [0.0, 0.1, 0.3, 0.6, 1.0]),
        ("backward_seconds", [case[4] * f for f in (0.0, 0.1, 0.25, 0.5, 1.0)]),
        ("host_bandwidth", [1e7, 1e8, 1e9, 1e10, None]),
    ):
        previous = None
        for value in values:
            rows = _plan_case(case, **{field: value})
            if previous is not None:
                for before, now in zip(previous, rows):
                    assert now.step_s <= before.step_s * (1 + 1e-12), (field, value, now.name)
            previous = rows


@pytest.mark.parametrize("case", PROPERTY_CASES)
def test_overlap_hides_at_most_all_but_the_last_bucket(case):
    params = case[0]
    share = last_bucket_share(params)
    no_overlap = _plan_case(case, overlap=0.0)
    for overlapped, alone in zip(_plan_case(case), no_overlap):
        floor = overlapped.step_s - overlapped.exposed_s
        assert floor == pytest.approx(case[4] + overlapped.compress_s + overlapped.host_s)
        # Never below the last bucket's share of the communication, never above it all.
        assert overlapped.exposed_s >= share * overlapped.time_s * (1 - 1e-12) - 1e-15
        assert overlapped.exposed_s <= overlapped.time_s
        assert alone.exposed_s == alone.time_s
        assert overlapped.step_s <= alone.step_s


def test_last_bucket_share():
    assert last_bucket_share(14417920) == pytest.approx(1310720 / 14417920, rel=1e-15)
    assert last_bucket_share(6553600) == 1.0  # one bucket: all of it is sent last
    assert last_bucket_share(2 * 6553600) == 0.5
    assert last_bucket_share(1e6, bucket_cap_mb=1) == pytest.approx(0.213568, rel=1e-12)


def test_the_planner_check_models_a_run_with_its_own_bucket_sizes():
    bench = _bench_network()
    assert bench._bucket_cap({"config": {"bucket_caps": [25.0, 100.0]}}) == (25.0, 100.0)
    assert bench._bucket_cap({"config": {"bucket_cap_mb": 25.0}}) == 25.0  # older runs
    assert bench._bucket_cap({"config": {}}) is None
    # what main() stores as a run's bucket_caps
    assert bucket_caps(None) == (25.0, 100.0) and bucket_caps(7.0) == (7.0, 7.0)
