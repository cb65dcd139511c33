"""Whole training-step time with each compressor, against DistributedDataParallel.

    torchrun --nproc_per_node=W benchmarks/bench_step.py --params 1e8 [--params 1e9] [--out FILE]
    torchrun --nproc_per_node=W benchmarks/bench_step.py --model gpt [--out FILE]

Two models:

- ``--model linear`` (the default): square 4096-wide linear layers (no bias) holding about
  ``--params`` fp32 parameters, loss ``mean(y**2)``, SGD with momentum, a batch of
  ``--batch`` rows (default 64) per rank.
- ``--model gpt``: a GPT-2-small-shaped language model (``--layers 12 --d-model 768
  --heads 12 --vocab 50257 --context 512``, untied ``lm_head``: 163M parameters in 149
  tensors), bf16 autocast, AdamW, ``--batch`` sequences (default 8) per rank, random tokens.

Variants (``--variants``, comma separated): ``none`` (the plain optimizer, no exchange),
``DDP`` (fp32), ``DDP+fp16`` (DDP with ``fp16_compress_hook``), a sparsecomm compressor
wrapping the optimizer (``Dense()``, ``Cast(bf16)``, ``Cast(fp16)``, ``TopK(d)``,
``Threshold(t)``), and ``ddp+sc-<compressor>``: DDP with ``sparsecomm.ddp_comm_hook``
(reported as skipped while sparsecomm has no ``ddp_comm_hook``). A sparsecomm row may
end in options, each after a ``/``: ``/stream`` (the engine's side CUDA stream), ``/noadopt``
(buckets of one parameter copy their gradient instead of adopting it), ``/nographs``
(``cuda_graphs=False``), ``/adam`` (``TopK(d, select="adam")``), ``/bf16``
(``TopK(d, value_dtype=torch.bfloat16)``: 6-byte pairs), ``/cap<MiB>``
(``bucket_cap_mb``: the optimizer's, or in a ``ddp+sc-`` row DDP's; ``/capinf``: no cap),
``/updates`` and ``/local`` (``exchange="updates"`` and ``"local_updates"``), ``/shared``
(``sparsecomm.SharedMomentAdamW`` with the workload's AdamW settings, in place of AdamW; at
one rank it never refreshes its shared moment), ``/wait`` (with ``--adamw fused``: the fused
AdamW steps after the host has read the step's verdict, as every other optimizer does,
instead of ahead of it), e.g. ``TopK(0.01)/nographs/stream``,
``ddp+sc-TopK(0.01)/cap100`` or ``TopK(0.01)/local/shared``.

Each row builds a fresh model from the same seed, runs ``--warmup`` steps and times
``--steps`` (forward, backward, optimizer step, ``zero_grad``; the device synchronized
before and after each step); the rows run in turn, ``--repeats`` times (every other repeat
in reverse order, against drift), and the table gives the median of the per-repeat medians.
With ``--interleave R`` every row is built at once and the rows take turns, ``--steps``
steps each, for R rounds: rows that are compared ran seconds apart, not minutes.
Per row also: peak memory (``torch.cuda.max_memory_allocated``, reset before the row's model
is built), bytes this rank sent per step, the ratios against the DDP and DDP+fp16 rows, and
after all timing (so that the profiler cannot slow a timed step) a pass that counts the CUDA
kernels of one profiled step (``torch.profiler``, CUDA activity; n/a on CPU). For sparsecomm
rows, a further 5 steps with ``profile=True`` (which synchronizes) give the share of the
step spent compressing / communicating / aggregating. NCCL on GPUs, gloo on CPUs. Rank 0
prints a markdown table with the targets of issue 11 and appends both to ``--out``.

    # CPU smoke test of every code path (seconds):
    torchrun --nproc_per_node=2 benchmarks/bench_step.py --model gpt --layers 2 --d-model 64 \\
        --heads 2 --vocab 256 --context 32 --batch 2 --warmup 1 --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import re
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import sparsecomm

WIDTH = 4096  # 16.8M parameters per layer: large buckets, realistic GEMMs

DEFAULT_VARIANTS = {
    "linear": "DDP,Dense(),Cast(bf16),TopK(0.01),TopK(0.001)",
    "gpt": "none,DDP,DDP+fp16,Dense(),Cast(bf16),TopK(0.01),TopK(0.001),ddp+sc-TopK(0.01)",
}
DEFAULT_BATCH = {"linear": 64, "gpt": 8}
DEFAULT_WARMUP = {"linear": 5, "gpt": 10}
DEFAULT_STEPS = {"linear": 20, "gpt": 30}
PROFILE_STEPS = 5  # steps with profile=True for the compress / communicate / aggregate shares
LAUNCH_WARMUP = 3  # steps before the profiled one: optimizer state made, kernels compiled
LAUNCH_EXTRA_S = 45.0  # the kernel counts may start until --budget-s plus this


# ----------------------------------------------------------------------------- models


def make_linear(params: float, device) -> nn.Module:
    layers = max(1, round(params / WIDTH**2))
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: 1e9 parameters in milliseconds
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in model:
        nn.init.normal_(layer.weight, std=WIDTH**-0.5)
    return model


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 layout (pre-norm blocks, learned positions), with an untied ``lm_head``."""

    def __init__(self, layers: int, d_model: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.h = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def fmt_params(numel: int) -> str:
    return f"{numel / 1e6:.0f}M" if numel >= 10**7 else f"{numel / 1e6:.3g}M"


@dataclass
class Workload:
    """One model, its batch, its loss and its optimizer: what every row of a table shares."""

    label: str  # for the table's params column
    description: str  # for the table's header
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[list], torch.optim.Optimizer]
    loss: Callable[[nn.Module], torch.Tensor]
    targets: list = field(default_factory=list)


