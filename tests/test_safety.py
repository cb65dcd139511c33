"""Issue 12: the same decision on every rank, and atomic state.

What one rank gets wrong must be refused on every rank, promptly and with the same error;
a refused call (a bad argument, an unusable gradient, a bad checkpoint) must change nothing;
and what the optimizer reports must be what it did. Each test goes through the public API
only, on one process (the pytest process, no process group: the same path as one gloo rank)
and on two gloo ranks.

The two-rank cases that cannot make a rank wait for another run together in one set of
processes (the module fixture ``two_ranks``: one spawn for all), each scenario on a
process group of its own. The cases where a defect makes one rank wait in a collective the
others never join run in processes of their own, with a short collective timeout, so that
such a defect fails the test in seconds instead of hanging it.
"""

from __future__ import annotations

import copy
import re

import _safety_workers as sw
import pytest
import torch
from _dist import run_ranks

import sparsecomm

# Seconds a collective waits before it gives up, where a defect makes a rank wait.
SHORT_TIMEOUT_S = 10
# The longest a refused call may take on any rank: far below SHORT_TIMEOUT_S, far above
# what agreeing on an error takes (milliseconds).
PROMPT_S = SHORT_TIMEOUT_S / 2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def assert_same_on_every_rank(values: list[torch.Tensor], what: str) -> None:
    for rank, value in enumerate(values[1:], start=1):
        assert torch.equal(bits(values[0]), bits(value)), f"{what}: rank {rank} differs from 0"


@pytest.fixture(scope="module")
def two_ranks():
    """Every scenario of ``_safety_workers.SCENARIOS`` on two gloo ranks, in one spawn:
    ``{name: [rank 0's ("ok", result) | ("error", traceback), rank 1's ...]}``."""
    names = list(sw.SCENARIOS)
    results = run_ranks(sw.run_scenarios, 2, names, 20, timeout=150, collective_timeout=20)
    return {name: [results[rank][name] for rank in range(2)] for name in names}


@pytest.fixture(params=[1, 2], ids=["W1", "W2"])
def world_size(request):
    return request.param


def scenario(request, name: str, world_size: int) -> list:
    """Every rank's result of scenario ``name``: run here (one rank) or taken from the
    two-rank spawn."""
    if world_size == 1:
        return [sw.SCENARIOS[name](0, 1, None)]
    results = request.getfixturevalue("two_ranks")[name]
    errors = [f"--- rank {r} ---\n{out}" for r, (kind, out) in enumerate(results) if kind != "ok"]
    if errors:
        raise AssertionError(f"scenario {name} failed:\n" + "\n".join(errors))
    return [out for _, out in results]


# ------------------------------------------------------------------ 12.1 one rank differs


@pytest.mark.parametrize(
    "case, bad_rank, types, word",
    [
        pytest.param(
            "float64_param",
            0,
            ("TypeError", "ValueError"),
            "float64",
            id="float64-parameter-on-rank-0",
        ),
        pytest.param(
            "bucket_cap_type",
            1,
            ("TypeError", "ValueError"),
            "bucket_cap_mb",
            id="bucket_cap_mb-str-on-rank-1",
        ),
        pytest.param(
            "learning_rate", 1, ("ValueError",), "different optimizers", id="lr-on-rank-1"
        ),
        pytest.param(
            "optimizer_class",
            0,
            ("ValueError",),
            "different optimizers",
            id="Adam-on-rank-0-AdamW-on-rank-1",
        ),
        pytest.param(
            "add_group_learning_rate",
            1,
            ("ValueError",),
            "different optimizers",
            id="add_param_group-lr-on-rank-1",
        ),
        pytest.param(
            "add_group_float64",
            0,
            ("TypeError", "ValueError"),
            "float64",
            id="add_param_group-float64-on-rank-0",
        ),
        pytest.param(
            "add_group_non_leaf",
            1,
            ("ValueError",),
            "leaf",
            id="add_param_group-refused-by-the-wrapped-optimizer-on-rank-1",
        ),
        pytest.param(
            "add_group_unfrozen",
            0,
            ("RuntimeError",),
            "wrap the optimizer again",
            id="add_param_group-with-a-parameter-unfrozen-on-rank-0",
        ),
    ],
)
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank_promptly(
    case, bad_rank, types, word
):
    results = run_ranks(
        sw.one_rank_differs, 2, case, bad_rank, timeout=60, collective_timeout=SHORT_TIMEOUT_S
    )
    outcomes = [outcome for outcome, _, _, _ in results]
    for rank, (outcome, seconds, groups, _) in enumerate(results):
        assert outcome[0] in types, f"rank {rank} did not refuse it: {outcome}"
        assert word in outcome[1], f"rank {rank}: the error does not name {word!r}: {outcome}"
        assert seconds < PROMPT_S, f"rank {rank} took {seconds:.1f} s to raise: it waited"
        if groups is not None:
            assert groups == 1, f"rank {rank}: the refused group was added anyway"
    assert outcomes[0] == outcomes[1], f"the ranks raised different errors: {outcomes}"
    # The ranks are still in step: the good optimizer that follows trains in sync.
    assert_same_on_every_rank([params for _, _, _, params in results], "parameters after")


