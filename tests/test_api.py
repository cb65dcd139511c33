"""The public API on one process: constructor errors, shared param_groups, schedulers,
state_dict, stats, residuals, and the package layout."""

import inspect
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import sparsecomm

ROOT = Path(__file__).resolve().parents[1]


COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.float16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(1e-3),
    sparsecomm.TopK(0.05),
]


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 40, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------ constructor errors

_MODEL = small_model()

# (what, thunk, error type, words the message must contain)
ERROR_TABLE = [
    ("TopK(0)", lambda: sparsecomm.TopK(0), ValueError, ["density", "0", "(0, 1]"]),
    (
        "TopK(1.5)",
        lambda: sparsecomm.TopK(1.5),
        ValueError,
        ["density", "1.5", "TopK(density=0.01)"],
    ),
    ("TopK(-0.1)", lambda: sparsecomm.TopK(-0.1), ValueError, ["density", "-0.1"]),
    ("TopK(nan)", lambda: sparsecomm.TopK(float("nan")), ValueError, ["density", "nan"]),
    ("TopK('1%')", lambda: sparsecomm.TopK("1%"), TypeError, ["density", "'1%'", "float"]),
    ("TopK(True)", lambda: sparsecomm.TopK(True), TypeError, ["density", "True"]),
    ("Threshold(-1)", lambda: sparsecomm.Threshold(-1), ValueError, ["threshold", "-1", ">= 0"]),
    (
        "Threshold(inf)",
        lambda: sparsecomm.Threshold(float("inf")),
        ValueError,
        ["threshold", "inf", "finite"],
    ),
    ("Threshold(None)", lambda: sparsecomm.Threshold(None), TypeError, ["threshold", "None"]),
    (
        "Cast(int8)",
        lambda: sparsecomm.Cast(torch.int8),
        ValueError,
        ["dtype", "torch.int8", "torch.float16", "Dense()"],
    ),
    (
        "Cast(float32)",
        lambda: sparsecomm.Cast(torch.float32),
        ValueError,
        ["torch.float32", "Dense()"],
    ),
    (
        "Cast('fp16')",
        lambda: sparsecomm.Cast("fp16"),
        TypeError,
        ["dtype", "'fp16'", "Cast(torch.float16)"],
    ),
    (
        "non-optimizer",
        lambda: sparsecomm.CompressedOptimizer(_MODEL.parameters(), sparsecomm.Dense()),
        TypeError,
        ["optimizer", "generator", "torch.optim.SGD"],
    ),
    (
        "wrapped twice",
        lambda: sparsecomm.CompressedOptimizer(
            sparsecomm.CompressedOptimizer(sgd(_MODEL), sparsecomm.Dense()), sparsecomm.Dense()
        ),
        TypeError,
        ["already a CompressedOptimizer"],
    ),
    (
        "compressor class, not instance",
        lambda: sparsecomm.CompressedOptimizer(sgd(_MODEL), sparsecomm.TopK),
        TypeError,
        ["compressor", "TopK(density)"],
    ),
    (
        "unknown keyword",
        lambda: sparsecomm.CompressedOptimizer(
            sgd(_MODEL), sparsecomm.Dense(), error_feedbak=False
        ),
        TypeError,
        ["'error_feedbak'", "did you mean 'error_feedback'"],
    ),
    (
        "error_feedback not bool",
        lambda: sparsecomm.CompressedOptimizer(
            sgd(_MODEL), sparsecomm.Dense(), error_feedback="yes"
        ),
        TypeError,
        ["error_feedback", "'yes'"],
    ),
    (
        "bucket_cap_mb 0",
        lambda: sparsecomm.CompressedOptimizer(sgd(_MODEL), sparsecomm.Dense(), bucket_cap_mb=0),
        ValueError,
        ["bucket_cap_mb", "0", "25"],
    ),
    (
        "bucket_cap_mb 0 under TopK names its default",
        lambda: sparsecomm.CompressedOptimizer(sgd(_MODEL), sparsecomm.TopK(0.1), bucket_cap_mb=0),
        ValueError,
        ["bucket_cap_mb", "0", "100", "TopK"],
    ),
    (
        "min_compress_numel negative",
        lambda: sparsecomm.CompressedOptimizer(
            sgd(_MODEL), sparsecomm.Dense(), min_compress_numel=-1
        ),
        ValueError,
        ["min_compress_numel", "-1"],
    ),
    (
        "process_group without init",
        lambda: sparsecomm.CompressedOptimizer(
            sgd(_MODEL), sparsecomm.Dense(), process_group=object()
        ),
        ValueError,
        ["process_group", "init_process_group"],
    ),
    (
        "float64 parameters",
        lambda: sparsecomm.CompressedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], lr=0.1),
            sparsecomm.Dense(),
        ),
        TypeError,
        ["torch.float64", "float32"],
    ),
]


