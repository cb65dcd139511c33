"""The exchange during backward (both front doors): the same bits as the exchange inside
step(), gradient accumulation with no_sync(), a used set that changes between steps and
ranks, the DDP comm hook in sync and resumed bitwise."""

import contextlib
import weakref

import _overlap_workers as w
import pytest
import torch
from _dist import run_ranks

import sparsecomm
from sparsecomm import _engine

COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(1e-2),
    sparsecomm.TopK(0.1),
    sparsecomm.TopK(0.1, value_dtype=torch.bfloat16),
]


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a.view(torch.int32) != b.view(torch.int32)).nonzero().flatten()[:5].tolist()
    return f"{len(bad)}+ elements differ, first at {bad}: {a[bad].tolist()} vs {b[bad].tolist()}"


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_overlap_gives_the_bits_of_the_exchange_in_step(compressor):
    results = run_ranks(w.overlap_matches_step, 2, compressor, 5)
    for rank, out in enumerate(results):
        (overlapped, after_backward), (in_step, never) = out[True], out[False]
        assert torch.equal(overlapped, in_step), f"rank {rank}: {_diff(overlapped, in_step)}"
        assert after_backward == 4 and never == 0  # the first step exchanges in step()
    assert torch.equal(results[0][True][0], results[1][True][0])


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Cast(torch.float16)])
def test_no_sync_accumulates_like_one_exchange_of_the_sum(compressor):
    results = run_ranks(w.accumulate, 2, compressor, 3)
    for rank, (no_sync, summed) in enumerate(results):
        assert torch.equal(no_sync, summed), f"rank {rank}: {_diff(no_sync, summed)}"
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Threshold(1e-2)])
def test_used_parameters_change_between_steps_and_ranks(compressor):
    results = run_ranks(w.changing_used_set, 2, compressor)
    assert torch.equal(results[0][0], results[1][0])
    assert all(all(none) for _, none in results)


def test_backward_twice_before_step_names_no_sync():
    errors = run_ranks(w.backward_twice, 2)
    assert all(e is not None and "no_sync" in e for e in errors), errors


@pytest.mark.parametrize("in_no_sync", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_backward_after_synchronize_raises_in_every_mode(overlap, in_no_sync):
    # After synchronize(), .grad holds the ranks' average: a gradient added to it would be
    # this rank's alone, and the ranks would step apart. In step()'s exchange mode (the
    # first step, overlap=False, GradScaler) it was added silently.
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.1), overlap=overlap
    )
    for _ in range(2):  # the second step exchanges during backward where overlap is on
        model(torch.randn(4, 16)).sum().backward()
        opt.synchronize()
        with pytest.raises(RuntimeError, match="backward ran again.*no_sync"):
            with opt.no_sync() if in_no_sync else contextlib.nullcontext():
                model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_reentrant_checkpoint_raises_naming_use_reentrant_false(reentrant):
    # The recomputation's backward ends inside the outer one; its end looked like the
    # step's, which sent the buckets before the layers below the checkpoint had gradients.
    torch.manual_seed(0)
    first = torch.nn.Linear(8, 16)
    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = [*first.parameters(), *block.parameters()]
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.1), min_compress_numel=0
    )

    def step():
        out = torch.utils.checkpoint.checkpoint(
            block, first(torch.randn(2, 8)), use_reentrant=reentrant
        )
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the first step exchanges in step(): nothing to tell
    if reentrant:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            step()
    else:
        step()
        step()


# Where each rank's first backward of step 2 stops: after a layer (some buckets sent, some
# not), before any parameter's gradient (4: the loss's own backward raised), or nowhere.
DROP_CASES = {
    "both-failed-at-different-layers": [0, 2],
    "one-failed-one-finished": [2, None],
    "one-failed-before-any-gradient-one-finished": [4, None],
    "one-failed-before-any-gradient-one-part-way": [4, 0],
}


@pytest.mark.parametrize("case", DROP_CASES)
@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Dense()], ids=repr)
def test_drop_step_after_a_failed_backward_keeps_every_rank_in_step(compressor, case):
    boom_at = DROP_CASES[case]
    results = run_ranks(w.drop_and_retry, 2, compressor, boom_at)
    dropped = [rank for rank, boom in enumerate(boom_at) if boom is not None]
    for rank, (failed, clean) in enumerate(results):
        assert failed[2] == dropped, f"rank {rank}: StepDroppedError named {failed[2]}"
        # The dropped step changed nothing: the retry gives a clean run's bits.
        assert torch.equal(failed[0], clean[0]), f"rank {rank}: {_diff(failed[0], clean[0])}"
        assert torch.equal(failed[1], clean[1]), f"rank {rank}: {_diff(failed[1], clean[1])}"
        assert (failed[3], clean[3]) == (1, 0)
    assert torch.equal(results[0][0][0], results[1][0][0])


