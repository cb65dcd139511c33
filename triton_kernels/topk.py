"""Error-feedback exact top-k: the k largest ``abs(g + r)``, ties to the lower index."""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

# Keys. A magnitude is ordered by the bits of abs(acc); shifting the float's bits left by
# one drops the sign and leaves a uint32 with the same order (NaN above inf, -0.0 == 0.0).
# That key splits into four 8-bit digits at these shifts, so every radix level has the
# same 256-bin histogram and the same code.
_NUM_BINS = 256
_NUM_LEVELS = 4

# Pass 1 (add the residual, write it back, histogram the top digit, i.e. the exponent).
# Each program adds its 256 counts to the global histogram once, so a program covers
# _HIST_BLOCK * _HIST_ITERS = 32768 elements: ~3000 programs and ~0.8M integer atomics
# at n = 1e8. 256 bins, not 2048: tl.histogram costs about one popc per bin per 32
# elements, and 2048 bins would make this pass compute-bound on the H200. H200 sweep
# (n = 1e8, k = 1e6, whole call): 4096 x 8 (8 warps) 0.937 ms, 4096 x 4 0.942 ms,
# 2048 x 16 (4 warps) 0.991 ms; this pass alone ran 333 us, 88% of the copy bandwidth.
_HIST_BLOCK = 4096
_HIST_ITERS = 8
_HIST_WARPS = 8

# Pass 2 and every later pass work per chunk of _CHUNK_BLOCK * _CHUNK_ITERS = 32768
# elements: a chunk writes its candidates (elements whose top digit is at or above the
# boundary digit) in index order into its own slice of the candidate buffer, so no pass
# needs atomics to place them and a chunk's slice never outgrows the chunk. The first H200
# sweep (n = 1e8, k = 1e6, whole call) with this block scan: 2048 x 16 (4 warps) 0.937 ms,
# 1024 x 32 0.966 ms, 2048 x 32 (8 warps) 1.018 ms, 2048 x 8 1.065 ms.
_CHUNK_BLOCK = 2048
_CHUNK_ITERS = 16
_CHUNK_WARPS = 4

# The candidate passes walk a chunk's slice in blocks of this many; a slice holds a few
# percent of its chunk for gradient-like data, so a small block wastes fewer masked lanes.
_CAND_BLOCK = 1024

# Pass 2 scans each block as rows of this many neighbours (see the kernel for why): 4 is
# one 16-byte load per row; in sm_90 SASS it cut the loop from ~930 to ~580 instructions
# and from 30 barriers to 12 (8 and 16 came out at ~700).
_PARTITION_ROW = 4

# Tile of the single-program exclusive scan over per-chunk counts.
_SCAN_BLOCK = 1024


