"""The DDP front door: sparsecomm's compressors as a ``DistributedDataParallel`` comm hook.

``state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01))`` and
``ddp_model.register_comm_hook(state, hook)``: DDP keeps its own bucketing, overlap with
backward, ``no_sync()``, ``static_graph`` and ``find_unused_parameters``; each of its
buckets goes through the same ``compress`` / ``start`` / ``finish`` as under
:class:`sparsecomm.CompressedOptimizer`, with an error-feedback residual per bucket kept
in the state object.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from ._comm import Communicator
from ._engine import CompressGraphs
from .compressors import Compressor, Dense, Message

__all__ = ["DDPCommHookState", "ddp_comm_hook"]

_STATE_FORMAT = 1
# A load_state_dict after at most this many iterations of this process is a resume, which
# every rank makes alike: its iteration is compared across ranks. (A resume in processes
# whose DDP buckets differ from their first ones loads after one iteration thrown away,
# two under static_graph=True, where DDP rebuilds its buckets after the second.)
_RESUME_ITERATIONS = 2
_DENSE = Dense()


class _HostFlag:
    """Is a 0-dim float32 device tensor NaN or Inf? Copied to the host without stalling it:
    read an iteration later, the copy has long arrived, where ``float(value)`` on a CUDA
    tensor would wait for every kernel queued so far (the current backward included)."""

    def __init__(self, value: torch.Tensor):
        self._event = None
        if value.is_cuda:
            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = value

    def is_set(self) -> bool:
        if self._event is not None:
            self._event.synchronize()  # done by now: returns at once
        return not math.isfinite(float(self._host))


class DDPCommHookState:
    """What the hook keeps between iterations (pass it to ``register_comm_hook``).

    Residuals live per DDP bucket, as one flat float32 tensor laid out like the bucket,
    and are known per parameter: DDP rebuilds its buckets after the first iteration of
    every process (in the order gradients arrived), and a checkpoint resumed in new
    processes starts again from DDP's first layout; each time the layout changes, every
    parameter's residual moves with it, nothing is lost.

    Attributes:
        compressor: what each bucket sends.
        error_feedback: whether unsent gradient is kept and added to the next iteration's.
        comm: the process group's collectives.
        dense_iterations: iterations sent dense (fp32) before compressing.
        iteration: iterations completed (counted at each iteration's last bucket).
        residuals: bucket index to its float32 residual (what was not sent yet).
        nonfinite: bucket index to a :class:`_HostFlag`: did this rank's last message for
            that bucket hold NaN or Inf? Its residual is then dropped before the next use (the
            averaged gradient is non-finite on every rank, so ``GradScaler`` skips the step).
            Where an iteration's averages held NaN or Inf, the other buckets' residuals (and
            every bucket of the ranks whose messages were finite) take back what they sent
            in it (:meth:`_settle`), for ``TopK`` and ``Threshold``.
        last_bytes_sent: bytes this rank put into the collectives in the last iteration.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool = True,
        process_group: Any = None,
        dense_iterations: int = 0,
        cuda_graphs: bool = True,
    ):
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"compressor must be a sparsecomm compressor, got {compressor!r}; use "
                "sparsecomm.Dense(), Cast(torch.float16), Cast(torch.bfloat16), "
                "Threshold(t) or TopK(density)"
            )
        if compressor.selects_by_adam:
            raise ValueError(
                f"{compressor!r} selects by the optimizer's second moment, which a comm hook "
                "does not see (DDP calls it with buckets only): use "
                "sparsecomm.CompressedOptimizer for it, or TopK(select='magnitude') here"
            )
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {error_feedback!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        if (
            isinstance(dense_iterations, bool)
            or not isinstance(dense_iterations, int)
            or (dense_iterations < 0)
        ):
            raise ValueError(
                f"dense_iterations must be an int >= 0, got {dense_iterations!r}; 0 "
                "compresses from the first iteration"
            )
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.comm = Communicator(process_group)
        self.dense_iterations = dense_iterations
        #: CUDA graphs of the compression (None: off), as in CompressedOptimizer.
        self.graphs = CompressGraphs() if cuda_graphs else None
        self.iteration = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.nonfinite: dict[int, _HostFlag] = {}
        # The current (or last) iteration's sparse messages per bucket, each with a flag:
        # was the average it took part in non-finite? Kept until the iteration is over.
        self._sent: dict[int, tuple[Message, _HostFlag]] = {}
        self._sent_iteration = 0
        self.last_bytes_sent = 0
        self._bytes_this_iteration = 0
        # A parameter's key is the order in which this process first saw it: DDP's first
        # layout is the same in every new process, so keys are too.
        self._keys: dict[int, int] = {}
        self._keyed = False  # every parameter has its key (after this process's first iteration)
        self._shapes: dict[int, list[int]] = {}  # key: its parameter's shape
        self._saved_shapes: dict[int, list[int]] = {}  # key: shape, of a loaded state's model
        # Compared across ranks at the first bucket (after a resume's load_state_dict); not
        # after a later load, which some ranks alone may call.
        self._iteration_unchecked = True
        self._iterations_here = 0  # iterations this process has sent (for load_state_dict)
        self._layouts: dict[int, list[tuple[int, int]]] = {}  # index: [(key, numel)]
        self._loose: dict[int, torch.Tensor] = {}  # key: residual between layouts

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per parameter) and counters, tensors and plain values
        only. Per rank: save one file per rank, after ``optimizer.step()`` (or before
        ``backward()``), with the model and the optimizer: between a backward and the step
        the residuals are already that step's, the model and optimizer not yet."""
        self._loosen_all()
        return {
            "format": _STATE_FORMAT,
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "compressor": self.compressor.config(),
            "error_feedback": self.error_feedback,
            "iteration": self.iteration,
            "residuals": {key: r.clone() for key, r in self._loose.items()},
            "shapes": {**self._saved_shapes, **self._shapes},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by this rank, between iterations: in new
        processes (before a first backward, or after the one, two under
        ``static_graph=True``, that DDP takes to rebuild its buckets) or in the one that
        saved it. A load in a process that has sent at most two iterations is a resume,
        which every rank makes: at the next bucket the ranks compare their iterations. A
        state belongs to one DDP model: for a new model, make a new state and load into it.
        Everything is checked first; a mismatch raises ``ValueError`` naming it and
        changes nothing. A state saved for another model (parameters of other shapes, or
        more or fewer of them, in the order DDP first hands them over) raises
        ``ValueError`` here if the hook has seen this process's model, else when DDP first
        hands over a parameter that differs (or at the end of that first iteration)."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(
                "DDPCommHookState.load_state_dict: not a saved hook state (format "
                f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})"
            )
        expected = {
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "compressor": self.compressor.config(),
            "error_feedback": self.error_feedback,
        }
        for key, value in expected.items():
            same = (
                self.compressor.matches(state.get(key))
                if key == "compressor"
                else state.get(key) == value
            )
            if not same:
                raise ValueError(
                    f"DDPCommHookState.load_state_dict: saved with {key}={state.get(key)!r}, "
                    f"this hook has {key}={value!r}; residuals belong to one rank, world size "
                    "and compressor. To go on without them (the gradient they held back is "
                    "dropped), keep only the iteration count: state.iteration = "
                    "saved['iteration']"
                )
        iteration = state.get("iteration")
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(
                "DDPCommHookState.load_state_dict: 'iteration' must be an int >= 0, got "
                f"{iteration!r}; the checkpoint is corrupt"
            )
        residuals = state.get("residuals")
        if not isinstance(residuals, dict):
            raise ValueError("DDPCommHookState.load_state_dict: 'residuals' must be a dict")
        for key, residual in residuals.items():
            if not torch.is_tensor(residual) or residual.dtype != torch.float32:
                raise ValueError(
                    f"DDPCommHookState.load_state_dict: residual of parameter {key} must be a "
                    "float32 tensor"
                )
            if not bool(torch.isfinite(residual).all()):
                raise ValueError(
                    f"DDPCommHookState.load_state_dict: residual of parameter {key} holds NaN "
                    "or Inf; the checkpoint is corrupt"
                )
        shapes = state.get("shapes", {})  # (none in states saved before it was recorded)
        if not isinstance(shapes, dict) or not all(
            isinstance(v, (list, tuple)) and all(isinstance(d, int) for d in v)
            for v in shapes.values()
        ):
            raise ValueError(
                "DDPCommHookState.load_state_dict: 'shapes' must map parameter keys to shapes"
            )
        shapes = {int(k): list(v) for k, v in shapes.items()}
        for key, residual in residuals.items():
            if int(key) in shapes and residual.numel() != math.prod(shapes[int(key)]):
                raise ValueError(
                    f"DDPCommHookState.load_state_dict: residual of parameter {key} has "
                    f"{residual.numel()} elements, its shape {shapes[int(key)]} has "
                    f"{math.prod(shapes[int(key)])}; the checkpoint is corrupt"
                )
        for key, shape in self._shapes.items():  # keys given already: this process's model
            self._check_shape(key, shape, shapes)
        if self._keyed:
            self._check_count(shapes)
        if self._iterations_here <= _RESUME_ITERATIONS:
            # A resume (every rank alike): compared across ranks at the next bucket. Not
            # after a later load, which some ranks alone may call.
            self._iteration_unchecked = True
        self.iteration = iteration
        self._saved_shapes = shapes
        self._loose = {int(k): r.clone() for k, r in residuals.items()}
        # Keys already given (the hook ran in this process) stay: they were given in DDP's
        # first layout, as the saving process gave its own, whatever layout DDP uses now.
        self.residuals, self.nonfinite, self._layouts, self._sent = {}, {}, {}, {}

    def _settle(self) -> None:
        """Once an iteration is over: if any of its averages held NaN or Inf, the step it
        fed was not taken (``GradScaler`` skips it on every rank, as every rank's averages
        are the same bits), so each bucket puts back into its residual what it sent, and
        nothing sent in a skipped step is lost. The residual then holds ``grad + residual``
        of that iteration, bit for bit (the sent places were zero, or the bfloat16
        rounding's remainder). A bucket whose own message held NaN or Inf drops its
        residual instead (``nonfinite``)."""
        if self._sent_iteration == self.iteration:
            return  # (its buckets are still being sent)
        sent, self._sent = self._sent, {}
        self._sent_iteration = self.iteration
        if not any(flag.is_set() for _, flag in sent.values()):
            return
        for index, (message, _) in sent.items():
            own = self.nonfinite.get(index)
            residual = self.residuals.get(index)
            if residual is None or (own is not None and own.is_set()):
                continue
            count = message.known_count()
            # Distinct indices: one add per place, deterministic on every device.
            residual.index_add_(0, message.indices[:count].long(), message.values[:count].float())

    def _layout_of(self, bucket) -> list[tuple[int, int]]:
        layout = []
        for param in bucket.parameters():
            key = self._keys.get(id(param))
            if key is None:  # first seen (in this process's first iteration)
                key = self._keys[id(param)] = len(self._keys)
                self._shapes[key] = list(param.shape)
                self._check_shape(key, self._shapes[key], self._saved_shapes)
            layout.append((key, param.numel()))
        return layout

    @staticmethod
    def _check_shape(key: int, shape: list[int], saved: dict[int, list[int]]) -> None:
        """A loaded state's model must be this one: parameter ``key`` (in the order DDP
        first hands parameters to the hook) must have the shape it had there."""
        if not saved or saved.get(key) == shape:
            return
        found = f"has shape {saved[key]}" if key in saved else "is not there"
        raise ValueError(
            f"DDPCommHookState: parameter {key} (in the order DDP first hands parameters to "
            f"the hook) has shape {shape}, but in the loaded state's model, of {len(saved)} "
            f"parameters, it {found}: the state was saved for another model. Load the state "
            "saved with this model, or none"
        )

    def _check_count(self, saved: dict[int, list[int]]) -> None:
        if saved and len(saved) != len(self._keys):
            raise ValueError(
                f"DDPCommHookState: this model has {len(self._keys)} parameters, the loaded "
                f"state's model {len(saved)}: the state was saved for another model. Load "
                "the state saved with this model, or none"
            )

    def _settings(self) -> str:
        return repr((self.compressor.config(), self.error_feedback, self.dense_iterations))

    def _agree_on_iteration(self, device: torch.device) -> None:
        """One all-gather of each rank's iteration count and settings, at this state's
        first bucket: ranks that loaded states of different iterations would pick
        different compressors or densities, and ranks built with different settings would
        send different payloads; either would not match."""
        self._iteration_unchecked = False
        # (the settings as a 63-bit digest: one all-gather of int64s for both)
        digest = int.from_bytes(hashlib.sha256(self._settings().encode()).digest()[:8], "big")
        gathered = self.comm.all_gather_ints([self.iteration, digest >> 1], device)
        iterations, digests = [row[0] for row in gathered], [row[1] for row in gathered]
        if len(set(digests)) > 1:
            raise RuntimeError(
                "DDPCommHookState: the ranks were built with different settings (compressor, "
                f"error_feedback or dense_iterations; this rank's: {self._settings()}). "
                "Build sparsecomm.ddp_comm_hook with the same arguments on every rank"
            )
        if len(set(iterations)) > 1:
            raise RuntimeError(
                f"DDPCommHookState: the ranks are at different iterations ({iterations} by "
                "rank): they loaded states saved at different iterations, or not every rank "
                "loaded one. Load on every rank the state that rank saved at the same "
                "iteration"
            )

    def _loosen_all(self) -> None:
        """Split every bucket's residual into per-parameter pieces (in ``_loose``); a
        residual whose last message held NaN or Inf is dropped first, as its next use would
        have dropped it."""
        self._settle()
        for index, flag in self.nonfinite.items():
            if flag.is_set():
                self.residuals[index].zero_()
        self.nonfinite = {}
        for index, residual in self.residuals.items():
            offset = 0
            for key, numel in self._layouts[index]:
                self._loose[key] = residual[offset : offset + numel]
                offset += numel
        self.residuals, self._layouts = {}, {}

    def _residual_for(self, bucket, grad: torch.Tensor) -> torch.Tensor:
        index = bucket.index()
        layout = self._layout_of(bucket)
        known = self._layouts.get(index)
        if known != layout:
            if known is not None:
                # DDP rebuilt its buckets: every residual goes into per-parameter pieces,
                # and each bucket takes its own back at its first sight after (the branch
                # below, once per bucket, not once per bucket and step).
                self._loosen_all()
            pieces = []
            for key, numel in layout:
                piece = self._loose.pop(key, None)
                if piece is not None and piece.numel() != numel:
                    raise ValueError(
                        f"DDPCommHookState: the loaded residual of parameter {key} (in the "
                        f"order DDP first hands parameters to the hook) has {piece.numel()} "
                        f"elements, but that parameter has {numel}: the state was saved for "
                        "another model; load the state saved with this model, or none"
                    )
                pieces.append(
                    torch.zeros(numel, dtype=torch.float32, device=grad.device)
                    if piece is None
                    else piece.to(grad.device)
                )
            residual = torch.cat(pieces) if pieces else grad.new_zeros(0)
            self.residuals[index], self._layouts[index] = residual, layout
            self.nonfinite.pop(index, None)
        residual = self.residuals[index]
        flag = self.nonfinite.pop(index, None)
        if flag is not None and flag.is_set():
            residual.zero_()
        return residual