@pytest.mark.parametrize(
    "wrap_kwargs, accumulate",
    [
        ({"overlap": False}, None),
        ({"exchange": "updates"}, None),
        ({}, "after"),
        ({}, "inside"),
        ({}, "inside-zero_grad"),
        ({"exchange": "updates"}, "inside-zero_grad"),
        ({"inner": "shared-moment"}, None),
        ({"inner": "shared-moment"}, "inside-zero_grad"),
        ({"exchange": "local_updates"}, None),
    ],
    ids=[
        "no-overlap",
        "updates",
        "after-no_sync",
        "inside-no_sync",
        "inside-no_sync-then-zero_grad",
        "updates-inside-no_sync-then-zero_grad",
        "local-updates-shared-moment",  # its step's agreement carries the refresh's flags
        "local-updates-shared-moment-inside-no_sync-then-zero_grad",
        "local-updates",
    ],
)
def test_drop_step_in_the_other_exchange_modes_keeps_every_rank_in_step(wrap_kwargs, accumulate):
    results = run_ranks(
        w.drop_and_retry, 2, sparsecomm.TopK(0.1), [2, None], wrap_kwargs, accumulate
    )
    for rank, (failed, clean) in enumerate(results):
        # inside-zero_grad: the rank that dropped never calls step() for that batch
        named = None if rank == 0 and accumulate == "inside-zero_grad" else [0]
        assert failed[2] == named, f"rank {rank}: StepDroppedError named {failed[2]}"
        assert torch.equal(failed[0], clean[0]), f"rank {rank}: {_diff(failed[0], clean[0])}"
        assert torch.equal(failed[1], clean[1]), f"rank {rank}: {_diff(failed[1], clean[1])}"
        assert (failed[3], clean[3]) == (1, 0), f"rank {rank}: skipped {failed[3]}, {clean[3]}"
        assert torch.equal(failed[4], clean[4]), f"rank {rank}: {_diff(failed[4], clean[4])}"
    assert torch.equal(results[0][0][0], results[1][0][0])


def test_drop_step_under_grad_scaler_skips_on_every_rank_and_lowers_every_scale():
    results = run_ranks(w.drop_under_grad_scaler, 2, [2, None])
    for rank, (scales, _, skipped) in enumerate(results):
        assert scales[1] == scales[0] == 2.0**10, f"rank {rank}: {scales}"
        assert scales[2] == 2.0**9, f"rank {rank}: the dropped step did not lower {scales}"
        assert skipped == 1
    assert torch.equal(results[0][1], results[1][1])


def test_zero_grad_after_a_finished_backward_skips_the_step():
    model = w.make_model()
    opt = w.wrap(model, sparsecomm.TopK(0.1))
    for step in range(4):
        x, y = w.batch(0, step)
        w._loss(model, x, y, boom_at=None).backward()  # exchanged during backward
        if step == 2:
            assert opt._synchronized
            before = w.flat(model)
            opt.zero_grad()  # no step(): skipped
            assert torch.equal(before, w.flat(model))
            continue
        opt.step()
        opt.zero_grad()
    assert opt.total_stats.skipped_steps == 1 and opt.steps_taken == 3


@pytest.mark.parametrize("where", ["launch", "after-agreement"])
def test_drop_step_refuses_a_step_whose_exchange_itself_raised(where, monkeypatch):
    # Collectives may have been issued that cannot be taken back: a clear error, not a
    # second round of collectives that the other ranks would never match.
    model = w.make_model()
    opt = w.wrap(model, sparsecomm.TopK(0.1))
    for step in range(2):
        x, y = w.batch(0, step)
        w._loss(model, x, y, boom_at=None).backward()
        opt.step()
        opt.zero_grad()

    def fail(*args, **kwargs):
        raise MemoryError("out of memory (test)")

    target = "_compress_and_start" if where == "launch" else "finish"
    monkeypatch.setattr(opt._engine, target, fail)
    with pytest.raises(MemoryError):
        w._loss(model, x, y, boom_at=None).backward()
    with pytest.raises(RuntimeError, match="cannot drop"):
        opt.drop_step()


@pytest.mark.parametrize(
    "kwargs, steps_before",
    [({}, 2), ({}, 0), ({"overlap": False}, 2), ({"exchange": "updates"}, 2)],
    ids=["during-backward", "first-step", "overlap-off", "updates"],
)
def test_zero_grad_after_a_failed_backward_names_drop_step(kwargs, steps_before):
    """Whether the exchange runs during backward (from the second step on) or in step()
    (the first step, overlap=False, exchange="updates"), zero_grad() after a backward that
    raised refuses: the other ranks wait for this rank's part, which drop_step() sends."""
    model = w.make_model()
    opt = w.wrap(model, sparsecomm.TopK(0.1), **kwargs)
    x, y = w.batch(0, 0)
    for step in range(steps_before):  # from the second step on, buckets go during backward
        x, y = w.batch(0, step)
        w._loss(model, x, y, boom_at=None).backward()
        opt.step()
        opt.zero_grad()
    w._Boom.armed = True
    try:
        with pytest.raises(MemoryError):
            w._loss(model, x, y, boom_at=0).backward()
    finally:
        w._Boom.armed = False
    with pytest.raises(RuntimeError, match="drop_step"):
        opt.zero_grad()
    opt.drop_step()
    opt.drop_step()  # a second call sends nothing more
    with pytest.raises(sparsecomm.StepDroppedError):
        opt.step()
    opt.zero_grad()
    w._loss(model, x, y, boom_at=None).backward()
    if not kwargs and steps_before:  # exchanged during backward: too late to drop
        with pytest.raises(RuntimeError, match="finished"):
            opt.drop_step()
    opt.step()
    assert opt.total_stats.skipped_steps == 1


