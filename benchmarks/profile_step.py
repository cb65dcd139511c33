"""Where one training step's time goes, per row of ``bench_step.py``: torch.profiler tables.

For each variant it builds the row as ``bench_step.py`` does (same model, optimizer and batch),
runs ``--warmup`` steps, then profiles ``--steps`` steps and prints, per step: wall time, the
time kernels kept the GPU busy (the union of kernel intervals, so wall - busy is the time the
GPU waited for the host), the number of host-device synchronisations, and the operators with
the most device time and the most host time; with ``--cprofile``, Python's hot spots; with
``--host``, host milliseconds per step in each phase (forward and backward, ``step()``,
``zero_grad()``) and in sparsecomm's own functions (inclusive, timed with
``time.perf_counter`` around each call, no profiler: the host cost a host-bound step pays).

    torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py --model gpt \\
        --variants "none,DDP,Dense(),TopK(0.01)" --out /tmp/profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def busy_us(events) -> float:
    """Microseconds in which at least one kernel ran (the union of kernel intervals)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    total, end = 0.0, -1.0
    for start, stop in spans:
        if start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def idle_gaps(events, count: int = 10) -> list[str]:
    """The longest stretches in which no kernel ran, each with where it began (ms after the
    first kernel) and the kernel that ended it: where the GPU waited for the host."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        return []
    origin, end = kernels[0][0], kernels[0][1]
    gaps = []
    for start, stop, kernel in kernels[1:]:
        if start > end:
            gaps.append((start - end, end - origin, kernel))
        end = max(end, stop)
    gaps.sort(reverse=True)
    return [
        f"{gap / 1e3:7.3f} ms idle from {at / 1e3:8.3f} ms, until {kernel[:70]}"
        for gap, at, kernel in gaps[:count]
    ]


# (module, class, method): sparsecomm's host-side work in a step, timed by --host.
HOST_SPOTS = [
    ("sparsecomm.optimizer", "CompressedOptimizer", "_on_gradient"),
    ("sparsecomm.optimizer", "CompressedOptimizer", "_synchronize"),
    ("sparsecomm.optimizer", "CompressedOptimizer", "_agree_on_step"),
    ("sparsecomm._engine", "BucketEngine", "fill"),
    ("sparsecomm._engine", "BucketEngine", "gather"),
    ("sparsecomm._engine", "BucketEngine", "_launch"),
    ("sparsecomm._engine", "BucketEngine", "launch_all"),
    ("sparsecomm._engine", "BucketEngine", "finish"),
    ("sparsecomm._engine", "CompressGraphs", "compress"),
    ("sparsecomm.optimizer", "CompressedOptimizer", "_sent_stats"),
]


def host_times(name: str, workload, args, device) -> str:
    """Host milliseconds per step in each phase and in each of :data:`HOST_SPOTS`."""
    import importlib

    built = bench_step.build_row(name, workload, device)
    module, optimizer = built.objects[0], built.optimizer
    for _ in range(args.warmup):
        built.step()
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    originals = []
    for module_name, class_name, method in HOST_SPOTS:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = getattr(cls, method)
        key = f"{class_name}.{method}"

        def timed(*a, _original=original, _key=key, **kw):
            started = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                spent[_key] = spent.get(_key, 0.0) + time.perf_counter() - started
                calls[_key] = calls.get(_key, 0) + 1

        originals.append((cls, method, original))
        setattr(cls, method, timed)
    phases = {"forward + backward": 0.0, "step()": 0.0, "zero_grad()": 0.0}
    steps = max(args.steps, 10)
    bench_step.sync(device)
    started = time.perf_counter()
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            workload.loss(module).backward()
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            optimizer.zero_grad()
            t3 = time.perf_counter()
            phases["forward + backward"] += t1 - t0
            phases["step()"] += t2 - t1
            phases["zero_grad()"] += t3 - t2
        bench_step.sync(device)
    finally:
        for cls, method, original in originals:
            setattr(cls, method, original)
    wall = (time.perf_counter() - started) * 1e3 / steps
    lines = [f"## {name}: host ms per step ({steps} steps, wall {wall:.2f} ms a step)", ""]
    lines += ["| where | host ms / step | calls / step |", "|---|---|---|"]
    lines += [f"| {k} | {v * 1e3 / steps:.3f} | |" for k, v in phases.items()]
    lines += [
        f"| {k} | {v * 1e3 / steps:.3f} | {calls[k] / steps:.0f} |"
        for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
    ]
    del built, module, optimizer
    bench_step.release(device)
    return "\n".join(lines + [""])


def profile_row(name: str, workload, args, device) -> str:
    built = bench_step.build_row(name, workload, device)
    for _ in range(args.warmup):
        built.step()
    torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            built.step()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / args.steps
    events = prof.events()
    busy_ms = busy_us(events) / 1e3 / args.steps
    syncs = sum(1 for e in events if e.name in SYNC_EVENTS) / args.steps
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = prof.key_averages()
    lines = [
        f"## {name}",
        "",
        f"per step: wall {wall_ms:.2f} ms, GPU busy {busy_ms:.2f} ms, GPU idle "
        f"{wall_ms - busy_ms:.2f} ms, {kernels / args.steps:.0f} kernels, {syncs:.1f} "
        "host syncs",
        "",
        "The longest GPU idle stretches (all profiled steps):",
        "",
        "```",
        *idle_gaps(events),
        "```",
        "",
        "```",
        table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60),
        table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60),
        "```",
        "",
    ]
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            built.step()
        torch.cuda.synchronize(device)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats(args.rows)
        lines += [
            "Python (cProfile, all steps, by own time):",
            "",
            "```",
            text.getvalue(),
            "```",
            "",
        ]
    del built
    torch.cuda.empty_cache()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("linear", "gpt"), default="gpt")
    parser.add_argument("--params", type=float, default=1e8, help="linear")
    parser.add_argument("--variants", default="none,DDP,Dense(),Cast(bf16),TopK(0.01)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=18, help="operators per table")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="also run the steps under cProfile and list Python's hot spots",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="instead of profiling, time the host side of each phase and of sparsecomm's "
        "functions (no profiler)",
    )
    parser.add_argument("--adamw", choices=("default", "fused"), default="default")
    for flag, default in (("--layers", 12), ("--d-model", 768), ("--heads", 12),
                          ("--vocab", 50257), ("--context", 512), ("--batch", None)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 8 if args.model == "gpt" else 64
    if not torch.cuda.is_available() and not args.host:
        raise SystemExit("profile_step.py profiles CUDA steps: run it on a machine with a GPU")
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:  # --host only: a smoke test of the timing on a CPU
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    if args.model == "gpt":
        workload = bench_step.gpt_workload(args, device)
    else:
        workload = bench_step.linear_workload(args.params, args, device)
    report = [f"# profile_step: {workload.description}", ""]
    for name in args.variants.split(","):
        row = host_times if args.host else profile_row
        report.append(row(name, workload, args, device))
        if dist.get_rank() == 0:
            print(report[-1], flush=True)
    if args.out and dist.get_rank() == 0:
        Path(args.out).write_text("\n".join(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
