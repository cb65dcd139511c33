"""Communication planner: bytes and time per step for each compressor, by the ring cost model,
and the step time once compression and overlap with backward are counted.

Run it before training to see whether compression pays for a model size, world size and link::

    python -m sparsecomm.plan --params 1.3e9 --world-size 64 --bandwidth 25Gbit --latency 20us

and, to weigh the exchange against the rest of the step, with what one step costs without any
exchange and the compressors' cost per element on this machine::

    python -m sparsecomm.plan --params 14.4M --world-size 2 --bandwidth 150Mbit \
        --compute-seconds 0.8s --measure

The cost model (per rank, per step; ``n`` gradient elements, ``W`` ranks, bandwidth ``B`` in
bytes/s, per-message latency ``alpha``):

- dense ring all-reduce of ``e``-byte elements (fp32: 4, fp16/bf16: 2) moves
  ``2 (W-1)/W * e * n`` bytes and pays ``2 (W-1)`` latency terms (reduce-scatter + all-gather);
- an all-gather of ``k`` (int32 index, fp32 value) pairs of ``b = 8`` bytes moves
  ``(W-1) * k * b`` bytes and pays ``(W-1)`` latency terms;
- time = bytes / B + latency terms * alpha, once per bucket for the latency terms (sparsecomm
  runs one collective per bucket of ``bucket_cap_mb``: by default 25 MiB for Dense and Cast,
  100 MiB for TopK and Threshold, or what keeps a model over 1.6 GiB to 16 of them,
  :func:`bucket_caps`).

Setting the two byte counts equal gives the crossover density ``k/n = 2e / (W b)``: ``1/W`` for
fp32 against 8-byte pairs (12.5% at W=8, 1.6% at W=64). A sparse all-gather pays fewer latency
terms than the ring all-reduce, which moves the *time* crossover up by
``(2 buckets - sparse_buckets) * alpha * B / (n b)`` (``buckets`` dense all-reduces against
``sparse_buckets`` all-gathers; see :func:`crossover_density`). Above the byte crossover
sparsecomm sends the bucket dense instead, so a density there buys nothing.

The step model (per rank, per step) adds what the communication time leaves out:

- ``compute``: forward + backward + optimizer step without any exchange (``--compute-seconds``;
  measure it by training without the wrapper);
- compression and aggregation: ``n`` times a cost per gradient element for each compressor
  (``--compress-ns-per-element``, or ``--measure`` to time the compressors here on a tensor of
  the model's size). Each bucket is compressed in a backward hook and aggregated after
  backward, on the processor that runs backward, so nothing hides them;
- overlap: ``CompressedOptimizer`` (like DistributedDataParallel) starts each bucket's
  collective during backward, as soon as its gradients are in, so communication hides behind
  backward, up to ``overlap * backward`` seconds (``--backward-seconds``, ``--overlap``), except
  the last bucket's share (``tail``), which is sent when backward ends. ``overlap`` is the
  fraction of backward that really runs beside the link: 1 where a NIC or GPU moves the bytes
  while the processor computes, 0 for an exchange after backward (``overlap=False``);
- the transport's own processor time: where the processor that computes also moves the bytes
  (gloo over TCP on a CPU), each byte costs ``1 / host_bandwidth`` seconds that compete with
  compute and never hide (``--host-bandwidth``: the per-rank rate of the same transport
  unshaped, e.g. the loopback without ``tc``). Without it, the transport costs nothing.

``step = compute + compress + bytes / host_bandwidth + max(tail, communication - overlap *
backward)``, with ``communication = bytes / bandwidth + latency terms`` as above and ``tail``
the last bucket's part of it. Loopback is one shared medium: W ranks on one machine share its
rate, so pass ``bandwidth = rate / W``. Fitted to 2 gloo ranks on 2 CPU cores (a 14.4M-parameter
transformer over a tc-shaped loopback, ``benchmarks/RESULTS.md``): ``overlap`` about 0.6 (the
ranks' collective threads share the two cores with backward) and ``host_bandwidth`` the unshaped
loopback's 8.1 Gbit/s per rank. The recommendation is the row with the smallest step (ties to
the less aggressive compressor); without compute and compression figures that is the row with
the least communication.

Everything here except :func:`measure_compress_costs` is a pure function of its arguments (no
torch, no process group), so the figures can be checked by hand.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "PlanRow",
    "allgather_bytes",
    "allreduce_bytes",
    "comm_time",
    "crossover_density",
    "num_buckets",
    "bucket_caps",
    "last_bucket_share",
    "parse_bandwidth",
    "parse_count",
    "parse_latency",
    "parse_compress_costs",
    "plan",
    "pick",
    "recommend",
    "format_plan",
    "measure_compress_costs",
    "main",
]

FP32_BYTES = 4
HALF_BYTES = 2
# int32 index + fp32 value; 6 with half values (an int32 index and a 2-byte value).
PAIR_BYTES = 8
# Threshold first all-gathers one int64 count per rank and bucket, then pads to the largest count.
COUNT_BYTES = 8
DEFAULT_DENSITIES = (0.001, 0.01, 0.1)
# sparsecomm.CompressedOptimizer's default bucket sizes (MiB of fp32 gradients): Dense and
# Cast, as DDP; TopK and Threshold (the compressors' default_bucket_cap_mb).
DEFAULT_BUCKET_CAP_MB = 25.0
SPARSE_BUCKET_CAP_MB = 100.0
# ... raised, for TopK and Threshold, to keep a large model to about this many buckets
# (the compressors' default_max_buckets).
SPARSE_MAX_BUCKETS = 16
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


def _per_bucket(n: float, bucket_cap_mb: float) -> float:
    """Elements a full bucket holds (``n`` itself without a cap: ``inf``)."""
    if math.isinf(bucket_cap_mb):
        return max(1.0, n)
    return max(1, int(bucket_cap_mb * MB) // FP32_BYTES)


def num_buckets(n: float, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> int:
    """How many fp32 buckets of at most ``bucket_cap_mb`` MiB (``inf``: no cap) hold ``n``
    gradient elements."""
    if not bucket_cap_mb > 0:
        raise ValueError(
            f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}; the library's defaults are "
            f"{DEFAULT_BUCKET_CAP_MB:g} (Dense, Cast) and {SPARSE_BUCKET_CAP_MB:g} "
            "(TopK, Threshold)"
        )
    if n <= 0:
        return 0
    return math.ceil(n / _per_bucket(n, bucket_cap_mb))


def bucket_caps(bucket_cap_mb=None, params: float = 0) -> tuple[float, float]:
    """The bucket sizes (MiB) of the dense rows (Dense, Cast) and of the sparse rows (TopK,
    Threshold): ``bucket_cap_mb`` for both, a ``(dense, sparse)`` pair as given, or
    ``CompressedOptimizer``'s defaults for a model of ``params`` elements when None (the
    sparse rows' raised for a model that would fill more than ``SPARSE_MAX_BUCKETS``).
    (Under ``ddp_comm_hook`` every row runs in DDP's buckets: pass DDP's
    ``bucket_cap_mb``, 25 by default.)

    Example:
        >>> bucket_caps(), bucket_caps(50), bucket_caps((25, 200)), bucket_caps(None, 1e9)
        ((25.0, 100.0), (50, 50), (25, 200), (25.0, 238.41858100891113))
    """
    if bucket_cap_mb is None:
        # (half an element over the 16th part, so that _per_bucket's floor keeps it)
        most = (math.ceil(params / SPARSE_MAX_BUCKETS) + 0.5) * FP32_BYTES / MB
        return DEFAULT_BUCKET_CAP_MB, max(SPARSE_BUCKET_CAP_MB, most)
    if isinstance(bucket_cap_mb, (tuple, list)):
        dense, sparse = bucket_cap_mb
        return dense, sparse
    return bucket_cap_mb, bucket_cap_mb


def last_bucket_share(n: float, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> float:
    """The share of ``n`` elements in the bucket sent last: what the full buckets leave.

    Buckets fill in reverse parameter order, so the last one holds the first parameters and
    the remainder; it is launched when backward ends, so its communication cannot hide.

    Example:
        >>> last_bucket_share(14417920)  # 2 full buckets of 6553600, then 1310720
        0.0909090909090909
    """
    buckets = num_buckets(n, bucket_cap_mb)
    if buckets <= 1:
        return 1.0
    return (n - (buckets - 1) * _per_bucket(n, bucket_cap_mb)) / n


def crossover_density(
    world_size: int,
    elem_bytes: float = FP32_BYTES,
    pair_bytes: float = PAIR_BYTES,
    *,
    n: float | None = None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    buckets: int = 1,
    sparse_buckets: int | None = None,
) -> float:
    """Density ``k/n`` at which a sparse all-gather costs the same as a dense all-reduce.

    Bytes: ``(W-1) k b = 2 (W-1)/W e n``  gives  ``k/n = 2e / (W b)``  (``1/W`` for fp32 against
    8-byte pairs). With a latency ``alpha`` the all-gather saves ``(W-1)`` latency terms per bucket,
    so in time ``(W-1) k b / B + buckets (W-1) alpha = 2 (W-1)/W e n / B + 2 buckets (W-1) alpha``,
    which gives ``k/n = 2e / (W b) + buckets * alpha * B / (n b)``. Below it, sparse is cheaper.
    With ``sparse_buckets`` all-gathers (larger buckets) against ``buckets`` all-reduces, the
    latency term is ``(2 buckets - sparse_buckets) alpha B / (n b)``.

    Args:
        world_size: number of ranks ``W`` (at least 2: one rank exchanges nothing).
        elem_bytes: bytes per dense element (4 for fp32, 2 for fp16/bf16).
        pair_bytes: bytes per sparse pair (8: int32 index + fp32 value).
        n, bandwidth, latency, buckets, sparse_buckets: only for the latency term (the dense
            rows' buckets, the sparse rows' if other: None); leave ``latency=0`` for the
            byte crossover, which is what sparsecomm's dense fallback uses. 0 when the
            all-gathers' latency alone costs more than the all-reduces'.

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
        sparse = buckets if sparse_buckets is None else sparse_buckets
        density += (2 * buckets - sparse) * latency * bandwidth / (n * pair_bytes)
        density = max(density, 0.0)  # (below 0: the all-gathers' latency alone costs more)
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
    if not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
        raise ValueError(f"bandwidth must be finite and > 0, got {text!r}; e.g. '25Gbit'")
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
    if not math.isfinite(value):
        raise ValueError(f"latency must be finite, got {text!r}; e.g. '20us'")
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
    if not (value >= 1 and math.isfinite(value)):
        raise ValueError(f"params must be finite and >= 1, got {text!r}; e.g. '1.3e9'")
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