def linear_workload(params: float, args, device) -> Workload:
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch, WIDTH, device=device, generator=gen)
    layers = max(1, round(params / WIDTH**2))
    return Workload(
        label=fmt_params(layers * WIDTH**2),
        description=f"linear: {layers} x {WIDTH}x{WIDTH} layers, SGD momentum 0.9, fp32, "
        f"batch {args.batch} per rank",
        make_model=lambda: make_linear(params, device),
        make_optimizer=lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        loss=lambda model: model(x).float().pow(2).mean(),
        targets=[("TopK(0.01)", "DDP", 1.25, "TopK(0.01) <= 1.25x DDP (issue 11, at 1e9)")],
    )


def gpt_workload(args, device) -> Workload:
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    tokens = torch.randint(args.vocab, (args.batch, args.context + 1), device=device, generator=gen)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def make_model():
        torch.manual_seed(0)
        with torch.device(device):
            return GPT(args.layers, args.d_model, args.heads, args.vocab, args.context)

    def loss(model):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    with torch.device("meta"):
        shape = GPT(args.layers, args.d_model, args.heads, args.vocab, args.context)
    numel = sum(p.numel() for p in shape.parameters())
    tensors = len(list(shape.parameters()))
    # torch's default on CUDA is foreach; fused=True steps in one kernel per group.
    fused = getattr(args, "adamw", "default") == "fused"
    adamw = {"fused": True} if fused else {}
    return Workload(
        label=fmt_params(numel),
        description=f"GPT: {args.layers} layers, d={args.d_model}, {args.heads} heads, vocab "
        f"{args.vocab}, context {args.context}, untied lm_head ({numel / 1e6:.1f}M parameters "
        f"in {tensors} tensors), bf16 autocast, {'fused ' if fused else ''}AdamW, batch "
        f"{args.batch}x{args.context} per rank",
        make_model=make_model,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.1, **adamw),
        loss=loss,
        targets=[
            ("TopK(0.01)", "DDP", 1.10, "TopK(0.01) <= 1.10x DDP"),
            ("Dense()", "DDP", 1.03, "Dense() <= 1.03x DDP"),
            ("Cast(bf16)", "DDP+fp16", 1.00, "Cast(bf16) <= DDP+fp16 hook"),
        ],
    )


# ----------------------------------------------------------------------------- rows


OPTIONS = (
    "stream", "noadopt", "nographs", "adam", "bf16", "updates", "local", "shared", "wait",
)  # fmt: skip


