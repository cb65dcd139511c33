"""The training recipes: TopK's density warm-up, DGC momentum correction
(``momentum_correction``) and ``exchange="updates"``, on one process and on two gloo ranks:
the schedule's shape, what each step sends, conservation of what is sent plus what is kept,
refused steps, checkpoints and rank agreement."""

import copy

import _workers
import numpy as np
import pytest
import torch
from _dist import run_ranks

import sparsecomm


def model_of(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))


def step_on(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    model(torch.randn(8, 40, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def dgc(model, compressor, **kwargs):
    return sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        compressor,
        **{"momentum_correction": 0.9, **kwargs},
    )


# ------------------------------------------------------------------ the schedule


def test_exponential_warmup_starts_at_warmup_start_and_decays_to_density():
    topk = sparsecomm.TopK(0.001, warmup_steps=40, warmup_start=0.25)
    densities = [topk.density_at(s) for s in range(60)]
    assert densities[0] == 0.25
    assert all(a > b for a, b in zip(densities[:40], densities[1:41]))  # strictly falling
    assert densities[40:] == [0.001] * 20
    # Geometric: equal ratios, and the middle is the geometric mean of the ends.
    assert densities[20] == pytest.approx((0.25 * 0.001) ** 0.5, rel=1e-12)
    assert densities[1] / densities[0] == pytest.approx(densities[31] / densities[30], rel=1e-9)


def test_dense_warmup_sends_everything_then_density():
    topk = sparsecomm.TopK(0.01, warmup_steps=5, warmup="dense")
    assert [topk.density_at(s) for s in range(7)] == [1.0] * 5 + [0.01] * 2
    assert topk.at_step(7) is topk
    assert topk.at_step(2).k_for(1000) == 1000


def test_without_warmup_the_schedule_is_constant_and_config_unchanged():
    topk = sparsecomm.TopK(0.01)
    assert topk.density_at(0) == 0.01 and topk.at_step(0) is topk
    assert topk.config() == {"name": "TopK", "density": 0.01}  # old checkpoints still load
    warmed = sparsecomm.TopK(0.01, warmup_steps=10)
    assert warmed != topk and warmed.config()["warmup_steps"] == 10
    assert repr(warmed) == "TopK(density=0.01, warmup_steps=10, warmup_start=0.25)"
    # A step count read from numpy is an int too, and the same compressor.
    assert sparsecomm.TopK(0.01, warmup_steps=np.int64(10)) == warmed


def test_a_dense_warmup_ignores_warmup_start_and_loads_checkpoints_that_kept_it():
    plain = sparsecomm.TopK(0.5, warmup_steps=5, warmup="dense")
    for start in (0.5, 0.25, float("nan")):
        other = sparsecomm.TopK(0.5, warmup_steps=5, warmup="dense", warmup_start=start)
        assert other == plain and other.config() == plain.config()
    assert "warmup_start" not in plain.config()
    # Checkpoints of earlier code kept it in the config: they still load.
    model = model_of()
    opt = sparsecomm.CompressedOptimizer(torch.optim.AdamW(model.parameters()), plain)
    state = opt.state_dict()
    old = {**plain.config(), "warmup_start": 0.5}
    state["sparsecomm"]["compressor"] = old
    opt.load_state_dict(state)
    assert plain.matches(old)
    assert not sparsecomm.TopK(0.5, warmup_steps=6, warmup="dense").matches(old)
    hook_state, _ = sparsecomm.ddp_comm_hook(plain)
    saved = hook_state.state_dict()
    hook_state.load_state_dict({**saved, "compressor": old})


def test_a_refused_step_of_the_update_exchange_reports_its_scheduled_density():
    model = model_of()
    topk = sparsecomm.TopK(0.01, warmup_steps=10)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), topk, exchange="updates", min_compress_numel=0
    )
    step_on(model, opt, 0)
    model(torch.full((2, 40), float("nan"))).sum().backward()
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    opt.zero_grad()
    assert opt.last_stats.skipped_steps == 1
    assert opt.last_stats.scheduled_density == pytest.approx(topk.density_at(1))
    assert opt.total_stats.scheduled_density == pytest.approx(topk.density_at(1))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"warmup_steps": -1}, ValueError, ["warmup_steps=-1", ">= 0"]),
        ({"warmup_steps": 2.5}, ValueError, ["warmup_steps=2.5", "int"]),
        ({"warmup_steps": 5, "warmup": "linear"}, ValueError, ["'linear'", "exponential"]),
        ({"warmup_steps": 5, "warmup_start": 0.001}, ValueError, ["warmup_start=0.001", "[0.01"]),
        ({"warmup_steps": 5, "warmup_start": "x"}, TypeError, ["warmup_start", "float"]),
    ],
)
def test_bad_warmup_arguments_are_named(kwargs, error, words):
    with pytest.raises(error) as caught:
        sparsecomm.TopK(0.01, **kwargs)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_each_step_sends_what_the_schedule_says_and_stats_show_it():
    model = model_of()
    topk = sparsecomm.TopK(0.01, warmup_steps=6)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), topk, min_compress_numel=0
    )
    numel = sum(p.numel() for p in model.parameters())  # one bucket
    for step in range(9):
        step_on(model, opt, step)
        stats = opt.last_stats
        assert stats.scheduled_density == topk.density_at(step)
        assert stats.elements_sent == topk.at_step(step).k_for(numel), step
        assert opt.steps_taken == step + 1
    assert opt.total_stats.scheduled_density == 0.01  # the latest, not a sum
    assert opt.total_stats.elements_sent > 9 * topk.k_for(numel)