# ------------------------------------------------------------------ the DDP front door


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_ddp_hook_keeps_ranks_in_sync(compressor):
    results = run_ranks(w.ddp_hook_in_sync, 2, compressor, 4)
    (params0, bytes0, iterations), (params1, _, _) = results
    assert torch.equal(params0, params1), _diff(params0, params1)
    assert iterations == 4 and bytes0 > 0
    dense_bytes = 4 * params0.numel()
    if not isinstance(compressor, sparsecomm.Dense):
        assert bytes0 < dense_bytes


def test_ddp_hook_with_catchup_adamw_keeps_ranks_in_sync():
    start = w.flat(w.make_model())
    (params0, oldest0), (params1, oldest1) = run_ranks(w.ddp_hook_catchup, 2, 6)
    assert torch.equal(params0, params1), _diff(params0, params1)
    assert not torch.equal(params0, start)
    assert oldest0 == oldest1
    assert min(oldest0) < 6  # some coordinates waited: the catch-up had bursts to take


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Cast(torch.bfloat16)])
def test_ddp_hook_keeps_one_residual_per_bucket_after_the_rebuild(compressor):
    # Before the fix every bucket after the first took its layout for a rebuild, split all
    # residuals into pieces and concatenated its own anew: a copy per bucket and step.
    for addresses in run_ranks(w.ddp_hook_residual_buffers, 2, compressor, 6):
        assert len(addresses[-1]) > 1  # several DDP buckets
        assert addresses[2] == addresses[3] == addresses[4] == addresses[5], addresses


def test_ddp_hook_dense_matches_ddp():
    for plain, hooked in run_ranks(w.ddp_hook_dense_matches_ddp, 2, 4):
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cap, phase",
    [(25, "second"), (0.01, "after-a-backward")],
    ids=["one-bucket", "several-buckets-loaded-after-a-backward"],
)
def test_ddp_hook_resumes_bitwise(tmp_path, cap, phase):
    """A run resumed in new processes is bitwise the run that never stopped: with one DDP
    bucket (the layout DDP starts every process with is the one it keeps), and with
    several when the state is loaded after a backward (DDP has rebuilt its buckets by
    then; every residual still goes back to its own parameter)."""
    args = (str(tmp_path), 3, 6, cap)
    full = run_ranks(w.ddp_hook_resume, 2, args[0], "full", *args[1:])
    run_ranks(w.ddp_hook_resume, 2, args[0], "first", *args[1:])
    resumed = run_ranks(w.ddp_hook_resume, 2, args[0], phase, *args[1:])
    for rank in range(2):
        (a, residual_a), (b, residual_b) = full[rank], resumed[rank]
        assert torch.equal(a, b), f"rank {rank}: {_diff(a, b)}"
        assert residual_a.keys() == residual_b.keys()
        assert all(torch.equal(residual_a[k], residual_b[k]) for k in residual_a)


@pytest.mark.parametrize("thrown_away", [0, 1, 2])
def test_ddp_hook_states_of_different_iterations_raise_on_every_rank(thrown_away):
    """Loaded before any backward, or after the one or two thrown away that a resume takes
    for DDP to rebuild its buckets (two under static_graph=True)."""
    results = run_ranks(w.ddp_hook_loaded_at_different_iterations, 2, thrown_away, timeout=90)
    for message in results:
        assert message is not None and "different iterations ([2, 1] by rank)" in message


@pytest.mark.parametrize(
    "compressor", [sparsecomm.Dense(), sparsecomm.Cast(torch.bfloat16), sparsecomm.TopK(0.1)],
    ids=repr,
)  # fmt: skip
def test_ddp_hook_raises_the_error_of_a_collective_that_failed(compressor):
    """Rank 1 sits out step 2: rank 0's backward raises the collective's error, as under
    DDP's own hook, instead of averaging its own gradient alone (or failing on an unfilled
    buffer)."""
    outcome = run_ranks(w.ddp_hook_collective_fails, 2, compressor, 3, timeout=90)[0]
    assert outcome != "no error"
    kind, message = outcome
    assert "IndexError" not in kind + message, outcome
    # gloo's words for it vary: "Timed out waiting", "Application timeout caused pair
    # closure", "Connection reset by peer".
    assert any(word in message.lower() for word in ("time", "connection", "clos")), outcome


