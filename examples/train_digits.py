"""Train a small CNN on scikit-learn's handwritten digits with compressed gradient exchange.

The 1797 8x8 digit images ship inside scikit-learn (nothing is downloaded). Each rank trains
on its own strided shard of the training split, like DistributedSampler; sparsecomm averages
the compressed gradients inside ``optimizer.step()``.

    torchrun --standalone --nproc_per_node=2 examples/train_digits.py --compressor topk \\
        --density 0.01
    torchrun --standalone --nproc_per_node=2 examples/train_digits.py --compressor bf16 \\
        --checkpoint runs/digits-ckpt --checkpoint-every 50 --resume

Runs on CPU with gloo; with CUDA each rank takes its GPU and NCCL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import check_args, init_distributed, make_parser, shard_batch, train
from torch import nn


def load_digits_split(seed: int, device: torch.device):
    """``(x_train, y_train, x_test, y_test)``: 80/20 stratified split fixed by ``seed``,
    images scaled to [0, 1] as ``(N, 1, 8, 8)`` float32."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:  # pragma: no cover - the message is the point
        raise SystemExit(
            "train_digits.py needs scikit-learn: pip install scikit-learn "
            "(or pip install 'sparsecomm[examples]')"
        ) from error
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )

    def images(array):
        return (torch.tensor(array, dtype=torch.float32) / 16.0).unsqueeze(1).to(device)

    def labels(array):
        return torch.tensor(array, dtype=torch.long).to(device)

    return images(x_train), labels(y_train), images(x_test), labels(y_test)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers, ~72k parameters: the two big weights
    (4608 and 65536) are compressed, the biases and the first convolution's 144 weights
    travel dense (below min_compress_numel=1024)."""

    def __init__(self, channels: int = 16, hidden: int = 128):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8x8 -> 4x4
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0], lr=0.05, steps=300, batch_size=32)
    args = parser.parse_args()
    check_args(parser, args)
    rank, world_size, device = init_distributed()

    x_train, y_train, x_test, y_test = load_digits_split(args.seed, device)
    torch.manual_seed(args.seed)  # rank 0's initialization is broadcast by the optimizer
    model = DigitsCNN().to(device)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"digits: {len(x_train)} train / {len(x_test)} test images, {world_size} ranks, "
            f"{params} parameters",
            flush=True,
        )

    def loss_at(step: int) -> torch.Tensor:
        batch = shard_batch(len(x_train), step, args.batch_size, args.seed, rank, world_size)
        batch = batch.to(device)
        return F.cross_entropy(model(x_train[batch]), y_train[batch])

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        model.train()
        return {"test_accuracy": accuracy}

    train(args, model, loss_at, evaluate, rank, world_size)
    torch.distributed.barrier()  # tear down together: gloo can abort a rank whose peer left
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