@pytest.mark.parametrize("what,thunk,error,words", ERROR_TABLE, ids=[e[0] for e in ERROR_TABLE])
def test_constructor_errors_name_argument_value_and_fix(what, thunk, error, words):
    with pytest.raises(error) as caught:
        thunk()
    for word in words:
        assert word in str(caught.value), f"{what}: {word!r} missing from: {caught.value}"


def test_the_keywords_named_in_errors_are_the_constructors():
    from sparsecomm import optimizer

    signature = inspect.signature(sparsecomm.CompressedOptimizer.__init__).parameters
    named = [k for k, v in signature.items() if v.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(optimizer._KEYWORDS) == sorted(["compressor", *named])


@pytest.mark.parametrize("hook", [False, True], ids=["optimizer", "ddp_comm_hook"])
def test_a_backend_name_as_process_group_is_refused_by_name(hook):
    with pytest.raises(TypeError, match="process_group must be None .* got 'gloo'"):
        if hook:
            sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01), process_group="gloo")
        else:
            sparsecomm.CompressedOptimizer(
                sgd(small_model()), sparsecomm.TopK(0.01), process_group="gloo"
            )


def test_residual_of_a_foreign_tensor_raises():
    opt = sparsecomm.CompressedOptimizer(sgd(_MODEL), sparsecomm.TopK(0.1))
    with pytest.raises(ValueError, match="not a parameter"):
        opt.residual(torch.zeros(3))


def test_bad_kernel_mode_is_named(monkeypatch):
    monkeypatch.setenv("SPARSECOMM_KERNELS", "cuda")
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    with pytest.raises(ValueError, match="SPARSECOMM_KERNELS='cuda'"):
        train(model, opt, 1)


# ------------------------------------------------------------------ local behaviour


def test_local_run_without_process_group_compresses_and_keeps_residuals():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05), min_compress_numel=0)
    assert opt.world_size == 1 and opt.rank == 0
    train(model, opt, 3)
    residual = opt.residual(model[0].weight)
    assert residual.shape == model[0].weight.shape and residual.dtype == torch.float32
    assert residual.abs().sum() > 0
    stats = opt.last_stats
    # One bucket of 2203 elements: k = ceil(0.05 * 2203) = 111 pairs of 8 bytes.
    assert stats.elements == 40 * 50 + 50 + 50 * 3 + 3
    assert stats.dense_bytes == 4 * 2203
    assert stats.elements_sent == 111 and stats.bytes_sent == 8 * 111
    assert stats.density == 111 / 2203
    assert opt.total_stats.steps == 3
    assert opt.total_stats.bytes_sent == 3 * stats.bytes_sent
    assert set(stats.as_dict()) >= {"bytes_sent", "dense_bytes", "density"}


def test_without_error_feedback_residuals_are_zero():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05), error_feedback=False)
    train(model, opt, 2)
    assert torch.equal(opt.residual(model[0].weight), torch.zeros(50, 40))


def test_dense_on_one_process_equals_the_plain_optimizer():
    a, b = small_model(), small_model()
    plain = sgd(a)
    wrapped = sparsecomm.CompressedOptimizer(sgd(b), sparsecomm.Dense())
    train(a, plain, 5)
    train(b, wrapped, 5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_small_parameters_travel_dense_by_default():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.01))
    train(model, opt, 1)
    # Only the 2000-element weight is compressed; biases and the 150-element weight are not.
    assert opt.residual(model[0].weight).abs().sum() > 0
    for p in (model[0].bias, model[2].weight, model[2].bias):
        assert torch.equal(opt.residual(p), torch.zeros_like(p))


@pytest.mark.parametrize(
    "compressor, cap",
    [
        (sparsecomm.Dense(), 25.0),
        (sparsecomm.Cast(torch.bfloat16), 25.0),
        (sparsecomm.TopK(0.01), 100.0),
        (sparsecomm.TopK(0.01, select="adam"), 100.0),
        (sparsecomm.Threshold(1e-3), 100.0),
    ],
)
def test_bucket_size_defaults_to_the_compressors(compressor, cap):
    # Two 16 MiB weights: one bucket each at 25 MiB, one bucket for both at 100 MiB.
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048, bias=False), torch.nn.Linear(2048, 2048, bias=False)
    )
    inner = torch.optim.AdamW(model.parameters())
    opt = sparsecomm.CompressedOptimizer(inner, compressor)
    assert opt.bucket_cap_mb == cap
    assert len(opt._engine.buckets) == (2 if cap == 25.0 else 1)
    explicit = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), compressor, bucket_cap_mb=16
    )
    assert explicit.bucket_cap_mb == 16 and len(explicit._engine.buckets) == 2


