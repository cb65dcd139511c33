"""The four compressors: what each rank sends for one flat float32 bucket, and how the W
messages become the averaged gradient.

Each compressor does three things, called once per bucket and step by the bucket engine
behind both front doors (:class:`sparsecomm.CompressedOptimizer` and
:func:`sparsecomm.ddp_comm_hook`):

- ``compress(grad, residual, world_size)``: local. Adds the error-feedback residual, picks
  what to send, and leaves in ``residual`` exactly what was not sent.
- ``start(message, comm)``: collective, asynchronous. Starts sending the message and
  receiving everyone's; returns an :class:`Exchange` in flight.
- ``finish(exchange, out)``: waits for it and writes ``(1 / W) * sum_r decode(message_r)``
  into ``out``, added in rank order so that every rank computes the same bits.

``exchange(message, comm)`` does the last two at once.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from . import _ops
from ._comm import Communicator
from .triton_kernels import adam_score as _adam_score

__all__ = ["Compressor", "Dense", "Cast", "Threshold", "TopK"]

# Bytes on the wire per element of a dense fp32 message (a sparse pair: _Sparse.pair_bytes).
DENSE_ELEMENT_BYTES = 4

# The dtypes a sparse message's values may travel in (TopK(..., value_dtype=...)).
VALUE_DTYPES = (torch.float32, torch.bfloat16)


def _round_values(message: Message, residual: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Make ``message.values`` what ``dtype`` carries, in place, and put what the rounding
    took off into ``residual`` at the sent positions (where the compressor left zeros), so
    that sent + residual is still ``grad + residual`` bit for bit (``round_pairs_ref``
    in ``triton_kernels/cast.py``: clamped to ``dtype``'s largest, NaN and Inf as they
    are). Elementwise over the ``count`` pairs: no host synchronisation."""
    count = message.values.numel() if message.count is None else message.count
    _ops.round_pairs(message.values[:count], message.indices[:count], residual, dtype)
    message.rounded = True
    message.known_peak = None  # (taken before the rounding, which may raise a magnitude)


@dataclass
class Message:
    """What one rank sends for one bucket.

    Dense messages (``indices is None``) carry ``values`` for every element, pre-multiplied
    by ``scale``. Sparse messages carry ``count`` (index, value) pairs; ``count_tensor`` is
    the same count on the device when a kernel produced it without a host sync.
    """

    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    count: int | None = None
    count_tensor: torch.Tensor | None = None
    scale: float = 1.0
    #: Bytes this rank put into the collectives for this message, set by ``exchange``.
    wire_bytes: int = 0
    #: :meth:`peak`, when it was computed with the message (inside a CUDA graph).
    known_peak: torch.Tensor | None = None
    #: Whether the values are already as a 16-bit ``value_dtype`` carries them
    #: (:meth:`Compressor.round_message`).
    rounded: bool = False

    def decode(self) -> torch.Tensor:
        """The float32 gradient this message stands for (what this rank sent)."""
        if self.indices is None:
            return self.values.float() * (1.0 / self.scale)
        count = self.known_count()
        dense = torch.zeros(self.numel, dtype=torch.float32, device=self.values.device)
        dense[self.indices[:count].long()] = self.values[:count]
        return dense

    def known_count(self) -> int:
        if self.count is None:
            self.count = int(self.count_tensor.item())
        return self.count

    def peak(self, world_size: int) -> torch.Tensor:
        """A 0-dim float32 device tensor (no host sync): the largest magnitude this message
        sends, as a fraction of :func:`sum_limit` (how large the magnitudes of
        ``world_size`` values may add up to for their sum to stay finite). NaN or Inf when
        the message carries one.

        Every compressor sends a non-finite value whenever ``grad + residual`` holds one
        (TopK and Threshold select NaN and Inf first; Cast and Dense send everything), so
        this check of what is sent covers what is kept too. If the peaks of all ranks add
        up to more than 1, the sum over the ranks could overflow."""
        if self.known_peak is not None:
            return self.known_peak
        values = self.values if self.indices is None else self.values[: self.known_count()]
        if values.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=values.device)
        peak = _max_magnitude(values)
        # A divide, not a multiply: 1 / 3.4e38 would be a float32 subnormal.
        return peak.div_(sum_limit(values.dtype, world_size))