_COST_KINDS = ("dense", "cast", "fp16", "bf16", "topk", "threshold")


@dataclass(frozen=True)
class PlanRow:
    """One compressor's cost per rank per step.

    Fields:
        name: short label (``"Dense fp32"``, ``"TopK 1%"``).
        compressor: the constructor to pass to ``CompressedOptimizer``.
        density: fraction of elements sent (1.0 for dense and cast).
        bytes_per_rank: bytes one rank moves per step by the cost model.
        latency_terms: number of latency terms paid per step (all buckets).
        time_s: communication time, ``bytes_per_rank / bandwidth + latency_terms * latency``.
        speedup: dense fp32 communication time / this one.
        above_crossover: a sparse row whose payload would be at least the dense
            all-reduce's in bytes (density >= 1/W for 8-byte pairs); sparsecomm sends those
            buckets dense, and the row's bytes and time are the dense all-reduce's.
        compress_s: compression and aggregation, ``n`` times the row's cost per element.
        host_s: processor time the transport itself takes from compute,
            ``bytes_per_rank / host_bandwidth`` (0 without ``host_bandwidth``).
        exposed_s: the communication not hidden behind backward,
            ``max(tail_s, time_s - overlap * backward_seconds)``, where ``tail_s`` is the last
            bucket's share of ``time_s`` (that bucket is sent when backward ends); ``time_s``
            when nothing hides.
        step_s: ``compute_seconds + compress_s + host_s + exposed_s``; equals ``time_s`` when
            no compute, compression, host or overlap figures were given.
    """

    name: str
    compressor: str
    density: float
    bytes_per_rank: float
    latency_terms: int
    time_s: float
    speedup: float
    above_crossover: bool = False
    compress_s: float = 0.0
    exposed_s: float = 0.0
    step_s: float = 0.0
    host_s: float = 0.0

    @property
    def kind(self) -> str:
        """``dense``, ``fp16``, ``bf16``, ``topk`` or ``threshold``."""
        return _kind(self.compressor)

    def as_dict(self) -> dict:
        return asdict(self)


