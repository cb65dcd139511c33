"""The torchrun worker of ``benchmarks/bench_network.py``: one process per rank, inside the
network namespace whose loopback the driver has shaped. Not meant to be run by hand (the driver
builds its command line); ``python benchmarks/bench_network.py --help`` describes the flags.

Per launch (one link rate) it does, on every rank:

1. measure the link: a timed all-reduce sized to take about ``--link-seconds`` at the set rate
   (ring all-reduce: each rank moves ``2 (W-1)/W * bytes``; loopback is one shared medium, so
   all ranks' traffic, ``2 (W-1) * bytes``, crosses the one shaped queue), and the median of 20
   one-element all-reduces (latency);
2. for each row (``none``, DDP variants, sparsecomm compressors), build the same model from the
   same seed, take ``--warmup`` untimed and ``--steps`` timed steps on the same data (a step is
   forward + backward + optimizer step), and for sparsecomm rows ``--profile-steps`` more with
   ``CompressedOptimizer(..., profile=True)`` for the compress / communicate / aggregate shares;
3. with ``--target-loss``, train each row again from the same initialization until the
   validation loss reaches the target (or ``--target-max-steps`` / ``--target-max-seconds``).

Rank 0 rewrites ``--json`` after every row, so a launch killed at its timeout keeps the rows
that finished.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  before the process group: docs/teardown.md
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO / "examples"))
try:
    import sparsecomm
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))
    import sparsecomm

from bench_network import parse_rows, split_cap  # noqa: E402  (pure Python: the row names)
from train_charlm import VOCAB, CharTransformer, load_stdlib_text, windows  # noqa: E402


class Skip(Exception):
    """A row that cannot run here; the message says why."""


# --------------------------------------------------------------------------- set-up


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--json", required=True, help="rank 0 writes the results here")
    add("--rate-label", required=True)
    add("--rate-bytes-per-s", type=float, default=0.0, help="set rate; 0: unshaped")
    add("--rows", required=True)
    add("--width", type=int, default=384)
    add("--layers", type=int, default=8)
    add("--heads", type=int, default=6)
    add("--context", type=int, default=64)
    add("--batch-size", type=int, default=4)
    add("--text-bytes", type=int, default=1_000_000)
    add("--lr", type=float, default=1e-3)
    add("--lr-warmup", type=int, default=20)
    add("--weight-decay", type=float, default=0.01)
    add("--adamw", choices=("default", "fused"), default="default")
    add("--seed", type=int, default=0)
    add("--steps", type=int, default=6)
    add("--rounds", type=int, default=1, help="times the rows run, taking turns")
    add("--interleave", action="store_true", help="build every row once; rounds take turns")
    add("--warmup", type=int, default=2)
    add("--profile-steps", type=int, default=2)
    add("--bucket-cap-mb", type=float, default=None, help="default: DDP 25, sparsecomm its own")
    add("--min-compress-numel", type=int, default=1024)
    add("--threshold", type=float, default=None)
    add("--threshold-density", type=float, default=0.01)
    add("--threshold-how", default=None, help="how --threshold was chosen, for the report")
    add("--powersgd-rank", type=int, default=4)
    add("--link-seconds", type=float, default=1.0)
    add("--link-max-mb", type=float, default=128.0)
    add("--target-loss", type=float, default=None)
    add("--target-max-steps", type=int, default=300)
    add("--target-max-seconds", type=float, default=120.0)
    add("--eval-every", type=int, default=10)
    add("--val-batches", type=int, default=4)
    add("--collective-timeout", type=float, default=300.0)
    return p.parse_args(argv)


class Context:
    """Everything the rows share: process group, device, data, flags."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = torch.cuda.is_available()
        timeout = timedelta(seconds=args.collective_timeout)
        if self.cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.threads = max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(self.threads)

        text = load_stdlib_text(args.text_bytes)
        split = int(0.9 * len(text))
        self.train_text, self.val_text = text[:split], text[split:]
        self.val_starts = torch.randint(
            0,
            len(self.val_text) - args.context - 1,
            (args.val_batches, args.batch_size),
            generator=torch.Generator().manual_seed(args.seed + 12345),
        )
        probe = self.fresh_model()
        self.numel = sum(p.numel() for p in probe.parameters())
        self.param_shapes = [tuple(p.shape) for p in probe.parameters()]
        del probe

    def fresh_model(self) -> torch.nn.Module:
        torch.manual_seed(self.args.seed)
        a = self.args
        return CharTransformer(a.width, a.layers, a.heads, a.context).to(self.device)

    def loss(self, module, step: int) -> torch.Tensor:
        """This rank's loss at ``step``: the same windows as examples/train_charlm.py draws
        (one draw of W * batch windows from (seed, step), rank r takes every W-th)."""
        a = self.args
        generator = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        starts = torch.randint(
            0,
            len(self.train_text) - a.context - 1,
            (self.world_size * a.batch_size,),
            generator=generator,
        )[self.rank :: self.world_size]
        inputs, targets = windows(self.train_text, starts, a.context)
        logits = module(inputs.to(self.device))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(self.device).reshape(-1))

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module) -> float:
        model.eval()
        losses = []
        for starts in self.val_starts:
            inputs, targets = windows(self.val_text, starts, self.args.context)
            logits = model(inputs.to(self.device))
            losses.append(
                F.cross_entropy(
                    logits.reshape(-1, VOCAB), targets.to(self.device).reshape(-1)
                ).item()
            )
        model.train()
        return sum(losses) / len(losses)

    def lr_at(self, step: int) -> float:
        a = self.args
        if a.lr_warmup > 0 and step < a.lr_warmup:
            return a.lr * (step + 1) / a.lr_warmup
        return a.lr

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def scalar(self, value: float = 0.0) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float64, device=self.device)

    def from_rank0(self, value: float) -> float:
        tensor = self.scalar(value if self.rank == 0 else 0.0)
        dist.broadcast(tensor, src=0)
        return float(tensor.item())

    def max_over_ranks(self, value: float) -> float:
        tensor = self.scalar(value)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())