@triton.jit
def _topk_select_bin(hist_ptr, need, NUM_BINS: tl.constexpr):
    """The bin holding the need-th largest key, and how many to take from it."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.load(hist_ptr + bins)
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    # at_or_above only shrinks as the bin grows, so the boundary is the last bin that
    # still reaches `need`; everything above it is taken whole.
    boundary = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    above = tl.sum(tl.where(bins > boundary, counts, 0), 0)
    return boundary, need - above


@triton.jit
def _topk_resolve(hist_ptr, k, LEVELS: tl.constexpr, NUM_BINS: tl.constexpr):
    """Key prefix fixed by the first LEVELS digit histograms, and how many keys equal to
    that prefix must still be taken. Every program recomputes it (a few 256-wide scans)
    rather than launching a one-program kernel per level."""
    boundary, need = _topk_select_bin(hist_ptr, k, NUM_BINS)
    prefix = boundary.to(tl.uint32)
    for level in tl.static_range(1, LEVELS):
        boundary, need = _topk_select_bin(hist_ptr + level * NUM_BINS, need, NUM_BINS)
        prefix = (prefix << 8) | boundary.to(tl.uint32)
    return prefix, need


@triton.jit
def _topk_histogram_kernel(
    grad_ptr,
    residual_ptr,
    hist_ptr,
    n,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for i in range(ITERS):
        offsets = start + i * BLOCK + lanes
        valid = offsets < n
        acc = tl.load(grad_ptr + offsets, mask=valid, other=0.0)
        if HAS_RESIDUAL:
            acc = acc + tl.load(residual_ptr + offsets, mask=valid, other=0.0)
            # Later passes read acc from here: 4 bytes per element instead of 8.
            tl.store(residual_ptr + offsets, acc, mask=valid)
        key = acc.to(tl.uint32, bitcast=True) << 1
        counts += tl.histogram((key >> 24).to(tl.int32), NUM_BINS)
    # Lanes past n loaded 0.0 and landed in bin 0; take them out again.
    padding = tl.minimum(tl.maximum(start + BLOCK * ITERS - n, 0), BLOCK * ITERS)
    bins = tl.arange(0, NUM_BINS)
    counts -= tl.where(bins == 0, padding.to(tl.int32), 0)
    tl.atomic_add(hist_ptr + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _topk_partition_kernel(
    acc_ptr,
    hist_ptr,
    cand_index_ptr,
    cand_value_ptr,
    cand_count_ptr,
    n,
    k,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    ROW: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * (BLOCK * ITERS)
    boundary, _ = _topk_select_bin(hist_ptr, k, NUM_BINS)
    lowest = boundary.to(tl.uint32) << 24
    # A block is laid out as rows of ROW neighbours so that the slot of each kept element
    # is a short in-register scan along its row plus a scan over rows: a flat cumsum over
    # the block costs a warp shuffle per element and made this pass compute-bound.
    rows = tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    acc_block_ptr = acc_ptr + start
    index_base = start.to(tl.int32)  # n < 2**31, so every index fits
    index_out_ptr = cand_index_ptr + start
    value_out_ptr = cand_value_ptr + start
    count = tl.full((), 0, tl.int32)
    for i in range(ITERS):
        local = i * BLOCK + rows
        valid = local < n - start
        acc = tl.load(acc_block_ptr + local, mask=valid, other=0.0)
        key = acc.to(tl.uint32, bitcast=True) << 1
        keep = (valid & (key >= lowest)).to(tl.int32)
        per_row = tl.sum(keep, 1)
        slot = (count + tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(keep, 1) - keep
        tl.store(index_out_ptr + slot, index_base + local, mask=keep != 0)
        tl.store(value_out_ptr + slot, acc, mask=keep != 0)
        count += tl.sum(per_row, 0)
    tl.store(cand_count_ptr + chunk, count)


@triton.jit
def _topk_refine_kernel(
    cand_value_ptr,
    cand_count_ptr,
    hist_ptr,
    k,
    LEVEL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * CHUNK
    prefix, _ = _topk_resolve(hist_ptr, k, LEVEL, NUM_BINS)
    count = tl.load(cand_count_ptr + chunk)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    misses = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(0, count, BLOCK):
        valid = first + lanes < count
        acc = tl.load(cand_value_ptr + start + first + lanes, mask=valid, other=0.0)
        key = acc.to(tl.uint32, bitcast=True) << 1
        match = valid & ((key >> (32 - 8 * LEVEL)) == prefix)
        digit = ((key >> (24 - 8 * LEVEL)) & 0xFF).to(tl.int32)
        # Non-matching lanes are counted in bin 0 and subtracted below: tl.histogram's
        # mask argument is newer than the Triton versions this must run on.
        counts += tl.histogram(tl.where(match, digit, 0), NUM_BINS)
        misses += (~match).to(tl.int32)
    bins = tl.arange(0, NUM_BINS)
    counts -= tl.where(bins == 0, tl.sum(misses, 0), 0)
    tl.atomic_add(hist_ptr + LEVEL * NUM_BINS + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _topk_tie_count_kernel(
    cand_value_ptr,
    cand_count_ptr,
    hist_ptr,
    chunk_stats_ptr,
    k,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * CHUNK
    threshold, _ = _topk_resolve(hist_ptr, k, NUM_LEVELS, NUM_BINS)
    count = tl.load(cand_count_ptr + chunk)
    lanes = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], dtype=tl.int32)
    equal = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(0, count, BLOCK):
        valid = first + lanes < count
        acc = tl.load(cand_value_ptr + start + first + lanes, mask=valid, other=0.0)
        key = acc.to(tl.uint32, bitcast=True) << 1
        above += (valid & (key > threshold)).to(tl.int32)
        equal += (valid & (key == threshold)).to(tl.int32)
    tl.store(chunk_stats_ptr + 2 * chunk, tl.sum(above, 0))
    tl.store(chunk_stats_ptr + 2 * chunk + 1, tl.sum(equal, 0))


@triton.jit
def _topk_offsets_kernel(
    chunk_stats_ptr,
    chunk_offsets_ptr,
    hist_ptr,
    num_chunks,
    k,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
):
    # One program walks the chunks in index order, so the keys equal to the threshold are
    # handed out lowest index first and each chunk's output lands after all lower chunks.
    _, ties_needed = _topk_resolve(hist_ptr, k, NUM_LEVELS, NUM_BINS)
    lanes = tl.arange(0, BLOCK)
    ties_before = tl.full((), 0, tl.int32)
    taken_before = tl.full((), 0, tl.int32)
    for first in range(0, num_chunks, BLOCK):
        chunks = first + lanes
        valid = chunks < num_chunks
        above = tl.load(chunk_stats_ptr + 2 * chunks, mask=valid, other=0)
        equal = tl.load(chunk_stats_ptr + 2 * chunks + 1, mask=valid, other=0)
        tie_rank = ties_before + tl.cumsum(equal, 0) - equal
        taken = above + tl.minimum(tl.maximum(ties_needed - tie_rank, 0), equal)
        out_offset = taken_before + tl.cumsum(taken, 0) - taken
        tl.store(chunk_offsets_ptr + 2 * chunks, tie_rank, mask=valid)
        tl.store(chunk_offsets_ptr + 2 * chunks + 1, out_offset, mask=valid)
        ties_before += tl.sum(equal, 0)
        taken_before += tl.sum(taken, 0)


@triton.jit
def _topk_write_kernel(
    cand_index_ptr,
    cand_value_ptr,
    cand_count_ptr,
    chunk_offsets_ptr,
    hist_ptr,
    out_index_ptr,
    out_value_ptr,
    residual_ptr,
    k,
    HAS_RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * CHUNK
    threshold, ties_needed = _topk_resolve(hist_ptr, k, NUM_LEVELS, NUM_BINS)
    count = tl.load(cand_count_ptr + chunk)
    tie_rank = tl.load(chunk_offsets_ptr + 2 * chunk)
    out_offset = tl.load(chunk_offsets_ptr + 2 * chunk + 1)
    lanes = tl.arange(0, BLOCK)
    for first in range(0, count, BLOCK):
        valid = first + lanes < count
        index = tl.load(cand_index_ptr + start + first + lanes, mask=valid, other=0)
        acc = tl.load(cand_value_ptr + start + first + lanes, mask=valid, other=0.0)
        key = acc.to(tl.uint32, bitcast=True) << 1
        tie = (valid & (key == threshold)).to(tl.int32)
        rank = tie_rank + tl.cumsum(tie, 0) - tie
        take = valid & ((key > threshold) | ((tie != 0) & (rank < ties_needed)))
        take_i = take.to(tl.int32)
        slot = out_offset + tl.cumsum(take_i, 0) - take_i
        tl.store(out_index_ptr + slot, index, mask=take)
        tl.store(out_value_ptr + slot, acc, mask=take)
        if HAS_RESIDUAL:
            tl.store(residual_ptr + index.to(tl.int64), 0.0, mask=take)
        tie_rank += tl.sum(tie, 0)
        out_offset += tl.sum(take_i, 0)


def _check_inputs(grad: torch.Tensor, residual: torch.Tensor | None, k: int) -> int:
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype != torch.float32:
        raise ValueError(f"grad must be float32, got {grad.dtype}; cast it with grad.float()")
    if grad.dim() != 1:
        raise ValueError(
            f"grad must be 1-D, got shape {tuple(grad.shape)}; flatten it with grad.view(-1)"
        )
    if not grad.is_contiguous():
        raise ValueError("grad must be contiguous; pass grad.contiguous()")
    n = grad.numel()
    if n >= 2**31:
        raise ValueError(f"grad has {n} elements; int32 indices allow at most 2**31 - 1")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            kind = type(residual).__name__
            raise TypeError(f"residual must be a torch.Tensor or None, got {kind}")
        if residual.dtype != torch.float32:
            raise ValueError(f"residual must be float32, got {residual.dtype}")
        if residual.shape != grad.shape:
            raise ValueError(
                f"residual must have grad's shape {tuple(grad.shape)}, got {tuple(residual.shape)}"
            )
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous; it is updated in place")
        if residual.device != grad.device:
            raise ValueError(f"residual is on {residual.device} but grad is on {grad.device}")
    if isinstance(k, bool):
        raise TypeError("k must be an int, got a bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"k must be a host int, got {type(k).__name__}") from None
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} elements, got k={k}")
    return k


def topk_compress(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`topk_compress_ref`: the same bits, no host synchronisation.

    Radix select on the 32-bit key ``bits(acc) << 1`` in four 8-bit digits. Pass 1 adds
    the residual (writing ``acc`` back into it) and histograms the top digit; pass 2
    re-reads ``acc`` and copies every element at or above the boundary digit, in index
    order, into per-chunk candidate slices; the three lower digits, the ties at the exact
    threshold and the final ascending compaction only touch those candidates. Device
    traffic is 16 bytes per element with error feedback (8 without) plus the candidates.

    Scratch: ``8 * n`` bytes of candidate buffer (all of it only when most elements tie
    with the k-th largest), a few bytes per 16K-element chunk and a 4 KB histogram.

    Args:
        grad: 1-D contiguous float32 tensor of ``n < 2**31`` elements.
        residual: float32 tensor like ``grad``, updated in place to ``acc`` where an element
            is not sent and to 0 where it is; ``None`` runs without error feedback.
        k: number of elements to send, a host int with ``0 <= k <= n``.

    Returns:
        ``(indices, values)``: ``k`` int32 indices in ascending order and the float32
        values ``acc[indices]``, bit for bit what :func:`topk_compress_ref` returns.

    Example:
        >>> g = torch.tensor([0.5, -3.0, 2.0, -0.0])
        >>> r = torch.zeros(4)
        >>> topk_compress(g, r, 2)
        (tensor([1, 2], dtype=torch.int32), tensor([-3.,  2.]))
    """
    k = _check_inputs(grad, residual, k)
    n = grad.numel()
    device = grad.device
    out_index = torch.empty(k, dtype=torch.int32, device=device)
    out_value = torch.empty(k, dtype=torch.float32, device=device)
    if k == 0:
        if residual is not None:
            # Nothing is sent, so the whole of acc stays behind.
            torch.add(grad, residual, out=residual)
        return out_index, out_value

    has_residual = residual is not None
    acc = residual if has_residual else grad
    chunk = _CHUNK_BLOCK * _CHUNK_ITERS
    num_chunks = triton.cdiv(n, chunk)
    hist = torch.zeros(_NUM_LEVELS * _NUM_BINS, dtype=torch.int32, device=device)
    cand_index = torch.empty(num_chunks * chunk, dtype=torch.int32, device=device)
    cand_value = torch.empty(num_chunks * chunk, dtype=torch.float32, device=device)
    cand_count = torch.empty(num_chunks, dtype=torch.int32, device=device)
    chunk_stats = torch.empty(2 * num_chunks, dtype=torch.int32, device=device)
    chunk_offsets = torch.empty(2 * num_chunks, dtype=torch.int32, device=device)

    _topk_histogram_kernel[(triton.cdiv(n, _HIST_BLOCK * _HIST_ITERS),)](
        grad, acc, hist, n,
        HAS_RESIDUAL=has_residual, BLOCK=_HIST_BLOCK, ITERS=_HIST_ITERS,
        NUM_BINS=_NUM_BINS, num_warps=_HIST_WARPS,
    )  # fmt: skip
    _topk_partition_kernel[(num_chunks,)](
        acc, hist, cand_index, cand_value, cand_count, n, k,
        BLOCK=_CHUNK_BLOCK, ITERS=_CHUNK_ITERS, ROW=_PARTITION_ROW, NUM_BINS=_NUM_BINS,
        num_warps=_CHUNK_WARPS,
    )  # fmt: skip
    for level in range(1, _NUM_LEVELS):
        _topk_refine_kernel[(num_chunks,)](
            cand_value, cand_count, hist, k,
            LEVEL=level, CHUNK=chunk, BLOCK=_CAND_BLOCK, NUM_BINS=_NUM_BINS,
            num_warps=_CHUNK_WARPS,
        )  # fmt: skip
    _topk_tie_count_kernel[(num_chunks,)](
        cand_value, cand_count, hist, chunk_stats, k,
        CHUNK=chunk, BLOCK=_CAND_BLOCK, NUM_BINS=_NUM_BINS, NUM_LEVELS=_NUM_LEVELS,
        num_warps=_CHUNK_WARPS,
    )  # fmt: skip
    _topk_offsets_kernel[(1,)](
        chunk_stats, chunk_offsets, hist, num_chunks, k,
        BLOCK=_SCAN_BLOCK, NUM_BINS=_NUM_BINS, NUM_LEVELS=_NUM_LEVELS, num_warps=4,
    )  # fmt: skip
    _topk_write_kernel[(num_chunks,)](
        cand_index, cand_value, cand_count, chunk_offsets, hist, out_index, out_value, acc, k,
        HAS_RESIDUAL=has_residual, CHUNK=chunk, BLOCK=_CAND_BLOCK, NUM_BINS=_NUM_BINS,
        NUM_LEVELS=_NUM_LEVELS, num_warps=_CHUNK_WARPS,
    )  # fmt: skip
    return out_index, out_value


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
