"""Exact top-k with error feedback on one GPU: the Triton kernel beside the torch baselines.

Median milliseconds (20th-80th percentile beside it) of ``triton.testing.do_bench``, and
GB/s counted at the 16-byte-per-element floor of the two-pass select (read g and r, write
r, read acc again), whatever a provider really moves. A timed call rewrites the residual
(error feedback), so later calls see ``g + r`` with the earlier remainders in it, as a
training loop does; k is fixed, so the work per call does not drift.

    python benchmarks/bench_topk.py                       # n = 1e8, k = 1e6 and 1e5
    python benchmarks/bench_topk.py --n 1e7 --k 1e4 1e5   # other sizes
    python benchmarks/bench_topk.py --profile             # per-kernel split of one call
    python benchmarks/bench_topk.py --sweep               # tile configurations of the kernel
    python benchmarks/bench_topk.py --baseline old_topk.py  # also time another version

The baselines come from the module the tests use: ``topk_compress_ref`` (exact, int64 keys)
and the torch pipeline a GRACE-style user writes (``g + r``, ``torch.topk(abs)``, gather,
residual update), which breaks ties arbitrarily and so is not exact.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
from unittest import mock

import torch
import triton
from sparsecomm.triton_kernels import topk as topk_module
from sparsecomm.triton_kernels.topk import topk_compress, topk_compress_ref
from triton.testing import do_bench

BYTES_PER_ELEMENT = 16
QUANTILES = [0.5, 0.2, 0.8]

# Module constants --sweep patches, one configuration per entry (the first is the default).
SWEEP = [
    {},
    {"_CHUNK_BLOCK": 4096, "_CHUNK_ITERS": 8, "_CHUNK_WARPS": 8},
    {"_CHUNK_ITERS": 32},
    {"_LEVEL_CHUNKS": 2},
    {"_LEVEL_CHUNKS": 8},
    {"_CAND_BLOCK": 512},
    {"_SAMPLE_COPIES": 1},
    {"_SAMPLE_COPIES": 8},
    {"_FINE_BITS": 12},
    {"_SAMPLE_SIZE": 1 << 15},
]


def torch_pipeline(grad: torch.Tensor, residual: torch.Tensor, k: int):
    acc = grad + residual
    index = torch.topk(acc.abs(), k, sorted=False).indices
    values = acc[index]
    residual.copy_(acc)
    residual[index] = 0.0
    return index, values


@contextlib.contextmanager
def tiles(**constants):
    if not constants:
        yield
        return
    with mock.patch.multiple(topk_module, **constants):
        yield


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(fn) -> tuple[float, float, float]:
    return tuple(do_bench(fn, warmup=25, rep=200, quantiles=QUANTILES))


def row(name: str, n: int, k: int, times: tuple[float, float, float]) -> str:
    median, low, high = times
    gbps = BYTES_PER_ELEMENT * n / (median * 1e-3) / 1e9
    return f"| {name} | {n:.0e} | {k:.0e} | {median:.3f} | {low:.3f}-{high:.3f} | {gbps:.0f} |"


def inputs(n: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(n, device="cuda", generator=gen)
    residual = torch.randn(n, device="cuda", generator=gen) * 0.5
    return grad, residual


def table(n: int, ks: list[int], with_reference: bool, baseline=None) -> None:
    grad, residual = inputs(n)
    print("| provider | n | k | median ms | p20-p80 ms | GB/s at 16 B/elem |")
    print("|---|---|---|---|---|---|")
    providers = [
        ("triton topk_compress", lambda k: topk_compress(grad, residual, k)),
        ("triton, no residual", lambda k: topk_compress(grad, None, k)),
    ]
    if baseline is not None:
        providers += [
            ("baseline topk_compress", lambda k: baseline.topk_compress(grad, residual, k)),
            ("baseline, no residual", lambda k: baseline.topk_compress(grad, None, k)),
        ]
    providers.append(("torch pipeline", lambda k: torch_pipeline(grad, residual, k)))
    if with_reference:
        providers.append(("topk_compress_ref", lambda k: topk_compress_ref(grad, residual, k)))
    for k in ks:
        for name, fn in providers:
            print(row(name, n, k, measure(functools.partial(fn, k))), flush=True)
    copy = torch.empty_like(grad)
    ms = do_bench(lambda: copy.copy_(grad), warmup=25, rep=200)
    print(f"\ndevice copy of n fp32: {ms:.3f} ms, {8 * n / (ms * 1e-3) / 1e12:.2f} TB/s")


def sweep(n: int, k: int) -> None:
    """Time each configuration of SWEEP, and check its output against the reference."""
    grad, residual = inputs(n)
    start = residual.clone()  # timed calls change the residual; each check starts here
    expected = topk_compress_ref(grad, start.clone(), k)
    print("| configuration | median ms | matches reference |")
    print("|---|---|---|")
    for config in SWEEP:
        with tiles(**config):
            got = topk_compress(grad, start.clone(), k)
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                       for a, b in zip(got, expected))  # fmt: skip
            median, _, _ = measure(lambda: topk_compress(grad, residual, k))
        name = ", ".join(f"{key}={value}" for key, value in config.items()) or "default"
        print(f"| {name} | {median:.3f} | {same} |", flush=True)


def profile(n: int, k: int, topk_compress=topk_compress) -> None:
    grad, residual = inputs(n)
    for _ in range(3):
        topk_compress(grad, residual, k)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            topk_compress(grad, residual, k)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=1e8)
    parser.add_argument("--k", type=float, nargs="+", default=[1e6, 1e5])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-reference", action="store_true", help="skip topk_compress_ref")
    parser.add_argument("--baseline", help="path of another topk.py to time beside this one")
    args = parser.parse_args()
    n, ks = int(args.n), [int(k) for k in args.k]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    baseline = load_module(args.baseline) if args.baseline else None
    table(n, ks, with_reference=not args.no_reference, baseline=baseline)
    if args.profile:
        profile(n, ks[0], topk_compress)
        if baseline is not None:
            profile(n, ks[0], baseline.topk_compress)
    if args.sweep:
        sweep(n, ks[0])


if __name__ == "__main__":
    main()
