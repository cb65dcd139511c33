"""``TopK(select="adam")``: the k largest ``|grad + residual| / (sqrt(max(v, mean(v))) +
eps)`` are sent, ``v`` the wrapped Adam's second moment. The selection against an
independent reference (ties, zeros, NaN, huge and tiny values, odd sizes), conservation of
what is sent plus what is kept, what the engine scores with, a refused step, and the
arguments refused. The CUDA kernels: ``test_kernel_adam_score.py``; two ranks agreeing and
resuming bitwise: ``test_recipes.py``."""

import numpy as np
import pytest
import torch
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from strategies import gradients

import sparsecomm
from sparsecomm.compressors import TopK


def expected_indices(score: torch.Tensor, k: int) -> list[int]:
    """The k largest scores, ordered as the bits of ``|score|`` read as an integer (NaN
    above Inf, -0 == 0), ties to the lower index; ascending."""
    keys = score.cpu().view(torch.int32).numpy().astype(np.int64) & 0x7FFFFFFF
    order = np.lexsort((np.arange(len(keys)), -keys))  # key descending, then index
    return sorted(order[:k].tolist())


@given(acc=gradients(max_size=3000), data=st.data())
def test_compress_scored_sends_the_largest_scores_and_keeps_the_rest(acc, data):
    n = acc.numel()
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    kind = data.draw(st.sampled_from(["random", "ties", "scaled"]))
    if kind == "random":
        divisor = torch.rand(n, generator=gen) * 10 + 1e-8
    elif kind == "ties":
        divisor = torch.tensor([1.0, 2.0, 1e-8])[torch.randint(0, 3, (n,), generator=gen)]
    else:  # one layer of tiny gradients beside one of huge: what Adam evens out
        divisor = torch.where(torch.arange(n) < n // 2, 1e6, 1e-6)
    score = acc.abs() / divisor
    density = data.draw(st.sampled_from([0.001, 0.05, 0.3, 1.0]))
    topk = TopK(density, select="adam")
    k = topk.k_for(n)
    before = acc.clone()
    work = acc.to(DEVICE)
    message = topk.compress_scored(work, score.to(DEVICE), world_size=2)
    want = expected_indices(score, k)
    assert message.count == k and message.numel == n
    assert message.indices.tolist() == want
    assert torch.equal(message.values.cpu().view(torch.int32), before[want].view(torch.int32))
    kept = before.clone()
    kept[want] = 0.0
    assert torch.equal(work.cpu().view(torch.int32), kept.view(torch.int32))


def test_a_nonfinite_sum_is_always_sent():
    acc = torch.randn(1000) * 1e-3
    acc[[17, 500]] = torch.tensor([float("nan"), float("-inf")])
    score = acc.abs() / torch.full((1000,), 1e-8)  # every finite score is large too
    message = TopK(0.002, select="adam").compress_scored(acc.to(DEVICE), score.to(DEVICE), 2)
    assert message.indices.tolist() == [17, 500]
    assert not torch.isfinite(message.peak(2))


def two_scales(seed=0, device="cpu"):
    """Two parameters whose gradients differ by 1e6 in scale: by magnitude the small
    one is never sent, by Adam's scale both are."""
    torch.manual_seed(seed)
    big, small = torch.randn(300, device=device), torch.randn(700, device=device)
    return torch.nn.Parameter(big), torch.nn.Parameter(small)


def grads_at(step, device="cpu"):
    gen = torch.Generator().manual_seed(100 + step)
    big, small = torch.randn(300, generator=gen) * 1e3, torch.randn(700, generator=gen) * 1e-3
    return big.to(device), small.to(device)


def wrapped(params, select, optimizer=torch.optim.AdamW):
    return sparsecomm.CompressedOptimizer(
        optimizer(params, lr=1e-3, eps=1e-6), TopK(0.05, select=select), min_compress_numel=0
    )


def sent_of(opt, params, step):
    """Run a step with ``grads_at(step)``; return, per parameter, the acc before it and the
    mask of what was sent (W = 1: the average is what was sent)."""
    accs = []
    for param, grad in zip(params, grads_at(step, params[0].device)):
        accs.append(grad + opt.residual(param))
        param.grad = grad.clone()
    opt.step()
    sent = [p.grad != 0 for p in params]
    for param, acc, mask in zip(params, accs, sent):
        assert torch.equal(param.grad + opt.residual(param), acc), "not conserved"
        assert torch.equal(param.grad[mask], acc[mask])
    opt.zero_grad()
    return accs, sent


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, sparsecomm.CatchUpAdamW])
def test_the_engine_scores_by_the_optimizers_second_moment(optimizer):
    """On CUDA the k are chosen from a CUDA graph from the third step on."""
    params = two_scales(device=DEVICE)
    opt = wrapped(list(params), "adam", optimizer)
    # Before the optimizer's first step there is no v: the choice is by magnitude.
    _, sent = sent_of(opt, params, 0)
    assert int(sent[0].sum()) == 50 and int(sent[1].sum()) == 0
    for step in range(1, 10):  # (the big one's coordinates not sent yet have v = 0 first)
        variances = [opt.optimizer.state[p]["exp_avg_sq"].clone() for p in params]
        accs, sent = sent_of(opt, params, step)
        # The floor: v's mean over the parameter (its sum as the engine takes it).
        means = [torch._foreach_norm([v], 1)[0] / v.numel() for v in variances]
        scores = [
            a.abs() / (torch.maximum(v, mean).sqrt() + 1e-6)
            for a, v, mean in zip(accs, variances, means)
        ]
        threshold = torch.cat(scores).topk(50).values.min()
        for score, mask in zip(scores, sent):
            assert torch.equal(mask, score >= threshold), step
    assert int(sent[1].sum()) > 0  # the small-gradient parameter takes its turn
    if DEVICE == "cuda":
        assert opt._engine.graphs.replays > 0


