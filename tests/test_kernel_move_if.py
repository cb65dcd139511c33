"""The move decided on the device (``move_if``) against its reference: where the flag
holds, ``dst`` gets ``src``'s bits and ``src`` becomes zeros; where it does not, both keep
their own bits. On odd sizes and on values a copy must not change (NaN payloads, signed
zeros, infinities, subnormals)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from sparsecomm.triton_kernels.move_if import BLOCK_SIZE, move_if, move_if_cpu, move_if_ref

SIZES = [1, 7, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 13]
SPECIAL = [float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-45, -3.4e38, 1.0]


def _pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    src = torch.randn(n, generator=gen)
    dst = torch.randn(n, generator=gen)
    special = torch.tensor(SPECIAL)
    src[: min(n, len(SPECIAL))] = special[:n]
    dst[-min(n, len(SPECIAL)) :] = special.flip(0)[:n]
    # NaNs with payloads of their own: a move through arithmetic could make them canonical.
    src.view(torch.int32)[-1] = 0x7FC0_4321
    dst.view(torch.int32)[0] = 0x7FC0_1234
    return src.to(DEVICE), dst.to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("with_dst", [True, False], ids=["move", "zero"])
@pytest.mark.parametrize("impl", [move_if, move_if_cpu], ids=["triton", "cpu"])
def test_move_if_matches_the_reference_bit_for_bit(impl, with_dst, flag, n):
    if impl is move_if_cpu and DEVICE != "cpu":
        pytest.skip("the CPU path takes CPU tensors")
    src, dst = _pair(n)
    want_src, want_dst = src.clone(), dst.clone()
    move_if_ref(torch.tensor([flag], device=DEVICE), want_src, want_dst if with_dst else None)
    before_src, before_dst = src.clone(), dst.clone()
    impl(torch.tensor([flag], device=DEVICE), src, dst if with_dst else None)
    assert torch.equal(_bits(src), _bits(want_src))
    assert torch.equal(_bits(dst), _bits(want_dst if with_dst else before_dst))
    # and the reference is what it says:
    assert torch.equal(_bits(src), _bits(torch.zeros_like(src) if flag else before_src))
    if with_dst:
        assert torch.equal(_bits(dst), _bits(before_src if flag else before_dst))


def test_move_if_refuses_a_flag_that_is_not_one_bool():
    src, dst = _pair(8)
    with pytest.raises(ValueError, match="one-element bool"):
        move_if(torch.tensor([1.0], device=DEVICE), src, dst)
    with pytest.raises(ValueError, match="must match"):
        move_if(torch.tensor([True], device=DEVICE), src[:4], dst)
