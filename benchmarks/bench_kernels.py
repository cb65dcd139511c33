"""Kernel benchmarks on one GPU: sparsecomm's Triton kernels beside the torch baselines.

Every row is measured in this process, on this GPU: median milliseconds (20th-80th
percentile beside it) of ``triton.testing.do_bench``, or, where a call changes its own
input (error feedback rewrites the residual, so the k of a threshold would drift from call
to call), the same method with the residual restored before each timed call, untimed.
Each operation has a byte floor: the bytes it must move, over the device-copy bandwidth
measured in the same run (a copy of n fp32, bytes read + written over time).

    python benchmarks/bench_kernels.py            # prints a markdown table
    OUT=results python benchmarks/bench_kernels.py  # also writes results/bench_kernels.md

BENCH_SIZES (e.g. "1e6,1e7") and BENCH_SWEEP=0 shorten a run; BENCH_BUDGET_S (default 240)
skips the later sections once a run has taken that long. BENCH_DEVICE=cpu with
TRITON_INTERPRET=1 and small sizes is a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import datetime
import math
import os
import time

import torch
import triton
from sparsecomm.triton_kernels import _indirect
from sparsecomm.triton_kernels import adam_score as adam_module
from sparsecomm.triton_kernels import cast as cast_module
from sparsecomm.triton_kernels import scatter_add as scatter_module
from sparsecomm.triton_kernels import threshold as threshold_module
from sparsecomm.triton_kernels.cast import cast_compress, cast_compress_ref
from sparsecomm.triton_kernels.scatter_add import scatter_add, scatter_add_ref
from sparsecomm.triton_kernels.threshold import threshold_compress, threshold_compress_ref
from triton.testing import do_bench

try:
    from sparsecomm.triton_kernels.topk import topk_compress, topk_compress_ref
except ImportError as error:  # another engineer's module, possibly not there yet
    topk_compress = None
    TOPK_MISSING = f"topk_compress not importable ({error})"
else:
    TOPK_MISSING = ""

SIZES = [int(float(s)) for s in os.environ.get("BENCH_SIZES", "1e6,1e7,1e8,1e9").split(",")]
DENSITIES = [0.001, 0.01]
WORLD_SIZE = 8
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "240"))
START = time.monotonic()
QUANTILES = [0.5, 0.2, 0.8]
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"

rows: list[dict] = []
notes: list[str] = []


def bench(fn, setup=None):
    """(median, p20, p80) milliseconds of ``fn``; ``setup`` runs untimed before each call."""
    if not ON_GPU:  # smoke test: one timed call
        if setup is not None:
            setup()
        begin = time.perf_counter()
        fn()
        ms = (time.perf_counter() - begin) * 1e3
        return ms, ms, ms
    if setup is None:
        return tuple(do_bench(fn, quantiles=QUANTILES))
    # do_bench's method (flush L2, one pair of events per call) with an untimed setup.
    cache = torch.empty(64 * 2**20, dtype=torch.int32, device=DEVICE)
    setup()
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    estimate = []
    for _ in range(3):
        setup()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate.append(begin.elapsed_time(end))
    repeats = max(5, min(200, int(100 / max(min(estimate), 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        setup()
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)])
    return tuple(torch.quantile(times, torch.tensor(QUANTILES)).tolist())


def record(op, n, k, provider, fn, floor_bytes, copy_bw, setup=None, torch_ms=None, exact=""):
    """Time one provider and add its row; returns its median ms (None if it failed).

    ``exact`` says whether this run's output had the reference's bits ("yes" / "NO")."""
    try:
        ms, low, high = bench(fn, setup)
    except torch.cuda.OutOfMemoryError:
        rows.append(dict(op=op, n=n, k=k, provider=provider, ms=None, note="out of memory"))
        empty_cache()
        return None
    floor_ms = floor_bytes / copy_bw * 1e3
    rows.append(
        dict(
            op=op,
            n=n,
            k=k,
            provider=provider,
            ms=ms,
            low=low,
            high=high,
            gbps=floor_bytes / (ms * 1e-3) / 1e9,
            x_floor=ms / floor_ms,
            speedup=None if torch_ms is None else torch_ms / ms,
            floor_ms=floor_ms,
            exact=exact,
        )
    )
    return ms


def same_bits(*pairs) -> str:
    """Whether each (actual, expected) pair has the same bits; any NaN matches any NaN."""
    for actual, expected in pairs:
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return "NO (shape/dtype)"
        if actual.dtype.is_floating_point:
            bits = {4: torch.int32, 2: torch.int16}[actual.element_size()]
            differ = (actual.view(bits) != expected.view(bits)) & ~(
                actual.isnan() & expected.isnan()
            )
        else:
            differ = actual != expected
        if bool(differ.any()):
            return f"NO ({int(differ.sum())} differ)"
    return "yes"


def fmt_n(n):
    exponent = int(round(math.log10(n))) if n > 0 else 0
    return f"1e{exponent}" if 10**exponent == n else str(n)


def table() -> str:
    if ON_GPU:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = "CPU smoke test in Triton's interpreter: not a measurement"
    lines = [
        "# sparsecomm kernel benchmarks",
        "",
        f"- GPU: {device}, "
        f"torch {torch.__version__}, Triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "- ms: median of `triton.testing.do_bench` (p20-p80 in brackets); GB/s: the op's floor "
        "bytes over the time; x floor: time over (floor bytes / copy bandwidth of this run); "
        "the torch baseline's time over this row's; same bits: ours against the reference, "
        "checked in this run.",
        "- floors per element: threshold 12 B + 8 B per sent pair; top-k 16 B + 8 B per pair; "
        "EF cast 14 B (`tensor.half()`: 6 B); aggregation 4 B per output element + 8 B per "
        "received pair.",
    ]
    lines += [f"- {note}" for note in notes]
    lines += [
        "",
        "| op | n | k | provider | ms | GB/s | x floor | torch baseline ms / this ms | same bits "
        "as ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        k = "" if row["k"] is None else fmt_n(row["k"]) if row["k"] else "0"
        if row["ms"] is None:
            lines.append(
                f"| {row['op']} | {fmt_n(row['n'])} | {k} | {row['provider']} | "
                f"{row['note']} | | | | |"
            )
            continue
        speedup = "" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(
            f"| {row['op']} | {fmt_n(row['n'])} | {k} | {row['provider']} | "
            f"{row['ms']:.4f} [{row['low']:.4f}-{row['high']:.4f}] | {row['gbps']:.0f} | "
            f"{row['x_floor']:.2f} | {speedup} | {row.get('exact', '')} |"
        )
    return "\n".join(lines) + "\n"


def publish():
    text = table()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_kernels.md"), "w") as f:
            f.write(text)
    return text


def over_budget() -> bool:
    return time.monotonic() - START > BUDGET_S


def fits(n_bytes: int) -> bool:
    if not ON_GPU:
        return True
    free, _ = torch.cuda.mem_get_info()
    return n_bytes * 1.3 < free


def empty_cache():
    if ON_GPU:
        torch.cuda.empty_cache()


def copy_bandwidth(n):
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    ms, low, high = bench(lambda: dst.copy_(src))
    bw = 8 * n / (ms * 1e-3)
    rows.append(
        dict(
            op="copy",
            n=n,
            k=None,
            provider="dst.copy_(src)",
            ms=ms,
            low=low,
            high=high,
            gbps=bw / 1e9,
            x_floor=1.0,
            speedup=None,
            floor_ms=ms,
        )
    )
    return bw


def threshold_for(acc, density):
    """A threshold that about ``density`` of ``|acc|`` reaches, from a sample."""
    sample = acc[torch.randint(acc.numel(), (min(acc.numel(), 1 << 22),), device=DEVICE)].abs()
    rank = max(1, min(sample.numel(), int(round((1 - density) * sample.numel()))))
    return sample.kthvalue(rank).values.item()


def torch_topk_pipeline(grad, residual, k):
    """What a GRACE-style user runs: add, topk of abs, gather, residual update."""
    acc = grad + residual
    indices = acc.abs().topk(k, sorted=False).indices
    values = acc[indices]
    residual.copy_(acc)
    residual[indices] = 0.0
    return indices, values


def dgc_sampled(grad, residual, density):
    """DGC-style: the threshold from a 1% random sample, then nonzero (about k, not k)."""
    acc = grad + residual
    magnitude = acc.abs()
    sample = magnitude[torch.randint(acc.numel(), (max(1, acc.numel() // 100),), device=DEVICE)]
    threshold = sample.topk(max(1, math.ceil(density * sample.numel()))).values[-1]
    keep = magnitude >= threshold
    indices = keep.nonzero().flatten()
    values = acc[indices]
    residual.copy_(acc.masked_fill(keep, 0.0))
    return indices, values


def messages(n, k, world_size, seed):
    """world_size rows of k unique ascending indices (one random pick per stride of n/k)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    stride = n // k
    base = torch.arange(k, device=DEVICE, dtype=torch.int64) * stride
    offsets = torch.randint(stride, (world_size, k), device=DEVICE, generator=gen)
    indices = (base + offsets).to(torch.int32)
    values = torch.randn(world_size, k, device=DEVICE, generator=gen)
    return indices.contiguous(), values


