"""The contract on several gloo processes: sync, conservation, average, resume, no hangs."""

import itertools
import math
from fractions import Fraction

import _workers
import pytest
import torch
from _dist import run_ranks
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from sparsecomm.triton_kernels import cast as cast_ref
from sparsecomm.triton_kernels import threshold as threshold_ref
from sparsecomm.triton_kernels import topk as topk_ref
from strategies import gradients

import sparsecomm

COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.float16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(2e-3),
    sparsecomm.TopK(0.05),
    sparsecomm.TopK(0.05, value_dtype=torch.bfloat16),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    differ = (bits(a) != bits(b)).nonzero().flatten()
    assert differ.numel() == 0, (
        f"{what}: {differ.numel()} elements differ, first at {differ[:5].tolist()}: "
        f"{a[differ[:5]].tolist()} vs {b[differ[:5]].tolist()}"
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parameters_bitwise_identical_on_all_ranks(world_size):
    configs = [(c, opt) for c in COMPRESSORS for opt in ("sgd", "adamw")]
    results = run_ranks(_workers.sync, world_size, configs, 20, timeout=300)
    start = _workers.flat_params(_workers.make_model(seed=0))
    for index, (compressor, optimizer) in enumerate(configs):
        what = f"{compressor} + {optimizer}, W={world_size}"
        final = results[0][index]
        assert torch.isfinite(final).all(), what
        assert not torch.equal(final, start), f"{what}: parameters never moved"
        for rank in range(1, world_size):
            assert_bitwise_equal(final, results[rank][index], f"{what}, rank {rank} vs 0")


# ------------------------------------------------------------------ aggregation, 3 ranks

AGGREGATION_COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.float16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(0.5),
    sparsecomm.TopK(0.1),
    sparsecomm.TopK(0.1, value_dtype=torch.bfloat16),
    sparsecomm.TopK(1.0),  # k = numel: always the dense all-reduce
]


def _sent(compressor, grad, residual, world_size):
    """What one rank sends, derived independently of the optimizer from the kernels' torch
    references (the documented semantics) applied to copies of its gradient and residual:
    ``(kind, payload, residual after)`` with kind ``dense`` (fp32 values), ``half`` (the
    fp16/bf16 values, pre-divided by the power of two at or above W and clamped) or ``pairs``
    (indices, values)."""
    grad, residual = grad.clone(), residual.clone()
    if isinstance(compressor, sparsecomm.Dense):
        return "dense", grad, residual  # no residual: it stays zero
    if isinstance(compressor, sparsecomm.Cast):
        scale = 2.0 ** -math.ceil(math.log2(world_size)) if world_size > 1 else 1.0
        # The documented clamp, about max / W (test_kernel_cast checks that W of them add up
        # to a finite sum).
        limit = compressor.limit(world_size)
        half = cast_ref.cast_compress_ref(grad, residual, compressor.dtype, scale, limit)
        return "half", half, residual
    if isinstance(compressor, sparsecomm.Threshold):
        index, value, _ = threshold_ref.threshold_compress_ref(grad, residual, compressor.threshold)
    else:
        k = math.ceil(Fraction(repr(compressor.density)) * grad.numel())
        index, value = topk_ref.topk_compress_ref(grad, residual, max(1, min(grad.numel(), k)))
        if compressor.value_dtype == torch.bfloat16:
            # Sent as bfloat16, rounded to nearest (a finite value clamped to bfloat16's
            # largest first); what that takes off stays in the residual, where the value
            # was zeroed; NaN and Inf go as they are and leave 0.
            largest = torch.finfo(torch.bfloat16).max
            finite = torch.isfinite(value)
            sent = torch.where(finite, value.clamp(-largest, largest), value)
            sent = sent.bfloat16().float()
            residual[index.long()] = torch.where(finite, value - sent, torch.zeros_like(value))
            value = sent
    return "pairs", (index.long(), value), residual


def _sum_in_every_order(terms: list[torch.Tensor], finish) -> list[torch.Tensor]:
    """``finish(((t_a + t_b) + t_c) + ...)`` for every order of the ranks: an all-reduce adds
    in an order of its own (gloo's ring starts each chunk at another rank), not rank order."""
    outs = []
    for order in itertools.permutations(range(len(terms))):
        total = terms[order[0]].clone()
        for rank in order[1:]:
            total = total + terms[rank]
        outs.append(finish(total))
    return outs


