"""A copy that happens only where a flag on the device says so, without the host reading
the flag: ``dst[:] = src`` if ``flag`` holds True, else nothing.

``CompressedOptimizer`` uses it when it steps a fused Adam before the host knows whether
the ranks refused the step: the old residual is copied where the new one would go only on
a refused step, so the common (accepted) step reads one flag per program and moves no
data. ``torch.where(flag, src, dst, out=dst)`` would read and write every element every
step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program: large, because the usual program reads its flag and exits.
BLOCK_SIZE = 8192
NUM_WARPS = 8


@triton.jit
def _copy_if_kernel(flag_ptr, src_ptr, dst_ptr, n, BLOCK_SIZE: tl.constexpr):
    if tl.load(flag_ptr).to(tl.int32) != 0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_bounds = offsets < n
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=in_bounds), mask=in_bounds)


def _check(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if flag.dtype != torch.bool or flag.numel() != 1 or flag.device != dst.device:
        raise ValueError(
            f"flag must be a one-element bool tensor on {dst.device}, got "
            f"{flag.numel()} element(s) of {flag.dtype} on {flag.device}"
        )
    if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(
            f"src and dst must match: got {tuple(src.shape)} {src.dtype} on {src.device} "
            f"and {tuple(dst.shape)} {dst.dtype} on {dst.device}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")


def copy_if(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` if ``flag`` (a one-element bool tensor) holds True, decided on
    the device: one launch, no host synchronisation."""
    _check(flag, src, dst)
    n = dst.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _copy_if_kernel[grid](
        flag.view(torch.uint8), src, dst, n, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS
    )


def copy_if_cpu(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """:func:`copy_if` on the CPU, where reading the flag costs no synchronisation."""
    _check(flag, src, dst)
    if bool(flag):
        dst.copy_(src)


def copy_if_ref(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The definition: every element of ``dst`` becomes ``src``'s where ``flag`` holds."""
    _check(flag, src, dst)
    torch.where(flag.view(()), src, dst, out=dst)