def ddp_comm_hook(
    compressor: Compressor,
    *,
    error_feedback: bool = True,
    process_group: Any = None,
    dense_iterations: int = 0,
    cuda_graphs: bool = True,
):
    """A ``DistributedDataParallel`` comm hook that sends each DDP bucket compressed.

    Args:
        compressor: ``Dense()``, ``Cast(dtype)``, ``Threshold(t)`` or ``TopK(density)``.
        error_feedback: keep what was not sent per bucket (default True).
        process_group: the group DDP averages over (``None``: the default group).
        dense_iterations: iterations sent dense first (see :class:`DDPCommHookState`).
        cuda_graphs: on CUDA, replay each bucket's compression from a CUDA graph once it
            has run twice (``TopK``, ``Cast``), as ``CompressedOptimizer`` does: the same
            bits, fewer launches from Python (default True).

    Returns:
        ``(state, hook)``, for ``ddp_model.register_comm_hook(state, hook)``.

    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
        >>> state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01))
        >>> ddp.register_comm_hook(state, hook)

    The hook runs once per DDP bucket, and each call costs host time and a few launches:
    with ``TopK`` or ``Threshold``, larger DDP buckets than the default 25 MiB pay (on one
    H100, the 163M GPT's step in 100 MiB buckets was 1.01x ``CompressedOptimizer``'s, in
    25 MiB ones 1.04-1.06x).

    Warning:
        Under ``torch.amp.GradScaler`` the hook sees scaled gradients, so residuals are
        kept in scaled units, and a changing scale rescales what they hold. When the
        scaler skips a step (a rank sent NaN or Inf, so every rank's average holds one),
        ``TopK`` and ``Threshold`` put what each rank sent back into its residual, with
        that step's gradient in it; ``Cast``'s residual, a rounding remainder, keeps
        nothing of that step, as DDP's fp16 hook does. Use
        :class:`sparsecomm.CompressedOptimizer`, which keeps residuals unscaled and skips
        such a step with its residuals as they were, for fp16 training with a loss scale.
    """
    state = DDPCommHookState(
        compressor,
        error_feedback=error_feedback,
        process_group=process_group,
        dense_iterations=dense_iterations,
        cuda_graphs=cuda_graphs,
    )
    return state, _compressed_hook