@pytest.mark.parametrize("which", ["dtype", "dense_iterations"])
def test_ddp_hooks_built_with_different_settings_raise_on_every_rank(which):
    for message in run_ranks(w.ddp_hook_built_differently, 2, which, timeout=90):
        assert message is not None and "different settings" in message, message


def test_ddp_hook_carries_residuals_through_a_layout_change(tmp_path):
    """Small DDP buckets: DDP rebuilds them after each process's first iteration, and a
    resumed process starts from its first layout again. Every parameter keeps a residual
    of its own size throughout, and the resumed ranks stay in sync."""
    args = (str(tmp_path), 3, 6, 0.01)
    first = run_ranks(w.ddp_hook_resume, 2, args[0], "first", *args[1:])
    resumed = run_ranks(w.ddp_hook_resume, 2, args[0], "second", *args[1:])
    numels = sorted(p.numel() for p in w.make_model().parameters())
    for _, residuals in first + resumed:
        assert sorted(r.numel() for r in residuals.values()) == numels
        assert all(r.abs().sum() > 0 for r in residuals.values() if r.numel() > 50)
    assert torch.equal(resumed[0][0], resumed[1][0])


@pytest.mark.parametrize("cap", [0.01, 25], ids=["several-buckets", "one-bucket"])
def test_ddp_hook_under_grad_scaler_skips_once_per_overflow(tmp_path, cap):
    """An overflow skips one step with the hook, as without it, at DDP's first iteration
    (before its bucket rebuild, which with one bucket changes its layout) and later; a
    state saved right after an overflow holds finite residuals and loads."""
    args = ((0, 3, 5), 6, str(tmp_path), cap)
    plain = run_ranks(w.ddp_hook_under_grad_scaler, 2, False, *args)
    hooked = run_ranks(w.ddp_hook_under_grad_scaler, 2, True, *args)
    assert plain[0][0] == [512.0, 512.0, 512.0, 256.0, 256.0, 128.0]
    for rank in range(2):
        scales, refused = hooked[rank]
        assert scales == plain[0][0]
        assert refused is None
        saved = torch.load(tmp_path / f"hook_rank{rank}.pt", weights_only=True)
        assert all(torch.isfinite(r).all() for r in saved["residuals"].values())


_SKIPPED = [  # (compressor, bucket cap in MiB, the step that overflows)
    (sparsecomm.TopK(0.1), 0.01, 2),
    (sparsecomm.TopK(0.1), 0.01, 0),  # before DDP's bucket rebuild
    (sparsecomm.TopK(0.1), 25, 2),  # one bucket
    (sparsecomm.TopK(0.1), 25, 0),
    (sparsecomm.TopK(0.1, value_dtype=torch.bfloat16), 0.01, 2),
    (sparsecomm.Threshold(1e-2), 0.01, 2),
    (sparsecomm.TopK(0.6), 0.01, 2),  # sent as a dense all-reduce (fewer bytes)
]


@pytest.mark.parametrize(("compressor", "cap", "overflow_at"), _SKIPPED, ids=repr)
def test_ddp_hook_gives_back_what_a_skipped_step_sent(compressor, cap, overflow_at):
    """A step GradScaler skips (rank 0 sent NaN) applies nothing, so the ranks whose
    messages were finite keep, bit for bit, their residual plus that step's gradient:
    nothing they sent is lost. The same training whether the hook settles the skipped
    step in state_dict() or at the next iteration's first bucket; ranks in sync."""
    finals = []
    for look in (True, False):
        results = run_ranks(
            w.ddp_hook_skip_gives_back_what_was_sent, 2, compressor, cap, overflow_at, look
        )
        for rank, (scales, expected, after, _) in enumerate(results):
            assert scales == [1024.0] * overflow_at + [512.0] * 3  # skipped once
            if not look:
                continue
            for e, a in zip(expected, after):
                assert torch.isfinite(a).all()
                if rank == 1:
                    assert torch.equal(a, e), _diff(a.flatten(), e.flatten())
        assert torch.equal(results[0][3], results[1][3])
        finals.append(results[0][3])
    assert torch.equal(finals[0], finals[1])


def test_ddp_hook_gives_back_what_a_skipped_step_sent_on_one_process():
    """One process, two buckets: an Inf in one bucket's gradient skips the step; that
    bucket drops its residual, the other keeps its residual plus its gradient, bit for
    bit."""
    for compressor in (sparsecomm.TopK(0.1), sparsecomm.Threshold(0.5)):
        expected, after = w.hook_skip_on_one_bucket(torch.device("cpu"), compressor)
        assert torch.equal(after[0], expected[0]), compressor
        assert not after[1].any(), compressor