class Bucket:
    """A gradient and a residual of n elements, and the residual to restore between calls."""

    def __init__(self, n, seed):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.n = n
        self.grad = torch.randn(n, device=DEVICE, generator=gen)
        self.residual0 = torch.randn(n, device=DEVICE, generator=gen) * 0.5
        self.residual = self.residual0.clone()

    def reset(self):
        self.residual.copy_(self.residual0)


def bench_threshold(bucket, density, copy_bw):
    n, grad, residual = bucket.n, bucket.grad, bucket.residual
    threshold = threshold_for(grad + bucket.residual0, density)
    bucket.reset()
    indices, values, count = threshold_compress(grad, residual, threshold)
    count = int(count)
    ours = (indices[:count], values[:count], residual.clone())
    bucket.reset()
    ref = threshold_compress_ref(grad, residual, threshold)[:2] + (residual.clone(),)
    exact = same_bits(*zip(ours, ref))
    del indices, values, ours, ref
    floor = 12 * n + 8 * count
    torch_ms = record(
        "threshold",
        n,
        count,
        "torch: g+r, abs>=t, nonzero, gather, residual",
        lambda: threshold_compress_ref(grad, residual, threshold),
        floor,
        copy_bw,
        setup=bucket.reset,
    )
    record(
        "threshold",
        n,
        count,
        "ours: threshold_compress",
        lambda: threshold_compress(grad, residual, threshold),
        floor,
        copy_bw,
        setup=bucket.reset,
        torch_ms=torch_ms,
        exact=exact,
    )


