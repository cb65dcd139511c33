"""Where a CPU training step's time goes: the network benchmark's model, one rank or several.

    python benchmarks/profile_cpu_step.py                          # W = 1: rows in turns
    python benchmarks/profile_cpu_step.py --adamw fused --cprofile 'TopK(0.01)'
    python benchmarks/profile_cpu_step.py --sqrt                   # sqrt of zeros vs positives
    torchrun --nproc_per_node=2 benchmarks/profile_cpu_step.py --timeline 'TopK(0.01)'

The model is benchmarks/bench_network.py's (examples/train_charlm.py's CharTransformer, width
384, 8 layers, 14.4M parameters, AdamW, 4 windows of 64 bytes per step), on one thread per
process. Modes:

- default: each row (``--rows``: ``none`` for the plain AdamW step, or a compressor such as
  ``TopK(0.01)``, maybe with an exchange: ``TopK(0.01)/local_updates``) is built once, and
  the rows take turns for ``--rounds`` rounds of
  ``--steps`` timed steps; prints each row's median step time;
- ``--cprofile ROW``: cProfile of ``--steps`` steps of that row, by own time (numpy work of
  the CPU paths shows up here, where the torch profiler counts it in autograd's frames);
- ``--sqrt``: ``torch.sqrt`` on 1.77e6 float32 zeros, subnormals and positives (the second
  moment of AdamW under a sparse average is mostly zeros);
- ``--timeline ROW`` (under torchrun): per rank and step, when each bucket's all-gather was
  started and how long the step's waits took, against the end of backward.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  before the process group: docs/teardown.md
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_charlm import VOCAB, CharTransformer  # noqa: E402

import sparsecomm  # noqa: E402
from sparsecomm import _comm  # noqa: E402


def make_row(row: str, adamw: str, bucket_cap_mb: float | None = None):
    torch.manual_seed(0)
    model = CharTransformer(384, 8, 6, 64)
    fused = True if adamw == "fused" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    if row != "none":  # a compressor, then maybe "/" and an exchange: TopK(0.01)/updates
        compressor, _, exchange = row.partition("/")
        optimizer = sparsecomm.CompressedOptimizer(
            optimizer,
            eval(compressor, vars(sparsecomm)),
            exchange=exchange or "gradients",
            bucket_cap_mb=bucket_cap_mb,
        )
    return model, optimizer


def train_step(model, optimizer, generator) -> float:
    """One step; returns the seconds from its start to the end of backward."""
    batch = torch.randint(0, VOCAB, (4, 65), generator=generator)
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    backward_end = time.perf_counter() - started
    optimizer.step()
    return backward_end


def rows_in_turns(args) -> None:
    rows = args.rows.split(";")
    built = {row: make_row(row, args.adamw, args.bucket_cap_mb) for row in rows}
    generator = torch.Generator().manual_seed(0)
    times = {row: [] for row in rows}
    for round_ in range(args.rounds):
        for row in rows if round_ % 2 == 0 else rows[::-1]:
            model, optimizer = built[row]
            train_step(model, optimizer, generator)  # untimed: the turn's first step
            started = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, optimizer, generator)
            times[row].append((time.perf_counter() - started) / args.steps * 1e3)
    print(f"AdamW {args.adamw}, W = 1, {args.rounds} rounds of {args.steps} steps, ms a step:")
    for row in rows:
        spread = f"{min(times[row]):.1f}-{max(times[row]):.1f}"
        print(f"  {row:24s} {statistics.median(times[row]):7.1f}  [{spread}]")


def profile_row(args) -> None:
    model, optimizer = make_row(args.cprofile, args.adamw, args.bucket_cap_mb)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        train_step(model, optimizer, generator)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        train_step(model, optimizer, generator)
    profiler.disable()
    print(f"{args.cprofile}, AdamW {args.adamw}: cProfile of {args.steps} steps (divide by it)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def sqrt_cost() -> None:
    n = 1_769_472  # one 384 x 4608 slice of the model's size
    out = torch.empty(n)
    for name, values in (
        ("positive (torch.rand)", torch.rand(n)),
        ("zeros", torch.zeros(n)),
        ("subnormal (1e-40)", torch.full((n,), 1e-40)),
    ):
        torch.sqrt(values, out=out)
        started = time.perf_counter()
        for _ in range(20):
            torch.sqrt(values, out=out)
        print(f"  torch.sqrt of {n} {name}: {(time.perf_counter() - started) / 20 * 1e3:.2f} ms")


def timeline(args) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    events: list[str] = []
    origin = [0.0]
    start_all_gather, wait = _comm.Communicator.start_all_gather, _comm.Communicator.wait

    def logged_start(self, tensor):
        events.append(f"send {tensor.numel() * 4 / 1e3:.0f} KB @{stamp()}")
        return start_all_gather(self, tensor)

    def logged_wait(self, work):
        if work is None:
            return wait(self, work)
        began = stamp()
        result = wait(self, work)
        events.append(f"wait @{began}+{stamp() - began}")
        return result

    def stamp() -> int:
        return round((time.perf_counter() - origin[0]) * 1e3)

    _comm.Communicator.start_all_gather, _comm.Communicator.wait = logged_start, logged_wait
    model, optimizer = make_row(args.timeline, args.adamw, args.bucket_cap_mb)
    generator = torch.Generator().manual_seed(rank)
    for step in range(3 + args.steps):
        dist.barrier()
        events.clear()
        origin[0] = time.perf_counter()
        backward_end = train_step(model, optimizer, generator)
        if step >= 3:
            print(
                f"rank {rank} step {step}: backward (with the step's finish) ends @"
                f"{backward_end * 1e3:.0f}, step @{stamp()} ms | " + ", ".join(events),
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--rows", default="none;Dense();TopK(0.01)", help="';'-separated")
    parser.add_argument("--adamw", choices=("default", "fused"), default="default")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="default: the compressor's own"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cprofile", default=None, metavar="ROW")
    parser.add_argument("--sqrt", action="store_true")
    parser.add_argument("--timeline", default=None, metavar="ROW")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.timeline:
        timeline(args)
    elif args.cprofile:
        profile_row(args)
    elif args.sqrt:
        sqrt_cost()
    else:
        rows_in_turns(args)


if __name__ == "__main__":
    main()