def _max_magnitude(values: torch.Tensor) -> torch.Tensor:
    """``max(|values|)`` as a 0-dim float32 tensor; NaN if any value is NaN."""
    if values.is_cuda:
        # One pass (NaN propagates), then the divide: two launches.
        return torch.linalg.vector_norm(values, ord=math.inf, dtype=torch.float32)
    # On a CPU the infinity norm is a scalar loop (6.5e6 float32: 20 ms on a 2-core AMD
    # EPYC, where aminmax takes 1.4 ms); min and max give the same value, NaN included
    # (and +0.0 for a message of -0.0, as the norm gives).
    low, high = torch.aminmax(values)
    return torch.maximum(high.abs(), low.abs()).to(torch.float32)


def sum_limit(dtype: torch.dtype, world_size: int) -> float:
    """The largest ``B`` such that any ``world_size`` values of ``dtype`` whose magnitudes
    add up to at most ``B`` sum to a finite value, however the collective orders and
    rounds the additions: ``max * (1 + u) ** (2 - W)`` with ``u`` the unit roundoff (a
    sum of W terms is rounded W - 1 times, each by at most a factor ``1 + u``, and
    overflows only past ``max * (1 + u)``), less 2**-20 for the rounding of the peaks
    themselves."""
    finfo = torch.finfo(dtype)
    unit_roundoff = finfo.eps / 2
    return finfo.max * (1 + unit_roundoff) ** min(0, 2 - world_size) * (1 - 2.0**-20)


@dataclass
class Exchange:
    """One bucket's message in flight: the collectives started by ``Compressor.start``.

    Attributes:
        message: what this rank sent.
        work: handle of the collective still running (``None`` once it is done).
        result: the buffer the collective fills: the all-reduced values, or the
            all-gathered ``[world_size, 2 * width]`` int32 payload of pairs (None on one
            rank, where the message is its own result).
        counts: pairs per rank (sparse messages), ``None`` when fixed or dense.
        width: pairs per rank in the gathered payload (0 for a dense exchange).
        peak: :meth:`Message.peak` of this rank's message (None when not checked).
        peak_limit: what ``peak`` is a fraction of, in the units of the average times the
            world size: :func:`sum_limit` of the dtype it was measured in, over the
            message's ``scale`` (the ranks' peaks summed, times this, bound the magnitude of
            the sum the average divides by the world size). None: float32's, unscaled, as
            for every sparse message.
    """

    message: Message
    work: object
    result: torch.Tensor
    comm: Communicator
    counts: list[int] | None = None
    width: int = 0
    peak: torch.Tensor | None = None
    #: True when the exchange is an all-reduce of dense values (also a sparse message
    #: that switched to dense because that moves fewer bytes).
    dense: bool = False
    peak_limit: float | None = None


