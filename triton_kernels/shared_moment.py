"""``SharedMomentAdamW``'s step of many parameters in one launch (``sparsecomm.shared_moment``).

The torch version (``SharedMomentAdamW._step_group``) is the definition: about a dozen
foreach ops over a group's tensors, each a pass over memory. This kernel reads each
parameter, its gradient, both moments and the shared moment once (20 bytes per float32
element) and writes the parameter and the moments back (12 bytes), for every tensor of the
launch: one program per ``BLOCK_SIZE`` elements of one tensor, which finds its tensor's
buffers in a table of addresses (the tensors need not be adjacent in memory). The results
agree with the torch ops to float32 rounding (the multiply-adds may fuse), not bit for bit;
every rank runs the same kernel, so ranks stay identical.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 2048  # elements per program; an elementwise pass, 8 per thread with 8 warps
NUM_WARPS = 8
# Columns of the address table: the parameter, its gradient, exp_avg, exp_avg_sq and the
# shared moment (0: none, then the rank's own second moment alone is the denominator's).
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, SHARED = (tl.constexpr(i) for i in range(5))
COLUMNS = tl.constexpr(5)
# Columns of the per-tensor scalars: the step size (-lr / bias correction 1), the
# denominator's scale (bias correction 2, times W with the shared moment) and the shared
# moment's factor (that scale over the shared moment's weight; 0 without one).
STEP_SIZE, SCALE, FACTOR = (tl.constexpr(i) for i in range(3))
SCALARS = tl.constexpr(3)


@triton.jit
def _shared_moment_adamw_kernel(
    addresses_ptr,  # int64 [T, COLUMNS]
    scalars_ptr,  # float32 [T, SCALARS]
    numels_ptr,  # int64 [T], kept with the two below (a model's sizes do not change)
    first_block_ptr,  # int32 [T]: the first program of each tensor
    block_tensor_ptr,  # int32 [programs]: each program's tensor
    param_like,  # the first parameter and gradient: their pointer types, for the others'
    grad_like,
    beta1,
    beta2,
    one_minus_beta1,  # from the host, in double: 1 - beta2 in float32 would lose ~5 digits
    one_minus_beta2,
    eps,
    decay,
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes: vectorised loads
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid).to(tl.int64)
    block = pid - tl.load(first_block_ptr + t)
    n = tl.load(numels_ptr + t)
    offsets = block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n
    row = addresses_ptr + t * COLUMNS
    param_ptr = tl.load(row + PARAM).to(param_like.dtype)
    grad_ptr = tl.load(row + GRAD).to(grad_like.dtype)
    avg_ptr = tl.load(row + EXP_AVG).to(tl.pointer_type(tl.float32))
    avg_sq_ptr = tl.load(row + EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    shared_address = tl.load(row + SHARED)
    shared_ptr = shared_address.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        avg_ptr = tl.multiple_of(avg_ptr, 16)
        avg_sq_ptr = tl.multiple_of(avg_sq_ptr, 16)
        shared_ptr = tl.multiple_of(shared_ptr, 16)
    step_size = tl.load(scalars_ptr + t * SCALARS + STEP_SIZE)
    scale = tl.load(scalars_ptr + t * SCALARS + SCALE)
    factor = tl.load(scalars_ptr + t * SCALARS + FACTOR)

    g = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offsets, mask=in_bounds, other=0.0)
    m = tl.load(avg_ptr + offsets, mask=in_bounds, other=0.0)
    v = tl.load(avg_sq_ptr + offsets, mask=in_bounds, other=0.0)
    # Without a shared moment nothing is read there and max(+0.0, v) is v (v >= 0, and NaN
    # propagates).
    has_shared = (offsets * 0 + shared_address) != 0  # (a block of it: the interpreter's masks)
    s = tl.load(shared_ptr + offsets, mask=in_bounds & has_shared, other=0.0)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.maximum(s * factor, v, propagate_nan=tl.PropagateNan.ALL)
    denom = tl.sqrt_rn(tl.div_rn(denom, scale)) + eps
    work = p.to(tl.float32) * decay + step_size * tl.div_rn(m, denom)
    tl.store(param_ptr + offsets, work.to(p.dtype), mask=in_bounds)
    tl.store(avg_ptr + offsets, m, mask=in_bounds)
    tl.store(avg_sq_ptr + offsets, v, mask=in_bounds)


@functools.lru_cache(maxsize=16)
def _blocks(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(the sizes, the first program of each tensor, each program's tensor) for tensors of
    ``numels``, on ``device``."""
    counts = torch.tensor([triton.cdiv(n, BLOCK_SIZE) for n in numels], dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts
    owner = torch.repeat_interleave(torch.arange(len(numels)), counts)
    sizes = torch.tensor(numels, dtype=torch.int64)
    return sizes.to(device), first.to(torch.int32).to(device), owner.to(torch.int32).to(device)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # pinned, so that the copy does not wait for the device
        return host.pin_memory().to(device, non_blocking=True)
    return host


def shared_moment_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    shareds: list[torch.Tensor | None],
    scalars: list[tuple[float, float, float]],
    *,
    betas: tuple[float, float],
    eps: float,
    decay: float,
) -> None:
    """One ``SharedMomentAdamW`` step of ``params`` (in place, with their moments), as one
    Triton launch.

    Per tensor ``i``, with ``(step_size, scale, factor) = scalars[i]``::

        m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2
        d <- sqrt(max(shared * factor, v) / scale) + eps   (v alone where shared is None)
        p <- p * decay + step_size * m / d

    Args:
        params: contiguous parameters, all of one dtype (float32, bfloat16 or float16) on
            one device.
        grads: their gradients, contiguous, all of one float dtype.
        exp_avgs, exp_avg_sqs: contiguous float32 moments (updated).
        shareds: contiguous float32 shared moments, or None for a tensor without one.
        scalars: per tensor, ``(step_size, scale, factor)`` as above.
        betas, eps, decay: AdamW's betas and eps, and ``1 - lr * weight_decay``.
    """
    if not params:
        return
    device = params[0].device
    for name, tensors in (
        ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
        ("shareds", shareds), ("scalars", scalars),
    ):  # fmt: skip
        if len(tensors) != len(params):
            raise ValueError(f"shared_moment_adamw: {len(params)} params but {len(tensors)} {name}")
    rows = []
    for param, grad, m, v, shared in zip(params, grads, exp_avgs, exp_avg_sqs, shareds):
        for tensor in (grad, m, v, shared):
            if tensor is not None and (
                tensor.shape != param.shape or not tensor.is_contiguous() or tensor.device != device
            ):
                raise ValueError(
                    "shared_moment_adamw: every gradient and moment must be contiguous, on "
                    f"the parameters' device and shaped like its parameter {tuple(param.shape)}"
                )
        if param.dtype != params[0].dtype or grad.dtype != grads[0].dtype:
            raise TypeError("shared_moment_adamw: one dtype for the params, one for the grads")
        if (
            m.dtype != torch.float32
            or v.dtype != torch.float32
            or (shared is not None and shared.dtype != torch.float32)
        ):
            raise TypeError("shared_moment_adamw: the moments must be float32")
        if not param.is_contiguous():
            raise ValueError("shared_moment_adamw: the parameters must be contiguous")
        rows.append([t.data_ptr() for t in (param, grad, m, v)])
        rows[-1].append(0 if shared is None else shared.data_ptr())
    numels = tuple(param.numel() for param in params)
    if not sum(numels):
        return
    sizes, first, owner = _blocks(numels, device)
    aligned = all(address % 16 == 0 for row in rows for address in row)
    addresses = _to_device(rows, torch.int64, device)
    values = _to_device([list(s) for s in scalars], torch.float32, device)
    beta1, beta2 = betas
    _shared_moment_adamw_kernel[(owner.numel(),)](
        addresses,
        values,
        sizes,
        first,
        owner,
        params[0],
        grads[0],
        beta1,
        beta2,
        1.0 - beta1,
        1.0 - beta2,
        eps,
        decay,
        ALIGNED=aligned,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
