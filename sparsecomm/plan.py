"""Communication planner: bytes and time per step for each compressor, by the ring cost model.

Run it before training to see whether compression pays for a model size, world size and link::

    python -m sparsecomm.plan --params 1.3e9 --world-size 64 --bandwidth 25Gbit --latency 20us

The cost model (per rank, per step; ``n`` gradient elements, ``W`` ranks, bandwidth ``B`` in
bytes/s, per-message latency ``alpha``):

- dense ring all-reduce of ``e``-byte elements (fp32: 4, fp16/bf16: 2) moves
  ``2 (W-1)/W * e * n`` bytes and pays ``2 (W-1)`` latency terms (reduce-scatter + all-gather);
- an all-gather of ``k`` (int32 index, fp32 value) pairs of ``b = 8`` bytes moves
  ``(W-1) * k * b`` bytes and pays ``(W-1)`` latency terms;
- time = bytes / B + latency terms * alpha, once per bucket for the latency terms (sparsecomm
  runs one collective per bucket of ``bucket_cap_mb``).

Setting the two byte counts equal gives the crossover density ``k/n = 2e / (W b)``: ``1/W`` for
fp32 against 8-byte pairs (12.5% at W=8, 1.6% at W=64). A sparse all-gather pays fewer latency
terms than the ring all-reduce, which moves the *time* crossover up by
``buckets * alpha * B / (n b)`` (see :func:`crossover_density`). Above the byte crossover
sparsecomm sends the bucket dense instead, so a density there buys nothing.

Everything here is a pure function of its arguments (no torch, no process group), so the figures
can be checked by hand.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "PlanRow",
    "allgather_bytes",
    "allreduce_bytes",
    "comm_time",
    "crossover_density",
    "num_buckets",
    "parse_bandwidth",
    "parse_count",
    "parse_latency",
    "plan",
    "recommend",
    "format_plan",
    "main",
]

FP32_BYTES = 4
HALF_BYTES = 2
# int32 index + fp32 value; 6 with half values (DESIGN.md: values fp32 or, optionally, half).
PAIR_BYTES = 8
# Threshold first all-gathers one int64 count per rank and bucket, then pads to the largest count.
COUNT_BYTES = 8
DEFAULT_DENSITIES = (0.001, 0.01, 0.1)
# sparsecomm.CompressedOptimizer's default bucket size; buckets hold fp32 gradients.
DEFAULT_BUCKET_CAP_MB = 25.0
MB = 1024 * 1024  # bucket_cap_mb counts MiB, as DistributedDataParallel's does


# --------------------------------------------------------------------------- cost model


def allreduce_bytes(n: float, world_size: int, elem_bytes: float = FP32_BYTES) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n`` elements of ``elem_bytes`` each.

    ``2 (W-1)/W * elem_bytes * n``: a reduce-scatter and an all-gather, each moving ``(W-1)/W``
    of the buffer. Zero for a single rank.

    Example:
        >>> allreduce_bytes(1e8, 8)  # 1e8 fp32 at W=8: 0.7 GB
        700000000.0
    """
    _check_world_size(world_size)
    _check_nonnegative("n", n)
    return 2.0 * (world_size - 1) / world_size * elem_bytes * n


def allgather_bytes(k: float, world_size: int, pair_bytes: float = PAIR_BYTES) -> float:
    """Bytes one rank receives in an all-gather of ``k`` (index, value) pairs from every rank.

    ``(W-1) * k * pair_bytes``: every other rank's message, each ``k`` pairs.

    Example:
        >>> allgather_bytes(1e6, 8)  # 1% of 1e8 at W=8: 56 MB
        56000000.0
    """
    _check_world_size(world_size)
    _check_nonnegative("k", k)
    return float((world_size - 1) * k * pair_bytes)