def test_dense_warmup_steps_match_dense_bitwise():
    a, b = model_of(), model_of()
    dense = sparsecomm.CompressedOptimizer(torch.optim.AdamW(a.parameters()), sparsecomm.Dense())
    warm = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(b.parameters()), sparsecomm.TopK(0.01, warmup_steps=4, warmup="dense")
    )
    for step in range(4):
        step_on(a, dense, step)
        step_on(b, warm, step)
        assert warm.last_stats.density == 1.0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(warm.residual(b[0].weight), torch.zeros(50, 40))
    step_on(b, warm, 4)
    assert warm.last_stats.elements_sent == 20 + 203  # 1% of 2000, and the small ones whole


def test_schedule_position_is_checkpointed_and_refused_steps_do_not_advance_it():
    model = model_of()
    topk = sparsecomm.TopK(0.01, warmup_steps=10)
    opt = sparsecomm.CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), topk)
    for step in range(3):
        step_on(model, opt, step)
    model[0].weight.grad = torch.full_like(model[0].weight, float("nan"))
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    opt.zero_grad()
    assert opt.steps_taken == 3
    state = opt.state_dict()
    assert state["sparsecomm"]["steps_taken"] == 3
    fresh = sparsecomm.CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), topk)
    fresh.load_state_dict(state)
    step_on(model, fresh, 3)
    assert fresh.last_stats.scheduled_density == topk.density_at(3)
    state["sparsecomm"]["steps_taken"] = -1
    with pytest.raises(ValueError, match="steps_taken"):
        fresh.load_state_dict(state)
    assert fresh.steps_taken == 4


# ------------------------------------------------------------------ momentum correction