def test_a_large_model_gets_larger_sparse_buckets_by_default():
    """TopK and Threshold keep a model to about default_max_buckets buckets (16) where their
    default size would make more: here scaled down, at most 3 buckets of at least 0.01 MiB.
    Frozen parameters do not count; a given bucket_cap_mb, and Dense, keep their size."""

    class Few(sparsecomm.TopK):
        default_bucket_cap_mb = 0.01  # 2621 float32s: one 64 x 64 weight per bucket
        default_max_buckets = 3

    assert sparsecomm.TopK(0.01).default_max_buckets == 16
    assert sparsecomm.Threshold(1e-3).default_max_buckets == 16
    assert sparsecomm.Dense().default_max_buckets is None
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(9)])
    model[0].requires_grad_(False)
    training = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = sparsecomm.CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), Few(0.1))
    assert opt.bucket_cap_mb == pytest.approx(4 * training / 2**20 / 3)
    compressed = [b for b in opt._engine.buckets if b.compressed]
    assert 3 <= len(compressed) <= 4, [b.numel for b in compressed]
    given = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), Few(0.1), bucket_cap_mb=0.01
    )
    assert given.bucket_cap_mb == 0.01
    assert len([b for b in given._engine.buckets if b.compressed]) == 8
    small = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(small_model().parameters(), lr=0.1), sparsecomm.TopK(0.1)
    )
    assert small.bucket_cap_mb == 100.0


def test_a_compressor_with_a_bad_default_bucket_size_is_refused():
    class Odd(sparsecomm.Dense):
        default_bucket_cap_mb = 0

    with pytest.raises(ValueError, match="Odd.default_bucket_cap_mb must be a number > 0"):
        sparsecomm.CompressedOptimizer(sgd(_MODEL), Odd())
    opt = sparsecomm.CompressedOptimizer(sgd(_MODEL), Odd(), bucket_cap_mb=1)
    assert opt.bucket_cap_mb == 1


def test_param_groups_are_shared_so_schedulers_and_zero_grad_work():
    model = small_model()
    inner = sgd(model)
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.1))
    assert opt.param_groups is inner.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    model(torch.randn(2, 40)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_param_groups_stay_shared_after_the_wrapped_optimizers_own_load():
    """The wrapped optimizer's load_state_dict() builds new containers (as the refusal of
    a plain optimizer's state advises: opt.optimizer.load_state_dict(state)); a scheduler
    on the wrapper must still reach them."""
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    train(model, opt, 1)
    opt.optimizer.load_state_dict(opt.optimizer.state_dict())
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    assert opt.optimizer.param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("exchange", ["updates", "local_updates"])
def test_a_nonfinite_update_is_named_as_an_update_whose_state_has_stepped(exchange):
    """Finite gradients, an infinite learning rate: the update is what is not finite, the
    wrapped optimizer's state has stepped, and a GradScaler (which these exchanges refuse)
    is not offered as the fix; a non-finite gradient says so, without the scaler too."""
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=float("inf"))
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.1), exchange=exchange)
    model(torch.randn(2, 40)).sum().backward()
    with pytest.raises(sparsecomm.NonFiniteGradientError) as info:
        opt.step()
    message = str(info.value)
    assert info.value.update and "non-finite update" in message
    assert "stepped its own state" in message and "GradScaler" not in message
    opt.zero_grad()
    model(torch.full((2, 40), float("nan"))).sum().backward()
    with pytest.raises(sparsecomm.NonFiniteGradientError) as info:
        opt.step()
    assert not info.value.update and "non-finite gradient" in str(info.value)
    assert "GradScaler" not in str(info.value)


def test_a_parameter_listed_twice_is_refused():
    """torch.optim only warns about a parameter listed twice; its gradient would be
    exchanged twice (with TopK, one copy as zeros), so sparsecomm refuses it."""
    model = small_model()
    params = list(model.parameters())
    with pytest.warns(UserWarning, match="duplicate"):
        inner = torch.optim.SGD(params + [params[0]], lr=0.1)
    with pytest.raises(ValueError, match="listed twice"):
        sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.1))


def test_add_param_group_keeps_residuals_and_compresses_new_params():
    model = small_model()
    extra = torch.nn.Linear(40, 30)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.05), min_compress_numel=0
    )
    train(model, opt, 2)
    before = opt.residual(model[0].weight)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert torch.equal(opt.residual(model[0].weight), before)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.01
    x = torch.randn(4, 40)
    (model(x).sum() + extra(x).sum()).backward()
    opt.step()
    assert opt.residual(extra.weight).abs().sum() > 0


