"""``PerRankAdamW``: AdamW for ``exchange="updates"``, where each rank steps on its own
gradient and the ranks' steps are averaged.

Why: with ``CompressedOptimizer(..., exchange="updates")`` every rank runs the wrapped
optimizer on its own gradient, so plain AdamW divides each coordinate by the root of the
second moment of *one rank's* gradient. Where the gradient is mostly noise, that moment is
about ``W`` times the second moment of the gradient averaged over ``W`` ranks (the noise's
variance falls by ``W`` in the average), so the average of the ``W`` ranks' steps moves such
a coordinate about ``sqrt(W)`` times less than dense AdamW moves it: the ranks' extra data
buys almost nothing. ``PerRankAdamW`` divides by an estimate of the averaged gradient's second
moment instead:

    m_hat = m / (1 - beta1^t)                 (bias-corrected, as in AdamW)
    v_hat = v / (1 - beta2^t)
    v_avg = max(v_hat / W, min(m_hat^2, v_hat))
    p    <- p * (1 - lr * weight_decay) - lr * m_hat / (sqrt(v_avg) + eps)

A coordinate whose gradient is noise with mean ``mu`` and variance ``s^2`` on each rank has
``v_hat ~ mu^2 + s^2`` and, averaged over ``W`` ranks, a second moment ``mu^2 + s^2 / W``;
``v_hat / W`` is that when ``mu`` is small, ``m_hat^2 ~ mu^2`` when the noise is small, and
``v_avg`` is within a factor of two of it in between. It never exceeds ``v_hat``: averaging
cannot make the second moment larger. Since the momentum is linear in the gradient, the
average of the ranks' ``m_hat`` is the momentum of the averaged gradient, and the average of
their steps is then close to dense AdamW's step. With ``W = 1`` this is AdamW (the same bits
as ``torch.optim.AdamW(foreach=False)``).

Measured in the README ("Measured: training quality with AdamW") and ``docs/catchup.md``
("How many ranks").
"""

from __future__ import annotations

import math

import torch

__all__ = ["PerRankAdamW"]


class PerRankAdamW(torch.optim.Optimizer):
    """AdamW whose step, averaged over ``world_size`` ranks that each step on their own
    gradient, approximates dense AdamW's step on the averaged gradient (the module
    docstring gives the update). Use it under ``exchange="updates"``::

        inner = sparsecomm.PerRankAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        opt = sparsecomm.CompressedOptimizer(
            inner, sparsecomm.TopK(0.01, warmup_steps=100, warmup="dense"),
            exchange="updates")

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (decoupled weight decay).
        world_size: how many ranks' steps are averaged. Default ``None``:
            :class:`sparsecomm.CompressedOptimizer` sets it to its process group's size
            when it wraps this optimizer; stepped unwrapped, it is then 1 (AdamW).

    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (like the
    parameter), as ``torch.optim.AdamW`` keeps them. Parameters whose ``.grad`` is None are
    skipped.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        world_size: int | None = None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"PerRankAdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"PerRankAdamW: betas must each be in [0, 1), got {betas}")
        if not 0.0 <= eps:
            raise ValueError(f"PerRankAdamW: eps must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"PerRankAdamW: weight_decay must be >= 0, got {weight_decay}")
        if world_size is not None:
            check_world_size(world_size)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.world_size = world_size

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world_size = self.world_size or 1
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise TypeError(
                        "PerRankAdamW: sparse gradients are not supported; build embeddings "
                        "with sparse=False"
                    )
                self._step_param(param, group, world_size)
        return loss

    def _step_param(self, param: torch.Tensor, group: dict, world_size: int) -> None:
        """One parameter's step, in the operations (and their order) of
        ``torch.optim.AdamW(foreach=False)``, so that ``world_size = 1`` gives its bits."""
        grad = param.grad
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        param.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        # sqrt(v_avg) = max(sqrt(v_hat / W), min(|m_hat|, sqrt(v_hat))), in roots
        root = exp_avg_sq.sqrt() / bias_correction2_sqrt  # sqrt(v_hat)
        if world_size > 1:
            momentum = exp_avg.abs().div_(bias_correction1)  # |m_hat|
            torch.minimum(momentum, root, out=momentum)
            torch.maximum(root.div_(math.sqrt(world_size)), momentum, out=root)
        param.addcdiv_(exp_avg, root.add_(eps), value=-lr / bias_correction1)


def check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"PerRankAdamW: world_size must be an int >= 1 (the number of ranks whose steps "
            f"are averaged), got {world_size!r}"
        )