def comm_time(
    nbytes: float, bandwidth: float, latency: float = 0.0, latency_terms: float = 0
) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s plus ``latency_terms * latency`` s.

    Example:
        >>> comm_time(7e8, 25e9 / 8)  # 0.7 GB over 25 Gbit/s
        0.224
    """
    if not bandwidth > 0:
        raise ValueError(
            f"bandwidth must be > 0 bytes/s, got {bandwidth!r}; pass e.g. parse_bandwidth('25Gbit')"
        )
    _check_nonnegative("latency", latency)
    _check_nonnegative("nbytes", nbytes)
    return nbytes / bandwidth + latency_terms * latency


def num_buckets(n: float, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> int:
    """How many fp32 buckets of at most ``bucket_cap_mb`` MiB hold ``n`` gradient elements."""
    if not bucket_cap_mb > 0:
        raise ValueError(
            f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}; the library default is 25"
        )
    if n <= 0:
        return 0
    per_bucket = max(1, int(bucket_cap_mb * MB) // FP32_BYTES)
    return math.ceil(n / per_bucket)


def crossover_density(
    world_size: int,
    elem_bytes: float = FP32_BYTES,
    pair_bytes: float = PAIR_BYTES,
    *,
    n: float | None = None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    buckets: int = 1,
) -> float:
    """Density ``k/n`` at which a sparse all-gather costs the same as a dense all-reduce.

    Bytes: ``(W-1) k b = 2 (W-1)/W e n``  gives  ``k/n = 2e / (W b)``  (``1/W`` for fp32 against
    8-byte pairs). With a latency ``alpha`` the all-gather saves ``(W-1)`` latency terms per bucket,
    so in time ``(W-1) k b / B + buckets (W-1) alpha = 2 (W-1)/W e n / B + 2 buckets (W-1) alpha``,
    which gives ``k/n = 2e / (W b) + buckets * alpha * B / (n b)``. Below it, sparse is cheaper.

    Args:
        world_size: number of ranks ``W`` (at least 2: one rank exchanges nothing).
        elem_bytes: bytes per dense element (4 for fp32, 2 for fp16/bf16).
        pair_bytes: bytes per sparse pair (8: int32 index + fp32 value).
        n, bandwidth, latency, buckets: only for the latency term; leave ``latency=0`` for the
            byte crossover, which is what sparsecomm's dense fallback uses.

    Example:
        >>> crossover_density(8), crossover_density(64)
        (0.125, 0.015625)
    """
    _check_world_size(world_size)
    if world_size < 2:
        raise ValueError(
            "world_size must be >= 2 for a crossover (one rank communicates nothing), got 1"
        )
    if not pair_bytes > 0 or not elem_bytes > 0:
        raise ValueError(
            f"elem_bytes and pair_bytes must be > 0, got {elem_bytes!r} and {pair_bytes!r}"
        )
    density = 2.0 * elem_bytes / (world_size * pair_bytes)
    if latency:
        if n is None or bandwidth is None or not n > 0 or not bandwidth > 0:
            raise ValueError(
                "crossover_density with latency > 0 needs n > 0 and bandwidth > 0 (bytes/s); "
                "pass them, or latency=0 for the byte crossover"
            )
        density += buckets * latency * bandwidth / (n * pair_bytes)
    return density


# --------------------------------------------------------------------------- units

_BANDWIDTH_RE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
    r"(?P<prefix>[kKmMgGtT]i?)?\s*(?P<unit>bits?|bytes?|bps|Bps|b|B)?\s*(?:/\s*s|ps)?\s*$"
)
_DECIMAL = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bandwidth(text: str | float) -> float:
    """Parse a link bandwidth into bytes per second.

    Bits: ``25Gbit``, ``100Gbit/s``, ``400Gbps``, ``10Gb``. Bytes: ``10GB``, ``10GB/s``,
    ``12.5GBps``, ``3GiB``. Prefixes k/M/G/T are decimal (network convention), Ki/Mi/Gi/Ti binary.
    A bare number is refused: bits or bytes is a factor of 8.

    Example:
        >>> parse_bandwidth("25Gbit"), parse_bandwidth("10GB"), parse_bandwidth("400Gbps")
        (3125000000.0, 10000000000.0, 50000000000.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        raise ValueError(
            f"bandwidth {text!r} has no unit; write it with one, e.g. '25Gbit' (bits/s) "
            "or '10GB' (bytes/s)"
        )
    match = _BANDWIDTH_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"bandwidth {text!r} is not understood; write e.g. '25Gbit', '400Gbps' (bits/s) "
            "or '10GB', '10GB/s' (bytes/s)"
        )
    unit = match["unit"]
    if unit is None:
        raise ValueError(
            f"bandwidth {text!r} has no unit; add one: '{match['num']}{match['prefix'] or 'G'}bit' "
            f"for bits/s or '{match['num']}{match['prefix'] or 'G'}B' for bytes/s"
        )
    value = float(match["num"])
    prefix = (match["prefix"] or "").lower()
    scale = _BINARY[prefix] if prefix.endswith("i") else _DECIMAL.get(prefix, 1.0)
    is_bytes = unit in ("B", "Bps") or unit.lower().startswith("byte")
    bytes_per_s = value * scale / (1.0 if is_bytes else 8.0)
    if not bytes_per_s > 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}; e.g. '25Gbit'")
    return bytes_per_s


