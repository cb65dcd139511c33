"""Train a small character-level (byte-level) transformer LM with compressed gradient exchange.

The text is Python's own standard library source (the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``, sorted by name), so nothing is downloaded; the first 90%
is for training, the rest for validation. Each rank draws its own windows of the training
text at each step (a strided share of one draw that depends only on seed and step).

    torchrun --standalone --nproc_per_node=2 examples/train_charlm.py --compressor topk

Defaults are small (2 layers, width 64, context 64) so that a few hundred steps run in about
a minute on CPU; with CUDA each rank takes its GPU and NCCL.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import check_args, init_distributed, make_parser, train
from torch import nn

VOCAB = 256  # bytes


def load_stdlib_text(max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` bytes of the standard library's top-level ``.py`` files, sorted by
    name and joined, as a uint8 tensor (the same bytes on every rank and run)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise SystemExit(f"found only {len(text)} bytes of Python source under {stdlib}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class CharTransformer(nn.Module):
    """Byte embedding + learned positions, pre-norm causal transformer layers, linear head."""

    def __init__(self, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(context, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def windows(text: torch.Tensor, starts: torch.Tensor, context: int):
    """Inputs ``text[s : s + context]`` and targets shifted by one, for each start ``s``."""
    offsets = starts[:, None] + torch.arange(context + 1)
    chunk = text[offsets]
    return chunk[:, :-1], chunk[:, 1:]


def main() -> None:
    parser = make_parser(
        __doc__.splitlines()[0],
        optimizer="adamw",
        lr=3e-3,
        warmup=20,
        steps=200,
        batch_size=16,
        eval_every=50,
        weight_decay=0.01,
    )
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument(
        "--text-bytes", type=int, default=1_000_000, help="bytes of standard-library source to use"
    )
    parser.add_argument(
        "--val-batches", type=int, default=8, help="validation batches of --batch-size windows"
    )
    args = parser.parse_args()
    check_args(parser, args)
    for flag in ("width", "layers", "heads", "context", "text_bytes", "val_batches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    rank, world_size, device = init_distributed()

    text = load_stdlib_text(args.text_bytes)
    split = int(0.9 * len(text))
    train_text, val_text = text[:split], text[split:]
    torch.manual_seed(args.seed)  # rank 0's initialization is broadcast by the optimizer
    model = CharTransformer(args.width, args.layers, args.heads, args.context).to(device)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"charlm: {len(train_text)} train / {len(val_text)} val bytes of stdlib source, "
            f"{world_size} ranks, {params} parameters",
            flush=True,
        )

    def loss_at(step: int) -> torch.Tensor:
        # One draw of world_size * batch_size windows per step, from (seed, step) alone;
        # rank r takes every world_size-th window from r: disjoint shares.
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(
            0,
            len(train_text) - args.context - 1,
            (world_size * args.batch_size,),
            generator=generator,
        )[rank::world_size]
        inputs, targets = windows(train_text, starts, args.context)
        logits = model(inputs.to(device))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(device).reshape(-1))

    # Fixed validation windows: the same for every run with this seed.
    val_starts = torch.randint(
        0,
        len(val_text) - args.context - 1,
        (args.val_batches, args.batch_size),
        generator=torch.Generator().manual_seed(args.seed + 12345),
    )

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        losses = []
        for starts in val_starts:
            inputs, targets = windows(val_text, starts, args.context)
            logits = model(inputs.to(device))
            losses.append(
                F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(device).reshape(-1)).item()
            )
        model.train()
        loss = sum(losses) / len(losses)
        return {"val_loss": loss, "val_bits_per_byte": loss / math.log(2)}

    train(args, model, loss_at, evaluate, rank, world_size)
    torch.distributed.barrier()  # tear down together: gloo can abort a rank whose peer left
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
