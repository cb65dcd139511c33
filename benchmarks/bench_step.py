"""Whole training-step time with each compressor, against DistributedDataParallel.

    torchrun --nproc_per_node=W benchmarks/bench_step.py --params 1e8 [--params 1e9] [--out FILE]

A synthetic model of square linear layers (no bias) holding about ``--params`` fp32
parameters; each rank a batch of ``--batch`` rows. For each variant: the median step time of
``--steps`` steps after ``--warmup``, bytes this rank sent per step, and (from a second run
with ``profile=True``, which synchronizes) the share of the step spent compressing and
communicating and aggregating. NCCL on GPUs, gloo on CPUs. Rank 0 prints a
markdown table and appends it to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

import sparsecomm

WIDTH = 4096  # 16.8M parameters per layer: large buckets, realistic GEMMs


def make_model(params: float, device) -> torch.nn.Module:
    layers = max(1, round(params / WIDTH**2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in model:
        torch.nn.init.normal_(layer.weight, std=WIDTH**-0.5)
    return model.to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, step_fn, args, device) -> list[float]:
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch, WIDTH, device=device, generator=gen)
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        step_fn()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def run_variant(name, params, args, device):
    model = make_model(params, device)
    numel = sum(p.numel() for p in model.parameters())
    shares = ""
    sent = 0
    if name == "DDP":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.step()
            opt.zero_grad()

        times = time_steps(ddp, step, args, device)
        sent = 4 * numel
    else:
        compressor = {
            "Dense()": sparsecomm.Dense(),
            "Cast(bf16)": sparsecomm.Cast(torch.bfloat16),
            "TopK(0.01)": sparsecomm.TopK(0.01),
            "TopK(0.001)": sparsecomm.TopK(0.001),
        }[name]
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), compressor
        )

        def step():
            opt.step()
            opt.zero_grad()

        times = time_steps(model, step, args, device)
        sent = opt.last_stats.bytes_sent
        opt.profile = True
        profiled = time_steps(model, step, argparse.Namespace(**{**vars(args), "steps": 5}), device)
        stats = opt.last_stats
        total = statistics.median(profiled)
        shares = " / ".join(
            f"{100 * seconds / total:.0f}%"
            for seconds in (
                stats.compress_seconds,
                stats.communicate_seconds,
                stats.aggregate_seconds,
            )
        )
    return statistics.median(times), sent, numel, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, action="append", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--variants", default="DDP,Dense(),Cast(bf16),TopK(0.01),TopK(0.001)")
    parser.add_argument("--label", default="", help="network path, for the table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    world_size = dist.get_world_size()

    rows = []
    for params in args.params or [1e8]:
        for name in args.variants.split(","):
            median, sent, numel, shares = run_variant(name, params, args, device)
            if cuda:
                torch.cuda.empty_cache()  # the variant's model and state are gone by now
            rows.append(
                f"| {numel / 1e6:.0f}M | {world_size} | {args.label} | {name} | "
                f"{median * 1e3:.2f} | {sent / 1e6:.1f} | {shares} |"
            )
            if dist.get_rank() == 0:
                print(rows[-1], flush=True)

    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name(device) if cuda else "CPU"
        header = [
            f"\n{gpu}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}, W={world_size}, batch {args.batch} per rank\n",
            "| params | W | path | variant | step ms (median) | MB sent / rank / step | "
            "compress / communicate / aggregate share |",
            "|---|---|---|---|---|---|---|",
        ]
        table = "\n".join(header + rows)
        print(table)
        if args.out:
            with open(args.out, "a") as f:
                f.write(table + "\n")
    dist.barrier()  # tear down together: gloo can abort a rank whose peer left
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
