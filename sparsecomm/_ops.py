"""Picks the implementation of each compression operation.

The torch references in ``sparsecomm.triton_kernels`` run for every device for now; the
environment variable ``SPARSECOMM_KERNELS`` (``auto``, ``torch``) is checked so that a typo
is reported.
"""

from __future__ import annotations

import os

import torch

from .triton_kernels import cast as _cast
from .triton_kernels import scatter_add as _scatter_add
from .triton_kernels import threshold as _threshold
from .triton_kernels import topk as _topk

_MODES = ("auto", "torch")


def _check_mode(tensor: torch.Tensor) -> None:
    mode = os.environ.get("SPARSECOMM_KERNELS", "auto")
    if mode not in _MODES:
        raise ValueError(
            f"SPARSECOMM_KERNELS={mode!r} is not one of {_MODES}; unset it to let sparsecomm "
            "choose"
        )


def threshold_compress(grad, residual, threshold_value):
    _check_mode(grad)
    return _threshold.threshold_compress_ref(grad, residual, threshold_value)


def topk_compress(grad, residual, k):
    _check_mode(grad)
    return _topk.topk_compress_ref(grad, residual, k)


def cast_compress(grad, residual, dtype, scale):
    _check_mode(grad)
    return _cast.cast_compress_ref(grad, residual, dtype, scale)


def scatter_add(indices, values, counts, numel, scale):
    _check_mode(values)
    return _scatter_add.scatter_add_ref(indices, values, counts, numel, scale)