def test_ddp_hook_state_refuses_a_missing_iteration_and_cuda_graphs_not_a_bool():
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))
    hook(state, _Bucket(torch.linspace(1, 2, 10))).wait()
    saved = state.state_dict()
    del saved["iteration"]
    with pytest.raises(ValueError, match="'iteration' must be an int"):
        sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))[0].load_state_dict(saved)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2), cuda_graphs="no")


def test_ddp_hook_refuses_a_residual_of_another_model():
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))
    hook(state, _Bucket(torch.linspace(1, 2, 10))).wait()
    other, other_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))
    other.load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match=r"has shape \[12\].* it has shape \[10\]"):
        other_hook(other, _Bucket(torch.zeros(12)))


@pytest.mark.parametrize("change", ["a layer more", "a layer less"])
def test_ddp_hook_refuses_a_model_with_parameters_of_the_same_sizes_added_or_removed(change):
    """Keys are positions in DDP's first layout: a model with one more (or one fewer)
    parameter of the same shape would take residuals for the wrong parameters."""
    a, b, c = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.5))
    hook(state, _Bucket(torch.linspace(1, 2, 8), params=[a, b])).wait()
    saved = state.state_dict()
    assert saved["shapes"] == {0: [4], 1: [4]}
    other, other_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.5))
    other.load_state_dict(saved)
    if change == "a layer more":
        with pytest.raises(ValueError, match="parameter 2 .* of 2 parameters, it is not there"):
            other_hook(other, _Bucket(torch.zeros(12), params=[c, a, b])).wait()
    else:
        with pytest.raises(ValueError, match="this model has 1 parameters, the loaded state's"):
            other_hook(other, _Bucket(torch.zeros(4), params=[a])).wait()
    # Refused at the load when the hook has seen this process's model already.
    seen, seen_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.5))
    seen_hook(seen, _Bucket(torch.zeros(12), params=[c, a, b])).wait()
    with pytest.raises(ValueError, match="parameter 2 .* it is not there"):
        seen.load_state_dict(saved)


_Bucket = w.Bucket


def test_ddp_hook_keys_parameters_in_the_first_layout_even_when_it_is_sent_dense():
    """``dense_iterations=1``: the first iteration (DDP's first layout, a then b) is sent
    dense, the later ones in the rebuilt layout (b then a). A process that loads the state
    sees the first layout at once and compresses it: every residual reaches its own
    parameter."""
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(6))
    gen = torch.Generator().manual_seed(0)
    grad_a, grad_b = torch.randn(4, generator=gen), torch.randn(6, generator=gen)
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.3), dense_iterations=1)
    hook(state, _Bucket(torch.cat([grad_a, grad_b]), params=[a, b])).wait()
    for _ in range(2):
        hook(state, _Bucket(torch.cat([grad_b, grad_a]), params=[b, a])).wait()
    kept_b, kept_a = state.residuals[0].clone().split([6, 4])
    saved = state.state_dict()
    # Keys in the order of the first layout, which the loading process sees first.
    assert torch.equal(saved["residuals"][0], kept_a)
    assert torch.equal(saved["residuals"][1], kept_b)
    fresh, fresh_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.3), dense_iterations=1)
    fresh.load_state_dict(saved)
    sent = fresh_hook(fresh, _Bucket(torch.zeros(10), params=[a, b])).wait()
    assert torch.equal(sent + fresh.residuals[0], torch.cat([kept_a, kept_b]))


@pytest.mark.parametrize("compressor", COMPRESSORS[1:], ids=repr)
def test_ddp_hook_conserves_exactly(compressor):
    state, hook = sparsecomm.ddp_comm_hook(compressor, dense_iterations=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(3001, generator=gen) * torch.logspace(-3, 1, 3001)
        old = state.residuals.get(0, torch.zeros(3001)).clone()
        sent = hook(state, _Bucket(grad.clone())).wait()  # one rank: the average is what it sent
        new = state.residuals[0]
        assert torch.equal(sent + new, grad + old), _diff(sent + new, grad + old)
        assert new.abs().sum() > 0  # something was kept back


def test_ddp_hook_drops_a_residual_poisoned_by_nan():
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01), dense_iterations=0)
    grad = torch.randn(1000)
    grad[5] = float("nan")
    assert not torch.isfinite(hook(state, _Bucket(grad.clone())).wait()).all()
    assert state.residuals[0].abs().sum() > 0
    after = torch.linspace(-1, 1, 1000)
    hook(state, _Bucket(after.clone())).wait()
    # The poisoned step's residual was dropped: as if this were the first gradient.
    fresh, fresh_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01), dense_iterations=0)
    fresh_hook(fresh, _Bucket(after.clone())).wait()
    assert torch.equal(state.residuals[0], fresh.residuals[0])


