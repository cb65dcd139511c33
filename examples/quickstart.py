"""The README's quickstart: a small model trained with TopK(1%) on every rank.

    torchrun --nproc_per_node=2 examples/quickstart.py
    python examples/quickstart.py        # one process: compression and residuals, no exchange

Runs on CPU with gloo (NCCL when CUDA is there) and prints, on rank 0, the loss and what
each rank sent against what dense fp32 all-reduce would have sent.
"""

import argparse
import os

import torch
import torch._dynamo  # noqa: F401  before the process group: docs/teardown.md
import torch.distributed as dist

import sparsecomm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    launched = "RANK" in os.environ  # by torchrun; plain `python` trains on one process
    if launched:
        dist.init_process_group(backend)
    rank = dist.get_rank() if launched else 0
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    torch.manual_seed(rank)  # any init: the optimizer broadcasts rank 0's parameters
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).to(device)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        compressor=sparsecomm.TopK(density=0.01),
    )

    # One random teacher, the same on every rank (its own generator, on the CPU); each
    # rank draws its own batches.
    fixed = torch.Generator().manual_seed(0)
    teacher = torch.nn.Linear(64, 10)
    with torch.no_grad():
        teacher.weight.normal_(std=0.125, generator=fixed)
        teacher.bias.normal_(std=0.125, generator=fixed)
    teacher = teacher.to(device)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    losses = []
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 64, device=device, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step % 50 == 0 or step == args.steps):
            recent = losses[-50:]  # one batch's loss jumps about: the mean of the last 50
            mean = sum(recent) / len(recent)
            print(f"step {step:4d}  loss {mean:.4f} (mean of the last {len(recent)})")

    total = opt.total_stats
    if rank == 0:
        print(
            f"rank 0 sent {total.bytes_sent / 1e6:.2f} MB, "
            f"dense fp32 would have sent {total.dense_bytes / 1e6:.2f} MB "
            f"({total.compression_ratio:.0f}x fewer bytes, density {total.density:.3f})"
        )
    if launched:
        dist.barrier()  # tear down together: gloo can abort a rank whose peer left
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
