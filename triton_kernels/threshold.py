"""Error-feedback magnitude threshold: send every element with ``abs(g + r) >= t``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program of the fused pass: 2048 fp32 with 4 warps is 16 elements (four
# 16-byte loads) per thread and per operand. H200 sweep (n = 1e8, 1% sent, 2026-12-02):
# 2048 x 4 warps 0.343 ms (86% of the 12-byte floor's bandwidth), 4096 x 4 0.355 ms,
# 4096 x 8 0.366 ms, 2048 x 8 0.383 ms, 8192 x 8 0.405 ms: the in-block prefix sum that
# orders the pairs is cheaper over fewer warps. The benchmark sweeps it again.
BLOCK_SIZE = 2048
NUM_WARPS = 4
# Pairs each program of the compaction pass moves per iteration: at least the expected count
# of a block at 1% density (20 of 2048) so sparse blocks cost one short iteration.
COPY_SIZE = 64
# Indices are int32 (see DESIGN.md: buckets stay below 2**31 elements).
MAX_NUMEL = 2**31 - 1


@triton.jit
def _threshold_compress_kernel(
    grad_ptr,
    residual_ptr,
    staged_idx_ptr,
    staged_val_ptr,
    block_count_ptr,
    n,
    threshold,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    block_start = pid.to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n
    acc = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offsets, mask=in_bounds, other=0.0)
    # `& in_bounds`: the padding lanes hold 0.0, which passes a threshold of 0.
    keep = (tl.abs(acc) >= threshold) & in_bounds
    if HAS_RESIDUAL:
        tl.store(residual_ptr + offsets, tl.where(keep, 0.0, acc), mask=in_bounds)
    # Compact the block's pairs in index order at the block's own offset in the staging
    # buffers; the second kernel moves them to their final place once every block's count
    # is known. Staging keeps this pass at one read of g and r and one write of r.
    keep_int = keep.to(tl.int32)
    slot = tl.cumsum(keep_int, axis=0) - 1
    tl.store(staged_idx_ptr + block_start + slot, offsets.to(tl.int32), mask=keep)
    tl.store(staged_val_ptr + block_start + slot, acc, mask=keep)
    tl.store(block_count_ptr + pid, tl.sum(keep_int, axis=0))


@triton.jit
def _threshold_compact_kernel(
    staged_idx_ptr,
    staged_val_ptr,
    block_count_ptr,
    block_end_ptr,
    out_idx_ptr,
    out_val_ptr,
    BLOCK_SIZE: tl.constexpr,
    COPY_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    src = pid.to(tl.int64) * BLOCK_SIZE
    count = tl.load(block_count_ptr + pid).to(tl.int64)
    # block_end is the inclusive scan of the counts: this block's pairs end there.
    dst = tl.load(block_end_ptr + pid) - count
    for start in range(0, count, COPY_SIZE):
        offsets = start + tl.arange(0, COPY_SIZE)
        valid = offsets < count
        idx = tl.load(staged_idx_ptr + src + offsets, mask=valid)
        val = tl.load(staged_val_ptr + src + offsets, mask=valid)
        tl.store(out_idx_ptr + dst + offsets, idx, mask=valid)
        tl.store(out_val_ptr + dst + offsets, val, mask=valid)


def threshold_compress(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused Triton version of :func:`threshold_compress_ref`, the same bits.

    One pass reads ``grad`` and ``residual``, writes the new residual and each block's pairs;
    a second, small kernel moves the pairs into place after a scan of the block counts. Nothing
    waits for the device: the returned buffers have capacity ``n`` and only their first
    ``count`` entries are meaningful.

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place; ``None`` for no error feedback.
        threshold: non-negative float, rounded to float32 as torch does when it compares.

    Returns:
        ``(indices, values, count)``: int32 and float32 buffers of ``n`` entries, the pairs in
        ascending index order first, and their number as a 0-d int64 tensor on the device.

    Example:
        >>> grad = torch.tensor([0.5, -2.0, 0.1, 3.0], device="cuda")
        >>> residual = torch.zeros_like(grad)
        >>> indices, values, count = threshold_compress(grad, residual, 1.0)
        >>> indices[:count].tolist(), values[:count].tolist()
        ([1, 3], [-2.0, 3.0])
    """
    check_grad_residual(grad, residual)
    threshold = float(threshold)
    if not threshold >= 0.0:  # also rejects NaN
        raise ValueError(
            f"threshold must be a float >= 0, got {threshold}; elements with "
            "abs(grad + residual) >= threshold are sent"
        )
    # torch compares a float32 tensor with a Python float in float32; 1e39 becomes inf.
    threshold32 = torch.tensor(threshold, dtype=torch.float32).item()
    n = grad.numel()
    device = grad.device
    indices = torch.empty(n, dtype=torch.int32, device=device)
    values = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return indices, values, torch.zeros((), dtype=torch.int64, device=device)
    n_blocks = triton.cdiv(n, BLOCK_SIZE)
    staged_indices = torch.empty(n, dtype=torch.int32, device=device)
    staged_values = torch.empty(n, dtype=torch.float32, device=device)
    block_count = torch.empty(n_blocks, dtype=torch.int32, device=device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)  # noqa: E731
    _threshold_compress_kernel[grid](
        grad,
        residual if residual is not None else grad,  # never read without HAS_RESIDUAL
        staged_indices,
        staged_values,
        block_count,
        n,
        threshold32,
        HAS_RESIDUAL=residual is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    block_end = torch.cumsum(block_count, dim=0)  # int64, stays on the device
    _threshold_compact_kernel[grid](
        staged_indices,
        staged_values,
        block_count,
        block_end,
        indices,
        values,
        BLOCK_SIZE=BLOCK_SIZE,
        COPY_SIZE=COPY_SIZE,
        num_warps=2,
    )
    return indices, values, block_end[-1]


def check_grad_residual(grad: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``grad`` (and ``residual``) suit the fused kernels."""
    if not isinstance(grad, torch.Tensor):
        raise ValueError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dim() != 1 or not grad.is_contiguous() or grad.dtype != torch.float32:
        raise ValueError(
            "grad must be a 1-D contiguous float32 tensor, got "
            f"shape={tuple(grad.shape)}, dtype={grad.dtype}, contiguous={grad.is_contiguous()}; "
            "pass a flat bucket, e.g. grad.reshape(-1).float().contiguous()"
        )
    if grad.numel() > MAX_NUMEL:
        raise ValueError(
            f"grad has {grad.numel()} elements but int32 indices address at most {MAX_NUMEL}; "
            "use smaller buckets"
        )
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise ValueError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if (
        residual.shape != grad.shape
        or residual.dtype != torch.float32
        or not residual.is_contiguous()
        or residual.device != grad.device
    ):
        raise ValueError(
            "residual must be a contiguous float32 tensor with grad's shape and device: got "
            f"shape={tuple(residual.shape)}, dtype={residual.dtype}, device={residual.device}, "
            f"contiguous={residual.is_contiguous()} for grad of shape={tuple(grad.shape)} on "
            f"{grad.device}"
        )


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
