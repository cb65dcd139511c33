"""Argument checks shared by every launcher and fast CPU path of ``triton_kernels``.

One rule everywhere: a wrong Python type or a wrong dtype raises :class:`TypeError`; a wrong
shape, size, layout, device or value raises :class:`ValueError`. A wrong dtype raises
:class:`DtypeError`, which is both (the checkers raised ``ValueError`` for it before, and
callers written against that keep working).
"""

from __future__ import annotations

import operator

import torch

# Messages index their elements with int32, so a flat tensor holds at most this many
# elements; every module here and the bucketing in sparsecomm take the limit from here.
MAX_NUMEL = 2**31 - 1


class DtypeError(TypeError, ValueError):
    """A tensor (or dtype argument) of the wrong dtype: a ``TypeError``, and also a
    ``ValueError`` for callers that caught that before the checks were unified."""


def check_grad_residual(grad: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Check a flat float32 bucket and its optional residual (same shape, dtype, device).

    Raises:
        TypeError: ``grad`` or ``residual`` is not a tensor.
        DtypeError: either is not float32 (a ``TypeError`` and a ``ValueError``).
        ValueError: ``grad`` is not 1-D or not contiguous or has more than ``MAX_NUMEL``
            elements; ``residual`` differs from ``grad`` in shape or device, or is not
            contiguous.
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype != torch.float32:
        raise DtypeError(
            f"grad must be a 1-D contiguous float32 tensor, got dtype={grad.dtype}; "
            "cast it with grad.float()"
        )
    if grad.dim() != 1:
        raise ValueError(
            f"grad must be a 1-D contiguous float32 tensor, got shape={tuple(grad.shape)}; "
            "pass a flat bucket, e.g. grad.reshape(-1)"
        )
    if not grad.is_contiguous():
        raise ValueError(
            "grad must be a 1-D contiguous float32 tensor, got a non-contiguous one; "
            "pass grad.contiguous()"
        )
    if grad.numel() > MAX_NUMEL:
        raise ValueError(
            f"grad has {grad.numel()} elements but int32 indices address at most {MAX_NUMEL}; "
            "use smaller buckets"
        )
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    what = "residual must be a contiguous float32 tensor with grad's shape and device"
    if residual.dtype != torch.float32:
        raise DtypeError(f"{what}: got dtype={residual.dtype}")
    if residual.shape != grad.shape:
        raise ValueError(
            f"{what}: got shape={tuple(residual.shape)} for grad of shape={tuple(grad.shape)}"
        )
    if residual.device != grad.device:
        raise ValueError(f"{what}: residual is on {residual.device} but grad is on {grad.device}")
    if not residual.is_contiguous():
        raise ValueError(f"{what}: got a non-contiguous one (it is updated in place)")


def check_count(name: str, value: object, upper: int, what: str) -> int:
    """``value`` as an int in ``[0, upper]``: ``TypeError`` unless it is an integer (a bool
    is not), ``ValueError`` outside the range. ``what`` ends the range message."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a host int, got {type(value).__name__}") from None
    if not 0 <= value <= upper:
        raise ValueError(f"{name} must be in [0, {upper}] {what}, got {name}={value}")
    return value


def check_out(out: torch.Tensor | None, numel: int, device: torch.device) -> None:
    """``out`` (when given) must be a contiguous float32 tensor of ``numel`` elements on
    ``device``: ``TypeError`` for a non-tensor or another dtype, ``ValueError`` otherwise."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    what = f"out must be a contiguous float32 tensor of {numel} elements on {device}"
    if out.dtype != torch.float32:
        raise DtypeError(f"{what}: got dtype={out.dtype}")
    if out.numel() != numel:
        raise ValueError(f"{what}: got {out.numel()} elements (shape {tuple(out.shape)})")
    if out.device != device:
        raise ValueError(f"{what}: got one on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{what}: got a non-contiguous one")