@pytest.mark.parametrize("exchange", ["gradients", "updates"])
def test_a_parameter_unfrozen_after_wrapping_is_refused_before_anything_is_sent(exchange):
    """On the first step (no overlap yet) step() raises; nothing changes."""
    model = small_model()
    model[0].requires_grad_(False)
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1), exchange=exchange)
    model[0].requires_grad_(True)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"parameter 0 \(float32 \(50, 40\) on cpu\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_add_param_group_refuses_a_parameter_unfrozen_after_wrapping():
    model = small_model()
    model[0].requires_grad_(False)
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match="wrap the optimizer again"):
        opt.add_param_group({"params": torch.nn.Linear(3, 3).parameters()})
    assert len(opt.param_groups) == 1


def test_synchronize_without_the_grad_scaler_is_refused_by_name():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(8, 40)).pow(2).mean()).backward()
    scaler.unscale_(opt)
    opt.synchronize()
    with pytest.raises(RuntimeError, match=r"opt.synchronize\(scaler\)"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.total_stats.skipped_steps == 1


def test_a_step_without_any_gradient_leaves_the_schedule_where_it_was():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.01, warmup_steps=10))
    for _ in range(3):
        opt.step()  # no backward anywhere
    assert opt.steps_taken == 0
    train(model, opt, 2)
    assert opt.steps_taken == 2


def test_synchronize_with_a_disabled_grad_scaler_is_plain_synchronize():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    before = model[0].weight.detach().clone()
    scaler.scale(model(torch.randn(8, 40)).pow(2).mean()).backward()
    scaler.unscale_(opt)
    opt.synchronize(scaler)
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model[0].weight, before)
    assert opt.steps_taken == 1


def test_bf16_parameters_keep_fp32_residuals():
    model = small_model().to(torch.bfloat16)
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05), min_compress_numel=0)
    model(torch.randn(8, 40, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    assert model[0].weight.grad.dtype == torch.bfloat16
    residual = opt.residual(model[0].weight)
    assert residual.dtype == torch.float32 and residual.abs().sum() > 0


def _poison(grad):
    grad = grad.clone()
    grad[1, 1] = float("nan")
    return grad


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_nonfinite_gradient_raises_and_changes_nothing_locally(compressor, overlap):
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), compressor, overlap=overlap)
    train(model, opt, 2)
    params = [p.detach().clone() for p in model.parameters()]
    residual = opt.residual(model[0].weight)
    if overlap:  # the NaN arrives during backward, which sends the bucket itself
        handle = model[0].weight.register_hook(_poison)
        model(torch.randn(2, 40)).sum().backward()
        handle.remove()
    else:  # exchanged in step(), from .grad as it is then
        model(torch.randn(2, 40)).sum().backward()
        model[0].weight.grad[1, 1] = float("nan")
    with pytest.raises(sparsecomm.NonFiniteGradientError, match=r"rank\(s\) \[0\]"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    assert torch.equal(residual, opt.residual(model[0].weight))
    opt.zero_grad()
    train(model, opt, 1)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("all_used", [True, False])
def test_averages_are_queued_before_the_host_waits_unless_a_parameter_went_unused(all_used, nan):
    # When every parameter had a gradient here, the refusal (decided on the device) is all
    # the averages need, so they are queued before the step's one host wait; a parameter
    # without one needs the ranks' used flags first. Either way a refused step leaves the
    # residuals and parameters exactly as they were.
    model = small_model()
    extra = torch.nn.Linear(3, 3)  # used only when all_used
    params = [*model.parameters(), *extra.parameters()]
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.05), min_compress_numel=1
    )
    gen = torch.Generator().manual_seed(0)

    def backward():
        out = model(torch.randn(8, 40, generator=gen))
        (extra(out) if all_used else out).pow(2).mean().backward()

    for _ in range(2):
        backward()
        opt.step()
        opt.zero_grad()
    order = []
    finish, agree = opt._engine.finish, opt._agree_on_step
    opt._engine.finish = lambda *a: (order.append("finish"), finish(*a))[1]
    opt._agree_on_step = lambda *a: (order.append("wait"), agree(*a))[1]
    before = [p.detach().clone() for p in params]
    residuals = [opt.residual(p).clone() for p in params]
    handle = model[0].weight.register_hook(_poison) if nan else None
    backward()
    if nan:
        handle.remove()
        with pytest.raises(sparsecomm.NonFiniteGradientError):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(before, params))
        assert all(torch.equal(r, opt.residual(p)) for r, p in zip(residuals, params))
        assert all(p.grad is None for p in params)
    else:
        opt.step()
        assert not all(torch.equal(p, q) for p, q in zip(before, params))
    assert order == (["finish", "wait"] if all_used else ["wait"] + ["finish"] * (not nan))