def test_momentum_correction_conserves_velocity_and_masks_what_was_sent():
    """Per step on one rank: sent + new residual = old residual + (grad + m * old velocity),
    bit for bit, and the new velocity is that sum's velocity part with the sent
    coordinates zeroed."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(2000))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD([param], lr=0.0), sparsecomm.TopK(0.02), momentum_correction=0.9
    )
    sent_before = torch.zeros(2000, dtype=torch.bool)
    for _ in range(6):
        grad = torch.randn(2000)
        residual, velocity = opt.residual(param), opt.velocity(param)
        (param * grad).sum().backward()
        opt.step()
        new_velocity = torch.add(grad, velocity, alpha=0.9)
        sent = param.grad != 0
        assert int(sent.sum()) == 40
        assert torch.equal(param.grad + opt.residual(param), residual + new_velocity)
        assert torch.equal(opt.velocity(param), torch.where(sent, 0.0, new_velocity))
        assert torch.equal(opt.residual(param)[sent], torch.zeros(40))
        sent_before |= sent
        opt.zero_grad()
    assert opt.velocity(param).abs().sum() > 0


def test_momentum_correction_at_full_density_is_sgd_momentum():
    a, b = model_of(), model_of()
    plain = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9), sparsecomm.Dense()
    )
    corrected = dgc(b, sparsecomm.Dense())
    for step in range(8):
        step_on(a, plain, step)
        step_on(b, corrected, step)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(a[0].weight, model_of()[0].weight)


def test_momentum_correction_refused_step_changes_nothing():
    model = model_of()
    opt = dgc(model, sparsecomm.TopK(0.05))
    for step in range(3):
        step_on(model, opt, step)
    velocities = [opt.velocity(p) for p in model.parameters()]
    residuals = [opt.residual(p) for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    # During backward, which sends the buckets: a small parameter, sent dense.
    handle = model[2].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    model(torch.randn(8, 40)).pow(2).mean().backward()
    handle.remove()
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    for p, v, r, before in zip(model.parameters(), velocities, residuals, params):
        assert torch.equal(opt.velocity(p), v)
        assert torch.equal(opt.residual(p), r)
        assert torch.equal(p, before)


def test_momentum_correction_checkpoint_round_trip_and_validation():
    model = model_of()
    opt = dgc(model, sparsecomm.TopK(0.05))
    for step in range(3):
        step_on(model, opt, step)
    state = opt.state_dict()
    assert len(state["sparsecomm"]["velocities"]) == 4
    fresh = dgc(model, sparsecomm.TopK(0.05))
    fresh.load_state_dict(state)
    for p in model.parameters():
        assert torch.equal(fresh.velocity(p), opt.velocity(p))
        assert fresh.velocity(p).abs().sum() > 0
    bad = {**state, "sparsecomm": {**state["sparsecomm"]}}
    bad["sparsecomm"]["velocities"] = list(state["sparsecomm"]["velocities"])
    bad["sparsecomm"]["velocities"][0] = torch.full((50, 40), float("nan"))
    other = dgc(model, sparsecomm.TopK(0.05))
    with pytest.raises(ValueError, match="velocity 0 holds NaN"):
        other.load_state_dict(bad)
    bad["sparsecomm"]["velocities"][0] = torch.zeros(3)
    with pytest.raises(ValueError, match="velocity 0 is float32"):
        other.load_state_dict(bad)
    assert torch.equal(other.velocity(model[0].weight), torch.zeros(50, 40))  # unchanged
    plain = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), sparsecomm.TopK(0.05)
    )
    with pytest.raises(ValueError, match="momentum_correction=0.9"):
        plain.load_state_dict(state)


def test_momentum_correction_arguments_are_checked():
    model = model_of()
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        dgc(model, sparsecomm.TopK(0.05), momentum_correction=1.5)
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), momentum_correction=0.9
        )
    with pytest.raises(ValueError, match="apply it twice"):
        sparsecomm.CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            sparsecomm.TopK(0.05),
            momentum_correction=0.9,
        )
    opt = dgc(model, sparsecomm.TopK(0.05))
    extra = torch.nn.Linear(40, 30)
    with pytest.raises(ValueError, match="apply it twice"):
        opt.add_param_group({"params": extra.parameters(), "momentum": 0.5})
    assert len(opt.param_groups) == 1


def test_add_param_group_keeps_velocities():
    model = model_of()
    opt = dgc(model, sparsecomm.TopK(0.05), min_compress_numel=0)
    for step in range(2):
        step_on(model, opt, step)
    before = opt.velocity(model[0].weight)
    extra = torch.nn.Linear(40, 30)
    opt.add_param_group({"params": extra.parameters()})
    assert torch.equal(opt.velocity(model[0].weight), before)
    assert torch.equal(opt.velocity(extra.weight), torch.zeros(30, 40))


# ------------------------------------------------------------------ exchange="updates"


def test_updates_with_dense_is_the_plain_optimizer():
    a, b = model_of(), model_of()
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2)
    wrapped = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(b.parameters(), lr=1e-2), sparsecomm.Dense(), exchange="updates"
    )
    for step in range(6):
        step_on(a, plain, step)
        step_on(b, wrapped, step)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert not torch.equal(a[0].weight, model_of()[0].weight)


def test_updates_conserve_the_local_update():
    """Per step on one rank: sent + new residual = old residual + the update the wrapped
    AdamW made from this rank's gradient, bit for bit; the parameter moves by what was sent."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(2000))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW([param], lr=1e-2), sparsecomm.TopK(0.02), exchange="updates"
    )
    twin = torch.nn.Parameter(torch.zeros(2000))
    twin_opt = torch.optim.AdamW([twin], lr=1e-2)
    for _ in range(5):
        grad = torch.randn(2000)
        residual, old = opt.residual(param), param.detach().clone()
        twin_opt.load_state_dict(copy.deepcopy(opt.optimizer.state_dict()))  # no aliasing
        with torch.no_grad():
            twin.copy_(old)
        twin.grad = grad.clone()
        twin_opt.step()
        update = torch.sub(old, twin.detach())
        (param * grad).sum().backward()
        opt.step()
        sent = param.grad != 0
        assert int(sent.sum()) == 40
        assert torch.equal(param.grad + opt.residual(param), residual + update)
        assert torch.equal(param.detach(), old - param.grad)
        opt.zero_grad()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_updates_refuse_a_nonfinite_gradient_before_the_wrapped_optimizer_steps(bad):
    model = model_of()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), exchange="updates"
    )
    for step in range(2):
        step_on(model, opt, step)
    params = [p.detach().clone() for p in model.parameters()]
    moments = opt.optimizer.state[model[0].weight]["exp_avg"].clone()
    model(torch.randn(8, 40)).pow(2).mean().backward()
    model[0].weight.grad[3, 4] = bad
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    assert opt.steps_taken == 2 and opt.total_stats.skipped_steps == 1
    assert torch.equal(opt.optimizer.state[model[0].weight]["exp_avg"], moments)
    assert float(opt.optimizer.state[model[0].weight]["step"]) == 2
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p, before)


