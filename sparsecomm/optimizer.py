"""``CompressedOptimizer``: compressed, averaged gradients for any ``torch.optim`` optimizer.

The exchange runs in the bucket engine (``_engine.py``): gradients are sent bucket by
bucket while backward still runs, and ``step()`` (or the end of backward) finishes it.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import inspect
import itertools
import math
import warnings
import weakref
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ._comm import Communicator
from ._engine import (
    BucketEngine,
    _unflatten,
    build_buckets,
    cap_numel,
    reallocation_is_free,
    too_large_for_a_bucket,
)
from ._stats import StepStats
from .catchup import CatchUpAdamW
from .compressors import DENSE_ELEMENT_BYTES, Compressor, Threshold, TopK
from .shared_moment import SharedMomentAdamW

__all__ = ["CompressedOptimizer", "NonFiniteGradientError"]

_STATE_FORMAT = 1
_KEYWORDS = (
    "compressor",
    "error_feedback",
    "process_group",
    "bucket_cap_mb",
    "min_compress_numel",
    "overlap",
    "profile",
    "cuda_graphs",
    "momentum_correction",
    "exchange",
)

# GradScaler hands itself to an optimizer whose step() takes `grad_scaler`, with a
# FutureWarning about a newer protocol. That newer protocol gives the optimizer no way to
# tell the scaler that another rank overflowed, so sparsecomm keeps the older one, which
# lets every rank's scaler skip and back off together.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


class NonFiniteGradientError(RuntimeError):
    """The averaged gradient would not be finite: a gradient (plus residual) held NaN or
    Inf on some rank, or finite values so large that their sum over the ranks would
    overflow. Raised by ``step()`` on every rank alike; nothing (parameters, residuals,
    optimizer state) was changed.

    Under ``exchange="updates"`` or ``"local_updates"`` (``update=True``) it is the update
    of the wrapped optimizer's step, from finite gradients, that is not finite: no rank
    applies it, but every wrapped optimizer has stepped its own state.

    Attributes:
        ranks: the ranks (in the process group) whose values were not finite, or, when
            ``too_large``, whose values were the largest (above 1/W of the sum's limit).
        too_large: True when every value was finite but their sum could overflow.
        update: True when the values were the wrapped optimizer's update, not gradients.
    """

    def __init__(
        self, ranks: list[int], too_large: bool = False, *, update: bool = False,
        scaler: bool = True,
    ):  # fmt: skip
        self.ranks = ranks
        self.too_large = too_large
        self.update = update
        values = "updates" if update else "gradients"
        what = (
            f"finite {values} on rank(s) {ranks} so large that their sum over the ranks "
            "would overflow (float32, or the float16 or bfloat16 of a parameter they average "
            "into)"
            if too_large
            else f"non-finite {values[:-1]} (NaN or Inf) on rank(s) {ranks}"
        )
        changed = (
            "no rank applied it: parameters and residuals are unchanged, but every wrapped "
            "optimizer has stepped its own state (its moments, its step count)"
            if update
            else "the step was not taken on any rank, and parameters, residuals and "
            "optimizer state are unchanged"
        )
        advice = "Lower the learning rate or clip gradients"
        if scaler:  # (exchange="gradients" only: the update exchanges refuse a GradScaler)
            advice += (
                ", or train under torch.amp.GradScaler, which skips such steps on every "
                "rank together"
            )
        super().__init__(f"{what}: {changed}. {advice}.")


class StepDroppedError(RuntimeError):
    """Some rank dropped this step with :meth:`CompressedOptimizer.drop_step` (its backward
    raised, say out of memory). Raised by ``step()`` on every rank that did not drop it;
    nothing (parameters, residuals, optimizer state) was changed on any rank. Also raised,
    with ``stepped=True``, under ``exchange="updates"`` or ``"local_updates"`` when some
    rank's wrapped optimizer raised in its step: no update is applied anywhere, but the
    wrapped optimizers have stepped their state.

    Attributes:
        ranks: the ranks (in the process group) that dropped the step.
    """

    def __init__(self, ranks: list[int], stepped: bool = False):
        self.ranks = ranks
        if stepped:
            super().__init__(
                f"rank(s) {ranks} dropped this step: their wrapped optimizer raised in its "
                f"step (exchange='updates' or 'local_updates'). No rank applied the update: "
                "parameters and residuals are unchanged, but every wrapped optimizer has "
                "stepped its own state (the rank(s) that raised perhaps in part). Catch this "
                "error, call zero_grad() and go on, or restart from the last checkpoint"
            )
            return
        super().__init__(
            f"rank(s) {ranks} dropped this step (CompressedOptimizer.drop_step(), after their "
            "backward raised): the step was not taken on any rank, and parameters, residuals "
            "and optimizer state are unchanged. Catch this error, call zero_grad() and go on "
            "with the next batch (or the same one again, as the ranks that dropped it may)"
        )


# A rank's status in a step's agreement: it dropped the step (drop_step()).
_DROPPED = 1
# A rank's position in a step's agreement: the steps it applied (its step count less the
# failed steps it left unapplied: the wrapped optimizer raised on their averages, which
# were not retried), modulo this so that float32 holds it exactly, times two, plus one if
# it left any unapplied. Ranks whose positions differ have parameters that differ, from
# then on (until every rank loads a checkpoint). The agreement adds to it a fingerprint of
# the wrapped optimizer's settings, below this too (the sum stays below 2**24, which
# float32 holds exactly), so that settings that differ are found the same way.
_POSITION_MODULUS = 1 << 22


class _RanksApartError(RuntimeError):
    """The ranks' parameters differ: no GradScaler may turn it into a skipped step."""


def _ranks_apart_error(positions: list[int]) -> RuntimeError:
    """The error every rank raises when the ranks' positions (_POSITION_MODULUS) differ."""
    ranks = [rank for rank, position in enumerate(positions) if position % 2]
    if not 0 < len(ranks) < len(positions):
        steps = [position // 2 for position in positions]
        return _RanksApartError(
            f"the ranks have applied different numbers of steps (by rank, modulo "
            f"{_POSITION_MODULUS}: {steps}), so their parameters differ now: after a "
            "backward whose gradients were exchanged, some ranks called step() and others "
            "skipped it (zero_grad() without step()), or some ranks loaded a checkpoint "
            "alone. Restart every rank from the last checkpoint, and skip a step on every "
            "rank or on none"
        )
    return _RanksApartError(
        f"rank(s) {ranks} did not apply the previous step: the wrapped optimizer's step "
        "raised there and its averages were left (zero_grad(), a new backward, drop_step() "
        "or gradients set by hand followed), while the other ranks applied it, so the "
        "ranks' parameters differ now. Restart every rank from the last checkpoint. (After "
        "the wrapped optimizer's step raises, calling opt.step() again applies the same "
        "averaged gradients; if it raised on every rank, zero_grad() skips it everywhere.)"
    )


def _settings_apart_error(by_rank: list[list[dict]]) -> RuntimeError:
    """The error every rank raises when the wrapped optimizers' settings (a learning rate,
    say) differ between the ranks in a step's agreement."""
    where = "they agree again now, but differed when this step's agreement ran"
    for rank, theirs in enumerate(by_rank[1:], start=1):
        if theirs != by_rank[0]:
            where = _first_setting_difference(by_rank[0], theirs, rank)
            break
    return _RanksApartError(
        f"the wrapped optimizers' settings differ between the ranks ({where}), so the same "
        "averaged gradient would move their parameters apart. The step was refused on every "
        "rank and nothing changed; each step raises this until the settings agree. A "
        "learning-rate scheduler stepped on some ranks only does this, and so does one "
        "driven by a value each rank computes itself (ReduceLROnPlateau on each rank's own "
        "validation loss): step schedulers on every rank alike, on a value averaged over "
        "the ranks (torch.distributed.all_reduce) first"
    )


def _first_setting_difference(first: list[dict], other: list[dict], rank: int) -> str:
    if len(first) != len(other):
        return f"rank 0 has {len(first)} parameter groups, rank {rank} has {len(other)}"
    for index, (mine, theirs) in enumerate(zip(first, other)):
        for key in sorted(set(mine) | set(theirs)):
            if repr(mine.get(key)) != repr(theirs.get(key)):
                return (
                    f"parameter group {index}: {key}={mine.get(key)!r} on rank 0, "
                    f"{theirs.get(key)!r} on rank {rank}"
                )
    return f"rank {rank} differs from rank 0"


def _hook_result(result: Any, state: dict[str, Any]) -> dict[str, Any]:
    """What a state-dict hook returned, or the dict it was given (it returned None)."""
    return state if result is None else result


class _Wrapped:
    """An attribute of ``CompressedOptimizer`` that is its wrapped optimizer's
    (``param_groups``, ``state``): shared, not copied, so that a scheduler changing a
    learning rate here changes it there, also after the wrapped optimizer's own
    ``load_state_dict()`` built new containers. Before the wrapper is ready
    (``torch.optim.Optimizer.__init__`` fills containers of its own first), the object's
    own."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if obj.__dict__.get("_ready"):
            return getattr(obj.optimizer, self.name)
        return obj.__dict__[self.name]

    def __set__(self, obj, value) -> None:
        if obj.__dict__.get("_ready"):
            setattr(obj.optimizer, self.name, value)
        else:
            obj.__dict__[self.name] = value


class CompressedOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer so that each step uses the gradients averaged, in
    compressed form, over the ranks of a process group.

    Use it instead of ``DistributedDataParallel`` (not on top of it): build the same model on
    every rank, wrap its optimizer, and train as usual. Gradients are packed into flat
    float32 buckets; as soon as backward has produced a bucket's gradients, each rank adds
    its error-feedback residual, compresses, keeps what it did not send as the new
    residual, and starts the bucket's collective, while backward goes on. When backward
    ends, the averages are in ``p.grad`` (as under DDP, so gradient clipping sees the
    average); ``step()`` then steps the wrapped optimizer. ``param_groups`` is the wrapped
    optimizer's own list, so learning-rate schedulers, ``zero_grad`` and
    ``torch.amp.GradScaler`` work as usual.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        compressor: ``Dense()``, ``Cast(torch.float16)``, ``Cast(torch.bfloat16)``,
            ``Threshold(t)`` or ``TopK(density)``.
        error_feedback: keep what was not sent and add it to the next step's gradient
            (default True). Without it, unsent gradient is dropped.
        process_group: the group to average over; ``None`` for the default group. Without
            an initialized process group everything runs locally.
        bucket_cap_mb: largest bucket, in MiB of float32 (``float("inf")``: no cap).
            Default ``None``: the compressor's ``default_bucket_cap_mb``, 25 for ``Dense``
            and ``Cast`` (as DDP), 100 for ``TopK`` and ``Threshold``, whose messages are
            a small fraction of the bucket, so that fewer buckets cost fewer launches and
            less host time; for ``TopK`` and ``Threshold`` raised as far as it takes to
            keep to about 16 buckets (a model over 1.6 GiB of float32, ~420M
            parameters: ``docs/buckets.md``).
        min_compress_numel: parameters with fewer elements travel dense, uncompressed, in
            buckets of their own (default 1024: biases and norms are cheap to send whole,
            and a sparse index costs as much as a value).
        overlap: send buckets during backward (default True). The first step, steps
            under ``torch.amp.GradScaler``, and ``overlap=False`` exchange inside
            ``step()`` instead, from ``p.grad`` as it is then.
        profile: time compression, communication and aggregation in ``last_stats``
            (synchronizes the device and runs each collective to completion, so it hides
            no communication behind backward; off by default).
        cuda_graphs: on CUDA, replay each bucket's compression from a CUDA graph once it
            has run twice (default True; ``TopK`` and ``Cast``): one launch instead of a dozen
            from Python. Capturing synchronizes the device once per bucket and buffer.
        momentum_correction: a momentum factor ``m`` in ``[0, 1)`` to apply before
            compression, as Deep Gradient Compression (Lin et al. 2018) does for SGD with
            momentum: each rank keeps a velocity ``u = m * u + grad`` per element, error
            feedback accumulates ``u`` (not the gradient), and a coordinate sent in a
            sparse message has its ``u`` zeroed (momentum factor masking). The wrapped
            optimizer must then be ``torch.optim.SGD`` with ``momentum=0``: the momentum
            lives here instead. Default ``None``: off.
        exchange: what is compressed and averaged. ``"gradients"`` (default): each rank's
            gradient; the wrapped optimizer steps on the average. ``"updates"``: each rank
            first steps the wrapped optimizer on its own gradient, and the update it made
            (new parameters minus old) is compressed with error feedback, averaged, and
            applied on every rank. The wrapped optimizer's state (Adam's moments) is then
            per rank, built from that rank's gradients; an adaptive optimizer's update is
            the same size for every coordinate, so error feedback delays it without
            shrinking it. No overlap with backward (the update exists only after it), one
            more small all-reduce per step (to refuse a non-finite gradient before the
            wrapped optimizer steps; a non-finite *update* from finite gradients is
            refused too, but the wrapped optimizer has then stepped), no ``GradScaler``.
            ``"local_updates"``: as ``"updates"``, but each rank's model keeps the part of
            its own updates that error feedback has not sent yet: its parameters are the
            shared parameters (the average of what was sent, the same on every rank) plus
            its residual, so each rank takes its gradient where its own updates put it, not
            where the compression left the shared parameters. The ranks' parameters then
            differ by their residuals: evaluate and save the model inside
            :meth:`shared_parameters`. One more copy of the parameters in memory.

    Example:
        >>> model = torch.nn.Linear(64, 64)
        >>> opt = sparsecomm.CompressedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...     compressor=sparsecomm.TopK(density=0.01))
        >>> model(torch.randn(8, 64)).sum().backward()
        >>> opt.step(); opt.zero_grad()

    Warning:
        Construction, ``backward()`` of the model, ``step()``, ``synchronize()`` and
        ``add_param_group()`` are collective: every rank of the group must call them, in
        the same order. An error that one rank finds in its arguments is raised on every
        rank. ``state_dict()`` is per rank (residuals differ by rank): save one file per
        rank.
    """

    # Lets GradScaler hand itself to step(), so that all ranks agree on skipping a step.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        compressor: Compressor,
        *,
        error_feedback: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        min_compress_numel: int = 1024,
        overlap: bool = True,
        profile: bool = False,
        cuda_graphs: bool = True,
        momentum_correction: float | None = None,
        exchange: str = "gradients",
        **unexpected: Any,
    ):
        # A wrapper of this optimizer before this one: its step's verdict first, before any
        # collective of this one (.grad may still view its scratch until then).
        previous = _WRAPPERS.get(getattr(optimizer, "_sparsecomm_wrapper", None))
        if previous is not None:
            previous._settle()
        self._comm = Communicator(process_group)
        self._raise_agreed(
            _check_arguments(
                optimizer, compressor, error_feedback, bucket_cap_mb, min_compress_numel,
                overlap, unexpected,
            )
            or _check_momentum_correction(optimizer, momentum_correction)
            or _check_exchange(exchange, momentum_correction, optimizer)
            or _check_selection(optimizer, compressor, exchange)
        )  # fmt: skip
        self.optimizer = optimizer
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        self.bucket_cap_mb = bucket_cap_mb  # None: set from the model below
        self.min_compress_numel = int(min_compress_numel)
        self.overlap = bool(overlap)
        self.profile = bool(profile)
        self.cuda_graphs = bool(cuda_graphs)
        self.momentum_correction = (
            None if momentum_correction is None else float(momentum_correction)
        )
        self.exchange = exchange
        # exchange="updates" or "local_updates": the wrapped optimizer steps on each rank
        self._steps_first = exchange != "gradients"
        self._steps_taken = 0  # steps not skipped: the compressor's schedule reads it
        # Compared across ranks before the first exchange (after a resume's load_state_dict:
        # ranks resumed from different steps would send differently). Not after a later
        # load, which some ranks alone may call: the check would then be theirs alone.
        self._steps_unchecked = True
        # Whether DistributedDataParallel wraps the model: looked for before the first
        # exchange, and again before each one while it is found (_check_not_in_ddp).
        self._ddp_unchecked = True
        self._comm.timed = self.profile
        self._ready = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._ready = True  # from here on param_groups and state are the wrapped optimizer's

        params = self._all_params()
        self._raise_agreed(_check_params(params, start=0))
        self._agree_on_model(params, start=0)
        self._params = params
        if self.bucket_cap_mb is None:
            self.bucket_cap_mb = default_bucket_cap_mb(compressor, params)
        self._frozen = _frozen_positions(params)
        # Per parameter, whether any rank had its gradient at this step's agreement (the
        # update exchanges with SharedMomentAdamW: _agree_gradients_finite).
        self._used_anywhere: list[bool] = []
        for param in self._params:
            self._comm.broadcast_from_first_(param.data)
        self._engine = self._build_engine()
        # exchange="local_updates": the shared parameters (this rank's are these less its
        # residual, empty yet); None otherwise.
        self._shared = (
            [p.detach().clone() for p in self._params] if exchange == "local_updates" else None
        )
        self._loads = 0  # load_state_dict() calls: shared_parameters() looks for one inside
        # exchange="updates" and "local_updates": where each parameter's value before the
        # wrapped optimizer's step is copied, kept between steps where reallocating is not
        # free (a CPU); elsewhere the memory serves the next forward pass in between.
        self._step_copies: dict[torch.Tensor, torch.Tensor] = {}
        self.last_stats = StepStats()
        self.total_stats = StepStats()

        # Backward hooks send buckets while backward runs. They start working after the
        # first step, once step() has shown whether a GradScaler scales the gradients.
        self._overlapping = False
        self._scaler_seen = False
        self._sync_enabled = True
        self._callback_queued = False
        self._synchronized = False  # this step's exchange is done, step() only steps
        self._backward_task = -1  # autograd's graph task of this step's first gradient hook
        self._no_gradient_anywhere = False  # this step's agreement found no gradient anywhere
        # synchronize()'s GradScaler (False: it was given none; None: not synchronize())
        self._synchronized_by_scaler = None
        self._verdict_buffer: torch.Tensor | None = None  # pinned, for _agree_on_step
        self._template: tuple | None = None  # (engine, flags): for _flags_template
        #: The step's refusal, agreed by every rank (None: the step is good).
        self._refusal: RuntimeError | None = None
        self._drop_pending = False  # drop_step() inside no_sync(): told at the exchange
        self._dropped_here = False  # drop_step() sent this rank's part: until step()/zero_grad()
        self._agreement_started = False  # this step's agreement was issued (not droppable)
        # The wrapped optimizer's step on this step's averages raised (step() retries it
        # while every .grad is still the average it was: _retrying), and whether a step of
        # averages was never applied here (the gradients cleared or replaced since): told to
        # the other ranks at the next agreement.
        self._applying = False
        self._averages: list | None = None  # the .grad tensors it raised on
        self._unapplied_steps = 0  # failed steps of this rank's left unapplied (not retried)
        self._step_stats = StepStats()
        # A fused torch Adam/AdamW steps before the host reads the step's verdict
        # (_step_ahead): the end of backward leaves it pending here, as (agreement, stats,
        # whether the wrapped optimizer has stepped on it already).
        self._ahead = _steps_ahead_possible(optimizer)
        self._pending: tuple[_Agreement, StepStats, bool] | None = None
        self._settle_hooks: list = []  # (_register_hooks: only where self._ahead)
        # Marks the parameters' hooks and the wrapped optimizer as this wrapper's (a newer
        # wrapper of the same ones takes them over): a plain int, so that the model and
        # the wrapped optimizer still pickle (torch.save(model)).
        self._token = next(_TOKENS)
        _WRAPPERS[self._token] = self
        self._stepping = False  # this wrapper is stepping the wrapped optimizer
        self._hooks: list = []
        self._register_hooks(self._params)
        self._hooks.append(self._guard_wrapped_step())
        weakref.finalize(self, _remove_hooks, self._hooks)
        weakref.finalize(self, _remove_hooks, self._settle_hooks)
        self._fresh_hooks: list = []
        self._watch_fresh_gradients()
        weakref.finalize(self, _remove_hooks, self._fresh_hooks)

    # ------------------------------------------------------------------ public API

    # param_groups and state: the wrapped optimizer's (:class:`_Wrapped`).
    param_groups = _Wrapped()
    state = _Wrapped()

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

    def residual(self, param: torch.Tensor) -> torch.Tensor:
        """What ``param``'s gradient has not sent yet: a float32 tensor shaped like ``param``
        (a copy; zeros when the parameter keeps no residual)."""
        return self._piece_of(param, "residual")

    def velocity(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s momentum-correction velocity (a float32 copy shaped like ``param``;
        zeros without ``momentum_correction``)."""
        return self._piece_of(param, "velocity")

    def _piece_of(self, param: torch.Tensor, buffer: str) -> torch.Tensor:
        self._settle()
        entry = self._engine.member_of.get(id(param))
        if entry is None:
            raise ValueError(
                f"{buffer}(param): this tensor is not a parameter of the wrapped optimizer (or "
                "does not require grad); pass one of the tensors in opt.param_groups"
            )
        bucket, member = entry
        flat = getattr(bucket, buffer)
        if flat is None:
            return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        return bucket.view(flat, member).clone()

    @property
    def steps_taken(self) -> int:
        """Steps taken (skipped and refused steps, and steps in which no rank had any
        gradient, not counted): the step a compressor's schedule is at, e.g. a
        :class:`TopK` density warm-up."""
        return self._steps_taken

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without exchanging them, for the backward passes
        run inside this context (gradient accumulation, as ``DistributedDataParallel.no_sync``).
        The exchange happens on the first backward outside it, with the accumulated sum.

        Example:
            >>> for i, batch in enumerate(micro_batches):
            ...     context = opt.no_sync() if i < len(micro_batches) - 1 else nullcontext()
            ...     with context:
            ...         loss_fn(model(batch)).backward()
            >>> opt.step(); opt.zero_grad()
        """
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def drop_step(self) -> None:
        """Drop this step on a rank whose backward raised (an out-of-memory error caught by
        the training loop, say), so that training can go on. Call it on every rank that
        caught such an error, before its next backward; ranks whose backward finished call
        nothing. Then ``step()`` raises :class:`StepDroppedError` on every rank, this one
        too (under ``torch.amp.GradScaler`` every rank skips the step instead, its scaler
        lowering the scale), or ``zero_grad()`` skips the step; no rank changes its
        parameters, residuals or optimizer state.

        The other ranks wait in the step's collectives for this rank's part: this sends it,
        the buckets backward did not reach as zeros, and the step's agreement marked as
        dropped, then discards what came back; further backward passes of the step (the
        rest of an accumulation) count for nothing on this rank. Called inside
        ``no_sync()``, it sends nothing yet: the step is marked, and the exchange at the end
        of the accumulation refuses it on every rank.

        Example:
            >>> try:
            ...     loss.backward()
            ... except torch.cuda.OutOfMemoryError:
            ...     opt.drop_step()  # this rank's part of the exchange, as zeros
            >>> try:
            ...     opt.step()
            ... except sparsecomm.StepDroppedError:
            ...     pass  # some rank dropped it; nothing changed anywhere
            >>> opt.zero_grad()

        Raises:
            RuntimeError: this rank's backward finished and its gradients were exchanged
                (call ``step()``, or ``zero_grad()`` on every rank to skip the step).
        """
        self._settle()
        if self._dropped_here or (self._drop_pending and not self._sync_enabled):
            return  # dropped already: its part is sent (or will be, at the exchange)
        if self._applying:  # a new step: the averages the wrapped optimizer raised on are gone
            self._forget_failed_step()
        if self._synchronized:
            raise RuntimeError(
                "drop_step() after a backward that finished: this step's gradients were "
                "already exchanged with every rank. Call step(), or zero_grad() on every rank "
                "to skip the step; drop_step() is for a rank whose backward raised"
            )
        if self._agreement_started or self._engine.launching is not None:
            raise RuntimeError(
                "drop_step() cannot drop this step: the error came from inside the exchange "
                "(a bucket's launch, or after the step's agreement), after this rank may have "
                "issued collectives it cannot take back, so the ranks can no longer be kept "
                "in step. Restart the ranks from the last checkpoint"
            )
        self._callback_queued = False  # a backward that raised never ran its callback
        if not self._sync_enabled:
            self._drop_pending = True
            return
        self._send_drop()

    def _send_drop(self) -> None:
        """This rank's part of a dropped step: what the other ranks' exchange waits for."""
        self._before_exchange()  # the other ranks run it before their exchange: so must this one
        self._drop_pending = False
        if self._steps_first:  # everything happens in step(): its first collective
            # The same collective the other ranks' step() runs, of the same size: with
            # an optimizer that takes the averaged gradient, its flags too.
            self._refusal = self._agree_gradients_finite(dropped=True, due=self._refresh_due())
            self._step_stats = self._refused_stats()
            self._synchronized = self._dropped_here = True
            return
        with torch.no_grad():
            self._engine.clear_unfilled()  # what backward did not reach goes as zeros
            self._synchronize(grad_scaler=None, dropped=True)
        self._dropped_here = True
        # Refused on every rank now: step() raises StepDroppedError here too, zero_grad()
        # counts the step as skipped.

    @torch.no_grad()
    def synchronize(self, grad_scaler=None) -> None:
        """Finish this step's exchange now: afterwards ``p.grad`` holds the average, and
        ``step()`` only steps the wrapped optimizer. Backward already does this when it
        sends buckets itself; call it where it does not (the first step, ``overlap=False``,
        every step under ``GradScaler``, gradients assigned by hand) before you read or
        change ``p.grad``, e.g. to clip.

        Args:
            grad_scaler: the ``torch.amp.GradScaler`` that scaled the loss, if any:
                ``scaler.unscale_(opt); opt.synchronize(scaler); clip...; scaler.step(opt)``.
                The gradients are unscaled first (unless ``unscale_`` did it), and a
                non-finite gradient on any rank makes ``scaler.step`` skip on every rank.

        Collective: every rank must call it. Without a scaler it raises
        :class:`NonFiniteGradientError` as ``step()`` does (the step is then dropped on
        every rank)."""
        self._settle()
        if self._retrying():
            return  # done already: the wrapped optimizer raised on these averages, step() retries
        if self._steps_first:
            raise RuntimeError(
                f"synchronize() exchanges gradients; with exchange={self.exchange!r} the "
                "exchange happens inside step(), after the wrapped optimizer has stepped"
            )
        if grad_scaler is not None and not grad_scaler.is_enabled():
            grad_scaler = None  # GradScaler(enabled=False): no scaling, so nothing to skip
        if grad_scaler is not None:
            if self._synchronized and self._refusal is not None:
                return  # refused already (drop_step()): scaler.step(opt) skips it everywhere
            self._adopt_scaler(grad_scaler)
        self._synchronize(grad_scaler)
        self._synchronized_by_scaler = grad_scaler if grad_scaler is not None else False
        if self._refusal is not None and grad_scaler is None:
            refusal = self._refusal
            self._finish_step(skipped=True)
            raise refusal

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or, by default, drop) every parameter's ``.grad``, as
        ``torch.optim.Optimizer.zero_grad`` does over the shared ``param_groups`` (a
        wrapped optimizer's own ``zero_grad`` override is not called). With
        ``set_to_none=True`` (the default) the flat gradient buffers of buckets with an
        error-feedback residual are dropped as well, so that between steps only the
        residuals stay allocated (as DDP keeps only its buckets); the next backward
        allocates them again as its gradients arrive (buckets compressed from CUDA graphs
        too: the graphs read their buffers' addresses from a table). Zeroing ``.grad``
        another way (``model.zero_grad()``) keeps the buffers: correct, but the memory
        stays.

        Called after a backward that finished and before ``step()`` (on every rank), it
        skips that step (``StepStats.skipped_steps``), keeping the residuals the exchange
        left; so does the next backward after ``model.zero_grad()`` there. After a
        backward that raised, call :meth:`drop_step` first.

        Raises:
            RuntimeError: this rank's backward raised part-way and its step was not
                dropped: the other ranks wait for this rank's part of the exchange, which
                :meth:`drop_step` sends."""
        self._settle()
        if self._drop_pending and self._sync_enabled:
            # drop_step() inside no_sync(), and no exchange since: the other ranks' exchange
            # at the end of their accumulation still waits for this rank's part.
            self._send_drop()
        if self._applying:  # averages the wrapped optimizer raised on, not retried
            self._forget_failed_step()
        if self._synchronized:
            self._finish_step(skipped=True)
        elif self._engine.in_progress() or self._callback_queued:
            raise RuntimeError(
                "zero_grad() after a backward that raised part-way: the other ranks wait "
                "for this rank's part of the step's exchange (some of its buckets may be "
                "sent already). Call opt.drop_step() on every rank whose backward raised, "
                "before zero_grad()"
            )
        super().zero_grad(set_to_none=set_to_none)
        self._engine.fresh.clear()  # (an accumulation left unfinished: its gradients are gone)
        if set_to_none:
            self._engine.release_gradients()

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Average the gradients over all ranks, compressed (unless backward already did),
        then step the wrapped optimizer.

        Collective: every rank must call it. If any rank's gradient holds NaN or Inf, every
        rank raises :class:`NonFiniteGradientError` and nothing changes; under
        ``torch.amp.GradScaler`` every rank skips the step instead and every scaler lowers
        its scale.

        Args:
            closure: re-evaluates the model and returns the loss, as for any optimizer.
            grad_scaler: passed by ``GradScaler.step``; do not pass it yourself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.momentum_correction is not None:  # (a scheduler may have set it since)
            for group in self.optimizer.param_groups:
                error = _check_group_momentum(group, self.optimizer)
                if error is not None:
                    raise error
        if self._pending is not None:
            if grad_scaler is None or self._pending[2]:
                return self._step_ahead(loss)
            self._settle()
        if self._retrying():  # the wrapped optimizer raised on these averages: again
            self._apply()
            return loss
        if self._synchronized and self._refusal is not None:
            # Refused before step(): at the end of backward, or by drop_step() here.
            refusal = self._refusal
            self._finish_step(skipped=True)
            if grad_scaler is None or isinstance(refusal, _RanksApartError):
                raise refusal
            self._scaler_seen, self._overlapping = True, False
            self._scaler_skips(grad_scaler)
            return loss
        if self._steps_first:
            self._step_updates(grad_scaler)
            return loss
        if grad_scaler is not None:
            self._adopt_scaler(grad_scaler)
        self._synchronize(grad_scaler)
        if self._refusal is not None:
            refusal = self._refusal
            self._finish_step(skipped=True)
            if grad_scaler is None or isinstance(refusal, _RanksApartError):
                raise refusal
            return loss
        # Counted before the wrapped optimizer steps: the exchange is done on every rank,
        # and the density schedule must stay the same on every rank even if this rank's
        # step raises (its next step() retries it).
        self._finish_step(skipped=False)
        self._apply()
        self._overlapping = self.overlap and not self._scaler_seen
        return loss

    def _step_ahead(self, loss):
        """``step()`` of a step left pending at the end of backward: the wrapped fused
        Adam steps first, handed the device's refusal as ``found_inf`` (so that a refused
        step changes nothing there), and only then does the host wait for the verdict.
        The device runs the averages and the step while the host waits, instead of idling
        between the verdict and the step's launch (docs/step_ahead.md)."""
        agreement, stats, stepped = self._pending
        if not stepped:  # (else a step() interrupted in its wait: the step is queued)
            optimizer = self.optimizer
            optimizer.grad_scale = None
            optimizer.found_inf = agreement.refused.to(torch.float32).view(())
            try:
                self._step_wrapped()
            except BaseException as error:
                self._settle()
                refusal = self._refusal
                if refusal is not None:  # refused on every rank: raise what the others raise
                    self._finish_step(skipped=True)
                    raise refusal from error
                self._finish_step(skipped=False)  # as _apply records it: step() retries
                self._applying, self._averages = True, [p.grad for p in self._params]
                raise
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            self._pending = (agreement, stats, True)
        refusal = self._settle()
        if refusal is not None:
            raise refusal
        self._overlapping = self.overlap and not self._scaler_seen
        return loss

    def _apply(self) -> None:
        """Step the wrapped optimizer on the averages in ``.grad``. Should it raise, the
        next ``step()`` calls it again on the same averages; a ``zero_grad()`` instead
        leaves them unapplied, which the next exchange's agreement tells every rank."""
        try:
            self._step_wrapped()
        except BaseException:
            if not self._applying:  # (a retry that raised again keeps the first record)
                self._applying, self._averages = True, [p.grad for p in self._params]
            raise
        self._applying, self._averages = False, None

    def _retrying(self) -> bool:
        """Whether ``step()`` retries the wrapped step that raised: every ``.grad`` is
        still the average it raised on. Gradients cleared or replaced since (``zero_grad``
        of the model, a new backward, gradients set by hand) make it a new step, and the
        failed one unapplied."""
        if self._applying and any(
            p.grad is not average for p, average in zip(self._params, self._averages)
        ):
            self._forget_failed_step()
        return self._applying

    def _forget_failed_step(self) -> None:
        self._applying, self._averages = False, None
        self._unapplied_steps += 1

    def _adopt_scaler(self, grad_scaler) -> None:
        """Turn the overlap off for a ``GradScaler``; refuse (and skip) a step whose
        gradients were exchanged without it, in the units they had then."""
        by = self._synchronized_by_scaler
        if self._synchronized and by is not grad_scaler:
            self._finish_step(skipped=True)
            self._overlapping = False
            if by is False:
                raise RuntimeError(
                    "opt.synchronize() ran without the GradScaler, so an overflow would not "
                    "skip the step on every rank: pass it, `scaler.unscale_(opt); "
                    "opt.synchronize(scaler)`, then clip and `scaler.step(opt)`"
                )
            # Sent during backward, before this scaler was known: in scaled units.
            raise RuntimeError(
                "torch.amp.GradScaler was first used after the first step, while "
                "gradients were already being sent during backward in scaled units. "
                "Use the scaler from the first step on, or construct "
                "CompressedOptimizer(..., overlap=False)"
            )
        self._scaler_seen = True
        self._overlapping = False

    def _step_updates(self, grad_scaler) -> None:
        """``exchange="updates"`` and ``"local_updates"``: agree that every gradient is
        finite, step the wrapped optimizer on this rank's gradient, exchange the update it
        made (compressed, with error feedback) and apply the average."""
        if grad_scaler is not None:
            raise RuntimeError(
                f"exchange={self.exchange!r} does not work under torch.amp.GradScaler (the "
                "wrapped optimizer steps before the ranks' scalers could agree); use the "
                "default exchange='gradients'"
            )
        self._before_exchange()
        for param in self._params:
            if param.grad is not None and not param.requires_grad:
                param.grad = None  # frozen since wrapping: unused, as the gradient exchange has it
        params = [p for p in self._params if p.grad is not None]
        due = self._refresh_due()
        refusal = self._agree_gradients_finite(dropped=self._drop_pending, due=due)
        self._drop_pending = False
        if refusal is not None:
            self._step_stats = self._refused_stats()
            self._finish_step(skipped=True)
            raise refusal
        shared_bytes = self._share_average_gradient() if due else 0
        before = self._copies_before_step(params)
        try:
            self._step_wrapped()
        except BaseException:
            # The other ranks go on to exchange their updates: send this rank's part as a
            # dropped step, so that every rank refuses it, then raise here.
            torch._foreach_copy_([p.detach() for p in params], before)
            self._synchronize(grad_scaler=None, dropped=True)
            self._finish_step(skipped=True)
            raise
        _update_as_gradient(params, before)
        self._synchronize(grad_scaler=None)
        self._step_stats.bytes_sent += shared_bytes
        if self._refusal is not None:  # finite gradients, an update that is not: not applied
            refusal = self._refusal
            self._finish_step(skipped=True)
            if isinstance(refusal, StepDroppedError):  # (a wrapped step raised there)
                refusal = StepDroppedError(refusal.ranks, stepped=True)
            elif isinstance(refusal, NonFiniteGradientError):
                refusal = NonFiniteGradientError(
                    refusal.ranks, refusal.too_large, update=True, scaler=False
                )
            raise refusal
        self._finish_step(skipped=False)
        pairs = [(param, param.grad) for param in self._params if param.grad is not None]
        if self._shared is None:
            _foreach_sub_([param for param, _ in pairs], [average for _, average in pairs])
            return
        shared = dict(zip(self._params, self._shared))
        _foreach_sub_([shared[param] for param, _ in pairs], [average for _, average in pairs])
        self._write_local()

    def _refresh_due(self) -> bool | None:
        """Whether the wrapped optimizer wants the ranks' averaged gradient this step
        (``SharedMomentAdamW``), told first how many ranks step together; None for an
        optimizer that never does."""
        tell = getattr(self.optimizer, "set_world_size", None)
        if tell is None:
            return None
        tell(self.world_size)
        return self.world_size > 1 and bool(self.optimizer.average_gradient_due())

    def _share_average_gradient(self) -> int:
        """Hand the wrapped optimizer the sum over the ranks of every gradient that some
        rank has (zeros for one this rank lacks), in its ``average_dtype``, by one
        all-reduce: when :meth:`_refresh_due` said so, on every rank alike. A parameter no
        rank has a gradient for (unused this step, or frozen) is left out, as AdamW leaves
        its moments alone. Returns the bytes sent."""
        used = self._used_anywhere  # the ranks' agreement of this step says
        params = [p for p, anywhere in zip(self._params, used) if anywhere]
        if not params:
            return 0
        # One buffer, each gradient cast into its view in one pass (no per-gradient copy to
        # concatenate afterwards).
        flat = torch.empty(
            sum(p.numel() for p in params),
            dtype=self.optimizer.average_dtype,
            device=self._engine.device,
        )
        views = _unflatten(flat, params)
        given = [(view, p.grad) for view, p in zip(views, params) if p.grad is not None]
        if given:
            torch._foreach_copy_([view for view, _ in given], [grad for _, grad in given])
        for view, param in zip(views, params):
            if param.grad is None:
                view.zero_()
        self._comm.all_reduce_(flat)
        self.optimizer.take_average_gradient(
            {param: view.to(param.device) for param, view in zip(params, views)}
        )
        return flat.numel() * flat.element_size()

    def _copies_before_step(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``params`` as they are now, in buffers kept from step to step where
        :func:`reallocation_is_free` does not hold (a CPU), in new ones elsewhere."""
        copies = []
        for param in params:
            if reallocation_is_free(param.device):
                copies.append(torch.empty_like(param.detach()))
                continue
            copy = self._step_copies.get(param)
            if copy is None or copy.shape != param.shape or copy.dtype != param.dtype:
                copy = self._step_copies[param] = torch.empty_like(param.detach())
            copies.append(copy)
        if copies:
            torch._foreach_copy_(copies, [p.detach() for p in params])
        return copies

    def _write_local(self) -> None:
        """``exchange="local_updates"``: this rank's parameters are the shared ones plus
        the update it has not sent yet (its residual holds ``-update``, a gradient's sign).
        On CUDA in foreach launches (a copy, then the subtraction); on a CPU in one pass per
        tensor."""
        params = [param.detach() for param in self._params]
        views = self._residual_views()
        if params and params[0].is_cuda:
            torch._foreach_copy_(params, self._shared)
            _foreach_sub_([params[i] for i, _ in views], [view for _, view in views])
            return
        residuals = dict(views)
        for position, (param, shared) in enumerate(zip(params, self._shared)):
            residual = residuals.get(position)
            if residual is None:
                param.copy_(shared)
            else:
                torch.sub(shared, residual.to(shared.dtype), out=param)

    def _residual_views(self) -> list[tuple[int, torch.Tensor]]:
        """(position, residual view) of every parameter whose bucket keeps a residual."""
        views = []
        for bucket in self._engine.buckets:
            if bucket.residual is not None:
                views.extend(zip(bucket.positions, bucket.residual_views))
        return views

    @contextlib.contextmanager
    def shared_parameters(self):
        """``exchange="local_updates"``: inside, the parameters are the shared ones (the
        same bits on every rank); on leaving, each rank's own again. Evaluate the model and
        save it inside: ``with opt.shared_parameters(): evaluate(model);
        torch.save(model.state_dict(), path)``. Change the parameters inside too (load
        weights, clamp, re-initialise; on every rank alike): what a parameter holds on
        leaving becomes its shared value, and this rank's own is that plus its unsent
        update; after ``load_state_dict()`` inside, the loaded shared parameters win over
        what the model loaded. (Outside, each step sets every parameter from the shared
        ones and the residual, so a change made there is lost.) With another exchange the
        parameters are shared already, and this does nothing."""
        if self._shared is None:
            yield
            return
        with torch.no_grad():
            local = [p.detach().clone() for p in self._params]
            for param, shared in zip(self._params, self._shared):
                param.copy_(shared)
        loads = self._loads
        try:
            yield
        finally:
            with torch.no_grad():
                # After load_state_dict() inside, the shared parameters are the loaded ones
                # (whatever the model loaded beside them); else what the parameters hold.
                loaded = self._loads != loads
                changed = loaded
                for param, shared in zip(self._params, self._shared):
                    if not loaded and not torch.equal(param, shared):
                        shared.copy_(param)
                        changed = True
                if changed:  # each rank's own: the shared ones less its residual
                    self._write_local()
                else:
                    for param, mine in zip(self._params, local):
                        param.copy_(mine)

    def _agree_gradients_finite(
        self, dropped: bool, due: bool | None = None
    ) -> RuntimeError | None:
        """``exchange="updates"``: one all-reduce of a flag per rank (2: it dropped the
        step, 1: a gradient holds NaN or Inf, 0: neither), before the wrapped optimizer
        steps, and of whether its optimizer wants the averaged gradient (``due``; None: it
        never does) and, then, of which parameters have a gradient on any rank (kept in
        ``_used_anywhere`` for :meth:`_share_average_gradient`). Returns the step's refusal
        or None."""
        device = self._engine.device
        flags = torch.zeros(2 * self.world_size, dtype=torch.float32, device=device)
        if due:
            flags[self.world_size + self.rank] = 1.0
        if due is not None:  # and which parameters have a gradient on some rank
            has_grad = torch.tensor([float(p.grad is not None) for p in self._params])
            if device.type == "cuda":
                has_grad = has_grad.pin_memory()  # so the copy does not wait for the device
            flags = torch.cat([flags, has_grad.to(device, non_blocking=True)])
        params = [p for p in self._params if p.grad is not None]
        if dropped:
            flags[self.rank] = 2.0
        elif params:  # one flag on the device, then the step's one extra host sync
            # No n-element temporary: isfinite(grad).all() writes a bool per element (14x
            # slower on a CPU). On CUDA each gradient's largest magnitude, NaN where it
            # holds one (the inf norm propagates NaN), in one foreach launch; on a CPU each
            # gradient's least and greatest element (NaN propagates into both, an infinity
            # is one of them), 12x faster there than the CPU's inf norm.
            grads = [p.grad for p in params if p.grad.numel()]
            if grads and grads[0].is_cuda:
                ends = torch.stack(torch._foreach_norm(grads, float("inf")))
            elif grads:
                ends = torch.cat([torch.stack(torch.aminmax(grad)) for grad in grads])
            if grads:
                flags[self.rank] = (~torch.isfinite(ends).all()).float().to(device)
        if self._comm.distributed:
            flags = self._comm.all_reduce_(flags, op="max")
        values = flags.tolist()
        self._used_anywhere = [bool(flag) for flag in values[2 * self.world_size :]]
        values, dues = values[: self.world_size], values[self.world_size : 2 * self.world_size]
        if due is not None and len(set(dues)) > 1:
            return RuntimeError(
                "the ranks' SharedMomentAdamW disagree on whether this step refreshes the "
                f"shared second moment (by rank: {[bool(d) for d in dues]}): their step "
                "counts differ. Resume every rank from the state_dict() it saved at the same "
                "step, and step the wrapped optimizer only through CompressedOptimizer"
            )
        if not any(values):
            return None
        dropped_ranks = [r for r, flag in enumerate(values) if flag == 2]
        if dropped_ranks:
            return StepDroppedError(dropped_ranks)
        nonfinite = [r for r, flag in enumerate(values) if flag > 0]
        return NonFiniteGradientError(nonfinite, scaler=False)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the wrapped optimizer (collective: every rank must call
        it with the same parameters). Residuals of the existing parameters are kept. The
        group is checked on every rank first; if it is refused anywhere, it is refused
        everywhere and nothing changes."""
        if not self._ready:  # called by torch.optim.Optimizer.__init__ for existing groups
            super().add_param_group(param_group)
            return
        self._settle()
        start = len(self._params)
        # A parameter unfrozen since wrapping has no hook: wrap again instead.
        error = self._unfrozen_error()
        new_params = []
        if error is None:
            new_params, error = _group_params(param_group, self._params)
        if error is None and (self._synchronized or self._engine.in_progress()):
            # The new parameters' gradients of this step were not exchanged: the wrapped
            # optimizer would step them on each rank's own, and the ranks would drift apart.
            error = RuntimeError(
                "add_param_group() between backward() and step(): this step's gradients "
                "are exchanged already, without the new group's. Call it after step() (or "
                "zero_grad()), before the next backward"
            )
        if error is None:
            error = _check_params(new_params, start)
        if error is None and self.momentum_correction is not None:
            error = _check_group_momentum(param_group, self.optimizer)
        if error is None:  # the new group, as the wrapped optimizer would fill it in
            group = {**self.optimizer.defaults, **param_group}
            error = _check_selection(self.optimizer, self.compressor, self.exchange, [group])
        added = False
        if error is None:
            # The wrapped optimizer's own checks (its hyperparameters, leaf tensors) run
            # before the ranks agree too, and the group comes out again wherever another
            # rank refused it. (The list, not the caller's iterator, which reading it has
            # used up.)
            try:
                self.optimizer.add_param_group({**param_group, "params": new_params})
                added = True
            except Exception as refused:  # noqa: BLE001 (agreed on, then raised everywhere)
                error = refused
        try:
            self._raise_agreed(error)
            self._agree_on_model(new_params, start=start)
        except BaseException:
            if added:
                self.optimizer.param_groups.pop()
            raise
        residuals = self._residuals_by_position()
        velocities = self._velocities_by_position()
        self._params = self._all_params()
        self._frozen = _frozen_positions(self._params)
        for param in self._params[start:]:
            self._comm.broadcast_from_first_(param.data)
        self._engine = self._build_engine()
        self._load_residuals(residuals)
        self._load_velocities(velocities)
        if self._shared is not None:  # the new parameters are shared as they are
            self._shared += [p.detach().clone() for p in self._params[start:]]
        self._register_hooks(self._params[start:])
        self._watch_fresh_gradients()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and this rank's residuals, as tensors and plain
        values only (``torch.load(..., weights_only=True)`` reads it back). Per rank: save
        one file per rank. Not between a backward whose exchange is done and ``step()``:
        the residuals are then this step's and the optimizer's state the step before's.
        Hooks registered with ``register_state_dict_pre_hook`` and
        ``register_state_dict_post_hook`` run as torch.optim runs them."""
        if self._exchanged_not_stepped():
            raise RuntimeError(
                "state_dict() between backward() and step(): this step's gradients are "
                "exchanged and its residuals updated, but the wrapped optimizer has not "
                "stepped, so a checkpoint now would resume with this step's gradient counted "
                "twice. Call state_dict() after step() (or before backward())"
            )
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = _hook_result(post_hook(self, state), state)
        return state

    def _state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "sparsecomm": {
                "format": _STATE_FORMAT,
                "optimizer_classes": _optimizer_classes(self.optimizer),
                "world_size": self.world_size,
                "rank": self.rank,
                "compressor": self.compressor.config(),
                "error_feedback": self.error_feedback,
                "min_compress_numel": self.min_compress_numel,
                "shapes": [list(p.shape) for p in self._params],
                "frozen": list(self._frozen),  # no gradient, so no residual
                "residuals": self._residuals_by_position(),
                "total_stats": self.total_stats.as_dict(),
                "steps_taken": self._steps_taken,
                "momentum_correction": self.momentum_correction,
                "velocities": self._velocities_by_position(),
                "exchange": self.exchange,
                # exchange="local_updates": the parameters every rank shares
                "shared": None if self._shared is None else [x.clone() for x in self._shared],
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any], *, keep_residuals: bool = True) -> None:
        """Load a ``state_dict()`` saved by this rank. Everything is checked first: a state
        saved with another world size, by another rank, with another compressor or
        error-feedback setting, or for other parameters, or residuals of the wrong shape,
        dtype or with NaN/Inf, raise ``ValueError`` naming what differs, and nothing is
        changed.

        ``keep_residuals=False`` continues on another world size, compressor, density or
        error-feedback setting: it loads the wrapped optimizer's state, the step count (a
        warm-up goes on where it was) and the statistics, and starts with empty residuals
        (and momentum-correction velocities): the gradient they held, not sent yet, is
        dropped. Every rank may load the same file (rank 0's, say). The parameters must
        still be the ones saved. Not between a backward whose exchange is done and
        ``step()``, which would apply that step's average to the loaded state. Hooks
        registered with ``register_load_state_dict_pre_hook`` (which may return the dict to
        load) and ``register_load_state_dict_post_hook`` run as torch.optim runs them."""
        if self._exchanged_not_stepped():
            raise RuntimeError(
                "load_state_dict() between backward() and step(): this step's gradients are "
                "exchanged already, and step() would apply their average to the loaded "
                "state. Load before backward() (or after step(), or zero_grad())"
            )
        state_dict = dict(state_dict)  # (a hook may change it: not the caller's)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = _hook_result(pre_hook(self, state_dict), state_dict)
        self._load_state_dict(state_dict, keep_residuals)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any], keep_residuals: bool) -> None:
        ours = self._check_state(state_dict, keep_residuals)
        self._check_schedule_state(ours, keep_residuals)
        self.optimizer.load_state_dict(state_dict["optimizer"])  # checks before it changes
        # (a failed step before the load is gone, applied or not)
        self._applying, self._averages, self._unapplied_steps = False, None, 0
        self._load_residuals(ours["residuals"] if keep_residuals else [])
        fields = StepStats.__dataclass_fields__
        saved_stats = ours.get("total_stats", {})
        self.total_stats = StepStats(**{k: v for k, v in saved_stats.items() if k in fields})
        self._steps_taken = int(ours.get("steps_taken", 0))
        self._engine.step = self._steps_taken
        self._load_velocities((ours.get("velocities") or []) if keep_residuals else [])
        if self._shared is not None:  # this rank's parameters: the shared ones + its residual
            with torch.no_grad():
                for mine, saved in zip(self._shared, ours["shared"]):
                    mine.copy_(saved)
                self._write_local()
        self._loads += 1

    def _exchanged_not_stepped(self) -> bool:
        """Whether this step's exchange is done (and not refused or dropped) and the
        wrapped optimizer has not stepped yet."""
        self._settle()
        waiting = self._synchronized and self._refusal is None and not self._dropped_here
        return waiting or self._retrying()

    def __getstate__(self):
        # (copy.copy, copy.deepcopy and pickle all come here; torch.optim's own would keep
        # three attributes of dozens, and the copy would fail only when used)
        raise TypeError(
            "a CompressedOptimizer cannot be copied or pickled: it holds the process group, "
            "hooks on the model's parameters and this rank's residuals. Save "
            "opt.state_dict() (one file per rank), and load it into the CompressedOptimizer "
            "built on each rank: opt.load_state_dict(state)"
        )

    def __repr__(self) -> str:
        return (
            f"CompressedOptimizer({self.optimizer.__class__.__name__}, "
            f"compressor={self.compressor!r}, error_feedback={self.error_feedback}, "
            f"world_size={self.world_size}, buckets={len(self._engine.buckets)})"
        )

    # ------------------------------------------------------------------ the exchange

    def _on_gradient(self, param: torch.Tensor) -> None:
        """Backward hook: ``param.grad`` is complete for this backward pass."""
        if self._dropped_here:
            return  # (after drop_step(): the rest of the step's micro-batches count for nothing)
        if getattr(param, "_sparsecomm_owner", None) != self._token:
            return  # a newer CompressedOptimizer wraps this parameter now
        if self._applying:  # a new backward, not a retry: the failed step's averages are gone
            self._forget_failed_step()
        if self._synchronized:
            if not self._cleared_since_exchange(param):
                # .grad holds the average: a gradient added to it would be this rank's alone.
                raise RuntimeError(
                    "backward ran again after this step's gradients were exchanged and "
                    "before step(). To accumulate gradients over several backward passes, "
                    "run all but the last inside `with opt.no_sync():`; to throw the first "
                    "backward's gradients away, call opt.zero_grad() before the next"
                    + self._nested_hint()
                )
            self._finish_step(skipped=True)  # as opt.zero_grad() there would have
        if not self._sync_enabled:
            return
        if not self._overlapping:  # the exchange runs in step(): only mark the backward open
            if not self._callback_queued:  # (so that zero_grad() after it raised refuses)
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(self._end_of_quiet_backward)
                self._callback_queued = True
                self._backward_task = torch._C._current_graph_task_id()
            return
        if not self._callback_queued:
            self._before_exchange()  # before this backward sends anything
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
            self._backward_task = torch._C._current_graph_task_id()
        try:
            if torch.is_grad_enabled():  # backward(create_graph=True)
                with torch.no_grad():
                    self._engine.fill_from_hook(param)
            else:  # (entering no_grad costs more than the rest of a hook)
                self._engine.fill_from_hook(param)
        except RuntimeError as error:
            hint = self._nested_hint()
            if not hint:
                raise
            raise RuntimeError(f"{error}{hint}") from None

    def _cleared_since_exchange(self, param: torch.Tensor) -> bool:
        """Whether the averages the exchange handed out are gone, set to None by something
        other than ``opt.zero_grad()`` (``model.zero_grad()``) before this new backward
        reached ``param``: every other parameter's ``.grad`` is None though some had an
        average (or, where ``param`` alone had one, ``param``'s is a new tensor). Then
        nothing of the averages is left for this backward to add to, and it starts a new
        step. Averages zeroed in place (``set_to_none=False``) cannot be told from averages
        backward is adding to: those raise, naming ``opt.zero_grad()``."""
        if any(p.grad is not None for p in self._params if p is not param):
            return False
        if self._engine.handed > 1:  # others had averages: they were cleared
            return True
        bucket, member = self._engine.member_of[id(param)]
        given = bucket.grad_views[member] if bucket.grad_views else None
        return param.dtype == torch.float32 and param.grad is not given

    def _nested_hint(self) -> str:
        """Why a gradient came too late, when the backward it belongs to began before the
        one whose end sent the buckets: autograd numbers its graph tasks as it starts them,
        so a lower number is an outer backward still running, and the end that sent them
        was that of a backward nested in it (a reentrant checkpoint's recomputation)."""
        current = torch._C._current_graph_task_id()
        if 0 <= current < self._backward_task:
            return (
                ". Here the backward still running began before the one that sent them: a "
                "backward nested in it ended first, as torch.utils.checkpoint(..., "
                "use_reentrant=True) runs one, and its end looked like the end of this "
                "step's backward. Checkpoint with use_reentrant=False"
            )
        return ""

    def _end_of_quiet_backward(self) -> None:
        self._callback_queued = False

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        with torch.no_grad():
            self._synchronize(grad_scaler=None, defer=self._ahead)

    def _synchronize(self, grad_scaler, dropped: bool = False, defer: bool = False) -> None:
        """Launch what has not been launched, agree across ranks on non-finite values, on
        dropped steps and on which parameters had gradients (one small all-reduce, one host
        sync), then finish (or drop) the exchange. ``dropped``: this rank drops the step
        (:meth:`drop_step`). ``defer``: leave the host sync to :meth:`_settle` where
        :meth:`_step_ahead` may step first."""
        if self._synchronized:
            return
        self._before_exchange()
        found_inf = self._unscale(grad_scaler) if grad_scaler is not None else []
        engine = self._engine
        engine.launch_all()
        stats = self._sent_stats()
        used_here = engine.local_used()
        dropped, self._drop_pending = dropped or self._drop_pending, False
        self._agreement_started = True  # from here on the step cannot be dropped
        agreement = self._start_agreement(engine.peak(), used_here, dropped)
        # Used here means used by some rank: the averages need nothing from the host but the
        # refusal, which the device has already. Queue them now, so that the device has work
        # while the host waits for the verdict and launches the optimizer after it.
        early = used_here == engine.held  # (a frozen parameter has no bucket to finish)
        ahead = defer and early and any(used_here) and self._may_step_ahead()
        if early:
            stats.aggregate_seconds = self._finish(used_here, agreement.refused, keep=ahead)
        if ahead:
            self._pending = (agreement, stats, False)
            self._synchronized = True
            return
        self._conclude(agreement, stats, found_inf, early)

    def _conclude(
        self, agreement: _Agreement, stats: StepStats, found_inf: list[torch.Tensor],
        early: bool, kept: bool = False,
    ) -> None:  # fmt: skip
        """:meth:`_synchronize`'s end: wait for the verdict, then drop or finish the
        step. ``early``: the averages are queued already; ``kept``: with the old residuals
        copied where the step was refused (``BucketEngine.finish(keep=True)``)."""
        engine = self._engine
        refusal, used = self._agree_on_step(agreement)
        self._no_gradient_anywhere = not any(used)  # no rank had a gradient: not a step taken
        refused = refusal is not None
        for flag in found_inf:
            flag.fill_(1.0 if refused else 0.0)
        if refused:
            if kept:
                engine.drop()
            elif early:
                engine.revert()
            else:
                engine.abandon()
        elif not early:
            stats.aggregate_seconds = self._finish(used, None)
        stats.compress_seconds = engine.compress_seconds
        stats.communicate_seconds = self._comm.seconds
        self._refusal = refusal
        self._step_stats = stats
        self._synchronized = True

    def _settle(self) -> RuntimeError | None:
        """Wait for the verdict of a step left pending at the end of backward (the host
        sync :meth:`_step_ahead` put off): afterwards the step is as :meth:`_synchronize`
        leaves it, or, where the wrapped optimizer has stepped on it already, counted
        (taken, or skipped where refused), and its refusal is returned. Everything that
        reads or changes the step's state calls it first."""
        if self._pending is None:
            return None
        agreement, stats, stepped = self._pending
        self._conclude(agreement, stats, [], early=True, kept=True)
        self._pending = None  # (not before: a wait interrupted leaves the step pending)
        if not stepped:
            return None
        refusal = self._refusal
        self._finish_step(skipped=refusal is not None)
        return refusal

    def _may_step_ahead(self) -> bool:
        """Whether the wrapped optimizer can take this step before the host knows the
        verdict: a torch Adam or AdamW with ``fused=True`` in every group skips a step on
        the device when handed the refusal as ``found_inf`` (as under ``GradScaler``),
        its state and step count included. Not when profiling (which times each phase) or
        with a velocity to restore."""
        return (
            self._ahead
            and not self.profile
            and self.momentum_correction is None
            and getattr(self.optimizer, "found_inf", None) is None
            and _steps_ahead_possible(self.optimizer)
        )

    def _refused_stats(self) -> StepStats:
        """A step of ``exchange="updates"`` refused before anything was sent: counted, at
        the density its schedule set (nothing sent)."""
        return StepStats(
            steps=1, scheduled_density=_scheduled_density(self.compressor, self._steps_taken)
        )

    def _before_exchange(self) -> None:
        """What every rank checks before its part of an exchange starts."""
        self._check_frozen()
        if self._ddp_unchecked:
            self._check_not_in_ddp()
        if self._steps_unchecked:
            self._agree_on_steps()

    def _agree_on_steps(self) -> None:
        """One all-gather of each rank's step count, before this optimizer's first exchange:
        ranks that resumed from checkpoints of different steps (or of which only some
        loaded one) would follow different density schedules, whose payloads do not
        match, and drift apart. Every rank raises alike."""
        self._steps_unchecked = False
        steps = self._comm.all_gather_int(self._steps_taken, self._engine.device)
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"the ranks are at different steps (steps_taken by rank: {steps}): they "
                "resumed from checkpoints saved at different steps, or not every rank "
                "loaded one. Load on every rank the state_dict() that rank saved at the "
                "same step"
            )

    def _check_not_in_ddp(self) -> None:
        """Raise, before anything is sent, if a ``DistributedDataParallel`` module holds one
        of the parameters. Its all-reduce runs beside the exchange, and at the end of
        backward it writes its own average over the one sparsecomm handed out (of zeros
        wherever sparsecomm's hooks took the gradient from ``.grad`` before DDP's saw it),
        while error feedback counts the values as sent. DDP builds the same way on every
        rank, so every rank raises alike."""
        ddp = _ddp_holding(self._params)
        if ddp is None:
            self._ddp_unchecked = False
            return
        raise RuntimeError(
            "the model is wrapped in torch.nn.parallel.DistributedDataParallel, whose own "
            "all-reduce would average the gradients beside sparsecomm's exchange and write "
            "over the averages it hands out. Use one of the two: build CompressedOptimizer "
            "on the unwrapped model's parameters (it replaces DDP: "
            "`sparsecomm.CompressedOptimizer(torch.optim.AdamW(model.parameters()), ...)` "
            "on the model itself), or keep DDP with a plain optimizer and compress inside "
            "it: `state, hook = sparsecomm.ddp_comm_hook(compressor); "
            "ddp_model.register_comm_hook(state, hook)`"
        )

    def _check_frozen(self) -> None:
        """Raise, before anything is sent, if a parameter that did not require grad when
        it was wrapped requires it now: it has no hook and no bucket, so its gradient would
        stay this rank's own and the ranks' parameters would drift apart."""
        error = self._unfrozen_error()
        if error is not None:
            raise error

    def _unfrozen_error(self) -> RuntimeError | None:
        """:meth:`_check_frozen`'s error, or None."""
        for position in self._frozen:
            param = self._params[position]
            if param.requires_grad:
                return RuntimeError(
                    f"parameter {position} ({_describe(_entry(param))}) did not require grad "
                    "when CompressedOptimizer wrapped it and requires it now, so its gradient "
                    "would not be exchanged. After changing requires_grad, wrap the optimizer "
                    "again on every rank, keeping the residuals: `state = opt.state_dict(); "
                    "opt = sparsecomm.CompressedOptimizer(opt.optimizer, ...the same "
                    "arguments...); opt.load_state_dict(state)`"
                )
        return None

    def _finish_step(self, skipped: bool) -> None:
        stats = self._step_stats
        if skipped:
            stats.skipped_steps = 1
        self.last_stats = stats
        self.total_stats = self.total_stats + stats
        if not skipped and not self._no_gradient_anywhere:
            self._steps_taken += 1
            self._engine.step = self._steps_taken
        self._no_gradient_anywhere = False
        self._synchronized = self._dropped_here = self._agreement_started = False
        self._synchronized_by_scaler = None
        self._refusal = None
        self._step_stats = StepStats()
        self._engine.compress_seconds = 0.0
        self._comm.seconds = 0.0

    def _sent_stats(self) -> StepStats:
        stats = StepStats(steps=1, elements=sum(b.numel for b in self._engine.buckets))
        stats.dense_bytes = DENSE_ELEMENT_BYTES * stats.elements
        stats.scheduled_density = _scheduled_density(self.compressor, self._steps_taken)
        for bucket in self._engine.buckets:
            exchange = bucket.exchange
            stats.bytes_sent += exchange.message.wire_bytes
            if exchange.dense:
                stats.elements_sent += exchange.message.numel
            else:
                stats.elements_sent += exchange.message.known_count()
        return stats

    def _finish(self, used: list[bool], skip: torch.Tensor | None, keep: bool = False) -> float:
        """``BucketEngine.finish``; returns the seconds it took beyond waiting for the
        collectives (measured only when profiling)."""
        engine = self._engine
        device = engine.device
        started, comm_before = self._comm.clock(device), self._comm.seconds
        engine.finish(used, skip, keep)
        finished = self._comm.clock(device)
        return finished - started - (self._comm.seconds - comm_before)

    def _start_agreement(
        self, peak: torch.Tensor | None, used_here: list[bool], dropped: bool = False
    ) -> _Agreement:
        """One small all-reduce: each rank's peak (the largest magnitude it sent, as a
        fraction of what W ranks may each send for their sum to stay finite; NaN or Inf
        when it sent one), which ranks dropped the step, and which parameters had a
        gradient on some rank. The step's refusal is decided from it on the device, and the
        verdict starts on its way to the host (:meth:`_agree_on_step` waits for it)."""
        world_size = self.world_size
        device = peak.device if peak is not None else torch.device("cpu")
        # flags: [sum of the peaks (slot 0, set after the all-reduce), each rank's peak,
        # each rank's status (_DROPPED), each rank's position (_POSITION_MODULUS), each
        # parameter's used flag]. Each rank has slots of its own (the others add 0 there,
        # and NaN stays NaN), and a used flag is above 0 if any rank used the parameter.
        if used_here == self._engine.held:  # every parameter with a bucket has a gradient
            flags = self._flags_template(device).clone()  # (no host copy)
        else:
            flags = torch.zeros(
                1 + 3 * world_size + len(used_here), dtype=torch.float32, device=device
            )
            used = torch.tensor(used_here, dtype=torch.float32)
            if device.type == "cuda":
                used = used.pin_memory()  # so the copy does not wait for the device
            flags[1 + 3 * world_size :] = used.to(device, non_blocking=True)
        if world_size > 1:  # (below 2**24: float32 holds it exactly)
            position = self._position() + _settings_fingerprint(self.optimizer)
            flags[1 + 2 * world_size + self.rank] = float(position)
        if dropped:  # an infinite peak: refused on the device as a non-finite one would be
            flags[1 + world_size + self.rank] = float(_DROPPED)
            flags[1 + self.rank] = math.inf
        elif peak is not None:
            flags[1 + self.rank] = peak
        self._comm.all_reduce_(flags)
        # The step is refused unless the peaks add up to at most the bound: a NaN or an Inf
        # fails the comparison, and so does a sum over the ranks that could overflow. The
        # host decides from the same float32 sum (slot 0), so it cannot disagree.
        total = flags[0:1]
        torch.sum(flags[1 : 1 + world_size], dim=0, keepdim=True, out=total)
        refused = total.le(_peak_bound(world_size, self._engine.narrow)).logical_not_()
        if world_size > 1:  # ranks apart: refused on the device too, so that no average is written
            lowest, highest = torch.aminmax(flags[1 + 2 * world_size : 1 + 3 * world_size])
            refused.logical_or_(lowest != highest)
        verdict = flags
        if device.type != "cuda":
            return _Agreement(refused, verdict, None)
        host = self._verdict_buffer
        if host is None or host.numel() != verdict.numel():
            host = self._verdict_buffer = torch.empty(verdict.numel(), pin_memory=True)
        host.copy_(verdict, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Agreement(refused, host, event)

    def _flags_template(self, device: torch.device) -> torch.Tensor:
        """The agreement's flags before this rank's peak goes in, when every parameter
        with a bucket had a gradient here: zeros, then the used flags (1 but for frozen
        parameters), kept for the engine they were made for, so that a step copies them in
        one launch."""
        template = self._template
        if template is None or template[0] is not self._engine or template[1].device != device:
            flags = torch.zeros(3 * self.world_size + 1, dtype=torch.float32, device=device)
            used = torch.tensor(self._engine.held, dtype=torch.float32, device=device)
            template = self._template = (self._engine, torch.cat([flags, used]))
        return template[1]

    def _agree_on_step(self, agreement: _Agreement) -> tuple[RuntimeError | None, list[bool]]:
        """Wait for the verdict of :meth:`_start_agreement` (the step's one host sync).
        Returns the step's refusal (None: accepted) and the used flags. Every rank gets the
        same answer."""
        if agreement.event is not None:
            agreement.event.synchronize()
        world_size = self.world_size
        values = agreement.host.tolist()
        peaks = values[1 : 1 + world_size]
        used = [f > 0 for f in values[1 + 3 * world_size :]]
        status = [int(f) for f in values[1 + world_size : 1 + 2 * world_size]]
        positions = [int(f) for f in values[1 + 2 * world_size : 1 + 3 * world_size]]
        if len(set(positions)) > 1:
            return self._apart_error(), used
        if values[0] <= _peak_bound(world_size, self._engine.narrow):
            return None, used
        dropped = [r for r in range(world_size) if status[r] & _DROPPED]
        if dropped:
            return StepDroppedError(dropped), used
        nonfinite = [r for r in range(world_size) if not math.isfinite(peaks[r])]
        if nonfinite:
            return NonFiniteGradientError(nonfinite), used
        too_large = [r for r in range(world_size) if peaks[r] > 1 / world_size]
        ranks = too_large or [max(range(world_size), key=peaks.__getitem__)]
        return NonFiniteGradientError(ranks, too_large=True), used

    def _position(self) -> int:
        """This rank's position in the step's agreement (:data:`_POSITION_MODULUS`)."""
        applied = (self._steps_taken - self._unapplied_steps) % _POSITION_MODULUS
        return 2 * applied + bool(self._unapplied_steps)

    def _apart_error(self) -> RuntimeError:
        """The error of a step whose agreement found the ranks apart: their positions plus
        their settings' fingerprints differed. Every rank found it in the same sum, so every
        rank runs this one collective (rare: it names what differs) and raises alike."""
        settings = _group_settings(self.optimizer, step=True)
        everyone = self._comm.all_gather_object((self._position(), settings))
        positions = [position for position, _ in everyone]
        if len(set(positions)) > 1:
            return _ranks_apart_error(positions)
        return _settings_apart_error([settings for _, settings in everyone])

    def _scaler_skips(self, grad_scaler) -> None:
        """Tell ``grad_scaler`` that this step was refused, as the other ranks' scalers
        are told (their found-inf flags set): it skips and lowers its scale with them."""
        state = grad_scaler._per_optimizer_states[id(self)]
        found_inf = state["found_inf_per_device"]
        if not found_inf:  # no gradient left to unscale (drop_step() cleared them)
            device = self._engine.device
            found_inf[device] = torch.ones((), device=device)
        for flag in found_inf.values():
            flag.fill_(1.0)

    def _unscale(self, grad_scaler) -> list[torch.Tensor]:
        """Unscale the gradients with ``grad_scaler`` (unless the user already did) and return
        its per-device found-inf flags, which step() then sets to the all-rank verdict."""
        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"].name != "UNSCALED":
            grad_scaler.unscale_(self)
        found_inf = state["found_inf_per_device"]
        if not found_inf:  # no gradient on this rank: nothing of its own to skip for
            device = self._engine.device
            found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        return list(found_inf.values())

    # ------------------------------------------------------------------ internals

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _build_engine(self) -> BucketEngine:
        buckets = build_buckets(
            self._params,
            cap_numel=cap_numel(self.bucket_cap_mb, DENSE_ELEMENT_BYTES),
            min_compress_numel=self.min_compress_numel,
            keep_residual=self.error_feedback and self.compressor.keeps_residual,
            keep_velocity=self.momentum_correction is not None,
        )
        # Profiling times each bucket's kernels apart, which a graph would merge.
        engine = BucketEngine(
            buckets, self.compressor, self._comm, self.momentum_correction,
            cuda_graphs=self.cuda_graphs and not self.profile,
            adam_state=_adam_state_of(self.optimizer) if self.compressor.selects_by_adam else None,
            num_params=len(self._params),
        )  # fmt: skip
        engine.step = self._steps_taken
        return engine

    def _register_hooks(self, params: list[torch.Tensor]) -> None:
        me = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            opt = me()
            if opt is not None:
                opt._on_gradient(param)

        def settle(grad: torch.Tensor) -> None:
            opt = me()
            if opt is not None and opt._pending is not None:
                opt._settle()  # before autograd adds to a .grad that may be dropped

        for param in params:
            if param.requires_grad:
                param._sparsecomm_owner = self._token
                if self._ahead:
                    self._settle_hooks.append(param.register_hook(settle))
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _guard_wrapped_step(self):
        """A step pre-hook on the wrapped optimizer: its ``step()`` called by anything but
        the wrapper that wraps it now (``optimizer.step()`` where ``opt.step()`` was meant)
        raises before it changes anything. It would step on this rank's own gradient (or
        on averages the wrapper then counts as a skipped step), and the ranks' parameters
        would come apart without a word."""
        me, token = weakref.ref(self), self._token
        self.optimizer._sparsecomm_wrapper = token

        def guard(optimizer, args, kwargs) -> None:
            opt = me()
            if opt is None or opt._stepping:
                return
            if getattr(optimizer, "_sparsecomm_wrapper", None) != token:
                return  # a newer CompressedOptimizer wraps it now: its guard decides
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called directly, but "
                "sparsecomm.CompressedOptimizer wraps this optimizer: call the wrapper's "
                "step() (`opt.step()`, with `opt = CompressedOptimizer(optimizer, ...)`), "
                "which exchanges the gradients first. Stepped alone, each rank would apply "
                "its own gradient and the ranks' parameters would come apart. Nothing was "
                "changed"
            )

        return self.optimizer.register_step_pre_hook(guard)

    def _step_wrapped(self) -> None:
        """The wrapped optimizer's step, past :meth:`_guard_wrapped_step`'s guard."""
        self._stepping = True
        try:
            self.optimizer.step()
        finally:
            self._stepping = False

    def _watch_fresh_gradients(self) -> None:
        """A hook before autograd accumulates, on each parameter the engine would adopt
        the gradient of (a bucket of its own): it notes whether ``.grad`` was None, that is
        whether the tensor after accumulation is autograd's own (:attr:`BucketEngine.fresh`)."""
        _remove_hooks(self._fresh_hooks)
        self._fresh_hooks.clear()
        me = weakref.ref(self)
        for param in self._engine.adopting_params():
            owner = weakref.ref(param)

            def note(grad: torch.Tensor, owner=owner) -> None:
                opt, param = me(), owner()
                if opt is not None and param is not None and param.grad is None:
                    opt._engine.fresh.add(id(param))

            self._fresh_hooks.append(param.register_hook(note))

    def _residuals_by_position(self) -> list[torch.Tensor | None]:
        return self._by_position("residual")

    def _load_residuals(self, residuals: list[torch.Tensor | None]) -> None:
        self._load_by_position("residual", residuals)

    def _velocities_by_position(self) -> list[torch.Tensor | None]:
        return self._by_position("velocity")

    def _load_velocities(self, velocities: list[torch.Tensor | None]) -> None:
        self._load_by_position("velocity", velocities)

    def _by_position(self, buffer: str) -> list[torch.Tensor | None]:
        """Per parameter position, a copy of its piece of each bucket's ``buffer``
        (``"residual"`` or ``"velocity"``); None where its bucket keeps none."""
        pieces: list[torch.Tensor | None] = [None] * len(self._params)
        for bucket in self._engine.buckets:
            flat = getattr(bucket, buffer)
            if flat is None:
                continue
            for member, position in enumerate(bucket.positions):
                pieces[position] = bucket.view(flat, member).clone()
        return pieces

    def _load_by_position(self, buffer: str, pieces: list[torch.Tensor | None]) -> None:
        """The inverse of ``_by_position``; a missing piece loads as zeros."""
        for bucket in self._engine.buckets:
            flat = getattr(bucket, buffer)
            if flat is None:
                continue
            for member, position in enumerate(bucket.positions):
                saved = pieces[position] if position < len(pieces) else None
                target = flat[bucket.span(member)]
                if saved is None:
                    target.zero_()
                else:
                    target.copy_(saved.reshape(-1))

    def _check_schedule_state(self, ours: dict, keep_residuals: bool = True) -> None:
        """Validate the step count and momentum-correction velocities of a state dict's
        sparsecomm section (after ``_check_state``, before anything is loaded)."""

        def refuse(what: str) -> ValueError:
            return ValueError(f"load_state_dict: {what}")

        steps = ours.get("steps_taken", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise refuse(f"'steps_taken' must be an int >= 0, got {steps!r}")
        saved = ours.get("exchange", "gradients")
        if saved != self.exchange:
            raise refuse(
                f"saved with exchange={saved!r}, this optimizer has exchange={self.exchange!r}"
            )
        if self._shared is not None:
            shared = ours.get("shared")
            if not isinstance(shared, (list, tuple)) or len(shared) != len(self._params):
                raise refuse(
                    f"'shared' must be a list of {len(self._params)} tensors (the shared "
                    "parameters of exchange='local_updates')"
                )
            for position, (saved, param) in enumerate(zip(shared, self._params)):
                if not torch.is_tensor(saved) or saved.dtype != param.dtype:
                    raise refuse(f"shared parameter {position} must be a {param.dtype} tensor")
                if saved.shape != param.shape:
                    raise refuse(
                        f"shared parameter {position} has shape {tuple(saved.shape)}, its "
                        f"parameter {tuple(param.shape)}"
                    )
                if not bool(torch.isfinite(saved).all()):
                    raise refuse(f"shared parameter {position} holds NaN or Inf")
        saved = ours.get("momentum_correction")
        if saved != self.momentum_correction:
            # (the wrapped optimizer's groups, loaded next, carry its own momentum)
            raise refuse(
                f"saved with momentum_correction={saved}, this optimizer has "
                f"momentum_correction={self.momentum_correction}"
            )
        if not keep_residuals:
            return  # the velocities are not loaded either
        velocities = ours.get("velocities") or []
        if self.momentum_correction is None:
            if any(v is not None for v in velocities):
                raise refuse("velocities are saved, but this optimizer keeps none")
            return
        if not isinstance(velocities, (list, tuple)) or len(velocities) != len(self._params):
            count = len(velocities) if isinstance(velocities, (list, tuple)) else velocities
            raise refuse(
                f"'velocities' must be a list of {len(self._params)} entries (one per "
                f"parameter), got {count!r}"
            )
        for position, (saved, param) in enumerate(zip(velocities, self._params)):
            if saved is None:
                continue
            if not torch.is_tensor(saved):
                raise refuse(f"velocity {position} is a {type(saved).__name__}, not a tensor")
            if saved.dtype != torch.float32 or list(saved.shape) != list(param.shape):
                raise refuse(
                    f"velocity {position} is {str(saved.dtype).replace('torch.', '')} "
                    f"{tuple(saved.shape)}; expected float32 {tuple(param.shape)}"
                )
            if not bool(torch.isfinite(saved).all()):
                raise refuse(f"velocity {position} holds NaN or Inf; the checkpoint is corrupt")

    def _raise_agreed(self, error: Exception | None) -> None:
        """Raise ``error`` on every rank if any rank has one (the first such rank's, so
        every rank raises the same). Collective."""
        if not self._comm.distributed:
            if error is not None:
                raise error
            return
        mine = None if error is None else (type(error).__name__, str(error))
        everyone = self._comm.all_gather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs is not None:
                kind = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(
                    theirs[0], ValueError
                )
                raise kind(f"on rank {rank}: {theirs[1]}")

    def _agree_on_model(self, params: list[torch.Tensor], start: int) -> None:
        """Check that every rank wraps the same parameters and settings; raise the same
        ValueError on every rank if not."""
        mine = {
            "settings": [
                self.compressor.config(),
                self.error_feedback,
                self.bucket_cap_mb,
                self.min_compress_numel,
                self.overlap,
                self.momentum_correction,
                self.exchange,
            ],
            "params": [_entry(p) for p in params],
            "optimizer": _optimizer_settings(self.optimizer),
        }
        everyone = self._comm.all_gather_object(mine)
        first = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs["optimizer"] != first["optimizer"]:
                raise ValueError(
                    f"ranks wrap different optimizers: rank 0 has {first['optimizer']}, rank "
                    f"{rank} has {theirs['optimizer']} (its class, then each parameter "
                    "group's settings); the ranks' parameters would step apart. Build the "
                    "wrapped optimizer with the same settings on every rank"
                )
            if theirs["settings"] != first["settings"]:
                raise ValueError(
                    f"ranks disagree on settings: rank 0 has {first['settings']}, rank {rank} "
                    f"has {theirs['settings']} ([compressor, error_feedback, bucket_cap_mb, "
                    "min_compress_numel, overlap, momentum_correction, exchange]); construct "
                    "CompressedOptimizer with the same arguments on every rank"
                )
            if theirs["params"] != first["params"]:
                detail = _first_difference(first["params"], theirs["params"], start, rank)
                raise ValueError(
                    f"ranks wrap different parameters: {detail}. Every rank must build the "
                    "same model and pass its parameters in the same order"
                )

    def _check_state(self, state_dict: Any, keep_residuals: bool = True) -> dict:
        """Validate a state dict completely before anything is loaded; return its
        sparsecomm section. ``keep_residuals=False``: only what is loaded then."""

        def refuse(what: str) -> ValueError:
            return ValueError(f"load_state_dict: {what}")

        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("sparsecomm"), dict):
            raise refuse(
                "this is not a CompressedOptimizer.state_dict() (no 'sparsecomm' section); "
                "to load a plain optimizer's state, call opt.optimizer.load_state_dict(state)"
            )
        if not isinstance(state_dict.get("optimizer"), dict):
            raise refuse("the 'optimizer' section (the wrapped optimizer's state) is missing")
        ours = state_dict["sparsecomm"]
        missing = [
            key
            for key in ("format", "world_size", "rank", "compressor", "error_feedback",
                        "shapes", "residuals")
            if key not in ours
        ]  # fmt: skip
        if missing:
            raise refuse(f"the 'sparsecomm' section lacks {missing}; it is not a saved state")
        if ours["format"] != _STATE_FORMAT:
            raise refuse(f"unknown state format {ours['format']!r}")
        shapes = [list(p.shape) for p in self._params]
        if ours["shapes"] != shapes:
            raise refuse(_first_difference(ours["shapes"], shapes))
        mine = _optimizer_classes(self.optimizer)
        saved = ours.get("optimizer_classes", mine)
        if not set(saved) & set(mine):  # (a subclass loads its base class's state)
            raise refuse(
                f"saved wrapping {saved[0]}, this optimizer wraps {mine[0]}, whose state the "
                f"saved one is not. Wrap the {saved[0]} it was saved with, or start this "
                "one afresh (load only the model's state)"
            )
        if not keep_residuals:
            return ours
        if ours["world_size"] != self.world_size:
            raise refuse(
                f"saved with world_size={ours['world_size']}, loading with "
                f"world_size={self.world_size}. Residuals belong to ranks, so this checkpoint "
                "resumes only on the same world size; to continue on another one without "
                "residuals, call opt.load_state_dict(state_dict, keep_residuals=False)"
            )
        if ours["rank"] != self.rank:
            raise refuse(
                f"saved by rank {ours['rank']}, loading on rank {self.rank}; each rank must "
                "load the file it saved"
            )
        if not self.compressor.matches(ours["compressor"]):
            raise refuse(
                f"saved with compressor {ours['compressor']}, this optimizer uses "
                f"{self.compressor.config()}; construct it with the compressor it was saved "
                "with, or continue without the residuals: opt.load_state_dict(state_dict, "
                "keep_residuals=False)"
            )
        if ours["error_feedback"] != self.error_feedback:
            raise refuse(
                f"saved with error_feedback={ours['error_feedback']}, this optimizer has "
                f"error_feedback={self.error_feedback}; to continue without the residuals: "
                "opt.load_state_dict(state_dict, keep_residuals=False)"
            )
        saved_min = ours.get("min_compress_numel", self.min_compress_numel)
        if saved_min != self.min_compress_numel:
            raise refuse(
                f"saved with min_compress_numel={saved_min}, this optimizer has "
                f"min_compress_numel={self.min_compress_numel}; to continue without the "
                "residuals: opt.load_state_dict(state_dict, keep_residuals=False)"
            )
        residuals = ours["residuals"]
        if not isinstance(residuals, (list, tuple)) or len(residuals) != len(self._params):
            count = len(residuals) if isinstance(residuals, (list, tuple)) else type(residuals)
            raise refuse(
                f"'residuals' must be a list of {len(self._params)} entries (one per "
                f"parameter), got {count}"
            )
        kept = self._residuals_by_position()
        frozen_then = ours.get("frozen", [])
        if not isinstance(frozen_then, (list, tuple)) or not all(
            isinstance(p, int) for p in frozen_then
        ):
            raise refuse(f"'frozen' must be a list of parameter positions, got {frozen_then!r}")
        frozen_then = set(frozen_then)
        for position, (saved, param) in enumerate(zip(residuals, self._params)):
            if saved is None:
                # A parameter that needed no gradient when saved had nothing to keep.
                if kept[position] is not None and position not in frozen_then:
                    raise refuse(
                        f"residual {position} is None, but this optimizer keeps one for "
                        "that parameter (the checkpoint would lose what it had not sent)"
                    )
                continue
            if not torch.is_tensor(saved):
                raise refuse(f"residual {position} is a {type(saved).__name__}, not a tensor")
            if kept[position] is None and not param.requires_grad:
                continue  # frozen since it was saved: its unsent gradient has no use now
            if kept[position] is None:
                raise refuse(
                    f"residual {position} is saved, but this optimizer keeps none for that "
                    "parameter"
                )
            if saved.dtype != torch.float32 or list(saved.shape) != list(param.shape):
                raise refuse(
                    f"residual {position} is {str(saved.dtype).replace('torch.', '')} "
                    f"{tuple(saved.shape)}; expected float32 {tuple(param.shape)}"
                )
            if not bool(torch.isfinite(saved).all()):
                raise refuse(
                    f"residual {position} holds NaN or Inf; the checkpoint is corrupt. Load "
                    "it with opt.load_state_dict(state_dict, keep_residuals=False) to start "
                    "with empty residuals"
                )
        return ours


def _peak_bound(world_size: int, narrow: bool = False) -> float:
    """The largest sum of the ranks' peaks (:meth:`Message.peak`) a step accepts: 1 (their
    sum stays finite), or with one rank any finite float32, whose peak may exceed 1 by
    :func:`sum_limit`'s margin, unless a bucket holds 16-bit parameters (``narrow``), whose
    peaks are measured against their dtype's largest value (``_Engine.narrow_factor``)."""
    return 1.0 if world_size > 1 or narrow else torch.finfo(torch.float32).max


@dataclass
class _Agreement:
    """The step's agreement on its way to the host: ``refused``, a one-element bool tensor
    on the device; ``host``, the verdict (the all-reduced flags: the sum of the peaks, the
    peaks, the used flags), filled once ``event`` (None off CUDA) has passed."""

    refused: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _first_difference(first: list, other: list, start: int = 0, rank: int | None = None) -> str:
    """Name the first parameter where two descriptions differ."""
    who = "this model" if rank is None else f"rank {rank}"
    base = "the checkpoint" if rank is None else "rank 0"
    for offset, (a, b) in enumerate(zip(first, other)):
        if a != b:
            return (
                f"parameter {start + offset} is {_describe(a)} on {base} but {_describe(b)} "
                f"on {who}"
            )
    return f"{base} has {start + len(first)} parameters but {who} has {start + len(other)}"


def _optimizer_classes(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the wrapped optimizer's class and its bases below
    ``torch.optim.Optimizer``: two optimizers sharing one share a state layout."""
    return [
        cls.__name__
        for cls in type(optimizer).__mro__
        if issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    ]


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> str:
    """The wrapped optimizer's class and each parameter group's settings (numbers, flags,
    strings and tuples of them; not its parameters), as the ranks compare them."""
    # (as text: a NaN setting equals itself there)
    return f"{type(optimizer).__name__} {_group_settings(optimizer)}"


def _group_settings(optimizer: torch.optim.Optimizer, step: bool = False) -> list[dict]:
    """Each parameter group's settings that are numbers, flags, strings or tuples of them
    (a one-element tensor read as its number). ``step``: as each step compares them, only
    those the wrapped optimizer has a default for (its hyperparameters: lr, betas,
    weight_decay, ...; not keys a scheduler adds), and a CUDA tensor left out (reading it
    would be a host sync)."""
    plain = (bool, int, float, str, type(None))
    keys = optimizer.defaults if step else None
    groups = []
    for group in optimizer.param_groups:
        settings = {}
        for key, value in sorted(group.items()):
            if keys is not None and key not in keys:
                continue
            if torch.is_tensor(value) and value.numel() == 1:  # (a tensor learning rate)
                if step and value.is_cuda:
                    continue
                value = value.item()
            if isinstance(value, plain) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, plain) for v in value)
            ):
                settings[key] = value
        groups.append(settings)
    return groups


def _settings_fingerprint(optimizer: torch.optim.Optimizer) -> int:
    """:func:`_group_settings` as an int below ``2**22``, added to the position each rank
    puts into a step's agreement: ranks whose settings differ are found apart there (a
    learning rate changed on some ranks only), at no extra collective. ``repr`` of a float
    is exact, and crc32 is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(_group_settings(optimizer, step=True)).encode()) % _POSITION_MODULUS


_TOKENS = itertools.count(1)  # CompressedOptimizer._token: one per wrapper in this process
_WRAPPERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> wrapper


def _ddp_holding(params: list[torch.Tensor]) -> torch.nn.Module | None:
    """A ``DistributedDataParallel`` module holding any of ``params``, or None. DDP marks
    nothing on the parameters it holds (its hooks are C++), so its modules are looked for
    among the objects Python's garbage collector tracks, by their type alone (``isinstance``
    would read attributes of every object): once per wrapper, about 75 ms per million
    objects."""
    ids = {id(param) for param in params}
    module, ddp = torch.nn.Module, torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, module) and issubclass(kind, ddp):
            if any(id(p) in ids for p in obj.module.parameters()):
                return obj
    return None


def _entry(param: torch.Tensor) -> list:
    """How :func:`_describe` and the ranks' agreement on the model see a parameter."""
    return [list(param.shape), str(param.dtype), param.requires_grad, param.device.type]


def _frozen_positions(params: list[torch.Tensor]) -> list[int]:
    """Positions of the parameters that need no gradient (they get no hook, no bucket)."""
    return [position for position, param in enumerate(params) if not param.requires_grad]


def _describe(entry) -> str:
    if isinstance(entry, list) and entry and isinstance(entry[0], list):
        shape, dtype, requires_grad, device = entry
        grad = "" if requires_grad else ", requires_grad=False"
        return f"{dtype.replace('torch.', '')} {tuple(shape)} on {device}{grad}"
    return f"shape {tuple(entry)}"


def _sharded(param: torch.Tensor) -> str | None:
    """What sharded ``param``, said for an error, or None: a ``DTensor`` (FSDP2's
    ``fully_shard``, tensor parallelism), known by its class name (no import of
    torch.distributed's modules), or ``FullyShardedDataParallel``'s flat parameter, a
    plain ``Parameter`` that FSDP marks ``_is_flat_param``."""
    if "DTensor" in {cls.__name__ for cls in type(param).__mro__}:
        return "a DTensor (FSDP2's fully_shard, or tensor parallelism, made it)"
    if getattr(param, "_is_flat_param", False):
        return "a FullyShardedDataParallel flat parameter (FSDP shards it across the ranks)"
    return None


def _check_params(params: list, start: int) -> Exception | None:
    """The first parameter sparsecomm cannot exchange, as an error naming the fix."""
    seen: dict[int, int] = {}
    for offset, param in enumerate(params):
        where = f"parameter {start + offset}"
        if not isinstance(param, torch.Tensor):
            return TypeError(f"{where} is a {type(param).__name__}, not a tensor")
        first = seen.setdefault(id(param), start + offset)
        if first != start + offset:
            return ValueError(
                f"{where} is parameter {first} again: torch.optim only warns about a "
                "parameter listed twice, but its gradient would be exchanged twice. List each "
                "parameter once (e.g. list(dict.fromkeys(model.parameters())))"
            )
        sharded = _sharded(param)
        if sharded is not None:
            return TypeError(
                f"{where} is {sharded}: each rank holds a piece of it, while sparsecomm "
                "averages gradients of parameters every rank holds whole. It replaces data "
                "parallelism and does not combine with sharding: wrap the optimizer of the "
                "model itself (unwrapped, on every rank), or keep the sharded model with its "
                "own optimizer"
            )
        if not param.is_floating_point() or param.dtype == torch.float64:
            return TypeError(
                f"{where} has dtype {param.dtype}; sparsecomm exchanges float32, float16 and "
                "bfloat16 parameters only: convert the model (e.g. model.float()) first"
            )
        if param.device.type == "meta":
            return ValueError(
                f"{where} {tuple(param.shape)} is on the meta device, which holds no data; "
                "materialize the model first (e.g. model.to_empty(device=...) and initialize "
                "it) and then wrap its optimizer"
            )
        too_large = too_large_for_a_bucket(start + offset, param)
        if too_large is not None:
            return too_large
    return None


def _scheduled_density(compressor: Compressor, step: int) -> float:
    """What ``StepStats.scheduled_density`` reports for ``step``."""
    current = compressor.at_step(step)
    if isinstance(current, TopK):
        return current.density
    return 0.0 if isinstance(current, Threshold) else 1.0


def _check_exchange(exchange, momentum_correction, optimizer=None) -> Exception | None:
    if exchange not in ("gradients", "updates", "local_updates"):
        return ValueError(
            "exchange must be 'gradients' (average the gradients, then step), 'updates' "
            "(step on each rank, average the updates) or 'local_updates' (the same, each "
            f"rank's model keeping its unsent updates), got {exchange!r}"
        )
    if exchange == "gradients" and isinstance(optimizer, SharedMomentAdamW):
        return ValueError(
            "SharedMomentAdamW shares the second moment of the ranks' averaged gradient "
            "between ranks that step on their own gradients: use it with "
            "exchange='local_updates' (or 'updates'); with exchange='gradients' every rank "
            "steps on the average already, so wrap torch.optim.AdamW or CatchUpAdamW"
        )
    if exchange != "gradients" and momentum_correction is not None:
        return ValueError(
            f"momentum_correction works on gradients; with exchange={exchange!r} the wrapped "
            "optimizer's own momentum runs on each rank before compression already"
        )
    return None


#: The wrapped optimizers whose state ``TopK(select="adam")`` reads (``exp_avg_sq``, ``eps``).
ADAM_FAMILY = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    CatchUpAdamW,
    SharedMomentAdamW,
)


def _check_selection(optimizer, compressor, exchange, new_groups=None) -> Exception | None:
    """The first problem with ``TopK(select="adam")`` and what it goes with; with
    ``new_groups``, of those groups about to be added (numbered after the existing ones)."""
    if not getattr(compressor, "selects_by_adam", False):
        return None
    if not isinstance(optimizer, ADAM_FAMILY):
        return TypeError(
            f"{compressor!r} selects by the wrapped optimizer's second moment (exp_avg_sq), "
            f"which {type(optimizer).__name__} does not keep: wrap torch.optim.AdamW, Adam, "
            "NAdam, RAdam or sparsecomm.CatchUpAdamW, or use TopK(select='magnitude')"
        )
    start = len(optimizer.param_groups) if new_groups is not None else 0
    groups = optimizer.param_groups if new_groups is None else new_groups
    zero_eps = [start + i for i, group in enumerate(groups) if not group["eps"] > 0]
    if zero_eps:
        return ValueError(
            f"{compressor!r} divides by sqrt(exp_avg_sq) + eps, and param group(s) {zero_eps} "
            "have eps <= 0 (0 / 0 where nothing was stepped on yet): give them eps > 0 (AdamW's "
            "default is 1e-8), or use TopK(select='magnitude')"
        )
    if exchange != "gradients":
        return ValueError(
            f"{compressor!r} scales gradients by Adam's second moment; with "
            f"exchange={exchange!r} what is compressed is Adam's update, scaled already: use "
            "TopK(select='magnitude') there"
        )
    return None


def _adam_state_of(optimizer: torch.optim.Optimizer):
    """For the bucket engine: a function of a parameter giving its ``(exp_avg_sq, eps)`` in
    ``optimizer``; ``exp_avg_sq`` is None before the optimizer has stepped on it."""
    # The group's index, not the group: load_state_dict replaces the group dicts.
    group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}

    def adam_state(param: torch.Tensor):
        variance = optimizer.state.get(param, {}).get("exp_avg_sq")
        return variance, optimizer.param_groups[group_of[id(param)]]["eps"]

    return adam_state


def _check_momentum_correction(optimizer, momentum_correction) -> Exception | None:
    """The first problem with ``momentum_correction`` and the optimizer it goes with."""
    if momentum_correction is None:
        return None
    if (
        isinstance(momentum_correction, bool)
        or not isinstance(momentum_correction, (int, float))
        or not 0 <= momentum_correction < 1
    ):
        return ValueError(
            f"momentum_correction must be None or a momentum factor in [0, 1), got "
            f"{momentum_correction!r}; for example momentum_correction=0.9"
        )
    if not isinstance(optimizer, torch.optim.SGD):
        return TypeError(
            "momentum_correction applies SGD momentum before compression, so the wrapped "
            f"optimizer must be torch.optim.SGD (with momentum=0), got {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        error = _check_group_momentum(group, optimizer)
        if error is not None:
            return error
    return None


def _check_group_momentum(group: dict, optimizer) -> Exception | None:
    momentum = group.get("momentum", optimizer.defaults.get("momentum", 0))
    if momentum:
        return ValueError(
            f"momentum_correction keeps the momentum itself, but the wrapped SGD has "
            f"momentum={momentum} in a parameter group, which would apply it twice; build "
            "torch.optim.SGD(..., momentum=0) and pass the factor as momentum_correction "
            "(a scheduler that cycles momentum, such as OneCycleLR or CyclicLR, sets it "
            "every step: build it with cycle_momentum=False)"
        )
    return None


def _needs_closure(optimizer) -> bool:
    """Whether the optimizer's ``step`` takes a closure it cannot do without
    (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # (a step without a signature to read)
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _group_params(param_group: Any, existing: list) -> tuple[list, Exception | None]:
    """The parameters of a group for add_param_group, or the error torch would raise."""
    if not isinstance(param_group, dict) or "params" not in param_group:
        return [], TypeError(
            f"add_param_group takes a dict with a 'params' entry, got {param_group!r}"
        )
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    known = {id(p) for p in existing}
    for offset, param in enumerate(params):
        if id(param) in known:
            return params, ValueError(
                f"add_param_group: parameter {offset} of the new group is already in a group; "
                "each parameter can be in one group only"
            )
    return params, None


def _good_cap(cap) -> bool:
    return (
        not isinstance(cap, bool)
        and isinstance(cap, (int, float))
        and not math.isnan(cap)
        and cap > 0
    )


def default_bucket_cap_mb(compressor: Compressor, params: list[torch.Tensor]) -> float:
    """The bucket size (MiB of float32) when ``bucket_cap_mb`` is not given: the
    compressor's ``default_bucket_cap_mb``, raised where the parameters that train would
    fill more than its ``default_max_buckets`` buckets of that size to what fills that
    many (about: a bucket holds whole parameters)."""
    cap = compressor.default_bucket_cap_mb
    most = compressor.default_max_buckets
    if most is None:
        return cap
    mib = DENSE_ELEMENT_BYTES * sum(p.numel() for p in params if p.requires_grad) / 2**20
    return max(cap, mib / most)


def _check_arguments(
    optimizer, compressor, error_feedback, bucket_cap_mb, min_compress_numel, overlap, unexpected
) -> Exception | None:
    """The first bad constructor argument, as a TypeError/ValueError naming the fix."""
    for name in unexpected:
        close = difflib.get_close_matches(name, _KEYWORDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return TypeError(
            f"CompressedOptimizer got an unexpected keyword argument {name!r}; {hint}"
            f"valid keywords are {', '.join(_KEYWORDS)}"
        )
    if isinstance(optimizer, CompressedOptimizer):
        return TypeError(
            "optimizer is already a CompressedOptimizer; wrap the plain torch.optim optimizer once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        return TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if _needs_closure(optimizer):
        return TypeError(
            f"{type(optimizer).__name__}.step() needs a closure, which it evaluates (and "
            "backpropagates) several times within one step: the exchange averages one "
            "backward per step, so such an optimizer cannot be wrapped. Use a first-order "
            "optimizer (torch.optim.SGD, AdamW, ...)"
        )
    if not isinstance(compressor, Compressor):
        return TypeError(
            f"compressor must be a sparsecomm compressor, got {compressor!r}; use "
            "sparsecomm.Dense(), Cast(torch.float16), Cast(torch.bfloat16), Threshold(t) or "
            "TopK(density)"
        )
    for name, value in (("error_feedback", error_feedback), ("overlap", overlap)):
        if not isinstance(value, bool):
            return TypeError(f"{name} must be True or False, got {value!r}")
    most = compressor.default_max_buckets
    if (
        bucket_cap_mb is None
        and most is not None
        and (isinstance(most, bool) or not isinstance(most, int) or most < 1)
    ):
        return ValueError(
            f"{type(compressor).__name__}.default_max_buckets must be an int >= 1 or None (no "
            f"bound), got {most!r}; set it in the class, or pass bucket_cap_mb"
        )
    default = compressor.default_bucket_cap_mb
    if bucket_cap_mb is None and not _good_cap(default):  # a custom compressor's
        return ValueError(
            f"{type(compressor).__name__}.default_bucket_cap_mb must be a number > 0 (MiB of "
            f"float32 per bucket), got {default!r}; set it in the class, or pass bucket_cap_mb"
        )
    if bucket_cap_mb is not None and not _good_cap(bucket_cap_mb):
        return ValueError(
            f"bucket_cap_mb must be a number > 0 (MiB of float32 per bucket; float('inf') "
            f"for no cap), got {bucket_cap_mb!r}; leave it out (None) for the compressor's "
            f"default ({default!r} MiB for {compressor!r}, more for a very large model)"
        )
    if (
        isinstance(min_compress_numel, bool)
        or not isinstance(min_compress_numel, int)
        or min_compress_numel < 0
    ):
        return ValueError(
            f"min_compress_numel must be an int >= 0, got {min_compress_numel!r}; 0 "
            "compresses every parameter, the default 1024 sends small ones dense"
        )
    return None


def _update_as_gradient(params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """After the wrapped optimizer's step: each parameter's ``.grad`` becomes its update as
    a gradient (``before - now``) and the parameter goes back to ``before``. On CUDA in
    foreach launches for all of them (one more pass over the gradients than a subtraction
    per tensor, far fewer launches); on a CPU tensor by tensor, while each is in cache."""
    if params and params[0].is_cuda:
        grads = [param.grad for param in params]
        detached = [param.detach() for param in params]
        torch._foreach_copy_(grads, before)
        torch._foreach_sub_(grads, detached)  # the same float op as before - now
        torch._foreach_copy_(detached, before)
        return
    for param, old in zip(params, before):
        torch.sub(old, param, out=param.grad)
        param.copy_(old)


def _foreach_sub_(targets: list[torch.Tensor], amounts: list[torch.Tensor]) -> None:
    """``target -= amount`` for each pair, ``amount`` rounded to its target's dtype first
    (as ``target.sub_(amount.to(target.dtype))``); in foreach launches on CUDA."""
    amounts = [amount.to(target.dtype) for target, amount in zip(targets, amounts)]
    if targets and targets[0].is_cuda:
        torch._foreach_sub_(targets, amounts)
        return
    for target, amount in zip(targets, amounts):
        target.sub_(amount)


def _steps_ahead_possible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is torch's own Adam/AdamW step (through any
    ``functools.wraps`` wrapper, a learning-rate scheduler's say) with ``fused=True`` in
    every group: it then skips on the device when ``found_inf`` is set
    (``_may_step_ahead``)."""
    step = optimizer.step
    step = inspect.unwrap(getattr(step, "__func__", step))
    torch_adam = any(step is inspect.unwrap(c.step) for c in (torch.optim.Adam, torch.optim.AdamW))
    return torch_adam and all(group.get("fused") for group in optimizer.param_groups)