def test_profile_records_times():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05), profile=True)
    train(model, opt, 1)
    stats = opt.last_stats
    assert stats.compress_seconds > 0 and stats.aggregate_seconds > 0
    assert stats.communicate_seconds == 0  # one process: no collectives ran


# ------------------------------------------------------------------ state_dict


def test_state_dict_round_trip_with_weights_only_and_resume_is_bitwise():
    reference, resumed = small_model(), small_model()
    opt_ref = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(reference.parameters()), sparsecomm.TopK(0.05)
    )
    train(reference, opt_ref, 10, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": reference.state_dict(), "opt": opt_ref.state_dict()}, buffer)
    train(reference, opt_ref, 10, seed=2)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed.load_state_dict(saved["model"])
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(resumed.parameters()), sparsecomm.TopK(0.05)
    )
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.total_stats.steps == 10
    train(resumed, opt, 10, seed=2)
    for p, q in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_state_dict_between_an_exchanged_backward_and_step_is_refused():
    # The residuals are this step's then, the optimizer's state the step before's: resumed
    # from there, the step's gradient would count twice.
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.1)
    )
    for step in range(3):
        model(torch.randn(4, model[0].in_features)).sum().backward()
        if step == 0:  # the first step exchanges in step(): nothing changed yet
            opt.state_dict()
        else:
            with pytest.raises(RuntimeError, match=r"after step\(\)"):
                opt.state_dict()
        opt.step()
        opt.state_dict()
        opt.zero_grad()


def test_load_state_dict_between_an_exchanged_backward_and_step_is_refused():
    # step() would apply the exchanged average on top of the loaded state.
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.1)
    )
    for _ in range(2):
        model(torch.randn(4, model[0].in_features)).sum().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    model(torch.randn(4, model[0].in_features)).sum().backward()  # exchanged in backward
    kept = [opt.residual(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"Load before backward\(\)"):
        opt.load_state_dict(saved)
    assert all(torch.equal(opt.residual(p), r) for p, r in zip(model.parameters(), kept))
    opt.zero_grad()  # leaves the step: loading works again
    opt.load_state_dict(saved)


def test_load_state_dict_errors_say_what_differs():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, opt, 1)
    state = opt.state_dict()

    other = sparsecomm.CompressedOptimizer(
        sgd(torch.nn.Sequential(torch.nn.Linear(40, 51), torch.nn.ReLU(), torch.nn.Linear(51, 3))),
        sparsecomm.TopK(0.05),
    )
    with pytest.raises(
        ValueError, match=r"parameter 0 is shape \(50, 40\) on the checkpoint but shape \(51, 40\)"
    ):
        other.load_state_dict(state)

    wrong_world = {**state, "sparsecomm": {**state["sparsecomm"], "world_size": 4}}
    with pytest.raises(ValueError, match="world_size=4.*world_size=1.*keep_residuals=False"):
        opt.load_state_dict(wrong_world)

    wrong_rank = {**state, "sparsecomm": {**state["sparsecomm"], "rank": 2}}
    with pytest.raises(ValueError, match="saved by rank 2"):
        opt.load_state_dict(wrong_rank)

    with pytest.raises(ValueError, match="not a CompressedOptimizer.state_dict"):
        opt.load_state_dict(sgd(model).state_dict())

    adamw = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05)
    )
    for keep_residuals in (True, False):  # (AdamW would raise KeyError 'betas' at its step)
        with pytest.raises(ValueError, match="saved wrapping SGD, this optimizer wraps AdamW"):
            adamw.load_state_dict(state, keep_residuals=keep_residuals)

    class LoggingSGD(torch.optim.SGD):
        pass

    # A subclass of the saved optimizer's class (or its base) has its state layout: loads.
    sub = sparsecomm.CompressedOptimizer(
        LoggingSGD(model.parameters(), lr=0.1, momentum=0.9), sparsecomm.TopK(0.05)
    )
    sub.load_state_dict(state)
    opt.load_state_dict(sub.state_dict())