def test_bfloat16_values_chosen_by_adam_conserve_exactly():
    """On CUDA the choice replays from a CUDA graph and the rounding follows it."""
    params = two_scales(device=DEVICE)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(params, lr=1e-3, eps=1e-6),
        TopK(0.05, select="adam", value_dtype=torch.bfloat16),
        min_compress_numel=0,
    )
    for step in range(10):
        accs = []
        for param, grad in zip(params, grads_at(step, DEVICE)):
            accs.append(grad + opt.residual(param))
            param.grad = grad.clone()
        opt.step()
        for param, acc in zip(params, accs):  # W = 1: the average is what was sent
            assert torch.equal(param.grad + opt.residual(param), acc), step
            sent = param.grad[param.grad != 0]
            assert torch.equal(sent, sent.bfloat16().float()), step
        assert opt.last_stats.bytes_sent == 6 * 50
        opt.zero_grad()
    if DEVICE == "cuda":
        assert opt._engine.graphs.replays > 0


def test_by_magnitude_the_small_gradients_wait():
    params = two_scales()
    opt = wrapped(list(params), "magnitude")
    for step in range(4):
        _, sent = sent_of(opt, params, step)
        assert int(sent[1].sum()) == 0


def test_select_is_part_of_the_compressor_and_its_schedule():
    topk = TopK(0.001, warmup_steps=10, select="adam")
    assert topk.config()["select"] == "adam"
    assert "select" not in TopK(0.001).config()  # checkpoints of before load as they did
    assert topk.at_step(3).select == "adam" and topk.at_step(3).density > 0.001
    assert repr(TopK(0.01, select="adam")) == "TopK(density=0.01, select='adam')"
    assert topk.graph_signature(1000) is None  # scored eagerly, never from a graph
    assert topk != TopK(0.001, warmup_steps=10)


def test_a_checkpoint_keeps_its_selection():
    params = two_scales()
    opt = wrapped(list(params), "adam")
    sent_of(opt, params, 0)
    state = opt.state_dict()
    other = wrapped(list(two_scales()), "magnitude")
    with pytest.raises(ValueError, match="select"):
        other.load_state_dict(state)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="'magnitude'.*'adam'"):
        TopK(0.01, select="largest")
    params = list(two_scales())
    with pytest.raises(TypeError, match="exp_avg_sq.*AdamW"):
        sparsecomm.CompressedOptimizer(torch.optim.SGD(params, lr=0.1), TopK(0.01, select="adam"))
    with pytest.raises(ValueError, match="exchange='updates'"):
        sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(params), TopK(0.01, select="adam"), exchange="updates"
        )
    with pytest.raises(ValueError, match="CompressedOptimizer"):
        sparsecomm.ddp_comm_hook(TopK(0.01, select="adam"))
    with pytest.raises(ValueError, match="compress_scored"):  # not silently by magnitude
        TopK(0.01, select="adam").compress(torch.ones(100), torch.zeros(100), 2)
    with pytest.raises(ValueError, match=r"group\(s\) \[0\] have eps <= 0"):
        sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(params, eps=0.0), TopK(0.01, select="adam")
        )
    opt = sparsecomm.CompressedOptimizer(torch.optim.AdamW(params[:1]), TopK(0.01, select="adam"))
    with pytest.raises(ValueError, match=r"group\(s\) \[1\] have eps <= 0"):  # as at construction
        opt.add_param_group({"params": params[1:], "eps": 0.0})
    assert len(opt.param_groups) == 1