def test_updates_step_with_an_empty_parameter():
    """A parameter of no elements has a gradient of no elements, which the finiteness check
    skips (it has no least or greatest element)."""
    model = model_of()
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW([*model.parameters(), empty]), sparsecomm.TopK(0.05), exchange="updates"
    )
    for step in range(2):
        empty.grad = torch.zeros(0, 3)
        step_on(model, opt, step)
    assert opt.steps_taken == 2


def test_updates_copy_the_parameters_into_kept_buffers_on_a_cpu():
    """The values before the wrapped optimizer's step go into the same buffers every step
    (fresh CPU memory each step would fault in its pages at the first write)."""
    model = model_of()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), exchange="local_updates"
    )
    step_on(model, opt, 0)
    kept = {id(p): c.data_ptr() for p, c in opt._step_copies.items()}
    assert len(kept) == len(list(model.parameters()))
    step_on(model, opt, 1)
    assert {id(p): c.data_ptr() for p, c in opt._step_copies.items()} == kept


def test_updates_arguments_are_checked():
    model = model_of()
    with pytest.raises(ValueError, match="'gradients'"):
        sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), exchange="grads"
        )
    with pytest.raises(ValueError, match="momentum_correction works on gradients"):
        dgc(model, sparsecomm.TopK(0.05), exchange="updates")
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), exchange="updates"
    )
    with pytest.raises(RuntimeError, match="inside step"):
        opt.synchronize()
    state = opt.state_dict()
    plain = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05)
    )
    with pytest.raises(ValueError, match="exchange='updates'"):
        plain.load_state_dict(state)