def bench_topk(bucket, density, copy_bw):
    n, grad, residual = bucket.n, bucket.grad, bucket.residual
    k = max(1, math.ceil(density * n))
    floor = 16 * n + 8 * k
    torch_ms = record(
        "top-k",
        n,
        k,
        "torch: g+r, topk(abs), gather, residual",
        lambda: torch_topk_pipeline(grad, residual, k),
        floor,
        copy_bw,
        setup=bucket.reset,
    )
    if topk_compress is not None:
        try:
            exact = ""
            if n <= 10**8:  # the reference's int64 keys are heavy beyond
                bucket.reset()
                ours = topk_compress(grad, residual, k) + (residual.clone(),)
                bucket.reset()
                ref = topk_compress_ref(grad, residual, k) + (residual.clone(),)
                exact = same_bits(*zip(ours, ref))
                del ours, ref
            record(
                "top-k",
                n,
                k,
                "ours: topk_compress",
                lambda: topk_compress(grad, residual, k),
                floor,
                copy_bw,
                setup=bucket.reset,
                torch_ms=torch_ms,
                exact=exact,
            )
            # What a CUDA graph of the engine runs: the same kernels, reading where the
            # buffers are from an addresses table (no alignment known at compile time).
            table = _indirect.table(grad.device, grad, residual)
            bucket.reset()
            direct = topk_compress(grad, residual, k) + (residual.clone(),)
            bucket.reset()
            through = topk_compress(grad, residual, k, addresses=table) + (residual.clone(),)
            exact = same_bits(*zip(through, direct))
            del direct, through
            record(
                "top-k",
                n,
                k,
                "ours: topk_compress, buffers through addresses",
                lambda: topk_compress(grad, residual, k, addresses=table),
                floor,
                copy_bw,
                setup=bucket.reset,
                torch_ms=torch_ms,
                exact=exact,
            )
        except Exception as error:  # report it and measure the rest
            message = f"failed: {type(error).__name__}: {error}"[:160]
            rows.append(
                dict(op="top-k", n=n, k=k, provider="ours: topk_compress", ms=None, note=message)
            )
    magnitude = (grad + bucket.residual0).abs()
    record(
        "top-k",
        n,
        k,
        "torch.topk(abs) alone",
        lambda: magnitude.topk(k, sorted=False),
        floor,
        copy_bw,
        torch_ms=torch_ms,
    )
    # The sort does not depend on k: once per size. Keys, int64 indices and their copies.
    if density == DENSITIES[-1] and fits(32 * n):
        record(
            "top-k",
            n,
            k,
            "torch.sort(abs) alone (SINGA)",
            lambda: magnitude.sort(descending=True),
            floor,
            copy_bw,
            torch_ms=torch_ms,
        )
    record(
        "top-k",
        n,
        k,
        "DGC: 1% sample threshold + nonzero (about k)",
        lambda: dgc_sampled(grad, residual, density),
        floor,
        copy_bw,
        setup=bucket.reset,
        torch_ms=torch_ms,
    )