def expected_sent(grads, variances, eps, k):
    """Which coordinates the score chooses, computed apart from the engine (the mean in
    float64), as masks per parameter."""
    scores = [
        g.abs() / (torch.maximum(v, torch.tensor(v.double().mean().item())).sqrt() + eps)
        for g, v in zip(grads, variances)
    ]
    threshold = torch.cat(scores).topk(k).values.min()
    return [score >= threshold for score in scores]


def test_without_error_feedback_what_is_not_sent_is_dropped():
    params = two_scales()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(params, lr=1e-3, eps=1e-6),
        TopK(0.05, select="adam"),
        error_feedback=False,
        min_compress_numel=0,
    )
    for step in range(6):
        grads = grads_at(step)
        variances = [opt.optimizer.state.get(p, {}).get("exp_avg_sq") for p in params]
        variances = [None if v is None else v.clone() for v in variances]  # (stepped in place)
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        opt.step()
        sent = [p.grad != 0 for p in params]
        assert sum(int(mask.sum()) for mask in sent) == 50
        for param, grad, mask in zip(params, grads, sent):
            assert torch.equal(param.grad[mask], grad[mask])
        if step >= 2:  # every parameter has a v: the choice is the score's, not |grad|'s
            want = expected_sent(grads, variances, 1e-6, 50)
            assert all(torch.equal(a, b) for a, b in zip(sent, want)), step
        opt.zero_grad()


def test_a_refused_step_keeps_the_residuals():
    params = two_scales()
    opt = wrapped(list(params), "adam")
    for step in range(3):
        sent_of(opt, params, step)
    residuals = [opt.residual(p).clone() for p in params]
    moments = opt.optimizer.state[params[0]]["exp_avg_sq"].clone()
    for param, grad in zip(params, grads_at(3)):
        param.grad = grad.clone()
    params[1].grad[5] = float("nan")
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    for param, residual in zip(params, residuals):
        assert torch.equal(opt.residual(param), residual)
    assert torch.equal(opt.optimizer.state[params[0]]["exp_avg_sq"], moments)


def test_eps_is_read_when_the_bucket_is_scored():
    params = list(two_scales())
    opt = wrapped(params, "adam")
    sent_of(opt, params, 0)
    state = opt.state_dict()
    state["optimizer"]["param_groups"][0]["eps"] = 0.5
    opt.load_state_dict(state)  # (torch replaces the group dicts)
    assert opt._engine.adam_state(params[0])[1] == 0.5


def test_a_member_without_state_and_groups_with_their_own_eps():
    """A parameter no rank used at the first step has no Adam state at the second: it is
    scored ``|acc| / (1 + eps)``; each param group's ``eps`` applies to its members."""
    big, small = two_scales()
    # eps 1e6 brings the big one's scores (about 1e3 / 1e6) down to the small one's (1e-3).
    inner = torch.optim.AdamW([{"params": [big], "eps": 1e6}, {"params": [small], "eps": 1e-3}])
    opt = sparsecomm.CompressedOptimizer(inner, TopK(0.05, select="adam"), min_compress_numel=0)
    big.grad = grads_at(0)[0].clone()
    opt.step()  # small unused: no state for it
    opt.zero_grad()
    assert "exp_avg_sq" not in inner.state.get(small, {})
    variance = inner.state[big]["exp_avg_sq"].clone()
    accs, sent = sent_of(opt, (big, small), 1)
    mean = torch._foreach_norm([variance], 1)[0] / variance.numel()
    scores = [
        accs[0].abs() / (torch.maximum(variance, mean).sqrt() + 1e6),
        accs[1].abs() / (1.0 + 1e-3),
    ]
    threshold = torch.cat(scores).topk(50).values.min()
    for score, mask in zip(scores, sent):
        assert torch.equal(mask, score >= threshold)
    assert int(sent[0].sum()) > 0 and int(sent[1].sum()) > 0


def test_the_cuda_chooser_is_a_plain_compressor_and_k_is_cached():
    # AdamChoice is made per bucket and step, holding that bucket's Members (and so its
    # optimizer's exp_avg_sq): it must be a class, not a cache that keeps them alive; the
    # cache belongs to k, which every bucket asks for every step.
    from sparsecomm.compressors import AdamChoice, Compressor, _k_of

    assert isinstance(AdamChoice, type) and issubclass(AdamChoice, Compressor)
    assert AdamChoice(None, 3) is not AdamChoice(None, 3)
    assert _k_of(0.01, 1000) == 10 and _k_of.cache_info().hits + _k_of.cache_info().misses > 0
