"""The Triton kernel of ``SharedMomentAdamW``'s step against the torch ops that define it:
many tensors in one launch, odd sizes, with and without a shared moment, views that do not
start on 16 bytes, huge and tiny gradients, signed zeros, NaN, 16-bit parameters; the
dispatch; the fallback when the kernel fails. In Triton's interpreter on a CPU, natively on
a GPU. They agree to float32 rounding (the kernel's multiply-adds may fuse)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from sparsecomm.triton_kernels import shared_moment as kernel

import sparsecomm
from sparsecomm import shared_moment

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

SIZES = [1, 7, 2047, 2048, 2049, 5003, 0]


def trained(sizes, dtype=torch.float32, world_size=2, refreshed=3, seed=0, views=False):
    """A SharedMomentAdamW over tensors of ``sizes`` after three steps, with a fourth
    gradient in place, as :meth:`_step_group` would see them on CUDA (one group). Steps 1
    and 3 refresh the shared moment of the first ``refreshed`` tensors. With ``views``,
    each parameter starts 1 element into a larger tensor (not on 16 bytes)."""
    gen = torch.Generator().manual_seed(seed)
    # Each coordinate's gradient keeps its sign from step to step, so its momentum does
    # too: no cancellation in the momentum's update, whose float32 rounding would then be
    # a large share of a small result (and differs where the multiply-adds fuse).
    signs = [torch.randint(0, 2, (n,), generator=gen) * 2.0 - 1.0 for n in sizes]
    params = []
    for n in sizes:
        start = torch.randn(n + 1, generator=gen).to(dtype).to(DEVICE)
        params.append(torch.nn.Parameter(start[1:] if views else start[:n].clone()))
    opt = sparsecomm.SharedMomentAdamW(params, lr=1e-2, weight_decay=0.1, refresh_every=2)
    for step in range(4):
        opt.set_world_size(world_size)
        if step < 3 and opt.average_gradient_due():
            opt.take_average_gradient(
                {p: torch.randn(p.shape, generator=gen).to(DEVICE) for p in params[:refreshed]}
            )
        for p, sign in zip(params, signs):
            scale = 10.0 ** torch.randint(-6, 4, p.shape, generator=gen) * sign
            p.grad = (torch.randn(p.shape, generator=gen).abs() * scale).to(dtype).to(DEVICE)
        if step < 3:
            opt.step()
    return opt, params


def both(sizes, monkeypatch, **kwargs):
    """(torch ops, kernel) parameters and moments after the fourth step, from one state."""
    monkeypatch.setattr(shared_moment, "_batched", lambda params: bool(params))
    out = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")  # the same three steps before
        opt, params = trained(sizes, **kwargs)
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
        opt.step()
        states = [opt.state[p] for p in params]
        out.append(
            (
                [p.detach().clone() for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
            )
        )
    assert not shared_moment._KERNEL.failed
    return out


def close(ours, theirs, rtol):
    for a, b in zip(ours, theirs):
        if b.numel():
            scale = b.float().abs().max().item()
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-6 * scale)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("views", [False, True], ids=["own", "views"])
def test_the_kernel_agrees_with_the_torch_ops(world_size, views, monkeypatch):
    """Every size in one launch, the first three with a shared moment (in use with two
    ranks), the others without one."""
    (p0, m0, v0), (p1, m1, v1) = both(SIZES, monkeypatch, world_size=world_size, views=views)
    close(m1, m0, 1e-6)
    close(v1, v0, 1e-6)
    close(p1, p0, 2e-6)


def test_signed_zeros_nan_and_a_coordinate_without_any_moment(monkeypatch):
    """One parameter, its shared moment in use: a zero gradient (either sign) with zero
    moments moves by the weight decay alone; NaN reaches the parameter and both moments."""
    monkeypatch.setattr(shared_moment, "_batched", lambda params: bool(params))
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
        param = torch.nn.Parameter(torch.ones(6, device=DEVICE))
        opt = sparsecomm.SharedMomentAdamW([param], lr=1e-2, weight_decay=0.1)
        opt.set_world_size(2)
        shared = torch.tensor([0.0, 0.0, 1.0, 2.0, 1e-20, 1e20], device=DEVICE)
        opt.take_average_gradient({param: shared})
        param.grad = torch.tensor([0.0, -0.0, float("nan"), 3.0, -1e-30, 1e30], device=DEVICE)
        opt.step()
        state = opt.state[param]
        results.append((param.detach().clone(), state["exp_avg"], state["exp_avg_sq"]))
    (p0, m0, v0), (p1, m1, v1) = results
    assert not shared_moment._KERNEL.failed
    decayed = torch.full((2,), 1.0 - 1e-3, device=DEVICE)
    assert torch.equal(p1[:2], decayed) and torch.equal(p0[:2], decayed)
    assert p1[2].isnan() and m1[2].isnan() and v1[2].isnan() and p0[2].isnan()
    torch.testing.assert_close(p1[3:], p0[3:], rtol=2e-6, atol=0.0)
    torch.testing.assert_close(m1[3:], m0[3:], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(v1[3:], v0[3:], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_parameter_is_rounded_once(dtype, monkeypatch):
    (p0, *_), (p1, *_) = both([3001, 40], monkeypatch, dtype=dtype, refreshed=1)
    for ours, theirs in zip(p1, p0):
        assert ours.dtype == dtype
        # Both round the float32 result to the half type once: an ulp apart at most (the
        # interpreter truncates where a GPU rounds to nearest).
        ulp = torch.finfo(dtype).eps * theirs.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((ours.float() - theirs.float()).abs() <= ulp).all()


def test_the_optimizer_runs_the_kernel_where_triton_is_picked(monkeypatch):
    calls = []
    real = kernel.shared_moment_adamw
    monkeypatch.setattr(
        kernel, "shared_moment_adamw", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    )
    monkeypatch.setattr(shared_moment, "_batched", lambda params: bool(params))
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")
    params = [torch.randn(300, device=DEVICE, requires_grad=True) for _ in range(3)]
    params.append(torch.randn(20, device=DEVICE).to(torch.bfloat16).requires_grad_(True))
    opt = sparsecomm.SharedMomentAdamW(params, lr=1e-2)
    for param in params:
        param.grad = torch.randn_like(param)
    opt.step()
    assert sorted(calls) == [1, 3]  # one launch per dtype
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    opt.step()
    assert sorted(calls) == [1, 3]


def test_a_failing_kernel_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setattr(shared_moment._KERNEL, "failed", False)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(kernel, "shared_moment_adamw", broken)
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")
    torch.manual_seed(0)
    start, grad = torch.randn(100, device=DEVICE), torch.randn(100, device=DEVICE)
    param = start.clone().requires_grad_(True)
    opt = sparsecomm.SharedMomentAdamW([param], lr=1e-2)
    param.grad = grad.clone()
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        opt.step()
    assert shared_moment._KERNEL.failed
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    expected = start.clone().requires_grad_(True)
    reference = sparsecomm.SharedMomentAdamW([expected], lr=1e-2)
    expected.grad = grad.clone()
    reference.step()
    assert torch.equal(param, expected)
    assert opt.state[param]["step"] == 1  # counted once, not again by the fallback


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a["exp_avgs"].__setitem__(0, a["exp_avgs"][0].double()), "float32"),
        (lambda a: a["grads"].__setitem__(0, a["grads"][0][:-1]), "shaped like"),
        (lambda a: a["scalars"].pop(), "scalars"),
        (lambda a: a["params"].__setitem__(1, a["params"][1].half()), "one dtype"),
    ],
)
def test_the_launcher_names_bad_arguments(change, match):
    tensors = [torch.randn(10, device=DEVICE) for _ in range(2)]
    args = dict(
        params=tensors,
        grads=[torch.ones_like(t) for t in tensors],
        exp_avgs=[torch.zeros_like(t) for t in tensors],
        exp_avg_sqs=[torch.zeros_like(t) for t in tensors],
        shareds=[None, None],
        scalars=[(-1e-2, 1e-3, 0.0)] * 2,
    )
    change(args)
    with pytest.raises((TypeError, ValueError), match=match):
        kernel.shared_moment_adamw(**args, betas=(0.9, 0.999), eps=1e-8, decay=1.0)


def test_a_parameter_that_is_not_contiguous_steps_in_the_torch_ops(monkeypatch):
    """The kernel takes the contiguous parameters; a transposed one steps in the torch ops
    beside them, with no warning and the kernel still in use."""
    monkeypatch.setattr(shared_moment, "_batched", lambda params: bool(params))
    monkeypatch.setattr(shared_moment._KERNEL, "failed", False)
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
        gen = torch.Generator().manual_seed(0)
        flat = torch.nn.Parameter(torch.randn(50, generator=gen).to(DEVICE))
        turned = torch.nn.Parameter(torch.randn(6, 9, generator=gen).to(DEVICE).t())
        opt = sparsecomm.SharedMomentAdamW([flat, turned], lr=1e-2)
        for _ in range(2):
            flat.grad = torch.randn(50, generator=gen).to(DEVICE)
            turned.grad = torch.randn(9, 6, generator=gen).to(DEVICE)
            opt.step()
        results.append((flat.detach().clone(), turned.detach().clone()))
    assert not shared_moment._KERNEL.failed
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-6, atol=1e-7)
    assert torch.equal(results[1][1], results[0][1])  # the same torch ops


def test_a_launch_that_fails_after_another_succeeded_steps_each_parameter_once(monkeypatch):
    """The float32 parameters' launch runs, the bfloat16 ones' fails: those step in the
    torch ops, and none twice (the same parameters and moments as the torch ops alone)."""
    monkeypatch.setattr(shared_moment, "_batched", lambda params: bool(params))
    monkeypatch.setattr(shared_moment._KERNEL, "failed", False)
    real = kernel.shared_moment_adamw

    def second_fails(params, *args, **kwargs):
        if params[0].dtype != torch.float32:
            raise RuntimeError("no bfloat16 here")
        return real(params, *args, **kwargs)

    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
        monkeypatch.setattr(kernel, "shared_moment_adamw", second_fails)
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(300, generator=gen).to(DEVICE)),
            torch.nn.Parameter(torch.randn(40, generator=gen).to(torch.bfloat16).to(DEVICE)),
        ]
        opt = sparsecomm.SharedMomentAdamW(params, lr=1e-2)
        for param in params:
            param.grad = torch.randn(param.shape, generator=gen).to(param.dtype).to(DEVICE)
        if mode == "triton":
            with pytest.warns(RuntimeWarning, match="no bfloat16 here"):
                opt.step()
        else:
            opt.step()
        assert [opt.state[p]["step"] for p in params] == [1, 1]
        results.append([t.detach().clone() for p in params for t in (p, opt.state[p]["exp_avg"])])
    assert shared_moment._KERNEL.failed
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=0.0)
    assert torch.equal(results[1][2], results[0][2]) and torch.equal(results[1][3], results[0][3])
