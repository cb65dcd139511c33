"""``SharedMomentAdamW``: AdamW for the update exchanges, with a second moment every rank shares.

Why: with ``exchange="updates"`` or ``"local_updates"`` each rank steps its own AdamW on its
own gradient ``g_i``, and the ranks average the updates. The first moment is linear, so the
average of the ranks' momenta is the momentum of the averaged gradient. The second moment is
not: each rank divides by ``v_i``, the second moment of its own gradient, which holds that
rank's noise in full, where dense AdamW divides by the second moment of the *average*, in
which the ranks' noise partly cancels. On a coordinate whose gradient is mostly noise, the
average of the ranks' steps is then up to ``sqrt(W)`` times smaller than dense AdamW's
(``docs/adamw.md``, "The shared second moment").

``SharedMomentAdamW`` keeps AdamW's moments per rank and, beside them, ``shared_exp_avg_sq``:
the second moment of the ranks' averaged gradient, the same bits on every rank. Every
``refresh_every`` steps the wrapping :class:`~sparsecomm.CompressedOptimizer` hands it that
average (one dense all-reduce of the gradients, in bfloat16 by default, counted in
``StepStats.bytes_sent``), and
the shared moment takes it in as AdamW's would, for the steps since the last refresh::

    d = beta2^(steps since the last refresh)
    shared <- d * shared + (1 - d) * average^2;   weight <- d * weight + (1 - d)
    denominator = sqrt(max(shared / weight, v_hat / W)) + eps

``v_hat / W`` (the rank's own bias-corrected second moment over the number of ranks, a lower
bound of the averaged gradient's in expectation) keeps a coordinate that had no gradient at
the last refresh (an embedding row first seen since) from dividing by zero. Then, as AdamW::

    p <- p * (1 - lr * weight_decay) - lr * m_hat / denominator

With one rank, or used without a wrapper (which says before each step how many ranks step
together: :meth:`SharedMomentAdamW.set_world_size`), the denominator is AdamW's own,
``sqrt(v_hat) + eps``, and the optimizer is AdamW. The floor binds where this rank's
second moment exceeds ``W`` times the shared one: on coordinates the last refresh did not
see, and where the ranks' gradients disagree (in one step with two ranks, where one rank's
gradient is over ``sqrt(2)`` times the average: a quarter of the coordinates in the
test's small model, whose ranks share most of their loss); there the step is smaller than
dense AdamW's. Where it does not bind, the average of the ranks' steps is dense AdamW's
step on the averaged gradient (to the staleness of the last refresh and to rounding).

Use it with ``exchange="local_updates"`` (or ``"updates"``); with the gradient exchange every
rank already steps on the average, and the wrapper refuses it.
"""

from __future__ import annotations

import torch

from . import _ops
from .catchup import _check_hyper, checked_adam_group
from .triton_kernels import shared_moment as _kernel

__all__ = ["SharedMomentAdamW"]

# What torch's Optimizer.__getstate__ would drop.
_OWN = ("refresh_every", "average_dtype", "steps", "world_size")
# The Triton kernel, until it fails here: torch ops from then on.
_KERNEL = _ops.KernelSwitch("SharedMomentAdamW")
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "shared_exp_avg_sq", "shared_weight", "shared_at")


