"""``CatchUpAdamW``: AdamW where every coordinate receives every step; the catch-up update
against a float64 reference that sums the tau steps' momenta one by one; a burst against
tau real AdamW steps; coordinates at zero; checkpoints; bad arguments."""

import copy
import math

import pytest
import torch

import sparsecomm
from sparsecomm.catchup import catch_up_adamw_

BETAS = (0.9, 0.999)


def reference_steps(param, grads, lr, betas, eps, weight_decay):
    """CatchUpAdamW on one flat float64 parameter, coordinate by coordinate, stepping the
    momentum through the tau steps one by one and summing its bias-corrected values (the
    module's closed form is what is checked)."""
    beta1, beta2 = betas
    p = [float(x) for x in param]
    m, v, last = [0.0] * len(p), [0.0] * len(p), [0] * len(p)
    for t, grad in enumerate(grads, start=1):
        for i, g in enumerate(float(x) for x in grad):
            p[i] *= 1.0 - lr * weight_decay
            if g == 0.0:
                continue
            tau = t - last[i]
            g /= tau
            # AdamW's momentum through the tau steps, each divided by its own step's bias
            # correction, exactly (in float64)
            momenta = 0.0
            for k in range(1, tau + 1):
                m[i] = beta1 * m[i] + (1.0 - beta1) * g
                momenta += m[i] / (1.0 - beta1 ** (last[i] + k))
            v[i] = beta2**tau * v[i] + (1.0 - beta2**tau) * g * g
            denom = math.sqrt(v[i] / (1.0 - beta2**t)) + eps
            p[i] -= lr * momenta / denom
            last[i] = t
    return torch.tensor(p, dtype=torch.float64)


@pytest.mark.parametrize("beta1", [0.9, 0.99])
def test_with_a_gradient_everywhere_every_step_it_is_adamw(beta1):
    # 200 steps: past momenta_terms(0.9) = 165, after which the bias corrections are 1 in
    # float32; at 0.99 they are far from 1 all along (0.99^200 = 0.13)
    torch.manual_seed(0)
    shapes = [(30, 20), (600, 500), (5, 3)]  # the second in several CPU chunks
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    start = [p.detach().clone() for p in ours]

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.0}]

    betas = (beta1, 0.999)
    opt = sparsecomm.CatchUpAdamW(groups(ours), lr=1e-2, betas=betas, weight_decay=0.1)
    adamw = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=betas, weight_decay=0.1)
    for _ in range(200):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape)
            g[g == 0] = 1.0  # every coordinate receives something
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)  # 200 steps of rounding
        # The second moment's weight 1 - beta2 = 0.001, formed in float32 as 1 - 0.999,
        # would be 1.3e-5 off: the moments would drift apart by that much.
        torch.testing.assert_close(
            opt.state[a]["exp_avg_sq"], adamw.state[b]["exp_avg_sq"], rtol=5e-6, atol=0.0
        )
    assert all((a - s).abs().max() > 0.01 for a, s in zip(ours, start))


