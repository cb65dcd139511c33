"""Error-feedback cast to fp16 / bf16, with the rounding error kept as residual."""

from __future__ import annotations

import math

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def cast_compress_ref(
    grad: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """Cast ``acc = grad + residual``, multiplied by ``scale``, to ``dtype``.

    The value is clamped to the largest finite value of ``dtype`` before rounding to
    nearest even, so nothing overflows to infinity: what the clamp cuts off stays in the
    residual like any other rounding error. NaN passes through as NaN.

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place to
            ``acc - float(half) / scale``; ``None`` runs without error feedback.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        scale: a power of two (so that multiplying by it and by its inverse is exact);
            the caller passes ``1 / 2**ceil(log2(world_size))`` so that a sum of
            ``world_size`` casts cannot overflow.

    Returns:
        The ``dtype`` tensor ``half``.
    """
    check_cast_args(dtype, scale)
    acc = grad if residual is None else grad + residual
    limit = torch.finfo(dtype).max
    half = (acc * scale).clamp(-limit, limit).to(dtype)
    if residual is not None:
        residual.copy_(acc - half.float() * (1.0 / scale))
    return half


def check_cast_args(dtype: torch.dtype, scale: float) -> None:
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    mantissa, _ = math.frexp(scale)
    if not (scale > 0 and mantissa == 0.5):
        raise ValueError(f"scale must be a positive power of two, got {scale}")