def test_ddp_hook_state_dict_checks_before_loading():
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))
    hook(state, _Bucket(torch.linspace(1, 2, 10))).wait()
    saved = state.state_dict()
    kept = torch.cat([torch.linspace(1, 2, 10)[:8], torch.zeros(2)])  # the top 2 were sent
    assert torch.equal(saved["residuals"][0], kept)
    other, _ = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.02))
    with pytest.raises(ValueError, match="compressor"):
        other.load_state_dict(saved)
    poisoned = dict(saved, residuals={0: torch.full((10,), float("nan"))})
    fresh, fresh_hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.2))
    with pytest.raises(ValueError, match="NaN"):
        fresh.load_state_dict(poisoned)
    fresh.load_state_dict(saved)
    assert fresh.iteration == 1
    # The loaded residual joins the next gradient: zeros now send its two largest.
    sent = fresh_hook(fresh, _Bucket(torch.zeros(10))).wait()
    assert sent.nonzero().flatten().tolist() == [6, 7]


def test_ddp_hook_rejects_bad_arguments():
    with pytest.raises(TypeError, match="compressor"):
        sparsecomm.ddp_comm_hook("topk")
    with pytest.raises(ValueError, match="dense_iterations"):
        sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01), dense_iterations=-1)
    with pytest.raises(TypeError, match="error_feedback"):
        sparsecomm.ddp_comm_hook(sparsecomm.Dense(), error_feedback=1)


# ------------------------------------------------------------------ memory between steps


