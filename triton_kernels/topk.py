"""Error-feedback exact top-k: the k largest ``abs(g + r)``, ties to the lower index."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl

from . import _cpu, _indirect
from ._checks import check_count, check_grad_residual

# Keys. A magnitude is ordered by the bits of abs(acc); shifting the float's bits left by
# one drops the sign and leaves a uint32 with the same order (NaN above inf, -0.0 == 0.0).
# That key splits into four 8-bit digits at these shifts, so every radix level has the
# same 256-bin histogram and the same code.
_NUM_BINS = 256
_NUM_LEVELS = 4

# The sample. A stratified sample of acc estimates where the k-th largest key lies, so that
# the one pass over the data can already keep only the elements that may be sent: those
# at or above a bound `lowest` that the sample puts safely below the k-th largest key.
# _SAMPLE_SIZE keys (at most n; one at a hashed position in each stretch of n // samples
# elements, see _sample_positions_ref) go into a histogram of their top _FINE_BITS bits (the
# exponent and five mantissa bits: bins 1/32 of a power of two wide); `lowest` is the
# lower edge of the bin holding the sample's m-th largest key, where m is k scaled to the
# sample plus a margin of _MARGIN_SIGMAS standard deviations of that count and
# _MARGIN_EXTRA keys. A bound that turns out too high (fewer than k elements reach it)
# costs a second, slower pass; the result is the same either way.
_SAMPLE_SIZE = 1 << 16
_SAMPLE_BLOCK = 1024
_FINE_BITS = 13
# The sample's integer atomics go to this many copies of its histogram (by lane), which
# the last sample program adds up (_topk_window): gradient-like keys crowd into a few
# bins, and on one copy the atomics on those bins queued behind each other (21 us of a
# 0.5 ms call on the H200).
# 12 fine bits (1/16 of a power of two) measured 0.560 ms there against 0.508 for 13.
_SAMPLE_COPIES = 4
_MARGIN_SIGMAS = 4.0
_MARGIN_EXTRA = 4

# The pass over the data (add the residual, write it back, keep the elements at or above
# `lowest`) works per chunk of _CHUNK_BLOCK * _CHUNK_ITERS elements: a chunk writes its
# candidates in index order into its own slice of the candidate buffer, so no pass needs
# atomics to place them and a chunk's slice never outgrows the chunk.
_CHUNK_BLOCK = 2048
_CHUNK_ITERS = 16
_CHUNK_WARPS = 4

# Each program of a radix level walks the candidate slices of this many chunks and adds
# its 256 counts to the level's histogram once: with one chunk per program, the integer
# atomics of ~3000 programs on the same 256 counters were most of a level's time.
_LEVEL_CHUNKS = 4

# The candidate passes walk a chunk's slice in blocks of this many; a slice holds about
# 1-2% of its chunk for gradient-like data, so a small block wastes fewer masked lanes.
_CAND_BLOCK = 1024

# The pass over the data scans each block as rows of this many neighbours (see the kernel
# for why): 4 is one 16-byte load per row; in sm_90 SASS it cut the loop from ~930 to ~580
# instructions and from 30 barriers to 12 (8 and 16 came out at ~700).
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
def _topk_key(acc):
    """The order key of abs(acc): its bits without the sign, as a uint32."""
    return acc.to(tl.uint32, bitcast=True) << 1


@triton.jit
def _topk_sample_kernel(
    grad_ptr,
    residual_ptr,
    addresses_ptr,
    sample_hist_ptr,
    done_ptr,
    window_ptr,
    samples,
    stride,
    m,
    HAS_RESIDUAL: tl.constexpr,
    INDIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
    FINE_BITS: tl.constexpr,
    COPIES: tl.constexpr,
):
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    residual_ptr = _indirect.resolve(
        addresses_ptr, _indirect.RESIDUAL, residual_ptr, INDIRECT and HAS_RESIDUAL
    )
    lanes = tl.arange(0, BLOCK)
    sample = tl.program_id(0) * BLOCK + lanes
    valid = sample < samples
    # One element of each stretch of `stride`, at a hashed place: a plain stride shares
    # its period with the rows of a weight (a 4096-wide layer's gradient has 16.8M
    # elements, so a stride of 256), and the columns it then sees may not be typical.
    mixed = sample.to(tl.uint32) * 0x9E3779B1
    mixed = mixed ^ (mixed >> 15)
    # _sample_positions_ref computes the same positions for the tests: keep the two alike.
    # (No method calls on stride: Triton passes an int argument equal to 1 as a constant.)
    offsets = sample.to(tl.int64) * stride + mixed.to(tl.int64) % stride
    acc = tl.load(grad_ptr + offsets, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        acc = acc + tl.load(residual_ptr + offsets, mask=valid, other=0.0)
    fine = (_topk_key(acc) >> (32 - FINE_BITS)).to(tl.int32)
    # One integer atomic per sampled key, on the copy of the histogram its lane picks.
    copy_ptr = sample_hist_ptr + (lanes % COPIES) * (1 << FINE_BITS)
    tl.atomic_add(copy_ptr + fine, 1, mask=valid, sem="relaxed")
    # The last program to get here turns the histogram into the bound, which saves a
    # launch (each costs the host tens of microseconds). The barrier orders this
    # program's atomics before its count. Even a histogram read too early could only
    # lower the bound: more candidates, never another result.
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        _topk_window(sample_hist_ptr, window_ptr, m, FINE_BITS, COPIES)


@triton.jit
def _topk_window(sample_hist_ptr, window_ptr, m, FINE_BITS: tl.constexpr, COPIES: tl.constexpr):
    # The lower edge of the bin holding the sample's m-th largest key; bin 0 (every
    # element a candidate) when fewer than m keys were sampled. ".cg" reads L2, where the
    # other programs' atomics landed, not this multiprocessor's L1.
    bins = tl.arange(0, 1 << FINE_BITS)
    counts = tl.load(sample_hist_ptr + bins, cache_modifier=".cg")
    for copy in tl.static_range(1, COPIES):
        counts += tl.load(sample_hist_ptr + copy * (1 << FINE_BITS) + bins, cache_modifier=".cg")
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    lowest_bin = tl.max(tl.where(at_or_above >= m, bins, 0), 0)
    lowest = lowest_bin.to(tl.uint32) << (32 - FINE_BITS)
    tl.store(window_ptr, lowest.to(tl.int32, bitcast=True))


@triton.jit
def _topk_candidates_kernel(
    grad_ptr,
    residual_ptr,
    addresses_ptr,
    window_ptr,
    cand_index_ptr,
    cand_value_ptr,
    cand_count_ptr,
    total_ptr,
    n,
    HAS_RESIDUAL: tl.constexpr,
    INDIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    ROW: tl.constexpr,
):
    grad_ptr = _indirect.resolve(addresses_ptr, _indirect.GRAD, grad_ptr, INDIRECT)
    residual_ptr = _indirect.resolve(
        addresses_ptr, _indirect.RESIDUAL, residual_ptr, INDIRECT and HAS_RESIDUAL
    )
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * (BLOCK * ITERS)
    lowest = tl.load(window_ptr).to(tl.uint32, bitcast=True)
    # A block is laid out as rows of ROW neighbours so that the slot of each kept element
    # is a short in-register scan along its row plus a scan over rows: a flat cumsum over
    # the block costs a warp shuffle per element and made this pass compute-bound.
    rows = tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    grad_block_ptr = grad_ptr + start
    residual_block_ptr = residual_ptr + start
    index_base = start.to(tl.int32)  # n <= MAX_NUMEL, so every index fits
    index_out_ptr = cand_index_ptr + start
    value_out_ptr = cand_value_ptr + start
    count = tl.full((), 0, tl.int32)
    for i in range(ITERS):
        local = i * BLOCK + rows
        valid = local < n - start
        acc = tl.load(grad_block_ptr + local, mask=valid, other=0.0)
        if HAS_RESIDUAL:
            acc = acc + tl.load(residual_block_ptr + local, mask=valid, other=0.0)
            # Later passes read acc from here, and the unsent part stays here.
            tl.store(residual_block_ptr + local, acc, mask=valid)
        keep = (valid & (_topk_key(acc) >= lowest)).to(tl.int32)
        per_row = tl.sum(keep, 1)
        slot = (count + tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(keep, 1) - keep
        tl.store(index_out_ptr + slot, index_base + local, mask=keep != 0)
        tl.store(value_out_ptr + slot, acc, mask=keep != 0)
        count += tl.sum(per_row, 0)
    tl.store(cand_count_ptr + chunk, count)
    tl.atomic_add(total_ptr, count, sem="relaxed")


@triton.jit
def _topk_level_kernel(
    acc_ptr,
    addresses_ptr,
    cand_index_ptr,
    cand_value_ptr,
    cand_count_ptr,
    total_ptr,
    hist_ptr,
    n,
    num_chunks,
    k,
    LEVEL: tl.constexpr,
    ACC_SLOT: tl.constexpr,
    INDIRECT: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    # Histogram of digit LEVEL over the candidates whose higher digits equal the prefix
    # the earlier levels fixed (level 0: over every candidate).
    first_chunk = tl.program_id(0) * CHUNKS_PER_PROGRAM
    lanes = tl.arange(0, BLOCK)
    if LEVEL == 0:
        # Fewer than k elements reached the sample's bound: every element becomes a
        # candidate, chunk by chunk, before the histogram below reads them back. The usual
        # case reads one counter and does nothing else.
        if tl.load(total_ptr) < k:
            acc_ptr = _indirect.resolve(addresses_ptr, ACC_SLOT, acc_ptr, INDIRECT)
            for j in range(CHUNKS_PER_PROGRAM):
                start = (first_chunk + j).to(tl.int64) * CHUNK
                if start < n:
                    for first in range(0, CHUNK, BLOCK):
                        offsets = start + first + lanes
                        valid = offsets < n
                        acc = tl.load(acc_ptr + offsets, mask=valid)
                        tl.store(cand_index_ptr + offsets, offsets.to(tl.int32), mask=valid)
                        tl.store(cand_value_ptr + offsets, acc, mask=valid)
                    count = tl.minimum(n - start, CHUNK).to(tl.int32)
                    tl.store(cand_count_ptr + first_chunk + j, count)
            # Other threads of this program read what these wrote.
            tl.debug_barrier()
    else:
        prefix, _ = _topk_resolve(hist_ptr, k, LEVEL, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    misses = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(CHUNKS_PER_PROGRAM):
        chunk = first_chunk + j
        start = chunk.to(tl.int64) * CHUNK
        count = tl.load(cand_count_ptr + chunk, mask=chunk < num_chunks, other=0)
        for first in range(0, count, BLOCK):
            valid = first + lanes < count
            acc = tl.load(cand_value_ptr + start + first + lanes, mask=valid, other=0.0)
            key = _topk_key(acc)
            if LEVEL == 0:
                match = valid
            else:
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
        key = _topk_key(acc)
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
    addresses_ptr,
    k,
    HAS_RESIDUAL: tl.constexpr,
    INDIRECT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
):
    residual_ptr = _indirect.resolve(
        addresses_ptr, _indirect.RESIDUAL, residual_ptr, INDIRECT and HAS_RESIDUAL
    )
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
        key = _topk_key(acc)
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
    """The shared bucket checks (``TypeError`` / ``ValueError``, see ``_checks``), then ``k``
    as an int in ``[0, n]``."""
    check_grad_residual(grad, residual)
    n = grad.numel()
    return check_count("k", k, n, f"for a tensor of {n} elements")


def _sample_positions_ref(samples: int, stride: int) -> torch.Tensor:
    """The elements the sample kernel reads: one in each stretch of ``stride``, at a place
    set by a multiplicative hash of the stretch's number (int64, on the CPU). The kernel's
    hash must stay the same as this one."""
    sample = torch.arange(samples, dtype=torch.int64)
    mixed = (sample * 0x9E3779B1) & 0xFFFFFFFF
    mixed ^= mixed >> 15
    return sample * stride + mixed % stride


def _sample_bound(n: int, k: int) -> tuple[int, int, int]:
    """(samples, stride, m): how many keys to sample, every how many elements, and the rank
    in the sample whose bin bounds the candidates (above ``samples``: no bound)."""
    samples = min(n, _SAMPLE_SIZE)
    stride = n // samples
    if samples == n:  # the sample is the whole tensor: its k-th largest is exact
        return samples, stride, k
    expected = k * samples / n
    m = math.ceil(expected + _MARGIN_SIGMAS * math.sqrt(expected) + _MARGIN_EXTRA)
    return samples, stride, min(m, samples + 1)


def topk_compress(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    addresses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`topk_compress_ref`: the same bits, no host synchronisation.

    One pass over the data and radix select on the candidates it keeps, with the 32-bit key
    ``bits(acc) << 1`` in four 8-bit digits:

    1. a stratified sample of 65536 keys bounds the k-th largest key from below, with a margin;
    2. the pass adds the residual (writing ``acc`` back into it) and copies every element
       at or above that bound, in index order, into per-chunk candidate slices: about 1.5%
       of the elements at k = 1% of gradient-like data;
    3. should fewer than k elements reach the bound, every element becomes a candidate
       (same result, slower; the first radix level does this);
    4. four digit histograms of the candidates fix the k-th largest key, a count of the
       keys equal to it per chunk hands the ties out lowest index first, and the chosen
       candidates are written in ascending order.

    Device traffic is 12 bytes per element with error feedback (4 without) plus the
    candidates. Scratch: ``8 * n`` bytes of candidate buffer (all of it only when most
    elements tie with the k-th largest, or in step 3), a few bytes per 32K-element chunk and
    132 KB of histograms.

    Args:
        grad: 1-D contiguous float32 tensor of ``n <= MAX_NUMEL`` (``2**31 - 1``) elements.
        residual: float32 tensor like ``grad``, updated in place to ``acc`` where an element
            is not sent and to 0 where it is; ``None`` runs without error feedback.
        k: number of elements to send, a host int with ``0 <= k <= n``.
        addresses: None, or an int64 device tensor from which the kernels read where
            ``grad`` and ``residual`` are when they run (``triton_kernels._indirect``), so
            that a CUDA graph of this call can be replayed on buffers that moved; the
            tensors passed then give only the size, and their addresses must be in it.

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
    _indirect.check_addresses(addresses, device, grad, residual)
    indirect = addresses is not None
    if indirect and k == 0:
        raise ValueError("addresses takes k >= 1 (k = 0 runs one torch op, not the kernels)")
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
    # One zeroed buffer for every counter: the level histograms, the sample's histogram,
    # the candidate total, the bound and the count of finished sample programs.
    levels_size = _NUM_LEVELS * _NUM_BINS
    sample_size = _SAMPLE_COPIES << _FINE_BITS
    counters = torch.zeros(levels_size + sample_size + 3, dtype=torch.int32, device=device)
    hist = counters[:levels_size]
    sample_hist = counters[levels_size : levels_size + sample_size]
    total, window, done = counters[-3:-2], counters[-2:-1], counters[-1:]
    cand_index = torch.empty(num_chunks * chunk, dtype=torch.int32, device=device)
    cand_value = torch.empty(num_chunks * chunk, dtype=torch.float32, device=device)
    cand_count = torch.empty(num_chunks, dtype=torch.int32, device=device)
    chunk_stats = torch.empty(2 * num_chunks, dtype=torch.int32, device=device)
    chunk_offsets = torch.empty(2 * num_chunks, dtype=torch.int32, device=device)

    samples, stride, m = _sample_bound(n, k)
    _topk_sample_kernel[(triton.cdiv(samples, _SAMPLE_BLOCK),)](
        grad, acc, addresses if indirect else grad, sample_hist, done, window, samples,
        stride, m, HAS_RESIDUAL=has_residual, INDIRECT=indirect, BLOCK=_SAMPLE_BLOCK,
        FINE_BITS=_FINE_BITS, COPIES=_SAMPLE_COPIES, num_warps=4,
    )  # fmt: skip
    _topk_candidates_kernel[(num_chunks,)](
        grad, acc, addresses if indirect else grad, window, cand_index, cand_value,
        cand_count, total, n, HAS_RESIDUAL=has_residual, INDIRECT=indirect,
        BLOCK=_CHUNK_BLOCK, ITERS=_CHUNK_ITERS, ROW=_PARTITION_ROW,
        num_warps=_CHUNK_WARPS,
    )  # fmt: skip
    for level in range(_NUM_LEVELS):
        _topk_level_kernel[(triton.cdiv(num_chunks, _LEVEL_CHUNKS),)](
            acc, addresses if indirect else acc, cand_index, cand_value, cand_count, total,
            hist, n, num_chunks, k, LEVEL=level,
            ACC_SLOT=_indirect.RESIDUAL if has_residual else _indirect.GRAD,
            INDIRECT=indirect, CHUNK=chunk, CHUNKS_PER_PROGRAM=_LEVEL_CHUNKS, BLOCK=_CAND_BLOCK,
            NUM_BINS=_NUM_BINS, num_warps=_CHUNK_WARPS,
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
        cand_index, cand_value, cand_count, chunk_offsets, hist, out_index, out_value, acc,
        addresses if indirect else acc, k, HAS_RESIDUAL=has_residual, INDIRECT=indirect,
        CHUNK=chunk, BLOCK=_CAND_BLOCK, NUM_BINS=_NUM_BINS,
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


# The CPU path's sample: at most this many keys, at least _CPU_SAMPLE_MIN, and one per
# _CPU_SAMPLE_STRIDE elements in between. Each sampled key costs two random reads (grad and
# residual), and a smaller sample needs a wider margin, which lets in more candidates to
# list and select among. One key in 64 (2-core AMD EPYC, 2026-12-03): the sample is about a
# tenth of the call at 1.4e7 elements and a sixth at 1e6, with 1.17 k candidates at 1.4e7
# and k = 1%, 1.45 k at k = 0.1%, and 1.42 k at 1e6 and k = 1%.
_CPU_SAMPLE_SIZE = 1 << 16
_CPU_SAMPLE_MIN = 1 << 12
_CPU_SAMPLE_STRIDE = 64
# Up to this many elements the CPU path selects among all keys directly: no sample, one pass.
_CPU_DIRECT_MAX = 1 << 16


@functools.lru_cache(maxsize=8)
def _cpu_sample_positions(samples: int, stride: int) -> torch.Tensor:
    return _sample_positions_ref(samples, stride)


def _cpu_bounds(sample_keys: np.ndarray, n: int, k: int):
    """Lower bounds for the k-th largest key, highest first: the sample's m-th largest key
    (m as the GPU sample's margin puts it), then its 4m-th, 16m-th, ..., then 1 (every
    non-zero magnitude) and 0 (every element). Each is below the one before."""
    samples = sample_keys.shape[0]
    if samples == n:
        rank = k  # the sample is the whole tensor: its k-th largest key is exact
    else:
        expected = k * samples / n
        rank = math.ceil(expected + _MARGIN_SIGMAS * math.sqrt(expected) + _MARGIN_EXTRA)
    previous = None
    while rank <= samples:
        bound = max(int(np.partition(sample_keys, samples - rank)[samples - rank]), 1)
        if previous is None or bound < previous:
            yield bound
            previous = bound
        rank *= 4
    if previous is None or previous > 1:
        yield 1
    yield 0


def topk_compress_cpu(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int, *, accumulated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast CPU version of :func:`topk_compress_ref`: the same outputs and residual, bit for bit.

    The GPU kernel's plan on the CPU, without a sort and without any ``n``-element int64
    array:

    1. a sample of about ``n / 64`` keys (``bits(acc) & 0x7FFFFFFF`` read as int32, which
       orders magnitudes with NaN above inf and ``-0.0 == 0.0``) at the kernel's hashed
       positions bounds the k-th largest key from below, with the kernel's margin;
    2. one pass in cache-sized chunks adds the residual in place (the reference's float32
       add) and copies out, in index order, the positions and values of the elements whose
       key reaches the bound, zeroing them in the residual: 1.2 to 1.5 k of them for
       gradient-like data at k = 1% and 0.1%;
    3. should fewer than ``k`` reach the bound, they go back into the residual and a pass
       over ``acc`` with a lower bound (the sample's 4m-th largest key, ..., then 1, then 0:
       every element) lists them again;
    4. an introselect on the candidates' keys finds the k-th largest key; every candidate
       above it is sent, and of those equal to it the lowest positions; the candidates not
       sent are written back into the residual.

    Memory traffic is about 12 bytes per element with a residual (4 without), plus the
    candidates; inputs for which most elements tie with the k-th largest key (all equal,
    mostly zeros with k beyond the non-zeros) take step 3 down to every element.

    With ``accumulated=True`` (and ``residual=None``), ``grad`` already holds ``acc =
    grad + residual``, added by the caller (the bucket engine adds each gradient into its
    bucket as it arrives, saving a pass): the sent elements are zeroed in ``grad``, which is
    left holding the new residual, with the bits the reference leaves in ``residual``.

    Args and returns: as :func:`topk_compress_ref`; CPU tensors only.
    """
    k = _check_inputs(grad, residual, k)
    _cpu.require_cpu(grad, "topk_compress_cpu")
    _cpu.check_accumulated(accumulated, residual, "topk_compress_cpu")
    keep = residual is not None or accumulated  # what is not sent stays behind, in acc
    n = grad.numel()
    if k == 0 or k == n:
        acc = grad if residual is None else torch.add(grad, residual, out=residual)
        if k == 0:  # nothing is sent: the whole of acc stays behind
            return torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.float32)
        values = acc.clone()
        if keep:
            acc.zero_()
        return torch.arange(n, dtype=torch.int32), values

    if n <= _CPU_DIRECT_MAX:
        # Small: select among all the keys at once (one chunk's worth), no sample.
        acc = grad if residual is None else torch.add(grad, residual, out=residual)
        bits = _cpu.int_view(acc)
        take = _cpu.select_top(bits & _cpu.SIGN_CLEAR, k)
        chosen = np.flatnonzero(take).astype(np.int32)
        values = bits[chosen]
        if keep:
            bits[chosen] = 0
        return torch.from_numpy(chosen), torch.from_numpy(values).view(torch.float32)

    samples = min(n, max(_CPU_SAMPLE_MIN, min(_CPU_SAMPLE_SIZE, n // _CPU_SAMPLE_STRIDE)))
    positions = _cpu_sample_positions(samples, n // samples)
    sample = grad.index_select(0, positions)
    if residual is not None:
        # The same float32 add as the full pass below: the same keys.
        sample += residual.index_select(0, positions)
    sample_keys = _cpu.int_view(sample) & _cpu.SIGN_CLEAR

    acc = grad if residual is None else residual
    bits = _cpu.int_view(acc)
    bounds = _cpu_bounds(sample_keys, n, k)
    # The first pass copies each candidate out and zeroes it in the residual while its
    # chunk is in cache; the ones not sent are written back afterwards (fewer, for a good
    # bound, than the k random writes of zeroing the sent ones after the pass).
    zero = keep
    candidates = _cpu.Candidates(n, next(bounds))
    for start, end in _cpu.chunks(n):
        if residual is not None:
            torch.add(grad[start:end], residual[start:end], out=residual[start:end])
        candidates.add_chunk(bits[start:end], start, zero=zero)
    if candidates.count < k:
        # The bound was too high. Put the candidates back, then list again, over acc, with
        # the next lower bound until at least k reach it; zero the sent ones at the end.
        if zero:
            listed, values = candidates.arrays()
            bits[listed] = values
        while candidates.count < k:
            candidates = _cpu.Candidates(n, next(bounds))
            for start, end in _cpu.chunks(n):
                candidates.add_chunk(bits[start:end], start)
        listed, values = candidates.arrays()
        take = _cpu.select_top(values & _cpu.SIGN_CLEAR, k)
        if take is not None:
            listed, values = listed[take], values[take]
        if zero:
            bits[listed] = 0  # +0.0, as the reference writes
        return torch.from_numpy(listed), torch.from_numpy(values).view(torch.float32)
    listed, values = candidates.arrays()
    take = _cpu.select_top(values & _cpu.SIGN_CLEAR, k)
    if take is not None:
        if zero:
            kept = ~take
            bits[listed[kept]] = values[kept]
        listed, values = listed[take], values[take]
    return torch.from_numpy(listed), torch.from_numpy(values).view(torch.float32)