_LATENCY_RE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>ns|us|µs|μs|ms|s)?\s*$"
)
# Divisors rather than factors so that "20us" is exactly 20 / 1e6 == 2e-05.
_TIME_DIVISORS = {"ns": 1e9, "us": 1e6, "µs": 1e6, "μs": 1e6, "ms": 1e3, "s": 1.0}


def parse_latency(text: str | float) -> float:
    """Parse a per-message latency into seconds: ``20us``, ``5ms``, ``800ns``, ``0``.

    A bare non-zero number is refused (seconds or microseconds is a factor of a million).

    Example:
        >>> parse_latency("20us"), parse_latency("5ms"), parse_latency("0")
        (2e-05, 0.005, 0.0)
    """
    match = _LATENCY_RE.match(str(text))
    if match is None:
        raise ValueError(f"latency {text!r} is not understood; write e.g. '20us', '5ms' or '0'")
    value = float(match["num"])
    unit = match["unit"]
    if unit is None:
        if value == 0:
            return 0.0
        raise ValueError(
            f"latency {text!r} has no unit; write e.g. '{match['num']}us' or '{match['num']}ms'"
        )
    return value / _TIME_DIVISORS[unit]


_COUNT_RE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<suffix>[kKmMbBgGtT])?\s*$"
)
_COUNT_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str | float) -> float:
    """Parse a parameter count: ``1.3e9``, ``1300000000``, ``350M``, ``7B``, ``125k``.

    Example:
        >>> parse_count("1.3e9"), parse_count("350M"), parse_count("7B")
        (1300000000.0, 350000000.0, 7000000000.0)
    """
    match = _COUNT_RE.match(str(text))
    if match is None:
        raise ValueError(f"params {text!r} is not a number; write e.g. '1.3e9', '350M' or '7B'")
    value = float(match["num"]) * _COUNT_SUFFIX.get((match["suffix"] or "").lower(), 1.0)
    if not value >= 1:
        raise ValueError(f"params must be >= 1, got {text!r}; e.g. '1.3e9'")
    return value


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an integer >= 1 (the number of ranks), got {world_size!r}"
        )


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0:  # also catches NaN
        raise ValueError(f"{name} must be >= 0, got {value!r}")


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRow:
    """One compressor's cost per rank per step.

    Fields:
        name: short label (``"Dense fp32"``, ``"TopK 1%"``).
        compressor: the constructor to pass to ``CompressedOptimizer``.
        density: fraction of elements sent (1.0 for dense and cast).
        bytes_per_rank: bytes one rank moves per step by the cost model.
        latency_terms: number of latency terms paid per step (all buckets).
        time_s: ``bytes_per_rank / bandwidth + latency_terms * latency``.
        speedup: dense fp32 time / this time.
        above_crossover: a sparse row whose payload is at least the dense all-reduce's in
            bytes (density >= 1/W for 8-byte pairs); sparsecomm sends those buckets dense.
    """

    name: str
    compressor: str
    density: float
    bytes_per_rank: float
    latency_terms: int
    time_s: float
    speedup: float
    above_crossover: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def plan(
    params: float,
    world_size: int,
    bandwidth: float,
    latency: float = 0.0,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    pair_bytes: float = PAIR_BYTES,
) -> list[PlanRow]:
    """Cost of each compressor for one step of ``params`` gradient elements on ``world_size`` ranks.

    Args:
        params: number of gradient elements (trainable parameters).
        world_size: number of ranks.
        bandwidth: per-rank link bandwidth in bytes/s (see :func:`parse_bandwidth`).
        latency: per-message latency in seconds (see :func:`parse_latency`).
        densities: the TopK and Threshold densities to list, each in (0, 1].
        bucket_cap_mb: bucket size; each bucket is one collective, so one set of latency terms.
        pair_bytes: bytes per sparse pair (8: int32 index + fp32 value; 6 with half values).

    Returns:
        Rows in the order Dense fp32, Cast fp16, Cast bf16, then TopK and Threshold per density.
        Threshold's count varies per rank; its row is for the largest count over ranks (the
        all-gather is padded to it) and adds the all-gather of the counts.

    Example:
        >>> rows = plan(1e8, 8, parse_bandwidth("25Gbit"))
        >>> rows[0].name, round(rows[0].time_s * 1e3)
        ('Dense fp32', 224)
    """
    params = float(params)
    if not params >= 1:
        raise ValueError(f"params must be >= 1 gradient element, got {params!r}")
    _check_world_size(world_size)
    if not bandwidth > 0:
        raise ValueError(
            f"bandwidth must be > 0 bytes/s, got {bandwidth!r}; pass e.g. parse_bandwidth('25Gbit')"
        )
    _check_nonnegative("latency", latency)
    for density in densities:
        if not 0 < density <= 1:
            raise ValueError(f"densities must each be in (0, 1], got {density!r}; write 1% as 0.01")
    buckets = num_buckets(params, bucket_cap_mb)
    ring_terms = 2 * (world_size - 1) * buckets
    gather_terms = (world_size - 1) * buckets

    def row(name, compressor, density, nbytes, terms, above=False):
        time_s = comm_time(nbytes, bandwidth, latency, terms)
        return name, compressor, density, nbytes, terms, time_s, above

    raw = [
        row(
            "Dense fp32",
            "Dense()",
            1.0,
            allreduce_bytes(params, world_size, FP32_BYTES),
            ring_terms,
        ),
        row(
            "Cast fp16",
            "Cast(torch.float16)",
            1.0,
            allreduce_bytes(params, world_size, HALF_BYTES),
            ring_terms,
        ),
        row(
            "Cast bf16",
            "Cast(torch.bfloat16)",
            1.0,
            allreduce_bytes(params, world_size, HALF_BYTES),
            ring_terms,
        ),
    ]
    dense_bytes = raw[0][3]
    for density in densities:
        k = density * params
        topk_bytes = allgather_bytes(k, world_size, pair_bytes)
        raw.append(
            row(
                f"TopK {_pct(density)}",
                f"TopK(density={density:g})",
                density,
                topk_bytes,
                gather_terms,
                topk_bytes >= dense_bytes,
            )
        )
    for density in densities:
        k = density * params
        threshold_bytes = allgather_bytes(k, world_size, pair_bytes) + (
            (world_size - 1) * COUNT_BYTES * buckets
        )
        raw.append(
            row(
                f"Threshold {_pct(density)}",
                f"Threshold(t)  # t giving {_pct(density)}",
                density,
                threshold_bytes,
                2 * gather_terms,
                allgather_bytes(k, world_size, pair_bytes) >= dense_bytes,
            )
        )
    dense_time = raw[0][5]
    return [
        PlanRow(
            name=name,
            compressor=compressor,
            density=density,
            bytes_per_rank=nbytes,
            latency_terms=terms,
            time_s=time_s,
            speedup=(dense_time / time_s) if time_s > 0 else math.inf,
            above_crossover=above,
        )
        for name, compressor, density, nbytes, terms, time_s, above in raw
    ]