# ------------------------------------------------------------------ exchange="local_updates"


def local(model, compressor=None, lr=1e-2, **kwargs):
    return sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr),
        compressor or sparsecomm.TopK(0.02),
        exchange="local_updates",
        **kwargs,
    )


def shared_of(model, opt):
    with opt.shared_parameters():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("shape", [(1,), (5,)], ids=["broadcasts", "does-not-broadcast"])
def test_a_shared_parameter_of_another_shape_is_refused_before_anything_loads(shape):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = local(model)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    bad = copy.deepcopy(state)
    bad["sparsecomm"]["shared"][0] = torch.zeros(shape)
    bad["sparsecomm"]["steps_taken"] = 7
    before, steps = shared_of(model, opt), opt.steps_taken
    with pytest.raises(ValueError, match=rf"shared parameter 0 has shape \({shape[0]},\)"):
        opt.load_state_dict(bad)
    assert opt.steps_taken == steps
    assert all(torch.equal(a, b) for a, b in zip(shared_of(model, opt), before))


def test_local_updates_on_one_rank_follow_the_wrapped_optimizer():
    """With one rank the shared parameters plus the unsent update are where AdamW alone
    would be (to rounding), while exchange="updates" lags behind by what it has not sent."""
    plain_model, local_model, updates_model = model_of(), model_of(), model_of()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = local(local_model)
    updates = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(updates_model.parameters(), lr=1e-2),
        sparsecomm.TopK(0.02),
        exchange="updates",
    )
    for step in range(10):
        step_on(plain_model, plain, step)
        step_on(local_model, opt, step)
        step_on(updates_model, updates, step)
    for p, q, u in zip(
        plain_model.parameters(), local_model.parameters(), updates_model.parameters()
    ):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        assert float((u - p).detach().abs().max()) > 1e-3  # the update exchange lags behind


def test_local_updates_parameters_are_the_shared_ones_less_the_residual():
    model = model_of()
    opt = local(model)
    shared = shared_of(model, opt)
    for step in range(6):
        step_on(model, opt, step)
        # (step_on zeroes the grads: the average sent is the shared parameters' move)
        now = shared_of(model, opt)
        for param, x, before in zip(model.parameters(), now, shared):
            assert torch.equal(param.detach(), x - opt.residual(param))
            assert not torch.equal(x, before) or param.numel() < 1024
        assert any(not torch.equal(p, x) for p, x in zip(model.parameters(), now))
        shared = now


def test_shared_parameters_swaps_in_and_back_bit_for_bit():
    model = model_of()
    opt = local(model)
    for step in range(4):
        step_on(model, opt, step)
    mine = [p.detach().clone() for p in model.parameters()]
    with opt.shared_parameters():
        inside = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(inside, mine))
    for p, before in zip(model.parameters(), mine):
        assert torch.equal(p, before)
    with pytest.raises(KeyError):  # restored even when the body raises
        with opt.shared_parameters():
            raise KeyError("evaluation failed")
    for p, before in zip(model.parameters(), mine):
        assert torch.equal(p, before)
    plain_model = model_of()
    plain = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(plain_model.parameters()), sparsecomm.TopK(0.02)
    )
    with plain.shared_parameters():  # shared already: nothing to swap
        assert all(
            torch.equal(p, q) for p, q in zip(plain_model.parameters(), model_of().parameters())
        )


