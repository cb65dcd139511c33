"""The Triton threshold kernel against ``threshold_compress_ref``: the same bits.

Runs in Triton's interpreter on CPU tensors without a GPU (conftest sets TRITON_INTERPRET),
on the GPU when there is one; tests marked ``gpu`` need CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from sparsecomm.triton_kernels.threshold import (
    BLOCK_SIZE,
    threshold_compress,
    threshold_compress_ref,
)
from strategies import gradients

# numpy (the interpreter's arithmetic) warns where float32 overflows, as meant.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

THRESHOLDS = [0.0, 1e-45, 1e-8, 0.5, 1.0, 2.0, 65504.0, 3.4028235e38, math.inf]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality, except that any NaN matches any NaN (payloads are not part of it)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.dtype.is_floating_point:
        both_nan = actual.isnan() & expected.isnan()
        bits = {4: torch.int32, 2: torch.int16}[actual.element_size()]
        differ = (actual.view(bits) != expected.view(bits)) & ~both_nan
    else:
        differ = actual != expected
    if differ.any():
        where = differ.nonzero().flatten()[:10].tolist()
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} elements differ, first at "
            f"{where}: got {actual[where].tolist()}, expected {expected[where].tolist()}"
        )


def check_against_ref(grad: torch.Tensor, residual: torch.Tensor | None, threshold: float):
    kernel_residual = None if residual is None else residual.clone()
    ref_residual = None if residual is None else residual.clone()
    grad_before = grad.clone()
    indices, values, count = threshold_compress(grad, kernel_residual, threshold)
    ref_indices, ref_values, ref_count = threshold_compress_ref(grad, ref_residual, threshold)
    assert count.dtype == torch.int64 and count.dim() == 0 and count.device == grad.device
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    assert int(count) == int(ref_count), f"count {int(count)} != {int(ref_count)}"
    assert indices.numel() >= int(count) and values.numel() >= int(count)
    assert_same_bits(indices[: int(count)], ref_indices, "indices")
    assert_same_bits(values[: int(count)], ref_values, "values")
    if residual is not None:
        assert_same_bits(kernel_residual, ref_residual, "residual")
    assert_same_bits(grad, grad_before, "grad (must not change)")
    return indices[: int(count)], values[: int(count)], kernel_residual


@st.composite
def threshold_cases(draw, max_size: int = 5000):
    grad = draw(gradients(max_size=max_size))
    residual = draw(st.one_of(st.none(), gradients(sizes=[grad.numel()])))
    acc = grad if residual is None else grad + residual
    # Either a fixed threshold, or the magnitude of one element, so that ties with the
    # threshold itself occur.
    threshold = draw(
        st.one_of(
            st.sampled_from(THRESHOLDS),
            st.integers(0, grad.numel() - 1).map(lambda i: float(acc[i].abs())),
        )
    )
    if not math.isfinite(threshold) and threshold != math.inf:
        threshold = 0.0
    return grad.to(DEVICE), None if residual is None else residual.to(DEVICE), threshold


@given(threshold_cases())
def test_matches_reference(case):
    grad, residual, threshold = case
    check_against_ref(grad, residual, threshold)


@pytest.mark.parametrize(
    "n", [1, 2, 7, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]
)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_block_boundaries(n, density):
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen)
    residual = torch.randn(n, generator=gen)
    keep = torch.rand(n, generator=gen) < density
    # Push the chosen elements above 10, the others below: the density is what was asked.
    grad = torch.where(keep, grad.sign() * 20.0, grad * 0.1)
    residual = residual * 0.1
    indices, _, _ = check_against_ref(grad.to(DEVICE), residual.to(DEVICE), 10.0)
    assert indices.cpu().tolist() == keep.nonzero().flatten().tolist()


def test_special_values():
    nan, inf = math.nan, math.inf
    grad = torch.tensor([nan, -0.0, 0.0, inf, -inf, 1.0, -1.0, 1e-45, -3.4028235e38, 5.0])
    residual = torch.tensor([1.0, -0.0, -0.0, 1.0, 0.0, nan, -1.0, 0.0, -3.4028235e38, -5.0])
    for threshold in [0.0, 1.0, 3.4028235e38, inf]:
        indices, values, new_residual = check_against_ref(
            grad.to(DEVICE), residual.to(DEVICE), threshold
        )
        # NaN is always sent, so nothing of it stays in the residual.
        assert {0, 5} <= set(indices.tolist())
        assert values[indices.tolist().index(0)].isnan()
        assert new_residual[0] == 0 and new_residual[5] == 0
    indices, values, _ = check_against_ref(grad.to(DEVICE), residual.to(DEVICE), inf)
    # Only the infinities (-3.4e38 twice overflows to -inf) and the NaNs reach an infinite
    # threshold.
    assert indices.tolist() == [0, 3, 4, 5, 8]


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_non_finite_is_always_sent(threshold):
    # A non-finite acc always shows in the message, whatever the threshold: NaN fails
    # `abs(acc) < t` as inf does.
    nan, inf = math.nan, math.inf
    grad = torch.tensor([nan, 1.0, -nan, inf, 0.5, -inf, 2.0, 3.4028235e38], device=DEVICE)
    residual = torch.tensor([0.0, nan, 0.0, -1.0, 0.0, 0.0, -2.0, 3.4028235e38], device=DEVICE)
    indices, _, new_residual = check_against_ref(grad, residual, threshold)
    assert {0, 1, 2, 3, 5, 7} <= set(indices.tolist())
    assert not new_residual.isnan().any() and new_residual.isfinite().all()
    indices, _, _ = check_against_ref(grad, None, threshold)
    assert {0, 2, 3, 5} <= set(indices.tolist())


def test_negative_zero_is_sent_at_threshold_zero():
    grad = torch.tensor([-0.0, 0.0, -0.0], device=DEVICE)
    residual = torch.tensor([-0.0, -0.0, 0.0], device=DEVICE)
    indices, values, new_residual = check_against_ref(grad, residual, 0.0)
    assert indices.tolist() == [0, 1, 2]
    assert values.view(torch.int32).tolist() == [-(2**31), 0, 0]  # -0.0 + -0.0 = -0.0
    assert new_residual.view(torch.int32).tolist() == [0, 0, 0]  # +0.0 where sent


def test_threshold_rounds_to_float32_like_torch():
    # 1 + 1e-8 rounds to 1.0 in float32, and torch compares in float32: 1.0 is sent.
    grad = torch.tensor([1.0, 0.99999994, 1.0000001], device=DEVICE)
    indices, _, _ = check_against_ref(grad, torch.zeros_like(grad), 1.00000001)
    assert indices.tolist() == [0, 2]
    # Beyond float32's range the threshold is inf.
    grad = torch.tensor([math.inf, 3.4028235e38], device=DEVICE)
    indices, _, _ = check_against_ref(grad, None, 1e39)
    assert indices.tolist() == [0]


def test_without_residual_and_constant_input():
    grad = torch.full((BLOCK_SIZE + 3,), -3.0, device=DEVICE)
    indices, values, _ = check_against_ref(grad, None, 3.0)
    assert indices.numel() == grad.numel()
    check_against_ref(grad, None, 3.0000002)


def test_empty():
    grad = torch.empty(0, device=DEVICE)
    residual = torch.empty(0, device=DEVICE)
    indices, values, count = threshold_compress(grad, residual, 1.0)
    assert int(count) == 0 and count.dim() == 0 and count.dtype == torch.int64
    assert indices.dtype == torch.int32 and values.dtype == torch.float32


BAD_ARGUMENTS = [
    ((torch.zeros(2, 2), None, 1.0), ValueError, "1-D contiguous float32"),
    ((torch.zeros(4, dtype=torch.float64), None, 1.0), TypeError, "1-D contiguous float32"),
    ((torch.zeros(4), torch.zeros(5), 1.0), ValueError, "residual must be"),
    ((torch.zeros(4), torch.zeros(4, dtype=torch.float16), 1.0), TypeError, "residual must be"),
    ((torch.zeros(4), [0.0] * 4, 1.0), TypeError, "residual must be"),
    ((torch.zeros(4), None, -1.0), ValueError, "threshold must be a float >= 0"),
    ((torch.zeros(4), None, math.nan), ValueError, "threshold must be a float >= 0"),
    ((torch.zeros(4), None, "1.0"), TypeError, "threshold must be a float >= 0"),
    ((torch.zeros(4), None, None), TypeError, "threshold must be a float >= 0"),
    (([0.0, 1.0], None, 1.0), TypeError, "grad must be a torch.Tensor"),
]


@pytest.mark.parametrize("args, error, message", BAD_ARGUMENTS)
def test_bad_arguments(args, error, message):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=message):
        threshold_compress(*args)


def test_non_contiguous():
    grad = torch.zeros(8, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="1-D contiguous float32"):
        threshold_compress(grad, None, 1.0)
    with pytest.raises(ValueError, match="residual must be"):
        threshold_compress(grad.contiguous(), torch.zeros(8, device=DEVICE)[::2], 1.0)


@pytest.mark.gpu
@needs_cuda
def test_residual_on_another_device():
    with pytest.raises(ValueError, match="residual must be"):
        threshold_compress(torch.zeros(4, device="cuda"), torch.zeros(4), 1.0)


@pytest.mark.gpu
@needs_cuda
def test_no_host_synchronisation():
    grad = torch.randn(100_000, device="cuda")
    residual = torch.randn(100_000, device="cuda")
    threshold_compress(grad, residual, 1.0)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        threshold_compress(grad, residual, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [10**8, 10**8 + 3])
def test_large_gpu_bit_exact(n):
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(n, device="cuda", generator=gen)
    residual = torch.randn(n, device="cuda", generator=gen)
    grad[::1_000_003] = math.nan
    grad[1::999_983] = -0.0
    # |g + r| ~ N(0, 2): about 1% of the elements pass 3.64.
    check_against_ref(grad, residual, 3.64)
    check_against_ref(grad, None, 0.0)
