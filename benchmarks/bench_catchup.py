"""Time one optimizer step of ``sparsecomm.CatchUpAdamW`` against torch's AdamW.

The parameters are shaped like the 163M GPT of ``bench_step.py --model gpt`` by default
(149 tensors); each gradient has ``--received`` of its elements nonzero (what the
average of a sparse exchange leaves; 1.0 is a dense gradient). Rows: AdamW fused and
foreach, ``CatchUpAdamW`` as it dispatches (the Triton kernel on CUDA) and with its torch
ops (``SPARSECOMM_KERNELS=torch``), and ``SharedMomentAdamW`` as on two ranks between
refreshes (its shared moment taken in at the untimed first step). Milliseconds per step,
median of ``--steps`` after one warm-up step, CUDA events on a GPU, wall clock on a CPU.

    python benchmarks/bench_catchup.py                     # CUDA if there is one
    python benchmarks/bench_catchup.py --scale 0.05 --device cpu
    python benchmarks/bench_catchup.py --start-step 1000    # late in training
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import sparsecomm


def gpt_shapes(layers=12, d=768, vocab=50257, context=512) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,)]
        shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def time_steps(opt, params, grads, steps, device, start_step=0) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()  # state, compilation
    if start_step:  # as if trained that long, every coordinate received at the last step
        for state in opt.state.values():
            if torch.is_tensor(state["step"]):
                state["step"].fill_(start_step)
            else:
                state["step"] = start_step
            if "last_step" in state:
                state["last_step"].fill_(start_step)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--received", type=float, nargs="+", default=[1.0, 0.03])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the width by this")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--start-step",
        type=int,
        default=0,
        help="time the steps after this one (0: steps 2 on). CatchUpAdamW adds the per-step "
        "bias corrections only early in training; late, its loop runs no turn",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    d = max(8, int(768 * args.scale))
    shapes = gpt_shapes(d=d, vocab=max(64, int(50257 * args.scale)))
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"{len(shapes)} tensors, {numel / 1e6:.1f}M parameters, {device}, torch {torch.__version__}"
    )
    print(
        "| received | AdamW fused | AdamW foreach | CatchUpAdamW | CatchUpAdamW, torch ops "
        "| SharedMomentAdamW |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen, requires_grad=True) for s in shapes]
    for received in args.received:
        grads = []
        for p in params:
            g = torch.randn(p.shape, device=device, generator=gen)
            g[torch.rand(p.shape, device=device, generator=gen) >= received] = 0.0
            grads.append(g)
        cells = []
        for name in ("fused", "foreach", "catchup", "catchup-torch", "shared"):
            os.environ["SPARSECOMM_KERNELS"] = "torch" if name == "catchup-torch" else "auto"
            if name.startswith("catchup"):
                opt = sparsecomm.CatchUpAdamW(params, lr=1e-4)
            elif name == "shared":  # as on 2 ranks: the shared moment taken in at step 1
                opt = sparsecomm.SharedMomentAdamW(params, lr=1e-4)
                opt.set_world_size(2)
                opt.take_average_gradient({p: 2 * g for p, g in zip(params, grads)})
            else:
                opt = torch.optim.AdamW(params, lr=1e-4, **{name: True})
            ms = time_steps(opt, params, grads, args.steps, device, args.start_step)
            cells.append(f"{ms:.2f}")
            del opt
        os.environ.pop("SPARSECOMM_KERNELS")
        print(f"| {received:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
