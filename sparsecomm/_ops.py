"""Picks the implementation of each compression operation: Triton kernel, fast CPU path, or
torch reference.

CUDA tensors go to the Triton kernels and CPU tensors to the fast CPU paths (``*_cpu``),
which return the references' bits. The environment variable ``SPARSECOMM_KERNELS``
overrides that: ``torch`` forces the references (``*_ref``) everywhere, ``triton`` forces
the kernels (on CPU tensors they need ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
import warnings

import torch

from .triton_kernels import cast as _cast
from .triton_kernels import move_if as _move_if
from .triton_kernels import scatter_add as _scatter_add
from .triton_kernels import threshold as _threshold
from .triton_kernels import topk as _topk

_MODES = ("auto", "torch", "triton")


def _mode() -> str:
    mode = os.environ.get("SPARSECOMM_KERNELS", "auto")
    if mode not in _MODES:
        raise ValueError(
            f"SPARSECOMM_KERNELS={mode!r} is not one of {_MODES}; unset it to let sparsecomm "
            "choose (Triton for CUDA tensors, the fast CPU paths for CPU tensors)"
        )
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    mode = _mode()
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


class KernelSwitch:
    """An optimizer's Triton kernel, standing in for its torch ops where :func:`use_triton`
    picks it, until it first fails on this machine (it did not compile here, say): then one
    warning, and the torch ops from then on."""

    def __init__(self, owner: str):
        self.owner = owner
        #: Set once the kernel has failed.
        self.failed = False

    def wanted(self, tensor: torch.Tensor) -> bool:
        return use_triton(tensor) and not self.failed

    def fail(self, error: Exception) -> None:
        self.failed = True
        warnings.warn(
            f"sparsecomm.{self.owner}: its Triton kernel failed ({error!r}); stepping with "
            "torch ops from now on",
            RuntimeWarning,
            stacklevel=4,
        )


def _pick(tensor: torch.Tensor, kernel, cpu, ref):
    mode = _mode()
    if mode == "triton" or (mode == "auto" and tensor.is_cuda):
        return kernel
    if mode == "torch":
        return ref
    return cpu if tensor.device.type == "cpu" else ref


def threshold_compress(grad, residual, threshold_value):
    impl = _pick(
        grad,
        _threshold.threshold_compress,
        _threshold.threshold_compress_cpu,
        _threshold.threshold_compress_ref,
    )
    return impl(grad, residual, threshold_value)


def topk_compress(grad, residual, k, addresses=None):
    impl = _pick(grad, _topk.topk_compress, _topk.topk_compress_cpu, _topk.topk_compress_ref)
    if impl is _topk.topk_compress:
        return impl(grad, residual, k, addresses)
    return impl(grad, residual, k)  # (addresses: only the kernels read buffers through it)


def zero_sent(acc, indices, count=None) -> None:
    """What ``accumulated=True`` does inside the CPU paths, for the other implementations:
    zero the sent elements of ``acc``, leaving the new residual there."""
    sent = indices if count is None else indices[: int(count)]
    acc[sent.long()] = 0.0


def topk_compress_accumulated(acc, k):
    """:func:`topk_compress` where ``acc`` already holds ``grad + residual``: the new
    residual is left in ``acc``, with the bits ``topk_compress`` leaves in ``residual``."""
    impl = _pick(acc, _topk.topk_compress, _topk.topk_compress_cpu, _topk.topk_compress_ref)
    if impl is _topk.topk_compress_cpu:
        return impl(acc, None, k, accumulated=True)
    indices, values = impl(acc, None, k)
    zero_sent(acc, indices)
    return indices, values


def threshold_compress_accumulated(acc, threshold_value):
    """:func:`threshold_compress` where ``acc`` already holds ``grad + residual`` (as
    :func:`topk_compress_accumulated`)."""
    impl = _pick(
        acc,
        _threshold.threshold_compress,
        _threshold.threshold_compress_cpu,
        _threshold.threshold_compress_ref,
    )
    if impl is _threshold.threshold_compress_cpu:
        return impl(acc, None, threshold_value, accumulated=True)
    indices, values, count = impl(acc, None, threshold_value)
    zero_sent(acc, indices, count)
    return indices, values, count


def cast_compress(grad, residual, dtype, scale, limit=None, out=None, addresses=None):
    impl = _pick(grad, _cast.cast_compress, _cast.cast_compress_cpu, _cast.cast_compress_ref)
    if impl is _cast.cast_compress:
        return impl(grad, residual, dtype, scale, limit, out, addresses)
    return impl(grad, residual, dtype, scale, limit, out)


def round_pairs(values, indices, residual, dtype):
    """A sparse message's values rounded to ``dtype`` in place, the rounding error into
    ``residual`` at ``indices``: one kernel on CUDA, the torch reference elsewhere."""
    impl = _pick(values, _cast.round_pairs, _cast.round_pairs_ref, _cast.round_pairs_ref)
    impl(values, indices, residual, dtype)


def scatter_add(indices, values, counts, numel, scale, out=None, skip=None):
    impl = _pick(
        values,
        _scatter_add.scatter_add,
        _scatter_add.scatter_add_cpu,
        _scatter_add.scatter_add_ref,
    )
    return impl(indices, values, counts, numel, scale, out=out, skip=skip)


_MOVE_IF = KernelSwitch("CompressedOptimizer's move_if")


def move_if(flag, src, dst=None) -> None:
    """Where the one-element bool ``flag`` holds True, ``dst.copy_(src)`` (if ``dst`` is
    given) and ``src.zero_()``; decided on the device (no host synchronisation on CUDA).
    Should the kernel fail to run here, the reference (selects over every element) does it
    from then on."""
    impl = _pick(src, _move_if.move_if, _move_if.move_if_cpu, _move_if.move_if_ref)
    if impl is _move_if.move_if:
        if not _MOVE_IF.failed:
            try:
                return impl(flag, src, dst)
            except ValueError:  # a bad call (its argument check), not the kernel's failure
                raise
            except Exception as error:  # (it did not compile here, say)
                _MOVE_IF.fail(error)
        impl = _move_if.move_if_ref
    impl(flag, src, dst)
