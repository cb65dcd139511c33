"""Deterministic sum of W ranks' sparse (index, value) messages into a dense buffer."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import _cpu
from ._checks import MAX_NUMEL, DtypeError, check_out

# Elements of the output each program owns: it zeroes them, then adds every rank's pairs
# that fall inside, rank after rank. Each program is a chain of dependent loads (bounds,
# pairs, then the sums), so what hides the latency is many small programs: H200 sweep
# (n = 1e8, 8 x 1e6 pairs, 2026-12-02): tiles of 4096 with 128-pair blocks and 4 warps
# 0.336 ms, 16384 / 256 / 8 warps 0.542 ms, 16384 / 256 / 4 warps 0.694 ms, 65536 0.74 ms.
TILE_SIZE = 4096
# Pairs of one rank a program moves per iteration: a tile at 1% density gets ~41.
PAIR_BLOCK = 128
NUM_WARPS = 4
# Tile boundaries found per program of the search kernel, and its warps: its programs are
# chains of dependent loads too, so smaller is faster (H200, 2026-12-04, numel 2**24 and
# 167773 pairs, one rank: 1024 / 4 warps 65 us, 128 / 4 41 us, 64 / 2 39 us, 32 / 1 57 us;
# 1e8 and 8 x 1e6 pairs: 318, 297, 297, 301 us; benchmarks/sweep_scatter_bounds.py).
SEARCH_BLOCK = 64
SEARCH_WARPS = 2


@triton.jit
def _scatter_bounds_kernel(
    indices_ptr,
    counts_ptr,
    bounds_ptr,
    row_stride,
    num_bounds,
    steps,
    HAS_COUNTS: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # bounds[r, t]: the first position j < counts[r] of row r with indices[r, j] >= t * TILE
    # (counts[r] if none), by binary search in the row's ascending indices; so tile t's
    # pairs of rank r are positions bounds[r, t] .. bounds[r, t + 1] - 1.
    rank = tl.program_id(1)
    tile = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = tile < num_bounds
    target = tile.to(tl.int64) * TILE_SIZE
    row_ptr = indices_ptr + rank.to(tl.int64) * row_stride
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    # Without counts every entry of a row is real: row_stride of them.
    if HAS_COUNTS:
        count = tl.load(counts_ptr + rank)
    else:
        count = row_stride
    hi = tl.zeros([BLOCK], dtype=tl.int32) + count
    for _ in range(steps):
        active = lo < hi
        mid = lo + (hi - lo) // 2
        index = tl.load(row_ptr + mid, mask=valid & active, other=0)
        below = index.to(tl.int64) < target
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    tl.store(bounds_ptr + rank.to(tl.int64) * num_bounds + tile, lo, mask=valid)


@triton.jit
def _scatter_tile_kernel(
    indices_ptr,
    values_ptr,
    bounds_ptr,
    out_ptr,
    world_size,
    row_stride,
    num_bounds,
    numel,
    scale,
    skip_ptr,
    HAS_SKIP: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    PAIR_BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    tile_start = tile.to(tl.int64) * TILE_SIZE
    # With a skip flag that holds True, nothing is zeroed (the zeros end at 0, not numel)
    # and no pair is read: the output keeps what it held (see the docstring).
    zeros_end = numel
    if HAS_SKIP:
        write = tl.load(skip_ptr).to(tl.int32) == 0
        zeros_end = tl.where(write, numel, 0)
    for first in range(0, TILE_SIZE, PAIR_BLOCK):
        offsets = tile_start + first + tl.arange(0, PAIR_BLOCK)
        tl.store(out_ptr + offsets, 0.0, mask=offsets < zeros_end)
    lanes = tl.arange(0, PAIR_BLOCK)
    row_index_ptr = indices_ptr
    row_value_ptr = values_ptr
    row_bounds_ptr = bounds_ptr + tile
    for _ in range(world_size):
        # Every thread's stores so far (the zeros, the previous rank's sums) are seen by
        # every thread's loads below: ranks are added in order, element by element.
        tl.debug_barrier()
        begin = tl.load(row_bounds_ptr)
        end = tl.load(row_bounds_ptr + 1)
        if HAS_SKIP:
            end = tl.where(write, end, begin)
        for first in range(begin, end, PAIR_BLOCK):
            position = first + lanes
            valid = position < end
            index = tl.load(row_index_ptr + position, mask=valid, other=0)
            value = tl.load(row_value_ptr + position, mask=valid, other=0.0)
            # The search put indices below the tile elsewhere; the last tile can reach past
            # numel, and such an index is skipped, as the reference would raise.
            valid &= index < numel
            # A rank's indices are unique, so no two lanes of this loop share an element.
            total = tl.load(out_ptr + index, mask=valid)
            # Multiply, then add, as two roundings like torch (the launch turns off fma).
            tl.store(out_ptr + index, total + value * scale, mask=valid)
        row_index_ptr += row_stride
        row_value_ptr += row_stride
        row_bounds_ptr += num_bounds


def scatter_add(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`scatter_add_ref`, the same bits, without float atomics.

    One launch finds where each rank's pairs cross every tile boundary of the output (a
    binary search in each row's ascending indices); a second gives each program one tile,
    which it zeroes and then adds rank 0's pairs into, then rank 1's, and so on: every
    element sees the reference's operations in the reference's order, the zero fill costs
    no extra pass, and there is one launch whatever the world size. Nothing waits for the
    device.

    Args:
        indices: int32 tensor ``[world_size, m]``; each row's first ``counts[r]`` entries are
            unique and ascending (what the compressors send). Entries outside
            ``[0, numel)`` are skipped, not reported.
        values: float32 tensor ``[world_size, m]`` on the same device.
        counts: the number of real entries of each row, or ``None`` when all ``m`` are.
        numel: length of the dense output.
        scale: multiplied into each value before it is added, in float32 as torch does.
        out: a contiguous float32 tensor of ``numel`` elements on ``values``' device to
            write the sum into (all of it is overwritten), instead of a new one.
        skip: with ``out``, an optional one-element bool tensor on ``values``' device: when
            it holds True, nothing is written and ``out`` keeps its bits. The kernels read
            it on the device (no host sync), so that the sum can be queued before the host
            knows whether it is wanted.

    Returns:
        A float32 tensor of ``numel`` elements: ``out`` when given.

    Example:
        >>> indices = torch.tensor([[0, 2], [2, 3]], dtype=torch.int32, device="cuda")
        >>> values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda")
        >>> scatter_add(indices, values, None, 5, 0.5).tolist()
        [0.5, 0.0, 2.5, 2.0, 0.0]
    """
    count_list = _check_scatter_args(indices, values, counts, numel, out, skip)
    world_size, m = indices.shape
    device = values.device
    count_tensor = None
    if count_list is not None:
        count_tensor = torch.tensor(count_list, dtype=torch.int32, device=device)
    if numel == 0 or world_size == 0 or m == 0:
        if out is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        if skip is not None:  # zeros, unless skipped (on the device)
            return out.masked_fill_(~skip.view(()), 0.0)
        return out.zero_()
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=device)
    num_tiles = triton.cdiv(numel, TILE_SIZE)
    num_bounds = num_tiles + 1
    bounds = torch.empty(world_size, num_bounds, dtype=torch.int32, device=device)
    # Without counts the kernel reads none: any int32 tensor stands in for the pointer.
    _scatter_bounds_kernel[(triton.cdiv(num_bounds, SEARCH_BLOCK), world_size)](
        indices, indices if count_tensor is None else count_tensor, bounds, m, num_bounds,
        m.bit_length(), HAS_COUNTS=count_tensor is not None, TILE_SIZE=TILE_SIZE,
        BLOCK=SEARCH_BLOCK, num_warps=SEARCH_WARPS,
    )  # fmt: skip
    _scatter_tile_kernel[(num_tiles,)](
        indices, values, bounds, out.view(-1), world_size, m, num_bounds, numel, scale,
        bounds if skip is None else skip.view(torch.uint8), HAS_SKIP=skip is not None,
        TILE_SIZE=TILE_SIZE, PAIR_BLOCK=PAIR_BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _check_scatter_args(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    out: torch.Tensor | None,
    skip: torch.Tensor | None = None,
) -> list[int] | None:
    """Check the arguments of every scatter-add; returns ``counts`` as a list of ints.

    ``TypeError`` for a non-tensor, a non-integer ``numel`` or count; ``DtypeError`` (a
    ``TypeError`` and a ``ValueError``) for a wrong dtype; ``ValueError`` for wrong shapes,
    layouts, devices, sizes and ranges (the same rule as ``_checks``)."""
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError(
            f"indices and values must be tensors, got {type(indices).__name__} and "
            f"{type(values).__name__}"
        )
    what = "indices must be a contiguous int32 tensor [world_size, m]"
    if indices.dtype != torch.int32:
        raise DtypeError(f"{what}, got dtype={indices.dtype}")
    if indices.dim() != 2 or not indices.is_contiguous():
        raise ValueError(
            f"{what}, got shape={tuple(indices.shape)}, contiguous={indices.is_contiguous()}"
        )
    what = f"values must be a contiguous float32 tensor with indices' shape {tuple(indices.shape)}"
    if values.dtype != torch.float32:
        raise DtypeError(f"{what}, got dtype={values.dtype}")
    if values.shape != indices.shape or not values.is_contiguous():
        raise ValueError(
            f"{what}, got shape={tuple(values.shape)}, contiguous={values.is_contiguous()}"
        )
    if values.device != indices.device:
        raise ValueError(
            f"indices and values must be on one device, got {indices.device} and {values.device}"
        )
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    if not 0 <= numel <= MAX_NUMEL:
        raise ValueError(
            f"numel must be an int in [0, {MAX_NUMEL}] (indices are int32), got {numel!r}"
        )
    check_out(out, numel, values.device)
    _check_skip(skip, out, values.device)
    if counts is None:
        return None
    world_size, m = indices.shape
    message = (
        f"counts must hold {world_size} integers in [0, {m}] (one per row of indices), "
        f"got {list(counts)}; pass None when every entry is real"
    )
    try:
        count_list = [operator.index(count) for count in counts]
    except TypeError:
        raise TypeError(message) from None
    if len(count_list) != world_size or not all(0 <= c <= m for c in count_list):
        raise ValueError(message)
    return count_list


def _check_skip(skip: torch.Tensor | None, out: torch.Tensor | None, device) -> None:
    if skip is None:
        return
    what = f"skip must be a one-element bool tensor on {device}"
    if not isinstance(skip, torch.Tensor):
        raise TypeError(f"{what}, got {type(skip).__name__}")
    if skip.dtype != torch.bool:
        raise DtypeError(f"{what}, got dtype={skip.dtype}")
    if skip.numel() != 1 or skip.device != device:
        raise ValueError(f"{what}, got {skip.numel()} elements on {skip.device}")
    if out is None:
        raise ValueError("skip keeps out's bits, so it needs out: pass out=... with skip=...")


def scatter_add_ref(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
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
        out: a contiguous float32 tensor of ``numel`` elements on ``values``' device to
            write the sum into (all of it is overwritten), instead of a new one.
        skip: with ``out``, a one-element bool tensor: when it holds True, nothing is
            written (``out`` keeps its bits).

    Returns:
        A float32 tensor of ``numel`` elements: ``out`` when given.
    """
    _check_skip(skip, out, values.device)
    if skip is not None and bool(skip):
        return out
    if out is None:
        result = torch.zeros(numel, dtype=torch.float32, device=values.device)
    else:
        check_out(out, numel, values.device)
        result = out.view(-1).zero_()
    for rank in range(indices.shape[0]):
        count = indices.shape[1] if counts is None else counts[rank]
        rank_indices = indices[rank, :count].long()
        result[rank_indices] += values[rank, :count] * scale
    return result if out is None else out


# The CPU path goes tile by tile from this many output elements on, where the output no
# longer fits the last-level cache (2-core AMD EPYC, 32 MiB L3, one thread, 2026-12-03:
# 1.4e7 elements with 8 x 1% pairs took 0.74 ns per element tiled against 2.0 untiled; 1e6
# took 1.1 tiled against 0.75 untiled).
_TILED_MIN_NUMEL = 1 << 22


def _ascending(row) -> bool:
    return bool((row[1:] > row[:-1]).all())


def scatter_add_cpu(
    indices: torch.Tensor,
    values: torch.Tensor,
    counts: Sequence[int] | None,
    numel: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fast CPU version of :func:`scatter_add_ref`: the same bits, for any unique indices.

    Each rank's values are multiplied by ``scale`` (the reference's float32 multiply) and
    added with ``index_add_`` (one float32 add per pair, as in the reference), rank after
    rank. When every row's indices ascend (as the compressors send them) and the output
    outgrows the last-level cache (``_TILED_MIN_NUMEL``), the work goes tile by tile, and in
    each tile rank by rank: the same additions in the same order per element, with the tile
    zeroed and summed in cache instead of every rank sweeping the whole output. Indices
    outside ``[0, numel)`` raise ``IndexError`` (the reference's indexing raises, or wraps
    negative ones).

    Args and returns: as :func:`scatter_add_ref`; CPU tensors only.
    """
    count_list = _check_scatter_args(indices, values, counts, numel, out, skip)
    _cpu.require_cpu(values, "scatter_add_cpu")
    if skip is not None and bool(skip):  # on a CPU, reading the flag costs nothing
        return out
    world_size, m = indices.shape
    if count_list is None:
        count_list = [m] * world_size
    result = torch.empty(numel, dtype=torch.float32) if out is None else out.view(-1)
    rows = [rank for rank in range(world_size) if count_list[rank] > 0]
    # One multiply for every row, padding included (the padding is never added).
    scaled = torch.mul(values, scale)
    if numel < _TILED_MIN_NUMEL or not all(
        _ascending(indices[rank, : count_list[rank]].numpy()) for rank in rows
    ):
        result.zero_()
        for rank in rows:
            count = count_list[rank]
            result.index_add_(0, indices[rank, :count], scaled[rank, :count])
        return result if out is None else out
    # Where each row's ascending indices cross each tile boundary.
    edges = torch.arange(0, numel + _cpu.CHUNK, _cpu.CHUNK).clamp_(max=numel).to(torch.int32)
    bounds = {
        rank: torch.searchsorted(indices[rank, : count_list[rank]], edges).tolist() for rank in rows
    }
    for rank in rows:
        # Indices outside [0, numel) raise, as index_add_ does on the other path.
        if bounds[rank][0] > 0 or bounds[rank][-1] < count_list[rank]:
            raise IndexError(f"scatter_add_cpu: rank {rank} has indices outside [0, {numel})")
    for tile, (start, end) in enumerate(_cpu.chunks(numel)):
        result[start:end].zero_()
        for rank in rows:
            first, last = bounds[rank][tile], bounds[rank][tile + 1]
            if first < last:
                result.index_add_(0, indices[rank, first:last], scaled[rank, first:last])
    return result if out is None else out
