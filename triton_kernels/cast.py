"""Error-feedback cast to fp16 / bf16, with the rounding error kept as residual; and the
same rounding for the values of a sparse message (``round_pairs``)."""

from __future__ import annotations

import functools
import math
import numbers

import torch
import triton
import triton.language as tl

from . import _cpu, _indirect
from ._checks import DtypeError, check_grad_residual

HALF_DTYPES = (torch.float16, torch.bfloat16)

# Elements per program: 4096 fp32 with 8 warps is 16 per thread, four 16-byte loads of each
# input, enough in flight to saturate HBM (the same shape as the threshold pass; not swept
# yet, the benchmark times 2048/4096/8192 beside it).
BLOCK_SIZE = 4096
NUM_WARPS = 8


@triton.jit
def _cast_compress_kernel(
    grad_ptr,
    residual_ptr,
    half_ptr,
    addresses_ptr,
    n,
    scale,
    inv_scale,
    LIMIT: tl.constexpr,
    FLOAT32_MAX: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    INDIRECT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    residual_ptr = _indirect.resolve(
        addresses_ptr, _indirect.RESIDUAL, residual_ptr, INDIRECT and HAS_RESIDUAL
    )
    half_ptr = _indirect.resolve(addresses_ptr, _indirect.OUT, half_ptr, INDIRECT)
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n
    acc = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offsets, mask=in_bounds, other=0.0)
    scaled = acc * scale
    # Comparisons are false for NaN, so NaN falls through every select unchanged, as in
    # torch.clamp; tl.minimum/maximum would need an explicit propagate_nan.
    clamped = tl.where(scaled > LIMIT, LIMIT, tl.where(scaled < -LIMIT, -LIMIT, scaled))
    # An infinite acc goes out as the half type's infinity, so that the sum shows it; only
    # finite values are clamped (a finite acc whose scaled value overflows float32 too).
    infinite = tl.abs(acc) > FLOAT32_MAX
    clamped = tl.where(infinite, scaled, clamped)
    # fp32 -> fp16/bf16 rounds to nearest even on the GPU, like torch's .to(dtype).
    half = clamped.to(half_ptr.dtype.element_ty)
    tl.store(half_ptr + offsets, half, mask=in_bounds)
    if HAS_RESIDUAL:
        # A multiply by the exact power-of-two inverse, never a divide: Triton's fp32
        # division is not correctly rounded. An infinity was sent whole: nothing stays.
        kept = acc - half.to(tl.float32) * inv_scale
        tl.store(residual_ptr + offsets, tl.where(infinite, 0.0, kept), mask=in_bounds)