class SharedMomentAdamW(torch.optim.Optimizer):
    """AdamW whose second moment comes from the ranks' averaged gradient, shared by every rank
    (see the module docstring for the update).

    Wrap it with an update exchange::

        inner = sparsecomm.SharedMomentAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        opt = sparsecomm.CompressedOptimizer(
            inner, sparsecomm.TopK(0.01, warmup_steps=100), exchange="local_updates"
        )

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (decoupled weight decay).
        refresh_every: steps between refreshes of the shared second moment (the first step
            is one). Each refresh all-reduces every gradient in ``average_dtype``, 2 bytes
            per parameter in bfloat16: ``refresh_every=10`` adds 0.2 bytes per parameter
            and step.
        average_dtype: what the gradients are summed in at a refresh: ``torch.bfloat16``
            (default; the second moment needs no more than its 8 bits of precision, and it
            has float32's range) or ``torch.float32`` (4 bytes per parameter).

    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (this rank's AdamW
    moments), ``shared_exp_avg_sq`` (the shared second moment, not yet divided by
    ``shared_weight``), ``shared_weight`` (float) and ``shared_at`` (the step of its last
    refresh); the moments are float32 whatever the parameter's dtype. Parameters whose
    ``.grad`` is None are skipped, as AdamW does, and the wrapper leaves a parameter that no
    rank has a gradient for out of a refresh.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        refresh_every: int = 10,
        average_dtype: torch.dtype = torch.bfloat16,
    ):
        _check_hyper(lr, betas, eps, weight_decay, where="SharedMomentAdamW")
        if average_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"SharedMomentAdamW: average_dtype must be torch.bfloat16 (the default) or "
                f"torch.float32 (float16 would overflow on gradients over 65504), got "
                f"{average_dtype!r}"
            )
        #: What the ranks' gradients are summed in at a refresh.
        self.average_dtype = average_dtype
        whole = isinstance(refresh_every, int) and not isinstance(refresh_every, bool)
        if not whole or refresh_every < 1:
            raise ValueError(
                f"SharedMomentAdamW: refresh_every must be an int >= 1 (steps between refreshes "
                f"of the shared second moment), got {refresh_every!r}"
            )
        self.refresh_every = refresh_every
        #: Steps taken (``step()`` calls); the shared moment is refreshed when it is a
        #: multiple of ``refresh_every``.
        self.steps = 0
        #: Ranks stepping together, as the wrapper last said (:meth:`set_world_size`); with
        #: one the shared moment is not used and the optimizer is AdamW.
        self.world_size = 1
        self._averages: dict[torch.Tensor, torch.Tensor] | None = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; refuses the group's hyperparameters
        as the constructor does, and parameters that are not float32, float16 or bfloat16."""
        super().add_param_group(checked_adam_group("SharedMomentAdamW", self.defaults, param_group))

    # ------------------------------------------------------------ the wrapper's protocol

    def average_gradient_due(self) -> bool:
        """Whether the next :meth:`step` refreshes the shared second moment: the wrapper
        then hands it the ranks' averaged gradient first (:meth:`take_average_gradient`)."""
        return self.steps % self.refresh_every == 0

    def set_world_size(self, world_size: int) -> None:
        """How many ranks step together: the wrapper says so before every step. With one
        (or before the wrapper says otherwise) the shared moment is left out."""
        self.world_size = int(world_size)

    def take_average_gradient(self, sums: dict[torch.Tensor, torch.Tensor]) -> None:
        """The sum over the ranks of each parameter's gradient (in ``average_dtype``, shaped
        like it; ``world_size`` ranks), for the next :meth:`step` to take into the shared
        moment as their average."""
        self._averages = sums

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        averages, self._averages = self._averages or {}, None
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise TypeError(
                "SharedMomentAdamW: sparse gradients are not supported; build embeddings "
                "with sparse=False"
            )
        self.steps += 1
        for group in self.param_groups:
            stepped = []
            for param in group["params"]:
                average = averages.get(param)
                if param.grad is None and average is None:
                    continue
                state = self._state_of(param)
                if average is not None:
                    self._refresh(state, average, group["betas"][1])
                if param.grad is not None:
                    stepped.append(param)
            if _batched(stepped):  # few launches for many tensors
                self._step_group(stepped, group)
            else:  # a CPU: each tensor's ops while it is in cache (faster than foreach)
                for param in stepped:
                    self._step_group([param], group)
        return loss

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            zeros = dict(device=param.device, dtype=torch.float32)
            state["step"] = 0
            state["exp_avg"] = torch.zeros(param.shape, **zeros)
            state["exp_avg_sq"] = torch.zeros(param.shape, **zeros)
            state["shared_exp_avg_sq"] = torch.zeros(param.shape, **zeros)
            state["shared_weight"] = 0.0
            state["shared_at"] = 0
        return state

    def _refresh(self, state: dict, total: torch.Tensor, beta2: float) -> None:
        decay = beta2 ** (self.steps - state["shared_at"])
        average = total.to(torch.float32).div_(self.world_size)
        shared = state["shared_exp_avg_sq"]
        shared.mul_(decay).addcmul_(average, average, value=1.0 - decay)
        state["shared_weight"] = decay * state["shared_weight"] + (1.0 - decay)
        state["shared_at"] = self.steps

    def _step_group(self, params: list[torch.Tensor], group: dict) -> None:
        """AdamW's step with the shared denominator for ``params`` (one group's, each with a
        gradient, all on one device). On CUDA one Triton launch per dtype for all of them
        (``triton_kernels/shared_moment.py``; ``SPARSECOMM_KERNELS=torch``: the torch ops
        below, a dozen foreach launches); on a CPU the torch ops, tensor by tensor."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        # Per tensor: the step size, the denominator's scale and the shared moment's factor
        # (0: none yet, or one rank). The denominator sqrt(max(shared / weight, v / (c2 W)))
        # with one division: the larger of shared * (c2 W / weight) and v, over c2 W (c2:
        # the bias correction); without the shared moment sqrt(v / c2).
        scalars = []
        for state in states:
            state["step"] += 1
            correction2 = 1.0 - beta2 ** state["step"]
            weight = state["shared_weight"]
            shared = weight > 0.0 and self.world_size > 1
            scale = correction2 * self.world_size if shared else correction2
            step_size = -group["lr"] / (1.0 - beta1 ** state["step"])
            scalars.append((step_size, scale, scale / weight if shared else 0.0))
        rest = range(len(params))
        if _KERNEL.wanted(params[0]):
            rest = self._step_kernel(params, states, scalars, group)
        if rest:
            self._step_foreach(*_pick(rest, params, states, scalars), group)

    def _step_kernel(self, params, states, scalars, group) -> list[int]:
        """The step in Triton launches, one per (parameter dtype, gradient dtype). Returns
        the positions left to the torch ops: a parameter that is not contiguous (rare), and
        every one not yet stepped once a launch has failed."""
        kinds: dict[tuple, list[int]] = {}
        rest = []
        for i, param in enumerate(params):
            if param.is_contiguous():
                kinds.setdefault((param.dtype, param.grad.dtype), []).append(i)
            else:
                rest.append(i)
        for members in kinds.values():
            if _KERNEL.failed:
                rest += members
                continue
            # (a factor of 0: no shared moment in use for that tensor)
            shareds = [states[i]["shared_exp_avg_sq"] if scalars[i][2] else None for i in members]
            try:
                _kernel.shared_moment_adamw(
                    [params[i].detach() for i in members],
                    [params[i].grad.contiguous() for i in members],
                    [states[i]["exp_avg"] for i in members],
                    [states[i]["exp_avg_sq"] for i in members],
                    shareds,
                    [scalars[i] for i in members],
                    betas=group["betas"],
                    eps=group["eps"],
                    decay=1.0 - group["lr"] * group["weight_decay"],
                )
            except Exception as error:  # (Triton's errors have no common type)
                _KERNEL.fail(error)
                rest += members
        return sorted(rest)

    def _step_foreach(self, params, states, scalars, group) -> None:
        """The step in torch's foreach ops (one launch each for all of ``params`` on CUDA)."""
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        grads = [p.grad.float() for p in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        # Foreach launches over the tensors with a shared moment, and over those without.
        denoms: list[torch.Tensor | None] = [None] * len(states)
        with_shared = [i for i, (_, _, factor) in enumerate(scalars) if factor != 0.0]
        if with_shared:
            found = torch._foreach_mul(
                [states[i]["shared_exp_avg_sq"] for i in with_shared],
                [scalars[i][2] for i in with_shared],
            )
            torch._foreach_maximum_(found, [exp_avg_sqs[i] for i in with_shared])
            for i, denom in zip(with_shared, found):
                denoms[i] = denom
        without = [i for i, denom in enumerate(denoms) if denom is None]
        if without:
            copies = torch._foreach_mul([exp_avg_sqs[i] for i in without], 1.0)  # v's bits
            for i, denom in zip(without, copies):
                denoms[i] = denom
        torch._foreach_div_(denoms, [scale for _, scale, _ in scalars])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        decay = 1.0 - group["lr"] * group["weight_decay"]
        steps = [step_size for step_size, _, _ in scalars]
        full = [i for i, p in enumerate(params) if p.dtype == torch.float32]
        if full:
            mine = [params[i] for i in full]
            if decay != 1.0:
                torch._foreach_mul_(mine, decay)
            torch._foreach_addcdiv_(
                mine,
                [exp_avgs[i] for i in full],
                [denoms[i] for i in full],
                [steps[i] for i in full],
            )
        for i, param in enumerate(params):  # a 16-bit parameter: decay and step in float32,
            if param.dtype != torch.float32:  # rounded once
                work = param.float().mul_(decay)
                param.copy_(work.addcdiv_(exp_avgs[i], denoms[i], value=steps[i]))

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """As ``torch.optim.Optimizer.state_dict``, with the step count under
        ``"shared_moment"`` (the world size is the wrapper's to say after a resume)."""
        state = super().state_dict()
        state["shared_moment"] = {"steps": self.steps}
        return state

    def __getstate__(self) -> dict:  # copy.deepcopy and pickle: torch keeps three keys
        state = super().__getstate__()
        state.update({key: getattr(self, key) for key in _OWN})
        return state

    def __setstate__(self, state: dict) -> None:
        own = {key: state.pop(key) for key in _OWN if key in state}
        super().__setstate__(state)
        self.__dict__.update(own)
        self._averages = None

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; the moments stay float32 (torch
        casts state tensors to their parameter's dtype). A state that is not a
        ``SharedMomentAdamW``'s is refused before anything changes."""
        counts = state_dict.get("shared_moment")
        missing = ["shared_moment"] if counts is None else []
        for index, saved in state_dict["state"].items():
            if saved:  # (an empty entry: a parameter never stepped, looked up since)
                missing += [f"{key} (parameter {index})" for key in _STATE_KEYS if key not in saved]
        if missing:
            raise ValueError(
                f"SharedMomentAdamW.load_state_dict: no {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}: it is not a SharedMomentAdamW state. "
                "Load the state_dict() of a SharedMomentAdamW, or start this optimizer fresh"
            )
        plain = {k: v for k, v in state_dict.items() if k != "shared_moment"}
        super().load_state_dict(plain)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            if not saved:
                continue
            param = params[index]
            for key in ("exp_avg", "exp_avg_sq", "shared_exp_avg_sq"):
                self.state[param][key] = saved[key].to(
                    device=param.device, dtype=torch.float32, copy=True
                )
        self.steps = int(counts["steps"])
        self._averages = None


def _batched(params: list[torch.Tensor]) -> bool:
    """Whether ``params`` step together (one kernel launch, or foreach launches): on one
    CUDA device."""
    return bool(params) and params[0].is_cuda and all(p.device == params[0].device for p in params)


def _pick(chosen: list[int], *lists: list) -> list[list]:
    """The ``chosen`` positions of each of ``lists``."""
    return [[items[i] for i in chosen] for items in lists]
