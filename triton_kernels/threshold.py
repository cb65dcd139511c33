"""Error-feedback magnitude threshold: send every element with ``abs(g + r) >= t``, and NaN."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _cpu
from ._checks import MAX_NUMEL, check_grad_residual

__all__ = [
    "MAX_NUMEL",
    "check_grad_residual",
    "threshold_compress",
    "threshold_compress_cpu",
    "threshold_compress_ref",
]

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
    # Not `abs(acc) >= threshold`, which is false for NaN: a NaN is sent too.
    # `& in_bounds`: the padding lanes hold 0.0, which passes a threshold of 0.
    keep = ~(tl.abs(acc) < threshold) & in_bounds
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

    Sends the elements with ``abs(acc) >= threshold`` and every NaN (``not abs(acc) < t``).
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
    threshold32 = _check_threshold(threshold)
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


def _check_threshold(threshold: float) -> float:
    """The threshold rounded to float32, as torch rounds a Python float it compares a float32
    tensor with (1e39 becomes inf). ``TypeError`` unless it is a real number, ``ValueError``
    if it is negative or NaN."""
    if isinstance(threshold, (bool, str, bytes)):
        raise TypeError(f"threshold must be a float >= 0, got {type(threshold).__name__}")
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        raise TypeError(f"threshold must be a float >= 0, got {type(threshold).__name__}") from None
    if not threshold >= 0.0:  # also rejects NaN
        raise ValueError(
            f"threshold must be a float >= 0, got {threshold}; elements with "
            "abs(grad + residual) >= threshold (and NaN) are sent"
        )
    return torch.tensor(threshold, dtype=torch.float32).item()


def threshold_compress_ref(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select the elements of ``acc = grad + residual`` with ``abs(acc) >= threshold``, and
    every NaN.

    An element is sent unless ``abs(acc) < threshold``: a NaN fails that comparison, so it is
    sent like an infinity, and a non-finite ``acc`` always shows in the message (where the
    receivers can see it) instead of hiding in the residual.

    Args:
        grad: 1-D contiguous float32 tensor.
        residual: float32 tensor like ``grad``, updated in place to ``acc`` where an element
            is not sent and to 0 where it is; ``None`` runs without error feedback.
        threshold: non-negative float, compared in float32 (as torch rounds it).

    Returns:
        ``(indices, values, count)``: int32 indices in ascending order, the float32 values
        ``acc[indices]``, and the number of selected elements as a 0-d int64 tensor on
        ``grad``'s device. Only the first ``count`` entries of ``indices`` and ``values``
        are meaningful (a launcher may return longer buffers).
    """
    acc = grad if residual is None else grad + residual
    keep = ~(acc.abs() < threshold)
    indices = keep.nonzero().flatten().to(torch.int32)
    values = acc[indices.long()]
    if residual is not None:
        residual.copy_(acc.masked_fill(keep, 0.0))
    count = torch.tensor(indices.numel(), dtype=torch.int64, device=grad.device)
    return indices, values, count


def threshold_compress_cpu(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    threshold: float,
    *,
    accumulated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fast CPU version of :func:`threshold_compress_ref`: the same outputs, bit for bit,
    returned at their exact length as the reference returns them.

    One pass over the data in cache-sized chunks: the residual add (torch, in place, the
    reference's float32 add), then the order key ``bits(acc) & 0x7FFFFFFF`` compared with
    the threshold's key (``not abs(acc) < t`` is ``key >= key(t)``: NaN keys lie above
    inf's), the chunk's positions, its values, and zeros into the residual where sent.
    No ``n``-element temporaries; about 12 bytes of memory traffic per element with a
    residual (4 without) plus 8 per sent pair.

    With ``accumulated=True`` (and ``residual=None``), ``grad`` already holds ``acc =
    grad + residual`` and is left holding the new residual, as in
    :func:`~sparsecomm.triton_kernels.topk.topk_compress_cpu`.

    Args and returns: as :func:`threshold_compress_ref`; CPU tensors only.
    """
    check_grad_residual(grad, residual)
    _cpu.require_cpu(grad, "threshold_compress_cpu")
    _cpu.check_accumulated(accumulated, residual, "threshold_compress_cpu")
    threshold_key = _cpu.float32_key(_check_threshold(threshold))
    n = grad.numel()
    acc = grad if residual is None else residual
    bits = _cpu.int_view(acc)
    candidates = _cpu.Candidates(n, threshold_key)
    for start, end in _cpu.chunks(n):
        if residual is not None:
            torch.add(grad[start:end], residual[start:end], out=residual[start:end])
        # Sent: +0.0 stays in the residual, as masked_fill writes.
        candidates.add_chunk(bits[start:end], start, zero=residual is not None or accumulated)
    indices, values = candidates.arrays()
    count = torch.tensor(candidates.count, dtype=torch.int64)
    return torch.from_numpy(indices), torch.from_numpy(values).view(torch.float32), count