# --------------------------------------------------------------------------- the link


def measure_link(ctx: Context) -> dict:
    """Achieved all-reduce bandwidth and small-message latency on this (shaped) loopback."""
    a, world_size = ctx.args, ctx.world_size
    if world_size < 2:
        return {"skipped": "one rank: nothing crosses the link"}
    rate = a.rate_bytes_per_s
    # All ranks' traffic crosses the one queue: 2 (W-1) * size bytes per all-reduce.
    wanted = rate * a.link_seconds / (2 * (world_size - 1)) if rate > 0 else 64 * 2**20
    size = int(min(max(wanted, 2**20), a.link_max_mb * 2**20)) // 4 * 4
    big = torch.ones(size // 4, device=ctx.device)
    small = torch.zeros(1, device=ctx.device)
    for _ in range(3):
        dist.all_reduce(small)
    latencies = []
    for _ in range(20):
        ctx.sync()
        started = time.perf_counter()
        dist.all_reduce(small)
        ctx.sync()
        latencies.append(time.perf_counter() - started)
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(big)
    ctx.sync()
    probe = ctx.max_over_ranks(time.perf_counter() - started)
    reps = int(ctx.from_rank0(min(100, max(1, round(a.link_seconds / max(probe, 1e-6))))))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    ctx.sync()
    seconds = ctx.max_over_ranks(time.perf_counter() - started)
    per_rank = 2 * (world_size - 1) / world_size * size * reps / seconds
    aggregate = world_size * per_rank
    return {
        "set_bytes_per_s": rate or None,
        "allreduce_bytes": size,
        "reps": reps,
        "seconds": seconds,
        "per_rank_bytes_per_s": per_rank,
        "aggregate_bytes_per_s": aggregate,
        "ratio_to_set": aggregate / rate if rate > 0 else None,
        "small_allreduce_s": statistics.median(latencies),
    }


# --------------------------------------------------------------------------- rows


def row_kind(name: str) -> str:
    if name == "none":
        return "none"
    if name.startswith("ddp"):
        return "ddp"
    return "sc"


def make_compressor(name: str, ctx: Context):
    inner = name.removeprefix("ddp+sc-").partition("/")[0]
    if inner == "Dense()":
        return sparsecomm.Dense()
    if inner == "Cast(bf16)":
        return sparsecomm.Cast(torch.bfloat16)
    if inner == "Cast(fp16)":
        return sparsecomm.Cast(torch.float16)
    number = float(inner[inner.index("(") + 1 : -1]) if not inner.endswith("(t)") else None
    if inner.startswith("Threshold"):
        return sparsecomm.Threshold(number if number is not None else ctx.threshold)
    if inner.startswith("TopK"):
        return sparsecomm.TopK(number)
    raise ValueError(f"unknown row {name!r}")


class Trainer:
    """One row's model, exchange and optimizer, with a per-step byte count."""

    def __init__(self, name: str, ctx: Context, model: torch.nn.Module, profile: bool = False):
        a = ctx.args
        name, cap = split_cap(name)
        self.bucket_cap_mb = a.bucket_cap_mb if cap is None else cap
        self.name, self.ctx, self.model = name, ctx, model
        self.module = model  # what the forward pass calls
        self.hook_state = None
        self.bytes_note = ""
        kind = row_kind(name)

        def adamw():
            fused = True if a.adamw == "fused" else None
            return torch.optim.AdamW(
                model.parameters(), lr=a.lr, weight_decay=a.weight_decay, fused=fused
            )

        if kind == "none":
            self.optimizer = adamw()
            self.bytes_note = "no exchange"
        elif kind == "sc":
            self.optimizer = sparsecomm.CompressedOptimizer(
                adamw(),
                make_compressor(name, ctx),
                bucket_cap_mb=self.bucket_cap_mb,
                min_compress_numel=a.min_compress_numel,
                profile=profile,
                exchange=name.partition("/")[2] or "gradients",
            )
            self.bytes_note = "measured: opt.last_stats.bytes_sent"
        else:
            self._make_ddp(name, model)
            self.optimizer = adamw()
        self._powersgd_seen = 0

    def _make_ddp(self, name: str, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        ctx, a = self.ctx, self.ctx.args
        if name.startswith("ddp+sc-") and not hasattr(sparsecomm, "ddp_comm_hook"):
            raise Skip("sparsecomm.ddp_comm_hook does not exist in this checkout")
        if name == "ddp+bf16" and not hasattr(default_hooks, "bf16_compress_hook"):
            raise Skip("this torch build has no bf16_compress_hook")
        first_bucket = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)
        if name == "ddp+powersgd" and ctx.backend == "gloo" and 4 * ctx.numel > first_bucket:
            # Seen on this model: gloo aborts with "Received data size doesn't match expected
            # size" in the first compressed step.
            raise Skip(
                "on gloo, torch's powerSGD_hook works only while the model fits one DDP bucket "
                f"({first_bucket / 2**20:g} MiB, here {4 * ctx.numel / 2**20:.0f} MiB): it "
                "starts each bucket's all-reduces of P and Q from futures' callbacks, which race "
                "with the next bucket's first all-reduce, so the ranks issue collectives in "
                "different orders and gloo, which matches them by issue order, aborts "
                '("Received data size doesn\'t match expected size"; a 6-layer MLP of 0.6 MiB '
                "ran, one of 24 MiB aborted)"
            )
        ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.cuda else None,
            bucket_cap_mb=25.0 if self.bucket_cap_mb is None else self.bucket_cap_mb,
        )
        self.module = ddp
        try:
            if name == "ddp":
                self.bytes_note = "computed: 4 B x parameters (fp32 buckets)"
            elif name == "ddp+fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                self.bytes_note = "computed: 2 B x parameters (fp16 buckets)"
            elif name == "ddp+bf16":
                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
                self.bytes_note = "computed: 2 B x parameters (bf16 buckets)"
            elif name == "ddp+powersgd":
                self.hook_state = powersgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=a.powersgd_rank,
                    start_powerSGD_iter=2,
                )
                ddp.register_comm_hook(self.hook_state, powersgd.powerSGD_hook)
                self.bytes_note = (
                    "counted by the hook: 4 B x PowerSGDState.total_numel_after_compression "
                    "per step (P, Q and uncompressed tensors, fp32)"
                )
            else:  # ddp+sc-...
                state, hook = sparsecomm.ddp_comm_hook(make_compressor(name, ctx))
                ddp.register_comm_hook(state, hook)
                self.hook_state = state
                self.bytes_note = "measured: the hook state's last_bytes_sent"
        except Exception as error:  # noqa: BLE001 - the reason goes into the report
            raise Skip(f"{type(error).__name__}: {error}") from None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def shared_parameters(self):
        if row_kind(self.name) == "sc":
            return self.optimizer.shared_parameters()
        return contextlib.nullcontext()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def bytes_and_density(self) -> tuple[float | None, float | None]:
        """What this rank put into the collectives in the last step, and the density sent."""
        numel = self.ctx.numel
        if self.name == "none":
            return 0.0, 0.0
        if row_kind(self.name) == "sc":
            stats = self.optimizer.last_stats
            return float(stats.bytes_sent), stats.density
        if self.name == "ddp":
            return 4.0 * numel, 1.0
        if self.name in ("ddp+fp16", "ddp+bf16"):
            return 2.0 * numel, 1.0
        if self.name == "ddp+powersgd":
            total = self.hook_state.total_numel_after_compression
            step_numel, self._powersgd_seen = total - self._powersgd_seen, total
            if step_numel == 0:  # before start_powerSGD_iter: a plain fp32 all-reduce
                return 4.0 * numel, 1.0
            return 4.0 * step_numel, None
        if hasattr(self.hook_state, "last_bytes_sent"):
            return float(self.hook_state.last_bytes_sent), None
        stats = getattr(self.hook_state, "last_stats", None)
        if stats is not None and hasattr(stats, "bytes_sent"):
            return float(stats.bytes_sent), getattr(stats, "density", None)
        return None, None

    def step(self, step: int) -> dict:
        """One timed training step at data step ``step``."""
        ctx = self.ctx
        self.set_lr(ctx.lr_at(step))
        self.zero_grad()
        ctx.sync()
        t0 = time.perf_counter()
        loss = ctx.loss(self.module, step)
        ctx.sync()
        t1 = time.perf_counter()
        loss.backward()
        ctx.sync()
        t2 = time.perf_counter()
        self.optimizer.step()
        ctx.sync()
        t3 = time.perf_counter()
        nbytes, density = self.bytes_and_density()
        record = {
            "step": step,
            "forward": t1 - t0,
            "backward": t2 - t1,
            "optimizer": t3 - t2,
            "total": t3 - t0,
            "bytes": nbytes,
            "density": density,
            "loss": loss.item(),
        }
        if row_kind(self.name) == "sc" and self.optimizer.profile:
            stats = self.optimizer.last_stats
            record.update(
                compress=stats.compress_seconds,
                communicate=stats.communicate_seconds,
                aggregate=stats.aggregate_seconds,
            )
        return record


