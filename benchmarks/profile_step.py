"""Where one training step's time goes, per row of ``bench_step.py``: torch.profiler tables.

For each variant it builds the row as ``bench_step.py`` does (same model, optimizer and batch),
runs ``--warmup`` steps, then profiles ``--steps`` steps and prints, per step: wall time, the
time kernels kept the GPU busy (the union of kernel intervals, so wall - busy is the time the
GPU waited for the host), the number of host-device synchronisations, and the operators with
the most device time and the most host time; with ``--cprofile``, Python's hot spots.

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
    for flag, default in (("--layers", 12), ("--d-model", 768), ("--heads", 12),
                          ("--vocab", 50257), ("--context", 512), ("--batch", None)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 8 if args.model == "gpt" else 64
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py profiles CUDA steps: run it on a machine with a GPU")
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if args.model == "gpt":
        workload = bench_step.gpt_workload(args, device)
    else:
        workload = bench_step.linear_workload(args.params, args, device)
    report = [f"# profile_step: {workload.description}", ""]
    for name in args.variants.split(","):
        report.append(profile_row(name, workload, args, device))
        if dist.get_rank() == 0:
            print(report[-1], flush=True)
    if args.out and dist.get_rank() == 0:
        Path(args.out).write_text("\n".join(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