def recommend(rows: Sequence[PlanRow], world_size: int) -> str:
    """One paragraph saying which compressor to use, from the rows of :func:`plan`.

    The rule: Cast(bf16) halves the bytes with no accuracy tuning (error feedback keeps the
    rounding), so it is the baseline; a sparse compressor is worth its tuning only when it beats
    Cast(bf16), and the least aggressive TopK density that does is the one to try first.
    """
    if world_size == 1:
        return "One rank exchanges nothing: use Dense() (or no wrapper at all)."
    by_name = {r.name: r for r in rows}
    bf16 = by_name["Cast bf16"]
    topk = sorted((r for r in rows if r.name.startswith("TopK")), key=lambda r: -r.density)
    better = [r for r in topk if r.time_s < bf16.time_s]
    if not better:
        lowest = min((r.density for r in topk), default=None)
        tail = f" at densities down to {_pct(lowest)}" if lowest is not None else ""
        return (
            f"Use Cast(torch.bfloat16): {_ms(bf16.time_s)} per step against {_ms(rows[0].time_s)} "
            f"dense. Sparse compression does not beat it{tail} at W={world_size}."
        )
    pick = better[0]
    return (
        f"Use {pick.compressor} with error_feedback=True: {_ms(pick.time_s)} per step against "
        f"{_ms(rows[0].time_s)} dense fp32 ({pick.speedup:.1f}x) and {_ms(bf16.time_s)} for "
        f"Cast(torch.bfloat16). Check accuracy against a dense run; if it drops, "
        f"Cast(torch.bfloat16) is the safe choice."
    )


