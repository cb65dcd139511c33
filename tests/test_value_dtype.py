"""TopK(value_dtype=torch.bfloat16): 6-byte pairs, the rounding kept in the residual.

The multi-rank contract (ranks identical, the average bit for bit, resume, the DDP hook)
runs this compressor in test_distributed.py and test_overlap.py beside the others."""

import _workers
import pytest
import torch
from _dist import run_ranks
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from strategies import gradients

import sparsecomm
from sparsecomm.compressors import TopK

BF16 = torch.bfloat16
LARGEST = torch.finfo(BF16).max


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def sent_of(message) -> tuple[torch.Tensor, torch.Tensor]:
    count = message.known_count()
    return message.indices[:count].long(), message.values[:count]


@st.composite
def grad_and_residual(draw):
    grad = draw(gradients(max_size=3000))
    residual = draw(gradients(sizes=[grad.numel()]))
    return grad.clamp(-1e37, 1e37).to(DEVICE), residual.clamp(-1e37, 1e37).to(DEVICE)


@given(pair=grad_and_residual(), density=st.floats(1e-4, 1.0), accumulated=st.booleans())
def test_rounded_values_conserve_exactly(pair, density, accumulated):
    grad, residual = pair
    expected = grad + residual
    ours, theirs = TopK(density, value_dtype=BF16), TopK(density)
    reference = theirs.compress(grad.clone(), residual.clone(), world_size=1)
    if accumulated:
        acc = expected.clone()
        message = ours.compress_accumulated(acc, world_size=1)
        residual = acc
    else:
        message = ours.compress(grad, residual, world_size=1)
    index, values = sent_of(message)
    # The same elements as float32 values would send, each rounded to nearest bfloat16.
    assert torch.equal(index, reference.indices.long())
    assert torch.equal(bits(values), bits(reference.values.to(BF16).float()))
    # What rounding took off is in the residual: sent + residual is the sum, bit for bit.
    assert torch.equal(message.decode() + residual, expected)
    assert torch.equal(residual[index] + values, expected[index])
    # Half an ulp of bfloat16 at most: 2**-8 of the value sent, or half of bfloat16's
    # smallest subnormal (2**-133) where the value is that small.
    bound = torch.clamp(values.abs() * 2.0**-8, min=2.0**-134)
    assert bool((residual[index].abs() <= bound).all())


def test_huge_values_are_clamped_and_non_finite_ones_travel_as_they_are():
    big = 3.4e38  # finite in float32, above bfloat16's largest (3.3895e38)
    grad = torch.tensor([big, -big, float("inf"), float("nan"), 1.0, 0.5], device=DEVICE)
    residual = torch.zeros_like(grad)
    message = TopK(4 / 6, value_dtype=BF16).compress(grad, residual, world_size=1)
    index, values = sent_of(message)
    assert index.tolist() == [0, 1, 2, 3]  # NaN and Inf are chosen first, then magnitudes
    assert values[:2].tolist() == [LARGEST, -LARGEST]
    assert values[2].item() == float("inf") and values[3].isnan()
    excess = grad[0] - LARGEST  # in float32, exact (Sterbenz): nothing overflows
    assert residual[:2].tolist() == [excess.item(), -excess.item()] and excess > 0
    assert torch.equal(residual[:2] + values[:2], grad[:2])
    assert residual[2:4].tolist() == [0.0, 0.0]  # a non-finite value leaves 0
    assert residual[4:].tolist() == [1.0, 0.5]  # not sent


