"""The bucket engine: persistent flat float32 buckets that are filled, compressed and sent
while backward runs, and finished (waited for, averaged) when the optimizer steps.

One bucket's life in a step:

1. **fill**: each member parameter's gradient lands in the bucket's ``grad_buffer``. After
   a step an fp32 parameter's ``.grad`` is a view of that buffer, so a backward after
   ``zero_grad(set_to_none=False)`` accumulates straight into it; a gradient that autograd
   allocated anew (after ``zero_grad()``) is copied once: on a CPU as it arrives, on CUDA
   with one foreach copy when the bucket's last gradient has arrived; a bucket of one
   parameter takes autograd's tensor as its buffer instead, with no copy.
   ``CompressedOptimizer.zero_grad(set_to_none=True)`` drops the buffer with the ``.grad``
   views (:meth:`Bucket.release`), and the first fill of the next step allocates a new one,
   so that between steps a bucket holds only its residual, as DDP holds only its buckets
   (a bucket without a residual keeps its one buffer). A CPU bucket of several members
   whose compressor selects from ``grad + residual`` (``TopK``, ``Threshold``) writes that
   sum as each gradient arrives instead of the gradient alone: one pass over memory where
   the copy and the compressor's add made two (:meth:`BucketEngine.accumulate`). CUDA
   graphs of the compression do not mind buffers that move: they read the addresses from
   a table (:class:`CompressGraphs`).
2. **launch**: when the last member is filled and every earlier bucket has launched, the
   bucket is compressed and its collective started (``async_op=True``); optionally
   (:attr:`BucketEngine.side_stream`) on CUDA from a side stream that waits for the
   gradients and then runs beside the rest of backward (:meth:`BucketEngine.join` makes
   the current stream wait for it when backward ends).
   Buckets launch in one fixed order on every rank, whatever order their gradients arrive
   in, so the ranks' collectives always match.
3. **finish**: wait for the collective and write the average.

Error feedback without a copy: the compressors compute ``acc = grad + residual`` and write
what they do not send back into their ``residual`` argument. The engine passes the
buffers the other way round (``compress(grad=residual, residual=grad_buffer)``; float
addition is commutative, so ``acc`` has the same bits), which leaves the old residual
untouched until the step is known to be good: a step refused on every rank (a NaN
somewhere) keeps the old residual exactly. A good step writes the average into the old
residual's buffer, which becomes the next gradient buffer, and the other buffer becomes
the residual: the two swap roles every step.

Momentum correction (Deep Gradient Compression, Lin et al. 2018), when the engine has a
``momentum``: each bucket also keeps a velocity ``u``. At launch the gradient buffer
becomes ``u' = grad + momentum * u`` (a copy goes to the bucket's spare velocity buffer),
and the residual accumulates ``u'`` instead of the gradient. At finish, a sparse message
zeroes ``u'`` where this rank sent (momentum factor masking: a coordinate just sent
starts its momentum afresh) and the two velocity buffers swap, as the residuals do; a
message that sent the whole bucket (a dense or small-parameter bucket, a density-1 step)
keeps ``u'`` whole, which is plain momentum. A refused step leaves ``u`` as it was.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import _ops
from ._comm import Communicator
from .compressors import AdamChoice, Compressor, Dense, Exchange, Message, sum_limit
from .triton_kernels import MAX_NUMEL as MAX_BUCKET_NUMEL  # sparse messages index with int32
from .triton_kernels import _indirect
from .triton_kernels import adam_score as _adam_score

_DENSE = Dense()


@dataclass
class Bucket:
    """Parameters (all on one device) packed into one flat float32 buffer.

    Attributes:
        positions: each member's position in the optimizer's flat parameter list.
        params: the members, in packing order.
        offsets: where each member starts in the flat buffers.
        numel: total elements.
        compressed: False for a bucket of small parameters, which travel dense.
        grad_buffer: float32, the members' gradients (and, after a step, their average).
        residual: float32 error-feedback residual (what was not sent yet), or None when
            the bucket keeps none.
        grad_views, residual_views: per member, its view of ``grad_buffer`` and of
            ``residual``, made once (they swap with the buffers).
        filled: per member, whether its gradient was taken this step (in ``grad_buffer``,
            or in ``to_copy`` / ``to_zero`` until the bucket is complete).
        used: per member, whether it had a gradient on this rank this step.
        pending: members not filled yet this step.
        to_copy, to_zero: on CUDA, filled members (with the gradient autograd allocated
            elsewhere) still to be copied into ``grad_buffer``, or zeroed there (they had
            none), once the last member is filled (:meth:`BucketEngine.gather`).
        exchange: the bucket's message in flight, once launched this step.
        velocity: float32 momentum-correction velocity, or None without momentum
            correction.
        next_velocity: float32 scratch holding this step's velocity until finish.
        adopts: a bucket of one parameter that takes the gradient autograd produced as
            its gradient buffer instead of copying it (:meth:`adopt`).
        accumulates: a CPU bucket whose gradient buffer receives ``residual + gradient``
            as each gradient arrives, instead of the gradient alone
            (:meth:`BucketEngine.accumulate`).
    """

    positions: list[int] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    compressed: bool = True
    grad_buffer: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    grad_views: list[torch.Tensor] = field(default_factory=list)
    residual_views: list[torch.Tensor] | None = None
    filled: list[bool] = field(default_factory=list)
    used: list[bool] = field(default_factory=list)
    pending: int = 0
    to_copy: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    to_zero: list[int] = field(default_factory=list)
    exchange: Exchange | None = None
    velocity: torch.Tensor | None = None
    next_velocity: torch.Tensor | None = None
    adopts: bool = False
    accumulates: bool = False

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def add(self, position: int, param: torch.Tensor) -> None:
        self.positions.append(position)
        self.params.append(param)
        self.offsets.append(self.numel)
        self.numel += param.numel()

    def span(self, member: int) -> slice:
        start = self.offsets[member]
        return slice(start, start + self.params[member].numel())

    def view(self, buffer: torch.Tensor, member: int) -> torch.Tensor:
        return buffer[self.span(member)].view(self.params[member].shape)

    def allocate(self, keep_residual: bool) -> None:
        """Allocate the flat buffers (zeros) and the members' views of them."""
        self.grad_buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.grad_views = self.views_of(self.grad_buffer)
        if keep_residual:
            self.residual = torch.zeros_like(self.grad_buffer)
            self.residual_views = self.views_of(self.residual)

    def views_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each member's view of a flat buffer, shaped like the member."""
        return list(_unflatten(buffer, self.params))

    def release(self) -> None:
        """Drop the gradient buffer (the last average, once nothing reads it): between
        steps only the residual stays allocated, as DDP keeps only its buckets. The next
        fill allocates a new one (:meth:`gradient_buffer`)."""
        self.grad_buffer = None
        self.grad_views = []

    def gradient_buffer(self) -> torch.Tensor:
        """The gradient buffer, allocated (uninitialised: every member is filled before
        the bucket launches) if :meth:`release` dropped it."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self.grad_views = self.views_of(self.grad_buffer)
        return self.grad_buffer

    def adopt(self, grad: torch.Tensor) -> None:
        """Make ``grad`` (the member's whole gradient, float32, contiguous, owning its
        storage) the gradient buffer: no copy. The old buffer, if any, is dropped."""
        self.grad_buffer = grad.view(-1)
        self.grad_views = [grad]

    def swap(self) -> None:
        """The residual buffer becomes the gradient buffer and the other way round."""
        self.grad_buffer, self.residual = self.residual, self.grad_buffer
        self.grad_views, self.residual_views = self.residual_views, self.grad_views

    def reset(self) -> None:
        self.to_copy, self.to_zero = [], []
        self.filled = [False] * len(self.params)
        self.used = [False] * len(self.params)
        self.pending = len(self.params)
        self.exchange = None


def reallocation_is_free(device: torch.device) -> bool:
    """Whether memory freed on ``device`` comes back at the next step's allocation for free,
    so that a buffer needed only during a step is better dropped between steps. CUDA's
    caching allocator hands it back; a large CPU allocation is new memory from the kernel,
    and its first write faults in every page (the 14.4M-parameter transformer of
    benchmarks/bench_network.py, one thread: ~30 ms a step, more than its top-k;
    benchmarks/RESULTS.md)."""
    return device.type == "cuda"


def build_buckets(
    params: list[torch.Tensor],
    cap_numel: int,
    min_compress_numel: int,
    keep_residual: bool,
    keep_velocity: bool = False,
) -> list[Bucket]:
    """Pack parameters into buckets of at most ``cap_numel`` elements (a larger parameter
    gets a bucket of its own), walking them in reverse order: backward produces the last
    layers' gradients first, so a bucket of neighbours fills at about one time. Parameters
    with fewer than ``min_compress_numel`` elements go to separate, uncompressed buckets.
    Buckets are ordered by when their last gradient is expected (the member registered
    first arrives last). Every rank packs the same parameters the same way. With
    ``keep_velocity``, every bucket gets momentum-correction velocity buffers."""
    cap_numel = min(cap_numel, MAX_BUCKET_NUMEL)
    buckets: list[Bucket] = []
    open_buckets: dict[tuple, Bucket] = {}
    for position in reversed(range(len(params))):
        param = params[position]
        if not param.requires_grad:
            continue
        too_large = too_large_for_a_bucket(position, param)
        if too_large is not None:
            raise too_large
        compressed = param.numel() >= min_compress_numel
        key = (param.device, compressed)
        bucket = open_buckets.get(key)
        if bucket is None or bucket.numel + param.numel() > cap_numel:
            bucket = Bucket(compressed=compressed)
            open_buckets[key] = bucket
            buckets.append(bucket)
        bucket.add(position, param)
    buckets.sort(key=lambda b: -min(b.positions))
    for bucket in buckets:
        bucket.allocate(keep_residual and bucket.compressed)
        if keep_velocity:
            bucket.velocity = torch.zeros_like(bucket.grad_buffer)
            bucket.next_velocity = torch.zeros_like(bucket.grad_buffer)
        bucket.reset()
    return buckets


def too_large_for_a_bucket(position: int, param: torch.Tensor) -> ValueError | None:
    """The error for a parameter that needs a gradient and has more elements than a
    bucket may hold; None for any other."""
    if not param.requires_grad or param.numel() <= MAX_BUCKET_NUMEL:
        return None
    return ValueError(
        f"parameter {position} has {param.numel()} elements, more than a bucket can hold "
        f"({MAX_BUCKET_NUMEL}, the int32 index limit); split it into smaller parameters"
    )


def cap_numel(bucket_cap_mb: float, element_bytes: int) -> int:
    """Elements per bucket for a cap in MiB (``inf``: no cap)."""
    if math.isinf(bucket_cap_mb):
        return MAX_BUCKET_NUMEL
    return max(1, int(bucket_cap_mb * 2**20) // element_bytes)


class CompressGraphs:
    """CUDA graphs of the per-bucket compression: the kernels of one ``compress`` (and the
    message's peak) replayed as one graph launch instead of a dozen kernel launches from
    Python.

    A graph does not depend on where the bucket's buffers are: the compressors that graph
    (those with a :meth:`~sparsecomm.compressors.Compressor.graph_signature`) take an
    ``addresses`` table, a small int64 device tensor per bucket from which their kernels
    read where the gradient, residual and wire buffers are when they run, and this class
    writes the current addresses there before every replay. So the buffers may move from
    step to step (they swap roles, a gradient buffer is released between steps and
    allocated anew, a bucket of one parameter takes autograd's gradient as its buffer) and
    one graph per bucket serves every step.

    A bucket's compression runs eagerly the first time its key (its size, whether it has a
    residual, and the compressor's signature) is seen, so that Triton compiles; is captured
    the second time in a row; replayed from then on. A bucket keeps the graph of its latest
    key only (a schedule changing ``k`` every step is never captured), and a bucket
    captured :attr:`MAX_CAPTURES` times in a row without replaying compresses eagerly from
    then on (so does every bucket once a capture failed). All graphs share one memory pool;
    they replay one after the other on one stream, so their scratch can overlap, and what
    they output stays allocated with them (their messages are kept). A message as large as
    the bucket (``Cast``'s) goes into one wire buffer per bucket
    (:meth:`~sparsecomm.compressors.Compressor.wire_buffer`), reused every step: the
    message's peak, measured inside the graph, reads it where it was captured."""

    #: Captures in a row without a replay before a bucket compresses eagerly for good (a
    #: key that changes every other step would otherwise be captured again and again).
    MAX_CAPTURES = 8

    def __init__(self):
        self.graphs: dict[int, tuple[tuple, torch.cuda.CUDAGraph, Message]] = {}  # per bucket
        self.last_key: dict[int, tuple] = {}  # per bucket, the key it compressed last
        self.pool = None
        self.wire_buffers: dict[tuple, torch.Tensor | None] = {}
        self.tables: dict[int, _AddressTable] = {}  # per bucket
        self.failed = False
        self.captures_of: dict[int, int] = {}  # per bucket, graphs captured in a row
        #: Compressions replayed from a graph, and graphs captured (counters for tests and
        #: benchmarks).
        self.replays = 0
        self.captured = 0

    def active(self, owner: int) -> bool:
        """Whether the graphs still capture for bucket ``owner`` (see :attr:`MAX_CAPTURES`)."""
        return not self.failed and self.captures_of.get(owner, 0) < self.MAX_CAPTURES

    def signature(
        self, compressor: Compressor, device: torch.device, numel: int, owner: int
    ) -> tuple | None:
        """The compressor's :meth:`~sparsecomm.compressors.Compressor.graph_signature` for
        bucket ``owner`` of ``numel`` elements on ``device``, or None where its compression
        runs eagerly: off CUDA, a compressor that does not graph, or a bucket the graphs
        gave up on (:meth:`active`)."""
        if device.type != "cuda" or not self.active(owner):
            return None
        return compressor.graph_signature(numel)

    def compress(
        self, compressor: Compressor, grad: torch.Tensor, residual: torch.Tensor | None,
        world_size: int, signature: tuple, owner: int,
    ) -> Message:  # fmt: skip
        """``compressor.compress(grad, residual, world_size)``, from a graph when one is
        captured. ``owner``: the bucket's index (whose graph, table and wire buffer these
        are)."""
        key = (grad.numel(), residual is None, signature)
        kwargs = {}
        slot = (owner, grad.numel(), signature)
        if slot not in self.wire_buffers:
            self.wire_buffers[slot] = compressor.wire_buffer(grad.numel(), grad.device)
        out = self.wire_buffers[slot]
        if out is not None:
            kwargs["out"] = out
        if not all(_aligned(t) for t in (grad, residual, out)):  # a view at an odd offset
            return compressor.compress(grad, residual, world_size, **kwargs)
        table = self.tables.get(owner)
        if table is None:
            table = self.tables[owner] = _AddressTable(grad.device)
        kwargs["addresses"] = table.write(grad, residual, out)
        seen = self.last_key.get(owner) == key
        self.last_key[owner] = key
        entry = self.graphs.get(owner)
        if entry is not None and entry[0] == key:
            _, graph, captured = entry
            graph.replay()
            self.replays += 1
            self.captures_of[owner] = 0  # the graphs pay: keep capturing for this bucket
            return dataclasses.replace(captured)  # the same tensors, fresh bookkeeping
        self.graphs.pop(owner, None)
        if not seen or not self.active(owner):  # first sighting: eagerly (Triton compiles)
            return self._eager(compressor, grad, residual, world_size, kwargs)
        self.captures_of[owner] = self.captures_of.get(owner, 0) + 1
        if not self.active(owner):  # capturing does not pay here: stop
            return self._eager(compressor, grad, residual, world_size, kwargs)
        return self._capture(compressor, grad, residual, world_size, key, owner, kwargs)

    def _eager(self, compressor, grad, residual, world_size, kwargs) -> Message:
        """Compress eagerly through the address table; should that fail (the kernels
        that read it do not compile here), without graphs from now on."""
        try:
            return compressor.compress(grad, residual, world_size, **kwargs)
        except Exception as error:  # a real error in the arguments raises again below
            reason = f"reading its buffers through an address table failed ({error!r})"
            return self._give_up(reason, compressor, grad, residual, world_size, kwargs)

    def _capture(self, compressor, grad, residual, world_size, key, owner, kwargs) -> Message:
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                message = compressor.compress(grad, residual, world_size, **kwargs)
                message.known_peak = message.peak(world_size)
        except RuntimeError as error:  # nothing ran: compress eagerly, from now on
            reason = f"capturing it in a CUDA graph failed ({error})"
            return self._give_up(reason, compressor, grad, residual, world_size, kwargs)
        self.graphs[owner] = (key, graph, message)
        self.captured += 1
        graph.replay()  # capturing ran nothing
        self.replays += 1
        return dataclasses.replace(message)

    def _give_up(self, reason, compressor, grad, residual, world_size, kwargs) -> Message:
        """Compress eagerly, without the address table, and without graphs from now on."""
        self.failed = True
        warnings.warn(
            f"sparsecomm: {compressor!r}: {reason}; compressing without CUDA graphs from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        kwargs.pop("addresses")
        return compressor.compress(grad, residual, world_size, **kwargs)


class _AddressTable:
    """One bucket's ``addresses`` table (``triton_kernels._indirect``): an int64 device
    tensor of the gradient's, residual's and wire buffer's addresses, written from a pinned
    host copy (asynchronously, in stream order before the kernels that read it) whenever
    they change. An event keeps the host copy from being rewritten before the device has
    read it."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(_indirect.SLOTS, dtype=torch.int64, pin_memory=cuda)
        self.host_view = self.host.numpy()
        self.table = torch.zeros_like(self.host, device=device) if cuda else self.host
        self.event = torch.cuda.Event() if cuda else None
        self.current: tuple = ()

    def write(self, *buffers) -> torch.Tensor:
        addresses = tuple(0 if b is None else b.data_ptr() for b in buffers)
        if addresses != self.current:
            if self.event is not None:  # (an event never recorded returns at once)
                self.event.synchronize()  # the last copy out of self.host has run
            self.host_view[: len(addresses)] = addresses
            self.current = addresses
            if self.event is not None:
                self.table.copy_(self.host, non_blocking=True)
                self.event.record()
        return self.table


def _aligned(tensor: torch.Tensor | None) -> bool:
    return tensor is None or tensor.data_ptr() % _indirect.ALIGN == 0


class BucketEngine:
    """Fills, launches and finishes the buckets of one set of parameters.

    Args:
        buckets: from :func:`build_buckets`.
        compressor: what the compressed buckets send; small-parameter buckets send dense.
        comm: the process group's collectives.
        momentum: the momentum-correction factor (None: no momentum correction; the
            buckets must then have velocity buffers).
        cuda_graphs: replay the compression of CUDA buckets from CUDA graphs where the
            compressor allows it (:class:`CompressGraphs`).
        adam_state: for ``TopK(select="adam")``, a parameter's ``(exp_avg_sq, eps)``
            (:meth:`_score`).
        num_params: how many parameters the buckets' positions index, frozen ones
            included (default: up to the last position a bucket holds).
    """

    def __init__(
        self,
        buckets: list[Bucket],
        compressor: Compressor,
        comm: Communicator,
        momentum: float | None = None,
        cuda_graphs: bool = True,
        adam_state: Callable[[torch.Tensor], tuple[torch.Tensor, float] | None] | None = None,
        num_params: int | None = None,
    ):
        self.buckets = buckets
        self.compressor = compressor
        self.comm = comm
        self.momentum = momentum
        #: For ``TopK(select="adam")``: a parameter's ``(exp_avg_sq, eps)`` in the wrapped
        #: optimizer, ``exp_avg_sq`` None before it has any (:meth:`_score`).
        self.adam_state = adam_state
        self.member_sizes: dict[int, tuple] = {}  # per bucket, for _score
        self.members: dict[int, tuple[tuple, _adam_score.Members]] = {}
        #: Steps taken so far: the compressor's schedule reads it (``Compressor.at_step``).
        self.step = 0
        #: CUDA graphs of the compression (None: never; see :class:`CompressGraphs`).
        self.graphs = CompressGraphs() if cuda_graphs else None
        self.member_of: dict[int, tuple[Bucket, int]] = {}
        self.handed = 0  # parameters the last finish() gave an average in .grad
        for bucket in buckets:
            for member, param in enumerate(bucket.params):
                self.member_of[id(param)] = (bucket, member)
        # A bucket of one parameter takes autograd's gradient as its buffer (no copy): the
        # CUDA graphs read their buffers through an address table, so a buffer that is new
        # every step costs them nothing.
        # A CPU bucket with a residual adds it to each gradient as it arrives (one pass over
        # memory where a copy into the bucket and the compressor's add made two).
        for bucket in buckets:
            bucket.adopts = len(bucket.params) == 1
            bucket.accumulates = (
                bucket.device.type == "cpu"
                and not bucket.adopts
                and bucket.compressed
                and bucket.residual is not None
                and bucket.velocity is None
                and compressor.compresses_accumulated()
            )
        #: ids of the members of adopting buckets whose ``.grad`` autograd allocated in
        #: this step's first backward (it was None): only such a tensor is adopted, never
        #: one the caller assigned (and may still hold). Noted by a hook before autograd
        #: accumulates (:meth:`adopting_params`); cleared as a step ends.
        self.fresh: set[int] = set()
        #: Per parameter position (``num_params`` of them: by default up to the last one a
        #: bucket holds), whether a bucket holds it (frozen ones: False); what
        #: :meth:`local_used` returns when every held parameter had a gradient.
        positions = [position for bucket in buckets for position in bucket.positions]
        if num_params is None:
            num_params = max(positions, default=-1) + 1
        self.held = [False] * num_params
        for position in positions:
            self.held[position] = True
        self.next_launch = 0  # buckets before this index have launched this step
        #: Copy gradients into a bucket when it launches (True) or as they arrive (False);
        #: None: on CUDA only (:meth:`gather`). Buckets that :attr:`~Bucket.accumulates`
        #: add each gradient as it arrives whatever this says.
        self.defer_copies: bool | None = None
        #: Drop a bucket's gradient buffer at ``zero_grad(set_to_none=True)`` (True) or keep
        #: it for the next step (False); None: drop it on CUDA only
        #: (:meth:`release_gradients`).
        self.release_buffers: bool | None = None
        #: Run a CUDA bucket's copies, compression and collective launch on a side stream,
        #: so that they overlap the rest of backward (False: on the current stream). Off by
        #: default: on one H200 the stream switches, waits and ``record_stream`` calls cost
        #: host time that a host-bound step pays in full (163M GPT, TopK(0.01): 45.5 ms a
        #: step with the side stream, 38.8 ms without; at 1e9 parameters no difference;
        #: benchmarks/RESULTS.md). Whether it pays on several GPUs is not measured yet.
        self.side_stream = False
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        #: Seconds spent compressing this step (set when ``timed``).
        self.compress_seconds = 0.0
        #: The bucket whose launch is under way (it raised, if set between launches).
        self.launching: Bucket | None = None
        #: Per bucket, the largest finite value of its narrowest member dtype (inf: all
        #: float32); and whether any bucket holds 16-bit members (with one rank the step's
        #: bound on the peaks is then 1).
        self.narrowest = [_narrowest(b) for b in buckets]
        self.narrow = any(math.isfinite(largest) for largest in self.narrowest)

    @property
    def device(self) -> torch.device:
        """The first bucket's device (the CPU without buckets): where the step's flags go."""
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    def compressor_of(self, bucket: Bucket) -> Compressor:
        """The bucket's compressor this step: small-parameter buckets send dense."""
        return self.compressor.at_step(self.step) if bucket.compressed else _DENSE

    # ---------------------------------------------------------------- fill

    def fill(self, bucket: Bucket, member: int, adopt: bool = False) -> None:
        """Put the member's current ``.grad`` (``None``: zeros) into the bucket. On CUDA
        the copies wait until the bucket's last member is filled (:meth:`gather`). With
        ``adopt`` (a gradient autograd just produced), a bucket that :attr:`~Bucket.adopts`
        takes the gradient tensor itself as its buffer."""
        param = bucket.params[member]
        # A parameter frozen since wrapping has no gradient, whatever its .grad holds (a
        # zeroed view of the bucket, after zero_grad(set_to_none=False)).
        grad = param.grad if param.requires_grad else None
        if grad is not None:
            _refuse_own_buffer(bucket, grad)
        if adopt and bucket.adopts and id(param) in self.fresh and _adoptable(grad, bucket):
            bucket.adopt(grad)
            self._hand_over(bucket, member)
            bucket.used[member] = True
            bucket.filled[member] = True
            bucket.pending -= 1
            return
        bucket.gradient_buffer()
        target = bucket.grad_views[member]
        if grad is not None and grad.is_sparse:
            raise TypeError(
                "sparse gradients are not supported: build embeddings with "
                "sparse=False so that their gradients are dense"
            )
        # On a CPU the copy is the work, best done while the gradient is hot in cache.
        defer = target.is_cuda if self.defer_copies is None else self.defer_copies
        if bucket.accumulates:
            self.accumulate(bucket, member, grad)
            bucket.used[member] = grad is not None
        elif grad is None:
            if defer:
                bucket.to_zero.append(member)
            else:
                target.zero_()
        else:
            # Autograd accumulated into the bucket itself unless it allocated anew.
            if grad.data_ptr() != target.data_ptr() or grad.dtype != torch.float32:
                if defer:
                    bucket.to_copy.append((member, grad))
                else:
                    target.copy_(grad)
                    self._hand_over(bucket, member)
            bucket.used[member] = True
        bucket.filled[member] = True
        bucket.pending -= 1
        if not bucket.pending:
            self.gather(bucket)

    @staticmethod
    def accumulate(bucket: Bucket, member: int, grad: torch.Tensor | None) -> None:
        """Write ``residual + grad`` (``grad`` None: zeros) into the member's piece of the
        gradient buffer, the sum the compressor selects from, with the same float32 add as
        the compressor's own (:meth:`Compressor.compress_accumulated` then skips it). The
        residual itself stays as it was until the step is known to be good. The sum is not
        the gradient, so ``.grad`` does not point at it: it becomes None, which frees
        autograd's tensor as :meth:`_hand_over` does."""
        target = bucket.grad_views[member]
        old = bucket.residual_views[member]
        if grad is None:
            target.zero_()
        elif grad.dtype != torch.float32:
            target.copy_(grad)
        elif grad.data_ptr() != target.data_ptr():  # autograd allocated it anew
            torch.add(old, grad, out=target)
            bucket.params[member].grad = None
            return
        torch.add(old, target, out=target)
        bucket.params[member].grad = None

    def gather(self, bucket: Bucket) -> None:
        """Copy the gradients that :meth:`fill` deferred into the bucket, and zero the
        members it found without one: one foreach launch each per bucket, not one per
        member (host time per parameter is what a model of many tensors pays for). Runs
        when the bucket's last member is filled, so at most about one bucket's gradients
        stay allocated outside the buckets."""
        stream = self._side(bucket)
        if stream is None:
            self._copy_deferred(bucket, None)
        else:
            with torch.cuda.stream(stream):
                self._copy_deferred(bucket, stream)

    def _copy_deferred(self, bucket: Bucket, stream: torch.cuda.Stream | None) -> None:
        if bucket.to_copy:
            views = bucket.grad_views
            grads = [grad for _, grad in bucket.to_copy]
            torch._foreach_copy_([views[m] for m, _ in bucket.to_copy], grads)
            if stream is not None:  # autograd's tensors: freed only once copied
                for grad in grads:
                    grad.record_stream(stream)
            for member, _ in bucket.to_copy:
                self._hand_over(bucket, member)
            bucket.to_copy = []
        if bucket.to_zero:
            torch._foreach_zero_([bucket.grad_views[m] for m in bucket.to_zero])
            bucket.to_zero = []

    def _side(self, bucket: Bucket) -> torch.cuda.Stream | None:
        """The side stream for the bucket's work, made to wait for what the current stream
        has queued (the gradients), or None: on a CPU, or with :attr:`side_stream` off.
        :meth:`join` makes the current stream wait for it in turn."""
        if not self.side_stream or bucket.device.type != "cuda":
            return None
        stream = self.streams.get(bucket.device)
        if stream is None:
            stream = self.streams[bucket.device] = torch.cuda.Stream(bucket.device)
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        return stream

    def join(self) -> None:
        """Make the current stream wait for the side streams' work (every launch so far):
        what follows (the step's agreement, the averages, the optimizer) reads it. Tensors
        the side stream allocated and the current stream reads are freed only after a later
        launch, which waits for the current stream first, so no stream reuses them early."""
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    @staticmethod
    def _hand_over(bucket: Bucket, member: int) -> None:
        """The gradient is in the bucket now: an fp32 member's ``.grad`` becomes its view
        (autograd's own tensor is freed, and a later backward accumulates in place)."""
        param = bucket.params[member]
        if param.dtype == torch.float32:
            param.grad = bucket.grad_views[member]

    def fill_from_hook(self, param: torch.Tensor) -> bool:
        """A gradient arrived during backward: fill it in, launch what is ready. Returns
        False for a parameter this engine does not hold."""
        entry = self.member_of.get(id(param))
        if entry is None:
            return False
        bucket, member = entry
        if bucket.exchange is not None:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket was already sent this step: "
                "backward ran again before step(). To accumulate gradients over several "
                "backward passes, run all but the last inside `with opt.no_sync():`; after a "
                "backward that raised, call opt.drop_step() before the next one"
            )
        self.fill(bucket, member, adopt=True)
        self.launch_ready()
        return True

    # ---------------------------------------------------------------- launch

    def adopting_params(self) -> list[torch.Tensor]:
        """The members of buckets that adopt their gradient: the parameters whose
        ``.grad`` the wrapper watches before autograd accumulates (:attr:`fresh`)."""
        return [bucket.params[0] for bucket in self.buckets if bucket.adopts]

    def launch_ready(self) -> None:
        """Launch, in order, every bucket whose members are all filled."""
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.pending:
                return
            self._launch(bucket)

    def local_used(self) -> list[bool]:
        """Per parameter position: did it have a gradient on this rank this step."""
        used = [False] * len(self.held)
        for bucket in self.buckets:
            for member, position in enumerate(bucket.positions):
                used[position] = bucket.used[member]
        return used

    def launch_all(self) -> None:
        """Fill what backward did not (from ``.grad`` as it is now) and launch the rest."""
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            for member, filled in enumerate(bucket.filled):
                if not filled:
                    self.fill(bucket, member)
            self._launch(bucket)
        self.join()

    def _launch(self, bucket: Bucket) -> None:
        # Set while the bucket's collectives start: should they raise part-way, what was
        # issued cannot be taken back (CompressedOptimizer.drop_step refuses to drop).
        self.launching = bucket
        stream = self._side(bucket)
        if stream is None:  # (a stream context costs microseconds even for None)
            self._compress_and_start(bucket)
        else:
            with torch.cuda.stream(stream):
                self._compress_and_start(bucket)
        self.launching = None
        self.next_launch += 1
        # Until finish() the buffer holds scratch (the new residual, then the average):
        # hide it from .grad so that nothing reads or scales it in place meanwhile.
        for param in bucket.params:
            param.grad = None

    def _compress_and_start(self, bucket: Bucket) -> None:
        compressor = self.compressor_of(bucket)
        started = self.comm.clock(bucket.device)
        if bucket.velocity is not None:
            # u' = grad + momentum * u, in the gradient buffer (what is compressed) and in
            # next_velocity (kept until finish); u itself stays as it was.
            bucket.grad_buffer.add_(bucket.velocity, alpha=self.momentum)
            bucket.next_velocity.copy_(bucket.grad_buffer)
        if compressor.selects_by_adam:
            message = self._compress_scored(bucket, compressor)
        elif bucket.accumulates:  # the sum is in grad_buffer already (accumulate)
            message = compressor.compress_accumulated(bucket.grad_buffer, self.comm.world_size)
        else:
            message = self._compress(bucket, compressor)
        # 16-bit sparse values: what rounding takes off joins the new residual, which every
        # branch above leaves in grad_buffer (a no-op where compress already rounded).
        compressor.round_message(message, None if bucket.residual is None else bucket.grad_buffer)
        self.compress_seconds += self.comm.clock(bucket.device) - started
        bucket.exchange = compressor.start(message, self.comm)

    def _compress(self, bucket: Bucket, compressor: Compressor) -> Message:
        """``compressor.compress`` on the bucket (from a CUDA graph where one serves)."""
        if bucket.residual is None:
            source, target = bucket.grad_buffer, None
        else:
            # Reversed on purpose (see the module docstring): the new residual goes into
            # grad_buffer, the old one stays as it was.
            source, target = bucket.residual, bucket.grad_buffer
        signature = self.graph_signature(bucket, compressor, self.next_launch)
        if signature is None:
            return compressor.compress(source, target, self.comm.world_size)
        return self.graphs.compress(
            compressor, source, target, self.comm.world_size, signature, self.next_launch
        )

    def _compress_scored(self, bucket: Bucket, compressor: Compressor) -> Message:
        """``TopK(select="adam")``: ``acc = grad + residual`` in the gradient buffer (the
        old residual stays as it was, as :meth:`_compress` leaves it), then the k largest
        of the scores are sent and zeroed there, leaving the new residual. With the Triton
        kernels (every member's ``v`` float32) that is :class:`AdamChoice`, replayed from a
        CUDA graph where one serves; else the torch ops of :meth:`_score` and
        :meth:`~sparsecomm.TopK.compress_scored`."""
        world_size = self.comm.world_size
        members = self._members(bucket) if _ops.use_triton(bucket.grad_buffer) else None
        if members is not None:  # the kernels, replayed from a CUDA graph where one serves
            chooser = AdamChoice(members, compressor.k_for(bucket.numel))
            signature = self.graph_signature(bucket, chooser, self.next_launch)
            # (A bucket that accumulates holds grad + residual already.)
            grad, residual = bucket.grad_buffer, None if bucket.accumulates else bucket.residual
            if signature is None:
                return chooser.compress(grad, residual, world_size)
            return self.graphs.compress(
                chooser, grad, residual, world_size, signature, self.next_launch
            )
        acc = bucket.grad_buffer
        if bucket.residual is not None and not bucket.accumulates:
            acc.add_(bucket.residual)
        return compressor.compress_scored(acc, self._score(bucket, acc), world_size)

    def _members(self, bucket: Bucket) -> _adam_score.Members | None:
        """The bucket's members as the CUDA kernels read them, while every member has a
        float32 ``v`` (else None: the torch ops score it); kept until a ``v`` moves or an
        ``eps`` changes."""
        states = [self.adam_state(param) for param in bucket.params]
        if any(v is None or v.dtype != torch.float32 or not v.is_contiguous() for v, _ in states):
            return None
        key = tuple((v.data_ptr(), eps) for v, eps in states)
        cached = self.members.get(id(bucket))
        if cached is None or cached[0] != key:
            numels = [param.numel() for param in bucket.params]
            members = _adam_score.Members(numels, [v for v, _ in states], [e for _, e in states])
            cached = self.members[id(bucket)] = (key, members)
        return cached[1]

    def _score(self, bucket: Bucket, acc: torch.Tensor) -> torch.Tensor:
        """``|acc| / (sqrt(max(v, mean(v))) + eps)`` per member, with its optimizer's ``v``
        (``exp_avg_sq``), the mean of ``v`` over the member, and its ``eps``
        (``triton_kernels.adam_score.score_ref``); ``|acc|`` for the whole bucket before
        the optimizer has any state for it, and ``v = 1`` for a member without state beside
        members with it (``|acc| / (1 + eps)``)."""
        states = [self.adam_state(param) for param in bucket.params]
        if all(variance is None for variance, _ in states):
            return acc.abs()
        variances = [
            variance.float().reshape(-1)
            if variance is not None
            else torch.ones(param.numel(), device=acc.device)
            for (variance, _), param in zip(states, bucket.params)
        ]
        counts, sizes, eps = self._sizes(bucket, tuple(eps for _, eps in states))
        return _adam_score.score_ref(acc, variances, counts, sizes, eps)

    def _sizes(self, bucket: Bucket, eps: tuple[float, ...]):
        """The bucket's members' sizes (int64 and float32) and ``eps`` (float32) on its
        device, made again only when an ``eps`` changes (no copy to the device a step)."""
        cached = self.member_sizes.get(id(bucket))
        if cached is None or cached[0] != eps:
            numels = [param.numel() for param in bucket.params]
            counts = torch.tensor(numels, dtype=torch.int64, device=bucket.device)
            on_device = torch.tensor(eps, dtype=torch.float32, device=bucket.device)
            cached = self.member_sizes[id(bucket)] = (eps, counts, counts.float(), on_device)
        return cached[1:]

    # ---------------------------------------------------------------- finish

    def peak(self) -> torch.Tensor | None:
        """A 0-dim float32 tensor on the first bucket's device: the largest
        :meth:`~sparsecomm.compressors.Message.peak` this rank sent in any bucket this step
        (NaN or Inf if it sent one; None without buckets), each bucket's measured against
        :func:`_narrow_factor`'s tighter limit where it holds 16-bit parameters."""
        peaks = []
        world_size = self.comm.world_size
        for bucket, largest in zip(self.buckets, self.narrowest):
            exchange = bucket.exchange
            factor = _narrow_factor(exchange.peak_limit, largest, world_size)
            peak = exchange.peak
            peaks.append(peak if factor == 1.0 or peak is None else peak * factor)
        if len(peaks) < 2:
            return peaks[0] if peaks else None
        device = peaks[0].device
        return torch.stack([p.to(device) for p in peaks]).max()  # max propagates NaN

    def finish(
        self, used: list[bool], skip: torch.Tensor | None = None, keep: bool = False
    ) -> None:
        """Wait for every bucket, average, commit the new residuals, and hand each used
        parameter its average in ``.grad`` (parameters no rank used keep ``grad = None``
        and their residual).

        ``skip``: a one-element bool tensor on the buckets' device, the step's refusal as
        the device knows it before the host does. Where it holds True the averages are not
        written over the old residuals (the kernels read it), so that :meth:`revert` can
        still drop the step: the host queues the averages first and waits after.

        ``keep`` (with ``skip``): where ``skip`` holds True, also move each old residual
        over the new one and zero what ``.grad`` views, on the device, so that the
        residuals are the old ones already and :meth:`drop` (not :meth:`revert`) drops
        the step. Then nothing written through ``.grad`` before the host learns the
        verdict (clipping, say) can reach a residual, and ``.grad`` reads as zeros there,
        not as a refused average."""
        skips = {} if skip is None else {skip.device: skip}
        handed = 0
        for bucket in self.buckets:
            exchange = bucket.exchange
            compressor = self.compressor_of(bucket)
            if skip is not None and bucket.device not in skips:
                skips[bucket.device] = skip.to(bucket.device)
            if bucket.residual is None:  # nothing to keep: the buffer is this step's
                compressor.finish(exchange, bucket.grad_buffer)
                if keep:
                    _ops.move_if(skips[bucket.device], bucket.grad_buffer)
            else:
                new_residual = bucket.grad_buffer
                for member, position in enumerate(bucket.positions):
                    if not used[position]:
                        span = bucket.span(member)
                        new_residual[span] = bucket.residual[span]
                compressor.finish(exchange, bucket.residual, skips.get(bucket.device))
                if keep:  # (launch_all() joined the side stream that wrote new_residual)
                    _ops.move_if(skips[bucket.device], bucket.residual, new_residual)
                bucket.swap()  # the average is in the old residual's buffer
            for member, (position, param) in enumerate(zip(bucket.positions, bucket.params)):
                if not used[position]:
                    param.grad = None
                    continue
                handed += 1
                view = bucket.grad_views[member]
                param.grad = view if param.dtype == torch.float32 else view.to(param.dtype)
            if bucket.velocity is not None:
                self._commit_velocity(bucket, exchange.message, used)
            bucket.reset()
        self.handed = handed
        self.next_launch = 0
        self.fresh.clear()

    def release_gradients(self) -> None:
        """``zero_grad(set_to_none=True)`` dropped the members' ``.grad``: drop the buffers
        holding them too (buckets between steps only), where that is what keeps the
        bucket's memory at DDP's: a bucket with a residual holds two buffers, DDP one.
        A bucket without a residual (``Dense``, small parameters, no error feedback) keeps
        its one buffer, and allocating it anew would only cost time. (A bucket compressed
        from a CUDA graph is no exception: the graph finds the buffers it reads through
        :class:`CompressGraphs`'s address table, wherever they are.)"""
        for bucket in self.buckets:
            if bucket.exchange is not None or bucket.pending != len(bucket.params):
                continue
            if bucket.adopts or (bucket.residual is not None and self._releases(bucket)):
                bucket.release()

    def _releases(self, bucket: Bucket) -> bool:
        """Whether :meth:`release_gradients` drops the bucket's own buffer: by default
        where :func:`reallocation_is_free`."""
        if self.release_buffers is not None:
            return self.release_buffers
        return reallocation_is_free(bucket.device)

    def graph_signature(self, bucket: Bucket, compressor: Compressor, index: int):
        """The signature under which the ``index``-th bucket is compressed from CUDA graphs
        (:meth:`CompressGraphs.signature`), or None: eagerly."""
        if self.graphs is None:
            return None
        return self.graphs.signature(compressor, bucket.device, bucket.numel, index)

    def _commit_velocity(self, bucket: Bucket, message, used: list[bool]) -> None:
        """Momentum factor masking, then make this step's velocity the current one.
        Members no rank used keep their velocity (their gradient counted as absent)."""
        velocity = bucket.next_velocity
        if message.indices is not None:
            count = message.known_count()
            if count < message.numel:
                velocity[message.indices[:count].long()] = 0.0
        for member, position in enumerate(bucket.positions):
            if not used[position]:
                span = bucket.span(member)
                velocity[span] = bucket.velocity[span]
        bucket.velocity, bucket.next_velocity = velocity, bucket.velocity

    def revert(self) -> None:
        """Drop a step that :meth:`finish` finished with ``skip`` holding True: the
        residuals and velocities swap back (their old buffers were not written), and the
        members' ``.grad`` is None."""
        for bucket in self.buckets:
            if bucket.residual is not None:
                bucket.swap()
            if bucket.velocity is not None:
                bucket.velocity, bucket.next_velocity = bucket.next_velocity, bucket.velocity
        self.drop()

    def drop(self) -> None:
        """Drop a step that :meth:`finish` finished with ``skip`` holding True and
        ``keep``: the residuals are the old ones already; the members' ``.grad`` is None."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None
        self.fresh.clear()

    def in_progress(self) -> bool:
        """Whether this step's exchange has begun: a bucket filled in part or launched."""
        return self.next_launch > 0 or any(b.pending != len(b.params) for b in self.buckets)

    def clear_unfilled(self) -> None:
        """Drop the ``.grad`` of every member not filled this step (a backward that raised
        did not reach it), so that :meth:`launch_all` sends zeros for it."""
        for bucket in self.buckets[self.next_launch :]:
            for member, filled in enumerate(bucket.filled):
                if not filled:
                    bucket.params[member].grad = None

    def abandon(self) -> None:
        """Wait for every bucket and drop the step: residuals stay as they were, and the
        members' ``.grad`` stays None."""
        for bucket in self.buckets:
            if bucket.exchange is not None:
                self.comm.wait(bucket.exchange.work)
            bucket.reset()
        self.next_launch = 0
        self.fresh.clear()


def _refuse_own_buffer(bucket: Bucket, grad: torch.Tensor) -> None:
    """Raise if ``grad`` lies in the bucket's residual or velocity: a ``.grad`` kept from
    an earlier step (those buffers trade places with the gradient's between steps), or a
    tensor assigned to ``.grad`` that the bucket adopted then, written into by this
    backward. What was not sent yet is lost; better an error than a wrong sum."""
    address = grad.data_ptr()
    for kept in (bucket.residual, bucket.velocity, bucket.next_velocity):
        if kept is not None and kept.data_ptr() <= address < kept.data_ptr() + 4 * kept.numel():
            raise RuntimeError(
                "a parameter's .grad is memory sparsecomm now keeps the unsent gradient in "
                "(a .grad tensor kept from an earlier step and assigned again, or one "
                "assigned before an earlier backward): this backward wrote into it, so "
                "error feedback lost what it held. Let backward allocate .grad "
                "(opt.zero_grad()), or assign a new tensor every step; restart from the "
                "last checkpoint"
            )


def _unflatten_in_python(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    views, start = [], 0
    for tensor in like:
        views.append(flat[start : start + tensor.numel()].view(tensor.shape))
        start += tensor.numel()
    return views


# The members' views of a buffer in one C++ call (what torch._utils._unflatten_dense_tensors
# uses): a third of the host time of slicing in Python, paid per bucket and step.
_unflatten = getattr(torch._C._nn, "unflatten_dense_tensors", _unflatten_in_python)


def _adoptable(grad: torch.Tensor | None, bucket: Bucket) -> bool:
    """Whether ``grad`` can become the bucket's gradient buffer as it is: float32 on the
    bucket's device, dense and contiguous, alone in its storage (not a view of something
    larger), outside the autograd graph, and none of the bucket's own buffers."""
    if grad is None or grad.dtype != torch.float32 or grad.device != bucket.device:
        return False
    if grad.is_sparse or grad.requires_grad or not grad.is_contiguous():
        return False
    if grad.storage_offset() != 0 or grad.untyped_storage().nbytes() != 4 * bucket.numel:
        return False
    own = (bucket.grad_buffer, bucket.residual, bucket.velocity, bucket.next_velocity)
    return all(t is None or t.data_ptr() != grad.data_ptr() for t in own)


def _narrowest(bucket: Bucket) -> float:
    """The largest finite value of the bucket's narrowest member dtype; inf if all its
    members are float32."""
    return min(
        (torch.finfo(p.dtype).max for p in bucket.params if p.dtype != torch.float32),
        default=math.inf,
    )


def _narrow_factor(peak_limit: float | None, largest: float, world_size: int) -> float:
    """How many times tighter than ``peak_limit`` (``Exchange.peak_limit``: the ranks'
    summed peaks, times it, bound the sum over the ranks in the average's units) the
    bucket's limit is: its average, that sum over ``W``, is written into its members'
    gradients in their own dtype, where beyond ``largest`` (float16's or bfloat16's
    largest value) it would become Inf. 1.0 for a bucket of float32 members, or where the
    message's own limit is the tighter one (a float16 ``Cast`` of float16 parameters on
    two ranks)."""
    if not math.isfinite(largest):
        return 1.0
    if peak_limit is None:  # (float32 values, unscaled)
        peak_limit = sum_limit(torch.float32, world_size)
    return peak_limit / min(peak_limit, world_size * largest * (1 - 2.0**-20))
