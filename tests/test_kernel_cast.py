"""The Triton cast kernel against ``cast_compress_ref``.

fp16 must match bit for bit everywhere. bf16 matches bit for bit on the GPU. Triton's
interpreter casts fp32 to bf16 by truncation instead of rounding to nearest even, so there
bf16 may be one unit in the last place off, and the residual is checked against the kernel's
own bf16 value instead; the interpreter also mangles fp32 subnormals on the way to and from
bf16 (triton/runtime/interpreter.py, ``_convert_float``), so there those elements are left out.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from sparsecomm.triton_kernels import _indirect
from sparsecomm.triton_kernels.cast import (
    BLOCK_SIZE,
    cast_compress,
    cast_compress_cpu,
    cast_compress_ref,
    round_pairs,
    round_pairs_ref,
)
from strategies import gradients

import sparsecomm

# numpy (the interpreter's arithmetic) warns where float32 overflows or makes NaN, as meant.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALES = [1.0, 0.5, 0.125, 2.0**-10, 4.0]
NAN, INF = math.nan, math.inf


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str, ulps: int = 0):
    """Equal bits (or within ``ulps`` units in the last place); any NaN matches any NaN."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    both_nan = actual.isnan() & expected.isnan()
    bits = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    # Adjacent floats of one sign have adjacent bit patterns, so the integer difference
    # counts units in the last place.
    distance = (actual.view(bits).long() - expected.view(bits).long()).abs()
    differ = (distance > ulps) & ~both_nan
    if differ.any():
        where = differ.nonzero().flatten()[:10].tolist()
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} elements differ by more than "
            f"{ulps} ulp, first at {where}: got {actual[where].tolist()}, expected "
            f"{expected[where].tolist()}"
        )


def check_against_ref(grad, residual, dtype, scale):
    kernel_residual = None if residual is None else residual.clone()
    ref_residual = None if residual is None else residual.clone()
    half = cast_compress(grad, kernel_residual, dtype, scale)
    ref_half = cast_compress_ref(grad, ref_residual, dtype, scale)
    exact = dtype == torch.float16 or not INTERPRETED
    if exact:
        assert_same_bits(half, ref_half, f"{dtype} values")
        if residual is not None:
            assert_same_bits(kernel_residual, ref_residual, "residual")
        return half, kernel_residual
    acc = grad if residual is None else grad + residual
    scaled = (acc * scale).abs()
    checked = ~((scaled > 0) & (scaled < torch.finfo(torch.float32).tiny))
    assert_same_bits(half[checked], ref_half[checked], f"{dtype} values", ulps=1)
    if residual is not None:
        # The residual of the kernel's own bf16 value, computed as the reference does.
        expected = (acc - half.float() * (1.0 / scale)).masked_fill(acc.isinf(), 0.0)
        assert_same_bits(kernel_residual[checked], expected[checked], "residual")
    return half, kernel_residual