def split_options(name: str) -> tuple[str, set[str]]:
    """``"TopK(0.01)/noadopt"`` -> ``("TopK(0.01)", {"noadopt"})``. ``/cap100`` builds the
    row with ``bucket_cap_mb=100`` (``/capinf``: no cap)."""
    base, *knobs = name.split("/")
    unknown = {k for k in knobs if k not in OPTIONS and bucket_cap(k) is None}
    if unknown:
        raise SystemExit(
            f"unknown option(s) {sorted(unknown)} in {name!r}: use {OPTIONS} or cap<MiB>"
        )
    if sum(bucket_cap(k) is not None for k in knobs) > 1:
        raise SystemExit(f"{name!r} gives more than one /cap<MiB>: give one")
    return base, set(knobs)


def bucket_cap(knob: str) -> float | None:
    """``"cap100"`` -> 100.0, ``"capinf"`` -> inf; None for any other knob."""
    match = re.fullmatch(r"cap([0-9.]+|inf)", knob)
    return None if match is None else float(match.group(1))


def knob_cap(knobs: set[str], default: float | None) -> float | None:
    """The row's ``/cap<MiB>`` (``split_options`` allows one at most), else ``default``."""
    caps = [cap for cap in map(bucket_cap, knobs) if cap is not None]
    return caps[0] if caps else default


def make_compressor(name: str) -> sparsecomm.Compressor:
    name, knobs = split_options(name)
    fixed = {
        "Dense()": sparsecomm.Dense,
        "Cast(bf16)": lambda: sparsecomm.Cast(torch.bfloat16),
        "Cast(fp16)": lambda: sparsecomm.Cast(torch.float16),
    }
    if name in fixed:
        return fixed[name]()
    match = re.fullmatch(r"(TopK|Threshold)\(([0-9.eE+-]+)\)", name)
    if match is None:
        raise SystemExit(
            f"unknown variant {name!r}: use none, DDP, DDP+fp16, Dense(), Cast(bf16), "
            "Cast(fp16), TopK(d), Threshold(t), or ddp+sc-<one of those compressors>"
        )
    topk_knobs = {"adam": {"select": "adam"}, "bf16": {"value_dtype": torch.bfloat16}}
    settings = {}
    for knob, setting in topk_knobs.items():
        if knob in knobs:
            if match.group(1) != "TopK":
                raise SystemExit(f"/{knob} is a TopK option ({setting}): {name!r} is not a TopK")
            settings.update(setting)
    return getattr(sparsecomm, match.group(1))(float(match.group(2)), **settings)


def shared_moment_like(adamw: torch.optim.Optimizer, name: str) -> sparsecomm.SharedMomentAdamW:
    """A ``/shared`` row's optimizer: SharedMomentAdamW with ``adamw``'s settings."""
    if not isinstance(adamw, torch.optim.AdamW):
        raise SystemExit(f"{name!r}: /shared replaces AdamW, and this model's optimizer is not")
    group = adamw.param_groups[0]
    settings = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}
    return sparsecomm.SharedMomentAdamW(group["params"], **settings)


def is_sparsecomm(name: str) -> bool:
    return name not in ("none", "DDP", "DDP+fp16") and not name.startswith("ddp+sc-")


def skip_reason(name: str) -> str:
    if name.startswith("ddp+sc-") and not hasattr(sparsecomm, "ddp_comm_hook"):
        return "skipped: sparsecomm has no ddp_comm_hook"
    return ""


@dataclass
class Built:
    step: Callable[[], None]
    numel: int
    sent_bytes: Callable[[], int | None]
    optimizer: torch.optim.Optimizer
    objects: list  # what holds memory, dropped after the row


