"""``triton_kernels.adam_score``: ``TopK(select="adam")``'s CUDA path (the score kernel, the
top-k of the scores, the take-and-zero kernel) against its torch definition, bit for bit:
odd member sizes, second moments at zero, huge and tiny, each member's eps, sums with ties,
signed zeros, NaN and Inf, with and without a residual, and read through an address table
as a CUDA graph reads it."""

import pytest
import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from sparsecomm.triton_kernels import _indirect
from sparsecomm.triton_kernels.adam_score import Members, adam_topk, adam_topk_ref
from strategies import gradients


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int32)


def make_members(numels, seed, kinds):
    gen = torch.Generator().manual_seed(seed)
    variances = []
    for numel, kind in zip(numels, kinds):
        if kind == "zero":
            v = torch.zeros(numel)
        elif kind == "wide":  # from 1e-30 to 1e6, some zeros
            v = torch.rand(numel, generator=gen) * 10.0 ** torch.randint(
                -30, 7, (numel,), generator=gen
            )
            v[torch.rand(numel, generator=gen) < 0.2] = 0.0
        else:
            v = torch.rand(numel, generator=gen)
        variances.append(v.to(DEVICE))
    eps = [
        float(e)
        for e in torch.tensor([1e-8, 1e-3, 1.0])[torch.randint(0, 3, (len(numels),), generator=gen)]
    ]
    return Members(list(numels), variances, eps)


@settings(max_examples=30)
@given(
    grad=gradients(min_size=3, max_size=3000),
    data=st.data(),
)
def test_adam_topk_matches_its_definition_bit_for_bit(grad, data):
    n = grad.numel()
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=0, max_size=3, unique=True)))
    numels = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    kinds = data.draw(
        st.lists(
            st.sampled_from(["zero", "wide", "plain"]), min_size=len(numels), max_size=len(numels)
        )
    )
    members = make_members(numels, data.draw(st.integers(0, 2**31 - 1)), kinds)
    with_residual = data.draw(st.booleans())
    residual = torch.randn(n).to(DEVICE) if with_residual else None
    k = data.draw(st.sampled_from([1, max(1, n // 100), max(1, n // 7), n]))
    g1, g2 = grad.to(DEVICE), grad.to(DEVICE).clone()
    indices, values = adam_topk(g1, residual, members, k)
    want_indices, want_values = adam_topk_ref(g2, residual, members, k)
    assert torch.equal(indices.cpu(), want_indices.cpu())
    assert torch.equal(bits(values), bits(want_values))
    assert torch.equal(bits(g1), bits(g2))  # the new residual: acc, sent elements zeroed


def test_through_an_address_table():
    torch.manual_seed(0)
    members = make_members([1000, 37, 4096], 1, ["wide", "zero", "plain"])
    grad, residual = torch.randn(5133, device=DEVICE), torch.randn(5133, device=DEVICE)
    direct_grad = grad.clone()
    want = adam_topk(direct_grad, residual, members, 51)
    # The buffers passed give the size only: the kernels read where the table says.
    table = _indirect.table(grad.device, grad, residual)
    got = adam_topk(torch.empty_like(grad), torch.empty_like(residual), members, 51, table)
    assert torch.equal(got[0], want[0]) and torch.equal(bits(got[1]), bits(want[1]))
    assert torch.equal(bits(grad), bits(direct_grad))


def test_arguments_are_checked():
    members = make_members([10, 20], 0, ["plain", "plain"])
    with pytest.raises(ValueError, match="30 elements, the bucket 31"):
        adam_topk(torch.zeros(31, device=DEVICE), None, members, 3)
    with pytest.raises(ValueError, match="k must be in"):
        adam_topk(torch.zeros(30, device=DEVICE), None, members, 0)
    with pytest.raises(ValueError, match="float32, contiguous"):
        Members([4], [torch.zeros(4, dtype=torch.bfloat16, device=DEVICE)], [1e-8])


@pytest.mark.skipif(DEVICE != "cuda", reason="a race between GPU threads: needs a GPU")
def test_every_value_taken_is_read_before_it_is_zeroed():
    # k = 1e6 values taken from a 1e8-element bucket: when one kernel read and zeroed them,
    # some threads zeroed elements that others had not read yet (on an H100, ~700 values
    # came out as zeros while the residual was zeroed there: gradient lost).
    n, k = 10**8, 10**6
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    grad = torch.randn(n, device=DEVICE, generator=gen)
    residual = torch.randn(n, device=DEVICE, generator=gen)
    numels = [n // 4] * 4
    variances = [torch.rand(m, device=DEVICE, generator=gen) * 1e-4 for m in numels]
    members = Members(numels, variances, [1e-8] * 4)
    acc = grad + residual
    indices, values = adam_topk(grad, residual, members, k)
    assert torch.equal(bits(values), bits(acc[indices.long()]))
    assert not bool(grad[indices.long()].any())
