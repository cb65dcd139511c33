"""``CatchUpAdamW``'s step of one parameter in one pass (``sparsecomm.catchup``).

The torch version (``sparsecomm.catchup._catch_up``) is the definition: about twenty
elementwise ops, each a kernel launch and a pass over memory. This kernel reads the
parameter, its gradient, both moments and ``last_step`` once (20 bytes per fp32 element)
and writes the parameter back and, only where the gradient is nonzero, the moments and
``last_step``: on a 163M-parameter model, 149 launches a step instead of about 3000. The
results agree with the torch version to float32 rounding, not bit for bit (``exp`` and the
divisions are the GPU's own); every rank runs the same kernel, so ranks stay identical.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def momenta_terms(beta1: float) -> int:
    """How many steps after a coordinate's previous receipt its bias corrections enter its
    momenta term by term: the smallest ``N`` with ``beta1 ** N <= 2 ** -25``, where ``1 -
    beta1 ** N`` rounds to 1 in float32 (165 steps for beta1 = 0.9, 1725 for 0.99), and at
    least 2 (Triton would make an argument of 1 a constant). A coordinate last received
    that late has corrections of 1, exactly in float32. The torch ops
    (``sparsecomm.catchup``) use the same number."""
    if not 0.0 < beta1 < 1.0:
        return 0
    return max(2, math.ceil(25.0 / -math.log2(beta1)))


BLOCK_SIZE = 2048  # elements per program; an elementwise pass, 8 per thread with 8 warps
NUM_WARPS = 8


@triton.jit
def _one_minus_exp(x):
    """``1 - exp(x)`` for ``x <= 0`` (``-expm1(x)``), to float32 precision also near 0,
    where ``1.0 - tl.exp(x)`` would cancel: for ``x > -0.5`` the Taylor series, whose terms
    after ``x**9`` are below ``6e-10`` of the sum; below, ``exp(x) <= 0.61`` and the
    subtraction loses at most a bit."""
    series = 1.0 + x * (1.0 / 9.0)
    series = 1.0 + x * (1.0 / 8.0) * series
    series = 1.0 + x * (1.0 / 7.0) * series
    series = 1.0 + x * (1.0 / 6.0) * series
    series = 1.0 + x * (1.0 / 5.0) * series
    series = 1.0 + x * (1.0 / 4.0) * series
    series = 1.0 + x * (1.0 / 3.0) * series
    series = 1.0 + x * 0.5 * series
    return tl.where(x > -0.5, -x * series, 1.0 - tl.exp(x))


@triton.jit
def _catch_up_adamw_kernel(
    param_ptr,
    grad_ptr,
    avg_ptr,
    avg_sq_ptr,
    last_ptr,
    n,
    step,
    decay,
    ln_beta1,
    ln_beta2,
    beta1,
    momenta_ratio,
    lr,
    bias_correction2,
    eps,
    momenta_terms,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n
    g = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offsets, mask=in_bounds, other=0.0)
    work = p.to(tl.float32) * decay  # the decoupled weight decay, on every coordinate
    received = g != 0.0
    touch = in_bounds & received
    m = tl.load(avg_ptr + offsets, mask=touch, other=0.0)
    v = tl.load(avg_sq_ptr + offsets, mask=touch, other=0.0)
    last = tl.load(last_ptr + offsets, mask=touch, other=0)
    tau = (step - last).to(tl.float32)
    tau = tl.where(received, tau, 1.0)  # (unread where nothing was received)
    g = g / tau
    # 1 - beta ** tau: the weight of the tau steps' gradient in each moment (1 - 0.999 formed
    # in float32 would keep 4 of its digits)
    keep1 = _one_minus_exp(tau * ln_beta1)
    keep2 = _one_minus_exp(tau * ln_beta2)
    # The weight of the old momentum's bias-corrected excess in the tau steps' momenta: the
    # geometric sum, plus the bias corrections' share for the first momenta_terms steps (as
    # many as this block's longest wait needs).
    weights = keep1 * momenta_ratio
    young = touch & (last < momenta_terms)
    x = tl.where(young, tl.exp(last.to(tl.float32) * ln_beta1), 0.0)
    excess = m - (1.0 - x) * g
    # (only for a coordinate last received before step momenta_terms: later ones' corrections
    # are 1 in float32, and late in training the loop runs no turn)
    wait = tl.where(young, tl.minimum(tau, momenta_terms.to(tl.float32)), 0.0)
    terms = tl.max(wait, axis=0).to(tl.int32)
    bk = 1.0
    for k in range(1, terms + 1):
        x = x * beta1
        bk = bk * beta1
        weights += tl.where(wait >= k, (bk * x) / (1.0 - x), 0.0)
    momenta = tau * g + excess * weights
    new_m = m + keep1 * (g - m)
    new_v = v + keep2 * (g * g - v)
    denom = tl.sqrt(new_v / bias_correction2) + eps
    work = tl.where(received, work - momenta / denom * lr, work)
    # The step stored into last_step does not depend on the value loaded from there, so with
    # 16-bit parameters (where Triton may store with another layout than it loaded, and so
    # from another thread) nothing else would order every thread's load before the stores.
    tl.debug_barrier()
    tl.store(param_ptr + offsets, work.to(p.dtype), mask=in_bounds)
    tl.store(avg_ptr + offsets, new_m, mask=touch)
    tl.store(avg_sq_ptr + offsets, new_v, mask=touch)
    tl.store(last_ptr + offsets, tl.zeros_like(last) + step, mask=touch)


def catch_up_adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    last_step: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One ``CatchUpAdamW`` step of one parameter, in place, as one Triton kernel.

    Args:
        param: contiguous float32, bfloat16 or float16 parameter (updated in place).
        grad: its gradient, contiguous, of ``param``'s shape (any float dtype).
        exp_avg, exp_avg_sq: contiguous float32 moments of ``param``'s shape (updated).
        last_step: contiguous int32 of ``param``'s shape: the step at which each coordinate
            last had a nonzero gradient (updated).
        step: this step's number, counting from 1; larger than every ``last_step``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``; betas in (0, 1).
    """
    beta1, beta2 = betas
    for name, tensor in (
        ("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
        ("last_step", last_step),
    ):  # fmt: skip
        if tensor.shape != param.shape or not tensor.is_contiguous():
            raise ValueError(
                f"catch_up_adamw: {name} must be contiguous and shaped like param "
                f"{tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise TypeError("catch_up_adamw: exp_avg and exp_avg_sq must be float32")
    if last_step.dtype != torch.int32:
        raise TypeError(f"catch_up_adamw: last_step must be int32, got {last_step.dtype}")
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"catch_up_adamw: betas must be in (0, 1), got {betas}")
    n = param.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _catch_up_adamw_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        last_step,
        n,
        step,
        1.0 - lr * weight_decay,
        math.log(beta1),
        math.log(beta2),
        beta1,
        beta1 / (1.0 - beta1),
        lr,
        1.0 - beta2**step,
        eps,
        momenta_terms(beta1),
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