def build_row(name: str, workload: Workload, device) -> Built:
    model = workload.make_model()
    numel = sum(p.numel() for p in model.parameters())
    module = model
    sent_bytes: Callable[[], int | None] = lambda: 0  # noqa: E731
    sent: list[int] | None = None  # a /shared row's bytes of each step
    if name in ("DDP", "DDP+fp16") or name.startswith("ddp+sc-"):
        # DDP's own default, 25 MiB; a hook row's /cap<MiB> sets DDP's bucket_cap_mb
        cap = knob_cap(split_options(name)[1], default=25)
        module = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap
        )
        if name == "DDP":
            sent_bytes = lambda: 4 * numel  # noqa: E731
        elif name == "DDP+fp16":
            module.register_comm_hook(None, default_hooks.fp16_compress_hook)
            sent_bytes = lambda: 2 * numel  # noqa: E731
        else:
            compressor_name = name[len("ddp+sc-") :]
            state, hook = sparsecomm.ddp_comm_hook(
                make_compressor(compressor_name),
                cuda_graphs="nographs" not in split_options(compressor_name)[1],
            )
            module.register_comm_hook(state, hook)

            def sent_bytes(state=state):
                if hasattr(state, "last_bytes_sent"):
                    return state.last_bytes_sent
                return getattr(getattr(state, "last_stats", None), "bytes_sent", None)

        optimizer = workload.make_optimizer(list(module.parameters()))
    elif name == "none":
        optimizer = workload.make_optimizer(list(model.parameters()))
    else:
        # Built before the first backward: the exchange may run in backward hooks.
        _, knobs = split_options(name)
        cap = knob_cap(knobs, default=None)
        inner = workload.make_optimizer(list(model.parameters()))
        if "shared" in knobs:
            inner = shared_moment_like(inner, name)
        exchange = "local_updates" if "local" in knobs else "gradients"
        exchange = "updates" if "updates" in knobs else exchange
        optimizer = sparsecomm.CompressedOptimizer(
            inner,
            make_compressor(name),
            cuda_graphs="nographs" not in knobs,
            bucket_cap_mb=cap,  # None: the library default
            exchange=exchange,
        )
        optimizer._engine.side_stream = "stream" in knobs
        if "wait" in knobs:  # a fused AdamW steps after the verdict, as other optimizers do
            optimizer._ahead = False
            for handle in optimizer._settle_hooks:  # (and backward runs no hook of its)
                handle.remove()
        if "noadopt" in knobs:
            for bucket in optimizer._engine.buckets:
                bucket.adopts = False
        if "shared" in knobs:  # every refresh_every-th step also sends the refresh: the mean
            sent = []
            sent_bytes = lambda: sum(sent) // len(sent) if sent else 0  # noqa: E731
        else:
            sent_bytes = lambda: optimizer.last_stats.bytes_sent  # noqa: E731

    def step():
        workload.loss(module).backward()
        optimizer.step()
        optimizer.zero_grad()
        if sent is not None:
            sent.append(optimizer.last_stats.bytes_sent)

    return Built(step, numel, sent_bytes, optimizer, [module, model, optimizer])


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, warmup: int, steps: int, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Result:
    name: str
    note: str = ""
    numel: int = 0
    medians: list = field(default_factory=list)  # one per repeat, seconds
    peak_bytes: int | None = None
    base_bytes: int = 0  # allocated when the row started (left by earlier rows)
    sent: int | None = None
    shares: str = ""
    kernels: int | None = None
    launch_calls: int | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.medians) if self.medians else None


