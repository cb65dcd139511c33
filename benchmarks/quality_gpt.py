"""Training quality on the GPU: the loss of the 163M GPT of ``bench_step.py --model gpt``
under AdamW, dense against the compressed recipes, step by step on the same batch.

Each recipe starts from the same initialization and trains ``--steps`` steps on the same
fixed batch (as ``bench_step.py`` times it), so the loss curve shows how fast each recipe
learns what dense learns; the table gives the loss at a few steps and the megabytes sent.

    torchrun --standalone --nproc_per_node=1 benchmarks/quality_gpt.py --steps 100 \\
        --out /tmp/quality.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402

import sparsecomm  # noqa: E402

# key: (label, compressor factory given the warm-up length, CompressedOptimizer keywords);
# no factory: plain AdamW, no wrapper (W = 1: the dense baseline).
RECIPES = {
    "dense": ("dense AdamW (no wrapper)", None, {}),
    "topk": ("TopK(0.01), gradients (a)", lambda w: sparsecomm.TopK(0.01), {}),
    "topk-warmup": (
        "TopK(0.01), exp. warm-up (b)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w),
        {},
    ),
    "topk-updates": (
        "TopK(0.01), updates (d)",
        lambda w: sparsecomm.TopK(0.01),
        {"exchange": "updates"},
    ),
    "topk-updates-warmup": (
        "TopK(0.01), updates + warm-up (d+b)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w),
        {"exchange": "updates"},
    ),
    "topk-updates-dense-warmup": (
        "TopK(0.01), updates + dense warm-up (d+c)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w, warmup="dense"),
        {"exchange": "updates"},
    ),
    "topk-0.001": ("TopK(0.001), gradients (a)", lambda w: sparsecomm.TopK(0.001), {}),
    "topk-0.001-updates-dense-warmup": (
        "TopK(0.001), updates + dense warm-up (d+c)",
        lambda w: sparsecomm.TopK(0.001, warmup_steps=w, warmup="dense"),
        {"exchange": "updates"},
    ),
    "topk-0.001-updates-warmup": (
        "TopK(0.001), updates + warm-up (d+b)",
        lambda w: sparsecomm.TopK(0.001, warmup_steps=w),
        {"exchange": "updates"},
    ),
    "topk-catchup": ("TopK(0.01), CatchUpAdamW (e)", lambda w: sparsecomm.TopK(0.01), {}),
    "topk-catchup-warmup": (
        "TopK(0.01), CatchUpAdamW + warm-up (e+b)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w),
        {},
    ),
    "topk-0.001-catchup-warmup": (
        "TopK(0.001), CatchUpAdamW + warm-up (e+b)",
        lambda w: sparsecomm.TopK(0.001, warmup_steps=w),
        {},
    ),
    "topk-adam-warmup": (
        "TopK(0.01), Adam-scaled choice + warm-up (b+s)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w, select="adam"),
        {},
    ),
    "topk-catchup-adam-warmup": (
        "TopK(0.01), CatchUpAdamW, Adam-scaled choice + warm-up (e+b+s)",
        lambda w: sparsecomm.TopK(0.01, warmup_steps=w, select="adam"),
        {},
    ),
    "topk-0.001-catchup-adam-warmup": (
        "TopK(0.001), CatchUpAdamW, Adam-scaled choice + warm-up (e+b+s)",
        lambda w: sparsecomm.TopK(0.001, warmup_steps=w, select="adam"),
        {},
    ),
}


def inner_optimizer(name: str, workload, params: list) -> torch.optim.Optimizer:
    """The workload's AdamW, or for the CatchUpAdamW recipes (the key says "catchup")
    ``sparsecomm.CatchUpAdamW`` with its learning rate and weight decay."""
    adamw = workload.make_optimizer(params)
    if "catchup" not in name:
        return adamw
    return sparsecomm.CatchUpAdamW(params, **{k: adamw.defaults[k] for k in ("lr", "weight_decay")})


def train(name: str, workload, args, device) -> tuple[list[float], float]:
    model = workload.make_model()
    inner = inner_optimizer(name, workload, list(model.parameters()))
    _, make, options = RECIPES[name]
    if make is None:
        optimizer = inner
    else:
        optimizer = sparsecomm.CompressedOptimizer(inner, make(args.warmup), **options)
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    losses = []
    for _ in range(args.steps):
        loss = workload.loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    sent = 0.0 if make is None else optimizer.total_stats.bytes_sent / 1e6
    del model, inner, optimizer
    torch.cuda.empty_cache()
    return losses, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="density warm-up steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=None)
    for flag, default in (("--layers", 12), ("--d-model", 768), ("--heads", 12),
                          ("--vocab", 50257), ("--context", 512), ("--batch", 8)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; known: {list(RECIPES)}")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    workload = bench_step.gpt_workload(args, device)
    marks = sorted({m for m in (1, 10, 20, 50, args.steps) if m <= args.steps})
    lines = [
        f"{workload.description}; AdamW lr {args.lr:g}, {args.steps} steps on one fixed batch, "
        f"density warm-ups of {args.warmup} steps, W = {dist.get_world_size()}, "
        f"{torch.cuda.get_device_name(device) if cuda else 'CPU'}, torch {torch.__version__}",
        "",
        "| recipe | " + " | ".join(f"loss at step {m}" for m in marks) + " | MB sent | s |",
        "|---|" + "---:|" * (len(marks) + 2),
    ]
    for name in names:
        started = time.perf_counter()
        losses, sent = train(name, workload, args, device)
        seconds = time.perf_counter() - started
        cells = " | ".join(f"{losses[m - 1]:.3f}" for m in marks)
        lines.append(f"| {RECIPES[name][0]} | {cells} | {sent:.4g} | {seconds:.0f} |")
        if dist.get_rank() == 0:
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    if dist.get_rank() == 0:
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
