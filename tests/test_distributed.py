"""The contract on several gloo processes: sync, conservation, average, resume, no hangs."""

import _workers
import pytest
import torch
from _dist import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecomm

COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.float16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(2e-3),
    sparsecomm.TopK(0.05),
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


def _expected_average(sents: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(sents[0])
    for sent in sents:  # rank order, each scaled by 1/W, like the aggregation
        total = total + sent * (1.0 / len(sents))
    return total


@settings(max_examples=4)
@given(
    compressor=st.sampled_from(
        [
            sparsecomm.TopK(0.01),
            sparsecomm.TopK(0.1),
            sparsecomm.Threshold(0.5),
            sparsecomm.Threshold(1.5),
            sparsecomm.Cast(torch.float16),
        ]
    ),
    numel=st.sampled_from([257, 1000, 3001]),
    seed=st.integers(0, 2**16),
)
def test_conservation_and_average_three_ranks(compressor, numel, seed):
    world_size, cases = 3, 4
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(world_size, numel, generator=gen) for _ in range(cases)]
    grads[1][:, ::7] = 0.0  # zeros and ties
    grads[2][1] = 1.0
    results = run_ranks(_workers.conservation, world_size, compressor, grads, numel)
    for _, stats in results:  # profile=True: the three shares of the step were timed
        assert stats.communicate_seconds > 0 and stats.compress_seconds > 0
        assert stats.aggregate_seconds >= 0
    results = [records for records, _ in results]
    for case in range(cases):
        sents = []
        for rank in range(world_size):
            grad, old, new, _ = results[rank][case]
            sent = grad + old - new
            sents.append(sent)
            if isinstance(compressor, sparsecomm.TopK):
                k = compressor.k_for(numel)
                assert int((new == 0).sum()) >= k  # k slots sent (others may be zero too)
                assert int((sent != 0).sum()) <= k
        averages = [results[rank][case][3] for rank in range(world_size)]
        for rank in range(1, world_size):
            assert_bitwise_equal(averages[0], averages[rank], f"average on rank {rank}")
        expected = _expected_average(sents)
        if isinstance(compressor, sparsecomm.Cast):
            # The sum itself runs in fp16 on the wire: rounding of the cast, not exact.
            torch.testing.assert_close(averages[0], expected, rtol=2e-3, atol=2e-3)
        else:
            sparse_path = (
                compressor.k_for(numel) * world_size < numel
                if isinstance(compressor, sparsecomm.TopK)
                else False
            )
            if sparse_path:
                assert_bitwise_equal(averages[0], expected, "average vs sum of sent / W")
            else:
                torch.testing.assert_close(averages[0], expected, rtol=1e-6, atol=1e-7)


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


def test_grad_scaler_overflow_on_one_rank_skips_everywhere():
    results = run_ranks(_workers.grad_scaler_overflow, 2, timeout=60)
    for scales, skipped, residual_finite, params, skipped_steps in results:
        assert scales == [1024.0, 1024.0, 512.0, 512.0], scales
        assert skipped == [False, False, True, False], skipped
        assert residual_finite
        assert skipped_steps == 1
        assert torch.equal(params, results[0][3])


def test_residual_is_kept_unscaled_under_grad_scaler():
    for without, with_scaler in run_ranks(_workers.residual_is_unscaled, 2, timeout=60):
        assert without.abs().sum() > 0
        assert_bitwise_equal(without, with_scaler, "residual with and without GradScaler")
