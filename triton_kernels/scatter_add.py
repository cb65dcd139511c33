"""Deterministic sum of W ranks' sparse (index, value) messages into a dense buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Pairs per program of one rank's launch: 1024 pairs with 4 warps is 8 per thread (two
# 16-byte loads of indices and of values); the gathers and scatters of `out` are random
# either way. Not swept yet: the benchmark times 512/1024/2048/4096 beside it.
BLOCK_SIZE = 1024
NUM_WARPS = 4


@triton.jit
def _scatter_add_kernel(
    indices_ptr,
    values_ptr,
    out_ptr,
    count,
    numel,
    scale,
    BLOCK_SIZE: tl.constexpr,
):
    # One launch adds one rank's pairs. Its indices are unique, so no two lanes touch the
    # same element and no atomics are needed; the launches run in stream order, so every
    # element sees rank 0's value added first, then rank 1's, as in the reference.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid = offsets < count
    index = tl.load(indices_ptr + offsets, mask=valid, other=0)
    value = tl.load(values_ptr + offsets, mask=valid, other=0.0)
    # The reference raises on an index out of range; checking would need a sync, so such
    # a pair is skipped instead of writing outside `out`.
    valid &= (index >= 0) & (index < numel)
    total = tl.load(out_ptr + index, mask=valid)
    # Multiply, then add, as two roundings like torch (the launch turns off fma fusion).
    tl.store(out_ptr + index, total + value * scale, mask=valid)


def scatter_add(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`scatter_add_ref`, the same bits, without float atomics.

    Zeros, then one launch per rank in rank order, each adding that rank's pairs times
    ``scale`` (every element at most once per launch): every element sees the reference's
    operations in the reference's order. Nothing waits for the device.

    Args:
        indices: int32 tensor ``[world_size, m]``; each row's first ``counts[r]`` entries are
            unique (the reference's contract; they need not be sorted here). Indices outside
            ``[0, numel)`` are skipped, not reported.
        values: float32 tensor ``[world_size, m]`` on the same device.
        counts: the number of real entries of each row, or ``None`` when all ``m`` are.
        numel: length of the dense output.
        scale: multiplied into each value before it is added, in float32 as torch does.

    Returns:
        A float32 tensor of ``numel`` elements.

    Example:
        >>> indices = torch.tensor([[0, 2], [2, 3]], dtype=torch.int32, device="cuda")
        >>> values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda")
        >>> scatter_add(indices, values, None, 5, 0.5).tolist()
        [0.5, 0.0, 2.5, 2.0, 0.0]
    """
    _check_scatter_args(indices, values, numel)
    world_size, m = indices.shape
    if counts is None:
        count_list = [m] * world_size
    else:
        count_list = [int(count) for count in counts]
        if len(count_list) != world_size or not all(0 <= c <= m for c in count_list):
            raise ValueError(
                f"counts must hold {world_size} integers in [0, {m}] (one per row of indices), "
                f"got {list(counts)}; pass None when every entry is real"
            )
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    if numel == 0:
        return out
    for rank, count in enumerate(count_list):
        if count == 0:
            continue
        grid = lambda meta, count=count: (triton.cdiv(count, meta["BLOCK_SIZE"]),)  # noqa: E731
        _scatter_add_kernel[grid](
            indices[rank],
            values[rank],
            out,
            count,
            numel,
            scale,
            BLOCK_SIZE=BLOCK_SIZE,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
    return out


def _check_scatter_args(indices: torch.Tensor, values: torch.Tensor, numel: int) -> None:
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError(
            f"indices and values must be tensors, got {type(indices).__name__} and "
            f"{type(values).__name__}"
        )
    if indices.dim() != 2 or indices.dtype != torch.int32 or not indices.is_contiguous():
        raise ValueError(
            "indices must be a contiguous int32 tensor [world_size, m], got "
            f"shape={tuple(indices.shape)}, dtype={indices.dtype}, "
            f"contiguous={indices.is_contiguous()}"
        )
    if values.shape != indices.shape or values.dtype != torch.float32 or not values.is_contiguous():
        raise ValueError(
            "values must be a contiguous float32 tensor with indices' shape "
            f"{tuple(indices.shape)}, got shape={tuple(values.shape)}, dtype={values.dtype}, "
            f"contiguous={values.is_contiguous()}"
        )
    if values.device != indices.device:
        raise ValueError(
            f"indices and values must be on one device, got {indices.device} and {values.device}"
        )
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel < 2**31:
        raise ValueError(f"numel must be an int in [0, 2**31) (indices are int32), got {numel!r}")


def scatter_add_ref(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
) -> torch.Tensor:
    """Add rank 0's values times ``scale``, then rank 1's, ..., into zeros.

    Each rank's indices are unique, so within one rank no element is added twice and the
    result depends only on the fixed rank order: the same bits on every run and rank.
    Scaling each value as it is added (``sum_r scale * v_r``, the way DDP divides before it
    sums) spares a pass over the whole output.

    Args:
        indices: int32 tensor ``[world_size, m]``: row ``r`` holds rank ``r``'s indices.
        values: float32 tensor ``[world_size, m]``, the matching values.
        counts: how many leading entries of each row are real (the rest is padding), or
            ``None`` when all ``m`` are.
        numel: length of the dense output.
        scale: multiplied into every value before it is added (``1 / world_size`` for an
            average).

    Returns:
        A float32 tensor of ``numel`` elements.
    """
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    for rank in range(indices.shape[0]):
        count = indices.shape[1] if counts is None else counts[rank]
        rank_indices = indices[rank, :count].long()
        out[rank_indices] += values[rank, :count] * scale
    return out
