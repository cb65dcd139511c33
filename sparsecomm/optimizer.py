"""``CompressedOptimizer``: compress, exchange and average gradients inside ``step()``."""

from __future__ import annotations

import difflib
import time
import warnings
from typing import Any

import torch

from ._buckets import Bucket, build_buckets
from ._comm import Communicator
from ._stats import StepStats
from .compressors import DENSE_ELEMENT_BYTES, Compressor, Dense

__all__ = ["CompressedOptimizer", "NonFiniteGradientError"]

_STATE_FORMAT = 1
_KEYWORDS = (
    "compressor",
    "error_feedback",
    "process_group",
    "bucket_cap_mb",
    "min_compress_numel",
    "profile",
)

# GradScaler hands itself to an optimizer whose step() takes `grad_scaler`, with a
# FutureWarning about a newer protocol. That newer protocol gives the optimizer no way to
# tell the scaler that another rank overflowed, so sparsecomm keeps the older one, which
# lets every rank's scaler skip and back off together.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


class NonFiniteGradientError(RuntimeError):
    """A gradient held NaN or Inf on some rank. Raised by ``step()`` on every rank alike;
    nothing (parameters, residuals, optimizer state) was changed.

    Attributes:
        ranks: the ranks (in the process group) whose gradients were not finite.
    """

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        super().__init__(
            f"non-finite gradient (NaN or Inf) on rank(s) {ranks}: the step was not taken on "
            "any rank, and parameters, residuals and optimizer state are unchanged. Lower the "
            "learning rate, clip gradients, or train under torch.amp.GradScaler, which skips "
            "such steps on every rank together."
        )


class CompressedOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer so that ``step()`` averages compressed gradients over
    the ranks of a process group before the wrapped optimizer steps.

    Use it instead of ``DistributedDataParallel`` (not on top of it): build the same model on
    every rank, wrap its optimizer, and train as usual. Inside ``step()`` each rank packs its
    gradients into flat float32 buckets, adds its error-feedback residual, compresses, keeps
    what it did not send as the new residual, exchanges messages, and writes the average into
    ``p.grad``; then the wrapped optimizer steps. ``param_groups`` is the wrapped optimizer's
    own list, so learning-rate schedulers, ``zero_grad`` and ``torch.amp.GradScaler`` work
    as usual.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        compressor: ``Dense()``, ``Cast(torch.float16)``, ``Cast(torch.bfloat16)``,
            ``Threshold(t)`` or ``TopK(density)``.
        error_feedback: keep what was not sent and add it to the next step's gradient
            (default True). Without it, unsent gradient is dropped.
        process_group: the group to average over; ``None`` for the default group. Without
            an initialized process group everything runs locally.
        bucket_cap_mb: largest bucket, in MiB of float32 (default 25).
        min_compress_numel: parameters with fewer elements travel dense, uncompressed, in
            buckets of their own (default 1024: biases and norms are cheap to send whole,
            and a sparse index costs as much as a value).
        profile: time compression, communication and aggregation in ``last_stats``
            (synchronizes the device, so off by default).

    Example:
        >>> model = torch.nn.Linear(64, 64)
        >>> opt = sparsecomm.CompressedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...     compressor=sparsecomm.TopK(density=0.01))
        >>> model(torch.randn(8, 64)).sum().backward()
        >>> opt.step(); opt.zero_grad()

    Warning:
        Construction, ``step()`` and ``add_param_group()`` are collective: every rank of the
        group must call them, in the same order. ``state_dict()`` is per rank (residuals
        differ by rank): save one file per rank.
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
        bucket_cap_mb: float = 25,
        min_compress_numel: int = 1024,
        profile: bool = False,
        **unexpected: Any,
    ):
        _check_arguments(
            optimizer, compressor, error_feedback, bucket_cap_mb, min_compress_numel, unexpected
        )
        self.optimizer = optimizer
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        self.bucket_cap_mb = bucket_cap_mb
        self.min_compress_numel = int(min_compress_numel)
        self.profile = bool(profile)
        self._comm = Communicator(process_group)
        self._ready = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share, not copy: a scheduler that changes a learning rate here changes it there.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._ready = True

        self._params = self._all_params()
        self._agree_on_model(self._params, start=0)
        for param in self._params:
            self._comm.broadcast_from_first_(param.data)
        self._buckets = self._build_buckets()
        self.last_stats = StepStats()
        self.total_stats = StepStats()

    # ------------------------------------------------------------------ public API

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

    def residual(self, param: torch.Tensor) -> torch.Tensor:
        """What ``param``'s gradient has not sent yet: a float32 tensor shaped like ``param``
        (a copy; zeros when the parameter keeps no residual)."""
        for bucket in self._buckets:
            for _, member, span in bucket.slices():
                if member is param:
                    if bucket.residual is None:
                        return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                    return bucket.residual[span].view(param.shape).clone()
        raise ValueError(
            "residual(param): this tensor is not a parameter of the wrapped optimizer (or "
            "does not require grad); pass one of the tensors in opt.param_groups"
        )

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Average the gradients over all ranks, compressed, then step the wrapped optimizer.

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
        found_inf = self._unscale(grad_scaler) if grad_scaler is not None else []

        self._comm.timed, self._comm.seconds = self.profile, 0.0
        grads = [bucket.gather_grads() for bucket in self._buckets]
        bad_ranks, used = self._agree_on_step(grads)
        agreement_seconds = self._comm.seconds
        stats = StepStats(steps=1, elements=sum(b.numel for b in self._buckets))
        stats.dense_bytes = DENSE_ELEMENT_BYTES * stats.elements
        for flag in found_inf:
            flag.fill_(1.0 if bad_ranks else 0.0)
        if bad_ranks:
            if grad_scaler is None:
                raise NonFiniteGradientError(bad_ranks)
            stats.skipped_steps = 1
            self._record(stats)
            return loss

        for bucket, grad in zip(self._buckets, grads):
            self._exchange_bucket(bucket, grad, used, stats)
        stats.communicate_seconds = self._comm.seconds
        stats.aggregate_seconds -= self._comm.seconds - agreement_seconds
        self._record(stats)
        self.optimizer.step()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the wrapped optimizer (collective: every rank must call
        it with the same parameters). Residuals of the existing parameters are kept."""
        if not self._ready:  # called by torch.optim.Optimizer.__init__ for existing groups
            super().add_param_group(param_group)
            return
        start = len(self._params)
        self.optimizer.add_param_group(param_group)
        self._params = self._all_params()
        self._agree_on_model(self._params[start:], start=start)
        for param in self._params[start:]:
            self._comm.broadcast_from_first_(param.data)
        residuals = self._residuals_by_position()
        self._buckets = self._build_buckets()
        self._load_residuals(residuals)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and this rank's residuals, as tensors and plain
        values only (``torch.load(..., weights_only=True)`` reads it back). Per rank: save
        one file per rank."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "sparsecomm": {
                "format": _STATE_FORMAT,
                "world_size": self.world_size,
                "rank": self.rank,
                "compressor": self.compressor.config(),
                "error_feedback": self.error_feedback,
                "shapes": [list(p.shape) for p in self._params],
                "residuals": self._residuals_by_position(),
                "total_stats": self.total_stats.as_dict(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` saved by this rank. Raises ``ValueError`` if it was saved
        with another world size, by another rank, or for other parameters."""
        if not isinstance(state_dict, dict) or "sparsecomm" not in state_dict:
            raise ValueError(
                "load_state_dict: this is not a CompressedOptimizer.state_dict() (no "
                "'sparsecomm' section); to load a plain optimizer's state, call "
                "opt.optimizer.load_state_dict(state_dict)"
            )
        ours = state_dict["sparsecomm"]
        if ours.get("format") != _STATE_FORMAT:
            raise ValueError(f"load_state_dict: unknown state format {ours.get('format')!r}")
        if ours["world_size"] != self.world_size:
            raise ValueError(
                f"load_state_dict: saved with world_size={ours['world_size']}, loading with "
                f"world_size={self.world_size}. Residuals belong to ranks, so this checkpoint "
                "resumes only on the same world size; to continue on another one without "
                "residuals, call opt.optimizer.load_state_dict(state_dict['optimizer'])"
            )
        if ours["rank"] != self.rank:
            raise ValueError(
                f"load_state_dict: saved by rank {ours['rank']}, loading on rank {self.rank}; "
                "each rank must load the file it saved"
            )
        shapes = [list(p.shape) for p in self._params]
        if ours["shapes"] != shapes:
            raise ValueError("load_state_dict: " + _first_difference(ours["shapes"], shapes))
        self.optimizer.load_state_dict(state_dict["optimizer"])
        # torch.optim.Optimizer.load_state_dict builds new group and state containers.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self._load_residuals(ours["residuals"])
        self.total_stats = StepStats(
            **{k: v for k, v in ours.get("total_stats", {}).items() if k != "density"}
        )

    def __repr__(self) -> str:
        return (
            f"CompressedOptimizer({self.optimizer.__class__.__name__}, "
            f"compressor={self.compressor!r}, error_feedback={self.error_feedback}, "
            f"world_size={self.world_size}, buckets={len(self._buckets)})"
        )

    # ------------------------------------------------------------------ internals

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _build_buckets(self) -> list[Bucket]:
        return build_buckets(
            self._params,
            cap_numel=max(1, int(self.bucket_cap_mb * 2**20) // DENSE_ELEMENT_BYTES),
            min_compress_numel=self.min_compress_numel,
            keep_residual=self.error_feedback and self.compressor.keeps_residual,
        )

    def _residuals_by_position(self) -> list[torch.Tensor | None]:
        residuals: list[torch.Tensor | None] = [None] * len(self._params)
        for bucket in self._buckets:
            if bucket.residual is None:
                continue
            for position, param, span in bucket.slices():
                residuals[position] = bucket.residual[span].view(param.shape).clone()
        return residuals

    def _load_residuals(self, residuals: list[torch.Tensor | None]) -> None:
        for bucket in self._buckets:
            if bucket.residual is None:
                continue
            for position, _, span in bucket.slices():
                saved = residuals[position] if position < len(residuals) else None
                if saved is None:
                    bucket.residual[span].zero_()
                else:
                    bucket.residual[span].copy_(saved.reshape(-1))

    def _agree_on_model(self, params: list[torch.Tensor], start: int) -> None:
        """Check that every rank wraps the same parameters and settings; raise the same
        ValueError on every rank if not."""
        for offset, param in enumerate(params):
            if not param.is_floating_point() or param.dtype == torch.float64:
                raise TypeError(
                    f"parameter {start + offset} has dtype {param.dtype}; sparsecomm "
                    "exchanges float32, float16 and bfloat16 parameters only"
                )
        mine = {
            "settings": [
                self.compressor.config(),
                self.error_feedback,
                self.bucket_cap_mb,
                self.min_compress_numel,
            ],
            "params": [
                [list(p.shape), str(p.dtype), p.requires_grad, p.device.type] for p in params
            ],
        }
        everyone = self._comm.all_gather_object(mine)
        first = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs["settings"] != first["settings"]:
                raise ValueError(
                    f"ranks disagree on settings: rank 0 has {first['settings']}, rank {rank} "
                    f"has {theirs['settings']} ([compressor, error_feedback, bucket_cap_mb, "
                    "min_compress_numel]); construct CompressedOptimizer with the same "
                    "arguments on every rank"
                )
            if theirs["params"] != first["params"]:
                detail = _first_difference(first["params"], theirs["params"], start, rank)
                raise ValueError(
                    f"ranks wrap different parameters: {detail}. Every rank must build the "
                    "same model and pass its parameters in the same order"
                )

    def _agree_on_step(self, grads: list[torch.Tensor]) -> tuple[list[int], list[bool]]:
        """One small all-reduce: which ranks saw a non-finite gradient, and which parameters
        had a gradient on some rank. Every rank gets the same answer."""
        world_size = self.world_size
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        flags = torch.zeros(world_size + len(self._params), device=device)
        if grads:
            finite = torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all()
            flags[self.rank] = (~finite).float()
        has_grad = [p.grad is not None for p in self._params]
        flags[world_size:] = torch.tensor(has_grad, dtype=torch.float32).to(device)
        flags = self._comm.all_reduce_(flags, op="max").tolist()
        bad_ranks = [r for r in range(world_size) if flags[r] > 0]
        used = [f > 0 for f in flags[world_size:]]
        return bad_ranks, used

    def _unscale(self, grad_scaler) -> list[torch.Tensor]:
        """Unscale the gradients with ``grad_scaler`` (unless the user already did) and return
        its per-device found-inf flags, which step() then sets to the all-rank verdict."""
        state = grad_scaler._per_optimizer_states[id(self)]
        if not state["found_inf_per_device"]:
            grad_scaler.unscale_(self)
        return list(state["found_inf_per_device"].values())

    def _exchange_bucket(
        self, bucket: Bucket, grad: torch.Tensor, used: list[bool], stats: StepStats
    ) -> None:
        compressor = self.compressor if bucket.compressed else _DENSE
        # Residual slices of parameters nobody had a gradient for are put back afterwards:
        # their average is discarded (grad stays None), so what they sent must not be lost.
        unused = [
            (span, bucket.residual[span].clone())
            for position, _, span in bucket.slices()
            if not used[position] and bucket.residual is not None
        ]
        started = self._clock()
        message = compressor.compress(grad, bucket.residual, self.world_size)
        compressed = self._clock()
        average = compressor.exchange(message, self._comm)
        exchanged = self._clock()
        for span, saved in unused:
            bucket.residual[span].copy_(saved)
        bucket.scatter_grads(average, used)

        stats.bytes_sent += message.wire_bytes
        stats.elements_sent += bucket.numel if message.indices is None else message.known_count()
        stats.compress_seconds += compressed - started
        stats.aggregate_seconds += exchanged - compressed  # step() takes the collectives out

    def _clock(self) -> float:
        if not self.profile:
            return 0.0
        if self._buckets and self._buckets[0].device.type == "cuda":
            torch.cuda.synchronize(self._buckets[0].device)
        return time.perf_counter()

    def _record(self, stats: StepStats) -> None:
        self.last_stats = stats
        self.total_stats = self.total_stats + stats


_DENSE = Dense()


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


def _describe(entry) -> str:
    if isinstance(entry, list) and entry and isinstance(entry[0], list):
        shape, dtype, requires_grad, device = entry
        grad = "" if requires_grad else ", requires_grad=False"
        return f"{dtype.replace('torch.', '')} {tuple(shape)} on {device}{grad}"
    return f"shape {tuple(entry)}"


def _check_arguments(
    optimizer, compressor, error_feedback, bucket_cap_mb, min_compress_numel, unexpected
) -> None:
    """Raise TypeError/ValueError for bad constructor arguments, naming the fix."""
    for name in unexpected:
        close = difflib.get_close_matches(name, _KEYWORDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(
            f"CompressedOptimizer got an unexpected keyword argument {name!r}; {hint}"
            f"valid keywords are {', '.join(_KEYWORDS)}"
        )
    if isinstance(optimizer, CompressedOptimizer):
        raise TypeError(
            "optimizer is already a CompressedOptimizer; wrap the plain torch.optim optimizer once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressor must be a sparsecomm compressor, got {compressor!r}; use "
            "sparsecomm.Dense(), Cast(torch.float16), Cast(torch.bfloat16), Threshold(t) or "
            "TopK(density)"
        )
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be True or False, got {error_feedback!r}")
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not bucket_cap_mb > 0
    ):
        raise ValueError(
            f"bucket_cap_mb must be a number > 0 (MiB of float32 per bucket), got "
            f"{bucket_cap_mb!r}; the default is 25"
        )
    if (
        isinstance(min_compress_numel, bool)
        or not isinstance(min_compress_numel, int)
        or min_compress_numel < 0
    ):
        raise ValueError(
            f"min_compress_numel must be an int >= 0, got {min_compress_numel!r}; 0 "
            "compresses every parameter, the default 1024 sends small ones dense"
        )