def summary(totals: list[float]) -> dict:
    ordered = sorted(totals)

    def pct(q):  # linear interpolation, like numpy's default
        pos = q * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"median": statistics.median(ordered), "p20": pct(0.2), "p80": pct(0.8)}


def gather(ctx: Context, obj):
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def start_row(name: str, ctx: Context) -> dict:
    """Build one row (model, trainer) and take its ``--warmup`` untimed steps."""
    a = ctx.args
    started = time.perf_counter()
    model = ctx.fresh_model()
    trainer = Trainer(name, ctx, model)
    # PowerSGD all-reduces plainly for its first start_powerSGD_iter (2) steps, and allocates
    # its P/Q memory on the first compressed one: keep all three out of the timed steps.
    warmup = max(a.warmup, 3) if name == "ddp+powersgd" else a.warmup
    for step in range(warmup):
        trainer.step(step)
    return {
        "name": name,
        "model": model,
        "trainer": trainer,
        "warmup": warmup,
        "records": [],
        "seconds": time.perf_counter() - started,
    }


def timed_steps(run: dict, count: int) -> None:
    """``count`` timed steps of a started row, after a barrier (the ranks start together)."""
    started = time.perf_counter()
    dist.barrier()
    for _ in range(count):
        run["records"].append(run["trainer"].step(run["warmup"] + len(run["records"])))
    run["seconds"] += time.perf_counter() - started