def time_row(result: Result, workload: Workload, args, device, first: bool) -> None:
    """One timed run of a row: fresh model, warmup, timed steps, peak memory."""
    cuda = device.type == "cuda"
    release(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        result.base_bytes = max(result.base_bytes, torch.cuda.memory_allocated(device))
    built = build_row(result.name, workload, device)
    times = time_steps(built.step, args.warmup, args.steps, device)
    result.medians.append(statistics.median(times))
    result.numel = built.numel
    result.sent = built.sent_bytes()
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        result.peak_bytes = max(result.peak_bytes or 0, peak)
    if first and args.shares and is_sparsecomm(result.name):
        result.shares = profile_shares(built, device)
    del built
    release(device)


def profile_shares(built: Built, device) -> str:
    """compress / communicate / aggregate share of a step, from PROFILE_STEPS steps with
    profile=True (which synchronizes around each part)."""
    opt = built.optimizer
    opt.profile = True
    profiled = time_steps(built.step, 0, PROFILE_STEPS, device)
    opt.profile = False
    stats = opt.last_stats
    total = statistics.median(profiled)
    parts = [
        getattr(stats, name, None)
        for name in ("compress_seconds", "communicate_seconds", "aggregate_seconds")
    ]
    if any(part is None for part in parts) or total <= 0:
        return "n/a"
    return " / ".join(f"{100 * seconds / total:.0f}%" for seconds in parts)


LAUNCH_APIS = ("LaunchKernel", "cudaGraphLaunch", "LaunchCooperativeKernel")


def count_kernels(step, device) -> tuple[int | None, int | None]:
    """(GPU kernels, CUDA launch API calls) in one profiled step; (None, None) on CPU.

    GPU kernels: the profiler's device events (ProfilerActivity.CUDA), leaving out memcpy,
    memset and the GPU copies of record_function ranges (DDP annotates its forward; those
    carry a CPU event's name or the user-annotation flag). Launch calls: the host's
    cudaLaunchKernel / cuLaunchKernel(Ex) / cudaLaunchKernelExC / graph launch events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = list(prof.events())
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    kernels = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith(("Memcpy", "Memset"))
        and e.name not in cpu_names
    ]
    launches = [
        e
        for e in events
        if e.device_type == DeviceType.CPU and any(api in e.name for api in LAUNCH_APIS)
    ]
    if not cuda:
        return None, None
    return len(kernels), len(launches)


def launch_row(result: Result, workload: Workload, device) -> None:
    release(device)
    built = build_row(result.name, workload, device)
    time_steps(built.step, LAUNCH_WARMUP, 0, device)
    result.kernels, result.launch_calls = count_kernels(built.step, device)
    del built
    release(device)


# ----------------------------------------------------------------------------- the table


def agreed(value):
    """Rank 0's value on every rank (decisions that change which collectives run)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def guarded(result: Result, what: str, fn) -> bool:
    """Run one part of a row; on failure note it in the row and go on with the others."""
    try:
        fn()
        return True
    except Exception as error:  # noqa: BLE001 - a benchmark reports and measures the rest
        if dist.get_rank() == 0:
            traceback.print_exc()
        result.note = f"{what} failed: {type(error).__name__}: {error}"[:200].replace("|", "/")
        return False


def interleaved(results: list[Result], workload: Workload, args, device, out_of_time) -> None:
    """``--interleave R``: every row built at once, then R rounds in which each row runs
    ``--steps`` timed steps in turn (every other round in reverse order). A row's median per
    round lands in ``medians``, so the repeat-by-repeat ratios pair blocks that ran seconds
    apart. Peak memory: what the row allocated beyond what was allocated before it was
    built (the other rows' resident state), plus what was allocated before any row."""
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    release(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    built = {}
    for result in results:
        if result.note:
            continue

        def build(r=result):
            release(device)
            before = 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            b = build_row(r.name, workload, device)
            time_steps(b.step, args.warmup, 0, device)
            if cuda:
                r.peak_bytes = base + torch.cuda.max_memory_allocated(device) - before
            r.base_bytes, r.numel = base, b.numel
            built[r.name] = b

        guarded(result, "building", build)
    for round_ in range(args.interleave):
        if round_ > 0 and out_of_time():
            if rank == 0:
                print(f"# time budget of {args.budget_s:.0f} s spent in round {round_ + 1}")
            break
        order = results if round_ % 2 == 0 else results[::-1]
        for result in order:
            if result.name not in built or result.note:
                continue

            def timed(r=result):
                r.medians.append(
                    statistics.median(time_steps(built[r.name].step, 0, args.steps, device))
                )

            guarded(result, "timing", timed)
        if rank == 0:
            line = ", ".join(f"{r.name} {r.medians[-1] * 1e3:.2f}" for r in results if r.medians)
            print(f"# {workload.label} round {round_ + 1} ms: {line}", flush=True)
    for result in results:
        if result.name in built and not result.note:
            result.sent = built[result.name].sent_bytes()
            graphs = getattr(getattr(built[result.name].optimizer, "_engine", None), "graphs", None)
            if graphs is not None and rank == 0:
                captures = graphs.captured
                print(f"# {result.name}: {graphs.replays} graph replays, {captures} captures")
            if args.shares and is_sparsecomm(result.name):
                guarded(
                    result,
                    "profile",
                    lambda r=result: setattr(r, "shares", profile_shares(built[r.name], device)),
                )
    built.clear()
    release(device)


def run_table(workload: Workload, names: list[str], args, device, started: float) -> list[Result]:
    results = [Result(name, note=skip_reason(name)) for name in names]
    rank = dist.get_rank()

    def out_of_time(extra: float = 0.0) -> bool:  # the same answer on every rank
        limit = None if args.budget_s is None else args.budget_s + extra
        return agreed(limit is not None and time.monotonic() - started > limit)

    stopped = False
    if args.interleave:
        interleaved(results, workload, args, device, out_of_time)
    for repeat in range(0 if args.interleave else args.repeats):
        order = results if repeat % 2 == 0 else results[::-1]
        for result in order:
            if result.note:
                continue
            if repeat > 0 and out_of_time():  # the first repeat always runs whole
                stopped = True
                break
            ok = guarded(
                result,
                "timing",
                lambda r=result, first=repeat == 0: time_row(r, workload, args, device, first),
            )
            if rank == 0 and ok:
                print(
                    f"# {workload.label} {result.name} repeat {repeat + 1}: "
                    f"{result.medians[-1] * 1e3:.2f} ms ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
        if rank == 0:  # what a timeout would otherwise lose
            print(f"# after repeat {repeat + 1}:", format_table(workload, results, args, device))
        if stopped:
            if rank == 0:
                print(f"# time budget of {args.budget_s:.0f} s spent in repeat {repeat + 1}")
            break
    if args.launches:
        for result in results:
            if result.note or not result.medians:
                continue
            if out_of_time(extra=LAUNCH_EXTRA_S):
                if rank == 0:
                    print(f"# time budget spent: no kernel count from {result.name} on")
                break
            guarded(result, "kernel count", lambda r=result: launch_row(r, workload, device))
    return results


def ratio(a, b) -> str:
    return f"{a / b:.3f}x" if a is not None and b else ""


def format_table(workload: Workload, results: list[Result], args, device) -> str:
    by_name = {r.name: r for r in results}
    ddp = by_name.get("DDP")
    fp16 = by_name.get("DDP+fp16")
    ddp_ms = ddp.median if ddp else None
    fp16_ms = fp16.median if fp16 else None
    ddp_peak = ddp.peak_bytes if ddp else None
    world = dist.get_world_size()
    lines = []
    for r in results:
        head = f"| {workload.label} | {world} | {args.label} | {r.name} |"
        if r.median is None:
            lines.append(head + f" {r.note or 'no result'} |" + " |" * 10)
            continue
        repeats = " / ".join(f"{m * 1e3:.2f}" for m in r.medians)
        peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.2f}"
        kernels = "n/a" if r.kernels is None else str(r.kernels)
        calls = "n/a" if r.launch_calls is None else str(r.launch_calls)
        sent = "" if r.sent is None else f"{r.sent / 1e6:.4g}"
        lines.append(
            head + f" {r.median * 1e3:.2f} | {repeats} | {ratio(r.median, ddp_ms)} | "
            f"{ratio(r.median, fp16_ms)} | {peak} | {ratio(r.peak_bytes, ddp_peak)} | "
            f"{kernels} | {calls} | {sent} | {r.shares} | {r.note} |"
        )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (not a measurement)"
    header = [
        f"\n{gpu}, torch {torch.__version__}, {datetime.date.today().isoformat()}, W={world}",
        f"{workload.description}; {args.warmup} warmup + {args.steps} timed steps per row, "
        f"{max((len(r.medians) for r in results), default=0)} "
        + (
            f"interleaved round(s): all rows built at once, each running {args.steps} steps in turn"
            if args.interleave
            else "repeat(s) of the rows"
        )
        + " (every other one in reverse order)",
        "",
        "| params | W | path | variant | step ms (median of repeats) | repeat medians ms | "
        "x DDP | x DDP+fp16 | peak GiB | peak x DDP | kernels / step | launch calls / step | "
        "MB sent / rank / step | compress / communicate / aggregate share | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = max((r.base_bytes for r in results), default=0)
    notes = [""]
    if args.interleave:
        notes.append(
            "- peak: what the row allocated beyond the other rows' resident state, plus "
            f"{base / 2**30:.2f} GiB allocated before any row was built"
        )
    elif base > 2**20:
        notes.append(
            f"- {base / 2**30:.2f} GiB were still allocated when some row started "
            "(included in its peak)"
        )
    notes += target_lines(workload, by_name)
    return "\n".join(header + lines + notes)


def paired(r: Result, b: Result) -> str:
    """The ratio repeat by repeat (the two rows of one repeat run minutes apart at most, so
    a machine that drifts between repeats cancels out): its median and range."""
    pairs = sorted(x / y for x, y in zip(r.medians, b.medians))
    if len(pairs) < 2:
        return ""
    return f"; repeat by repeat {statistics.median(pairs):.3f}x [{pairs[0]:.3f}-{pairs[-1]:.3f}]"


def target_lines(workload: Workload, by_name: dict) -> list[str]:
    lines = ["", "Targets (issue 11):", ""]

    def verdict(value, limit):
        return "met" if value <= limit else "NOT met"

    for name, against, limit, text in workload.targets:
        r, b = by_name.get(name), by_name.get(against)
        if not (r and b and r.median and b.median):
            lines.append(f"- {text}: n/a (a row is missing)")
            continue
        value = r.median / b.median
        lines.append(
            f"- {text}: {r.median * 1e3:.2f} / {b.median * 1e3:.2f} ms = {value:.3f}x, "
            f"{verdict(value, limit)}{paired(r, b)}"
        )
    ddp = by_name.get("DDP")
    for r in by_name.values():
        if r is ddp or r.name in ("none", "DDP+fp16") or r.median is None:
            continue
        if ddp is None or ddp.peak_bytes is None or r.peak_bytes is None:
            lines.append(f"- {r.name} peak memory <= DDP's: n/a")
            continue
        value = r.peak_bytes / ddp.peak_bytes
        lines.append(
            f"- {r.name} peak memory <= DDP's: {r.peak_bytes / 2**30:.2f} / "
            f"{ddp.peak_bytes / 2**30:.2f} GiB = {value:.3f}x, {verdict(value, 1.0)}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--model", choices=("linear", "gpt"), default="linear")
    parser.add_argument(
        "--params",
        type=float,
        action="append",
        default=None,
        help="linear: parameters (repeatable; default 1e8)",
    )
    parser.add_argument("--layers", type=int, default=12, help="gpt")
    parser.add_argument("--d-model", type=int, default=768, help="gpt")
    parser.add_argument("--heads", type=int, default=12, help="gpt")
    parser.add_argument("--vocab", type=int, default=50257, help="gpt")
    parser.add_argument("--context", type=int, default=512, help="gpt")
    parser.add_argument("--batch", type=int, default=None, help="per rank (linear 64, gpt 8)")
    parser.add_argument(
        "--adamw",
        choices=("default", "fused"),
        default="default",
        help="gpt: torch's default AdamW (foreach on CUDA) or AdamW(fused=True), every row",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (linear 20, gpt 30)")
    parser.add_argument("--warmup", type=int, default=None, help="linear 5, gpt 10")
    parser.add_argument("--repeats", type=int, default=2, help="times the set of rows runs")
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="R",
        help="build every row at once and time R rounds of --steps steps per row, the rows "
        "taking turns (instead of --repeats of whole rows one after the other)",
    )
    parser.add_argument("--variants", default=None)
    parser.add_argument(
        "--no-launches",
        dest="launches",
        action="store_false",
        help="skip the profiled step that counts kernels",
    )
    parser.add_argument(
        "--no-shares",
        dest="shares",
        action="store_false",
        help="skip the profile=True steps of the sparsecomm rows",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="after this many seconds start no further row of a repeat after "
        f"the first (nor a kernel count after {LAUNCH_EXTRA_S:.0f} s more)",
    )
    parser.add_argument("--label", default="", help="network path, for the table")
    parser.add_argument("--out", default=None, help="append the table here (rank 0)")
    args = parser.parse_args()  # fmt: skip
    args.batch = args.batch or DEFAULT_BATCH[args.model]
    args.steps = DEFAULT_STEPS[args.model] if args.steps is None else args.steps
    args.warmup = DEFAULT_WARMUP[args.model] if args.warmup is None else args.warmup
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit("--steps and --repeats must be at least 1")
    names = (args.variants or DEFAULT_VARIANTS[args.model]).split(",")
    for name in names:  # fail before any work on a name nobody knows
        if name not in ("none", "DDP", "DDP+fp16"):
            make_compressor(name.removeprefix("ddp+sc-"))

    started = time.monotonic()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    if args.model == "gpt":
        workloads = [gpt_workload(args, device)]
    else:
        workloads = [linear_workload(params, args, device) for params in args.params or [1e8]]
    for workload in workloads:
        results = run_table(workload, names, args, device, started)
        if dist.get_rank() == 0:
            table = format_table(workload, results, args, device)
            print(table, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(table + "\n")
    if dist.get_rank() == 0:
        print(f"# bench_step done in {time.monotonic() - started:.0f} s", flush=True)
    dist.barrier()  # tear down together: gloo can abort a rank whose peer left
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
