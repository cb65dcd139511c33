"""SharedMomentAdamW: AdamW whose second moment is the ranks' averaged gradient's, shared.

Checked against torch's AdamW where they must agree (no refresh; one rank; a refresh every
step with Dense(), against AdamW on the averaged gradient), against its formula after a
refresh, for its refresh schedule and bytes, its checkpoints, and its refusals."""

from __future__ import annotations

import copy
import math

import _workers
import pytest
import torch
from _dist import run_ranks

import sparsecomm


def model_of(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))


def loss_on(model, step):
    gen = torch.Generator().manual_seed(step)
    return model(torch.randn(8, 40, generator=gen)).pow(2).mean()


def test_without_a_refresh_it_is_adamw():
    """Used alone (nothing hands it an average), it is torch's AdamW, to rounding; a
    parameter without a gradient is skipped, as AdamW skips it."""
    ours_model, adamw_model = model_of(), model_of()
    ours = sparsecomm.SharedMomentAdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(12):
        for model, opt in ((ours_model, ours), (adamw_model, adamw)):
            loss_on(model, step).backward()
            if step == 5:
                model[0].bias.grad = None
            opt.step()
            opt.zero_grad()
    for p, q in zip(ours_model.parameters(), adamw_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert ours.state[ours_model[0].bias]["step"] == 11
    assert ours.steps == 12 and all(s["shared_weight"] == 0.0 for s in ours.state.values())


def test_on_one_rank_the_wrapper_never_refreshes_and_it_is_adamw():
    ours_model, adamw_model = model_of(), model_of()
    ours = sparsecomm.CompressedOptimizer(
        sparsecomm.SharedMomentAdamW(ours_model.parameters(), lr=1e-2, refresh_every=1),
        sparsecomm.TopK(0.05),
        exchange="local_updates",
    )
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-2, foreach=False)
    for step in range(8):
        for model, opt in ((ours_model, ours), (adamw_model, adamw)):
            loss_on(model, step).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(ours_model.parameters(), adamw_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert all(s["shared_weight"] == 0.0 for s in ours.optimizer.state.values())


def test_a_refresh_divides_by_the_shared_moment_or_the_rank_s_own_over_w():
    """After a refresh with average ``a`` from W ranks, the step of a coordinate is
    ``lr * m_hat / (sqrt(max(shared_hat, v_hat / W)) + eps)``: where ``a`` is zero (a
    coordinate unseen at the refresh) the rank's own moment over W bounds it."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = sparsecomm.SharedMomentAdamW([param], lr=0.1, weight_decay=0.0, refresh_every=2)
    beta1, beta2 = 0.9, 0.999
    assert opt.average_gradient_due()
    average = torch.tensor([2.0, 0.5, 0.0, -3.0])
    grad = torch.tensor([1.0, 1.0, 1.0, 1.0])
    opt.set_world_size(4)  # as the wrapper says before every step
    opt.take_average_gradient({param: 4 * average})  # the sum over the 4 ranks
    param.grad = grad.clone()
    opt.step()
    shared_hat = average.square()  # one refresh: (1 - d) a^2 / (1 - d)
    v_hat = grad.square()
    m_hat = grad
    denominator = torch.maximum(shared_hat, v_hat / 4).sqrt() + 1e-8
    torch.testing.assert_close(param.detach(), -0.1 * m_hat / denominator, rtol=1e-6, atol=0)
    assert torch.isfinite(param).all()
    # The next step is not a refresh: the shared moment stays, its step counted.
    assert not opt.average_gradient_due()
    before = param.detach().clone()
    param.grad = grad.clone()
    opt.step()
    state = opt.state[param]
    assert state["shared_at"] == 1 and opt.steps == 2
    m = (1 - beta1) * grad * (1 + beta1)
    m_hat = m / (1 - beta1**2)
    v_hat = grad.square()  # the same gradient twice: v_hat is g^2
    denominator = torch.maximum(shared_hat, v_hat / 4).sqrt() + 1e-8
    expected = before - 0.1 * m_hat / denominator
    torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=0)
    # Refreshed again at step 3, after two steps: the old average decays by beta2^2.
    assert opt.average_gradient_due()
    opt.take_average_gradient({param: torch.zeros(4)})
    param.grad = grad.clone()
    opt.step()
    decay = beta2**2
    weight = decay * (1 - beta2) + (1 - decay)
    expected_shared = decay * (1 - beta2) * average.square()
    torch.testing.assert_close(state["shared_exp_avg_sq"], expected_shared, rtol=1e-6, atol=0)
    assert math.isclose(state["shared_weight"], weight, rel_tol=1e-12)
    assert state["shared_at"] == 3


@pytest.mark.parametrize("refresh_every, average_dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_two_ranks_share_the_second_moment_of_their_averaged_gradient(refresh_every, average_dtype):
    """Dense() with exchange="updates" on two ranks: at each refresh (steps 1, 1 +
    refresh_every, ...) the wrapper hands the optimizer the ranks' averaged gradient, summed
    in average_dtype (the shared moment after the first step is its square), sends 2 or 4
    bytes a parameter more, and only then; the ranks' parameters and shared moments agree."""
    steps = 7
    results = run_ranks(_workers.shared_moment, 2, steps, refresh_every, average_dtype)
    params, sent, moments, refreshed, averages = results[0]
    assert torch.equal(params, results[1][0]), "the ranks' parameters differ"
    for step in range(steps):
        assert torch.equal(moments[step], results[1][2][step]), f"step {step}: moments differ"
    if average_dtype == torch.float32:
        torch.testing.assert_close(moments[0], averages[0].square(), rtol=1e-6, atol=1e-12)
    else:  # each rank's gradient rounded to 8 bits: off by up to ~2^-8 of its magnitude
        scale = float(averages[0].abs().max())
        torch.testing.assert_close(moments[0].sqrt(), averages[0].abs(), rtol=0, atol=2**-7 * scale)
    assert refreshed == [1 + refresh_every * (step // refresh_every) for step in range(steps)]
    dense_bytes = 4 * params.numel()  # Dense(): what exchanging the updates sends
    wire = params.numel() * (4 if average_dtype == torch.float32 else 2)
    assert sent == [
        dense_bytes + (wire if step % refresh_every == 0 else 0) for step in range(steps)
    ]
    if refresh_every > 1:  # a second refresh took the later average in, with decay
        assert not torch.equal(moments[refresh_every], moments[refresh_every - 1])


def test_state_dict_resumes_bitwise_and_refuses_another_optimizer_s():
    def run(model, opt, steps, start=0):
        for step in range(start, steps):
            opt.set_world_size(3)  # as the wrapper would, for 3 ranks
            if opt.average_gradient_due():
                gen = torch.Generator().manual_seed(100 + step)
                sums = {p: torch.randn(p.shape, generator=gen) for p in model.parameters()}
                opt.take_average_gradient(sums)
            loss_on(model, step).backward()
            opt.step()
            opt.zero_grad()

    model = model_of()
    opt = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2, refresh_every=4)
    run(model, opt, 6)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # (state_dict() holds the live tensors)
    assert saved["shared_moment"] == {"steps": 6}
    run(model, opt, 12, start=6)

    resumed_model = model_of(seed=1)
    resumed_model.load_state_dict(saved_model)
    resumed = sparsecomm.SharedMomentAdamW(resumed_model.parameters(), lr=1e-2, refresh_every=4)
    resumed.load_state_dict(saved)
    run(resumed_model, resumed, 12, start=6)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)

    other = torch.optim.AdamW(model_of().parameters())
    with pytest.raises(ValueError, match="not a SharedMomentAdamW state"):
        resumed.load_state_dict(other.state_dict())


def test_bfloat16_parameters_keep_float32_moments():
    param = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = sparsecomm.SharedMomentAdamW([param], lr=1e-2)
    param.grad = torch.full((8,), 0.5, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[param]
    assert state["exp_avg"].dtype == state["shared_exp_avg_sq"].dtype == torch.float32
    assert param.dtype == torch.bfloat16 and float(param.detach()[0]) < 1.0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"refresh_every": 0}, ["refresh_every", ">= 1"]),
        ({"refresh_every": 2.5}, ["refresh_every"]),
        ({"betas": (0.9, 1.0)}, ["betas"]),
        ({"lr": -1.0}, ["lr"]),
        ({"average_dtype": torch.float64}, ["average_dtype", "bfloat16"]),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(ValueError) as info:
        sparsecomm.SharedMomentAdamW(model_of().parameters(), **kwargs)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_float64_parameters_are_refused():
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        sparsecomm.SharedMomentAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_the_gradient_exchange_refuses_it_naming_the_exchange_to_use():
    inner = sparsecomm.SharedMomentAdamW(model_of().parameters())
    with pytest.raises(ValueError, match="exchange='local_updates'"):
        sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.01))


