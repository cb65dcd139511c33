"""Error-feedback exact top-k: the k largest ``abs(g + r)``, ties to the lower index."""

from __future__ import annotations

import torch


def topk_compress_ref(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` elements of ``acc = grad + residual`` with the largest magnitude.

    Magnitudes are ordered by the bits of ``abs(acc)`` read as an integer, which is the
    float order with ``-0.0 == 0.0`` and NaN above infinity. Equal magnitudes are broken
    by the lower index, so the selection is unique.

    Args:
        grad: 1-D contiguous float32 tensor of ``n`` elements.
        residual: float32 tensor like ``grad``, updated in place to ``acc`` where an element
            is not sent and to 0 where it is; ``None`` runs without error feedback.
        k: number of elements to send, ``0 <= k <= n``.

    Returns:
        ``(indices, values)``: ``k`` int32 indices in ascending order and the float32
        values ``acc[indices]``.
    """
    n = grad.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} elements, got k={k}")
    acc = grad if residual is None else grad + residual
    # One int64 key per element: magnitude bits above, reversed index below, so keys are
    # unique and the larger key wins a tie for the lower index.
    magnitude_bits = acc.abs().view(torch.int32).to(torch.int64)
    reversed_index = (n - 1) - torch.arange(n, dtype=torch.int64, device=grad.device)
    keys = (magnitude_bits << 32) | reversed_index
    chosen = torch.topk(keys, k, sorted=False).indices
    indices = chosen.sort().values
    values = acc[indices]
    if residual is not None:
        residual.copy_(acc)
        residual[indices] = 0.0
    return indices.to(torch.int32), values