def _assert_average(average, sents, numel, what):
    """The average against the documented rule, bit for bit. Sparse messages: each rank's
    pairs times 1/W added into zeros in rank order, when the largest count times W is below
    numel; otherwise (and for Dense and Cast) an all-reduce of the dense values times
    1/W, or of the half values times 1/(scale * W), in some order of the ranks."""
    world_size = len(sents)
    kind = sents[0][0]
    if kind == "pairs":
        width = max(index.numel() for _, (index, _), _ in sents)
        if width * world_size < numel:
            expected = torch.zeros(numel)
            for _, (index, value), _ in sents:  # rank order
                expected[index] = expected[index] + value * (1.0 / world_size)
            assert_bitwise_equal(average, expected, f"{what}: sparse sum in rank order")
            return
        dense = []
        for _, (index, value), _ in sents:
            decoded = torch.zeros(numel)
            decoded[index] = value
            dense.append(decoded)
        candidates = _sum_in_every_order(dense, lambda t: t * (1.0 / world_size))
    elif kind == "half":
        scale = 2.0 ** -math.ceil(math.log2(world_size))
        candidates = _sum_in_every_order(
            [payload for _, payload, _ in sents],
            lambda t: t.float() * (1.0 / (scale * world_size)),
        )
    else:
        candidates = _sum_in_every_order(
            [payload for _, payload, _ in sents], lambda t: t * (1.0 / world_size)
        )
    matches = torch.zeros(numel, dtype=torch.bool)
    for candidate in candidates:
        matches |= bits(candidate) == bits(average)
    wrong = (~matches).nonzero().flatten()
    assert wrong.numel() == 0, (
        f"{what}: {wrong.numel()} elements are no order's sum, first at {wrong[:5].tolist()}: "
        f"{average[wrong[:5]].tolist()}, rank order gives {candidates[0][wrong[:5]].tolist()}"
    )


@st.composite
def aggregation_cases(draw):
    """Three steps of three ranks' gradients of one size. Each step's gradients share a
    part, as gradients of one model do, so that the ranks send many of the same indices
    and the order of the sum matters: ``shared * (1 + spread * u_r) + own_r``, ``u_r``
    normal noise of rank r, ``own_r`` (when drawn) a part of the rank's own. The parts come
    from the adversarial ``gradients`` regimes (ties, zeros, denormals, signed zeros, ...),
    bounded by 1e30 so that no sum overflows (what an overflow must do is tested in
    test_safety.py)."""
    # The first option of each choice is what the first (simplest) example gets.
    numel = draw(st.sampled_from([1000, 7, 3001, 257, 2, 1, 31, 1025]))
    cases = []
    for _ in range(3):
        shared = draw(gradients(sizes=[numel])).clamp(-1e30, 1e30)
        spread = draw(st.sampled_from([1e-3, 1.0, 0.0]))
        seed = draw(st.integers(0, 2**16))
        own = draw(st.booleans())
        step = []
        for rank in range(3):
            noise = torch.randn(numel, generator=torch.Generator().manual_seed(3 * seed + rank))
            grad = shared * (1 + spread * noise)
            if own:
                grad = grad + draw(gradients(sizes=[numel])).clamp(-1e30, 1e30)
            step.append(grad)
        cases.append(step)
    return cases


@settings(max_examples=examples(3))
@given(cases=aggregation_cases())
def test_aggregation_on_three_ranks_is_the_documented_sum_bit_for_bit(cases):
    """Every compressor on every drawn input (one spawn per example): the residual each
    rank keeps and the average every rank gets, against an independent computation from
    what each rank sent."""
    world_size, numel = 3, cases[0][0].numel()
    results = run_ranks(
        _workers.aggregation, world_size, AGGREGATION_COMPRESSORS, cases, timeout=120
    )
    for index, compressor in enumerate(AGGREGATION_COMPRESSORS):
        for rank in range(world_size):
            stats = results[rank][index][1]  # profile=True: the step's parts were timed
            assert stats.communicate_seconds > 0 and stats.compress_seconds > 0, stats
        for step, case in enumerate(cases):
            what = f"{compressor}, numel {numel}, step {step}"
            records = [results[rank][index][0][step] for rank in range(world_size)]
            sents = []
            for rank, (before, after, _) in enumerate(records):
                sent = _sent(compressor, case[rank], before, world_size)
                assert_bitwise_equal(after, sent[2], f"{what}: residual of rank {rank}")
                sents.append(sent)
            averages = [average for _, _, average in records]
            for rank in range(1, world_size):
                assert_bitwise_equal(averages[0], averages[rank], f"{what}: rank {rank} vs 0")
            _assert_average(averages[0], sents, numel, what)
        # The last step's bytes show which exchange ran: pairs padded to the largest count,
        # or the whole bucket in fp32 (or half) when that is no more than all the pairs.
        kind = sents[0][0]
        if kind == "pairs":
            width = max(index.numel() for _, (index, _), _ in sents)
            pair = 4 + getattr(compressor, "value_dtype", torch.float32).itemsize  # 8 or 6
            wire = pair * width if width * world_size < numel else 4 * numel
        else:
            wire = (2 if kind == "half" else 4) * numel
        for rank in range(world_size):
            sent_bytes = results[rank][index][1].bytes_sent
            assert sent_bytes == wire, f"{compressor}: rank {rank} sent {sent_bytes} B, not {wire}"


def test_dense_matches_ddp_and_full_density_matches_dense():
    results = run_ranks(_workers.match_ddp, 2, 10)
    for rank in range(2):
        r = results[rank]
        torch.testing.assert_close(r["dense"], r["ddp"], rtol=1e-6, atol=1e-7)
        assert torch.equal(r["topk1"], r["dense"]), "TopK(1.0) differs from Dense()"
        assert torch.equal(r["threshold0"], r["dense"]), "Threshold(0.0) differs from Dense()"