def test_keep_residuals_false_moves_to_another_world_size_or_compressor():
    """The warm-up's clock, the statistics and the wrapped optimizer's state carry over;
    the residuals start empty; another model is still refused."""
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05, warmup_steps=20)
    )
    train(model, opt, 6)
    state = opt.state_dict()
    assert any(r is not None and r.abs().sum() > 0 for r in state["sparsecomm"]["residuals"])
    on_four = {**state, "sparsecomm": {**state["sparsecomm"], "world_size": 4, "rank": 3}}
    for compressor in (sparsecomm.TopK(0.05, warmup_steps=20), sparsecomm.TopK(0.01)):
        again = sparsecomm.CompressedOptimizer(torch.optim.AdamW(model.parameters()), compressor)
        with pytest.raises(ValueError, match="keep_residuals=False"):
            again.load_state_dict(on_four)
        again.load_state_dict(on_four, keep_residuals=False)
        assert again.steps_taken == 6 and again.total_stats.steps == 6
        inner = again.optimizer.state_dict()["state"]
        for index, saved in state["optimizer"]["state"].items():
            assert torch.equal(inner[index]["exp_avg_sq"], saved["exp_avg_sq"])
        residuals = again.state_dict()["sparsecomm"]["residuals"]
        assert all(r is None or not r.any() for r in residuals)
    warm = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05, warmup_steps=20)
    )
    warm.load_state_dict(on_four, keep_residuals=False)
    train(model, warm, 1)
    # the warm-up's 7th step (0.25 * 0.2^(6/20) = 0.154), not its first (0.25)
    assert warm.last_stats.scheduled_density == pytest.approx(0.25 * 0.2 ** (6 / 20))
    assert warm.steps_taken == 7

    other = sparsecomm.CompressedOptimizer(
        sgd(torch.nn.Sequential(torch.nn.Linear(40, 51), torch.nn.ReLU(), torch.nn.Linear(51, 3))),
        sparsecomm.TopK(0.05),
    )
    with pytest.raises(ValueError, match=r"parameter 0 is shape \(50, 40\)"):
        other.load_state_dict(state, keep_residuals=False)
    # The wrapped optimizer's groups carry its momentum: a state of SGD(momentum=0.9) in an
    # optimizer that applies momentum_correction would apply momentum twice.
    with_momentum = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, with_momentum, 1)
    corrected = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.05), momentum_correction=0.9
    )
    with pytest.raises(ValueError, match="momentum_correction"):
        corrected.load_state_dict(with_momentum.state_dict(), keep_residuals=False)


# ------------------------------------------------------------------ packaging


def test_triton_kernels_install_inside_the_sparsecomm_namespace(tmp_path):
    import sparsecomm.triton_kernels.topk as topk

    assert hasattr(topk, "topk_compress_ref")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    (wheel,) = tmp_path.glob("sparsecomm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names}
    assert packages == {"sparsecomm", wheel.name.split("-py3")[0] + ".dist-info"}, packages
    assert "sparsecomm/triton_kernels/topk.py" in names
    assert not any(name.startswith("triton_kernels/") for name in names)


def test_an_optimizer_that_needs_a_closure_is_refused_by_name():
    # LBFGS evaluates (and backpropagates) its closure several times in one step.
    model = small_model()
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) needs a closure.*first-order"):
        sparsecomm.CompressedOptimizer(torch.optim.LBFGS(model.parameters()), sparsecomm.TopK(0.1))


@pytest.mark.parametrize("cycle_momentum", [True, False])
def test_a_scheduler_cycling_momentum_is_refused_under_momentum_correction(cycle_momentum):
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        sparsecomm.TopK(0.1),
        momentum_correction=0.9,
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=10, cycle_momentum=cycle_momentum
    )
    model(torch.randn(4, 40)).sum().backward()
    if cycle_momentum:  # it wrote momentum into the groups: SGD would apply it twice
        with pytest.raises(ValueError, match="cycle_momentum=False"):
            opt.step()
        return
    opt.step()
    scheduler.step()
    assert "momentum_buffer" not in str(opt.optimizer.state_dict()["state"])


def test_frozen_parameters_keep_the_step_on_its_fast_path():
    # A frozen parameter has no bucket: it must not count as a parameter without a
    # gradient, which would send every step's used flags from the host and queue the
    # averages only after the verdict.
    model = small_model()
    model[0].requires_grad_(False)
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.1))
    reference = small_model()
    reference[0].requires_grad_(False)
    plain = sparsecomm.CompressedOptimizer(sgd(reference), sparsecomm.TopK(0.1))
    train(model, opt, 3)
    train(reference, plain, 3)
    # The kept flags: the frozen weight and bias not used, the last layer's two used.
    assert opt._template is not None and opt._template[1][-4:].tolist() == [0, 0, 1, 1]
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ torch.optim habits


