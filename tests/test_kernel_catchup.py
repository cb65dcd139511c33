"""The Triton kernel of ``CatchUpAdamW``'s step against the torch ops that define it: odd
sizes, every coordinate or a few receiving, waits of every length, huge and tiny gradients,
signed zeros, NaN, bf16 parameters; the dispatch; the fallback when the kernel fails. In
Triton's interpreter on a CPU, natively on a GPU. They agree to float32 rounding (the
kernel's ``exp2`` and divisions are the device's own), and exactly on which coordinates
moved and on ``last_step``."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from sparsecomm.triton_kernels import catchup as kernel

import sparsecomm
from sparsecomm import catchup

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def state_of(n, step, gen, dtype=torch.float32):
    """A parameter mid-training: moments of every size, last steps of every age."""
    param = torch.randn(n, generator=gen).to(dtype)
    avg = torch.randn(n, generator=gen) * 1e-2
    avg_sq = torch.rand(n, generator=gen) * 1e-4
    last = torch.randint(0, step, (n,), generator=gen, dtype=torch.int32)
    return [t.to(DEVICE) for t in (param, avg, avg_sq, last)]


def both(grad, state, step, monkeypatch):
    """(torch ops, kernel) results of one step from copies of ``state``. The kernel is
    called directly: through the dispatch, a kernel that failed would fall back to torch."""
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    out = []
    for step_one in (catchup.catch_up_adamw_, kernel.catch_up_adamw):
        copies = [t.clone() for t in state]
        step_one(copies[0], grad, *copies[1:], step=step, **HYPER)
        out.append(copies)
    return out


@pytest.mark.parametrize("n", [1, 7, 2047, 2048, 2049, 5003])
@pytest.mark.parametrize("received", [1.0, 0.3, 0.01])
@pytest.mark.parametrize("step", [57, 400])  # 400: last steps on both sides of 165
def test_the_kernel_agrees_with_the_torch_ops(n, received, step, monkeypatch):
    gen = torch.Generator().manual_seed(n)
    state = state_of(n, step, gen)
    grad = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 4, (n,), generator=gen)
    grad[torch.rand(n, generator=gen) >= received] = 0.0
    grad = grad.to(DEVICE)
    (p0, m0, v0, l0), (p1, m1, v1, l1) = both(grad, state, step, monkeypatch)
    assert torch.equal(l0, l1)
    moved = grad != 0
    assert torch.equal(l1[moved], torch.full_like(l1[moved], step))
    assert torch.equal(m1[~moved], state[1][~moved]) and torch.equal(v1[~moved], state[2][~moved])
    # Relative to each tensor's scale: a moment's lerp cancels where the gradient is close
    # to it, and there an ulp is a larger share of the small result. The moments' weight 1 -
    # beta ** tau is formed without cancelling (expm1 in torch, a series in the kernel), so
    # it agrees to a few ulps; when it was 1 - exp2(...) in float32 an ulp of exp2 was ~1000
    # ulps of the weight at beta2 = 0.999, and the moments agreed to 5e-5.
    for ours, theirs, rtol in ((p1, p0, 2e-6), (m1, m0, 2e-6), (v1, v0, 2e-6)):
        scale = theirs.abs().max().item()
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=1e-6 * scale)


def test_signed_zeros_nan_and_the_first_step(monkeypatch):
    step = 1
    state = [t.to(DEVICE) for t in (torch.ones(6), torch.zeros(6), torch.zeros(6))]
    state.append(torch.zeros(6, dtype=torch.int32, device=DEVICE))
    grad = torch.tensor([0.0, -0.0, float("nan"), 3.0, -1e-30, 1e30], device=DEVICE)
    (p0, m0, v0, l0), (p1, m1, v1, l1) = both(grad, state, step, monkeypatch)
    assert l1.tolist() == l0.tolist() == [0, 0, 1, 1, 1, 1]
    decayed = torch.full((2,), 1.0 - 1e-3, device=DEVICE)  # weight decay alone
    assert torch.equal(p1[:2], decayed) and torch.equal(p0[:2], decayed)
    assert p1[2].isnan() and p0[2].isnan()
    torch.testing.assert_close(p1[3:], p0[3:], rtol=2e-6, atol=0.0)
    # AdamW's first step moves a coordinate by lr against its sign; one whose gradient's
    # square underflows (v = 0: -1e-30 / eps) or overflows (v = inf) barely moves, as in AdamW.
    torch.testing.assert_close(p1[3:], torch.tensor([0.989, 0.999, 0.999], device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_parameter_is_rounded_once(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n, step = 3001, 12
    state = state_of(n, step, gen, dtype)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(dtype).to(DEVICE)
    grad[::3] = 0
    (p0, *_), (p1, *_) = both(grad, state, step, monkeypatch)
    assert p1.dtype == dtype
    # Both round the float32 result to the half type once; an ulp apart at most where the
    # float32 results straddle a rounding boundary.
    ulp = torch.finfo(dtype).eps * p0.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((p1.float() - p0.float()).abs() <= ulp).all()


def test_the_optimizer_runs_the_kernel_where_triton_is_picked(monkeypatch):
    calls = []
    real = kernel.catch_up_adamw
    monkeypatch.setattr(kernel, "catch_up_adamw", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")
    param = torch.randn(300, device=DEVICE, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([param], lr=1e-2)
    param.grad = torch.randn(300, device=DEVICE)
    opt.step()
    assert calls == [1]
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    param.grad = torch.randn(300, device=DEVICE)
    opt.step()
    assert calls == [1]


def test_a_failing_kernel_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setattr(catchup._KERNEL, "failed", False)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(kernel, "catch_up_adamw", broken)
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")
    torch.manual_seed(0)
    start = torch.randn(100, device=DEVICE)
    grad = torch.randn(100, device=DEVICE)
    param = start.clone().requires_grad_(True)
    opt = sparsecomm.CatchUpAdamW([param], lr=1e-2)
    param.grad = grad.clone()
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        opt.step()
    assert catchup._KERNEL.failed
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    expected = start.clone().requires_grad_(True)
    reference = sparsecomm.CatchUpAdamW([expected], lr=1e-2)
    expected.grad = grad.clone()
    reference.step()
    assert torch.equal(param, expected)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s.__setitem__(1, s[1].double()), "float32"),
        (lambda s: s.__setitem__(3, s[3].long()), "int32"),
        (lambda s: s.__setitem__(2, s[2][:-1]), "shaped like param"),
    ],
)
def test_the_launcher_names_bad_arguments(change, match):
    gen = torch.Generator().manual_seed(0)
    state = state_of(10, 5, gen)
    change(state)
    with pytest.raises((TypeError, ValueError), match=match):
        kernel.catch_up_adamw(state[0], torch.ones_like(state[0]), *state[1:], step=5, **HYPER)