@given(
    grad=gradients(),
    with_residual=st.booleans(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    scale=st.sampled_from(SCALES),
    data=st.data(),
)
def test_matches_reference(grad, with_residual, dtype, scale, data):
    residual = data.draw(gradients(sizes=[grad.numel()])) if with_residual else None
    grad = grad.to(DEVICE)
    residual = None if residual is None else residual.to(DEVICE)
    check_against_ref(grad, residual, dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
def test_overflow_nan_and_signed_zero(dtype, scale):
    limit = torch.finfo(dtype).max
    values = [
        NAN,
        INF,
        -INF,
        -0.0,
        0.0,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        1e6,
        -1e6,
        limit,
        2 * limit,
        -3.4028235e38,
        1e-45,
        -1e-45,
        5.96e-8,
        2.98e-8,
        1e-3,
        -1.0,
    ]
    grad = torch.tensor(values, device=DEVICE)
    residual = torch.full_like(grad, -0.0)  # so that -0.0 stays -0.0
    half, new_residual = check_against_ref(grad, residual, dtype, scale)
    assert half[0].isnan() and new_residual[0].isnan(), "NaN must pass through as NaN"
    # An infinite acc goes out as the half type's infinity and leaves nothing behind; no
    # finite acc becomes infinite: the clamp keeps the largest finite value (2 * limit is
    # inf in float32 for bf16, so it is an infinite acc there).
    infinite = grad.isinf()
    assert half[1] == INF and half[2] == -INF
    assert torch.equal(half[1:].isinf(), infinite[1:])
    assert torch.equal(half[infinite].sign(), grad[infinite].sign().to(dtype))
    assert (new_residual[infinite] == 0).all()
    if dtype == torch.float16 and scale >= 1.0:  # 1e6 and -1e6 beyond fp16's range
        assert half[9] == limit and half[10] == -limit
    assert half[13] == -limit or scale < 1.0  # -3.4e38, finite: clamped
    assert half[3].item() == 0.0 and math.copysign(1.0, half[3].item()) == -1.0
    check_against_ref(grad, None, dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_infinite_acc_is_sent_and_finite_overflow_is_clamped(dtype):
    limit = torch.finfo(dtype).max
    # acc: inf from grad, -inf from residual, inf from a float32 overflow of the add, and
    # finite values beyond the half range (scaled by 4 to beyond float32 too).
    grad = torch.tensor([INF, 1.0, 3e38, 3e38, -3e38, 1e6, NAN], device=DEVICE)
    residual = torch.tensor([1.0, -INF, 3e38, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    for scale in [1.0, 4.0, 0.125]:
        half, new_residual = check_against_ref(grad, residual.clone(), dtype, scale)
        assert half[:3].tolist() == [INF, -INF, INF]
        assert new_residual[:3].tolist() == [0.0, 0.0, 0.0]
        assert half[3:6].isfinite().all() and half[6].isnan() and new_residual[6].isnan()
        if scale == 4.0:  # 3e38 * 4 overflows float32, yet acc is finite: clamped
            assert half[3:5].tolist() == [limit, -limit]
            assert new_residual[3] == 3e38 - limit / 4  # the excess stays behind


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 7, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1])
def test_sizes(dtype, n):
    gen = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=gen) * 100).to(DEVICE)
    residual = (torch.randn(n, generator=gen) * 1e-3).to(DEVICE)
    check_against_ref(grad, residual, dtype, 0.25)


def test_round_to_nearest_even_fp16():
    # 1 + 2**-11 lies halfway between 1 and 1 + 2**-10: even is 1. 1 + 3 * 2**-11 rounds up.
    grad = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11)], device=DEVICE)
    half, residual = check_against_ref(grad, torch.zeros_like(grad), torch.float16, 1.0)
    assert half.tolist() == [1.0, 1 + 2.0**-9, -1.0]
    assert residual.tolist() == [2.0**-11, -(2.0**-11), -(2.0**-11)]


def test_empty():
    grad = torch.empty(0, device=DEVICE)
    half = cast_compress(grad, torch.empty(0, device=DEVICE), torch.float16)
    assert half.shape == (0,) and half.dtype == torch.float16


BAD_ARGUMENTS = [
    ((torch.zeros(4), None, torch.float32, 1.0), TypeError, "dtype must be"),
    ((torch.zeros(4), None, torch.float16, 3.0), ValueError, "scale must be a positive power"),
    ((torch.zeros(4), None, torch.float16, -0.5), ValueError, "scale must be a positive power"),
    ((torch.zeros(4), None, torch.float16, "1"), TypeError, "scale must be a positive power"),
    ((torch.zeros(2, 2), None, torch.float16, 1.0), ValueError, "1-D contiguous float32"),
    (
        (torch.zeros(4, dtype=torch.float16), None, torch.float16, 1.0),
        TypeError,
        "1-D contiguous float32",
    ),
    ((torch.zeros(4), torch.zeros(3), torch.float16, 1.0), ValueError, "residual must be"),
    (([0.0] * 4, None, torch.float16, 1.0), TypeError, "grad must be a torch.Tensor"),
    ((torch.zeros(4), None, torch.float16, 1.0, 0.0), ValueError, "limit must be a positive"),
    ((torch.zeros(4), None, torch.float16, 1.0, 7e4), ValueError, "limit must be a positive"),
    ((torch.zeros(4), None, torch.float16, 1.0, 1000.1), ValueError, "limit must be a positive"),
    ((torch.zeros(4), None, torch.float16, 1.0, "9"), TypeError, "limit must be a float"),
]