def finish_row(run: dict, ctx: Context, profile: bool = True, rounds: int = 1) -> dict:
    """The row's result from its timed steps (``rounds`` turns of ``--steps`` each), and for
    sparsecomm rows with ``profile`` the profiled steps that continue from them."""
    a = ctx.args
    name, model, trainer, records = run["name"], run["model"], run["trainer"], run["records"]
    warmup, seconds = run["warmup"], run["seconds"]
    started = time.perf_counter()
    profiled = []
    if profile and row_kind(name) == "sc" and a.profile_steps > 0:
        # A separate short run with profile=True (it synchronizes, so it is not timed above),
        # continuing from the timed run's residuals and optimizer state.
        state = trainer.optimizer.state_dict()
        profiler = Trainer(name, ctx, model, profile=True)
        profiler.optimizer.load_state_dict(state)
        dist.barrier()
        first = warmup + len(records)
        profiled = [profiler.step(first + i) for i in range(a.profile_steps)]
        del profiler
    bytes_note = trainer.bytes_note
    run.clear()
    del trainer, model
    gc.collect()
    everyone = gather(ctx, {"records": records, "profiled": profiled})
    steps = [max(rank["records"][i]["total"] for rank in everyone) for i in range(len(records))]
    mine = everyone[0]["records"]
    byte_values = [r["bytes"] for r in mine if r["bytes"] is not None]
    densities = [r["density"] for r in mine if r["density"] is not None]
    result = {
        "row": name,
        "warmup": warmup,
        "step_s": summary(steps),
        "step_s_all": steps,
        "phases_s": {
            phase: statistics.median(r[phase] for r in mine)
            for phase in ("forward", "backward", "optimizer")
        },
        "bytes_per_step": statistics.median(byte_values) if byte_values else None,
        "bytes_note": bytes_note,
        "density": statistics.median(densities) if densities else None,
        "final_loss": mine[-1]["loss"],
        "per_rank": everyone,
        "wall_s": seconds + time.perf_counter() - started,
    }
    if rounds > 1:  # the rows took turns: each turn's median, in turn order
        per = len(steps) // rounds
        result["round_medians"] = [
            statistics.median(steps[i * per : (i + 1) * per]) for i in range(rounds)
        ]
    if profiled:
        prof = everyone[0]["profiled"]
        total = sum(r["total"] for r in prof)
        result["profile"] = {
            "steps": len(prof),
            "step_s_median": statistics.median(r["total"] for r in prof),
            **{
                f"{part}_s": sum(r[part] for r in prof) / len(prof)
                for part in ("compress", "communicate", "aggregate")
            },
            **{
                f"{part}_share": sum(r[part] for r in prof) / total
                for part in ("compress", "communicate", "aggregate")
            },
        }
    return result