class Compressor:
    """Base class of the compressors; not used directly."""

    #: Whether the compressor leaves anything unsent (so error feedback has work to do).
    keeps_residual = True
    #: Whether it chooses what to send by the wrapped Adam's scale (``TopK(select="adam")``):
    #: the engine then scores each bucket and calls ``compress_scored``.
    selects_by_adam = False
    #: ``CompressedOptimizer``'s bucket size (MiB of float32) when ``bucket_cap_mb`` is not
    #: given: DDP's 25 for the compressors that send every element, larger for the sparse
    #: ones (see ``docs/buckets.md``).
    default_bucket_cap_mb = 25.0
    #: With ``bucket_cap_mb`` not given, at most about this many buckets (None: no bound):
    #: a model too large for that many buckets of ``default_bucket_cap_mb`` gets larger
    #: ones, as each bucket costs the host a fixed time per step (see ``docs/buckets.md``).
    default_max_buckets: int | None = None

    def compress(
        self, grad: torch.Tensor, residual: torch.Tensor | None, world_size: int
    ) -> Message:
        raise NotImplementedError

    def compress_accumulated(self, acc: torch.Tensor, world_size: int) -> Message:
        """``compress(grad, residual, world_size)`` where ``acc`` already holds ``grad +
        residual``: the new residual is left in ``acc``, with the bits ``compress`` would
        leave in ``residual``. Optional: see :meth:`compresses_accumulated`."""
        raise NotImplementedError

    def compresses_accumulated(self) -> bool:
        """Whether :meth:`compress_accumulated` stands for this compressor's ``compress``:
        where it is defined in the class of the ``compress`` in use or below it (a subclass
        that overrides ``compress`` alone is taken at its word). The bucket engine then adds
        each gradient into its CPU bucket as it arrives instead of copying it there."""

        def owner(name: str) -> type:
            return next(c for c in type(self).__mro__ if name in vars(c))

        accumulated = owner("compress_accumulated")
        return accumulated is not Compressor and issubclass(accumulated, owner("compress"))

    def round_message(self, message: Message, residual: torch.Tensor | None) -> None:
        """Make the message's values what the wire carries, what that takes off going into
        ``residual`` (the tensor ``compress`` left the new residual in; None: no error
        feedback). Only :class:`TopK` with ``value_dtype=torch.bfloat16`` rounds; its
        ``compress`` does it itself except when given ``addresses`` (a CUDA graph's buffers
        may have moved since its capture, so the caller, who knows where they are now,
        rounds after the replay). Idempotent: a message already rounded is left alone."""

    def start(self, message: Message, comm: Communicator, check: bool = True) -> Exchange:
        """Start the collectives. ``check``: also measure the message's peak
        (``Exchange.peak``, which flags NaN, Inf and sums that could overflow); without
        it the peak is None."""
        raise NotImplementedError

    def finish(
        self, exchange: Exchange, out: torch.Tensor, skip: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Wait for the collectives and write the average into ``out``. ``skip``: a
        one-element bool device tensor; where it holds True nothing is written to ``out``
        (decided on the device, so that the engine can queue the averages before the host
        knows whether the step is refused)."""
        raise NotImplementedError

    def exchange(self, message: Message, comm: Communicator) -> torch.Tensor:
        """``start`` then ``finish`` into a new float32 tensor: the averaged gradient."""
        pending = self.start(message, comm)
        out = torch.empty(message.numel, dtype=torch.float32, device=message.values.device)
        return self.finish(pending, out)

    def at_step(self, step: int) -> Compressor:
        """The compressor to use at 0-based ``step`` (``self`` unless it follows a
        schedule, as a warmed-up :class:`TopK` does). A pure function of the step."""
        return self

    def config(self) -> dict:
        """Plain-value description, compared across ranks and stored in checkpoints."""
        return {"name": type(self).__name__}

    def matches(self, saved: Any) -> bool:
        """Is ``saved``, a :meth:`config` stored in a checkpoint (perhaps by an earlier
        release), this compressor's?"""
        return saved == self.config()

    def graph_signature(self, numel: int) -> tuple | None:
        """What fixes the shapes and kernels of ``compress`` on a bucket of ``numel``
        elements, when it can be captured in a CUDA graph (no host synchronisation, no
        size that depends on the data); None when it cannot. A compressor that returns a
        signature takes ``compress(..., addresses=table)``: its kernels then read where
        ``grad``, ``residual`` (and ``out``) are from that int64 device tensor when they
        run, so that one graph serves the bucket whatever buffers it has this step."""
        return None

    def wire_buffer(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """A new buffer that ``compress(..., out=buffer)`` writes the bucket's message
        into, for compressors whose message is as large as the bucket (a graph replayed
        on it finds it through ``addresses``); None for the others."""
        return None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))


def average_scale(world_size: int) -> float:
    """The factor that turns a sum over ranks into their mean (the same float everywhere)."""
    return 1.0 / world_size


def _start_all_reduce(
    dense: torch.Tensor, comm: Communicator, message: Message, check: bool
) -> Exchange:
    """Check ``dense`` (what this rank sends) and start summing it in place over the ranks."""
    message.wire_bytes = dense.numel() * dense.element_size()
    # Before the sum overwrites this rank's values. A message's own values may have their
    # peak measured already (inside the CUDA graph that compressed them).
    peak = None
    own = dense is message.values
    if check:
        peak = message.peak(comm.world_size) if own else _peak(dense, comm.world_size)
    limit = None  # (float32 values, unscaled: a sparse message's, decoded)
    if own and (dense.dtype != torch.float32 or message.scale != 1.0):
        limit = sum_limit(dense.dtype, comm.world_size) / message.scale
    work = comm.start_all_reduce_(dense)
    return Exchange(message, work, dense, comm, peak=peak, dense=True, peak_limit=limit)


def _peak(dense: torch.Tensor, world_size: int) -> torch.Tensor:
    return Message(numel=dense.numel(), values=dense).peak(world_size)


def _finish_mean(
    exchange: Exchange, out: torch.Tensor, skip: torch.Tensor | None, factor: float
) -> torch.Tensor:
    """``out = sum * factor`` of a started all-reduce (``out`` may be the summed buffer),
    or, where ``skip`` holds True, ``out`` as it was."""
    exchange.comm.wait(exchange.work)
    result = exchange.result
    if skip is None:
        if factor != 1.0 and result.dtype == out.dtype:
            return torch.mul(result, factor, out=out)
        if out is not result:  # (a half result is widened first: the multiply is in fp32)
            out.copy_(result)
        return out if factor == 1.0 else out.mul_(factor)  # x * 1.0 is x: skip the pass
    if out is not result:
        torch.where(skip, out, result, out=out)
    if factor != 1.0:  # skipped: times 1.0, the same bits (a NaN may become canonical)
        out.mul_(torch.where(skip, 1.0, factor))
    return out