def test_local_updates_keep_a_change_made_inside_shared_parameters():
    """Loading weights or clamping after wrapping: inside ``shared_parameters()`` the change
    becomes the shared value (each rank's own: that plus its unsent update) and lasts;
    outside, the next step sets the parameter from the shared one again."""
    model = model_of()
    opt = local(model)
    for step in range(3):
        step_on(model, opt, step)
    weight = model[0].weight
    residual = opt.residual(weight)
    assert residual.abs().sum() > 0  # an unsent update to keep
    rest = [p for p in model.parameters() if p is not weight]
    others = [p.detach().clone() for p in rest]
    with opt.shared_parameters():
        with torch.no_grad():
            weight.fill_(0.5)
    assert torch.equal(weight.detach(), torch.full_like(weight, 0.5) - residual)
    assert torch.equal(shared_of(model, opt)[0], torch.full_like(weight, 0.5))
    assert all(torch.equal(p, q) for p, q in zip(rest, others))  # back as they were
    # Steps that update nothing (lr 0, and AdamW's decay is scaled by lr) keep a rank's own
    # parameters where they are (to rounding: the residual's sent part moves into shared).
    opt.param_groups[0]["lr"] = 0.0
    edited = weight.detach().clone()
    step_on(model, opt, 3)
    torch.testing.assert_close(weight.detach(), edited, rtol=0, atol=1e-6)
    with torch.no_grad():
        weight.fill_(-2.0)  # outside: lost at the next step
    step_on(model, opt, 4)
    torch.testing.assert_close(weight.detach(), edited, rtol=0, atol=1e-6)


def test_local_updates_resume_inside_shared_parameters_is_bitwise():
    """The model and the optimizer loaded inside ``shared_parameters()`` (where the model was
    saved): the loaded shared parameters win, and the run goes on bit for bit."""
    model = model_of()
    opt = local(model)
    for step in range(4):
        step_on(model, opt, step)
    with opt.shared_parameters():
        saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    resumed = model_of(seed=1)
    again = local(resumed)
    with again.shared_parameters():
        resumed.load_state_dict(saved_model)
        again.load_state_dict(saved_opt)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for step in range(4, 6):
        step_on(model, opt, step)
        step_on(resumed, again, step)
    assert all(torch.equal(p, q) for p, q in zip(shared_of(model, opt), shared_of(resumed, again)))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_local_updates_refused_step_changes_nothing():
    model = model_of()
    opt = local(model)
    for step in range(2):
        step_on(model, opt, step)
    params = [p.detach().clone() for p in model.parameters()]
    shared = shared_of(model, opt)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    model[0].weight.grad[0, 0] = float("inf")
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    opt.zero_grad()
    for p, before, x, again in zip(model.parameters(), params, shared, shared_of(model, opt)):
        assert torch.equal(p, before) and torch.equal(x, again)


def test_local_updates_checkpoint_restores_shared_and_local_parameters():
    model = model_of()
    opt = local(model, sparsecomm.TopK(0.02, warmup_steps=3))
    for step in range(5):
        step_on(model, opt, step)
    state = copy.deepcopy(opt.state_dict())
    assert len(state["sparsecomm"]["shared"]) == len(list(model.parameters()))
    mine = [p.detach().clone() for p in model.parameters()]
    shared = shared_of(model, opt)

    fresh = model_of(seed=1)  # other values: load_state_dict sets them
    again = local(fresh, sparsecomm.TopK(0.02, warmup_steps=3))
    again.load_state_dict(state)
    for p, before in zip(fresh.parameters(), mine):
        assert torch.equal(p, before)
    step_on(model, opt, 5)
    step_on(fresh, again, 5)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)

    restart = model_of(seed=2)
    empty = local(restart, sparsecomm.TopK(0.05))
    empty.load_state_dict(state, keep_residuals=False)  # another density: no residuals
    for p, x in zip(restart.parameters(), shared):
        assert torch.equal(p, x)

    broken = copy.deepcopy(state)
    broken["sparsecomm"]["shared"] = broken["sparsecomm"]["shared"][:-1]
    with pytest.raises(ValueError, match="'shared' must be a list"):
        local(model_of(), sparsecomm.TopK(0.02, warmup_steps=3)).load_state_dict(broken)
    updates = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model_of().parameters()),
        sparsecomm.TopK(0.02, warmup_steps=3),
        exchange="updates",
    )
    with pytest.raises(ValueError, match="exchange='local_updates'"):
        updates.load_state_dict(state)