@pytest.mark.parametrize("args, error, message", BAD_ARGUMENTS)
def test_bad_arguments(args, error, message):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=message):
        cast_compress(*args)


@pytest.mark.gpu
@needs_cuda
def test_no_host_synchronisation():
    grad = torch.randn(100_000, device="cuda")
    residual = torch.randn(100_000, device="cuda")
    cast_compress(grad, residual, torch.float16, 0.125)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cast_compress(grad, residual, torch.float16, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_gpu_bit_exact(dtype):
    n = 10**8 + 3
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(n, device="cuda", generator=gen) * 3e4
    residual = torch.randn(n, device="cuda", generator=gen)
    grad[::1_000_003] = NAN
    grad[1::999_983] = -0.0
    grad[2::999_979] = 1e9
    for scale in [1.0, 0.125]:
        check_against_ref(grad, residual, dtype, scale)
    check_against_ref(grad, None, dtype, 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_clamp_limit_matches_reference_and_keeps_the_excess(dtype, world_size):
    # The clamp Cast uses so that a sum of world_size casts stays finite.
    compressor = sparsecomm.Cast(dtype)
    scale, limit = compressor.prescale(world_size), compressor.limit(world_size)
    big = limit / scale
    over = min(2 * big, torch.finfo(torch.float32).max)  # finite in float32, beyond the clamp
    grad = torch.tensor([0.5, big, -big, over, -over, INF, NAN, 1e-3, -0.0, 0.0])
    residual = torch.linspace(-1, 1, grad.numel())
    # Triton's interpreter rounds to bf16 its own way (see check_against_ref): bf16 bit
    # equality of the Triton kernel is checked on the GPU.
    exact_triton = dtype == torch.float16 or not INTERPRETED
    impls = [(cast_compress_cpu, "cpu")] + ([(cast_compress, DEVICE)] if exact_triton else [])
    for impl, device in impls:
        kernel_residual, ref_residual = residual.clone().to(device), residual.clone()
        half = impl(grad.to(device), kernel_residual, dtype, scale, limit).cpu()
        ref_half = cast_compress_ref(grad, ref_residual, dtype, scale, limit)
        assert_same_bits(half, ref_half, f"{impl.__name__} values")
        assert_same_bits(kernel_residual.cpu(), ref_residual, f"{impl.__name__} residual")
    if over * scale > limit:  # (for bf16 at W = 3 no finite float32 reaches the clamp)
        assert ref_half[3].item() == limit and ref_half[4].item() == -limit
        acc = grad + residual
        assert ref_residual[3].item() == pytest.approx(acc[3].item() - limit / scale, rel=1e-6)
    # world_size copies of the clamp, added one by one in the half type, stay finite.
    total = torch.zeros((), dtype=dtype)
    for _ in range(world_size):
        total = total + torch.tensor(limit, dtype=dtype)
    assert torch.isfinite(total)


@pytest.mark.parametrize("impl", [cast_compress, cast_compress_cpu, cast_compress_ref])
def test_out_is_written_and_checked(impl):
    device = "cpu" if impl is not cast_compress else DEVICE
    grad = torch.linspace(-3, 3, 1001, device=device)
    expected = cast_compress_ref(grad.cpu(), None, torch.float16, 0.5)
    out = torch.full((1001,), 7.0, dtype=torch.float16, device=device)
    assert impl(grad, None, torch.float16, 0.5, None, out) is out
    assert_same_bits(out.cpu(), expected, "out")
    with pytest.raises(ValueError, match="out must be a 1-D torch.float16 tensor of 1001"):
        impl(grad, None, torch.float16, 0.5, None, out[:-1])
    with pytest.raises(ValueError, match="out must be"):
        impl(grad, None, torch.float16, 0.5, None, out.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n", [1, 7, BLOCK_SIZE + 1])
def test_through_addresses_gives_the_direct_bits(dtype, with_residual, n):
    """With ``addresses`` the kernel reads and writes the buffers the table names, not the
    (decoy) tensors it is passed, and computes the same bits as a direct call."""
    gen = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=gen) * 1e3).to(DEVICE)
    grad[0] = NAN
    residual = torch.randn(n, generator=gen).to(DEVICE) if with_residual else None
    direct_residual = None if residual is None else residual.clone()
    direct = cast_compress(grad, direct_residual, dtype, 0.5, None)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    decoy_grad = torch.full_like(grad, INF)
    decoy_residual = None if residual is None else torch.full_like(grad, INF)
    decoy_out = torch.zeros(n, dtype=dtype, device=DEVICE)
    table = _indirect.table(grad.device, grad, residual, out)
    returned = cast_compress(
        decoy_grad, decoy_residual, dtype, 0.5, None, decoy_out, addresses=table
    )
    assert returned is decoy_out and not decoy_out.any()  # the decoys are not touched
    assert decoy_grad.isinf().all()
    assert decoy_residual is None or decoy_residual.isinf().all()
    assert torch.equal(out.view(torch.int16), direct.view(torch.int16))
    if residual is not None:
        assert torch.equal(residual.view(torch.int32), direct_residual.view(torch.int32))
    with pytest.raises(ValueError, match="takes out="):
        cast_compress(grad, None, dtype, 0.5, None, None, addresses=table)


# ---- round_pairs: a sparse message's values rounded to 16 bits, the error into the residual


def check_round_pairs(values, indices, residual, dtype):
    """The kernel against ``round_pairs_ref``: the same bits (in the interpreter, bf16 within
    one unit and the residual that of the kernel's own value); returns the kernel's values
    and residual."""
    got_values, want_values = values.clone(), values.clone()
    got_residual = None if residual is None else residual.clone()
    want_residual = None if residual is None else residual.clone()
    round_pairs(got_values, indices, got_residual, dtype)
    round_pairs_ref(want_values, indices, want_residual, dtype)
    if dtype == torch.float16 or not INTERPRETED:
        assert_same_bits(got_values, want_values, "values")
        if residual is not None:
            assert_same_bits(got_residual, want_residual, "residual")
        return got_values, got_residual
    checked = ~((values.abs() > 0) & (values.abs() < torch.finfo(torch.float32).tiny))
    assert_same_bits(got_values.to(dtype)[checked], want_values.to(dtype)[checked], "values", 1)
    if residual is not None:
        finite = values.isfinite()
        expected = residual.clone()
        expected[indices.long()] = torch.where(finite, values - got_values, 0.0)
        untouched = torch.ones_like(residual, dtype=torch.bool)
        untouched[indices.long()[~checked]] = False
        assert_same_bits(got_residual[untouched], expected[untouched], "residual")
    return got_values, got_residual


@given(
    values=gradients(max_size=3000),
    with_residual=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_round_pairs_matches_reference(values, with_residual, dtype, index_dtype, data):
    count = values.numel()
    numel = count + data.draw(st.integers(0, 3 * count))
    seed = data.draw(st.integers(0, 2**31 - 1))
    order = torch.randperm(numel, generator=torch.Generator().manual_seed(seed))
    indices = order[:count].to(index_dtype).to(DEVICE)
    residual = data.draw(gradients(sizes=[numel])).to(DEVICE) if with_residual else None
    values = values.to(DEVICE)
    got_values, got_residual = check_round_pairs(values, indices, residual, dtype)
    # Every value sent is one the 16-bit type carries, and (bfloat16, float32's exponent
    # range) nothing is lost: a finite value's rounding error is in the residual, exactly.
    assert torch.equal(got_values.to(dtype).float().nan_to_num(), got_values.nan_to_num())
    if got_residual is not None and dtype == torch.bfloat16:
        finite = values.isfinite()
        left = got_residual[indices.long()]
        assert torch.equal((got_values + left)[finite], values[finite])
        assert (left[~finite] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_pairs_adversarial_values(dtype):
    largest = torch.finfo(dtype).max
    one_ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    values = torch.tensor(
        [NAN, INF, -INF, -0.0, 0.0, 3.4028235e38, -3.4028235e38, largest, 1.0 + one_ulp / 2,
         1.0 + 3 * one_ulp / 2, -(1.0 + one_ulp / 2), 1e-3, -123.456, 1e-45],
        device=DEVICE,
    )  # fmt: skip
    indices = torch.arange(values.numel() - 1, -1, -1, dtype=torch.int32, device=DEVICE)
    residual = torch.full((values.numel() + 2,), 7.0, device=DEVICE)
    got, full = check_round_pairs(values, indices, residual, dtype)
    left = full[indices.long()]
    assert got[0].isnan() and got[1] == INF and got[2] == -INF  # travel as they are
    assert (left[:3] == 0).all()
    assert math.copysign(1.0, got[3].item()) == -1.0 and got[4] == 0.0
    assert got[5] == largest and got[6] == -largest  # finite: clamped, the excess kept
    big = torch.tensor(3.4028235e38)
    assert left[5].cpu() == big - largest and got[7] == largest and left[7] == 0
    if not (INTERPRETED and dtype == torch.bfloat16):  # (the interpreter truncates bf16)
        assert got[8:11].tolist() == [1.0, 1.0 + 2 * one_ulp, -1.0]  # ties to even
    assert (full[values.numel() :] == 7.0).all()  # written at the indices only


def test_round_pairs_without_residual_and_empty():
    values = torch.tensor([1.0 + 2.0**-9, -2.5], device=DEVICE)
    round_pairs(values, torch.tensor([0, 1], device=DEVICE), None)
    assert values.to(torch.bfloat16).float().tolist() == values.tolist()
    round_pairs(torch.empty(0, device=DEVICE), torch.empty(0, dtype=torch.int64), None)


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int32), None),
         TypeError, "values must be a 1-D float32"),
        ((torch.zeros(2), torch.zeros(3, dtype=torch.int32), None), ValueError, "indices must"),
        ((torch.zeros(2), torch.zeros(2), None), ValueError, "indices must"),
        ((torch.zeros(2), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.float16)),
         TypeError, "residual must be float32"),
        ((torch.zeros(2), torch.zeros(2, dtype=torch.int32), None, torch.float32),
         TypeError, "dtype must be"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("impl", [round_pairs, round_pairs_ref])
def test_round_pairs_bad_arguments(impl, args, error, message):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=message):
        impl(*args)


@pytest.mark.gpu
@needs_cuda
def test_round_pairs_large_gpu_bit_exact_without_host_synchronisation():
    gen = torch.Generator(device="cuda").manual_seed(3)
    numel, count = 10**7 + 3, 10**5 + 7
    values = torch.randn(count, device="cuda", generator=gen) * 1e3
    indices = torch.randperm(numel, device="cuda", generator=gen)[:count].int()
    residual = torch.randn(numel, device="cuda", generator=gen)
    check_round_pairs(values, indices, residual, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_pairs(values.clone(), indices, residual, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
