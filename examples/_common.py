"""Shared parts of the training examples: flags, process group, optimizer, data order,
checkpoints, logging and the training loop.

Not part of the sparsecomm API: the examples import it from their own directory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import sparsecomm
except ImportError:  # run from a checkout without `pip install -e .`: use the checkout's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import sparsecomm

try:  # a progress bar is a nicety, not a requirement
    from tqdm.auto import tqdm
except ImportError:  # without tqdm, train() runs with _NoBar (tests/test_examples.py)
    tqdm = None

COMPRESSORS = ("dense", "fp16", "bf16", "topk", "threshold")
LATEST = "latest"  # file in the checkpoint directory naming the last complete checkpoint


# --------------------------------------------------------------------------- flags


def make_parser(description: str, **defaults: Any) -> argparse.ArgumentParser:
    """The flags both examples share; ``defaults`` overrides per example (lr, steps, ...)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add(
        "--compressor",
        choices=COMPRESSORS,
        default="topk",
        help="dense: fp32 all-reduce; fp16/bf16: Cast; topk: TopK(--density); "
        "threshold: Threshold(--threshold)",
    )
    add("--density", type=float, default=0.01, help="TopK density (fraction of elements sent)")
    add(
        "--density-warmup",
        type=int,
        default=0,
        metavar="N",
        help="TopK density warm-up over the first N steps (TopK(warmup_steps=N))",
    )
    add(
        "--density-warmup-shape",
        choices=("exponential", "dense"),
        default="exponential",
        help="exponential: from --density-warmup-start down to --density (DGC); "
        "dense: send everything for N steps",
    )
    add(
        "--density-warmup-start",
        type=float,
        default=0.25,
        help="density of the first exponential warm-up step",
    )
    add(
        "--momentum-correction",
        action="store_true",
        help="with --optimizer sgd: apply the momentum 0.9 before compression (DGC) "
        "instead of in SGD",
    )
    add(
        "--exchange",
        choices=("gradients", "updates", "local_updates"),
        default="gradients",
        help="gradients: average gradients, then step; updates: each rank steps on its own "
        "gradient and the updates are compressed and averaged; local_updates: the same, "
        "each rank's model keeping the updates it has not sent (evaluated and saved with "
        "the shared parameters)",
    )
    add(
        "--select",
        choices=("magnitude", "adam"),
        default="magnitude",
        help="TopK's choice: the largest |grad + residual|, or the largest in Adam's units, "
        "|grad + residual| / (sqrt(max(v, mean v)) + eps): TopK(select='adam') (needs "
        "--optimizer adamw or catchup-adamw)",
    )
    add(
        "--topk-values",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the dtype TopK's values travel in: fp32 (8-byte pairs) or bf16 (6-byte pairs, "
        "the rounding kept in the residual): TopK(value_dtype=...)",
    )
    add("--threshold", type=float, default=1e-3, help="Threshold magnitude")
    add("--no-error-feedback", action="store_true", help="drop what is not sent")
    add(
        "--optimizer",
        choices=("sgd", "adamw", "catchup-adamw", "shared-moment-adamw"),
        default="sgd",
        help="wrapped optimizer: SGD with momentum 0.9, AdamW, sparsecomm.CatchUpAdamW "
        "(AdamW that credits a coordinate the steps it waited to be sent), or "
        "sparsecomm.SharedMomentAdamW (with --exchange updates or local_updates: AdamW whose "
        "second moment is the ranks' averaged gradient's, shared)",
    )
    add(
        "--refresh-every",
        type=int,
        default=None,
        help="with --optimizer shared-moment-adamw: steps between refreshes of the shared "
        "second moment (each all-reduces the gradients in bfloat16); not given: "
        "SharedMomentAdamW's own, 10",
    )
    add("--lr", type=float, default=0.05, help="peak learning rate")
    add("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    add("--weight-decay", type=float, default=0.0)
    add("--steps", type=int, default=300, help="optimizer steps in total")
    add("--batch-size", type=int, default=32, help="examples per rank per micro-batch")
    add(
        "--accumulate",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step: the first N-1 backward passes run inside "
        "opt.no_sync() (gradients add up locally), the last one sends",
    )
    add("--seed", type=int, default=0, help="model init, data split and data order")
    add("--eval-every", type=int, default=25, help="evaluate every N steps (and at the end)")
    add(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="MiB of float32 per bucket (default: the compressor's: 25 for dense and cast, "
        "100 for topk and threshold)",
    )
    add(
        "--min-compress-numel",
        type=int,
        default=1024,
        help="parameters smaller than this travel dense",
    )
    add("--checkpoint", metavar="DIR", help="save model + optimizer state under DIR")
    add("--checkpoint-every", type=int, default=50, metavar="N", help="checkpoint every N steps")
    add(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in --checkpoint DIR (fresh start if none)",
    )
    add(
        "--log-json",
        metavar="PATH",
        help="rank 0 appends JSON lines: config, per-step train and eval metrics, final",
    )
    add("--save-final", metavar="PATH", help="rank 0 saves the final model state_dict here")
    add(
        "--stop-after",
        type=int,
        metavar="S",
        help="testing: exit abruptly (os._exit, no cleanup) after step S, like a kill",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    add(
        "--log-update-rms",
        action="store_true",
        help="log each step's parameter change, its root mean square over every parameter "
        "in units of the learning rate, as update_rms (costs a copy of the parameters a step)",
    )
    parser.set_defaults(**defaults)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations that cannot work, through ``parser.error`` (exit status 2)."""
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.accumulate < 1:
        parser.error(f"--accumulate must be >= 1, got {args.accumulate}")
    if args.eval_every < 1 or args.checkpoint_every < 1:
        parser.error("--eval-every and --checkpoint-every must be >= 1")
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR (the directory to resume from)")
    if args.compressor == "topk" and not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}; 1% is 0.01")
    if args.density_warmup < 0:
        parser.error(f"--density-warmup must be >= 0, got {args.density_warmup}")
    if not 0 < args.density_warmup_start <= 1:
        parser.error(
            f"--density-warmup-start must be in (0, 1], got {args.density_warmup_start}; the "
            "exponential warm-up's first density (below --density it starts at --density)"
        )
    if args.density_warmup and args.compressor != "topk":
        parser.error("--density-warmup warms TopK's density up: it needs --compressor topk")
    if args.select == "adam" and args.compressor != "topk":
        parser.error("--select adam picks TopK's coordinates: it needs --compressor topk")
    if args.topk_values != "fp32" and args.compressor != "topk":
        parser.error("--topk-values sets how TopK's values travel: it needs --compressor topk")
    if args.momentum_correction and args.exchange != "gradients":
        parser.error(
            f"--momentum-correction works on gradients, not with --exchange {args.exchange}"
        )
    if args.momentum_correction and args.optimizer != "sgd":
        parser.error("--momentum-correction is SGD momentum: it needs --optimizer sgd")
    if args.optimizer == "shared-moment-adamw" and args.exchange == "gradients":
        parser.error(
            "--optimizer shared-moment-adamw shares a second moment between ranks that step "
            "on their own gradients: it needs --exchange local_updates or updates"
        )
    if args.refresh_every is not None and args.optimizer != "shared-moment-adamw":
        parser.error(
            "--refresh-every sets how often SharedMomentAdamW refreshes its shared second "
            "moment: it needs --optimizer shared-moment-adamw"
        )
    if args.refresh_every is not None and args.refresh_every < 1:
        parser.error(f"--refresh-every must be >= 1, got {args.refresh_every}")
    if args.select == "adam" and (args.optimizer == "sgd" or args.exchange != "gradients"):
        parser.error(
            "--select adam reads the optimizer's second moment: it needs --optimizer adamw or "
            "catchup-adamw, and --exchange gradients"
        )


# --------------------------------------------------------------------------- distributed


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (NCCL with CUDA, gloo without).

    Run without torchrun, it starts a one-rank group on this machine, so the examples also run
    as plain ``python examples/train_digits.py``.
    """
    # Imported after the group exists (creating an optimizer imports it), torch._dynamo keeps
    # a reference to the group, so destroy_process_group no longer ends it and a gloo rank
    # can abort at exit; imported first, it keeps none (docs/teardown.md).
    import torch._dynamo  # noqa: F401

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_compressor(args: argparse.Namespace) -> sparsecomm.Compressor:
    if args.compressor == "dense":
        return sparsecomm.Dense()
    if args.compressor == "fp16":
        return sparsecomm.Cast(torch.float16)
    if args.compressor == "bf16":
        return sparsecomm.Cast(torch.bfloat16)
    if args.compressor == "topk":
        shape = {"warmup": args.density_warmup_shape}
        if args.density_warmup_shape == "exponential":
            shape["warmup_start"] = max(args.density_warmup_start, args.density)
        values = torch.bfloat16 if args.topk_values == "bf16" else torch.float32
        return sparsecomm.TopK(
            density=args.density,
            warmup_steps=args.density_warmup,
            select=args.select,
            value_dtype=values,
            **shape,
        )
    return sparsecomm.Threshold(args.threshold)


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    """The wrapped optimizer. Every rank must call it (the wrapper broadcasts rank 0's model)."""
    if args.optimizer == "sgd":
        momentum = 0.0 if args.momentum_correction else 0.9  # then the wrapper applies it
        inner = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=momentum, weight_decay=args.weight_decay
        )
    elif args.optimizer == "shared-moment-adamw":
        inner = sparsecomm.SharedMomentAdamW(
            model.parameters(),
            lr=args.lr,
            weight_decay=args.weight_decay,
            **({} if args.refresh_every is None else {"refresh_every": args.refresh_every}),
        )
    else:
        adamw = torch.optim.AdamW if args.optimizer == "adamw" else sparsecomm.CatchUpAdamW
        inner = adamw(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return sparsecomm.CompressedOptimizer(
        inner,
        compressor=make_compressor(args),
        error_feedback=not args.no_error_feedback,
        bucket_cap_mb=args.bucket_cap_mb,
        min_compress_numel=args.min_compress_numel,
        momentum_correction=0.9 if args.momentum_correction else None,
        exchange=args.exchange,
    )


def parameters_copy(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def update_rms(model: torch.nn.Module, before: list[torch.Tensor], lr: float) -> float:
    """Root mean square of the step's change over every parameter element, over ``lr``: how
    far a step moves the model (``docs/catchup.md``, "Why: how far a step moves the
    model"). Dense AdamW's is a fraction of 1 (each coordinate moves at most about ``lr``);
    a burst credited at once moves further."""
    squares = sum(
        float((p.detach() - b).double().square().sum()) for p, b in zip(model.parameters(), before)
    )
    count = sum(b.numel() for b in before)
    return math.sqrt(squares / count) / lr if lr > 0 and count else 0.0


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up, then constant. A pure function of the
    step, so a resumed run needs no scheduler state."""
    if args.warmup > 0 and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr


# --------------------------------------------------------------------------- data order


def shard_batch(
    num_examples: int, step: int, batch_size: int, seed: int, rank: int, world_size: int
) -> torch.Tensor:
    """Indices of this rank's batch at ``step``, like ``DistributedSampler(drop_last=True)``.

    Each epoch is a permutation drawn from ``seed + epoch``; rank ``r`` takes every
    ``world_size``-th index from ``r`` (disjoint strided shards), and batch ``j`` of the epoch is
    the ``j``-th slice of its shard. Only ``(seed, step, rank, world_size)`` matter, never how
    long the process has lived, so a resumed run sees the same batches.
    """
    per_rank = num_examples // world_size
    steps_per_epoch = per_rank // batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"--batch-size {batch_size} is larger than each rank's shard of {per_rank} examples "
            f"({num_examples} examples over {world_size} ranks); lower --batch-size"
        )
    epoch, position = divmod(step, steps_per_epoch)
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(num_examples, generator=generator)[: per_rank * world_size]
    shard = order[rank::world_size]
    return shard[position * batch_size : (position + 1) * batch_size]


# --------------------------------------------------------------------------- checkpoints


def _atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``: a reader
    (or a resume after a kill) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if path.suffix == ".json":
        tmp.write_text(json.dumps(obj, indent=1))
    else:
        torch.save(obj, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _config_for_resume(args: argparse.Namespace, world_size: int) -> dict:
    """What must not change between a run and its resumption."""
    keys = (
        "compressor",
        "optimizer",
        "batch_size",
        "seed",
        "no_error_feedback",
        "density_warmup",
        "density_warmup_shape",
        "momentum_correction",
        "exchange",
    )
    config = {key: getattr(args, key) for key in keys}
    if args.compressor in ("topk", "threshold"):
        config["density" if args.compressor == "topk" else "threshold"] = (
            args.density if args.compressor == "topk" else args.threshold
        )
    if getattr(args, "accumulate", 1) != 1:  # (absent from older checkpoints)
        config["accumulate"] = args.accumulate
    if getattr(args, "select", "magnitude") != "magnitude":  # (absent from older checkpoints)
        config["select"] = args.select
    # Absent from older checkpoints too, so kept only where they differ from the default:
    # what the compressor, its schedule and the optimizer's groups were built with.
    for key, default in (
        ("topk_values", "fp32"),
        ("density_warmup_start", 0.25),
        ("refresh_every", None),
        ("weight_decay", 0.0),
    ):
        if getattr(args, key, default) != default:
            config[key] = getattr(args, key)
    config["world_size"] = world_size
    return config


def save_checkpoint(
    directory: str, step: int, model: torch.nn.Module, optimizer, args, rank: int, world_size: int
) -> None:
    """Save after ``step`` steps: the model (rank 0; identical on all ranks) and one optimizer
    file per rank (residuals differ by rank). Collective: every rank must call it.

    Layout: ``DIR/step-00000040/{model.pt, optimizer-rank<r>.pt, meta.json}`` and
    ``DIR/latest`` naming the last complete one; ``latest`` is rewritten only after every rank
    has written, so a kill at any moment leaves a loadable checkpoint.
    """
    root = Path(directory)
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _atomic_save(model.state_dict(), folder / "model.pt")
    _atomic_save(optimizer.state_dict(), folder / f"optimizer-rank{rank}.pt")
    dist.barrier()  # every rank's file is in place
    if rank == 0:
        meta = {"step": step, "config": _config_for_resume(args, world_size)}
        _atomic_save(meta, folder / "meta.json")
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(folder.name + "\n")
        os.replace(tmp, root / LATEST)
        for old in root.glob("step-*"):  # keep only the newest complete checkpoint
            if old.name != folder.name and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    directory: str, model: torch.nn.Module, optimizer, args, rank: int, world_size: int
) -> int:
    """Load the last complete checkpoint under ``directory``; return its step (0 if none)."""
    root = Path(directory)
    if not (root / LATEST).exists():
        return 0
    folder = root / (root / LATEST).read_text().strip()
    meta = json.loads((folder / "meta.json").read_text())
    expected = _config_for_resume(args, world_size)
    if meta["config"].get("compressor") not in ("topk", "threshold"):
        meta["config"].pop("threshold", None)  # (kept, unused, by older checkpoints)
    if meta["config"] != expected:
        changed = {
            key: (meta["config"].get(key), expected.get(key))
            for key in expected.keys() | meta["config"].keys()
            if meta["config"].get(key) != expected.get(key)
        }
        raise ValueError(
            f"--resume: checkpoint {folder} was saved with other settings {{flag: (saved, now)}}: "
            f"{changed}; rerun with the saved flags, or use a fresh --checkpoint DIR"
        )
    model.load_state_dict(torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
    state = torch.load(folder / f"optimizer-rank{rank}.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state)
    return int(meta["step"])


# --------------------------------------------------------------------------- reporting


def param_checksum(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters and buffers, in state_dict order: equal iff bitwise."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class JsonLog:
    """JSON lines from rank 0 (other ranks write nothing). Readers keep the last record per
    ``(event, step)``: a resumed run appends and repeats the steps after its checkpoint."""

    def __init__(self, path: str | None, rank: int, append: bool):
        self.handle = None
        if path and rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.handle = open(path, "a" if append else "w")  # noqa: SIM115 - closed in close()

    def write(self, **record: Any) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def read_json_log(path: str | Path) -> list[dict]:
    """The records of a ``--log-json`` file, keeping the last of each ``(event, step)``."""
    latest: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest[(record.get("event"), record.get("step"))] = record
    return sorted(latest.values(), key=lambda r: (r.get("step") or 0, r.get("event")))


# --------------------------------------------------------------------------- the loop


class _NoBar:
    """What ``train()`` uses instead of a tqdm bar when there is none to show: the same
    three methods, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, desc: str, show: bool):
    """A tqdm bar when ``show`` and tqdm is installed; otherwise one that does nothing."""
    if not show or tqdm is None:
        return _NoBar()
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)


def accumulate_gradients(
    optimizer: sparsecomm.CompressedOptimizer,
    loss_at: Callable[[int], torch.Tensor],
    step: int,
    micro_batches: int,
) -> float:
    """Backward over ``micro_batches`` micro-batches of ``step``, each loss divided by their
    number, all but the last inside ``optimizer.no_sync()``: the gradients add up locally,
    and only the last backward sends them. Returns the mean loss."""
    total = 0.0
    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        with contextlib.nullcontext() if last else optimizer.no_sync():
            loss = loss_at(step * micro_batches + micro) / micro_batches
            loss.backward()
        total += loss.item()
    return total


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    loss_at: Callable[[int], torch.Tensor],
    evaluate: Callable[[], dict[str, float]],
    rank: int,
    world_size: int,
) -> dict[str, float]:
    """Train ``args.steps`` steps with the compressed optimizer; return the last evaluation.

    ``loss_at(i)`` computes this rank's loss on its ``i``-th micro-batch, 0-based (its data
    must depend only on ``i``); step ``s`` takes micro-batches ``s * N`` to ``s * N + N - 1``
    for ``N = args.accumulate``. ``evaluate()`` runs on rank 0 only and returns metrics.
    """
    optimizer = make_optimizer(args, model)
    start = 0
    if args.resume:
        start = load_checkpoint(args.checkpoint, model, optimizer, args, rank, world_size)
        if rank == 0:
            print(
                f"resumed from step {start}" if start else "no checkpoint: starting at step 0",
                flush=True,
            )
    log = JsonLog(args.log_json, rank, append=args.resume and start > 0)
    if start == 0:
        log.write(
            event="config",
            step=0,
            world_size=world_size,
            compressor=repr(optimizer.compressor),
            error_feedback=optimizer.error_feedback,
            **{k: v for k, v in vars(args).items() if k not in ("compressor",)},
        )

    def evaluate_shared() -> dict[str, float]:
        # exchange="local_updates": each rank's parameters differ; the model is the shared ones
        with optimizer.shared_parameters():
            return evaluate()

    if start == 0 and rank == 0:  # the curve's starting point: the untrained model
        log.write(event="eval", step=0, mb_sent=0.0, dense_mb=0.0, **evaluate_shared())

    bar = progress_bar(
        total=args.steps,
        initial=start,
        desc=repr(optimizer.compressor),
        show=rank == 0 and not args.no_progress,
    )
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    for step in range(start, args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args, step)
        optimizer.zero_grad(set_to_none=True)
        loss_value = accumulate_gradients(optimizer, loss_at, step, args.accumulate)
        before = parameters_copy(model) if args.log_update_rms else None
        optimizer.step()
        done = step + 1
        stats, total = optimizer.last_stats, optimizer.total_stats
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {done}; lower --lr")
        log.write(
            event="train",
            step=done,
            loss=loss_value,
            lr=lr_at(args, step),
            mb_sent=total.bytes_sent / 1e6,
            dense_mb=total.dense_bytes / 1e6,
            density=stats.density,
            bytes_sent=stats.bytes_sent,
            **(
                {}
                if before is None
                else {"update_rms": update_rms(model, before, lr_at(args, step))}
            ),
        )
        if rank == 0 and (done % args.eval_every == 0 or done == args.steps):
            metrics = evaluate_shared()
            log.write(
                event="eval",
                step=done,
                mb_sent=total.bytes_sent / 1e6,
                dense_mb=total.dense_bytes / 1e6,
                **metrics,
            )
            bar.set_postfix(loss=f"{loss_value:.3f}", **{k: f"{v:.4f}" for k, v in metrics.items()})
        bar.update(1)
        if args.checkpoint and (done % args.checkpoint_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint, done, model, optimizer, args, rank, world_size)
        if args.stop_after is not None and done == args.stop_after:
            bar.close()
            print(f"rank {rank}: --stop-after {done}: exiting abruptly", flush=True)
            sys.stderr.flush()
            os._exit(3)  # no cleanup, no destroy_process_group: as if killed
    bar.close()
    seconds = time.perf_counter() - started
    if rank == 0 and not metrics:  # resumed from a checkpoint at the last step: nothing ran
        metrics = evaluate_shared()

    total = optimizer.total_stats
    with optimizer.shared_parameters():
        checksum = param_checksum(model)
    checksums = [None] * world_size
    dist.all_gather_object(checksums, checksum)
    # One write per line: ranks share the terminal, and print() writes the newline apart.
    sys.stdout.write(
        f"rank {rank}: sent {total.bytes_sent / 1e6:.3f} MB over {total.steps} steps "
        f"(steps before a resume included); dense fp32 would have sent "
        f"{total.dense_bytes / 1e6:.3f} MB ({total.compression_ratio:.1f}x fewer bytes)\n"
    )
    sys.stdout.flush()
    if rank == 0:
        if metrics:
            print("final " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        print(f"steps {start}..{args.steps} in {seconds:.1f} s")
        print(f"param_sha256={checksum}")
        in_sync = all(c == checksum for c in checksums)
        print(f"ranks in sync: {'yes' if in_sync else 'NO: ' + str(checksums)}", flush=True)
        log.write(
            event="final",
            step=args.steps,
            mb_sent=total.bytes_sent / 1e6,
            dense_mb=total.dense_bytes / 1e6,
            param_sha256=checksum,
            in_sync=in_sync,
            seconds=seconds,
            **metrics,
        )
        if args.save_final:
            with optimizer.shared_parameters():
                _atomic_save(model.state_dict(), Path(args.save_final))
        if not in_sync:
            raise RuntimeError(f"ranks ended with different parameters: {checksums}")
    log.close()
    return metrics