def test_resumed_on_one_rank_or_unwrapped_it_is_adamw_again():
    """A state saved on 3 ranks, loaded where nothing says otherwise (one rank, or no
    wrapper): the world size is 1, and the shared moment it carries is left out."""
    model = model_of()
    opt = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2, refresh_every=2)
    for step in range(5):
        opt.set_world_size(3)
        if opt.average_gradient_due():
            opt.take_average_gradient({p: 50 * torch.ones_like(p) for p in model.parameters()})
        loss_on(model, step).backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    results = []
    for forget_shared in (False, True):
        resumed_model = model_of(seed=1)
        resumed_model.load_state_dict(model.state_dict())
        resumed = sparsecomm.SharedMomentAdamW(resumed_model.parameters(), lr=1e-2)
        state = copy.deepcopy(saved)
        if forget_shared:
            for entry in state["state"].values():
                entry["shared_exp_avg_sq"].zero_()
                entry["shared_weight"] = 0.0
        resumed.load_state_dict(state)
        assert resumed.world_size == 1
        loss_on(resumed_model, 5).backward()
        resumed.step()
        results.append([p.detach().clone() for p in resumed_model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_an_entry_without_state_saves_and_loads():
    """torch's state is a defaultdict: looking up a parameter that never had a gradient
    leaves an empty entry, which state_dict() saves and load_state_dict() must take."""
    model = model_of()
    opt = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2)
    loss_on(model, 0).backward()
    model[0].bias.grad = None
    opt.step()
    assert opt.state[model[0].bias] == {}  # the lookup makes the empty entry
    saved = copy.deepcopy(opt.state_dict())
    again = sparsecomm.SharedMomentAdamW(model_of().parameters(), lr=1e-2)
    again.load_state_dict(saved)
    assert again.steps == 1


def test_deepcopy_and_pickle_keep_its_own_settings():
    model = model_of()
    opt = sparsecomm.SharedMomentAdamW(
        model.parameters(), refresh_every=7, average_dtype=torch.float32
    )
    opt.set_world_size(2)
    loss_on(model, 0).backward()
    opt.step()
    for other in (copy.deepcopy(opt), torch.load(_saved(opt), weights_only=False)):
        assert (other.refresh_every, other.average_dtype, other.steps, other.world_size) == (
            7,
            torch.float32,
            1,
            2,
        )
        assert not other.average_gradient_due()


def _saved(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_two_ranks_whose_refresh_schedules_differ_refuse_on_both():
    results = run_ranks(_workers.shared_moment_out_of_step, 2)
    for rank, (message, params_equal) in enumerate(results):
        assert "disagree on whether this step refreshes" in message, (rank, message)
        assert params_equal, f"rank {rank}: the refused step changed the parameters"


def test_two_ranks_step_as_adamw_on_the_average_where_the_floor_does_not_bind():
    """The point of it, one step with a refresh in float32: on every coordinate where no
    rank's squared gradient over W exceeds the averaged gradient's (the floor does not
    bind), the average of the ranks' steps is dense AdamW's step on the averaged gradient,
    to rounding."""
    (shared, per_rank, dense), grads = run_ranks(_workers.shared_moment_against_dense, 2)[0]
    average = (grads[0] + grads[1]) / 2
    free = (grads[0].square() / 2 < 0.99 * average.square()) & (
        grads[1].square() / 2 < 0.99 * average.square()
    )
    assert float(free.float().mean()) > 0.5  # most coordinates: the ranks mostly agree
    torch.testing.assert_close(shared[free], dense[free], rtol=0, atol=1e-6)
    # (Per-rank AdamW's first step is lr * sign(g_i): dense's where the ranks' signs agree,
    # half as far where they differ.)
    assert float((per_rank - dense).abs().max()) > 1e-3
    # Where it binds, the step is smaller than dense AdamW's: never larger.
    start = _workers.flat_params(_workers.make_model(seed=0))
    bound = ~free & (average != 0)
    assert bool(((shared - start)[bound].abs() <= (dense - start)[bound].abs() + 1e-6).all())


def test_the_batched_step_of_cuda_gives_the_per_tensor_step_s_bits(monkeypatch):
    """On CUDA a group steps in foreach launches, on a CPU tensor by tensor: the same
    operations, so the same bits (here both on the CPU, the batched path forced)."""
    from sparsecomm import shared_moment

    results = []
    for batched in (False, True):
        monkeypatch.setattr(shared_moment, "_batched", lambda params, b=batched: b)
        model = _workers.make_model(seed=0)
        opt = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2, refresh_every=2)
        for step in range(5):
            _workers.shared_moment_step(model, opt, step)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_refresh_leaves_out_what_no_rank_has_a_gradient_for():
    """As AdamW leaves a parameter without a gradient alone, a refresh leaves the shared
    moment of one that no rank used this step as it was, and sends nothing for it; one
    that a single rank used takes in that rank's gradient over the number of ranks."""
    (states, sent, _), (states_1, sent_1, second_grad) = run_ranks(_workers.shared_moment_unused, 2)
    assert sent == sent_1
    for mine, theirs in zip(states, states_1):  # the same bits on both ranks
        assert mine.keys() == theirs.keys()
        for name in mine:
            for key, value in mine[name].items():
                other = theirs[name][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    first_then, first_now = states[0]["first"], states[1]["first"]
    assert first_now["shared_at"] == first_then["shared_at"] == 1
    assert first_now["shared_weight"] == first_then["shared_weight"]
    assert torch.equal(first_now["shared_exp_avg_sq"], first_then["shared_exp_avg_sq"])
    assert states[1]["always"]["shared_at"] == 2
    second = states[1]["second"]  # first refreshed at step 2, by rank 1's gradient alone
    assert second["shared_at"] == 2
    torch.testing.assert_close(
        second["shared_exp_avg_sq"] / second["shared_weight"], (second_grad / 2).square()
    )
    # Each step: Dense() sends the three weights' updates (4 bytes an element), and the
    # refresh the two weights some rank used (4 bytes an element in float32), not three.
    assert sent == [4 * 16 * 3 + 4 * 16 * 2] * 2
