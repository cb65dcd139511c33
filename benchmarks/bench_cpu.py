"""CPU benchmarks: the fast CPU paths (``*_cpu``) beside the torch references (``*_ref``).

Every row is measured in this process on this CPU: nanoseconds per element (of the input
bucket, or of the dense output for the scatter-add) as the median of timed calls, and GB/s
as the operation's floor bytes over that time. Error feedback rewrites the residual, so it
is restored before each timed call, untimed. Beside them, as the bandwidth reference, a plain
``torch.add(g, r, out=r)`` (12 bytes per element: the floor of an error-feedback pass) and a
``dst.copy_(src)`` (8 bytes), timed the same way.

Floors per element: top-k and threshold 12 B + 8 B per sent pair (top-k from a sum added
beforehand, as the bucket engine's CPU path calls it: 4 B + 8 B per pair); cast 14 B (fp32
grad and residual in, residual and fp16 out); scatter-add 4 B of output + 8 B per received
pair.

    python benchmarks/bench_cpu.py                  # prints a markdown table
    python benchmarks/bench_cpu.py --threads 1      # torch.set_num_threads(1) first
    OUT=results python benchmarks/bench_cpu.py      # also writes results/bench_cpu.md

BENCH_SIZES (default "1e6,1.4e7") and BENCH_REPEATS (default 15) change a run; --quick is a
smoke test (tiny sizes, one call each).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import time

import torch
from sparsecomm.triton_kernels.cast import cast_compress_cpu, cast_compress_ref
from sparsecomm.triton_kernels.scatter_add import scatter_add_cpu, scatter_add_ref
from sparsecomm.triton_kernels.threshold import threshold_compress_cpu, threshold_compress_ref
from sparsecomm.triton_kernels.topk import topk_compress_cpu, topk_compress_ref

DENSITIES = [0.01, 0.001]
WORLD_SIZE = 8


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def timed(fn, setup=None, repeats=15, budget_s=20.0) -> tuple[float, float]:
    """(median, fastest) seconds of ``fn`` over up to ``repeats`` calls (fewer once
    ``budget_s`` is spent, at least three); ``setup`` runs untimed before each call. One
    warm-up call."""
    if setup is not None:
        setup()
    fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        if setup is not None:
            setup()
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), min(times)


def same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.is_floating_point:
            view = {4: torch.int32, 2: torch.int16}[a.element_size()]
            return torch.equal(a.view(view), b.view(view))
        return torch.equal(a, b)
    return all(same_bits(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def measure(n: int, repeats: int, row) -> None:
    """Time every CPU path and its reference on one bucket of n elements; `row` records."""
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen)
    residual0 = torch.randn(n, generator=gen) * 0.5
    residual = residual0.clone()
    restore = lambda: residual.copy_(residual0)  # noqa: E731
    dst = torch.empty(n)

    seconds = timed(lambda: torch.add(grad, residual, out=residual), restore, repeats)
    row("bandwidth", n, "", "torch.add(g, r, out=r)", seconds, 12 * n)
    seconds = timed(lambda: dst.copy_(grad), None, repeats)
    row("bandwidth", n, "", "dst.copy_(src)", seconds, 8 * n)

    for density in DENSITIES:
        k = math.ceil(density * n)
        label = f"{k:.0e}".replace("e+0", "e")
        # top-k with error feedback
        restore()
        cpu = topk_compress_cpu(grad, residual, k), residual.clone()
        restore()
        ref = topk_compress_ref(grad, residual, k), residual.clone()
        bits = "yes" if same_bits(cpu, ref) else "NO"
        for provider, fn in [("topk_compress_cpu", topk_compress_cpu),
                             ("topk_compress_ref", topk_compress_ref)]:  # fmt: skip
            seconds = timed(lambda fn=fn, k=k: fn(grad, residual, k), restore, repeats)
            row("top-k, EF", n, label, provider, seconds, 12 * n + 8 * k,
                bits if provider.endswith("cpu") else "")  # fmt: skip

        # top-k from the sum already added (the bucket engine's CPU path adds the residual
        # as each gradient arrives): one read of the sum, the sent elements zeroed in it
        acc0 = grad + residual0
        acc = acc0.clone()
        cpu = topk_compress_cpu(acc, None, k, accumulated=True), acc.clone()
        bits = "yes" if same_bits(cpu, ref) else "NO"
        seconds = timed(
            lambda k=k, a=acc: topk_compress_cpu(a, None, k, accumulated=True),
            lambda a=acc, a0=acc0: a.copy_(a0), repeats,
        )  # fmt: skip
        row("top-k, sum added", n, label, "topk_compress_cpu(accumulated=True)", seconds,
            4 * n + 8 * k, bits)  # fmt: skip
        del acc, acc0

        # threshold at the magnitude that sends about k elements
        acc = (grad + residual0).abs()
        threshold = float(acc.kthvalue(n - k + 1).values)
        del acc
        restore()
        cpu = threshold_compress_cpu(grad, residual, threshold), residual.clone()
        restore()
        ref = threshold_compress_ref(grad, residual, threshold), residual.clone()
        bits = "yes" if same_bits(cpu, ref) else "NO"
        sent = int(cpu[0][2])
        for provider, fn in [("threshold_compress_cpu", threshold_compress_cpu),
                             ("threshold_compress_ref", threshold_compress_ref)]:  # fmt: skip
            seconds = timed(lambda fn=fn, t=threshold: fn(grad, residual, t), restore, repeats)
            row("threshold, EF", n, f"{sent}", provider, seconds, 12 * n + 8 * sent,
                bits if provider.endswith("cpu") else "")  # fmt: skip

        # deterministic aggregation of WORLD_SIZE messages of k pairs
        indices = torch.stack(
            [torch.randperm(n, generator=gen)[:k].sort().values for _ in range(WORLD_SIZE)]
        ).to(torch.int32)
        values = torch.randn(WORLD_SIZE, k, generator=gen)
        out = torch.empty(n)
        bits = same_bits(scatter_add_cpu(indices, values, None, n, 1 / WORLD_SIZE),
                         scatter_add_ref(indices, values, None, n, 1 / WORLD_SIZE))  # fmt: skip
        pairs = WORLD_SIZE * k
        seconds = timed(
            lambda i=indices, v=values, o=out: scatter_add_cpu(i, v, None, n, 1 / WORLD_SIZE,
                                                               out=o),
            None, repeats,
        )  # fmt: skip
        row(f"scatter-add W={WORLD_SIZE}", n, f"{pairs}", "scatter_add_cpu(out=)", seconds,
            4 * n + 8 * pairs, "yes" if bits else "NO")  # fmt: skip
        seconds = timed(
            lambda i=indices, v=values: scatter_add_ref(i, v, None, n, 1 / WORLD_SIZE),
            None, repeats,
        )  # fmt: skip
        row(f"scatter-add W={WORLD_SIZE}", n, f"{pairs}", "scatter_add_ref", seconds,
            4 * n + 8 * pairs)  # fmt: skip

    # fp16 cast with error feedback, scale 1/8 (W = 8)
    restore()
    cpu = cast_compress_cpu(grad, residual, torch.float16, 0.125), residual.clone()
    restore()
    ref = cast_compress_ref(grad, residual, torch.float16, 0.125), residual.clone()
    bits = "yes" if same_bits(cpu, ref) else "NO"
    for provider, fn in [("cast_compress_cpu", cast_compress_cpu),
                         ("cast_compress_ref", cast_compress_ref)]:  # fmt: skip
        seconds = timed(lambda fn=fn: fn(grad, residual, torch.float16, 0.125), restore,
                        repeats)  # fmt: skip
        row("fp16 cast, EF", n, "", provider, seconds, 14 * n,
            bits if provider.endswith("cpu") else "")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes_text = "1e4,2e4" if args.quick else os.environ.get("BENCH_SIZES", "1e6,1.4e7")
    sizes = [int(float(s)) for s in sizes_text.split(",")]
    repeats = 1 if args.quick else int(os.environ.get("BENCH_REPEATS", "15"))
    rows: list[tuple] = []
    load_before = load_average()

    def row(op, n, k, provider, seconds, floor_bytes, bits=""):
        median, best = seconds
        rows.append(
            (op, n, k, provider, median * 1e9 / n, best * 1e9 / n, floor_bytes / median / 1e9, bits)
        )

    for n in sizes:
        measure(n, repeats, row)

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"with {torch.get_num_threads()} intra-op threads, numpy "
        f"{__import__('numpy').__version__}, {now}",
        f"- load average (1, 5, 15 min) before: {load_before}; after: {load_average()}",
        "- ns/el: median over the timed calls (best: the fastest one), per element of the "
        "bucket (of the dense output for the scatter-add); GB/s: the op's floor bytes over "
        "the median; same bits: the _cpu outputs and residual against the _ref ones, checked "
        "in this run.",
        "",
        "| op | n | k / pairs | provider | ns/el | best ns/el | GB/s | same bits as ref |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for op, n, k, provider, ns, best, gbs, bits in rows:
        size = f"{n:.1e}".replace("e+0", "e").replace(".0e", "e")
        lines.append(
            f"| {op} | {size} | {k} | {provider} | {ns:.3f} | {best:.3f} | {gbs:.1f} | {bits} |"
        )
    text = "\n".join(lines)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_cpu.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