def run_row(name: str, ctx: Context, profile: bool = True) -> dict:
    """Warm-up, timed steps and (sparsecomm, with ``profile``) profiled steps of one row."""
    run = start_row(name, ctx)
    timed_steps(run, ctx.args.steps)
    return finish_row(run, ctx, profile)


def run_to_target(name: str, ctx: Context) -> dict:
    """Train from the same initialization until the validation loss reaches --target-loss.

    Seconds count the training steps only (each rank's own step times, rank 0's sum); the
    evaluations on rank 0 every --eval-every steps are not counted."""
    a = ctx.args
    model = ctx.fresh_model()
    trainer = Trainer(name, ctx, model)
    seconds, step, val, reached = 0.0, 0, float("nan"), False
    dist.barrier()
    while True:
        for _ in range(a.eval_every):
            seconds += trainer.step(step)["total"]
            step += 1
            if step >= a.target_max_steps:
                break
        with trainer.shared_parameters():  # local_updates: each rank's own model otherwise
            val = ctx.from_rank0(ctx.val_loss(model) if ctx.rank == 0 else 0.0)
        seconds = ctx.from_rank0(seconds)
        if val <= a.target_loss:
            reached = True
            break
        if step >= a.target_max_steps or seconds >= a.target_max_seconds:
            break
    del trainer, model
    gc.collect()
    return {"reached": reached, "steps": step, "seconds": seconds, "val_loss": val}