def test_local_updates_add_param_group_shares_the_new_parameters():
    model = model_of()
    opt = local(model)
    for step in range(3):
        step_on(model, opt, step)
    shared = shared_of(model, opt)
    extra = torch.nn.Linear(40, 30)
    opt.add_param_group({"params": list(extra.parameters())})
    with opt.shared_parameters():
        for p, x in zip(model.parameters(), shared):
            assert torch.equal(p, x)
        values = [p.detach().clone() for p in extra.parameters()]
    for p, v in zip(extra.parameters(), values):
        assert torch.equal(p, v)  # not stepped yet: shared and local alike


def test_local_updates_arguments_are_checked():
    model = model_of()
    with pytest.raises(ValueError, match="momentum_correction works on gradients"):
        dgc(model, sparsecomm.TopK(0.05), exchange="local_updates")
    with pytest.raises(ValueError, match="exchange='local_updates' what is compressed"):
        local(model, sparsecomm.TopK(0.05, select="adam"))
    opt = local(model)
    with pytest.raises(RuntimeError, match="inside step"):
        opt.synchronize()
    scaler = torch.amp.GradScaler("cpu")
    model(torch.randn(8, 40)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step(grad_scaler=scaler)


# ------------------------------------------------------------------ two ranks


def test_local_updates_on_two_ranks_share_parameters_and_keep_their_own():
    records = run_ranks(_workers.local_updates, 2, 8)
    for step, (a, b) in enumerate(zip(*records)):
        local_a, shared_a, residual_a, after_a = a
        local_b, shared_b, residual_b, after_b = b
        assert torch.equal(shared_a, shared_b), f"step {step}: shared parameters differ"
        assert not torch.equal(local_a, local_b), f"step {step}: nothing kept locally?"
        for local_, shared, residual, after in (a, b):
            assert torch.equal(local_, shared - residual)
            assert torch.equal(after, local_)  # shared_parameters() swapped back


def test_ranks_agree_and_resume_bitwise_with_every_recipe(tmp_path):
    configs = [
        (sparsecomm.TopK(0.05, warmup_steps=15), "dgc"),
        (sparsecomm.TopK(0.05, warmup_steps=15, warmup="dense"), "adamw"),
        (sparsecomm.Dense(), "dgc"),
        (sparsecomm.TopK(0.05, warmup_steps=15), "adamw-updates"),
        (sparsecomm.TopK(0.05, warmup_steps=15), "adamw-local"),
        (sparsecomm.TopK(0.05, warmup_steps=15), "shared-local"),
        (sparsecomm.TopK(0.05), "catchup"),
        (sparsecomm.TopK(0.05, warmup_steps=15, select="adam"), "catchup"),
        (sparsecomm.TopK(0.05, select="adam"), "adamw"),
    ]
    full = run_ranks(_workers.resume, 2, "full", str(tmp_path), configs, 10, 20)
    run_ranks(_workers.resume, 2, "first", str(tmp_path), configs, 10, 20)
    resumed = run_ranks(_workers.resume, 2, "second", str(tmp_path), configs, 10, 20)
    start = _workers.flat_params(_workers.make_model(seed=0))
    for index, (compressor, optimizer) in enumerate(configs):
        what = f"{compressor} + {optimizer}"
        assert not torch.equal(full[0][index], start), what
        assert torch.equal(full[0][index], full[1][index]), f"{what}: ranks differ"
        assert torch.equal(full[0][index], resumed[0][index]), f"{what}: resume differs"
        assert torch.equal(full[1][index], resumed[1][index]), f"{what}: resume differs"