class Dense(Compressor):
    """Send the full float32 bucket with an all-reduce: plain data parallelism.

    SINGA: ``fusedSynch`` / ``synch``. Nothing is left unsent, so there is no residual.

    Example:
        >>> sparsecomm.Dense()
        Dense()
    """

    keeps_residual = False

    def compress(self, grad, residual, world_size):
        return Message(numel=grad.numel(), values=grad)

    def start(self, message, comm, check=True):
        return _start_all_reduce(message.values, comm, message, check)

    def finish(self, exchange, out, skip=None):
        return _finish_mean(exchange, out, skip, average_scale(exchange.comm.world_size))


class Cast(Compressor):
    """Send the bucket as fp16 or bf16 with an all-reduce; the rounding error is the residual.

    Each rank divides by the power of two at or above the world size before the cast and
    clamps to :meth:`limit`, about ``max / W``, so a sum of W casts cannot overflow; the
    clamp cuts only values beyond about the half type's range (before the prescale), and
    the excess stays in the residual. SINGA: ``fusedSynchHalf`` / ``synchHalf``, which
    drop the rounding error.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Example:
        >>> sparsecomm.Cast(torch.bfloat16)
        Cast(dtype=torch.bfloat16)
    """

    def __init__(self, dtype: torch.dtype = torch.float16):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"Cast(dtype=...) takes a torch.dtype, got {dtype!r} of type "
                f"{type(dtype).__name__}; use Cast(torch.float16) or Cast(torch.bfloat16)"
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"Cast(dtype={dtype}) is not supported: dtype must be torch.float16 or "
                "torch.bfloat16; for float32 use Dense(), for fewer bytes use TopK(density)"
            )
        self.dtype = dtype

    def config(self):
        return {"name": "Cast", "dtype": str(self.dtype)}

    def __repr__(self):
        return f"Cast(dtype={self.dtype})"

    @staticmethod
    def prescale(world_size: int) -> float:
        return 2.0 ** -math.ceil(math.log2(world_size)) if world_size > 1 else 1.0

    def limit(self, world_size: int) -> float:
        """The clamp, after the prescale: the largest value of the half type that
        ``world_size`` ranks can each send without their sum overflowing (at least
        ``max / world_size``, so at least the type's range before the prescale)."""
        return _cast_limit(self.dtype, world_size)

    def graph_signature(self, numel):
        return ("Cast", str(self.dtype))

    def wire_buffer(self, numel, device):
        return torch.empty(numel, dtype=self.dtype, device=device)

    def compress(self, grad, residual, world_size, out=None, addresses=None):
        scale = self.prescale(world_size)
        limit = self.limit(world_size)
        half = _ops.cast_compress(grad, residual, self.dtype, scale, limit, out, addresses)
        return Message(numel=grad.numel(), values=half, scale=scale)

    def start(self, message, comm, check=True):
        return _start_all_reduce(message.values, comm, message, check)

    def finish(self, exchange, out, skip=None):
        # sum_r half_r / scale / W, as one float factor so every rank rounds alike.
        factor = 1.0 / (exchange.message.scale * exchange.comm.world_size)
        return _finish_mean(exchange, out, skip, factor)


@functools.lru_cache(maxsize=64)
def _cast_limit(dtype: torch.dtype, world_size: int) -> float:
    if world_size == 1:  # nothing is summed
        return torch.finfo(dtype).max
    bound = sum_limit(dtype, world_size) / world_size
    mantissa, exponent = math.frexp(bound)  # bound = mantissa * 2**exponent
    bits = -int(math.log2(torch.finfo(dtype).eps)) + 1  # significand bits
    return math.floor(mantissa * 2**bits) * 2.0 ** (exponent - bits)


def _require_real(value, where: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where} takes a float, got {value!r} of type {type(value).__name__}; "
            f"for example {example}"
        )