def _kind(compressor: str) -> str:
    if compressor.startswith("Dense"):
        return "dense"
    if compressor.startswith("Cast"):
        return "bf16" if "bfloat16" in compressor else "fp16"
    return "topk" if compressor.startswith("TopK") else "threshold"


def _cost_for(name: str, kind: str, spec) -> float | None:
    """The cost per element (ns) that ``spec`` gives the row, or None if it names none."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        for key in (name, kind, "cast" if kind in ("fp16", "bf16") else None):
            if key is not None and key in spec:
                return float(spec[key])
        return None
    return 0.0 if kind == "dense" else float(spec)


def parse_compress_costs(text: str) -> float | dict[str, float]:
    """Parse ``--compress-ns-per-element``: one number for every compressor that compresses
    (Cast, TopK, Threshold; Dense costs nothing), or ``kind=ns`` pairs with kinds ``dense``,
    ``cast``, ``fp16``, ``bf16``, ``topk``, ``threshold``.

    Example:
        >>> parse_compress_costs("4.5"), parse_compress_costs("topk=9,cast=1.5")
        (4.5, {'topk': 9.0, 'cast': 1.5})
    """
    text = str(text).strip()
    try:
        if "=" not in text:
            value = float(text)
            _check_nonnegative("compress ns per element", value)
            return value
        costs = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, value = (s.strip() for s in part.split("=", 1))
            if key.lower() not in _COST_KINDS:
                raise ValueError(key)
            costs[key.lower()] = float(value)
            _check_nonnegative(f"compress ns per element of {key}", costs[key.lower()])
        return costs
    except ValueError as error:
        if "must be >= 0" in str(error):
            raise
        raise ValueError(
            f"compress ns per element {text!r} is not understood; write one number (e.g. 4.5) "
            f"or kind=ns pairs with kinds {', '.join(_COST_KINDS)} (e.g. topk=9,cast=1.5)"
        ) from None


def plan(
    params: float,
    world_size: int,
    bandwidth: float,
    latency: float = 0.0,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    bucket_cap_mb: float | None = None,
    pair_bytes: float = PAIR_BYTES,
    *,
    threshold_densities: Sequence[float] | None = None,
    compress_ns_per_element: float | Mapping[str, float] | None = None,
    compute_seconds: float = 0.0,
    backward_seconds: float = 0.0,
    overlap: float = 1.0,
    host_bandwidth: float | None = None,
) -> list[PlanRow]:
    """Cost of each compressor for one step of ``params`` gradient elements on ``world_size`` ranks.

    Args:
        params: number of gradient elements (trainable parameters).
        world_size: number of ranks.
        bandwidth: per-rank link bandwidth in bytes/s (see :func:`parse_bandwidth`).
        latency: per-message latency in seconds (see :func:`parse_latency`).
        densities: the TopK densities to list (and Threshold's, unless
            ``threshold_densities`` is given), each in (0, 1].
        bucket_cap_mb: bucket size; each bucket is one collective, so one set of latency terms.
            Default None: ``CompressedOptimizer``'s defaults, 25 MiB for the Dense and Cast
            rows and 100 MiB for the TopK and Threshold rows, or 16 buckets' worth of a model
            over 1.6 GiB (:func:`bucket_caps`).
        pair_bytes: bytes per TopK pair (8: int32 index + fp32 value; 6 with bfloat16
            values, ``TopK(value_dtype=torch.bfloat16)``); Threshold's pairs are 8 always.
        threshold_densities: the densities the Threshold rows' ``t`` gives, if not
            ``densities``.
        compress_ns_per_element: compression + aggregation cost per gradient element, in
            nanoseconds: one number for every compressor but Dense, or a mapping from row name
            (``"TopK 1%"``) or kind (``dense``, ``cast``, ``fp16``, ``bf16``, ``topk``,
            ``threshold``) to ns; rows it does not name cost nothing. See
            :func:`measure_compress_costs`.
        compute_seconds: forward + backward + optimizer step without any exchange.
        backward_seconds: the part of ``compute_seconds`` the communication can hide behind.
        overlap: the fraction of ``backward_seconds`` that hides communication (1: all of it;
            0: none, an exchange after backward, as ``CompressedOptimizer(overlap=False)``).
            Buckets sent during backward (``CompressedOptimizer``'s default, and DDP) hide
            up to ``overlap * backward_seconds`` of it, never the last bucket's share, which
            is sent when backward ends. Measured on 2 gloo ranks on 2 CPU cores: about 0.6
            with ``host_bandwidth`` (benchmarks/RESULTS.md).
        host_bandwidth: bytes/s at which the processor that computes also moves the bytes
            (gloo over TCP on CPU: the per-rank rate of an unshaped loopback); each byte then
            costs ``1 / host_bandwidth`` seconds that no overlap hides. ``None`` (default):
            the transport takes no compute time (a GPU's NCCL, RDMA).

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
    threshold_densities = densities if threshold_densities is None else threshold_densities
    for density in (*densities, *threshold_densities):
        if not 0 < density <= 1:
            raise ValueError(f"densities must each be in (0, 1], got {density!r}; write 1% as 0.01")
    _check_nonnegative("compute_seconds", compute_seconds)
    _check_nonnegative("backward_seconds", backward_seconds)
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (a fraction of backward), got {overlap!r}")
    if backward_seconds > compute_seconds:
        raise ValueError(
            f"backward_seconds ({backward_seconds:g}) must be <= compute_seconds "
            f"({compute_seconds:g}): backward is part of the step's compute; pass both "
            "(--compute-seconds and --backward-seconds)"
        )
    if host_bandwidth is not None and not host_bandwidth > 0:
        raise ValueError(
            f"host_bandwidth must be > 0 bytes/s or None, got {host_bandwidth!r}; pass e.g. "
            "parse_bandwidth('8Gbit'), the unshaped loopback's per-rank rate"
        )
    if compress_ns_per_element is not None and not isinstance(compress_ns_per_element, Mapping):
        _check_nonnegative("compress_ns_per_element", compress_ns_per_element)
    dense_cap, sparse_cap = bucket_caps(bucket_cap_mb, params)
    dense_buckets, sparse_buckets = num_buckets(params, dense_cap), num_buckets(params, sparse_cap)
    ring_terms = 2 * (world_size - 1) * dense_buckets
    gather_terms = (world_size - 1) * sparse_buckets

    def row(name, compressor, density, nbytes, terms, above=False, first=(0, 0)):
        """``first``: (bytes, latency terms) sent before the choice between sparse and
        dense (Threshold's count all-gather), added below and above the crossover."""
        if above:  # every rank switches such a bucket to a dense fp32 all-reduce
            nbytes = allreduce_bytes(params, world_size, FP32_BYTES)
            terms = 2 * (world_size - 1) * sparse_buckets
        nbytes, terms = nbytes + first[0], terms + first[1]
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
    counts = ((world_size - 1) * COUNT_BYTES * sparse_buckets, gather_terms)
    for density in threshold_densities:
        # Threshold's values are always float32: 8-byte pairs, whatever pair_bytes says.
        pairs_bytes = allgather_bytes(density * params, world_size, PAIR_BYTES)
        raw.append(
            row(
                f"Threshold {_pct(density)}",
                f"Threshold(t)  # t giving {_pct(density)}",
                density,
                pairs_bytes,
                gather_terms,
                pairs_bytes >= dense_bytes,
                first=counts,
            )
        )
    dense_time = raw[0][5]
    hidden = overlap * backward_seconds
    rows = []
    for name, compressor, density, nbytes, terms, time_s, above in raw:
        sparse = _kind(compressor) in ("topk", "threshold")
        buckets = sparse_buckets if sparse else dense_buckets
        last_share = last_bucket_share(params, sparse_cap if sparse else dense_cap)
        cost = _cost_for(name, _kind(compressor), compress_ns_per_element) or 0.0
        if not cost >= 0:
            raise ValueError(f"compress ns per element of {name} must be >= 0, got {cost!r}")
        compress_s = cost * 1e-9 * params
        host_s = nbytes / host_bandwidth if host_bandwidth else 0.0
        tail_s = comm_time(nbytes * last_share, bandwidth, latency, terms / max(1, buckets))
        exposed_s = max(min(tail_s, time_s), time_s - hidden)
        rows.append(
            PlanRow(
                name=name,
                compressor=compressor,
                density=density,
                bytes_per_rank=nbytes,
                latency_terms=terms,
                time_s=time_s,
                speedup=(dense_time / time_s) if time_s > 0 else math.inf,
                above_crossover=above,
                compress_s=compress_s,
                exposed_s=exposed_s,
                step_s=compute_seconds + compress_s + host_s + exposed_s,
                host_s=host_s,
            )
        )
    return rows


def _aggressiveness(row: PlanRow) -> tuple:
    """Less aggressive first: Dense, Cast bf16, Cast fp16, then sparse by falling density
    (TopK before Threshold, whose t needs tuning)."""
    order = {"dense": 0, "bf16": 1, "fp16": 2}
    if row.kind in order:
        return (order[row.kind], 0.0, 0)
    return (3, -row.density, 0 if row.kind == "topk" else 1)


def _constructor(row: PlanRow) -> str:
    """``TopK(density=0.01)``; ``Threshold(t) (t giving 1%)``."""
    code, _, comment = row.compressor.partition("  # ")
    return f"{code} ({comment})" if comment else code


def pick(rows: Sequence[PlanRow]) -> PlanRow:
    """The row with the smallest modelled step time, ties to the less aggressive compressor.
    Sparse rows above the byte crossover are left out (sparsecomm sends those dense)."""
    candidates = [r for r in rows if not r.above_crossover] or list(rows)
    best = min(r.step_s for r in candidates)
    tied = [r for r in candidates if r.step_s <= best * (1 + 1e-9) + 1e-15]
    return min(tied, key=_aggressiveness)


def recommend(rows: Sequence[PlanRow], world_size: int) -> str:
    """One paragraph saying which compressor to use, from the rows of :func:`plan`.

    The rule: the row with the smallest modelled step time (:func:`pick`). Without compute
    and compression figures the step is the communication alone, so the least communication
    wins; with them, compression must save more time on the link than it costs. A less
    aggressive sparse density within 10% of the pick is named too: it keeps more of each
    gradient for little time.
    """
    if world_size == 1:
        return "One rank exchanges nothing: use Dense() (or no wrapper at all)."
    by_name = {r.name: r for r in rows}
    dense, bf16 = by_name["Dense fp32"], by_name["Cast bf16"]
    best = pick(rows)
    candidates = [r for r in rows if not r.above_crossover]
    if best.kind == "dense":
        others = [r for r in candidates if r.kind != "dense"]
        runner = min(others, key=lambda r: (r.step_s, _aggressiveness(r)), default=None)
        tail = (
            f": the fastest compressor, {_constructor(runner)}, takes {_ms(runner.step_s)}"
            if runner
            else ""
        )
        return (
            f"Use Dense() (or plain DistributedDataParallel): {_ms(best.step_s)} per step. "
            f"Compression costs more than it saves here{tail}."
        )
    if best.kind in ("bf16", "fp16"):
        sparse = [r.density for r in rows if r.kind == "topk"]
        tail = f" at densities down to {_pct(min(sparse))}" if sparse else ""
        return (
            f"Use {best.compressor}: {_ms(best.step_s)} per step against {_ms(dense.step_s)} "
            f"dense. Sparse compression does not beat it{tail} at W={world_size}."
        )
    text = (
        f"Use {_constructor(best)} with error_feedback=True: {_ms(best.step_s)} per step against "
        f"{_ms(dense.step_s)} dense fp32 ({dense.step_s / best.step_s:.1f}x) and "
        f"{_ms(bf16.step_s)} for Cast(torch.bfloat16)."
    )
    gentler = [
        r
        for r in candidates
        if r.kind in ("topk", "threshold")
        and r.density > best.density
        and r.step_s <= 1.1 * best.step_s
    ]
    if gentler:
        other = min(gentler, key=_aggressiveness)
        text += (
            f" {_constructor(other)} is within "
            f"{100 * (other.step_s / best.step_s - 1):.0f}% of it ({_ms(other.step_s)}) and "
            f"sends {other.density / best.density:.3g}x more of each gradient."
        )
    return (
        text + " Check accuracy against a dense run; if it drops, Cast(torch.bfloat16) is the "
        "safe choice."
    )


def format_plan(
    params: float,
    world_size: int,
    bandwidth: float,
    latency: float = 0.0,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    bucket_cap_mb: float | None = None,
    pair_bytes: float = PAIR_BYTES,
    **step_model,
) -> str:
    """The planner's report as text: the table, the crossover and the recommendation.

    ``step_model``: :func:`plan`'s keyword arguments (``threshold_densities``,
    ``compress_ns_per_element``, ``compute_seconds``, ``backward_seconds``, ``overlap``,
    ``host_bandwidth``)."""
    rows = plan(
        params, world_size, bandwidth, latency, densities, bucket_cap_mb, pair_bytes, **step_model
    )
    dense_cap, sparse_cap = bucket_caps(bucket_cap_mb, params)
    buckets = num_buckets(params, dense_cap)
    sparse_buckets = num_buckets(params, sparse_cap)
    described = f"{buckets} bucket(s) of <= {dense_cap:g} MiB"
    if sparse_cap != dense_cap:
        described += f" (Dense, Cast), {sparse_buckets} of <= {sparse_cap:g} MiB (TopK, Threshold)"
    stepped = any(r.step_s != r.time_s for r in rows)
    lines = [
        f"{params:.4g} gradient elements, W={world_size} ranks, "
        f"{bandwidth * 8 / 1e9:.4g} Gbit/s ({bandwidth / 1e9:.4g} GB/s) per rank, "
        f"latency {latency * 1e6:.4g} us per message, {described}",
    ]
    if stepped:
        compute = step_model.get("compute_seconds", 0.0)
        backward = step_model.get("backward_seconds", 0.0)
        overlap = step_model.get("overlap", 1.0)
        hidden = (
            f" not hidden behind {overlap:g} x backward {_ms(backward)}"
            if backward and overlap
            else ""
        )
        host = step_model.get("host_bandwidth")
        transport = f" + bytes / host {host * 8 / 1e9:.4g} Gbit/s" if host else ""
        lines.append(
            f"step = compute {_ms(compute)} + compress/aggregate{transport} + "
            f"communication{hidden} (the last bucket's never hides)"
        )
    lines += [
        "",
        f"| {'compressor':<15} | {'bytes/rank/step':>15} | {'time/step':>10} | {'vs dense':>8} "
        + (f"| {'compress':>8} | {'step':>8} " if stepped else "")
        + "| note |",
        f"|{'-' * 17}|{'-' * 16}:|{'-' * 11}:|{'-' * 9}:|"
        + (f"{'-' * 9}:|{'-' * 9}:|" if stepped else "")
        + "------|",
    ]
    for r in rows:
        note = ""
        if r.above_crossover:
            note = "above crossover: sparsecomm sends these buckets dense fp32"
            if r.name.startswith("Threshold"):
                note += ", after the count all-gather"
        elif r.name.startswith("Threshold"):
            note = "density = largest over ranks (padded); + count all-gather"
        extra = f"{_ms(r.compress_s):>8} | {_ms(r.step_s):>8} | " if stepped else ""
        lines.append(
            f"| {r.name:<15} | {_bytes(r.bytes_per_rank):>15} | {_ms(r.time_s):>10} | "
            f"{r.speedup:>7.2f}x | {extra}{note} |"
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
                sparse_buckets=sparse_buckets,
            )
            lines.append(
                f"In time, with {latency * 1e6:.4g} us latency (the all-gathers pay "
                f"{(world_size - 1) * sparse_buckets} latency terms, the all-reduces "
                f"{2 * (world_size - 1) * buckets}): "
                + (
                    f"{_pct(time_cross)}."
                    if time_cross < 1
                    else "none: at every density the all-gather of the pairs takes less "
                    "time than the dense all-reduce, whose latency terms cost more than all "
                    "the bytes (the rows above add Threshold's count all-gather, and send "
                    "dense above the byte crossover)."
                )
            )
        lines.append(
            f"Against Cast fp16/bf16 (2-byte all-reduce) the sparse compressors pay below "
            f"{_pct(half_cross)} (= 2*2/(W*{pair_bytes:g}) in bytes"
            + (" = 1/(2W))." if pair_bytes == 2 * FP32_BYTES else ").")
        )
    lines.append("")
    lines.append("Recommendation: " + recommend(rows, world_size))
    return "\n".join(lines)


# --------------------------------------------------------------------------- measuring


def measure_compress_costs(
    params: float,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    threshold_densities: Sequence[float] | None = None,
    bucket_cap_mb: float | None = None,
    *,
    max_elements: float = 2e7,
    repeats: int = 3,
    device: str | None = None,
    half_values: bool = False,
) -> dict[str, float]:
    """Time each planner row's compression + aggregation on this machine, in ns per element.

    Runs ``CompressedOptimizer(..., profile=True)`` without a process group (one rank) on
    ``min(params, max_elements)`` normally distributed gradient elements in buckets of
    ``bucket_cap_mb`` (None: each compressor's default, :func:`bucket_caps`), and returns
    ``{row name: (compress_seconds + aggregate_seconds) / n}`` in nanoseconds (median of
    ``repeats`` steps after one warm-up, each from a zero residual).
    Threshold's ``t`` sends the row's density of a normal gradient. Aggregation here adds one
    message, not W: at the densities that pay, the W-1 others are a small part of it.
    CUDA when available (or ``device``), else CPU. ``half_values``: the TopK rows round
    their values to bfloat16, as ``TopK(value_dtype=torch.bfloat16)`` does (``--half-values``).
    Needs torch; must not run inside an initialized process group.
    """
    import torch
    import torch.distributed as dist

    from .compressors import Cast, Dense, Threshold, TopK
    from .optimizer import CompressedOptimizer

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "measure_compress_costs runs on one process without a process group; call it "
            "before torch.distributed.init_process_group (or from python -m sparsecomm.plan)"
        )
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if not float(max_elements) >= 1:
        raise ValueError(
            f"max_elements (--measure-max-elements) must be >= 1, got {max_elements!r}"
        )
    n = int(min(float(params), float(max_elements)))
    if n < 1:
        raise ValueError(f"params must be >= 1, got {params!r}")
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    flat = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(where)
    split: dict[float, tuple[list, list]] = {}  # per cap: the buckets' gradients and tensors

    def buckets_of(cap: float) -> tuple[list, list]:
        if cap not in split:
            grads = list(flat.split(int(_per_bucket(n, cap))))
            split[cap] = grads, [torch.zeros_like(g, requires_grad=True) for g in grads]
        return split[cap]

    dense_cap, sparse_cap = bucket_caps(bucket_cap_mb, float(params))
    compressors = [
        ("Dense fp32", Dense()),
        ("Cast fp16", Cast(torch.float16)),
        ("Cast bf16", Cast(torch.bfloat16)),
    ]
    value_dtype = torch.bfloat16 if half_values else torch.float32
    compressors += [(f"TopK {_pct(d)}", TopK(d, value_dtype=value_dtype)) for d in densities]
    normal = statistics.NormalDist()
    compressors += [
        (f"Threshold {_pct(d)}", Threshold(normal.inv_cdf(1 - d / 2)))
        for d in (densities if threshold_densities is None else threshold_densities)
    ]
    costs = {}
    for name, compressor in compressors:
        cap = sparse_cap if isinstance(compressor, (TopK, Threshold)) else dense_cap
        grads, tensors = buckets_of(cap)
        samples = []
        for repeat in range(repeats + 1):
            optimizer = CompressedOptimizer(
                torch.optim.SGD(tensors, lr=0.0),
                compressor,
                bucket_cap_mb=cap,
                min_compress_numel=0,
                profile=True,
            )
            for tensor, grad in zip(tensors, grads):
                tensor.grad = grad.clone()
            optimizer.step()
            stats = optimizer.last_stats
            if repeat:
                samples.append(stats.compress_seconds + stats.aggregate_seconds)
        costs[name] = statistics.median(samples) / n * 1e9
    return costs


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
            "by the ring cost model, and (given compute and compression figures) the step "
            "time; prints the crossover density and a recommendation."
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
        "--threshold-densities",
        default=None,
        help="comma-separated densities for the Threshold rows (default: --densities)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket size in MiB, for every row; latency is paid per bucket (default: "
        "CompressedOptimizer's, 25 for Dense and Cast, 100 for TopK and Threshold (16 "
        "buckets' worth for a model over 1.6 GiB); under "
        "ddp_comm_hook pass DDP's, 25 by default)",
    )
    parser.add_argument(
        "--half-values",
        action="store_true",
        help="TopK's values sent as bfloat16, as TopK(value_dtype=torch.bfloat16) sends "
        "them: 6-byte pairs instead of 8 (Threshold's stay 8)",
    )
    parser.add_argument(
        "--compute-seconds",
        default="0",
        help="forward + backward + optimizer step without any exchange: 0.8s, 350ms",
    )
    parser.add_argument(
        "--backward-seconds",
        default="0",
        help="the part of --compute-seconds communication can hide behind (default 0)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=1.0,
        help="fraction of --backward-seconds that hides communication (default 1: a NIC or "
        "GPU moves the bytes; about 0.6 measured for gloo on 2 CPU cores; 0 for "
        "CompressedOptimizer(overlap=False)); the last bucket never hides",
    )
    parser.add_argument(
        "--host-bandwidth",
        default=None,
        help="per-rank rate at which the computing processor itself moves the bytes (gloo "
        "over TCP on CPU: the unshaped loopback's rate, e.g. 8Gbit); each byte then costs "
        "1/host-bandwidth seconds that never hide (default: none)",
    )
    parser.add_argument(
        "--compress-ns-per-element",
        default=None,
        help="compression + aggregation cost per gradient element in ns: one number, or "
        "kind=ns pairs (dense, cast, fp16, bf16, topk, threshold), e.g. topk=9,cast=1.5",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time the compressors on this machine (CUDA if present) on a tensor of the "
        "model's size (at most --measure-max-elements); --compress-ns-per-element overrides",
    )
    parser.add_argument(
        "--measure-max-elements",
        type=float,
        default=2e7,
        help="--measure times at most this many elements and scales per element (default 2e7)",
    )
    return parser