def format_plan(
    params: float,
    world_size: int,
    bandwidth: float,
    latency: float = 0.0,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    pair_bytes: float = PAIR_BYTES,
) -> str:
    """The planner's report as text: the table, the crossover and the recommendation."""
    rows = plan(params, world_size, bandwidth, latency, densities, bucket_cap_mb, pair_bytes)
    buckets = num_buckets(params, bucket_cap_mb)
    lines = [
        f"{params:.4g} gradient elements, W={world_size} ranks, "
        f"{bandwidth * 8 / 1e9:.4g} Gbit/s ({bandwidth / 1e9:.4g} GB/s) per rank, "
        f"latency {latency * 1e6:.4g} us per message, "
        f"{buckets} bucket(s) of <= {bucket_cap_mb:g} MiB",
        "",
        f"| {'compressor':<15} | {'bytes/rank/step':>15} | {'time/step':>10} | {'vs dense':>8} "
        "| note |",
        f"|{'-' * 17}|{'-' * 16}:|{'-' * 11}:|{'-' * 9}:|------|",
    ]
    for r in rows:
        note = ""
        if r.above_crossover:
            note = "above crossover: sparsecomm sends these buckets dense fp32"
        elif r.name.startswith("Threshold"):
            note = "density = largest over ranks (padded); + count all-gather"
        lines.append(
            f"| {r.name:<15} | {_bytes(r.bytes_per_rank):>15} | {_ms(r.time_s):>10} | "
            f"{r.speedup:>7.2f}x | {note} |"
        )
    lines.append("")
    if world_size >= 2:
        byte_cross = crossover_density(world_size, FP32_BYTES, pair_bytes)
        half_cross = crossover_density(world_size, HALF_BYTES, pair_bytes)
        lines.append(
            f"Crossover density (sparse all-gather = dense fp32 all-reduce, in bytes): "
            f"2*4/(W*{pair_bytes:g}) = {_pct(byte_cross)}"
            + (" = 1/W" if pair_bytes == 2 * FP32_BYTES else "")
            + "; below it TopK/Threshold send fewer bytes."
        )
        if latency > 0:
            time_cross = crossover_density(
                world_size,
                FP32_BYTES,
                pair_bytes,
                n=params,
                bandwidth=bandwidth,
                latency=latency,
                buckets=buckets,
            )
            lines.append(
                f"In time, with {latency * 1e6:.4g} us latency (the all-gather pays half the "
                f"latency terms): {_pct(time_cross)}."
            )
        lines.append(
            f"Against Cast fp16/bf16 (2-byte all-reduce) the sparse compressors pay below "
            f"{_pct(half_cross)} (= 1/(2W) in bytes)."
        )
    lines.append("")
    lines.append("Recommendation: " + recommend(rows, world_size))
    return "\n".join(lines)


def _pct(density: float) -> str:
    return f"{density * 100:.3g}%"


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sparsecomm.plan",
        description=(
            "Bytes and communication time per rank per step for each sparsecomm compressor, "
            "by the ring cost model; prints the crossover density and a recommendation."
        ),
    )
    parser.add_argument(
        "--params", required=True, help="gradient elements (trainable parameters): 1.3e9, 350M, 7B"
    )
    parser.add_argument("--world-size", required=True, type=int, help="number of ranks W")
    parser.add_argument(
        "--bandwidth",
        required=True,
        help="per-rank link bandwidth: 25Gbit, 400Gbps (bits/s), 10GB (bytes/s)",
    )
    parser.add_argument(
        "--latency", default="0", help="per-message latency: 20us, 5ms (default 0: bandwidth only)"
    )
    parser.add_argument(
        "--densities",
        default=",".join(f"{d:g}" for d in DEFAULT_DENSITIES),
        help="comma-separated TopK/Threshold densities (default 0.001,0.01,0.1)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=DEFAULT_BUCKET_CAP_MB,
        help="bucket size in MiB; latency is paid per bucket (default 25)",
    )
    parser.add_argument(
        "--half-values",
        action="store_true",
        help="sparse values sent as half: 6-byte pairs instead of 8",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        params = parse_count(args.params)
        bandwidth = parse_bandwidth(args.bandwidth)
        latency = parse_latency(args.latency)
        try:
            densities = [float(d) for d in args.densities.split(",") if d.strip()]
        except ValueError:
            raise ValueError(
                f"densities {args.densities!r} must be comma-separated fractions, e.g. 0.001,0.01"
            ) from None
        pair_bytes = 6 if args.half_values else PAIR_BYTES
        text = format_plan(
            params, args.world_size, bandwidth, latency, densities, args.bucket_cap_mb, pair_bytes
        )
    except ValueError as error:
        parser.error(str(error))  # exits with status 2 and the usage line
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
