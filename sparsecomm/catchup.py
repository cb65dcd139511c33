"""``CatchUpAdamW``: AdamW for gradients that arrive in bursts, as top-k with error feedback
delivers them.

Why: under ``TopK`` or ``Threshold`` with error feedback a coordinate is sent once every
``tau`` steps, carrying the sum of the ``tau`` gradients it held back. Plain AdamW divides
each coordinate by the root of its own second moment, so it moves such a coordinate by
about one step's worth per burst, where the dense gradient would have moved it ``tau``
steps' worth (``docs/catchup.md`` works the numbers). ``CatchUpAdamW`` credits the steps a
coordinate missed: a coordinate whose averaged gradient ``g`` is nonzero at step ``t``,
after ``tau - 1`` steps at exactly zero (``tau = t - last``, ``last`` the step it last
received something, 0 at the start), takes the ``tau`` AdamW steps it would have taken on a
constant gradient ``g / tau``, at once:

    g' = g / tau
    m_s = beta1^s * m + (1 - beta1^s) * g'        the momentum after s of the tau steps
    S   = sum over s = 1..tau of m_s / (1 - beta1^(last + s))
        = tau * g' + (m - (1 - beta1^last) * g') * sum over s of beta1^s / (1 - beta1^(last + s))
    m  <- m_tau
    v  <- beta2^tau * v + (1 - beta2^tau) * g'^2
    p  <- p - lr * S / (sqrt(v / (1 - beta2^t)) + eps)

``S`` is the sum of the ``tau`` steps' bias-corrected momenta, each with its own step's
correction, as AdamW would have taken them (its second form is what runs: the geometric sum
in closed form, the corrections' share term by term for the first ``momenta_terms(beta1)``
steps, 165 for beta1 = 0.9, for a coordinate last received before that step: later, the
corrections are 1 in float32, ``beta1`` to that power being at most ``2^-25``);
the new ``v`` and step ``t``'s correction stand for the ``tau`` steps' second moments. A
coordinate whose gradient is zero is left alone (its moments and ``last`` too) but for the
decoupled weight decay ``p <- p * (1 - lr * weight_decay)``, which every coordinate takes
every step, as in AdamW. With ``tau = 1`` (a coordinate that receives something every step:
dense exchange, ``Cast``, the small parameters that travel dense, a dense warm-up) this is
AdamW's update.

Every rank receives the same average, so every rank's ``CatchUpAdamW`` takes the same steps:
the ranks stay identical, and the optimizer state is one state, not one per rank (unlike
``exchange="updates"``). The measurements behind it are in the README ("Measured: training
quality with AdamW").
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _ops
from .triton_kernels import catchup as _kernel
from .triton_kernels._cpu import CHUNK

__all__ = ["CatchUpAdamW"]

# The Triton kernel, until it fails here: torch ops from then on.
_KERNEL = _ops.KernelSwitch("CatchUpAdamW")

#: ``momenta_terms(beta1)``: steps after a coordinate's previous receipt whose bias
#: corrections enter its momenta term by term, for a coordinate last received before that
#: step (see ``_momenta_weights``); the others are 1 in float32. The Triton kernel's number.
momenta_terms = _kernel.momenta_terms


class CatchUpAdamW(torch.optim.Optimizer):
    """AdamW that moves a coordinate whose gradient arrives after ``tau - 1`` steps of zeros
    by the ``tau`` steps it missed (see the module docstring for the update).

    Wrap it like any optimizer::

        inner = sparsecomm.CatchUpAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.01, warmup_steps=100))

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (decoupled weight decay).

    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (float32, whatever
    the parameter's dtype) and ``last_step`` (int32: the step at which each coordinate last
    had a nonzero gradient). Parameters whose ``.grad`` is None are skipped, as AdamW does.

    Warning:
        Measure it against dense AdamW on your model first: on a 3.3M-parameter char-LM it
        stalled at 1% density and diverged at 0.1% where ``exchange="updates"`` with plain
        AdamW kept up (``docs/catchup.md``, "Where it fails").
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        _check_hyper(lr, betas, eps, weight_decay, where="CatchUpAdamW")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; refuses the group's hyperparameters
        as the constructor does, and parameters that are not float32, float16 or bfloat16
        (the moments and the step are float32: a float64 or complex parameter would be
        rounded or lose its imaginary part)."""
        super().add_param_group(
            checked_adam_group(
                "CatchUpAdamW", self.defaults, param_group, "step it with torch.optim.AdamW, or "
            )
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise TypeError(
                        "CatchUpAdamW: sparse gradients are not supported; build embeddings "
                        "with sparse=False"
                    )
                self._step_param(param, group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the moments stay float32 and
        ``last_step`` int32: torch casts every state tensor but ``step`` to its parameter's
        dtype, and a bf16 ``last_step`` would lose step numbers above 256. A state without
        ``CatchUpAdamW``'s keys (another optimizer's) is refused before anything changes."""
        for index, saved in state_dict["state"].items():
            if not saved:  # (an empty entry: a parameter never stepped, looked up since)
                continue
            missing = [k for k in ("step", "exp_avg", "exp_avg_sq", "last_step") if k not in saved]
            if missing:
                raise ValueError(
                    f"CatchUpAdamW.load_state_dict: the state of parameter {index} has no "
                    f"{', '.join(missing)}: it is not a CatchUpAdamW state (keys: "
                    f"{sorted(saved)}). Load the state_dict() of a CatchUpAdamW, or start "
                    "this optimizer fresh"
                )
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            for key in ("exp_avg", "exp_avg_sq", "last_step"):
                if key in saved:
                    self.state[param][key] = saved[key].to(device=param.device, copy=True)

    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["step"] = 0
            zeros = dict(device=param.device, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(param.shape, **zeros)
            state["exp_avg_sq"] = torch.zeros(param.shape, **zeros)
            state["last_step"] = torch.zeros(param.shape, device=param.device, dtype=torch.int32)
        state["step"] += 1
        catch_up_adamw_(
            param,
            param.grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["last_step"],
            step=state["step"],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def checked_adam_group(name: str, defaults: dict, param_group: dict, fix: str = "") -> dict:
    """``param_group`` for ``torch.optim.Optimizer.add_param_group`` of the AdamW variant
    ``name``, its parameters listed (a generator read once), after refusing its
    hyperparameters as the constructor does and parameters that are not float32, float16
    or bfloat16 (the moments are float32: a float64 or complex parameter would be rounded
    or lose its imaginary part). ``fix``: what the TypeError suggests before converting."""
    group = {**defaults, **param_group}
    _check_hyper(
        group["lr"], group["betas"], group["eps"], group["weight_decay"],
        where=f"{name} parameter group",
    )  # fmt: skip
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif not isinstance(params, set):  # (torch refuses a set: its order varies by run)
        params = list(params)
        param_group = {**param_group, "params": params}
    for param in params:
        if isinstance(param, torch.Tensor) and param.dtype not in _DTYPES:
            raise TypeError(
                f"{name} steps float32, float16 and bfloat16 parameters, got one of "
                f"{param.dtype}; {fix}convert the model (model.float())"
            )
    return param_group


def _check_hyper(lr, betas, eps, weight_decay, where: str) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{where}: betas must be two numbers, each in [0, 1), got {betas}")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: eps must be >= 0, got {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay}")


def catch_up_adamw_(
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
    """One :class:`CatchUpAdamW` step of one parameter, in place (``param``, the moments and
    ``last_step``, float32 and int32, contiguous). ``step``: this step's number, counting
    from 1.

    On CUDA, one Triton kernel (``triton_kernels/catchup.py``; ``SPARSECOMM_KERNELS=torch``
    runs the torch ops below instead, over the whole parameter, with one host
    synchronisation: the longest wait to catch up term by term). On a CPU, where the host
    learns for free how many coordinates received something, over those alone when they
    are fewer than half (behind ``TopK``, most steps): the catch-up's arithmetic, two
    exponentials per coordinate among it, then costs in proportion to what was sent; else
    over every coordinate, in chunks."""
    if _KERNEL.wanted(param) and min(betas) > 0 and param.is_contiguous():
        try:
            _kernel.catch_up_adamw(
                param, grad.contiguous(), exp_avg, exp_avg_sq, last_step, step=step, lr=lr,
                betas=betas, eps=eps, weight_decay=weight_decay,
            )  # fmt: skip
            return
        except Exception as error:  # (Triton's errors have no common type)
            _KERNEL.fail(error)
    in_place = param.dtype == torch.float32 and param.is_contiguous()
    work = param if in_place else param.float().contiguous()
    flat = [t.detach().view(-1) for t in (work, exp_avg, exp_avg_sq, last_step)]
    flat.insert(0, grad.detach().float().reshape(-1))
    hyper = step, lr, betas, eps
    work.mul_(1.0 - lr * weight_decay)
    if grad.is_cuda:
        _catch_up_all(*flat, *hyper)
    elif not _catch_up_few(*flat, *hyper):
        # In the CPU paths' chunks, whose temporaries stay in cache (whole-tensor temporaries
        # are fresh pages on every op: several times slower on a CPU).
        for start in range(0, flat[0].numel(), CHUNK):
            _catch_up_all(*(t[start : start + CHUNK] for t in flat), *hyper)
    if work is not param:
        param.copy_(work)


def _catch_up_few(g, work, exp_avg, exp_avg_sq, last_step, *hyper) -> bool:
    """On a CPU: the catch-up of the coordinates that received something, gathered, if they
    are fewer than half (else nothing: returns False). numpy's comparison, flatnonzero and
    fancy indexing take a third to half of torch's time here; the arithmetic stays torch's."""
    g, work, exp_avg, exp_avg_sq, last_step = (
        t.numpy() for t in (g, work, exp_avg, exp_avg_sq, last_step)
    )
    where = np.flatnonzero(g != 0)
    if where.size >= g.size // 2:
        return False
    gathered = (torch.from_numpy(a[where]) for a in (g, exp_avg, exp_avg_sq, last_step))
    update, new_avg, new_avg_sq = _catch_up(*gathered, *hyper)
    work[where] -= update.numpy()
    exp_avg[where] = new_avg.numpy()
    exp_avg_sq[where] = new_avg_sq.numpy()
    last_step[where] = hyper[0]
    return True


def _catch_up_all(g, work, exp_avg, exp_avg_sq, last_step, *hyper) -> None:
    """The catch-up over every coordinate, kept where the gradient is nonzero."""
    received = g != 0
    update, new_avg, new_avg_sq = _catch_up(g, exp_avg, exp_avg_sq, last_step, *hyper)
    work.sub_(update.masked_fill_(~received, 0.0))
    torch.where(received, new_avg, exp_avg, out=exp_avg)
    torch.where(received, new_avg_sq, exp_avg_sq, out=exp_avg_sq)
    last_step.masked_fill_(received, hyper[0])


def _catch_up(g, exp_avg, exp_avg_sq, last_step, step, lr, betas, eps):
    """The catch-up of coordinates with gradient ``g`` (see the module docstring): their
    parameter update (to subtract) and new moments. Elementwise; what it computes for a
    coordinate with a zero gradient is not used."""
    beta1, beta2 = betas
    tau = (step - last_step).float()  # >= 1: last_step is at most step - 1
    g = g / tau
    # 1 - beta ** tau, the weight of the tau steps' gradient in each moment, as -expm1(tau *
    # ln(beta)): 1 - beta2 formed in float32 would keep only 4 of its digits (beta2 = 0.999)
    keep1 = _one_minus_power(beta1, tau)
    keep2 = _one_minus_power(beta2, tau)
    last = last_step.float()
    # beta1^last, 1 minus the old momentum's bias correction, for a coordinate last received
    # before step momenta_terms(beta1); a later one's corrections are 1 in float32
    limit = momenta_terms(beta1)
    young = last < limit
    start = torch.where(young, _power(beta1, last), torch.zeros_like(last))
    weights = _momenta_weights(beta1, tau, young, start, keep1, limit)
    # The bias-corrected momenta of the tau steps, summed.
    momenta = torch.addcmul(tau * g, exp_avg - (1.0 - start) * g, weights)
    new_avg = torch.lerp(exp_avg, g, keep1)
    new_avg_sq = torch.lerp(exp_avg_sq, g * g, keep2)
    denom = new_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps)
    return momenta.div_(denom).mul_(lr), new_avg, new_avg_sq


def _power(beta: float, exponent: torch.Tensor) -> torch.Tensor:
    """``beta ** exponent`` for exponents >= 0 (``0 ** 0`` is 1), as ``exp2(exponent *
    log2(beta))``: within an ulp, and on a CPU 8x faster than ``pow``."""
    if beta > 0:
        return torch.exp2(exponent * math.log2(beta))
    return (exponent == 0).float()


def _one_minus_power(beta: float, exponent: torch.Tensor) -> torch.Tensor:
    """``1 - beta ** exponent`` for exponents >= 1, without the cancellation of forming
    ``beta ** exponent`` first (docs/catchup.md, "Rounding")."""
    if beta > 0:
        return torch.expm1(exponent * math.log(beta)).neg_()
    return torch.ones_like(exponent)


def _momenta_weights(beta1, tau, young, start, keep1, limit) -> torch.Tensor:
    """``sum over k = 1..tau of beta1^k / (1 - beta1^(last + k))``: the weight of the old
    momentum's bias-corrected excess in the momenta of the tau steps. The geometric sum in
    closed form, plus, for a coordinate last received before step ``limit`` (``momenta_terms``),
    the bias corrections' share term by term for the first ``min(tau, limit)`` steps (later
    terms are below ``beta1^(2 limit)``): as many as the longest wait needs, read by the
    host (on CUDA a sync, but late in training no turn at all, where ``limit`` turns of
    seven launches each would cost far more)."""
    weights = keep1 * (beta1 / (1.0 - beta1)) if beta1 > 0 else torch.zeros_like(tau)
    if beta1 == 0:
        return weights
    # Only a coordinate last received within the first `limit` steps has corrections that
    # matter: later, 1 - beta1^(last + k) is 1 in float32.
    wait = torch.where(young, tau.clamp(max=limit), torch.zeros_like(tau))
    terms = int(wait.max().item()) if wait.numel() else 0
    x = start  # beta1^(last + k) as k goes
    bk = 1.0
    for k in range(1, terms + 1):
        x = x * beta1
        bk *= beta1
        share = (bk * x) / (1.0 - x)  # beta1^k (1 / (1 - beta1^(last + k)) - 1)
        weights += torch.where(wait >= k, share, torch.zeros_like(share))
    return weights
