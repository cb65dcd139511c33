"""Picks the implementation of each compression operation: Triton kernel, fast CPU path, or
torch reference.

CUDA tensors go to the Triton kernels and CPU tensors to the fast CPU paths (``*_cpu``),
which return the references' bits. The environment variable ``SPARSECOMM_KERNELS``
overrides that: ``torch`` forces the references (``*_ref``) everywhere, ``triton`` forces
the kernels (on CPU tensors they need ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from .triton_kernels import cast as _cast
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


def cast_compress(grad, residual, dtype, scale, limit=None, out=None, addresses=None):
    impl = _pick(grad, _cast.cast_compress, _cast.cast_compress_cpu, _cast.cast_compress_ref)
    if impl is _cast.cast_compress:
        return impl(grad, residual, dtype, scale, limit, out, addresses)
    return impl(grad, residual, dtype, scale, limit, out)


def scatter_add(indices, values, counts, numel, scale, out=None, skip=None):
    impl = _pick(
        values,
        _scatter_add.scatter_add,
        _scatter_add.scatter_add_cpu,
        _scatter_add.scatter_add_ref,
    )
    return impl(indices, values, counts, numel, scale, out=out, skip=skip)
