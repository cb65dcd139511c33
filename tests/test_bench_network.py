"""benchmarks/bench_network.py: its flag parsing and report (pure Python), its one-line refusals
without root or tools, and an end-to-end smoke run on a shaped loopback (two ranks, 200mbit, a
tiny model, three rows) whose measured link bandwidth must be within 25% of the set rate.

The end-to-end tests need root, ``unshare`` (util-linux) and ``tc``/``ip`` (iproute2) with the
tbf qdisc; without them they are skipped, and the skip says which is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_network.py"
SMOKE_RATE = "200mbit"
SMOKE_BYTES_PER_S = 200e6 / 8

_spec = importlib.util.spec_from_file_location("bench_network", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = [
    "--width=32",
    "--layers=1",
    "--heads=2",
    "--context=32",
    "--batch-size=4",
    "--text-bytes=200000",
]


def run_bench(*flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def needs_shaping() -> None:
    missing = bench.missing_prerequisite()
    if missing:
        pytest.skip(f"cannot shape a private loopback here: {missing}")


# --------------------------------------------------------------------------- pure parts


def test_parse_rows_accepts_the_issue_spellings_in_order():
    rows = bench.parse_rows(
        "none, ddp,ddp+fp16,DDP+bf16,ddp+powersgd,dense,Cast(torch.bfloat16),threshold,"
        "Threshold(0.002),TopK(0.01),topk(1e-3),ddp+sc-TopK(0.01),TopK(0.01)"
    )
    assert rows == [
        "none",
        "ddp",
        "ddp+fp16",
        "ddp+bf16",
        "ddp+powersgd",
        "Dense()",
        "Cast(bf16)",
        "Threshold(t)",
        "Threshold(0.002)",
        "TopK(0.01)",
        "TopK(0.001)",
        "ddp+sc-TopK(0.01)",
    ]
    assert bench.parse_rows(bench.DEFAULT_ROWS)[-1] == "ddp+sc-TopK(0.01)"
    assert bench.parse_rows("topk(1e-2)/local-updates, Dense()/updates, TopK(0.01)") == [
        "TopK(0.01)/local_updates",
        "Dense()/updates",
        "TopK(0.01)",
    ]
    # A bucket cap of its own: two bucket sizes side by side.
    assert bench.parse_rows("TopK(0.01), topk(0.01)@25, TopK(0.01)/updates@12.5, ddp@100") == [
        "TopK(0.01)",
        "TopK(0.01)@25",
        "TopK(0.01)/updates@12.5",
        "ddp@100",
    ]
    assert bench.split_cap("TopK(0.01)/updates@12.5") == ("TopK(0.01)/updates", 12.5)
    assert bench.split_cap("ddp") == ("ddp", None)


@pytest.mark.parametrize(
    "text, words",
    [
        ("fast", ["fast", "TopK(D)"]),
        ("TopK(2)", ["(0, 1]"]),
        ("TopK(0.01)/sideways", ["sideways", "local_updates", "TopK(0.01)/local_updates"]),
        ("ddp+fp16/updates", ["ddp+fp16/updates", "sparsecomm row"]),
        ("none/local_updates", ["none/local_updates", "sparsecomm row"]),
        ("TopK(0.01)@big", ["TopK(0.01)@big", "MiB", "TopK(0.01)@25"]),
        ("none@25", ["none@25", "DDP or sparsecomm row"]),
    ],
)
def test_parse_rows_refuses_with_the_fix(text, words):
    with pytest.raises(ValueError) as info:
        bench.parse_rows(text)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_parse_rate_in_tc_units():
    assert bench.parse_rate("unshaped") == ("unshaped", 0.0)
    assert bench.parse_rate("300mbit") == ("300mbit", 300e6 / 8)
    assert bench.parse_rate("10Gbit") == ("10gbit", 10e9 / 8)
    with pytest.raises(ValueError, match="bit rate"):
        bench.parse_rate("100mbps")  # tc reads bps as bytes/s: refused, not guessed


def test_qdisc_commands():
    args = bench.make_parser().parse_args([])
    assert bench.qdisc_commands("unshaped", 0.0, args) == []
    (tbf,) = bench.qdisc_commands("1gbit", 1e9 / 8, args)
    # burst: 2 ms of the rate (250 kB) is below the 256 KiB floor.
    assert tbf == "tc qdisc add dev lo root handle 1: tbf rate 1gbit burst 262144 latency 100ms"
    (tbf,) = bench.qdisc_commands("10gbit", 10e9 / 8, args)
    assert "burst 2500000 " in tbf  # 1.25e9 B/s * 2 ms
    args.delay = "1ms"
    netem, child = bench.qdisc_commands("1gbit", 1e9 / 8, args)
    assert netem == "tc qdisc add dev lo root handle 1: netem delay 1ms limit 100000"
    assert child.startswith("tc qdisc add dev lo parent 1:1 handle 10: tbf rate 1gbit ")


def test_refusals_are_one_line_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    message = bench.missing_prerequisite()
    assert "needs root" in message and "\n" not in message
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    real = bench.find_tool
    monkeypatch.setattr(bench, "find_tool", lambda name: None if name == "tc" else real(name))
    message = bench.missing_prerequisite()
    assert "`tc`" in message and "apt-get install iproute2" in message and "\n" not in message
    monkeypatch.setattr(bench, "find_tool", lambda name: None if name == "unshare" else "/bin/x")
    message = bench.missing_prerequisite()
    assert "`unshare`" in message and "apt-get install util-linux" in message


def test_main_exits_with_the_message_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(bench, "missing_prerequisite", lambda delay=False: "needs `tc`: apt-get")
    assert bench.main(["--rates", "1gbit"]) == 3
    err = capsys.readouterr().err
    assert err.strip() == "needs `tc`: apt-get"


def _fake_results() -> dict:
    def row(name, median, nbytes, density=None, profile=None):
        out = {
            "row": name,
            "step_s": {"median": median, "p20": 0.9 * median, "p80": 1.1 * median},
            "phases_s": {"forward": 0.2, "backward": 0.4, "optimizer": 0.05},
            "bytes_per_step": nbytes,
            "density": density,
        }
        if profile:
            out["profile"] = profile
        return out

    def profile(compress):
        return {
            "compress_s": compress,
            "aggregate_s": 0.0,
            "communicate_s": 0.1,
            "compress_share": 0.1,
            "communicate_share": 0.2,
            "aggregate_share": 0.0,
        }

    def rate(label, set_rate, measured, rows):
        return {
            "label": label,
            "qdisc": [],
            "status": "ok",
            "data": {
                "world_size": 2,
                "params": 1e7,
                "torch": "x",
                "backend": "gloo",
                "device": "cpu",
                "cpu_count": 2,
                "threads_per_rank": 1,
                "link": {
                    "allreduce_bytes": 1e7,
                    "reps": 1,
                    "seconds": 1.0,
                    "aggregate_bytes_per_s": measured,
                    "per_rank_bytes_per_s": measured / 2,
                    "ratio_to_set": measured / set_rate if set_rate else None,
                    "small_allreduce_s": 2e-4,
                },
                "rows": rows,
                "skipped": [{"row": "ddp+bf16", "reason": "no bf16 on gloo"}],
            },
        }

    fast = [
        row("none", 0.6, 0.0),
        row("ddp", 0.65, 4e7, 1.0),
        row("Dense()", 0.7, 4e7, 1.0, profile(0.0)),
        row("TopK(0.01)", 0.9, 8e5, 0.01, profile(0.3)),
    ]
    slow = [
        row("none", 0.6, 0.0),
        row("ddp", 3.0, 4e7, 1.0),
        row("Dense()", 3.2, 4e7, 1.0, profile(0.0)),
        row("TopK(0.01)", 0.95, 8e5, 0.01, profile(0.3)),
        # Faster than every row the planner models: the planner check must leave it out.
        row("TopK(0.01)/local_updates", 0.7, 8e5, 0.01, profile(0.3)),
    ]
    return {
        "date": "2026-12-03",
        "command": "python benchmarks/bench_network.py",
        "seconds": 100.0,
        "config": vars(bench.make_parser().parse_args([])),
        "rates": [rate("unshaped", 0, 2e9, fast), rate("300mbit", 300e6 / 8, 3.7e7, slow)],
    }


def test_report_and_planner_check_on_fixed_numbers(tmp_path):
    results = _fake_results()
    results["planner"] = bench.planner_check(results, overlap=0.0)
    by_rate = {item["rate"]: item for item in results["planner"]["rates"]}
    # Fast link: 40 MB at 1 GB/s per rank is 40 ms, TopK's 0.3 s of compression is not worth it.
    assert by_rate["unshaped"]["recommended"] == "Dense()" == by_rate["unshaped"]["fastest"]
    # 300mbit: 40 MB at 18.5 MB/s per rank is 2.2 s; TopK sends 0.8 MB.
    assert by_rate["300mbit"]["recommended"] == "TopK(0.01)" == by_rate["300mbit"]["fastest"]
    report = bench.format_report(results)
    assert "| 300mbit |" in report and "99%" in report  # 3.7e7 of 3.75e7 B/s
    assert "| TopK(0.01) | 0.8 | 1% | 900 [810-990] | 950 [855-1045] |" in report
    assert "Skipped `ddp+bf16`: no bf16 on gloo." in report
    assert "rate/2" in report and "2(W-1)/W" in report
    assert bench.plot(results, tmp_path / "network.png")
    assert (tmp_path / "network.png").stat().st_size > 10_000


def test_side_by_side_ratios_are_taken_turn_by_turn_and_checked_against_the_targets():
    # The machine slows down 2x in the second turn: pooled medians would blur the rows, the
    # turn-by-turn ratios do not.
    results = _fake_results()
    results["rates"][0]["label"] = "1gbit"
    turns = {
        "none": [0.40, 0.80, 0.40],
        "ddp+fp16": [1.00, 2.00, 1.00],
        "TopK(0.01)": [0.48, 0.96, 0.52],
        "ddp+sc-TopK(0.01)": [0.50, 1.20, 0.52],
    }
    rows = []
    for name, medians in turns.items():
        row = dict(results["rates"][0]["data"]["rows"][0], row=name, round_medians=medians)
        rows.append(row)
    results["rates"][0]["data"]["rows"] = rows
    report = bench.format_report(results)
    assert "| TopK(0.01) / ddp+fp16 | 0.480x [0.480-0.520] | - |" in report
    assert "| TopK(0.01) / none | 1.200x [1.200-1.300] | - |" in report
    assert "| ddp+sc-TopK(0.01) / TopK(0.01) | 1.042x [1.000-1.250] | - |" in report
    assert "- 1gbit: `TopK(0.01)` <= 0.5x `ddp+fp16`: 0.480x [0.480-0.520], met" in report
    assert "- 1gbit: `TopK(0.01)` <= 1.3x `none`: 1.200x [1.200-1.300], met" in report
    assert "`ddp+sc-TopK(0.01)` within 10% of the optimizer door: 1.042x" in report
    # A row that ran in other turns than its baseline (a rebuilt round) is not divided.
    rows[0]["round_medians"] = [0.4, 0.8]
    assert "| TopK(0.01) / none |" not in bench.format_report(results)
    assert bench.turn_ratios(rows[2], rows[1]) == pytest.approx([0.48, 0.48, 0.52])


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("interleave", [False, True], ids=["rebuilt", "interleaved"])
def test_smoke_two_ranks_on_a_shaped_loopback(tmp_path, interleave):
    needs_shaping()
    out = tmp_path / "out"
    result = run_bench(
        f"--rates={SMOKE_RATE}",
        "--rows=none,ddp,TopK(0.01),TopK(0.01)/local_updates"
        + (",TopK(0.01)@0.01" if interleave else ""),
        *TINY,
        "--steps=2",
        "--rounds=2",
        "--warmup=1",
        "--profile-steps=1",
        "--rate-timeout=100",
        f"--out={out}",
        *(["--interleave"] if interleave else []),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    for row in results["rates"][0]["data"]["rows"]:  # two rounds of two timed steps, pooled
        assert len(row["step_s_all"]) == 4 and len(row["round_medians"]) == 2, row["row"]
    (rate,) = results["rates"]
    assert rate["status"] == "ok", rate
    data = rate["data"]
    link = data["link"]
    achieved = link["aggregate_bytes_per_s"]
    assert 0.75 * SMOKE_BYTES_PER_S <= achieved <= 1.25 * SMOKE_BYTES_PER_S, (
        f"loopback shaped to {SMOKE_RATE} carried {achieved * 8 / 1e6:.1f} Mbit/s: "
        "the shaping does not shape"
    )
    assert link["per_rank_bytes_per_s"] == pytest.approx(achieved / 2)
    rows = {row["row"]: row for row in data["rows"]}
    assert list(rows) == ["none", "ddp", "TopK(0.01)", "TopK(0.01)/local_updates"] + (
        ["TopK(0.01)@0.01"] if interleave else []
    )
    for row in rows.values():
        assert 0 < row["step_s"]["p20"] <= row["step_s"]["median"] <= row["step_s"]["p80"]
    assert rows["none"]["bytes_per_step"] == 0
    assert rows["ddp"]["bytes_per_step"] == 4 * data["params"]
    for name in ("TopK(0.01)", "TopK(0.01)/local_updates", *(["TopK(0.01)@0.01"] * interleave)):
        assert 0 < rows[name]["bytes_per_step"] < rows["ddp"]["bytes_per_step"] / 10, name
    assert 0 <= rows["TopK(0.01)"]["profile"]["communicate_share"] <= 1
    if interleave:  # 10 KiB buckets: k = ceil(1% of each), more than 1% of one bucket
        assert rows["TopK(0.01)@0.01"]["bytes_per_step"] > rows["TopK(0.01)"]["bytes_per_step"]
    assert "Sent" in rate["qdisc_stats"] and "tbf" in rate["qdisc_stats"]
    table = (out / "table.md").read_text()
    assert "| TopK(0.01) |" in table and "rate/2" in table
    assert "| TopK(0.01) / ddp | " in table  # two turns each: the turn-by-turn ratios
    assert (out / "network.png").stat().st_size > 10_000


def test_a_rate_past_its_timeout_is_killed_with_its_namespace(tmp_path):
    needs_shaping()
    out = tmp_path / "slow"
    result = run_bench(
        "--rates=50mbit",
        "--rows=ddp",
        *TINY,
        "--steps=100000",
        "--warmup=0",
        "--rate-timeout=12",
        f"--out={out}",
        timeout=90,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (rate,) = json.loads((out / "results.json").read_text())["rates"]
    assert rate["status"].startswith("timed out after 12 s"), rate["status"]
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(out).encode() in (entry / "cmdline").read_bytes():
                left.append(int(entry.name))
        except OSError:
            continue
    assert not left, f"processes {left} of the killed namespace are still running"
