"""Deterministic sum of W ranks' sparse (index, value) messages into a dense buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def scatter_add_ref(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
) -> torch.Tensor:
    """Add rank 0's message, then rank 1's, ..., into zeros, then multiply by ``scale``.

    Each rank's indices are unique, so within one rank no element is added twice and the
    result depends only on the fixed rank order: the same bits on every run and rank.

    Args:
        indices: int32 tensor ``[world_size, m]``: row ``r`` holds rank ``r``'s indices.
        values: float32 tensor ``[world_size, m]``, the matching values.
        counts: how many leading entries of each row are real (the rest is padding), or
            ``None`` when all ``m`` are.
        numel: length of the dense output.
        scale: multiplied into the sum at the end (``1 / world_size`` for an average).

    Returns:
        A float32 tensor of ``numel`` elements.
    """
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    for rank in range(indices.shape[0]):
        count = indices.shape[1] if counts is None else counts[rank]
        rank_indices = indices[rank, :count].long()
        out[rank_indices] += values[rank, :count]
    return out.mul_(scale)
