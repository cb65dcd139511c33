"""Buffers found when a kernel runs, not when it is launched.

A CUDA graph replays its kernels with the arguments they were captured with, buffer
addresses included, so a graph captured once could only ever read and write the buffers it
was captured on. The launchers that take ``addresses`` (``topk_compress``,
``cast_compress``) make their kernels read the buffers' addresses from that small int64
device tensor instead, when they run: whoever replays the graph writes the current buffers'
addresses there first (``sparsecomm._engine.CompressGraphs``), and the buffers may move
from one step to the next (a gradient that autograd allocated anew, a bucket buffer
released between steps).

The table has one slot per buffer, :data:`GRAD`, :data:`RESIDUAL` and :data:`OUT`; a slot
the call has no buffer for is never read. Every address must be a multiple of
:data:`ALIGN` bytes (what lets the kernels use 16-byte loads on an address they cannot
see at compile time); the caching allocator's blocks are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slots (constexpr, so that the kernels can read them).
GRAD = tl.constexpr(0)
RESIDUAL = tl.constexpr(1)
OUT = tl.constexpr(2)
SLOTS = 3
ALIGN = 16


@triton.jit
def resolve(addresses_ptr, slot: tl.constexpr, ptr, INDIRECT: tl.constexpr):
    """``ptr``, or with ``INDIRECT`` the address in ``addresses_ptr[slot]``, of ``ptr``'s
    pointer type."""
    if INDIRECT:
        # The hint goes on the pointer: on the int64 before the cast it is lost, and the
        # loads through it are not vectorised (sm_90 PTX, Triton 3.9).
        ptr = tl.multiple_of(tl.load(addresses_ptr + slot).to(ptr.dtype), 16)
    return ptr


def check_addresses(addresses: torch.Tensor | None, device: torch.device, *buffers) -> None:
    """Check an ``addresses`` table for buffers on ``device``: an int64 tensor of
    :data:`SLOTS` elements there, and every buffer (None: no buffer) aligned to
    :data:`ALIGN` bytes. That the table holds the buffers' addresses when the kernels run
    is the caller's to keep (it cannot be checked without reading the device)."""
    if addresses is None:
        return
    if not isinstance(addresses, torch.Tensor):
        raise TypeError(f"addresses must be a torch.Tensor or None, got {type(addresses).__name__}")
    if addresses.dtype != torch.int64 or addresses.shape != (SLOTS,):
        raise ValueError(
            f"addresses must be an int64 tensor of {SLOTS} elements (grad, residual, out), got "
            f"dtype={addresses.dtype}, shape={tuple(addresses.shape)}"
        )
    if addresses.device != device:
        raise ValueError(f"addresses is on {addresses.device} but the buffers are on {device}")
    for buffer in buffers:
        if buffer is not None and buffer.data_ptr() % ALIGN:
            raise ValueError(
                f"a buffer read through addresses must start at a multiple of {ALIGN} bytes; "
                "pass a tensor that owns its storage (or addresses=None)"
            )


def table(device: torch.device, *buffers) -> torch.Tensor:
    """A new table holding the buffers' addresses (0 for None), for tests and one-off calls."""
    values = [0 if b is None else b.data_ptr() for b in buffers]
    values += [0] * (SLOTS - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)