def test_resume_in_new_processes_is_bitwise_equal(tmp_path):
    configs = [
        (sparsecomm.TopK(0.05), "adamw"),
        (sparsecomm.TopK(0.05, value_dtype=torch.bfloat16), "sgd"),
        (sparsecomm.Threshold(2e-3), "sgd"),
        (sparsecomm.Cast(torch.float16), "sgd"),
        (sparsecomm.Dense(), "adamw"),
    ]
    full = run_ranks(_workers.resume, 2, "full", str(tmp_path), configs, 10, 20)
    run_ranks(_workers.resume, 2, "first", str(tmp_path), configs, 10, 20)
    resumed = run_ranks(_workers.resume, 2, "second", str(tmp_path), configs, 10, 20)
    for rank in range(2):
        for index, (compressor, optimizer) in enumerate(configs):
            assert_bitwise_equal(
                full[rank][index], resumed[rank][index], f"{compressor}+{optimizer} rank {rank}"
            )


def test_ranks_resumed_at_different_steps_raise_on_every_rank_before_sending():
    # Without the check, the warm-up's densities differ, so do the all-gathers' sizes, and
    # gloo aborts the process (or, with equal sizes, the ranks drift apart silently).
    results = run_ranks(_workers.resumed_at_different_steps, 2, timeout=90)
    for (different, rank_0_only), _ in results:
        assert different is not None and "steps_taken by rank: [4, 2]" in different
        assert "that rank saved at the same step" in different
        assert rank_0_only is not None and "steps_taken by rank: [4, 0]" in rank_0_only
    # A load by one rank alone later on is not checked (a check only it ran would hang):
    # reloading the state of the step it is at keeps the ranks in sync.
    assert torch.equal(results[0][1], results[1][1])


def test_mismatched_models_raise_on_every_rank():
    messages = run_ranks(_workers.mismatched_model, 3, timeout=60)
    for message in messages:
        assert message is not None and "parameter 0" in message and "rank 1" in message, message
    messages = run_ranks(_workers.mismatched_count, 2, timeout=60)
    for message in messages:
        assert message is not None and "5 parameters" in message, message


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_gradient_on_one_rank_raises_everywhere_and_changes_nothing(bad_value):
    results = run_ranks(_workers.nan_on_one_rank, 3, bad_value, timeout=60)
    for caught, unchanged, _ in results:
        assert caught is not None and caught[1] == [1], caught
        assert unchanged
    for rank in (1, 2):
        assert torch.equal(results[0][2], results[rank][2])


def test_unused_parameters_on_one_rank():
    results = run_ranks(_workers.unused_parameters, 2, timeout=60)
    for params, head_grads_none, middle_has_grad in results:
        assert head_grads_none, "a parameter no rank used must keep grad None"
        assert middle_has_grad, "a parameter some rank used gets the average on every rank"
        assert torch.equal(params, results[0][0])


def test_a_parameter_unfrozen_after_wrapping_is_refused_until_wrapped_again():
    results = run_ranks(_workers.unfrozen_after_wrapping, 2, timeout=60)
    for error, carried, first_layer_moved, params in results:
        assert error is not None and "parameter 0" in error and "wrap the optimizer again" in error
        assert carried, "wrapping again with the old state keeps the residuals"
        assert first_layer_moved
        assert torch.equal(params, results[0][3])


@pytest.mark.parametrize("clip", [False, True], ids=["step", "synchronize-clip-step"])
def test_grad_scaler_overflow_on_one_rank_skips_everywhere(clip):
    """Also with ``opt.synchronize(scaler)`` and clipping between backward and step: every
    rank clips the same average."""
    results = run_ranks(_workers.grad_scaler_overflow, 2, clip, timeout=60)
    for scales, skipped, residual_finite, params, skipped_steps, norms in results:
        assert scales == [1024.0, 1024.0, 512.0, 512.0], scales
        assert skipped == [False, False, True, False], skipped
        assert residual_finite
        assert skipped_steps == 1
        assert torch.equal(params, results[0][3])
        assert norms == results[0][5] and len(norms) == (3 if clip else 0)


def test_synchronize_with_the_scaler_on_a_rank_without_gradients_or_that_dropped():
    results = run_ranks(_workers.grad_scaler_synchronize_odd_ranks, 2, timeout=60)
    (scales_0, params_0), (scales_1, params_1) = results
    assert scales_0 == scales_1 == [1024.0, 1024.0, 512.0, 512.0]
    assert torch.equal(params_0, params_1)


def test_a_rank_dropping_a_step_with_an_unfrozen_parameter_raises_as_the_others_do():
    errors = run_ranks(_workers.updates_unfrozen_and_dropped, 2, timeout=60)
    assert all(e is not None and "parameter 0" in e for e in errors), errors


def test_residual_is_kept_unscaled_under_grad_scaler():
    for without, with_scaler in run_ranks(_workers.residual_is_unscaled, 2, timeout=60):
        assert without.abs().sum() > 0
        assert_bitwise_equal(without, with_scaler, "residual with and without GradScaler")
