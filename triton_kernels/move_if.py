"""Work decided by a flag on the device, without the host reading the flag: where the
one-element bool ``flag`` holds True, ``src`` is copied into ``dst`` (if given) and then
zeroed; where it holds False, nothing happens.

``CompressedOptimizer`` uses it when it steps a fused Adam before the host knows whether
the ranks refused the step (``docs/step_ahead.md``). On a refused step each bucket's old
residual moves to where the new one would go, and the buffer behind ``.grad`` is zeroed,
so that whatever writes through ``.grad`` before the verdict reaches no residual. An
accepted step moves no data: each program reads the flag and exits, where
``torch.where(flag, ...)`` would read and write every element every step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program: large, because the usual program reads its flag and exits.
BLOCK_SIZE = 8192
NUM_WARPS = 8


@triton.jit
def _move_if_kernel(flag_ptr, src_ptr, dst_ptr, n, HAS_DST: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    if tl.load(flag_ptr).to(tl.int32) != 0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_bounds = offsets < n
        if HAS_DST:
            values = tl.load(src_ptr + offsets, mask=in_bounds)
            tl.store(dst_ptr + offsets, values, mask=in_bounds)
        zeros = tl.zeros([BLOCK_SIZE], src_ptr.dtype.element_ty)
        tl.store(src_ptr + offsets, zeros, mask=in_bounds)


def check_move_args(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``flag`` is one bool on ``src``'s device and ``dst`` (if
    given) matches ``src``; both contiguous."""
    if flag.dtype != torch.bool or flag.numel() != 1 or flag.device != src.device:
        raise ValueError(
            f"flag must be a one-element bool tensor on {src.device}, got "
            f"{flag.numel()} element(s) of {flag.dtype} on {flag.device}"
        )
    if dst is not None and (
        src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device
    ):
        raise ValueError(
            f"src and dst must match: got {tuple(src.shape)} {src.dtype} on {src.device} "
            f"and {tuple(dst.shape)} {dst.dtype} on {dst.device}"
        )
    if not src.is_contiguous() or (dst is not None and not dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")


def move_if(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor | None = None) -> None:
    """Where ``flag`` holds True: ``dst.copy_(src)`` (if ``dst`` is given), then
    ``src.zero_()``; decided on the device: one launch, no host synchronisation."""
    check_move_args(flag, src, dst)
    n = src.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _move_if_kernel[grid](
        flag.view(torch.uint8), src, src if dst is None else dst, n, HAS_DST=dst is not None,
        BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS,
    )  # fmt: skip


def move_if_cpu(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor | None = None) -> None:
    """:func:`move_if` on the CPU, where reading the flag costs no synchronisation."""
    check_move_args(flag, src, dst)
    if bool(flag):
        if dst is not None:
            dst.copy_(src)
        src.zero_()


def move_if_ref(flag: torch.Tensor, src: torch.Tensor, dst: torch.Tensor | None = None) -> None:
    """The definition, element by element: selects, read and written everywhere."""
    check_move_args(flag, src, dst)
    keep = flag.view(())
    if dst is not None:
        torch.where(keep, src, dst, out=dst)
    torch.where(keep, torch.zeros((), dtype=src.dtype, device=src.device), src, out=src)