def bench_adam_topk(bucket, density, copy_bw, members=4):
    """``TopK(select="adam")``'s choice on one bucket of ``members`` equal parameters: the
    score kernel (``acc = grad + residual`` and ``|acc| / (sqrt(max(v, mean v)) + eps)``), the
    top-k kernels on the score, the take-and-zero, against the same in torch ops
    (``adam_topk_ref``). Floor: read grad, residual and v, write acc and the score, read the
    score for the top-k, read and write the k taken."""
    n, grad, residual = bucket.n, bucket.grad, bucket.residual
    k = max(1, math.ceil(density * n))
    gen = torch.Generator(device=DEVICE).manual_seed(n + 1)
    numels = [n // members] * (members - 1) + [n - (n // members) * (members - 1)]
    variances = [torch.rand(m, device=DEVICE, generator=gen) * 1e-4 for m in numels]
    group = adam_module.Members(numels, variances, [1e-8] * members)
    work = torch.empty_like(grad)

    def restore():
        work.copy_(grad)

    floor = 24 * n + 16 * k
    restore()
    ours = adam_module.adam_topk(work, residual, group, k) + (work.clone(),)
    restore()
    ref = adam_module.adam_topk_ref(work, residual, group, k) + (work.clone(),)
    exact = same_bits(*zip(ours, ref))
    del ours, ref
    torch_ms = record(
        "adam top-k",
        n,
        k,
        "torch: adam_topk_ref (score, topk_compress_ref, take)",
        lambda: adam_module.adam_topk_ref(work, residual, group, k),
        floor,
        copy_bw,
        setup=restore,
    )
    record(
        "adam top-k",
        n,
        k,
        f"ours: adam_topk ({members} members)",
        lambda: adam_module.adam_topk(work, residual, group, k),
        floor,
        copy_bw,
        setup=restore,
        torch_ms=torch_ms,
        exact=exact,
    )


def bench_aggregate(n, density, copy_bw):
    k = max(1, math.ceil(density * n))
    indices, values = messages(n, k, WORLD_SIZE, seed=1)
    flat_indices = indices.flatten().to(torch.int64)
    flat_values = values.flatten()
    dense = torch.zeros(n, device=DEVICE)
    floor = 4 * n + 8 * WORLD_SIZE * k
    pairs = WORLD_SIZE * k
    exact = same_bits(
        (
            scatter_add(indices, values, None, n, 1 / WORLD_SIZE),
            scatter_add_ref(indices, values, None, n, 1 / WORLD_SIZE),
        )
    )
    torch_ms = record(
        "aggregate W=8",
        n,
        pairs,
        "torch: index_add_ alone (atomics, not deterministic)",
        lambda: dense.index_add_(0, flat_indices, flat_values),
        floor,
        copy_bw,
    )
    record(
        "aggregate W=8",
        n,
        pairs,
        "torch: scatter_add_ref (loop over ranks)",
        lambda: scatter_add_ref(indices, values, None, n, 1 / WORLD_SIZE),
        floor,
        copy_bw,
        torch_ms=torch_ms,
    )
    record(
        "aggregate W=8",
        n,
        pairs,
        "ours: scatter_add (deterministic)",
        lambda: scatter_add(indices, values, None, n, 1 / WORLD_SIZE),
        floor,
        copy_bw,
        torch_ms=torch_ms,
        exact=exact,
    )


def bench_cast(bucket, copy_bw):
    n, grad, residual = bucket.n, bucket.grad, bucket.residual
    bucket.reset()
    floor = 14 * n
    torch_ms = record(
        "cast",
        n,
        None,
        "torch fp16: cast_compress_ref (EF pipeline)",
        lambda: cast_compress_ref(grad, residual, torch.float16, 0.125),
        floor,
        copy_bw,
    )
    record(
        "cast",
        n,
        None,
        "torch fp16: tensor.half() (no EF; floor 6 B)",
        grad.half,
        6 * n,
        copy_bw,
        torch_ms=torch_ms,
    )
    for dtype in (torch.float16, torch.bfloat16):
        bucket.reset()
        ours = (cast_compress(grad, residual, dtype, 0.125), residual.clone())
        bucket.reset()
        ref = (cast_compress_ref(grad, residual, dtype, 0.125), residual.clone())
        exact = same_bits(*zip(ours, ref))
        del ours, ref
        record(
            "cast",
            n,
            None,
            f"ours {str(dtype)[6:]}: cast_compress",
            lambda dtype=dtype: cast_compress(grad, residual, dtype, 0.125),
            floor,
            copy_bw,
            torch_ms=torch_ms,
            exact=exact,
        )
    out = torch.empty(n, dtype=torch.bfloat16, device=grad.device)
    table = _indirect.table(grad.device, grad, residual, out)
    bucket.reset()
    direct = (cast_compress(grad, residual, torch.bfloat16, 0.125).clone(), residual.clone())
    bucket.reset()
    cast_compress(grad, residual, torch.bfloat16, 0.125, None, out, addresses=table)
    exact = same_bits(*zip((out, residual.clone()), direct))
    del direct
    record(
        "cast",
        n,
        None,
        "ours bfloat16: cast_compress, buffers through addresses",
        lambda: cast_compress(grad, residual, torch.bfloat16, 0.125, None, out, addresses=table),
        floor,
        copy_bw,
        torch_ms=torch_ms,
        exact=exact,
    )


def bench_size(n):
    copy_bw = copy_bandwidth(n)
    bucket = Bucket(n, seed=n)
    for density in DENSITIES:
        if over_budget():
            notes.append(f"skipped density {density} at n={fmt_n(n)}: time budget")
            break
        bench_threshold(bucket, density, copy_bw)
        empty_cache()
        bench_topk(bucket, density, copy_bw)
        empty_cache()
        if density == 0.01 and n <= 10**8 and fits(24 * n):  # (the reference's int64 keys)
            bench_adam_topk(bucket, density, copy_bw)
            empty_cache()
        bench_aggregate(n, density, copy_bw)
        empty_cache()
        publish()
    if not over_budget():
        bench_cast(bucket, copy_bw)
    publish()


def bench_bucket_step(n, density=0.01):
    """One TopK(0.01) bucket step, communication left out: compress this rank's bucket, then
    aggregate 8 messages (made here, from two gradients and eight residuals) into the average."""
    k = math.ceil(density * n)
    copy_bw = copy_bandwidth(n)
    bucket = Bucket(n, seed=7)
    other_grad = torch.randn(n, device=DEVICE)
    floor = 16 * n + 8 * k + 4 * n + 8 * WORLD_SIZE * k
    torch_messages = [
        torch_topk_pipeline(bucket.grad if r % 2 else other_grad, bucket.residual0 * (1 + r), k)
        for r in range(WORLD_SIZE)
    ]
    torch_indices = torch.cat([message[0] for message in torch_messages])
    torch_values = torch.cat([message[1] for message in torch_messages])

    def torch_step():
        torch_topk_pipeline(bucket.grad, bucket.residual, k)
        average = torch.zeros(n, device=DEVICE).index_add_(0, torch_indices, torch_values)
        return average.mul_(1 / WORLD_SIZE)

    torch_ms = record(
        "bucket step TopK(0.01)",
        n,
        k,
        "torch: topk pipeline + zeros, index_add_, mul",
        torch_step,
        floor,
        copy_bw,
        setup=bucket.reset,
    )
    if topk_compress is None:
        notes.append(f"bucket step of ours skipped: {TOPK_MISSING}")
        return
    ours = [
        topk_compress(bucket.grad if r % 2 else other_grad, bucket.residual0 * (1 + r), k)
        for r in range(WORLD_SIZE)
    ]
    indices = torch.stack([message[0] for message in ours])
    values = torch.stack([message[1] for message in ours])

    def our_step():
        topk_compress(bucket.grad, bucket.residual, k)
        return scatter_add(indices, values, None, n, 1 / WORLD_SIZE)

    record(
        "bucket step TopK(0.01)",
        n,
        k,
        "ours: topk_compress + scatter_add",
        our_step,
        floor,
        copy_bw,
        setup=bucket.reset,
        torch_ms=torch_ms,
    )


class patched:
    """Sets module constants for the duration of a ``with`` block."""

    def __init__(self, module, **values):
        self.module, self.values = module, values

    def __enter__(self):
        self.saved = {name: getattr(self.module, name) for name in self.values}
        for name, value in self.values.items():
            setattr(self.module, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(self.module, name, value)


def sweep(n):
    """Block sizes of our kernels beside the chosen ones (module constants, patched here)."""
    copy_bw = copy_bandwidth(n)
    bucket = Bucket(n, seed=11)
    grad, residual = bucket.grad, bucket.residual
    threshold = threshold_for(grad + bucket.residual0, 0.01)
    for block, warps in [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]:
        if over_budget():
            return
        config = f"BLOCK_SIZE={block} num_warps={warps}"
        with patched(threshold_module, BLOCK_SIZE=block, NUM_WARPS=warps):
            record(
                "sweep threshold 1%",
                n,
                None,
                config,
                lambda: threshold_compress(grad, residual, threshold),
                12 * n,
                copy_bw,
                setup=bucket.reset,
            )
        with patched(cast_module, BLOCK_SIZE=block, NUM_WARPS=warps):
            record(
                "sweep cast fp16",
                n,
                None,
                config,
                lambda: cast_compress(grad, residual, torch.float16, 0.125),
                14 * n,
                copy_bw,
            )
        publish()
    k = n // 100
    indices, values = messages(n, k, WORLD_SIZE, seed=2)
    for tile, pairs, warps in [
        (2048, 128, 4),
        (4096, 128, 4),
        (4096, 128, 2),
        (4096, 64, 2),
        (4096, 256, 4),
        (8192, 128, 4),
        (8192, 256, 8),
    ]:
        if over_budget():
            return
        with patched(scatter_module, TILE_SIZE=tile, PAIR_BLOCK=pairs, NUM_WARPS=warps):
            record(
                "sweep aggregate W=8 1%",
                n,
                WORLD_SIZE * k,
                f"TILE_SIZE={tile} PAIR_BLOCK={pairs} num_warps={warps}",
                lambda: scatter_add(indices, values, None, n, 1 / WORLD_SIZE),
                4 * n + 8 * WORLD_SIZE * k,
                copy_bw,
            )
        publish()


def main():
    if ON_GPU and not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA device (or BENCH_DEVICE=cpu to smoke-test)")
    if TOPK_MISSING:
        notes.append(f"top-k rows of ours skipped: {TOPK_MISSING}")
    step_n = 10**8 if ON_GPU else 10**4
    # The bucket step (at 1e8) before the largest size, the block-size sweep last: what a
    # time budget cuts off should be what matters least.
    plan = [("size", n) for n in SIZES if n <= step_n] + [("step", step_n)]
    plan += [("size", n) for n in SIZES if n > step_n]
    if os.environ.get("BENCH_SWEEP", "1") != "0":
        plan.append(("sweep", step_n))
    for what, n in plan:
        if over_budget():
            notes.append(f"skipped {what} at n={fmt_n(n)}: time budget of {BUDGET_S:.0f} s spent")
            continue
        # g, r, the saved r, the threshold's staging and outputs, the sort's buffers.
        if not fits(48 * n):
            notes.append(f"skipped {what} at n={fmt_n(n)}: does not fit in free GPU memory")
            continue
        {"size": bench_size, "step": bench_bucket_step, "sweep": sweep}[what](n)
        empty_cache()
        publish()
        print(f"# {what} n={fmt_n(n)} done at {time.monotonic() - START:.0f} s", flush=True)
    print(publish())


if __name__ == "__main__":
    main()
