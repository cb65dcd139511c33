"""Compressors on one process: conservation, exactly k, ties, the cast's overflow rule."""

import struct

import pytest
import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import gradients

import sparsecomm
from sparsecomm.compressors import Cast, Threshold, TopK


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def magnitude_key(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", abs(x)))[0]


@st.composite
def grad_and_residual(draw):
    grad = draw(gradients(max_size=3000))
    residual = draw(gradients(sizes=[grad.numel()]))
    # Keep g + r finite: huge values in both could overflow to inf in the sum.
    return grad.clamp(-1e37, 1e37).to(DEVICE), residual.clamp(-1e37, 1e37).to(DEVICE)


@given(
    pair=grad_and_residual(),
    compressor=st.one_of(
        st.floats(1e-4, 1.0).map(TopK),
        st.sampled_from([0.0, 1e-30, 0.5, 1.0, 3.0]).map(Threshold),
    ),
)
def test_sparse_conservation_is_exact(pair, compressor):
    grad, residual = pair
    expected = grad + residual
    message = compressor.compress(grad, residual, world_size=1)
    sent = message.decode()
    assert torch.equal(sent + residual, expected)
    # Sent elements leave exactly zero behind; unsent ones leave exactly themselves.
    was_sent = torch.zeros(grad.numel(), dtype=torch.bool, device=grad.device)
    was_sent[message.indices[: message.known_count()].long()] = True
    assert torch.equal(residual[was_sent], torch.zeros_like(residual[was_sent]))
    assert torch.equal(bits(residual[~was_sent]), bits(expected[~was_sent]))


@given(
    pair=grad_and_residual(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    world_size=st.sampled_from([1, 2, 3, 8]),
)
def test_cast_conservation_within_rounding(pair, dtype, world_size):
    grad, residual = pair
    expected = grad + residual
    message = Cast(dtype).compress(grad, residual, world_size)
    assert message.values.dtype == dtype
    assert torch.isfinite(message.values.float()).all()
    sent = message.decode()
    # sent + residual re-rounds once in fp32; the residual itself is a single rounding.
    torch.testing.assert_close(sent + residual, expected, rtol=2**-23, atol=0)
    # The residual is no larger than half an ulp of the half type, or the clamped excess.
    limit = Cast(dtype).limit(world_size) / message.scale
    inside = expected.abs() <= limit
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal / message.scale
    bound = expected.abs() * eps + tiny
    assert (residual.abs()[inside] <= bound[inside]).all()


def test_cast_fp16_overflow_stays_in_the_residual():
    grad = torch.tensor([1e6, -70000.0, 65504.0, 60000.0, 1.0], device=DEVICE)
    residual = torch.zeros(5, device=DEVICE)
    message = Cast(torch.float16).compress(grad, residual, world_size=2)
    assert message.scale == 0.5
    # The clamp after the prescale: the largest fp16 that two ranks can each send without
    # their sum overflowing (65472 = 2 * 32736, below 65504, however it is rounded).
    limit = Cast(torch.float16).limit(2)
    assert limit == 32736.0
    assert torch.isfinite(message.values.float()).all()
    # 60000 / 2 = 30000 is an fp16 value; the rest, beyond 2 * limit, is clamped.
    assert message.values.float().tolist() == [limit, -limit, limit, 30000.0, 0.5]
    assert residual.tolist() == [1e6 - 65472.0, -70000.0 + 65472.0, 32.0, 0.0, 0.0]


def _oracle_topk(acc: torch.Tensor, k: int) -> list[int]:
    keys = [(-magnitude_key(v), i) for i, v in enumerate(acc.tolist())]
    return sorted(i for _, i in sorted(keys)[:k])


@settings(max_examples=100)
@given(grad=gradients(max_size=2000), density=st.floats(1e-3, 1.0))
def test_topk_sends_exactly_k_largest_ties_to_lower_index(grad, density):
    grad = grad.to(DEVICE)
    compressor = TopK(density)
    k = compressor.k_for(grad.numel())
    message = compressor.compress(grad, None, world_size=1)
    assert message.count == k and message.indices.numel() == k
    assert message.indices.tolist() == _oracle_topk(grad.cpu(), k)
    assert torch.equal(bits(message.values), bits(grad[message.indices.long()]))


@pytest.mark.parametrize(
    "values,k,expected",
    [
        ([1.0] * 10, 3, [0, 1, 2]),  # all equal
        ([0.0, -0.0, 0.0, -0.0], 2, [0, 1]),  # signed zeros tie
        ([-2.0, 2.0, -2.0, 1.0], 2, [0, 1]),  # sign does not matter
        ([1e-45, 0.0, -1e-45, 1e-44], 2, [0, 3]),  # denormals order by magnitude
        ([1.0, float("inf"), -float("inf"), 3.0], 3, [1, 2, 3]),
    ],
)
def test_topk_ties_and_edge_values(values, k, expected):
    grad = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    message = TopK(k / len(values)).compress(grad, None, world_size=1)
    assert message.indices.tolist() == expected


@pytest.mark.parametrize(
    "density,numel,k",
    [
        (0.07, 100, 7),
        (0.01, 100, 1),
        (0.01, 101, 2),
        (1e-9, 10, 1),
        (1.0, 123457, 123457),
        (0.001, 1_000_000, 1000),
        (0.3, 10, 3),
    ],
)
def test_k_is_ceil_of_density_times_numel_as_written(density, numel, k):
    assert TopK(density).k_for(numel) == k


def test_compressors_compare_and_print_by_value():
    assert TopK(0.01) == TopK(0.01) and TopK(0.01) != TopK(0.02)
    assert repr(sparsecomm.Threshold(1e-3)) == "Threshold(threshold=0.001)"
    assert repr(sparsecomm.Cast(torch.bfloat16)) == "Cast(dtype=torch.bfloat16)"
    assert repr(sparsecomm.Dense()) == "Dense()"


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (a multiply by 1.0 on a GPU
    returns the canonical NaN: payloads are not part of the contract)."""
    both_nan = actual.isnan() & expected.isnan()
    return bool(((bits(actual) == bits(expected)) | both_nan).all())


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize(
    "compressor",
    [
        sparsecomm.Dense(),
        Cast(torch.float16),
        Cast(torch.bfloat16),
        TopK(0.01),
        TopK(0.9),
        Threshold(0.5),
    ],  # fmt: skip
    ids=repr,
)
def test_finish_with_skip_keeps_out_or_writes_the_average(world_size, compressor):
    # skip, read on the device: True leaves out's bits (-0.0; NaN stays NaN) as they were;
    # False writes exactly what finish without skip writes. At W = 3 the mean is a multiply
    # (an Exchange holding the summed result, as the collective leaves it); TopK(0.9) at
    # W = 3 switches to a dense all-reduce.
    from sparsecomm._comm import Communicator
    from sparsecomm.compressors import Exchange

    comm = Communicator()
    comm.world_size = world_size  # what the sum of W ranks looks like, on one process
    gen = torch.Generator().manual_seed(world_size)
    numel = 1000
    grad = torch.randn(numel, generator=gen).to(DEVICE)
    residual = torch.randn(numel, generator=gen).to(DEVICE)
    message = compressor.compress(grad, residual, world_size)
    if world_size == 1:
        exchange = lambda: compressor.start(message, comm)  # noqa: E731
    elif message.indices is None or message.known_count() * world_size >= numel:
        values = message.values if message.indices is None else message.decode()
        exchange = lambda: Exchange(message, None, values * world_size, comm, dense=True)  # noqa: E731
    else:
        count = message.known_count()
        row = torch.cat([message.indices[:count], message.values[:count].view(torch.int32)])
        gathered = row.repeat(world_size, 1)
        exchange = lambda: Exchange(message, None, gathered, comm, width=count)  # noqa: E731
    expected = compressor.finish(exchange(), torch.empty(numel, device=DEVICE))
    old = torch.randn(numel, generator=gen).to(DEVICE)
    old[0], old[1] = float("nan"), -0.0
    out = old.clone()
    compressor.finish(exchange(), out, skip=torch.tensor(True, device=DEVICE))
    assert _same_bits(out, old)
    compressor.finish(exchange(), out, skip=torch.tensor(False, device=DEVICE))
    assert _same_bits(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "values",
    [
        [1.0, -3.0, 2.0],
        [-0.0, 0.0],
        [-0.0],
        [-7.5],
        [float("nan"), 1.0],
        [1.0, float("-inf"), 2.0],
        [float("inf"), float("nan")],
        [3e38, -3.4e38, 1e-45],
    ],
    ids=repr,
)
def test_message_peak_is_the_largest_magnitude_over_the_sum_limit(values, dtype):
    # A CPU computes max |values| with aminmax, CUDA with the infinity norm: either must
    # give the infinity norm's bits, NaN where a value is NaN. (The divide stays on the
    # device: CUDA divides by a scalar through its reciprocal, a CPU does not.)
    from sparsecomm.compressors import Message, sum_limit

    tensor = torch.tensor(values).to(dtype).to(DEVICE)
    for world_size in (1, 3):
        peak = Message(numel=tensor.numel(), values=tensor).peak(world_size)
        norm = torch.linalg.vector_norm(tensor, ord=float("inf"), dtype=torch.float32)
        expected = norm.div_(sum_limit(dtype, world_size)).cpu()
        assert peak.dtype == torch.float32 and peak.dim() == 0
        if torch.isnan(expected):
            assert torch.isnan(peak), (values, dtype, peak)
        else:
            same = torch.equal(peak.cpu().view(torch.int32), expected.view(torch.int32))
            assert same, (values, dtype, peak, expected)  # bits: +0.0 is not -0.0


@pytest.mark.parametrize("compressor", [Cast(torch.bfloat16), sparsecomm.Dense()], ids=repr)
def test_start_takes_the_peak_measured_with_the_message(compressor):
    # A message compressed inside a CUDA graph carries its peak (measured there); start()
    # uses it instead of measuring the values again. Without it, start() measures them.
    from sparsecomm._comm import Communicator

    grad = torch.tensor([1.0, -3.0, 2.0], device=DEVICE)
    message = compressor.compress(grad, torch.zeros_like(grad), 1)
    measured = compressor.start(message, Communicator()).peak
    assert float(measured) == pytest.approx(
        3.0 / sparsecomm.compressors.sum_limit(message.values.dtype, 1)
    )
    message = compressor.compress(grad, torch.zeros_like(grad), 1)
    message.known_peak = torch.tensor(0.25, device=DEVICE)
    assert compressor.start(message, Communicator()).peak is message.known_peak