class _Sparse(Compressor):
    """Shared exchange of (index, value) messages: all-gather, then deterministic sum."""

    # A 100 MiB bucket sends about what a 2 MiB dense one would at 1% density; fewer
    # buckets cost fewer launches and less host time per step (docs/buckets.md).
    default_bucket_cap_mb = 100.0
    # A 1e9-parameter model in 100 MiB buckets is 60 of them, ~0.5 ms of host time each: the
    # GPU then waits on the host (docs/buckets.md). Sixteen sparse buckets still overlap.
    default_max_buckets = 16

    #: The dtype the values travel in (TopK's ``values``); float32 for Threshold.
    value_dtype = torch.float32

    @property
    def pair_bytes(self) -> int:
        """Bytes on the wire per (index, value) pair: 8, or 6 with bfloat16 values."""
        return 4 + self.value_dtype.itemsize

    def start(self, message, comm, check=True):
        world_size, numel = comm.world_size, message.numel
        if world_size == 1:  # nothing to send: finish() reads the message itself
            count = message.known_count()
            message.wire_bytes = count * self.pair_bytes
            return Exchange(
                message, None, None, comm, width=count,
                peak=message.peak(world_size) if check else None,
            )  # fmt: skip
        counts = self._gather_counts(message, comm)
        width = max(counts)
        # An all-gather of `width` pairs from each rank moves (W-1) * width * pair_bytes
        # bytes per rank; a ring all-reduce of the dense bucket 2 (W-1) / W * 4 * numel.
        # All ranks know every count, so they all switch to dense together.
        if width * world_size * self.pair_bytes >= 2 * DENSE_ELEMENT_BYTES * numel:
            return _start_all_reduce(message.decode(), comm, message, check)
        if message.known_count() == width and self.value_dtype == torch.float32:
            payload = torch.cat([message.indices[:width], message.values[:width].view(torch.int32)])
        else:
            payload = _pad_pairs(message, width, self.value_dtype)
        message.wire_bytes = width * self.pair_bytes
        gathered, work = comm.start_all_gather(payload)
        fixed = all(c == width for c in counts)
        return Exchange(
            message, work, gathered, comm, counts=None if fixed else counts, width=width,
            peak=message.peak(world_size) if check else None,
        )  # fmt: skip

    def finish(self, exchange, out, skip=None):
        if exchange.dense:  # switched to a dense all-reduce
            return _finish_mean(exchange, out, skip, average_scale(exchange.comm.world_size))
        exchange.comm.wait(exchange.work)
        width, gathered = exchange.width, exchange.result
        if gathered is None:
            indices = exchange.message.indices[:width].unsqueeze(0)
            values = exchange.message.values[:width].unsqueeze(0)
        else:
            indices = gathered[:, :width].contiguous()
            values = gathered[:, width:].contiguous().view(self.value_dtype)[:, :width].float()
        world_size = exchange.comm.world_size
        return _ops.scatter_add(
            indices, values, exchange.counts, exchange.message.numel,
            average_scale(world_size), out=out, skip=skip,
        )  # fmt: skip

    def average_peak(self, exchange: Exchange, out: torch.Tensor) -> torch.Tensor:
        """0-dim float32 device tensor, no host sync: the largest magnitude of the average
        that :meth:`finish` wrote into ``out``, NaN or Inf where it holds one (a rank sent
        one, or a sum overflowed). Reads ``out`` only where the ranks' pairs landed (it is
        0 elsewhere), or all of it after a dense all-reduce."""
        if exchange.dense:
            landed = out
        else:
            pairs = exchange.message.indices.unsqueeze(0)
            if exchange.result is not None:
                pairs = exchange.result  # [world_size, indices then values]
            landed = out[pairs[:, : exchange.width].reshape(-1).long()]
        if landed.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=out.device)
        return _max_magnitude(landed)

    def _gather_counts(self, message: Message, comm: Communicator) -> list[int]:
        raise NotImplementedError