def test_float64_parameters_on_every_rank_raise_typeerror_everywhere(request, world_size):
    outcomes = scenario(request, "float64_everywhere", world_size)
    for outcome in outcomes:
        assert outcome[0] == "TypeError" and "float64" in outcome[1], outcome
    assert all(outcome == outcomes[0] for outcome in outcomes)


# ------------------------------------------------------------------ 12.2 add_param_group


def test_refused_add_param_group_changes_nothing_and_ranks_stay_in_sync(request, world_size):
    results = scenario(request, "add_group_float64", world_size)
    for rank, result in enumerate(results):
        kind, message = result["outcome"]
        assert kind == "TypeError" and "float64" in message, f"rank {rank}: {result['outcome']}"
        assert result["groups"] == (1, 1), f"rank {rank}: param_groups went {result['groups']}"
        assert result["unchanged"], f"rank {rank}: the refused call changed the state"
    assert_same_on_every_rank([r["params"] for r in results], "parameters after the next step")


def test_add_param_group_refuses_a_parameter_too_large_for_a_bucket_before_changing_anything(
    monkeypatch,
):
    monkeypatch.setattr(sparsecomm._engine, "MAX_BUCKET_NUMEL", 100)
    small = torch.nn.Parameter(torch.ones(50))
    opt = sparsecomm.CompressedOptimizer(torch.optim.SGD([small], lr=0.1), sparsecomm.TopK(0.1))
    big = torch.nn.Parameter(torch.ones(200))
    with pytest.raises(ValueError, match="more than a bucket can hold"):
        opt.add_param_group({"params": [big]})
    assert len(opt.optimizer.param_groups) == 1 and len(opt._params) == 1
    (small.sum() + big.sum()).backward()
    opt.step()  # big is in no group: stepped by nobody, exchanged by nobody
    assert torch.equal(big.detach(), torch.ones(200)) and not torch.equal(small, torch.ones(50))
    with pytest.raises(ValueError, match="more than a bucket can hold"):
        sparsecomm.CompressedOptimizer(torch.optim.SGD([small, big], lr=0.1), sparsecomm.TopK(0.1))


def test_add_param_group_between_backward_and_step_is_refused_everywhere(request, world_size):
    results = scenario(request, "add_group_mid_step", world_size)
    for rank, result in enumerate(results):
        kind, message = result["refused"]
        assert kind == "RuntimeError" and "between backward() and step()" in message, result
        assert result["groups"] == (1, 2), f"rank {rank}: param_groups went {result['groups']}"
    assert_same_on_every_rank([r["params"] for r in results], "parameters after the new group")


# ------------------------------------------------------------------ 12.3 non-finite g + r


@pytest.mark.parametrize("compressor", list(sw.OVERFLOW))
def test_overflow_of_gradient_plus_residual_raises_everywhere_and_changes_nothing(
    request, world_size, compressor
):
    results = [r[compressor] for r in scenario(request, "overflow", world_size)]
    bad_rank = world_size - 1
    # The set-up: the first step left the large values in the bad rank's residual.
    assert results[bad_rank]["residual_peak"] > 1e37, results[bad_rank]["residual_peak"]
    for rank, result in enumerate(results):
        assert result["caught"] == [bad_rank], f"rank {rank}: raised for {result['caught']}"
        assert result["unchanged"], f"rank {rank}: the refused step changed the state"
        assert result["finite"], f"rank {rank}: a parameter or residual is not finite"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_overflow_of_gradient_plus_residual_under_grad_scaler_skips_everywhere(request, world_size):
    results = scenario(request, "overflow_grad_scaler", world_size)
    for rank, result in enumerate(results):
        assert result["scales"] == [1.0, 0.5], f"rank {rank}: scales {result['scales']}"
        assert result["unchanged"] == [False, True], f"rank {rank}: {result['unchanged']}"
        assert result["finite"], f"rank {rank}: a parameter or residual is not finite"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