def _fractions(text: str, flag: str) -> list[float]:
    try:
        return [float(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} must be comma-separated fractions, e.g. 0.001,0.01"
        ) from None


def _seconds(text: str, flag: str) -> float:
    try:
        return parse_latency(text)
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} is not understood; write a time with its unit, e.g. 0.8s or 350ms"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        params = parse_count(args.params)
        bandwidth = parse_bandwidth(args.bandwidth)
        latency = parse_latency(args.latency)
        densities = _fractions(args.densities, "densities")
        threshold_densities = (
            None
            if args.threshold_densities is None
            else _fractions(args.threshold_densities, "threshold densities")
        )
        pair_bytes = 6 if args.half_values else PAIR_BYTES
        given = (
            None
            if args.compress_ns_per_element is None
            else parse_compress_costs(args.compress_ns_per_element)
        )
        step_model = dict(
            threshold_densities=threshold_densities,
            compute_seconds=_seconds(args.compute_seconds, "--compute-seconds"),
            backward_seconds=_seconds(args.backward_seconds, "--backward-seconds"),
            overlap=args.overlap,
            host_bandwidth=None
            if args.host_bandwidth is None
            else parse_bandwidth(args.host_bandwidth),
        )
        # Validate everything before a measurement that can take a while.
        names = [
            r.name
            for r in plan(
                params,
                args.world_size,
                bandwidth,
                latency,
                densities,
                args.bucket_cap_mb,
                pair_bytes,
                compress_ns_per_element=given,
                **step_model,
            )
        ]
        costs = given
        measured_text = ""
        if args.measure:
            measured = measure_compress_costs(
                params,
                densities,
                threshold_densities,
                args.bucket_cap_mb,
                max_elements=args.measure_max_elements,
                half_values=args.half_values,
            )
            costs = {}
            for name in names:
                kind = name.split()[0].lower()
                kind = {"dense": "dense", "cast": name.split()[1]}.get(kind, kind)
                explicit = _cost_for(name, kind, given)
                costs[name] = measured.get(name, 0.0) if explicit is None else explicit
            n = int(min(params, args.measure_max_elements))
            measured_text = (
                f"Measured here (compress + aggregate, {n:.3g} elements, ns per element): "
                + ", ".join(f"{name} {ns:.3g}" for name, ns in measured.items())
                + "\n"
            )
        text = format_plan(
            params,
            args.world_size,
            bandwidth,
            latency,
            densities,
            args.bucket_cap_mb,
            pair_bytes,
            compress_ns_per_element=costs,
            **step_model,
        )
    except ValueError as error:
        parser.error(str(error))  # exits with status 2 and the usage line
    print(measured_text + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
