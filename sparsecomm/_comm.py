"""The few torch.distributed collectives sparsecomm uses, bound to one process group.

Without an initialized process group (or with one rank) every collective is the identity,
so the optimizer runs locally with the same code path; but a process that torchrun started
as one of several (``WORLD_SIZE`` above 1) must initialize its group first.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); 2.4 to 2.12
# have only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator:
    """A process group, with its size and this process's rank in it."""

    def __init__(self, process_group: Any = None):
        self.group = process_group
        initialized = dist.is_available() and dist.is_initialized()
        if (initialized or isinstance(process_group, str)) and not (
            process_group is None or isinstance(process_group, dist.ProcessGroup)
        ):
            raise TypeError(
                "process_group must be None (the default group) or a torch.distributed "
                f"ProcessGroup such as dist.new_group(ranks), got {process_group!r}; the "
                "backend (gloo, nccl) is chosen by dist.init_process_group"
            )
        if initialized:
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
        else:
            if process_group is not None:
                raise ValueError(
                    "process_group was given but torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group(...) first, or pass process_group=None "
                    "to train on one process"
                )
            launched = os.environ.get("WORLD_SIZE", "1")
            if launched.isdigit() and int(launched) > 1:
                raise RuntimeError(
                    f"torch.distributed is not initialized, but WORLD_SIZE={launched} says "
                    "this process is one of several (torchrun sets it): each would train "
                    "alone, its parameters apart from the others'. Call "
                    "torch.distributed.init_process_group(backend) on every rank first. To "
                    "train on this process alone (after destroy_process_group(), say), set "
                    "os.environ['WORLD_SIZE'] = '1' before building it"
                )
            self.world_size = 1
            self.rank = 0
        #: Seconds spent inside collectives since the last reset, when ``timed`` is set
        #: (each collective then synchronizes the device before and after).
        self.timed = False
        self.seconds = 0.0

    def _run(self, collective, tensor: torch.Tensor, *args, async_op: bool = False, **kwargs):
        """Run ``collective``; with ``async_op`` return its handle (``None`` once done).
        Timed runs always finish before returning, so that the time is the collective's."""
        if not self.timed:
            if async_op:
                return collective(*args, async_op=True, **kwargs)
            collective(*args, **kwargs)
            return None
        _synchronize(tensor)
        start = time.perf_counter()
        collective(*args, **kwargs)
        _synchronize(tensor)
        self.seconds += time.perf_counter() - start
        return None

    def wait(self, work) -> None:
        """Wait for a handle returned by an ``async_op=True`` collective (``None``: done)."""
        if work is None:
            return
        if not self.timed:
            work.wait()
            return
        start = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - start

    def clock(self, device: torch.device) -> float:
        """``time.perf_counter()`` after the device has finished its queued work, when
        ``timed``; 0 otherwise (no synchronisation)."""
        if not self.timed:
            return 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over all ranks (every rank must call)."""
        self.wait(self.start_all_reduce_(tensor, op))
        return tensor

    def start_all_reduce_(self, tensor: torch.Tensor, op: str = "sum"):
        """Start reducing ``tensor`` in place over all ranks; returns a handle for
        :meth:`wait` (every rank must call, in the same order)."""
        if not self.distributed:
            return None
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._run(
            dist.all_reduce, tensor, tensor, op=reduce_op, group=self.group, async_op=True
        )

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every rank's equally shaped ``tensor`` into ``[world_size, *shape]``, in rank
        order (every rank must call)."""
        out, work = self.start_all_gather(tensor)
        self.wait(work)
        return out

    def start_all_gather(self, tensor: torch.Tensor):
        """Start :meth:`all_gather`: returns ``(out, handle)``; ``out`` is valid after
        :meth:`wait` on the handle (every rank must call, in the same order)."""
        if not self.distributed:
            return tensor.unsqueeze(0), None
        out = tensor.new_empty((self.world_size * tensor.numel(),))
        work = self._run(
            _all_gather_single,
            out,
            out,
            tensor.contiguous().view(-1),
            group=self.group,
            async_op=True,
        )
        return out.view(self.world_size, *tensor.shape), work

    def all_gather_int(self, value: int, device: torch.device) -> list[int]:
        """Every rank's ``value``, in rank order (every rank must call)."""
        return [row[0] for row in self.all_gather_ints([value], device)]

    def all_gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank), in rank order: one all-gather of
        int64s on ``device`` and a host sync (every rank must call)."""
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        return self.all_gather(mine).view(-1, len(values)).tolist()

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order (every rank must call)."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_from_first_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` with the group's rank 0 copy (every rank must call)."""
        if self.distributed:
            group = self.group if self.group is not None else dist.group.WORLD
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=self.group)
        return tensor


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