@pytest.mark.parametrize("compressor", ["topk", "threshold", "fp16"])
def test_nan_residual_from_a_checkpoint_is_refused_or_raises_everywhere(
    request, world_size, compressor
):
    results = [r[compressor] for r in scenario(request, "nan_residual", world_size)]
    bad_rank = world_size - 1
    bad = results[bad_rank]
    if bad["loaded"][0] == "ok":  # loaded: then the step must see it, on every rank
        for rank, result in enumerate(results):
            assert result["caught"] == [bad_rank], f"rank {rank}: raised for {result['caught']}"
            assert result["step_unchanged"], f"rank {rank}: the refused step changed the state"
    else:  # refused: with a ValueError, and nothing loaded
        assert bad["loaded"][0] == "ValueError", bad["loaded"]
        assert bad["load_unchanged"], "the refused load_state_dict changed the state"
    for rank, result in enumerate(results):
        assert result["params_finite"], f"rank {rank}: a parameter became NaN or Inf"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


@pytest.mark.parametrize("compressor", list(sw.SUM_OVERFLOW))
def test_finite_gradients_whose_sum_overflows_never_make_parameters_inf(request, compressor):
    results = [r[compressor] for r in scenario(request, "sum_overflow", 2)]
    caught = [result["caught"] for result in results]
    if compressor == "fp16":  # the clamp at about max / W keeps the sum finite: no refusal
        assert caught == [None, None], caught
    else:  # fp32 values of 2e38 on both ranks: refused, as too large (not as NaN)
        assert caught == [[0, 1], [0, 1]], caught
        assert all(result["too_large"] for result in results)
    for rank, result in enumerate(results):
        assert result["finite"], f"rank {rank}: a parameter or residual is not finite"
        if caught[0] is not None:  # refused: everywhere, and nothing changed
            assert result["caught"] == caught[0], f"the ranks disagree: {caught}"
            assert result["unchanged"], f"rank {rank}: the refused step changed the state"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


@pytest.mark.parametrize("world_size", [1, 2])
def test_16_bit_parameters_step_under_every_compressor(request, world_size):
    results = scenario(request, "half_params", world_size)
    for case in results[0]:
        for rank, result in enumerate(results):
            outcomes = result[case]["outcomes"]
            assert outcomes == [("ok", None)] * 2, f"rank {rank}, {case}: {outcomes}"
        assert_same_on_every_rank([r[case]["params"] for r in results], case)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_average_beyond_float16_is_refused_for_a_float16_parameter(overlap):
    # Gradient plus residual lives in float32, so it can outgrow float16 while every value
    # stays finite there; the average written back into the float16 gradient would be Inf.
    param = torch.nn.Parameter(torch.zeros(2048, dtype=torch.float16))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD([param], lr=1e-6), sparsecomm.TopK(0.5), overlap=overlap
    )
    grad = torch.full((2048,), 40000.0, dtype=torch.float16)
    (param * grad).sum().backward()
    opt.step()  # half sent (40000), half kept: the residual holds 40000
    opt.zero_grad()
    kept, start = opt.residual(param), param.detach().clone()
    (param * grad).sum().backward()  # 80000 to send: beyond float16's 65504
    with pytest.raises(sparsecomm.NonFiniteGradientError, match="float16") as info:
        opt.step()
    assert info.value.too_large and info.value.ranks == [0]
    assert torch.equal(param.detach(), start) and torch.equal(opt.residual(param), kept)
    opt.zero_grad()
    # A quarter of the gradient brings the kept half to 50000, within range: it steps.
    (param * (grad / 4)).sum().backward()
    opt.step()
    assert torch.isfinite(param).all() and not torch.equal(param.detach(), start)


