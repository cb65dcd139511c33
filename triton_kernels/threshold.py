"""Error-feedback magnitude threshold: send every element with ``abs(g + r) >= t``."""

from __future__ import annotations

import torch


def threshold_compress_ref(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select the elements of ``acc = grad + residual`` with ``abs(acc) >= threshold``.

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place to ``acc`` where an element
            is not sent and to 0 where it is; ``None`` runs without error feedback.
        threshold: non-negative float.

    Returns:
        ``(indices, values, count)``: int32 indices in ascending order, the float32 values
        ``acc[indices]``, and the number of selected elements as a 0-d int64 tensor on
        ``grad``'s device. Only the first ``count`` entries of ``indices`` and ``values``
        are meaningful (a launcher may return longer buffers). NaN is never selected
        (``NaN >= t`` is false), so it stays in the residual.
    """
    acc = grad if residual is None else grad + residual
    keep = acc.abs() >= threshold
    indices = keep.nonzero().flatten().to(torch.int32)
    values = acc[indices.long()]
    if residual is not None:
        residual.copy_(acc.masked_fill(keep, 0.0))
    count = torch.tensor(indices.numel(), dtype=torch.int64, device=grad.device)
    return indices, values, count