def _train_zeroing(compressor, zero, steps=5, release=True, **kwargs):
    model = w.make_model()
    opt = w.wrap(model, compressor, **kwargs)
    opt._engine.release_buffers = release  # True: CUDA's default, here on a CPU
    for step in range(steps):
        x, y = w.batch(0, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        zero(model, opt)
    return model, opt


@pytest.mark.parametrize(
    "compressor",
    [sparsecomm.Dense(), sparsecomm.TopK(0.1), sparsecomm.Cast(torch.bfloat16)],
    ids=repr,
)
def test_zero_grad_releases_the_gradient_buffers_and_keeps_the_bits(compressor):
    kept, _ = _train_zeroing(compressor, lambda m, o: m.zero_grad(set_to_none=True))
    model, opt = _train_zeroing(compressor, lambda m, o: o.zero_grad())
    assert torch.equal(w.flat(kept), w.flat(model)), _diff(w.flat(kept), w.flat(model))
    # Buckets with a residual hold two buffers (DDP one): their gradient buffer goes.
    # The others (Dense, small parameters) hold one and keep it, unless they hold one
    # parameter, whose next gradient autograd allocates and the bucket adopts.
    buckets = [b for b in opt._engine.buckets if b.residual is not None or b.adopts]
    kept = [b for b in opt._engine.buckets if b.residual is None and not b.adopts]
    assert all(b.grad_buffer is not None for b in kept)
    assert all(b.grad_buffer is None for b in buckets)
    if isinstance(compressor, sparsecomm.Dense):
        assert kept
        return
    assert len(buckets) > 1 and all(b.grad_buffer is None for b in buckets)
    # One more step: the average lives in each bucket's buffer until opt.zero_grad().
    x, y = w.batch(0, 99)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    averages = [weakref.ref(b.grad_buffer) for b in buckets]
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=False)  # zeroed in place: the buffers are kept
    assert all(a() is not None for a in averages)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(a() is None for a in averages), "a released buffer is still alive"


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Cast(torch.bfloat16)])
def test_cpu_buckets_keep_their_gradient_buffers_across_zero_grad(compressor):
    """On a CPU a dropped buffer would come back as fresh pages from the kernel, each
    faulted in by its first write: the buckets keep theirs (those adopting autograd's
    gradient excepted), with the bits of the releasing path."""
    one_bucket = {"bucket_cap_mb": 1}  # the two weights in one bucket, which cannot adopt
    released, _ = _train_zeroing(compressor, lambda m, o: o.zero_grad(), **one_bucket)
    model, opt = _train_zeroing(compressor, lambda m, o: o.zero_grad(), release=None, **one_bucket)
    assert torch.equal(w.flat(released), w.flat(model)), _diff(w.flat(released), w.flat(model))
    held = [b for b in opt._engine.buckets if b.residual is not None and not b.adopts]
    assert held and all(b.grad_buffer is not None for b in held)

    # (A step may swap a bucket's gradient and residual buffers: the pair stays.)
    def buffers():
        return [{b.grad_buffer.data_ptr(), b.residual.data_ptr()} for b in held]

    before = buffers()
    x, y = w.batch(0, 99)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    assert buffers() == before
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Gradient buffers allocated anew are filled with NaN: a member left unwritten would
    have its step refused."""
    allocate = _engine.Bucket.gradient_buffer

    def poisoned(bucket):
        fresh = bucket.grad_buffer is None
        buffer = allocate(bucket)
        if fresh:
            buffer.fill_(float("nan"))
        return buffer

    monkeypatch.setattr(_engine.Bucket, "gradient_buffer", poisoned)


@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.1), sparsecomm.Cast(torch.float16)])
def test_gradients_copied_at_launch_give_the_bits_of_copies_on_arrival(
    compressor, poisoned_buffers
):
    """The CUDA path copies a bucket's gradients with one foreach call at its launch; here
    forced on a CPU against copies as each gradient arrives, with a layer that has no
    gradient every other step (its members are zeroed the same way). Buffers allocated
    anew are poisoned with NaN, so a member left unwritten would be refused."""
    results = []
    for defer in (False, True):
        model = w.make_model()
        opt = w.wrap(model, compressor)
        opt._engine.defer_copies = defer
        for step in range(6):
            x, y = w.batch(0, step)
            if step % 2:
                out = model(x)
            else:  # the first layer has no gradient
                out = model[2:](x.sum(1, keepdim=True).expand(-1, w.HIDDEN))
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 3 != 0)
        results.append(w.flat(model))
    assert torch.equal(results[0], results[1]), _diff(results[0], results[1])


class _MixedPrecision(torch.nn.Module):
    """w.make_model's layers with the middle one in bf16 (its gradient is bf16: the engine
    converts it into the float32 bucket)."""

    def __init__(self):
        super().__init__()
        self.layers = w.make_model()
        self.layers[2].to(torch.bfloat16)

    def forward(self, x, skip_first=False):
        first, middle, last = self.layers[0], self.layers[2], self.layers[4]
        x = x.sum(1, keepdim=True).expand(-1, w.HIDDEN) if skip_first else torch.tanh(first(x))
        x = torch.tanh(middle(x.to(torch.bfloat16))).float()
        return last(x)


@pytest.mark.parametrize(
    "compressor",
    [
        sparsecomm.TopK(0.1),
        sparsecomm.Threshold(2e-3),
        sparsecomm.TopK(0.05, warmup_steps=3, warmup="dense"),
        sparsecomm.TopK(0.01, warmup_steps=4),
    ],
    ids=repr,
)
def test_sums_written_on_arrival_give_the_bits_of_copies(compressor, poisoned_buffers):
    """On a CPU a bucket of several members receives residual + gradient as each gradient
    arrives (``Bucket.accumulates``) and the compressor skips its own add; against the
    copy-then-add path, bit for bit: a bf16 layer, a layer without a gradient every other
    step, gradients accumulated in place after ``zero_grad(set_to_none=False)``, two
    backward passes under ``no_sync()``, and poisoned fresh buffers (a member left
    unwritten would be refused)."""
    results = []
    for accumulate in (True, False):
        model = _MixedPrecision()
        opt = w.wrap(model, compressor, bucket_cap_mb=1)  # both large weights in one bucket
        buckets = opt._engine.buckets
        assert any(b.accumulates for b in buckets), "no bucket takes the path under test"
        for bucket in buckets:
            bucket.accumulates = bucket.accumulates and accumulate
        # Registered after the optimizer's hook, so it runs after it: the sums never show
        # as .grad.
        grads_seen = []
        for bucket in buckets:
            for param in bucket.params if bucket.accumulates else []:
                param.register_post_accumulate_grad_hook(
                    lambda p, seen=grads_seen: seen.append(p.grad is None)
                )
        residuals = []
        for step in range(8):
            x, y = w.batch(0, step)
            if step == 5:
                with opt.no_sync():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            out = model(x, skip_first=step % 2 == 0)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 3 != 0)
            residuals.append(torch.cat([opt.residual(p).view(-1) for p in model.parameters()]))
        results.append((w.flat(model), torch.stack(residuals)))
        if accumulate:  # per backward, one entry per member with a gradient
            hooked = [False] + [True] * 6 + [False, False] + [True] * 5
            assert grads_seen == hooked  # the first step and no_sync() do not fill
    for ours, theirs in zip(results[0], results[1]):
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), _diff(ours, theirs)


def test_a_refused_step_keeps_the_residual_when_sums_are_written_on_arrival():
    """The sum goes into the gradient buffer, not the residual: a step refused for a NaN
    leaves every residual as it was."""
    model = w.make_model()
    opt = w.wrap(model, sparsecomm.TopK(0.1), bucket_cap_mb=1)
    assert any(b.accumulates for b in opt._engine.buckets)
    x, y = w.batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    before = [opt.residual(p) for p in model.parameters()]
    assert any(r.abs().sum() > 0 for r in before)
    x[0, 0] = float("nan")
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    for param, old in zip(model.parameters(), before):
        assert torch.equal(opt.residual(param).view(torch.int32), old.view(torch.int32))


def test_a_subclass_that_overrides_compress_alone_keeps_its_compress():
    """A TopK subclass with its own compress() (here counting its calls) is not bypassed by
    compress_accumulated(); one that overrides both takes the summing path."""

    class Counted(sparsecomm.TopK):
        calls = 0

        def compress(self, grad, residual, world_size, addresses=None):
            Counted.calls += 1
            return super().compress(grad, residual, world_size, addresses)

    class Both(Counted):
        def compress_accumulated(self, acc, world_size):
            return super().compress_accumulated(acc, world_size)

    assert sparsecomm.TopK(0.1).compresses_accumulated()
    assert sparsecomm.Threshold(0.1).compresses_accumulated()
    assert not sparsecomm.Dense().compresses_accumulated()
    assert not sparsecomm.Cast(torch.bfloat16).compresses_accumulated()
    assert not Counted(0.1).compresses_accumulated()
    assert Both(0.1).compresses_accumulated()
    model = w.make_model()
    opt = w.wrap(model, Counted(0.1), bucket_cap_mb=1)
    assert not any(b.accumulates for b in opt._engine.buckets)
    x, y = w.batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert Counted.calls == 1  # the one bucket of the two large weights


def _adopting_run(adopt: bool, steps: int = 5):
    """Train two 48x48 layers, one weight per bucket, with TopK locally; record the
    address of each gradient autograd produced and of each weight's residual after step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48))
    weights = [model[0].weight, model[2].weight]
    produced = {id(p): [] for p in weights}
    for p in weights:  # registered first, so it runs before the optimizer's hook
        p.register_post_accumulate_grad_hook(lambda p: produced[id(p)].append(p.grad.data_ptr()))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        sparsecomm.TopK(0.1),
        bucket_cap_mb=48 * 48 * 4 / 2**20,
    )
    for bucket in opt._engine.buckets:
        bucket.adopts = bucket.adopts and adopt
    residuals = {id(p): [] for p in weights}
    for step in range(steps):
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for p in weights:
            residuals[id(p)].append(opt._engine.member_of[id(p)][0].residual.data_ptr())
    return model, opt, weights, produced, residuals