def calibrate_threshold(ctx: Context) -> tuple[float, str]:
    """t for which error-feedback thresholding sends --threshold-density of the elements, on
    average over as many steps as a row takes (warm-up and timed).

    On rank 0 it takes the gradients of the initial model on the first steps' data (the
    learning rate is still warming up then, so the weights barely move) and simulates what
    ``Threshold(t)`` does with them (``r += g``; send ``abs(r) >= t``; zero what was sent),
    bisecting on t. Error feedback makes the density grow as residuals build up, so this t is
    well above the first gradient's own 1% quantile. Parameters below --min-compress-numel
    travel dense and are left out."""
    a = ctx.args
    value = 0.0
    steps = max(2, a.warmup + a.steps)
    if ctx.rank == 0:
        model = ctx.fresh_model()
        grads = []
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            ctx.loss(model, step).backward()
            grads.append(
                torch.cat(
                    [
                        p.grad.reshape(-1).float()
                        for p in model.parameters()
                        if p.grad is not None and p.numel() >= a.min_compress_numel
                    ]
                )
            )
        del model

        def density(t: float) -> float:
            residual = torch.zeros_like(grads[0])
            sent = 0
            for grad in grads:
                residual += grad
                mask = residual.abs() >= t
                sent += int(mask.sum())
                residual[mask] = 0
            return sent / (len(grads) * residual.numel())

        low, high = 0.0, float(sum(g.abs() for g in grads).max())
        for _ in range(24):  # to 2**-24 of the range
            mid = (low + high) / 2
            low, high = (mid, high) if density(mid) > a.threshold_density else (low, mid)
        value = high
        del grads
    value = ctx.from_rank0(value)
    how = (
        f"t = {value:.4g}, bisected on rank 0 so that error-feedback thresholding of the "
        f"initial model's gradients on the first {steps} steps' data sends "
        f"{a.threshold_density:g} of the elements on average (parameters of >= "
        f"{a.min_compress_numel} elements; the others travel dense)"
    )
    return value, how


# --------------------------------------------------------------------------- main


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _where(module) -> str:
    """The directory a package was imported from, relative to the repository if inside it."""
    path = Path(module.__file__).resolve().parent.parent
    try:
        return str(path.relative_to(REPO)) or "."
    except ValueError:
        return str(path)


def write_json(path: str, data: dict) -> None:
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = Context(args)
    rows = parse_rows(args.rows)
    out = {
        "rate": args.rate_label,
        "set_bytes_per_s": args.rate_bytes_per_s or None,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": ctx.threads,
        "torch": torch.__version__,
        "sparsecomm": _where(sparsecomm),
        "python": platform.python_version(),
        "params": ctx.numel,
        "rows": [],
        "skipped": [],
        "finished": False,
    }

    def save():
        if ctx.rank == 0:
            write_json(args.json, out)

    def say(text):
        if ctx.rank == 0:
            print(f"[{args.rate_label}] {text}", flush=True)

    out["link"] = measure_link(ctx)
    link = out["link"]
    if "aggregate_bytes_per_s" in link:
        set_text = (
            f"set {args.rate_bytes_per_s * 8 / 1e9:.3g} Gbit/s, "
            if args.rate_bytes_per_s
            else "unshaped, "
        )
        say(
            f"link: {set_text}all-reduce of {link['allreduce_bytes'] / 1e6:.1f} MB x "
            f"{link['reps']} in {link['seconds']:.2f} s: "
            f"{link['aggregate_bytes_per_s'] * 8 / 1e9:.3g} Gbit/s through lo "
            f"({link['per_rank_bytes_per_s'] * 8 / 1e9:.3g} per rank)"
        )
    save()
    if any("Threshold(t)" in r for r in rows):
        calibrated = args.threshold is None
        if calibrated:
            ctx.threshold, how = calibrate_threshold(ctx)
        else:
            ctx.threshold = args.threshold
            how = args.threshold_how or f"given: --threshold {args.threshold:g}"
        out["threshold"] = {"t": ctx.threshold, "how": how, "calibrated": calibrated}
        say(f"Threshold(t): {how}")

    if args.interleave:
        run_interleaved(rows, ctx, out, say, save)
    else:
        run_in_rounds(rows, ctx, out, say, save)
    out["finished"] = True
    save()
    dist.barrier()  # tear down together: gloo can abort a rank whose peer left
    dist.destroy_process_group()