def test_a_parameter_frozen_with_its_grad_zeroed_in_place_is_unused_under_updates():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters()), sparsecomm.TopK(0.05), exchange="updates"
    )
    for step in range(4):
        if step == 2:
            model[0].weight.requires_grad_(False)  # its .grad: zeros, not None
            state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
            weight = model[0].weight.detach().clone()
        model(torch.randn(8, 40)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert torch.equal(model[0].weight, weight)
    for key, value in opt.state[model[0].weight].items():
        assert torch.equal(value, state[key]), key  # AdamW did not step it


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.05), sparsecomm.Threshold(1e-3)])
def test_a_parameter_frozen_with_its_grad_zeroed_in_place_stays_put(compressor):
    # zero_grad(set_to_none=False) leaves a frozen parameter's .grad as a zeroed view of its
    # bucket: it must still count as unused, not send its residual and step on it.
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:
            model[0].weight.requires_grad_(False)
            frozen = model[0].weight.detach().clone()
            residual = opt.residual(model[0].weight).clone()
            assert residual.abs().max() > 0  # something held back, that could be sent
        model(torch.randn(8, 40, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert torch.equal(model[0].weight, frozen)
    assert torch.equal(opt.residual(model[0].weight), residual)  # nothing of it lost


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.05), sparsecomm.Cast(torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_zero_grad_between_backward_and_step_skips_the_step_as_opt_zero_grad_does(
    compressor, dtype
):
    # A backward whose gradients are thrown away (a probe, a failed check) cleared with the
    # model's zero_grad(): the next backward starts a new step, as after opt.zero_grad().
    runs = {}
    for clear in ("opt", "model"):
        model = small_model().to(dtype)
        opt = sparsecomm.CompressedOptimizer(sgd(model), compressor)
        gen = torch.Generator().manual_seed(0)
        for step in range(5):
            if step in (1, 3):  # (step 0's exchange runs in step(): nothing to clear)
                model(torch.randn(8, 40, generator=gen, dtype=dtype)).pow(2).mean().backward()
                (opt if clear == "opt" else model).zero_grad()
            model(torch.randn(8, 40, generator=gen, dtype=dtype)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs[clear] = ([p.detach().clone() for p in model.parameters()], opt.total_stats)
    for p, q in zip(runs["opt"][0], runs["model"][0]):
        assert torch.equal(p, q)
    assert runs["model"][1].skipped_steps == runs["opt"][1].skipped_steps == 2


def test_a_new_backward_onto_averages_zeroed_in_place_is_refused_naming_opt_zero_grad():
    # model.zero_grad(set_to_none=False) zeroes the averages in place, which the next
    # backward cannot tell from averages it would add to: refused, naming the way that works.
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, opt, 1)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    model.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match=r"opt.zero_grad\(\)"):
        model(torch.randn(8, 40)).pow(2).mean().backward()


def test_a_second_backward_onto_the_averages_is_still_refused():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, opt, 1)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(torch.randn(8, 40)).pow(2).mean().backward()


def test_state_dict_hooks_registered_on_the_wrapper_run():
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, opt, 2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("save pre", o)))

    def tag(o, state):
        calls.append(("save post", o))
        state["tagged"] = True
        return state

    opt.register_state_dict_post_hook(tag)

    def untag(o, state):
        calls.append(("load pre", o))
        state = dict(state)
        assert state.pop("tagged")
        return state

    opt.register_load_state_dict_pre_hook(untag)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o)))
    state = opt.state_dict()
    assert state["tagged"]
    opt.load_state_dict(state)  # the pre hook's dict, without the tag, is what loads
    assert calls == [("save pre", opt), ("save post", opt), ("load pre", opt), ("load post", opt)]


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copying_the_wrapper_is_refused_naming_state_dict(how):
    import copy
    import pickle

    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    thunk = {
        "copy": lambda: copy.copy(opt),
        "deepcopy": lambda: copy.deepcopy(opt),
        "pickle": lambda: pickle.dumps(opt),
    }[how]
    with pytest.raises(TypeError, match=r"state_dict\(\)"):
        thunk()


def test_a_rank_of_several_without_a_process_group_is_refused(monkeypatch):
    # torchrun set WORLD_SIZE, but init_process_group was forgotten (or comes later): each
    # rank would train alone, apart from the others, without a word.
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = small_model()
    with pytest.raises(RuntimeError, match="init_process_group"):
        sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    with pytest.raises(RuntimeError, match="init_process_group"):
        sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.05))
    monkeypatch.setenv("WORLD_SIZE", "1")
    sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))  # one process: fine