# No annotations: DDP compares them with the real types, and this module's are strings.
def _compressed_hook(state, bucket):
    """Compress one DDP bucket, start its exchange, return a future of its average."""
    buffer = bucket.buffer()
    index = bucket.index()
    if state._iteration_unchecked:
        state._agree_on_iteration(buffer.device)
    state._settle()  # (at the first bucket of an iteration, the last one's)
    if not state._keyed:
        # Keys in DDP's first layout (this process's first iteration), dense or not, as
        # any process that later loads this state gives them.
        state._layout_of(bucket)
        state._keyed = bucket.is_last()
        if state._keyed:
            state._check_count(state._saved_shapes)
    if state.iteration < state.dense_iterations:
        compressor = _DENSE
    else:
        compressor = state.compressor.at_step(state.iteration)  # a TopK warm-up's density
    grad = buffer if buffer.dtype == torch.float32 else buffer.float()
    residual = None
    if state.error_feedback and compressor.keeps_residual:
        residual = state._residual_for(bucket, grad)
    signature = None
    if state.graphs is not None:
        signature = state.graphs.signature(compressor, grad.device, grad.numel(), index)
    if signature is None:
        message = compressor.compress(grad, residual, state.comm.world_size)
    else:
        message = state.graphs.compress(
            compressor, grad, residual, state.comm.world_size, signature, index
        )
    compressor.round_message(message, residual)  # (16-bit sparse values; else a no-op)
    exchange = compressor.start(message, state.comm, check=residual is not None)
    state._bytes_this_iteration += message.wire_bytes
    if residual is not None:
        state.nonfinite[index] = _HostFlag(exchange.peak)
    keep = residual is not None and message.indices is not None  # (what _settle can put back)
    if bucket.is_last():
        state.iteration += 1
        state._iterations_here += 1
        state.last_bytes_sent, state._bytes_this_iteration = state._bytes_this_iteration, 0

    def finish(done) -> torch.Tensor:
        if done is not None:
            done.value()  # a collective that failed (a rank gone, a timeout) raises here
        exchange.work = None  # done: this runs when it completes, and must not wait on it
        average = compressor.finish(exchange, grad)
        if keep:
            flag = _HostFlag(compressor.average_peak(exchange, average))
            state._sent[index] = (message, flag)
        if average is not buffer:
            buffer.copy_(average)
        return buffer

    if exchange.work is None:
        done = torch.futures.Future()
        done.set_result(finish(None))
        return done
    return exchange.work.get_future().then(finish)