def test_a_bucket_of_one_parameter_adopts_the_gradient_autograd_produced():
    model, opt, weights, produced, residuals = _adopting_run(adopt=True)
    assert all(opt._engine.member_of[id(p)][0].adopts for p in weights)
    for p in weights:
        # From the second step on (the first exchanges inside step()), the tensor autograd
        # allocated became the bucket's buffer and, after the swap, its residual.
        assert residuals[id(p)][1:] == produced[id(p)][1:]
    copied, *_ = _adopting_run(adopt=False)
    assert torch.equal(w.flat(model), w.flat(copied)), _diff(w.flat(model), w.flat(copied))


def test_a_gradient_tensor_assigned_before_backward_is_not_adopted_and_conserves():
    """A buffer of the caller's, zeroed and assigned as ``.grad`` before every backward
    (autograd accumulates into it): the bucket copies it and never takes it over, so
    zeroing it again cannot wipe the residual. Conservation, bit for bit, at W = 1."""
    layer = torch.nn.Linear(48, 48, bias=False)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.0), sparsecomm.TopK(0.1)
    )
    assert opt._engine.buckets[0].adopts
    buf = torch.zeros(48, 48)
    old = opt.residual(layer.weight)
    for step in range(4):
        c = torch.randn(48, 48, generator=torch.Generator().manual_seed(step))
        buf.zero_()
        layer.weight.grad = buf
        (layer.weight * c).sum().backward()  # the gradient is c, exactly
        opt.step()
        new = opt.residual(layer.weight)
        assert torch.equal(layer.weight.grad + new, c + old), f"step {step}: not conserved"
        assert opt._engine.buckets[0].residual.data_ptr() != buf.data_ptr()
        old = new


def test_a_gradient_kept_from_an_earlier_step_and_assigned_again_is_refused():
    # Between steps the gradient's buffer and the residual's trade places, so a .grad kept
    # from two steps back is the residual now: a backward into it lost the unsent part.
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 48, bias=False), torch.nn.Linear(48, 48, bias=False)
    )
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sparsecomm.TopK(0.1)
    )
    assert not opt._engine.buckets[0].adopts  # the two weights share a bucket
    weight, kept = model[0].weight, None
    for step in range(3):
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step))
        if step == 2:
            weight.grad = kept
            with pytest.raises(RuntimeError, match="keeps the unsent gradient in"):
                model(x).square().mean().backward()
            break
        model(x).square().mean().backward()
        opt.step()
        if step == 0:
            kept = weight.grad
        opt.zero_grad(set_to_none=False)


def test_gradients_the_user_assigned_are_copied_not_adopted():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 48, bias=False)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1), sparsecomm.TopK(0.1)
    )
    assert opt._engine.buckets[0].adopts
    for step in range(3):
        grad = torch.randn(48, 48, generator=torch.Generator().manual_seed(step))
        kept = grad.clone()
        layer.weight.grad = grad
        opt.step()
        assert torch.equal(grad, kept), "step() wrote into a gradient the user owns"
        assert opt._engine.buckets[0].residual.data_ptr() != grad.data_ptr()
        opt.zero_grad()