def run_interleaved(rows: list[str], ctx: Context, out: dict, say, save) -> None:
    """Every row built once; then ``--rounds`` rounds in which each row takes ``--steps``
    timed steps in turn (every other round in reverse order). Adjacent turns are seconds
    apart, so a row's ratio to another, turn by turn, is free of the machine's drift over
    minutes."""
    args = ctx.args
    runs = {}
    for name in rows:
        try:
            runs[name] = start_row(name, ctx)
        except Skip as why:
            out["skipped"].append({"row": name, "reason": str(why)})
            say(f"{name}: skipped: {why}")
            gc.collect()
            dist.barrier()
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for name in order:
            timed_steps(runs[name], args.steps)
        say(f"round {round_ + 1}/{args.rounds} done")
    for name in list(runs):
        result = finish_row(runs.pop(name), ctx, profile=True, rounds=args.rounds)
        if args.target_loss is not None:
            result["target"] = run_to_target(name, ctx)
        out["rows"].append(result)
        report_row(result, args.rounds, args.rounds - 1, say)
        save()


def run_in_rounds(rows: list[str], ctx: Context, out: dict, say, save) -> None:
    """``--rounds`` rounds in which each row, built afresh, runs in turn."""
    args = ctx.args
    by_name = {}
    skipped = set()
    for round_ in range(args.rounds):
        for name in rows if round_ % 2 == 0 else rows[::-1]:
            if name in skipped:
                continue
            try:
                result = run_row(name, ctx, profile=round_ == 0)
            except Skip as why:
                skipped.add(name)
                out["skipped"].append({"row": name, "reason": str(why)})
                say(f"{name}: skipped: {why}")
                save()
                gc.collect()
                dist.barrier()
                continue
            if round_ == 0 and args.target_loss is not None:
                result["target"] = run_to_target(name, ctx)
            if name in by_name:
                result = merge_rounds(by_name[name], result)
            by_name[name] = result
            out["rows"] = [by_name[n] for n in rows if n in by_name]
            report_row(result, args.rounds, round_, say)
            save()


def merge_rounds(first: dict, later: dict) -> dict:
    """One row's results over rounds: every timed step pooled (``step_s`` summarises them
    all), each round's median kept in ``round_medians``; the profile and loss of the
    first round."""
    merged = dict(first)
    merged["step_s_all"] = first["step_s_all"] + later["step_s_all"]
    merged["step_s"] = summary(merged["step_s_all"])
    merged["round_medians"] = first.get("round_medians", [first["step_s"]["median"]]) + [
        later["step_s"]["median"]
    ]
    # Each round's phase medians, and their median over the rounds so far.
    merged["round_phases_s"] = first.get("round_phases_s", [first["phases_s"]]) + [
        later["phases_s"]
    ]
    merged["phases_s"] = {
        phase: statistics.median(r[phase] for r in merged["round_phases_s"])
        for phase in first["phases_s"]
    }
    merged["wall_s"] = first["wall_s"] + later["wall_s"]
    return merged


def report_row(result: dict, rounds: int, round_: int, say) -> None:
    """One line per row and round: the step time over the rounds so far."""
    s = result["step_s"]
    mb = result["bytes_per_step"]
    target = result.get("target")
    say(
        (f"round {round_ + 1}/{rounds}: " if rounds > 1 else "")
        + f"{result['row']}: step {s['median'] * 1e3:.0f} ms [{s['p20'] * 1e3:.0f}-"
        f"{s['p80'] * 1e3:.0f}], "
        + (f"{mb / 1e6:.3g} MB/rank/step" if mb is not None else "bytes n/a")
        + (
            f", target: {target['seconds']:.1f} s / {target['steps']} steps "
            f"(val {target['val_loss']:.3f})"
            if target
            else ""
        )
    )


if __name__ == "__main__":
    main()
