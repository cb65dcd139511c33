"""``PerRankAdamW``: AdamW's bits on one rank; its update against a float64 reference of the
formula; the average of W ranks' steps against dense AdamW on the averaged gradient (and
plain AdamW's shortfall there); the wrapper's checks; bad arguments."""

import copy

import _workers
import pytest
import torch
from _dist import run_ranks

import sparsecomm

BETAS = (0.9, 0.999)


def reference_steps(param, grads, lr, eps, weight_decay, world_size):
    """The module's update on one flat float64 parameter, from its formula."""
    beta1, beta2 = BETAS
    p = param.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        g = grad.double()
        p *= 1 - lr * weight_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        v_avg = torch.maximum(v_hat / world_size, torch.minimum(m_hat * m_hat, v_hat))
        p -= lr * m_hat / (v_avg.sqrt() + eps)
    return p


def test_one_rank_is_adamw_bit_for_bit():
    torch.manual_seed(0)
    shapes = [(37, 5), (11,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0}]

    opt = sparsecomm.PerRankAdamW(groups(ours), lr=3e-3, weight_decay=0.1, world_size=1)
    adamw = torch.optim.AdamW(groups(theirs), lr=3e-3, weight_decay=0.1, foreach=False)
    for step in range(25):
        for a, b in zip(ours, theirs):
            # magnitudes from 1e-6 to 1e2; the last parameter has no gradient every third step
            scale = 10.0 ** torch.randint(-6, 3, ()).item()
            grad = None if (a is ours[2] and step % 3 == 0) else torch.randn(a.shape) * scale
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()
        opt.step()
        adamw.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], theirs[0].new_zeros(1).expand_as(ours[0]))


@pytest.mark.parametrize("world_size", [2, 8])
def test_the_update_is_the_formula(world_size):
    torch.manual_seed(1)
    n = 500
    param = torch.nn.Parameter(torch.randn(n))
    start = param.detach().clone()
    # a drift on half the coordinates, noise on all, and a growing scale: each of the three
    # arms of max(v_hat / W, min(m_hat^2, v_hat)) is taken somewhere
    drift = torch.where(torch.arange(n) < n // 2, 0.5, 0.0)
    grads = [(drift + torch.randn(n)) * (1 + t / 5) for t in range(30)]
    opt = sparsecomm.PerRankAdamW([param], lr=1e-2, weight_decay=0.05, world_size=world_size)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    expected = reference_steps(start, grads, 1e-2, 1e-8, 0.05, world_size)
    torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)
    plain = reference_steps(start, grads, 1e-2, 1e-8, 0.05, 1)
    assert (expected - plain).abs().max() > 1e-3  # the estimate changed the steps


def average_of_rank_steps(make, world_size, mean, steps=200, noise=1.0):
    """Shared parameters at zero; each step every rank steps its own optimizer (from the
    shared parameters) on ``mean + noise`` of its own, and the shared parameters move by the
    average of the ranks' steps, as under ``exchange="updates"`` with ``Dense()``."""
    gen = torch.Generator().manual_seed(0)
    shared = torch.zeros_like(mean)
    params = [torch.nn.Parameter(torch.zeros_like(mean)) for _ in range(world_size)]
    opts = [make([p]) for p in params]
    for _ in range(steps):
        moves = []
        for param, opt in zip(params, opts):
            with torch.no_grad():
                param.copy_(shared)
            param.grad = mean + noise * torch.randn(mean.shape, generator=gen)
            opt.step()
            moves.append(param.detach() - shared)
        shared += torch.stack(moves).mean(0)
    return shared


def test_the_average_of_the_ranks_steps_is_dense_adamws_step():
    """Noisy coordinates (drift 0.05, noise 1 on each of 8 ranks): dense AdamW on the
    averaged gradient moves them about 0.05 / sqrt(0.05^2 + 1/8) = 0.14 lr a step; the
    average of 8 plain AdamW steps moves them 0.05 lr, and PerRankAdamW's as dense does."""
    world_size, lr = 8, 1e-3
    mean = torch.full((1000,), 0.05)
    dense = average_of_rank_steps(
        lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), 1, mean, noise=8**-0.5
    )
    ours = average_of_rank_steps(
        lambda ps: sparsecomm.PerRankAdamW(ps, lr=lr, weight_decay=0.0, world_size=8),
        world_size,
        mean,
    )
    plain = average_of_rank_steps(
        lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), world_size, mean
    )
    # moves against the gradient: negative
    dense_move, our_move, plain_move = (-x.mean().item() for x in (dense, ours, plain))
    assert 0.10 * 200 * lr < dense_move < 0.18 * 200 * lr
    assert 0.8 < our_move / dense_move < 1.25
    assert plain_move / dense_move < 0.5


def test_the_wrapper_sets_and_checks_the_world_size():
    model = torch.nn.Linear(40, 40)
    inner = sparsecomm.PerRankAdamW(model.parameters())
    assert inner.world_size is None
    sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05), exchange="updates")
    assert inner.world_size == 1  # one process: the group's size
    with pytest.raises(ValueError, match="world_size=4"):
        sparsecomm.CompressedOptimizer(
            sparsecomm.PerRankAdamW(model.parameters(), world_size=4),
            sparsecomm.TopK(0.05),
            exchange="updates",
        )


def test_the_wrapper_refuses_it_with_gradient_exchange():
    model = torch.nn.Linear(40, 40)
    with pytest.raises(ValueError, match="exchange='updates'.*torch.optim.AdamW"):
        sparsecomm.CompressedOptimizer(
            sparsecomm.PerRankAdamW(model.parameters()), sparsecomm.TopK(0.05)
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"world_size": 2.0}, "world_size"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsecomm.PerRankAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_sparse_gradients_are_refused():
    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(TypeError, match="sparse=False"):
        sparsecomm.PerRankAdamW([param]).step()


def test_a_checkpoint_resumes_bit_for_bit():
    torch.manual_seed(2)
    a = torch.nn.Parameter(torch.randn(64))
    opt = sparsecomm.PerRankAdamW([a], lr=1e-2, world_size=4)
    grads = [torch.randn(64) for _ in range(10)]
    for grad in grads[:5]:
        a.grad = grad.clone()
        opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    resumed = sparsecomm.PerRankAdamW([b], lr=1e-2, world_size=4)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if from a file
    for grad in grads[5:]:
        a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        resumed.step()
    assert torch.equal(a, b)


def test_two_ranks_set_its_world_size_and_stay_identical():
    (size0, params0), (size1, params1) = run_ranks(_workers.per_rank_world_size, 2)
    assert size0 == size1 == 2
    assert torch.equal(params0, params1)
    assert not torch.equal(params0, _workers.flat_params(_workers.make_model(seed=0)))
