"""Flat float32 buckets of gradients: one compression and one collective per bucket."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Sparse messages index a bucket with int32.
MAX_BUCKET_NUMEL = 2**31 - 1


@dataclass
class Bucket:
    """Consecutive parameters (all on one device) packed into one flat float32 buffer.

    Attributes:
        positions: each parameter's position in the optimizer's flat parameter list.
        params: the parameters, in packing order.
        offsets: where each parameter starts in the flat buffer.
        numel: total elements.
        compressed: False for a bucket of small parameters, which travel dense.
        residual: float32 error-feedback residual of the whole bucket (what was not sent
            yet), or None when the bucket keeps none.
    """

    positions: list[int] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    compressed: bool = True
    residual: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def add(self, position: int, param: torch.Tensor) -> None:
        self.positions.append(position)
        self.params.append(param)
        self.offsets.append(self.numel)
        self.numel += param.numel()

    def slices(self):
        """``(position, param, flat slice)`` for each parameter."""
        for position, param, offset in zip(self.positions, self.params, self.offsets):
            yield position, param, slice(offset, offset + param.numel())

    def gather_grads(self) -> torch.Tensor:
        """The parameters' gradients as one new float32 buffer; a missing gradient counts as
        zeros."""
        parts = []
        for param in self.params:
            grad = param.grad
            if grad is None:
                parts.append(torch.zeros(param.numel(), dtype=torch.float32, device=self.device))
            else:
                if grad.is_sparse:
                    raise TypeError(
                        "sparse gradients are not supported: build embeddings with "
                        "sparse=False so that their gradients are dense"
                    )
                parts.append(grad.reshape(-1).float())
        return torch.cat(parts)  # always a new buffer, even of one part: ours to change

    def scatter_grads(self, average: torch.Tensor, used: list[bool]) -> None:
        """Hand each parameter its slice of the averaged gradient. Parameters that no rank
        had a gradient for keep ``grad = None`` (as under DistributedDataParallel)."""
        for position, param, span in self.slices():
            if not used[position]:
                continue
            value = average[span].view_as(param)
            param.grad = value if param.dtype == torch.float32 else value.to(param.dtype)


def build_buckets(
    params: list[torch.Tensor],
    cap_numel: int,
    min_compress_numel: int,
    keep_residual: bool,
) -> list[Bucket]:
    """Pack parameters, in order, into buckets of at most ``cap_numel`` elements (a larger
    parameter gets a bucket of its own). Parameters with fewer than ``min_compress_numel``
    elements go to separate, uncompressed buckets. Every rank packs the same parameters the
    same way, so bucket ``i`` is the same on all ranks."""
    buckets: list[Bucket] = []
    open_buckets: dict[tuple, Bucket] = {}
    for position, param in enumerate(params):
        if not param.requires_grad:
            continue
        compressed = param.numel() >= min_compress_numel
        key = (param.device, compressed)
        bucket = open_buckets.get(key)
        if bucket is None or bucket.numel + param.numel() > cap_numel:
            bucket = Bucket(compressed=compressed)
            open_buckets[key] = bucket
            buckets.append(bucket)
        bucket.add(position, param)
    for bucket in buckets:
        if bucket.numel > MAX_BUCKET_NUMEL:
            raise ValueError(
                f"a parameter of {bucket.numel} elements is larger than a bucket can be "
                f"({MAX_BUCKET_NUMEL} elements, the int32 index limit); split it into smaller "
                "parameters"
            )
        if keep_residual and bucket.compressed:
            bucket.residual = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
    return buckets