# ------------------------------------------------------------------ 12.4 load_state_dict


def _trained():
    """A model and optimizer three steps in (the state to corrupt and load), then two more
    (the state a refused load must leave): momentum and residuals differ between the two."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        sparsecomm.TopK(0.05),
        min_compress_numel=0,  # every parameter keeps a residual
    )
    gen = torch.Generator().manual_seed(0)

    def train(steps):
        for _ in range(steps):
            model(torch.randn(8, 40, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    train(3)
    saved = copy.deepcopy(opt.state_dict())
    train(2)
    return model, opt, saved


def _set(path):
    def corrupt(state, value):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value
        return state

    return corrupt


def _residuals(change):
    def corrupt(state):
        state["sparsecomm"]["residuals"] = change(list(state["sparsecomm"]["residuals"]))
        return state

    return corrupt


def _last(residuals, value):
    # The last parameter's residual: a load that copies residuals one by one and stops at a
    # bad one has already changed the others.
    residuals[-1] = value(residuals[-1])
    return residuals


def _nan(r):
    r = r.clone()
    r.view(-1)[1] = float("nan")
    return r


def _inf(r):
    r = r.clone()
    r.view(-1)[1] = float("inf")
    return r


def _without(section, key):
    def corrupt(state):
        del (state if section is None else state[section])[key]
        return state

    return corrupt


LOAD_CASES = [
    # id, corrupt(state) -> what to load, the words the ValueError must match, and the
    # defect each case pinned before the fix
    (
        "another-compressor",
        lambda s: _set(["sparsecomm", "compressor"])(s, sparsecomm.TopK(0.1).config()),
        r"compressor",
        "a state saved with another compressor loads silently",
    ),
    (
        "another-error-feedback",
        lambda s: _set(["sparsecomm", "error_feedback"])(s, False),
        r"error_feedback",
        "a state saved without error feedback loads silently",
    ),
    (
        "residual-element-count",
        _residuals(lambda rs: _last(rs, lambda r: torch.zeros(r.numel() + 1))),
        r"residual",
        "a residual with the wrong element count raises RuntimeError from copy_, after the "
        "wrapped optimizer's state was already replaced",
    ),
    (
        "residual-shape",
        _residuals(lambda rs: _last(rs, lambda r: r.unsqueeze(0))),
        r"residual",
        "a residual of the wrong shape (same element count) loads silently, reshaped",
    ),
    (
        "residual-float64",
        _residuals(lambda rs: _last(rs, lambda r: r.double())),
        r"float64|dtype",
        "a float64 residual loads silently, converted",
    ),
    (
        "residual-list-short",
        _residuals(lambda rs: rs[:-1]),
        r"residual",
        "a shortened residual list loads silently, the missing residual zeroed",
    ),
    (
        "residual-none",
        _residuals(lambda rs: _last(rs, lambda r: None)),
        r"residual",
        "a missing (None) residual of a parameter that keeps one loads silently, zeroed",
    ),
    (
        "residual-nan",
        _residuals(lambda rs: _last(rs, _nan)),
        r"(?i)nan|finite",
        "a NaN residual loads silently",
    ),
    (
        "residual-inf",
        _residuals(lambda rs: _last(rs, _inf)),
        r"(?i)inf|finite",
        "an Inf residual loads silently",
    ),
    ("not-a-dict", lambda s: [s], r"state_dict|dict", None),
    (
        "section-not-a-dict",
        lambda s: _set(["sparsecomm"])(s, lambda section: list(section.items())),
        r"sparsecomm|dict",
        "a 'sparsecomm' section that is a list raises AttributeError",
    ),
    (
        "no-residuals-key",
        _without("sparsecomm", "residuals"),
        r"residuals",
        "a missing 'residuals' key raises KeyError, after the wrapped optimizer's state "
        "was already replaced",
    ),
    (
        "no-world-size-key",
        _without("sparsecomm", "world_size"),
        r"world_size",
        "a missing 'world_size' key raises KeyError",
    ),
    (
        "no-optimizer-key",
        _without(None, "optimizer"),
        r"optimizer",
        "a missing 'optimizer' key raises KeyError",
    ),
    ("another-world-size", lambda s: _set(["sparsecomm", "world_size"])(s, 4), r"world_size", None),
]


@pytest.mark.parametrize(
    "corrupt, words",
    [pytest.param(corrupt, words, id=name) for name, corrupt, words, _why in LOAD_CASES],
)
def test_load_state_dict_refuses_a_bad_state_and_changes_nothing(corrupt, words):
    model, opt, saved = _trained()
    before = sw.state_of(opt, list(model.parameters()))
    bad = corrupt(copy.deepcopy(saved))
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(bad)
    assert sw.state_of(opt, list(model.parameters())) == before, "the refused load changed state"
    # The good state still loads, and training goes on from it.
    opt.load_state_dict(saved)
    model(torch.randn(8, 40)).pow(2).mean().backward()
    opt.step()


# ------------------------------------------------------------------ 12.5 edge cases


@pytest.mark.parametrize(
    "compressor",
    [
        pytest.param(
            "topk",
        ),
        *[c for c in sw.ZERO_ELEMENT_COMPRESSORS if c != "topk"],
    ],
)
def test_zero_element_parameters_alone_in_a_bucket_train(request, world_size, compressor):
    results = [r[compressor] for r in scenario(request, "zero_element", world_size)]
    for rank, result in enumerate(results):
        assert result["outcome"] == ("ok", None), f"rank {rank}: {result['outcome']}"
        assert result["params"].abs().sum() > 0, f"rank {rank}: the 4096-element weight never moved"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


def test_infinite_bucket_cap_means_no_cap(request, world_size):
    results = scenario(request, "no_cap", world_size)
    # TopK(0.1) of the two compressed weights (1152 + 2304) together, plus the 341 elements
    # of the small parameters, which travel dense.
    one_bucket = sparsecomm.TopK(0.1).k_for(1152 + 2304) + 48 + 48 + 240 + 5
    for rank, result in enumerate(results):
        no_cap, huge_cap = result["inf"], result["1000000000.0"]
        assert no_cap["outcome"] == ("ok", None), f"rank {rank}: {no_cap['outcome']}"
        assert huge_cap["outcome"] == ("ok", None), f"rank {rank}: {huge_cap['outcome']}"
        assert no_cap["elements_sent"] == one_bucket, no_cap["elements_sent"]
        assert torch.equal(bits(no_cap["params"]), bits(huge_cap["params"])), (
            f"rank {rank}: no cap trains differently from a cap nothing reaches"
        )
    assert_same_on_every_rank([r["inf"]["params"] for r in results], "parameters")


def _expanded_parameter(numel: int) -> torch.nn.Parameter:
    """A parameter of ``numel`` elements that holds one float: no 8 GiB allocation."""
    return torch.nn.Parameter(torch.zeros(1).expand(numel))


def test_parameter_over_the_int32_index_limit_is_refused_with_its_size():
    params = [_expanded_parameter(2**31)]
    with pytest.raises(ValueError, match="2147483648"):
        sparsecomm.CompressedOptimizer(
            torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.01), error_feedback=False
        )


def test_oversize_error_names_a_real_parameter_size():
    small, big = torch.nn.Parameter(torch.zeros(2000)), _expanded_parameter(2**31)
    with pytest.raises(ValueError) as caught:
        sparsecomm.CompressedOptimizer(
            torch.optim.SGD([small, big], lr=0.1),
            sparsecomm.TopK(0.01),
            error_feedback=False,
            bucket_cap_mb=2**20,
        )
    message = str(caught.value)
    sizes = {int(n) for n in re.findall(r"\d{10,}", message)} - {2**31 - 1}  # the limit
    assert sizes <= {2**31}, f"the error names sizes no parameter has ({sizes}): {message}"


def test_meta_parameter_is_refused_at_construction_naming_it_and_the_fix(request, world_size):
    outcomes = scenario(request, "meta_everywhere", world_size)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind in ("TypeError", "ValueError"), f"rank {rank}: accepted ({kind})"
        assert "meta" in message and "parameter 1" in message, message
        assert re.search(r"to_empty|materiali[sz]e", message), f"no fix named: {message}"
    assert all(outcome == outcomes[0] for outcome in outcomes)


# ------------------------------------------------------------------ 12.6 (a) and (e)


@pytest.mark.parametrize("config", list(sw.UNUSED_CONFIGS))
def test_parameter_no_rank_used_keeps_its_residual_bit_for_bit(request, world_size, config):
    results = [r[config] for r in scenario(request, "unused_residual", world_size)]
    for rank, result in enumerate(results):
        before, after = result["residual_before"], result["residual_after"]
        assert before.abs().sum() > 0, f"rank {rank}: set-up: no residual was built"
        assert torch.equal(bits(before), bits(after)), (
            f"rank {rank}: the residual of a parameter no rank used changed in "
            f"{int((bits(before) != bits(after)).sum())} elements"
        )
        assert result["grad_none"], f"rank {rank}: its grad is no longer None"
        assert result["idle_unchanged"], f"rank {rank}: it moved without a gradient"
    assert_same_on_every_rank([r["params"] for r in results], "parameters")


def _expected_elements_sent(results, name, world_size):
    """Per step and rank, what the rank sent: its own count of the 3000-element bucket, or
    all of it when the exchange switches to dense (every rank's count known), plus the
    10-element dense bucket."""
    sparse = name.startswith(("threshold", "topk"))
    expected = []
    for step in range(len(results[0][name])):
        counts = [r[name][step]["count"] for r in results]
        fallback = sparse and world_size > 1 and max(counts) * world_size >= 3000
        if world_size > 1:
            assert fallback == sw.ELEMENTS_CONFIGS[name][1], f"set-up: {name} counts {counts}"
        expected.append([(3000 if fallback else count) + 10 for count in counts])
    return expected


ELEMENTS_CASES = [
    pytest.param(w, name, id=f"W{w}-{name}")
    for w in (1, 2)
    for name in ("threshold", "topk", "fp16", "dense", "topk-fallback", "threshold-fallback")
    if not (w == 2 and name.endswith("fallback"))
] + [
    pytest.param(
        2,
        name,
        id=f"W2-{name}",
    )
    for name in ("topk-fallback", "threshold-fallback")
]


@pytest.mark.parametrize("world_size, name", ELEMENTS_CASES)
def test_elements_sent_is_what_each_rank_sent(request, world_size, name):
    results = scenario(request, "elements_sent", world_size)
    expected = _expected_elements_sent(results, name, world_size)
    for step, per_rank in enumerate(expected):
        reported = [r[name][step]["elements_sent"] for r in results]
        assert reported == per_rank, f"step {step}: reported {reported}, sent {per_rank}"


# ------------------------------------------------------------------ the wrapped step raises


def _wrapped_step_raises(exchange, raising, then):
    return run_ranks(
        sw.wrapped_step_raises, 2, exchange, raising, then,
        timeout=90, collective_timeout=SHORT_TIMEOUT_S,
    )  # fmt: skip


@pytest.mark.parametrize(
    "raising, then",
    [
        ([0, 1], "retry"),
        ([1], "retry"),
        ([1], "synchronize"),
        ([0, 1], "zero_grad"),
        ([0, 1], "model.zero_grad"),
    ],
    ids=[
        "every-rank-retries",
        "one-rank-retries",
        "one-rank-retries-after-synchronize",
        "every-rank-skips",
        "every-rank-skips-clearing-grads-another-way",
    ],
)
def test_a_wrapped_step_that_raised_is_retried_or_skipped_alike(raising, then):
    """The wrapped optimizer's step raises at step 2: calling step() again applies the
    same averages (no second exchange; the density schedule goes on in step), giving the
    bits of a run without the failure; zero_grad() on every rank skips it on every rank."""
    clean = _wrapped_step_raises("gradients", [], then)
    results = _wrapped_step_raises("gradients", raising, then)
    for rank, (params, steps, errors) in enumerate(results):
        assert [e[:2] for e in errors] == ([(2, "RuntimeError")] if rank in raising else [])
        assert steps == 6
        if then in ("retry", "synchronize"):
            assert torch.equal(bits(params), bits(clean[rank][0])), f"rank {rank}"
    assert_same_on_every_rank([params for params, _, _ in results], "parameters")
    if then.endswith("zero_grad"):
        assert not torch.equal(bits(results[0][0]), bits(clean[0][0]))


def test_a_wrapped_step_that_raised_on_one_rank_only_raises_on_every_rank_after():
    """Rank 1's wrapped step raises at step 2 and rank 1 goes on without it: rank 0 has
    applied that step, so the ranks' parameters differ. The next step tells every rank,
    with the same error, instead of training on apart."""
    results = _wrapped_step_raises("gradients", [1], "zero_grad")
    for _, _, errors in results:
        apart = [e for e in errors if e[0] >= 3]
        # Every step after, not the first only: the parameters stay apart.
        assert [e[:2] for e in apart] == [(s, "_RanksApartError") for s in (3, 4, 5)], errors
        assert all("did not apply the previous step" in e[2] for e in apart)
        assert all(e[3] for e in apart), "a refused step changed the residuals"
    assert [e[:2] for e in results[1][2]][0] == (2, "RuntimeError")


@pytest.mark.parametrize("then", ["drop", "by_hand"])
def test_a_failed_step_left_behind_by_a_new_step_is_told_to_every_rank(then):
    """Rank 0's wrapped step raises at step 2 and the loop clears the gradients with
    model.zero_grad(); at step 3 rank 0 drops its step (its forward failed), or every
    rank sets its gradients by hand. Step 3 is a new step, not a retry of step 2: it is
    exchanged on every rank, and every rank raises the same error, rank 0 having left
    step 2 unapplied; the ranks stay in step for the collectives after it."""
    results = _wrapped_step_raises("gradients", [0], then)
    for rank, (_, _, errors) in enumerate(results):
        expected = [(2, "RuntimeError")] if rank == 0 else []
        apart = [(s, "_RanksApartError") for s in (3, 4, 5)]
        assert [e[:2] for e in errors] == expected + apart, errors
        assert errors[-1][3], "the refused step changed the residuals"


def test_a_checkpoint_loaded_on_every_rank_after_a_failed_step_goes_on():
    """Rank 1's wrapped step raises at step 2 and it goes on; then every rank loads the
    state it had before step 2: the ranks are together again, and no error follows."""
    results = _wrapped_step_raises("gradients", [1], "reload")
    assert [e[:2] for e in results[0][2]] == []
    assert [e[:2] for e in results[1][2]] == [(2, "RuntimeError")]
    assert_same_on_every_rank([params for params, _, _ in results], "parameters")


@pytest.mark.parametrize("exchange", ["updates", "local_updates"])
def test_a_wrapped_step_that_raised_on_one_rank_drops_the_update_everywhere(exchange):
    """With the update exchanged after the wrapped step, a rank whose step raised sends a
    dropped step: the other ranks raise StepDroppedError (saying their optimizers
    stepped), nobody applies an update, and the ranks go on in step."""
    results = _wrapped_step_raises(exchange, [1], "zero_grad")
    (_, _, errors0), (_, _, errors1) = results
    assert [e[:2] for e in errors0] == [(2, "StepDroppedError")]
    assert "their wrapped optimizer raised in its step" in errors0[0][2]
    assert [e[:2] for e in errors1] == [(2, "RuntimeError")]
    assert_same_on_every_rank([params for params, _, _ in results], "parameters")


@pytest.mark.parametrize("clear", ["opt.zero_grad", "model.zero_grad"])
def test_a_step_skipped_on_some_ranks_only_raises_on_every_rank_after(clear):
    """After a backward whose gradients were exchanged, rank 1 throws them away where rank
    0 steps: their parameters differ from then on. The next step says so on every rank,
    changing nothing, instead of training on apart."""
    results = run_ranks(
        sw.skip_on_some_ranks, 2, [1], clear, timeout=90, collective_timeout=SHORT_TIMEOUT_S
    )
    for _, _, errors in results:
        assert [e[:2] for e in errors] == [(s, "_RanksApartError") for s in (3, 4, 5)], errors
        assert "different numbers of steps" in errors[0][2]
        assert all(e[3] for e in errors), "a refused step changed the residuals"


@pytest.mark.parametrize("clear", ["opt.zero_grad", "model.zero_grad"])
def test_a_step_skipped_on_every_rank_goes_on_in_step(clear):
    results = run_ranks(
        sw.skip_on_some_ranks, 2, [0, 1], clear, timeout=90, collective_timeout=SHORT_TIMEOUT_S
    )
    for _, steps, errors in results:
        assert errors == [] and steps == 5
    assert_same_on_every_rank([params for params, _, _ in results], "parameters")


def test_a_model_inside_ddp_raises_at_every_step_on_every_rank_and_changes_nothing(request):
    """DDP's all-reduce would write its average over sparsecomm's (mostly zeros: the hooks
    take each gradient first) while error feedback counts the values as sent."""
    results = scenario(request, "inside_ddp", 2)
    for rank, result in enumerate(results):
        for case in ("ddp_first", "optimizer_first", "hook"):
            for kind, message in result[case]["outcomes"]:
                assert kind == "RuntimeError", (rank, case, kind, message)
                assert "DistributedDataParallel" in message and "ddp_comm_hook" in message
            assert not result[case]["changed"], (rank, case)
        assert result["beside"], "a DDP module over another model stopped this one training"
    assert results[0] == results[1]


def test_parameters_that_fsdp_shards_are_refused_by_name_on_every_rank(request):
    results = scenario(request, "sharded", 2)
    for result in results:
        assert result["fsdp"][0] == "TypeError" and "FullyShardedDataParallel" in result["fsdp"][1]
        assert result["fsdp2"][0] == "TypeError" and "DTensor" in result["fsdp2"][1]
    assert results[0] == results[1]


def test_a_fused_adamw_stepped_ahead_of_the_verdict_matches_one_stepped_after(request, world_size):
    """The step-ahead path (the host waits for the verdict after queuing the fused step)
    gives the same bits, errors and checkpoint as the waiting path, refused steps and all."""
    results = scenario(request, "step_ahead", world_size)
    for name in ("topk", "dense"):
        for rank, result in enumerate(results):
            check_step_ahead(result[name]["ahead"], result[name]["after"], rank)
        assert_same_on_every_rank([r[name]["ahead"]["params"] for r in results], "parameters")


# What each of _safety_workers.STEP_AHEAD_PLAN's steps gives: step() or the clip before it.
STEP_AHEAD_OUTCOMES = [
    "ok", "ok", "ok", "ok",  # plain, plain, clip (the clip, the step)
    "ok", "NonFiniteGradientError",  # nan+clip
    "ok", "NonFiniteGradientError", "ok", "zero_grad",  # plain, nan, nan+again, nan+skip
    "NonFiniteGradientError",  # nan+raise: the refusal, not the wrapped step's error
    "RuntimeError", "ok", "ok",  # raise, then step() again; plain
]  # fmt: skip


def check_step_ahead(ahead: dict, after: dict, rank: int = 0) -> None:
    """``_safety_workers.step_ahead``'s two runs agree, and the first did step ahead."""
    # Every backward after the first step left its verdict pending.
    assert not ahead["pending"][0] and all(ahead["pending"][1:]), (rank, ahead["pending"])
    assert not any(after["pending"]), (rank, after["pending"])
    kinds = [kind for kind, _ in ahead["outcomes"]]
    assert kinds == STEP_AHEAD_OUTCOMES, (rank, kinds)
    assert ahead["outcomes"] == after["outcomes"], rank
    # Between backward and step() of a refused step, .grad holds nothing of it: zeros
    # (ahead) or None (after).
    assert all(ahead["clear"]) and all(after["clear"]), (rank, ahead["clear"], after["clear"])
    assert ahead["state"] == after["state"], f"rank {rank}: state differs"
    assert torch.equal(bits(ahead["params"]), bits(after["params"])), rank


def test_a_learning_rate_changed_on_one_rank_is_refused_on_every_rank_until_they_agree(request):
    """A scheduler stepped on one rank only: before, that rank stepped its parameters apart
    without a word."""
    results = scenario(request, "settings_apart", 2)
    for name in ("sgd", "fused-adamw"):
        for rank, result in enumerate(results):
            outcome = result[name]
            for kind, message in outcome["outcomes"]:
                assert kind == "_RanksApartError", (name, rank, kind, message)  # a RuntimeError
                assert "lr=0.05" in message or "lr=0.01" in message, message
                assert "rank 1" in message and "ReduceLROnPlateau" in message, message
            assert outcome["unchanged"], (name, rank)
            assert outcome["trained_again"], (name, rank)
        assert results[0][name]["outcomes"] == results[1][name]["outcomes"], name
        assert_same_on_every_rank([r[name]["params"] for r in results], f"{name} parameters")