def test_the_agreement_is_float32_whatever_the_default_dtype(monkeypatch):
    # Its slots hold step counts up to 2**23: a float16 default would overflow them.
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 3))
    unused = torch.nn.Parameter(torch.zeros(2000))  # (so not every step takes the template)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD([*model.parameters(), unused], lr=0.1), sparsecomm.TopK(0.05)
    )
    dtypes = []
    reduce = opt._comm.all_reduce_
    monkeypatch.setattr(opt._comm, "all_reduce_", lambda t: (dtypes.append(t.dtype), reduce(t)))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        for _ in range(2):
            model(torch.randn(8, 40, dtype=torch.float32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_default_dtype(default)
    assert dtypes and set(dtypes) == {torch.float32}


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@pytest.mark.parametrize("overlap_step", [False, True], ids=["first step", "overlapping step"])
def test_the_wrapped_optimizer_stepped_directly_raises_and_changes_nothing(overlap_step):
    # `optimizer.step()` where `opt.step()` was meant: each rank would step on its own
    # gradient (or on averages counted as a skipped step) and the ranks come apart.
    model = small_model()
    inner = sgd(model)
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05))
    if overlap_step:
        train(model, opt, 2)  # from the second step on the exchange runs in backward
    before = _flat(model)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"opt\.step\(\)"):
        inner.step()
    assert torch.equal(_flat(model), before)
    assert overlap_step or not inner.state  # (no momentum buffer made either)
    opt.step()  # the wrapper steps it
    opt.zero_grad()
    assert not torch.equal(_flat(model), before)
    # Wrapped again (as the README does after a change of requires_grad): the new wrapper
    # steps it, and a direct call still raises.
    state = opt.state_dict()
    opt = sparsecomm.CompressedOptimizer(opt.optimizer, sparsecomm.TopK(0.05))
    opt.load_state_dict(state)
    train(model, opt, 2)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"opt\.step\(\)"):
        inner.step()


def test_a_model_and_optimizer_under_the_wrapper_still_save_whole():
    # torch.save(model) pickles each parameter's attributes: the wrapper's mark on them
    # must pickle (a weakref did not: TypeError).
    model = small_model()
    opt = sparsecomm.CompressedOptimizer(sgd(model), sparsecomm.TopK(0.05))
    train(model, opt, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    torch.save(opt.optimizer, io.BytesIO())
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_flat(loaded), _flat(model))


@pytest.mark.parametrize("refused", [False, True], ids=["accepted", "refused"])
def test_a_step_ahead_interrupted_in_its_wait_is_finished_by_the_next_step_call(
    refused, monkeypatch
):
    # A fused AdamW steps before the host reads the verdict. Should that wait be
    # interrupted (KeyboardInterrupt), the step is queued already: step() again must wait
    # and count it, not step the optimizer a second time, nor apply a refused step.
    def run(interrupt: bool):
        model = small_model()
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), sparsecomm.TopK(0.05)
        )
        train(model, opt, 2)
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(5))
        if refused:
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        assert opt._pending is not None  # (it did step ahead)
        if interrupt:
            agree = opt._agree_on_step
            calls = []

            def interrupted(agreement):
                if not calls:
                    calls.append(1)
                    raise KeyboardInterrupt
                return agree(agreement)

            monkeypatch.setattr(opt, "_agree_on_step", interrupted)
            with pytest.raises(KeyboardInterrupt):
                opt.step()
        outcome = "ok"
        try:
            opt.step()
        except sparsecomm.NonFiniteGradientError:
            outcome = "refused"
        opt.zero_grad()
        train(model, opt, 1, seed=7)
        return outcome, opt.steps_taken, _flat(model), opt.optimizer.state_dict()["state"]

    plain, interrupted = run(False), run(True)
    assert plain[0] == interrupted[0] == ("refused" if refused else "ok")
    assert plain[1] == interrupted[1]
    assert torch.equal(plain[2], interrupted[2])
    for key, value in plain[3].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(value[name], interrupted[3][key][name]), (key, name)


def test_wrapping_again_while_a_step_is_pending_settles_it_first():
    # Between backward and step() of a step the fused AdamW would take ahead, .grad views
    # the wrapper's scratch. A new wrapper of the same optimizer built there waits for the
    # old one's verdict first: on a refused step .grad is then None, as after any refusal,
    # and the new wrapper does not send the scratch as gradients.
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05))
    train(model, opt, 2)
    x = torch.randn(8, 40)
    x[0, 0] = float("nan")
    model(x).pow(2).mean().backward()
    assert opt._pending is not None
    assert any(p.grad is not None for p in model.parameters())  # (zeros, until the verdict)
    sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05))
    assert opt._pending is None
    assert all(p.grad is None for p in model.parameters())