def cast_compress(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
    scale: float = 1.0,
    limit: float | None = None,
    out: torch.Tensor | None = None,
    addresses: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused Triton version of :func:`cast_compress_ref`, the same bits.

    One pass reads ``grad`` and ``residual`` and writes the half tensor and the new residual:
    14 bytes per element for fp16 or bf16.

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place to ``acc - float(half) / scale``
            (0 where ``acc`` is infinite); ``None`` runs without error feedback.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        scale: a power of two, multiplied into ``acc`` before the cast.
        limit: finite values are clamped to ``[-limit, limit]`` after scaling (default:
            the largest finite value of ``dtype``; must be one of ``dtype``'s values).
        out: a ``dtype`` tensor of ``grad``'s size and device to write the result into
            (default: a new one).
        addresses: None, or an int64 device tensor from which the kernel reads where
            ``grad``, ``residual`` and ``out`` are when it runs (``triton_kernels._indirect``),
            so that a CUDA graph of this call can be replayed on buffers that moved; it
            takes ``out``, and the addresses of the tensors passed must be in it.

    Returns:
        The ``dtype`` tensor ``half``.

    Example:
        >>> grad = torch.tensor([1.0, 70000.0, -1e-3], device="cuda")
        >>> residual = torch.zeros_like(grad)
        >>> cast_compress(grad, residual, torch.float16).tolist()
        [1.0, 65504.0, -0.0010004043579101562]
    """
    check_grad_residual(grad, residual)
    limit = check_cast_args(dtype, scale, limit)
    n = grad.numel()
    half = _half_out(out, n, dtype, grad.device)
    if addresses is not None and out is None:
        raise ValueError("addresses takes out= too: the half tensor must have a known address")
    _indirect.check_addresses(addresses, grad.device, grad, residual, out)
    if n == 0:
        return half
    scale32, inv_scale32 = _float32_scales(scale)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)  # noqa: E731
    _cast_compress_kernel[grid](
        grad,
        residual if residual is not None else grad,  # never touched without HAS_RESIDUAL
        half,
        grad if addresses is None else addresses,
        n,
        scale32,
        inv_scale32,
        LIMIT=limit,
        FLOAT32_MAX=torch.finfo(torch.float32).max,
        HAS_RESIDUAL=residual is not None,
        INDIRECT=addresses is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
        # torch rounds acc - float(half) * inv_scale twice; keep the compiler from fusing it
        # into one fma (equal whenever the product is exact, which it is unless it overflows).
        enable_fp_fusion=False,
    )
    return half


def cast_compress_ref(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
    scale: float = 1.0,
    limit: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cast ``acc = grad + residual``, multiplied by ``scale``, to ``dtype``.

    A finite value is clamped to ``[-limit, limit]`` (by default the largest finite value
    of ``dtype``) before rounding to nearest even, so no finite value overflows to
    infinity, nor a sum of ``world_size`` of them when the caller passes
    ``Cast.limit(world_size)``: what the clamp cuts off stays in
    the residual like any other rounding error. An infinite ``acc`` is sent as the infinity
    of ``dtype`` (its residual becomes 0: it was sent whole), so that the all-reduced sum
    shows it. NaN passes through as NaN (and stays in the residual).

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place to
            ``acc - float(half) / scale`` (0 where ``acc`` is infinite); ``None`` runs
            without error feedback.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        scale: a power of two (so that multiplying by it and by its inverse is exact);
            the caller passes ``1 / 2**ceil(log2(world_size))``.
        limit: a positive value of ``dtype`` at most its largest finite value (the
            default).
        out: a ``dtype`` tensor of ``grad``'s size and device to write the result into
            (default: a new one).

    Returns:
        The ``dtype`` tensor ``half``.
    """
    limit = check_cast_args(dtype, scale, limit)
    acc = grad if residual is None else grad + residual
    scaled = acc * scale
    infinite = acc.isinf()
    half = torch.where(infinite, scaled, scaled.clamp(-limit, limit)).to(dtype)
    if out is not None:
        half = _half_out(out, grad.numel(), dtype, grad.device).copy_(half)
    if residual is not None:
        residual.copy_((acc - half.float() * (1.0 / scale)).masked_fill(infinite, 0.0))
    return half


def cast_compress_cpu(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
    scale: float = 1.0,
    limit: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fast CPU version of :func:`cast_compress_ref`: the same half tensor and residual, bit
    for bit.

    The reference's float32 ops in the reference's order, one cache-sized chunk at a time
    into one chunk of scratch, so that only ``grad``, ``residual`` and the half tensor
    travel through memory (14 bytes per element with a residual, 6 without). A chunk's
    infinities are looked for only when its minimum or maximum is not finite.

    Args and returns: as :func:`cast_compress_ref`; CPU tensors only.
    """
    check_grad_residual(grad, residual)
    _cpu.require_cpu(grad, "cast_compress_cpu")
    limit = check_cast_args(dtype, scale, limit)
    n = grad.numel()
    half = _half_out(out, n, dtype, grad.device)
    inverse = 1.0 / scale
    scratch = torch.empty(min(n, _cpu.CHUNK), dtype=torch.float32)
    for start, end in _cpu.chunks(n):
        if residual is None:
            acc = grad[start:end]
        else:
            acc = torch.add(grad[start:end], residual[start:end], out=residual[start:end])
        work = scratch[: end - start]
        torch.mul(acc, scale, out=work)
        low, high = torch.aminmax(acc)
        # False for NaN too: such a chunk takes the careful path.
        infinite = None
        if not (-math.inf < low.item() and high.item() < math.inf):
            infinite = acc.isinf()
        work.clamp_(-limit, limit)
        if infinite is not None:
            torch.where(infinite, acc, work, out=work)  # acc * scale is acc where infinite
        half_chunk = half[start:end]
        half_chunk.copy_(work)
        if residual is not None:
            work.copy_(half_chunk)
            work.mul_(inverse)
            torch.sub(acc, work, out=acc)
            if infinite is not None:
                acc.masked_fill_(infinite, 0.0)
    return half


@triton.jit
def _round_pairs_kernel(
    values_ptr,
    indices_ptr,
    residual_ptr,
    count,
    LIMIT: tl.constexpr,
    FLOAT32_MAX: tl.constexpr,
    HALF: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < count
    value = tl.load(values_ptr + offsets, mask=in_bounds, other=0.0)
    finite = tl.abs(value) <= FLOAT32_MAX  # false for NaN and for either infinity
    clamped = tl.where(value > LIMIT, LIMIT, tl.where(value < -LIMIT, -LIMIT, value))
    # fp32 -> bf16/fp16 rounds to nearest even, like torch's .to(dtype); NaN and Inf go
    # through as themselves.
    sent = tl.where(finite, clamped, value).to(HALF).to(tl.float32)
    tl.store(values_ptr + offsets, sent, mask=in_bounds)
    if HAS_RESIDUAL:
        index = tl.load(indices_ptr + offsets, mask=in_bounds, other=0).to(tl.int64)
        tl.store(residual_ptr + index, tl.where(finite, value - sent, 0.0), mask=in_bounds)


def round_pairs(
    values: torch.Tensor,
    indices: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Fused Triton version of :func:`round_pairs_ref`, the same bits, in one launch.

    Args and effects: as :func:`round_pairs_ref`; CUDA tensors (or any device under
    ``TRITON_INTERPRET=1``).
    """
    limit = _check_pairs(values, indices, residual, dtype)
    count = values.numel()
    if count == 0:
        return
    grid = (triton.cdiv(count, BLOCK_SIZE),)
    _round_pairs_kernel[grid](
        values,
        indices,
        residual if residual is not None else values,  # never touched without HAS_RESIDUAL
        count,
        LIMIT=limit,
        FLOAT32_MAX=torch.finfo(torch.float32).max,
        HALF=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
        HAS_RESIDUAL=residual is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def round_pairs_ref(
    values: torch.Tensor,
    indices: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Round a sparse message's float32 ``values`` to what ``dtype`` carries, in place, and
    write what the rounding took off into ``residual`` at ``indices`` (where the compressor
    left zeros), so that the values sent plus the residual are still ``grad + residual``
    bit for bit: with bfloat16 (float32's exponent range) ``v - half(v)`` is exact in
    float32.

    A finite value beyond ``dtype``'s largest is clamped to it first (the excess goes into
    the residual); NaN and Inf travel as they are, and their residual stays 0. Elementwise
    over the pairs: no host synchronisation. (Also the CPU path: a message holds ``k``
    pairs, a small share of its bucket.)

    Args:
        values: 1-D float32 tensor of the pairs' values, rounded in place.
        indices: int32 or int64 tensor of the pairs' indices into ``residual``, as long as
            ``values``, each index at most once.
        residual: float32 tensor, written at ``indices`` only; ``None`` without error
            feedback.
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
    """
    limit = _check_pairs(values, indices, residual, dtype)
    finite = torch.isfinite(values)
    sent = torch.where(finite, values.clamp(-limit, limit), values).to(dtype).float()
    if residual is not None:
        left = torch.where(finite, values - sent, torch.zeros_like(values))
        residual.scatter_(0, indices.long(), left)
    values.copy_(sent)


def _check_pairs(values, indices, residual, dtype) -> float:
    limit = check_cast_args(dtype, 1.0)
    if values.dtype != torch.float32 or values.dim() != 1:
        raise DtypeError(
            f"values must be a 1-D float32 tensor, got {values.dtype} of {values.dim()} dims"
        )
    if indices.shape != values.shape or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"indices must be an int32 or int64 tensor shaped like values {tuple(values.shape)}, "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )
    if residual is not None and residual.dtype != torch.float32:
        raise DtypeError(f"residual must be float32, got {residual.dtype}")
    return limit


def _half_out(out: torch.Tensor | None, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=dtype, device=device)
    if out.dtype != dtype or out.shape != (n,) or out.device != device:
        raise ValueError(
            f"out must be a 1-D {dtype} tensor of {n} elements on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


@functools.lru_cache(maxsize=64)
def _float32_scales(scale: float) -> tuple[float, float]:
    """``scale`` and ``1 / scale`` as float32 values. torch multiplies by Python scalars in
    float32; both are exact powers of two, and an inverse beyond float32's range becomes
    inf there as here. (Cached: converting costs more than the kernel launch.)"""
    as32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    return as32(scale), as32(1.0 / scale)


# Cached (``typed``: True and 1 are different arguments): it runs on every call of the
# three cast functions, and its answer depends on its arguments only.
@functools.lru_cache(maxsize=256, typed=True)
def check_cast_args(dtype: torch.dtype, scale: float, limit: float | None = None) -> float:
    """``DtypeError`` (a ``TypeError`` and a ``ValueError``) unless ``dtype`` is fp16 or
    bf16; ``TypeError`` unless ``scale`` is a real number, ``ValueError`` unless it is a
    positive power of two or ``limit`` is not a positive value of ``dtype`` within its
    range. Returns the clamp limit (``limit``, or ``dtype``'s largest finite value)."""
    if dtype not in HALF_DTYPES:
        raise DtypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive power of two, got {type(scale).__name__}")
    mantissa, _ = math.frexp(scale)
    if not (scale > 0 and mantissa == 0.5):
        raise ValueError(f"scale must be a positive power of two, got {scale}")
    largest = torch.finfo(dtype).max
    if limit is None:
        return largest
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"limit must be a float, got {type(limit).__name__}")
    if not (0 < limit <= largest) or float(torch.tensor(limit).to(dtype)) != limit:
        raise ValueError(f"limit must be a positive {dtype} value at most {largest}, got {limit}")
    return float(limit)
