"""Picks the Triton kernel or the torch reference for each compression operation.

CUDA tensors go to the Triton kernels and CPU tensors to the references. The environment
variable ``SPARSECOMM_KERNELS`` overrides that: ``torch`` forces the references everywhere,
``triton`` forces the kernels (on CPU tensors they need ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from .triton_kernels import cast as _cast
from .triton_kernels import scatter_add as _scatter_add
from .triton_kernels import threshold as _threshold
from .triton_kernels import topk as _topk

_MODES = ("auto", "torch", "triton")


def use_triton(tensor: torch.Tensor) -> bool:
    mode = os.environ.get("SPARSECOMM_KERNELS", "auto")
    if mode not in _MODES:
        raise ValueError(
            f"SPARSECOMM_KERNELS={mode!r} is not one of {_MODES}; unset it to let sparsecomm "
            "choose (Triton for CUDA tensors, torch for CPU tensors)"
        )
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


def threshold_compress(grad, residual, threshold_value):
    impl = _threshold.threshold_compress if use_triton(grad) else _threshold.threshold_compress_ref
    return impl(grad, residual, threshold_value)


def topk_compress(grad, residual, k):
    impl = _topk.topk_compress if use_triton(grad) else _topk.topk_compress_ref
    return impl(grad, residual, k)


def cast_compress(grad, residual, dtype, scale):
    impl = _cast.cast_compress if use_triton(grad) else _cast.cast_compress_ref
    return impl(grad, residual, dtype, scale)


def scatter_add(indices, values, counts, numel, scale):
    impl = _scatter_add.scatter_add if use_triton(values) else _scatter_add.scatter_add_ref
    return impl(indices, values, counts, numel, scale)