def test_the_wire_carries_six_bytes_a_pair_and_the_same_average():
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200)
    grads = [torch.randn_like(p) for p in model.parameters()]
    out = {}
    for dtype in (torch.float32, BF16):
        copy = torch.nn.Linear(300, 200)
        copy.load_state_dict(model.state_dict())
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(copy.parameters(), lr=0.1),
            sparsecomm.TopK(0.01, value_dtype=dtype),
            min_compress_numel=0,
        )
        for p, g in zip(copy.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        out[dtype] = (opt.last_stats, copy.weight.detach().clone(), opt.residual(copy.weight))
    k = 602  # one bucket of 60200 elements: ceil(1%)
    assert out[torch.float32][0].bytes_sent == 8 * k
    assert out[BF16][0].bytes_sent == 6 * k
    # The same coordinates moved, each by the step of its rounded value (2**-8 of it at
    # most, plus the float32 rounding of the weights).
    start = model.weight.detach()
    step32, step16 = start - out[torch.float32][1], start - out[BF16][1]
    assert torch.equal(step32 != 0, step16 != 0) and int((step32 != 0).sum()) > 0
    assert bool(((step32 - step16).abs() <= step32.abs() * 2.0**-7).all())


def test_config_repr_and_checkpoint_agreement():
    ours = TopK(0.01, value_dtype=BF16)
    assert ours.config() == {"name": "TopK", "density": 0.01, "value_dtype": "bfloat16"}
    assert TopK(0.01).config() == {"name": "TopK", "density": 0.01}  # as before
    assert repr(ours) == "TopK(density=0.01, value_dtype=torch.bfloat16)"
    assert not ours.matches(TopK(0.01).config()) and not TopK(0.01).matches(ours.config())
    assert ours.matches(TopK(0.01, value_dtype=BF16).config())
    warm = TopK(0.01, warmup_steps=10, value_dtype=BF16)
    assert warm.at_step(3).value_dtype == BF16 and warm.at_step(3).pair_bytes == 6
    assert TopK(0.01).pair_bytes == 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, "bfloat16"])
def test_other_value_dtypes_are_refused_with_the_choices(dtype):
    with pytest.raises(ValueError, match="torch.float32 .* or torch.bfloat16"):
        TopK(0.01, value_dtype=dtype)


def test_with_an_address_table_the_caller_rounds_once(monkeypatch):
    # A CUDA graph's replay (compress called with `addresses`) may run on buffers that moved
    # since its capture, so compress leaves the rounding to the caller, who passes the
    # step's residual to round_message; rounding twice would zero what the first one kept.
    from sparsecomm import _ops

    topk = _ops.topk_compress
    monkeypatch.setattr(_ops, "topk_compress", lambda g, r, k, addresses=None: topk(g, r, k))
    gen = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    expected = grad + residual
    ours = TopK(0.05, value_dtype=BF16)
    message = ours.compress(grad, residual, world_size=1, addresses=object())
    assert not message.rounded
    assert not torch.equal(message.values, message.values.to(BF16).float())  # float32 still
    ours.round_message(message, residual)
    assert message.rounded and torch.equal(message.decode() + residual, expected)
    kept = residual.clone()
    ours.round_message(message, residual)  # a no-op now
    assert torch.equal(residual, kept)
    plain = TopK(0.05).compress(grad.clone(), None, world_size=1)
    TopK(0.05).round_message(plain, None)  # float32 values: nothing to do
    assert not plain.rounded


def test_the_switch_to_a_dense_all_reduce_counts_six_bytes_a_pair():
    # Two ranks, 10000 elements: a ring all-reduce moves 8 bytes an element (40000 bytes of
    # payload); W * k pairs of 8 bytes reach that at k = 5000, of 6 bytes at k = 6667.
    cases = [(torch.float32, 0.55), (BF16, 0.55), (BF16, 0.65), (BF16, 0.7)]
    results = run_ranks(_workers.dense_switch, 2, cases)
    for rank, sent in enumerate(results):
        assert sent[0] == (40_000, 10_000), f"rank {rank}: float32 pairs at 55% go dense"
        assert sent[1] == (6 * 5_500, 5_500), f"rank {rank}: 6-byte pairs at 55% stay sparse"
        assert sent[2] == (6 * 6_500, 6_500), f"rank {rank}: and at 65%"
        assert sent[3] == (40_000, 10_000), f"rank {rank}: 6-byte pairs at 70% go dense"