@pytest.mark.parametrize("betas", [BETAS, (0.97, 0.99)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_bursts_match_the_tau_steps_summed_one_by_one(weight_decay, betas):
    gen = torch.Generator().manual_seed(1)
    numel, steps = 64, 250  # last receipts past momenta_terms(0.9) = 165 too
    # Each coordinate receives at its own rate (every step to every 13th), as top-k with
    # error feedback delivers it, with bursts of every sign and size.
    every = torch.randint(1, 14, (numel,), generator=gen)
    every[:4] = torch.tensor([1, 70, 100, 200])  # waits longer than momenta_terms(0.9) too
    phase = torch.randint(0, 13, (numel,), generator=gen)
    grads = []
    for t in range(1, steps + 1):
        g = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(
            -3, 3, (numel,), generator=gen
        )
        g[(t + phase) % every != 0] = 0.0
        grads.append(g)
    start = torch.randn(numel, generator=gen)
    param = start.clone().requires_grad_(True)
    opt = sparsecomm.CatchUpAdamW([param], lr=1e-2, betas=betas, weight_decay=weight_decay)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected = reference_steps(start, grads, 1e-2, betas, 1e-8, weight_decay)
    torch.testing.assert_close(param.detach().double(), expected, rtol=2e-5, atol=2e-6)
    state = opt.state[param]
    received = torch.stack(grads) != 0
    last = torch.where(received, torch.arange(1, steps + 1)[:, None], 0).amax(0)
    assert torch.equal(state["last_step"].long(), last)
    assert state["step"] == steps


def test_a_burst_catches_up_the_steps_adamw_takes_on_the_gradients_it_sums():
    """A coordinate silent for tau - 1 steps, then sent the sum of tau gradients g, moves as
    far as AdamW moves in tau steps of g (from a state where g is what it has been seeing,
    late in training so that the bias corrections hardly change); plain AdamW, given the
    burst in one step, moves it far less."""
    tau, g, lr = 40, torch.tensor([0.3, -2.0, 1e-3]), 1e-3
    state = {"exp_avg": g.clone(), "exp_avg_sq": g * g, "step": 5000}

    # tau steps of AdamW on g
    iterated = torch.zeros(3, requires_grad=True)
    adamw = torch.optim.AdamW([iterated], lr=lr, weight_decay=0.0)
    iterated.grad = torch.zeros(3)
    adamw.step()  # creates the state, which is then set
    with torch.no_grad():
        iterated.zero_()
    adamw.state[iterated].update(
        exp_avg=state["exp_avg"].clone(),
        exp_avg_sq=state["exp_avg_sq"].clone(),
        step=torch.tensor(float(state["step"])),
    )
    for _ in range(tau):
        iterated.grad = g.clone()
        adamw.step()

    # one step of CatchUpAdamW on the burst tau * g, after tau - 1 silent steps
    caught_up = torch.zeros(3)
    last = torch.full((3,), state["step"], dtype=torch.int32)
    catch_up_adamw_(
        caught_up, tau * g, state["exp_avg"].clone(), state["exp_avg_sq"].clone(), last,
        step=state["step"] + tau, lr=lr, betas=BETAS, eps=1e-8, weight_decay=0.0,
    )  # fmt: skip
    torch.testing.assert_close(caught_up, iterated.detach(), rtol=2e-3, atol=0.0)
    assert torch.equal(last, torch.full((3,), state["step"] + tau, dtype=torch.int32))

    # plain AdamW on the same burst, once
    plain = torch.zeros(3, requires_grad=True)
    once = torch.optim.AdamW([plain], lr=lr, weight_decay=0.0)
    plain.grad = torch.zeros(3)
    once.step()
    with torch.no_grad():
        plain.zero_()
    once.state[plain].update(
        exp_avg=state["exp_avg"].clone(),
        exp_avg_sq=state["exp_avg_sq"].clone(),
        step=torch.tensor(float(state["step"] + tau - 1)),
    )
    plain.grad = tau * g
    once.step()
    assert (plain.detach().abs() * 5 < caught_up.abs()).all()


def test_coordinates_at_zero_take_only_the_weight_decay():
    param = torch.randn(6, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    opt.step()
    state = copy.deepcopy({k: v for k, v in opt.state[param].items()})
    before = param.detach().clone()
    param.grad = torch.tensor([0.0, 4.0, 0.0, 0.0, -0.0, 1.0])
    opt.step()
    silent = torch.tensor([True, False, True, True, True, False])
    torch.testing.assert_close(param.detach()[silent], before[silent] * (1 - 0.1 * 0.5))
    after = opt.state[param]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(after[key][silent], state[key][silent])
        assert not torch.equal(after[key][~silent], state[key][~silent])
    assert after["last_step"].tolist() == [1, 2, 1, 1, 1, 2]


def test_behind_topk_a_checkpoint_resumes_bitwise():
    def run(steps, saved=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 4)
        )
        opt = sparsecomm.CompressedOptimizer(
            sparsecomm.CatchUpAdamW(model.parameters(), lr=1e-2), sparsecomm.TopK(0.05)
        )
        first = 0
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            first = saved["at"]
        for step in range(first, steps):
            gen = torch.Generator().manual_seed(step)
            model(torch.randn(8, 40, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert all("last_step" in s for s in opt.optimizer.state.values())
        state = {"model": copy.deepcopy(model.state_dict()), "opt": opt.state_dict(), "at": steps}
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state

    straight, _ = run(12)
    _, saved = run(5)
    resumed, _ = run(12, copy.deepcopy(saved))
    assert torch.equal(straight, resumed)
    assert not torch.equal(straight, run(5)[0])


def test_a_bf16_parameter_keeps_its_state_exact_through_a_checkpoint():
    param = torch.randn(50, dtype=torch.bfloat16, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([param], lr=1e-2)
    param.grad = torch.randn(50, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[param]
    state["step"] = 1000
    state["last_step"][:] = 1000 - 3 * torch.arange(50, dtype=torch.int32)  # not all bf16 values
    saved = copy.deepcopy(opt.state_dict())
    again = sparsecomm.CatchUpAdamW([param], lr=1e-2)
    again.load_state_dict(saved)  # torch alone would cast every state tensor to bf16
    for key in ("exp_avg", "exp_avg_sq", "last_step"):
        assert again.state[param][key].dtype == state[key].dtype
        assert torch.equal(again.state[param][key], state[key])
        assert again.state[param][key].data_ptr() != saved["state"][0][key].data_ptr()
    assert state["exp_avg"].dtype == torch.float32 and state["last_step"].dtype == torch.int32
    param.grad = torch.randn(50, dtype=torch.bfloat16)
    again.step()
    assert param.dtype == torch.bfloat16 and torch.isfinite(param).all()
    assert again.state[param]["last_step"].unique().tolist() == [1001]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsecomm.CatchUpAdamW([torch.zeros(2, requires_grad=True)], **kwargs)
    # the same in a parameter group added later: refused, and not added
    opt = sparsecomm.CatchUpAdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], **kwargs})
    assert len(opt.param_groups) == 1


def test_three_betas_are_refused():
    with pytest.raises(ValueError, match="two numbers"):
        sparsecomm.CatchUpAdamW([torch.zeros(2, requires_grad=True)], betas=(0.9, 0.999, 0.5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_a_parameter_it_would_round_is_refused_with_the_fix(dtype):
    param = torch.zeros(3, dtype=dtype, requires_grad=True)
    with pytest.raises(TypeError, match=r"torch.optim.AdamW"):
        sparsecomm.CatchUpAdamW([param])
    opt = sparsecomm.CatchUpAdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError, match=str(dtype)):
        opt.add_param_group({"params": param})


def test_a_set_of_parameters_is_refused_as_torch_refuses_it():
    # (a set's order, and so the state_dict's indices, changes from run to run)
    param = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError, match="set"):
        sparsecomm.CatchUpAdamW([{"params": {param}}])
    opt = sparsecomm.CatchUpAdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError, match="set"):
        opt.add_param_group({"params": {param}})


def test_momenta_terms_reach_float32s_one_and_are_never_one():
    from sparsecomm.catchup import momenta_terms

    assert momenta_terms(0.9) == 165 and momenta_terms(0.99) == 1725
    for beta1 in (0.5, 0.9, 0.99, 0.999):
        n = momenta_terms(beta1)
        assert beta1**n <= 2**-25 < beta1 ** (n - 1)
        assert torch.tensor(1.0 - beta1**n, dtype=torch.float32).item() == 1.0
    # Triton makes an int argument of 1 a constant, which the kernel cannot convert
    assert momenta_terms(1e-9) == 2


def test_an_adamw_state_is_refused_before_anything_changes():
    param = torch.ones(4, requires_grad=True)
    adamw = torch.optim.AdamW([param], lr=1e-2)
    param.grad = torch.ones(4)
    adamw.step()
    opt = sparsecomm.CatchUpAdamW([param], lr=1e-2)
    with pytest.raises(ValueError, match="not a CatchUpAdamW state"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state  # nothing loaded: the next step starts fresh
    opt.step()
    assert opt.state[param]["last_step"].tolist() == [1] * 4


def test_a_state_with_a_parameter_looked_up_but_never_stepped_loads():
    # optimizer.state is a defaultdict: reading a parameter's entry (to log its moments,
    # say) before its first gradient leaves an empty one, which the checkpoint carries.
    used, unused = torch.ones(4, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([used, unused], lr=1e-2)
    used.grad = torch.ones(4)
    opt.step()
    assert "exp_avg_sq" not in opt.state[unused]  # the lookup that leaves {}
    again = sparsecomm.CatchUpAdamW([used, unused], lr=1e-2)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(again.state[used]["exp_avg_sq"], opt.state[used]["exp_avg_sq"])
    used.grad, unused.grad = None, torch.full((3,), 2.0)
    again.step()  # the first gradient of `unused` starts its state
    assert again.state[unused]["exp_avg"].tolist() == pytest.approx([0.2] * 3)


def test_a_sparse_gradient_is_refused_with_the_fix():
    param = torch.zeros(4, 2, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([param])
    param.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(TypeError, match="sparse=False"):
        opt.step()


def test_the_step_benchmark_prints_its_table():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_catchup.py"), "--device", "cpu",
         "--scale", "0.02", "--steps", "1", "--received", "1", "0.1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 1 |")]
    rows += [line for line in result.stdout.splitlines() if line.startswith("| 0.1 |")]
    assert len(rows) == 2 and all(len(row.split("|")) == 8 for row in rows), result.stdout
    assert "| SharedMomentAdamW |" in result.stdout


@pytest.mark.parametrize("tau", [1, 2, 7, 100])
def test_a_first_burst_moves_as_far_as_the_adamw_steps_it_stands_for(tau):
    # From a fresh state AdamW's bias-corrected momentum is the gradient itself at every step,
    # so tau steps of g move a coordinate tau * lr; the catch-up of the burst tau * g must too.
    param = torch.zeros(2, requires_grad=True)
    opt = sparsecomm.CatchUpAdamW([param], lr=0.01, eps=0.0, weight_decay=0.0)
    for step in range(1, tau + 1):
        param.grad = torch.tensor([0.0, 0.5]) if step < tau else torch.tensor([3.0 * tau, 0.5])
        opt.step()
    torch.testing.assert_close(param[0].detach(), torch.tensor(-0.01 * tau), rtol=1e-5, atol=0)
