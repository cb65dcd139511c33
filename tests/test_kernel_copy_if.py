"""The copy decided on the device (``copy_if``) against its reference: every bit of ``dst``
is ``src``'s where the flag holds, and stays its own where it does not, on odd sizes and
on values the copy must not touch (NaN payloads, signed zeros, infinities, subnormals)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from sparsecomm.triton_kernels.copy_if import BLOCK_SIZE, copy_if, copy_if_cpu, copy_if_ref

SIZES = [1, 7, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 13]
SPECIAL = [float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-45, -3.4e38, 1.0]


def _pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    src = torch.randn(n, generator=gen)
    dst = torch.randn(n, generator=gen)
    special = torch.tensor(SPECIAL)
    src[: min(n, len(SPECIAL))] = special[:n]
    dst[-min(n, len(SPECIAL)) :] = special.flip(0)[:n]
    # A NaN with a payload of its own: a copy through arithmetic could make it canonical.
    dst.view(torch.int32)[0] = 0x7FC0_1234
    return src.to(DEVICE), dst.to(DEVICE)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("impl", [copy_if, copy_if_cpu], ids=["triton", "cpu"])
def test_copy_if_matches_the_reference_bit_for_bit(impl, flag, n):
    if impl is copy_if_cpu and DEVICE != "cpu":
        pytest.skip("the CPU path takes CPU tensors")
    src, dst = _pair(n)
    expected = dst.clone()
    copy_if_ref(torch.tensor([flag], device=DEVICE), src, expected)
    before = dst.clone()
    impl(torch.tensor([flag], device=DEVICE), src, dst)
    assert torch.equal(dst.view(torch.int32), expected.view(torch.int32))
    want = src if flag else before
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))


def test_copy_if_refuses_a_flag_that_is_not_one_bool():
    src, dst = _pair(8)
    with pytest.raises(ValueError, match="one-element bool"):
        copy_if(torch.tensor([1.0], device=DEVICE), src, dst)
    with pytest.raises(ValueError, match="must match"):
        copy_if(torch.tensor([True], device=DEVICE), src[:4], dst)