def _pad_pairs(message: Message, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 words: this rank's ``width`` indices, then its values in ``dtype`` (bfloat16:
    two a word, the last word half padding for an odd ``width``), each zero-padded from its
    count to ``width``."""
    count = message.known_count()
    value_words = -(-width * dtype.itemsize // 4)
    payload = torch.zeros(width + value_words, dtype=torch.int32, device=message.values.device)
    payload[:count] = message.indices[:count]
    payload[width:].view(dtype)[:count] = message.values[:count]
    return payload


class Threshold(_Sparse):
    """Send every element whose magnitude (gradient plus residual) is at least ``threshold``.

    The number sent varies by rank and step: counts are all-gathered first, then the
    pairs, padded to the largest count. SINGA: ``valSparsAllReduce``.

    Args:
        threshold: a finite float ``>= 0``. ``Threshold(0.0)`` sends everything.

    Example:
        >>> sparsecomm.Threshold(1e-3)
        Threshold(threshold=0.001)
    """

    def __init__(self, threshold: float):
        _require_real(threshold, "Threshold(threshold=...)", "Threshold(1e-3)")
        if not (math.isfinite(threshold) and threshold >= 0):
            raise ValueError(
                f"Threshold(threshold={threshold}) is invalid: the threshold must be a finite "
                "number >= 0 (elements with abs(gradient + residual) >= threshold are sent); "
                "for example Threshold(1e-3)"
            )
        self.threshold = float(threshold)

    def config(self):
        return {"name": "Threshold", "threshold": self.threshold}

    def compress(self, grad, residual, world_size):
        indices, values, count = _ops.threshold_compress(grad, residual, self.threshold)
        return Message(numel=grad.numel(), values=values, indices=indices, count_tensor=count)

    def compress_accumulated(self, acc, world_size):
        indices, values, count = _ops.threshold_compress_accumulated(acc, self.threshold)
        return Message(numel=acc.numel(), values=values, indices=indices, count_tensor=count)

    def _gather_counts(self, message, comm):
        local = message.count_tensor.reshape(1).to(torch.int64)
        counts = comm.all_gather(local).view(-1).tolist()
        message.count = counts[comm.rank]
        return counts


class AdamChoice(Compressor):
    """What ``TopK(select="adam")`` runs on CUDA for one bucket (the bucket engine makes
    it): ``acc = grad + residual`` into ``grad``, the k largest Adam-scaled scores sent and
    zeroed there (``triton_kernels.adam_score.adam_topk``), from a CUDA graph where one
    serves. Not a compressor to pass to the optimizer."""

    def __init__(self, members, k: int):
        self.members = members
        self.k = k

    def config(self):
        return {"name": "AdamChoice", "k": self.k}

    def graph_signature(self, numel):
        return ("AdamChoice", self.k, self.members.signature)

    def compress(self, grad, residual, world_size, addresses=None):
        indices, values = _adam_score.adam_topk(grad, residual, self.members, self.k, addresses)
        # (16-bit values: the engine rounds them, TopK.round_message, after any replay)
        return Message(numel=grad.numel(), values=values, indices=indices, count=self.k)


@functools.lru_cache(maxsize=4096)
def _k_of(density: float, numel: int) -> int:
    """:meth:`TopK.k_for`, cached: a step asks it once per bucket (and a graph signature)."""
    if numel == 0:
        return 0
    exact = Fraction(repr(density)) * numel
    return max(1, min(numel, math.ceil(exact)))


class TopK(_Sparse):
    """Send exactly ``k = ceil(density * numel)`` elements of each bucket: the largest
    magnitudes of gradient plus residual, ties to the lower index.

    SINGA: ``topKSparsAllReduce``, which sorts the whole bucket; sparsecomm selects exactly
    k without a sort.

    A density warm-up makes the first ``warmup_steps`` steps send more. Its shape is
    ``warmup``:

    - ``"exponential"`` (the default shape, as in Deep Gradient Compression, Lin et al.
      2018): the density starts at ``warmup_start`` and falls geometrically, reaching
      ``density`` at step ``warmup_steps``: ``warmup_start * (density /
      warmup_start) ** (step / warmup_steps)``.
    - ``"dense"`` (as 1-bit Adam, Tang et al. 2021, warms up uncompressed): density 1 (the
      whole bucket, sent as a dense all-reduce) for ``warmup_steps`` steps, then
      ``density``.

    The density is a pure function of the step count (:meth:`density_at`), which
    :class:`sparsecomm.CompressedOptimizer` keeps in its ``state_dict``, so every rank
    follows the same schedule without a collective, and a resumed run continues it.

    Which k are sent is ``select``:

    - ``"magnitude"`` (the default): the k largest ``|acc|``, ``acc = grad + residual``.
    - ``"adam"``: the k largest ``|acc| / (sqrt(max(v, mean(v))) + eps)``, ``v`` and
      ``eps`` the wrapped Adam-family optimizer's ``exp_avg_sq`` and ``eps``, ``mean(v)``
      over the coordinate's parameter: the coordinates Adam would move furthest with what
      they hold, measured in Adam's own units (the floor keeps a coordinate whose ``v`` is
      tiny beside its tensor's from jumping the queue). Magnitudes differ by
      orders between layers, while Adam moves every coordinate about ``lr`` a step, so by
      magnitude the small-gradient layers wait longest; by Adam's scale they take their
      turn. The values sent are still ``acc`` as it is (conservation and rank agreement
      are unchanged); only the choice of coordinates differs. Before the optimizer's
      first step (no ``v`` yet) it selects by magnitude. Needs
      :class:`sparsecomm.CompressedOptimizer` around an optimizer that keeps
      ``exp_avg_sq`` (Adam, AdamW, NAdam, RAdam, :class:`sparsecomm.CatchUpAdamW`) with
      ``eps > 0``, and ``exchange="gradients"``. On CUDA the scoring and the choice
      replay from one CUDA graph per bucket (``triton_kernels/adam_score.py``); see
      ``docs/adam_selection.md`` for the definition's details and the measurements.

    The values travel in ``value_dtype``: ``torch.float32`` (the default; 8 bytes a pair
    with the int32 index) or ``torch.bfloat16`` (6 bytes a pair, a quarter fewer). With
    bfloat16 each value is rounded to nearest before it is sent and what the rounding took
    off stays in the residual, so sent plus residual is still exactly ``grad + residual``
    and the rounding error goes out in a later step, as a value that was not chosen does.
    Every rank adds the same rounded values, so the ranks stay identical.

    Args:
        density: the fraction of elements sent, in ``(0, 1]``. ``TopK(1.0)`` sends everything.
        warmup_steps: steps of warm-up (default 0: ``density`` from the first step).
        warmup: the warm-up's shape, ``"exponential"`` or ``"dense"``.
        warmup_start: the density of the first exponential warm-up step, in ``[density,
            1]`` (default 0.25, DGC's first stage); a dense warm-up ignores it.
        select: ``"magnitude"`` or ``"adam"``, as above.
        value_dtype: ``torch.float32`` or ``torch.bfloat16``, as above.

    Example:
        >>> sparsecomm.TopK(density=0.01)
        TopK(density=0.01)
        >>> sparsecomm.TopK(0.001, warmup_steps=100).density_at(50)  # sqrt(0.25 * 0.001)
        0.015811388300841896
    """

    WARMUP_SHAPES = ("exponential", "dense")
    SELECTIONS = ("magnitude", "adam")

    def __init__(
        self,
        density: float,
        *,
        warmup_steps: int = 0,
        warmup: str = "exponential",
        warmup_start: float = 0.25,
        select: str = "magnitude",
        value_dtype: torch.dtype = torch.float32,
    ):
        _require_real(density, "TopK(density=...)", "TopK(density=0.01) sends 1%")
        if not (0 < density <= 1):
            raise ValueError(
                f"TopK(density={density}) is invalid: density is the fraction of elements "
                "sent and must be in (0, 1]; for example TopK(density=0.01) sends 1%"
            )
        if (
            isinstance(warmup_steps, bool)
            or not isinstance(warmup_steps, numbers.Integral)
            or warmup_steps < 0
        ):
            raise ValueError(
                f"TopK(warmup_steps={warmup_steps!r}) is invalid: it must be an int >= 0 (steps "
                "of density warm-up; 0: none)"
            )
        if warmup not in self.WARMUP_SHAPES:
            raise ValueError(
                f"TopK(warmup={warmup!r}) is invalid: the warm-up shape is 'exponential' "
                "(DGC: from warmup_start down to density) or 'dense' (send everything first)"
            )
        _require_real(warmup_start, "TopK(warmup_start=...)", "warmup_start=0.25")
        if warmup_steps and warmup == "exponential" and not (density <= warmup_start <= 1):
            raise ValueError(
                f"TopK(warmup_start={warmup_start}) is invalid: the warm-up starts at a density "
                f"in [density, 1] = [{density}, 1] and decays to density"
            )
        if select not in self.SELECTIONS:
            raise ValueError(
                f"TopK(select={select!r}) is invalid: it is 'magnitude' (the largest "
                "|grad + residual|) or 'adam' (the largest |grad + residual| over the wrapped "
                "Adam's scale, sqrt(exp_avg_sq) + eps)"
            )
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"TopK(value_dtype={value_dtype!r}) is invalid: the values travel as "
                "torch.float32 (8-byte pairs) or torch.bfloat16 (6-byte pairs, the rounding "
                "kept in the residual)"
            )
        self.density = float(density)
        self.select = select
        self.value_dtype = value_dtype
        self.warmup_steps = int(warmup_steps)
        self.warmup = warmup
        self.warmup_start = float(warmup_start)
        self._at: dict[int, TopK] = {}

    def config(self):
        config = {"name": "TopK", "density": self.density}
        if self.select != "magnitude":
            config["select"] = self.select
        if self.value_dtype != torch.float32:
            config["value_dtype"] = str(self.value_dtype).removeprefix("torch.")
        if self.warmup_steps:
            config.update(warmup_steps=self.warmup_steps, warmup=self.warmup)
            if self.warmup == "exponential":  # (a dense warm-up has no use for it)
                config["warmup_start"] = self.warmup_start
        return config

    def matches(self, saved: Any) -> bool:
        # Checkpoints of earlier code keep a dense warm-up's warmup_start, which it ignores.
        if isinstance(saved, dict) and saved.get("warmup") == "dense":
            saved = {k: v for k, v in saved.items() if k != "warmup_start"}
        return super().matches(saved)

    def __repr__(self):
        select = "" if self.select == "magnitude" else f", select={self.select!r}"
        if self.value_dtype != torch.float32:
            select += f", value_dtype={self.value_dtype}"
        if not self.warmup_steps:
            return f"TopK(density={self.density}{select})"
        shape = "warmup='dense'" if self.warmup == "dense" else f"warmup_start={self.warmup_start}"
        return f"TopK(density={self.density}, warmup_steps={self.warmup_steps}, {shape}{select})"

    def density_at(self, step: int) -> float:
        """The density of 0-based ``step`` (``density`` once the warm-up is over)."""
        if step >= self.warmup_steps:
            return self.density
        if self.warmup == "dense":
            return 1.0
        return self.warmup_start * (self.density / self.warmup_start) ** (step / self.warmup_steps)

    def at_step(self, step: int) -> TopK:
        if step >= self.warmup_steps:
            return self
        current = self._at.get(step)
        if current is None:
            if len(self._at) > 64:  # steps only move forward: keep a few
                self._at.clear()
            current = self._at[step] = TopK(
                self.density_at(step), select=self.select, value_dtype=self.value_dtype
            )
        return current

    def k_for(self, numel: int) -> int:
        """``ceil(density * numel)``, with density read as the decimal it was written as
        (so 0.07 of 100 is 7, not 8), and at least 1 (0 of an empty bucket). The
        density after the warm-up; see :meth:`at_step` for a given step's."""
        return _k_of(self.density, numel)

    def graph_signature(self, numel):
        if self.select != "magnitude":  # the engine scores the bucket first, eagerly
            return None
        return ("TopK", self.k_for(numel), self.value_dtype)

    @property
    def selects_by_adam(self) -> bool:
        return self.select == "adam"

    def compress(self, grad, residual, world_size, addresses=None):
        self._by_magnitude_only()
        numel = grad.numel()
        k = self.k_for(numel)
        indices, values = _ops.topk_compress(grad, residual, k, addresses)
        message = Message(numel=numel, values=values, indices=indices, count=k)
        if addresses is None:  # (else the caller rounds: see round_message)
            self.round_message(message, residual)
        return message

    def compress_accumulated(self, acc, world_size):
        self._by_magnitude_only()
        numel = acc.numel()
        k = self.k_for(numel)
        indices, values = _ops.topk_compress_accumulated(acc, k)
        message = Message(numel=numel, values=values, indices=indices, count=k)
        self.round_message(message, acc)
        return message

    def round_message(self, message, residual):
        if self.value_dtype != torch.float32 and not message.rounded:
            _round_values(message, residual, self.value_dtype)

    def _by_magnitude_only(self) -> None:
        if self.select != "magnitude":
            raise ValueError(
                f"{self!r} chooses by the wrapped optimizer's second moment, which compress() "
                "does not see: use it through sparsecomm.CompressedOptimizer, or call "
                "compress_scored(acc, score, world_size) with a score of your own"
            )

    def compress_scored(self, acc: torch.Tensor, score: torch.Tensor, world_size: int) -> Message:
        """:meth:`compress_accumulated`, choosing the k elements by ``score`` (``select=
        "adam"``: ``|acc|`` over Adam's scale, which the bucket engine computes) instead of
        by ``|acc|``: the k largest scores, ties to the lower index, NaN first. The message
        carries ``acc`` at those indices, which are zeroed in ``acc`` (the new residual).
        Every non-finite ``acc`` scores NaN or Inf (the divisor is finite and positive), so
        it is sent, as by magnitude. (On CUDA the engine runs
        ``triton_kernels.adam_score.adam_topk`` instead, which computes the same.)"""
        numel = acc.numel()
        k = self.k_for(numel)
        indices, _ = _ops.topk_compress(score, None, k)
        values = acc.index_select(0, indices)
        _ops.zero_sent(acc, indices)
        message = Message(numel=numel, values=values, indices=indices, count=k)
        self.round_message(message, acc)
        return message

    def _gather_counts(self, message, comm):
        return [message.count] * comm.world_size
