"""What ``tests/test_safety.py`` (issue 12: the same decision on every rank, and atomic state)
runs on each gloo rank, through ``_dist.run_ranks``.

A spawned worker imports only the standard library, torch and sparsecomm. Every scenario
takes ``(rank, world_size, group)`` and returns plain data; ``group`` is the process group to
pass to ``CompressedOptimizer`` (``None``: the default group, or no group at all when
torch.distributed is not initialized, which is how the tests run the one-rank cases in the
pytest process itself). Gradients are made by autograd, ``(p * g).sum().backward()``, which
leaves exactly ``g`` in ``p.grad`` and runs the optimizer's backward hooks like real training.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import sparsecomm

IN, HIDDEN, OUT = 24, 48, 5

# ------------------------------------------------------------------ helpers


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),  # 1152 + 48
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),  # 2304 + 48
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),  # 240 + 5
    )


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, IN, generator=gen), torch.randn(size, OUT, generator=gen)


def train_step(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def backward_with(grads: dict) -> None:
    """One backward pass that leaves exactly ``g`` in ``p.grad`` for each ``p: g``."""
    loss = sum((p * g.to(p.dtype)).sum() for p, g in grads.items())
    loss.backward()


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().clone() for p in params])


def fingerprint(obj):
    """``obj`` with every tensor replaced by its dtype, shape and bytes: two fingerprints are
    equal exactly when the objects are equal bit for bit (NaN included)."""
    if torch.is_tensor(obj):
        data = obj.detach().cpu().contiguous().reshape(-1)
        return (
            "tensor",
            str(obj.dtype),
            tuple(obj.shape),
            data.view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(obj, dict):
        return {key: fingerprint(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [fingerprint(value) for value in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return ("nan",)
    return obj


def state_of(opt, params, stats: bool = True):
    """Everything a failed call must leave as it was: parameter values, the residuals and the
    whole ``state_dict()`` (wrapped optimizer state, param_groups, residuals; the step
    counters too unless ``stats=False``)."""
    state = copy.deepcopy(opt.state_dict())
    if not stats:
        state["sparsecomm"].pop("total_stats", None)
    return fingerprint(
        {
            "params": [p.detach() for p in params],
            "residuals": [opt.residual(p) for p in params if p.requires_grad],
            "state_dict": state,
        }
    )


def attempt(thunk, errors=(TypeError, ValueError)):
    """``("ok", None)``, or ``(error type name, message)`` for one of ``errors``; any other
    exception propagates (and fails the scenario with its traceback)."""
    try:
        thunk()
    except errors as error:
        return (type(error).__name__, str(error))
    return ("ok", None)


def all_finite(opt, params) -> bool:
    return all(
        bool(torch.isfinite(p.detach()).all()) and bool(torch.isfinite(opt.residual(p)).all())
        for p in params
    )


def make_compressor(name: str) -> sparsecomm.Compressor:
    return {
        "dense": sparsecomm.Dense,
        "fp16": lambda: sparsecomm.Cast(torch.float16),
        "bf16": lambda: sparsecomm.Cast(torch.bfloat16),
        "threshold": lambda: sparsecomm.Threshold(1e-3),
        "topk": lambda: sparsecomm.TopK(0.1),
    }[name]()


# ------------------------------------------------------------------ 12.1 one rank differs


def one_rank_differs(rank, world_size, case: str, bad_rank: int):
    """Rank ``bad_rank`` passes something the others do not (default group). Returns what
    each rank raised, how long the call took, and the parameters after a good optimizer then
    trained a step, which shows the group is still usable and in step on every rank."""
    model = make_model()
    params = list(model.parameters())
    bad = rank == bad_rank
    odd = torch.nn.Parameter(torch.zeros(30, dtype=torch.float64 if bad else torch.float32))
    # A first optimizer, built and stepped before the timed call, so that the time measured
    # is the refusal's and not what a first construction costs (lazy imports).
    warm = make_model(seed=2)
    train_step(
        warm, sparsecomm.CompressedOptimizer(torch.optim.SGD(warm.parameters(), lr=0.05),
        sparsecomm.TopK(0.1)), rank, 0,
    )  # fmt: skip
    opt = None
    if case == "add_group_unfrozen":  # the last layer frozen when wrapped
        model[2].weight.requires_grad_(False)
    if case.startswith("add_group"):
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(params, lr=0.05), sparsecomm.TopK(0.1), bucket_cap_mb=0.01
        )
        train_step(model, opt, rank, 0)
    dist.barrier()  # start the timed call together
    started = time.monotonic()
    if case == "float64_param":
        outcome = attempt(
            lambda: sparsecomm.CompressedOptimizer(
                torch.optim.SGD(params + [odd], lr=0.05), sparsecomm.TopK(0.1)
            )
        )
    elif case == "bucket_cap_type":
        outcome = attempt(
            lambda: sparsecomm.CompressedOptimizer(
                torch.optim.SGD(params, lr=0.05),
                sparsecomm.TopK(0.1),
                bucket_cap_mb="25" if bad else 25,
            )
        )
    elif case == "learning_rate":
        outcome = attempt(
            lambda: sparsecomm.CompressedOptimizer(
                torch.optim.SGD(params, lr=0.1 if bad else 0.05), sparsecomm.TopK(0.1)
            )
        )
    elif case == "optimizer_class":
        inner = torch.optim.Adam if bad else torch.optim.AdamW
        outcome = attempt(
            lambda: sparsecomm.CompressedOptimizer(inner(params, lr=0.05), sparsecomm.TopK(0.1))
        )
    elif case == "add_group_learning_rate":
        new = torch.nn.Parameter(torch.zeros(30))
        outcome = attempt(
            lambda: opt.add_param_group({"params": [new], "lr": 0.1 if bad else 0.05})
        )
    elif case == "add_group_float64":
        outcome = attempt(lambda: opt.add_param_group({"params": [odd]}))
    elif case == "add_group_non_leaf":  # refused by the wrapped optimizer, on one rank
        new = torch.zeros(30, requires_grad=True)
        new = new * 1.0 if bad else new
        outcome = attempt(lambda: opt.add_param_group({"params": [new]}))
    elif case == "add_group_unfrozen":  # the frozen layer unfrozen on one rank only
        if bad:
            model[2].weight.requires_grad_(True)
        new = torch.nn.Parameter(torch.zeros(30))
        outcome = attempt(lambda: opt.add_param_group({"params": [new]}), Exception)
        model[2].weight.requires_grad_(False)  # as on the other rank: training goes on
    else:
        raise ValueError(case)
    seconds = time.monotonic() - started
    groups = None
    if opt is None:
        model = make_model(seed=1)
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), sparsecomm.TopK(0.1)
        )
    else:
        groups = len(opt.param_groups)
    train_step(model, opt, rank, 1)
    return outcome, seconds, groups, flat(model.parameters())


# ------------------------------------------------------------------ scenarios (any W)


def float64_everywhere(rank, world_size, group):
    params = [torch.nn.Parameter(torch.zeros(40, 30)), torch.nn.Parameter(torch.zeros(30).double())]
    return attempt(
        lambda: sparsecomm.CompressedOptimizer(
            torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.1), process_group=group
        )
    )


def meta_everywhere(rank, world_size, group):
    params = [
        torch.nn.Parameter(torch.zeros(40, 30)),
        torch.nn.Parameter(torch.empty(30, 40, device="meta")),
    ]
    return attempt(
        lambda: sparsecomm.CompressedOptimizer(
            torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.1), process_group=group
        )
    )


def add_group_float64(rank, world_size, group):
    """12.2: a refused add_param_group changes nothing, and training goes on in sync even
    when the refused parameter gets a different gradient on every rank."""
    model = make_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        sparsecomm.TopK(0.1),
        process_group=group,
        bucket_cap_mb=0.01,
    )
    for step in range(2):
        train_step(model, opt, rank, step)
    extra = torch.nn.Parameter(torch.ones(50, dtype=torch.float64))
    params = list(model.parameters())
    before, groups_before = state_of(opt, params), len(opt.param_groups)
    outcome = attempt(lambda: opt.add_param_group({"params": [extra], "lr": 0.1}))
    unchanged = state_of(opt, params) == before
    groups_after = len(opt.param_groups)
    x, y = batch(rank, 2)
    loss = torch.nn.functional.mse_loss(model(x), y) + (extra * (rank + 1.0)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return {
        "outcome": outcome,
        "groups": (groups_before, groups_after),
        "unchanged": unchanged,
        "params": flat(params + [extra]),
    }


def add_group_mid_step(rank, world_size, group):
    """add_param_group() between an exchanged backward and step() is refused on every
    rank; after step() the same call works, and the ranks stay in sync."""
    model = make_model()
    head = torch.nn.Linear(OUT, OUT)
    torch.manual_seed(7)
    with torch.no_grad():  # the same head on every rank
        for p in head.parameters():
            p.copy_(torch.randn(p.shape))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        sparsecomm.TopK(0.1),
        process_group=group,
        bucket_cap_mb=0.01,
    )

    def backward(step):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(head(model(x)), y).backward()

    for step in range(2):  # from the second step on, backward exchanges
        backward(step)
        opt.step()
        opt.zero_grad()
        head.zero_grad()
    backward(2)
    refused = attempt(
        lambda: opt.add_param_group({"params": list(head.parameters())}),
        errors=(RuntimeError,),
    )
    groups = len(opt.param_groups)
    opt.step()
    opt.zero_grad()
    head.zero_grad()
    opt.add_param_group({"params": list(head.parameters())})
    for step in range(3, 5):
        backward(step)
        opt.step()
        opt.zero_grad()
    return {
        "refused": refused,
        "groups": (groups, len(opt.param_groups)),
        "params": flat(list(model.parameters()) + list(head.parameters())),
    }


# Per compressor: the gradient the bad rank of the overflow scenarios gives its first
# elements in step 1, and how many. Step 1 leaves (some of) them in the residual; in step
# 2 they get 3e38 again, and gradient + residual exceeds float32's 3.4e38: inf.
OVERFLOW = {
    # k = 20 of 2000 sent in step 1, 80 elements of 3e38 stay behind.
    "topk": (lambda: sparsecomm.TopK(0.01), 3e38, 100),
    # Below the threshold, so not sent: 9e37 stays behind, then 3e38 + 9e37 = 3.9e38.
    "threshold": (lambda: sparsecomm.Threshold(1e38), 9e37, 100),
    # Clamped to fp16's 65504 (x 2): nearly all of 3e38 stays behind.
    "fp16": (lambda: sparsecomm.Cast(torch.float16), 3e38, 100),
}
OVERFLOW_STEP_2 = 3e38


def _overflow_grads(name: str, rank: int, step: int, bad_rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17 * rank + step)
    grad = torch.randn(2000, generator=gen) * 1e-3
    _, first, count = OVERFLOW[name]
    if rank == bad_rank:
        grad[:count] = first if step == 0 else OVERFLOW_STEP_2
    return grad


def overflow(rank, world_size, group):
    """12.3: gradients that are finite, but whose sum with the residual overflows to inf on
    the last rank. Every rank must raise NonFiniteGradientError naming that rank and change
    nothing; no parameter or residual may become inf or NaN."""
    bad_rank = world_size - 1
    out = {}
    for name, (compressor, _, _) in OVERFLOW.items():
        weight = torch.nn.Parameter(torch.zeros(2000))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([weight], lr=1e-3), compressor(), min_compress_numel=0,
            process_group=group,
        )  # fmt: skip
        backward_with({weight: _overflow_grads(name, rank, 0, bad_rank)})
        opt.step()
        opt.zero_grad()
        residual_peak = float(opt.residual(weight).abs().max())
        before = state_of(opt, [weight], stats=False)
        caught = None
        try:
            backward_with({weight: _overflow_grads(name, rank, 1, bad_rank)})
            opt.step()
        except sparsecomm.NonFiniteGradientError as error:
            caught = error.ranks
        opt.zero_grad()
        out[name] = {
            "residual_peak": residual_peak,
            "caught": caught,
            "unchanged": state_of(opt, [weight], stats=False) == before,
            "finite": all_finite(opt, [weight]),
            "params": flat([weight]),
        }
    return out


def overflow_grad_scaler(rank, world_size, group):
    """12.3 under GradScaler (scale 1, so the scaled gradients are the gradients): every
    rank skips the step, every scaler lowers its scale, nothing changes."""
    bad_rank = world_size - 1
    weight = torch.nn.Parameter(torch.zeros(2000))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD([weight], lr=1e-3), sparsecomm.TopK(0.01), min_compress_numel=0,
        process_group=group,
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    scales, unchanged = [], []
    for step in range(2):
        before = state_of(opt, [weight], stats=False)
        grad = _overflow_grads("topk", rank, step, bad_rank)
        scaler.scale((weight * grad).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        unchanged.append(state_of(opt, [weight], stats=False) == before)
    return {
        "scales": scales,
        "unchanged": unchanged,
        "finite": all_finite(opt, [weight]),
        "params": flat([weight]),
    }


def nan_residual(rank, world_size, group):
    """12.3: a NaN put into one rank's residual through its checkpoint. Either
    load_state_dict refuses it (ValueError, nothing changed) or the next step raises
    NonFiniteGradientError on every rank and changes nothing; a parameter never becomes NaN."""
    bad_rank = world_size - 1
    out = {}
    for name in ("topk", "threshold", "fp16"):
        compressor = OVERFLOW[name][0]()
        weight = torch.nn.Parameter(torch.zeros(2000))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([weight], lr=1e-3), compressor, min_compress_numel=0,
            process_group=group,
        )  # fmt: skip
        backward_with({weight: torch.randn(2000, generator=torch.Generator().manual_seed(rank))})
        opt.step()
        opt.zero_grad()
        state = copy.deepcopy(opt.state_dict())
        if rank == bad_rank:
            state["sparsecomm"]["residuals"][0][5] = float("nan")
        before = state_of(opt, [weight])
        loaded = attempt(lambda: opt.load_state_dict(state))  # noqa: B023
        load_unchanged = loaded[0] == "ok" or state_of(opt, [weight]) == before
        before = state_of(opt, [weight], stats=False)
        caught = None
        try:
            backward_with({weight: torch.full((2000,), 1e-3)})
            opt.step()
        except sparsecomm.NonFiniteGradientError as error:
            caught = error.ranks
        opt.zero_grad()
        out[name] = {
            "loaded": loaded,
            "load_unchanged": load_unchanged,
            "caught": caught,
            "step_unchanged": state_of(opt, [weight], stats=False) == before,
            "params_finite": bool(torch.isfinite(weight.detach()).all()),
            "params": flat([weight]),
        }
    return out


# Per compressor, a gradient that every rank holds and that is finite, as is its mean,
# but whose sum over two ranks is not: 2 x 2e38 overflows float32, and Cast's two fp16
# values of 1e5 / 2 = 50000 add up beyond fp16's 65504.
SUM_OVERFLOW = {
    "dense": (sparsecomm.Dense, 2e38),
    "topk-dense-fallback": (lambda: sparsecomm.TopK(1.0), 2e38),
    "fp16": (lambda: sparsecomm.Cast(torch.float16), 1e5),
}


def sum_overflow(rank, world_size, group):
    """12.3: finite gradients whose sum over the ranks overflows in the exchange. No
    parameter or residual may become inf: either every rank raises NonFiniteGradientError
    and nothing changes, or the step is finite (and the same) everywhere."""
    out = {}
    for name, (compressor, value) in SUM_OVERFLOW.items():
        weight = torch.nn.Parameter(torch.zeros(2000))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([weight], lr=1e-40), compressor(), min_compress_numel=0,
            process_group=group,
        )  # fmt: skip
        grad = torch.randn(2000, generator=torch.Generator().manual_seed(rank)) * 1e-3
        grad[:10] = value
        before = state_of(opt, [weight], stats=False)
        caught, too_large = None, None
        try:
            backward_with({weight: grad})
            opt.step()
        except sparsecomm.NonFiniteGradientError as error:
            caught, too_large = error.ranks, error.too_large
        opt.zero_grad()
        out[name] = {
            "caught": caught,
            "too_large": too_large,
            "unchanged": state_of(opt, [weight], stats=False) == before,
            "finite": all_finite(opt, [weight]),
            "params": flat([weight]),
        }
    return out


HALF_PARAMS_COMPRESSORS = ("fp16", "bf16", "dense", "topk")


def half_params(rank, world_size, group):
    """float16 and bfloat16 parameters under every compressor, gradients of about 1e-2 and
    one of 30000 (within float16's range, as is every average): every step is taken (a
    float16 Cast's own limit was once compared as if it were float32's, and every step
    refused as too large), on every rank the same."""
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for name in HALF_PARAMS_COMPRESSORS:
            weight = torch.nn.Parameter(torch.zeros(3000, dtype=dtype))
            opt = sparsecomm.CompressedOptimizer(
                torch.optim.SGD([weight], lr=1e-3), make_compressor(name),
                min_compress_numel=0, process_group=group,
            )  # fmt: skip
            outcomes = []
            for step in range(2):
                gen = torch.Generator().manual_seed(10 * rank + step)
                grad = torch.randn(3000, generator=gen) * 1e-2
                grad[7] = 30000.0
                backward_with({weight: grad.to(dtype)})
                outcomes.append(attempt(opt.step, sparsecomm.NonFiniteGradientError))
                opt.zero_grad()
            out[f"{dtype}-{name}"] = {"outcomes": outcomes, "params": flat([weight]).float()}
    return out


ZERO_ELEMENT_COMPRESSORS = ("topk", "threshold", "fp16", "bf16", "dense")


def zero_element(rank, world_size, group):
    """12.5: zero-element parameters alone in their buckets (min_compress_numel=0)."""
    out = {}
    for name in ZERO_ELEMENT_COMPRESSORS:
        empty_first = torch.nn.Parameter(torch.zeros(0))
        weight = torch.nn.Parameter(torch.zeros(64, 64))  # 4096 > the 2621-element cap
        empty_last = torch.nn.Parameter(torch.zeros(3, 0))
        params = [empty_first, weight, empty_last]

        def run(params=params, weight=weight, name=name):
            opt = sparsecomm.CompressedOptimizer(
                torch.optim.SGD(params, lr=0.1), make_compressor(name), min_compress_numel=0,
                bucket_cap_mb=0.01, process_group=group,
            )  # fmt: skip
            for step in range(2):
                gen = torch.Generator().manual_seed(10 * rank + step)
                backward_with({p: torch.randn(p.shape, generator=gen) for p in params})
                opt.step()
                opt.zero_grad()

        out[name] = {"outcome": attempt(run, Exception), "params": flat(params)}
    return out


def no_cap(rank, world_size, group):
    """12.5: bucket_cap_mb=inf means no cap: the same result as a cap nothing reaches, and
    one compressed bucket (TopK sends k of all compressed elements together)."""
    out = {}
    for cap in (float("inf"), 1e9):
        model = make_model()

        def run(model=model, cap=cap):
            opt = sparsecomm.CompressedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05),
                sparsecomm.TopK(0.1),
                bucket_cap_mb=cap,
                process_group=group,
            )
            for step in range(3):
                train_step(model, opt, rank, step)
            return opt.last_stats.elements_sent

        holder = {}
        outcome = attempt(lambda run=run, holder=holder: holder.update(sent=run()), Exception)
        out[str(cap)] = {
            "outcome": outcome,
            "elements_sent": holder.get("sent"),
            "params": flat(model.parameters()),
        }
    return out


def inside_ddp(rank, world_size, group):
    """A model wrapped in DistributedDataParallel (before or after the wrapper is built, or
    with sparsecomm's own DDP hook) raises at every step on every rank and changes nothing;
    a DDP module over another model beside it does not count."""
    DDP = torch.nn.parallel.DistributedDataParallel
    beside = DDP(make_model(1), process_group=group)  # another model's: not this one's
    out = {}
    for case in ("ddp_first", "optimizer_first", "hook"):
        model = make_model()
        net = DDP(model, process_group=group) if case != "optimizer_first" else None
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), sparsecomm.TopK(0.1), process_group=group
        )
        if net is None:
            net = DDP(model, process_group=group)
        if case == "hook":
            net.register_comm_hook(*sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1)))
        before = flat(model.parameters())
        outcomes = []
        for step in range(2):  # (a step in overlap after the first)
            thunk = functools.partial(train_step, net, opt, rank, step)
            outcomes.append(attempt(thunk, Exception))
            opt.zero_grad()
        changed = not torch.equal(before, flat(model.parameters()))
        out[case] = {"outcomes": outcomes, "changed": changed}
    alone = make_model()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(alone.parameters(), lr=0.05), sparsecomm.TopK(0.1), process_group=group
    )
    before = flat(alone.parameters())
    for step in range(2):
        train_step(alone, opt, rank, step)
    out["beside"] = not torch.equal(before, flat(alone.parameters()))
    del beside
    return out


def sharded(rank, world_size, group):
    """Parameters that FSDP (a flat parameter per rank) or FSDP2 (DTensors) shard: refused
    when the wrapper is built, on every rank, by name."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    out = {}
    for kind in ("fsdp", "fsdp2"):
        model = make_model()
        if kind == "fsdp":
            cpu = torch.device("cpu")
            net = FullyShardedDataParallel(model, process_group=group, device_id=cpu)
        else:
            net = fully_shard(model)
        sgd = torch.optim.SGD(net.parameters(), lr=0.05)
        out[kind] = attempt(
            lambda sgd=sgd: sparsecomm.CompressedOptimizer(
                sgd, sparsecomm.TopK(0.1), process_group=group
            )
        )
    return out


# _step_ahead_run's steps, in order: "nan" on the last rank; "clip" (error_if_nonfinite)
# between backward and step; "again", a second backward before step(), which skips the
# refused step; "skip", zero_grad() in place of step(); "raise", the wrapped optimizer's
# step raising once (on an accepted step, step() is then called again).
STEP_AHEAD_PLAN = (
    "plain", "plain", "clip", "nan+clip", "plain", "nan", "nan+again", "nan+skip",
    "nan+raise", "raise", "plain",
)  # fmt: skip


def _step_ahead_run(rank, world_size, group, ahead: bool, device="cpu", compressor=None):
    """The steps of :func:`step_ahead` under one wrapper: fused AdamW stepped ahead of the
    verdict (``ahead``) or after it, as any other optimizer is. Buckets of small
    parameters (below ``min_compress_numel``) keep no residual, the others one."""
    bad_rank = world_size - 1
    model = make_model().to(device)
    params = list(model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    opt = sparsecomm.CompressedOptimizer(
        inner, compressor or sparsecomm.TopK(0.1), process_group=group
    )
    if not ahead:
        opt._ahead = False
    raising = []

    def boom(optimizer, args, kwargs):
        if raising:
            raising.clear()
            raise RuntimeError("the wrapped step raised")

    inner.register_step_pre_hook(boom)
    pending, outcomes, clear = [], [], []

    def backward(step: int, nan: bool = False) -> None:
        x, y = (t.to(device) for t in batch(rank, step))
        if nan and rank == bad_rank:
            x[0, 0] = math.nan
        torch.nn.functional.mse_loss(model(x), y).backward()
        pending.append(opt._pending is not None)

    for index, plan in enumerate(STEP_AHEAD_PLAN):
        backward(index, nan="nan" in plan)
        if "again" in plan:
            backward(index + 100)
        if "nan" in plan and "again" not in plan:  # .grad holds nothing of the refused step
            clear.append(all(p.grad is None or not p.grad.any() for p in params))
        if "clip" in plan:  # through .grad, between backward and step
            outcomes.append(
                attempt(lambda: torch.nn.utils.clip_grad_norm_(params, 0.05, 2.0, True), Exception)
            )
        if "skip" in plan:
            outcomes.append(("zero_grad", None))
        else:
            if "raise" in plan:
                raising.append(True)
            outcomes.append(attempt(opt.step, Exception))
            if outcomes[-1][0] == "RuntimeError":  # the wrapped step raised: again
                outcomes.append(attempt(opt.step, Exception))
        opt.zero_grad()
    state = state_of(opt, params)
    return {
        "outcomes": outcomes, "pending": pending, "clear": clear, "state": state,
        "params": flat(params).cpu(),
    }  # fmt: skip


def step_ahead(rank, world_size, group):
    """A fused AdamW steps before the host reads the step's verdict (the device skips a
    refused step): the same bits, errors and state as when it steps after, through refused
    steps, clipping between backward and step (a refused step's too), a backward after a
    refused one without step(), and a wrapped step that raises; with TopK (residuals, and
    small buckets without) and with Dense (no residual)."""
    return {
        name: {
            "ahead": _step_ahead_run(rank, world_size, group, True, compressor=compressor()),
            "after": _step_ahead_run(rank, world_size, group, False, compressor=compressor()),
        }
        for name, compressor in (
            ("topk", lambda: sparsecomm.TopK(0.1)),
            ("dense", sparsecomm.Dense),
        )
    }


def settings_apart(rank, world_size, group):
    """The learning rate halved on the last rank only (a scheduler stepped there alone):
    every step raises on every rank, naming the setting, and changes nothing, until the
    ranks agree again; then training goes on, the ranks identical."""
    out = {}
    for name in ("sgd", "fused-adamw"):
        model = make_model()
        params = list(model.parameters())
        if name == "sgd":
            inner = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            inner = torch.optim.AdamW(params, lr=0.01, fused=True)
        opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.1), process_group=group)
        for step in range(2):
            train_step(model, opt, rank, step)
        odd = rank == world_size - 1
        if odd:
            opt.param_groups[0]["lr"] *= 0.5
        before = state_of(opt, params, stats=False)
        outcomes = []
        for step in (2, 3):
            thunk = functools.partial(train_step, model, opt, rank, step)
            outcomes.append(attempt(thunk, Exception))
            opt.zero_grad()
        unchanged = state_of(opt, params, stats=False) == before
        if odd:
            opt.param_groups[0]["lr"] *= 2.0
        stopped = flat(params)
        train_step(model, opt, rank, 4)
        out[name] = {
            "outcomes": outcomes,
            "unchanged": unchanged,
            "trained_again": not torch.equal(stopped, flat(params)),
            "params": flat(params),
        }
    return out


UNUSED_CONFIGS = {
    # (compressor, bucket_cap_mb): one bucket for both weights, or one each.
    "topk-shared": (lambda: sparsecomm.TopK(0.05), 25),
    "topk-own": (lambda: sparsecomm.TopK(0.05), 0.01),
    "fp16-shared": (lambda: sparsecomm.Cast(torch.float16), 25),
    "bf16-own": (lambda: sparsecomm.Cast(torch.bfloat16), 0.01),
    "threshold-shared": (lambda: sparsecomm.Threshold(0.5), 25),
}


def unused_residual(rank, world_size, group):
    """12.6 (a): a parameter that had gradients (so it has a residual) and then has none on
    any rank keeps its residual bit for bit, keeps grad None and does not move."""
    out = {}
    for name, (compressor, cap) in UNUSED_CONFIGS.items():
        used = torch.nn.Parameter(torch.zeros(3000))
        idle = torch.nn.Parameter(torch.zeros(3000))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([used, idle], lr=0.01, momentum=0.9), compressor(),
            min_compress_numel=0, bucket_cap_mb=cap, process_group=group,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            backward_with(
                {used: torch.randn(3000, generator=gen), idle: torch.randn(3000, generator=gen)}
            )
            opt.step()
            opt.zero_grad()
        residual_before = opt.residual(idle)
        idle_before = idle.detach().clone()
        # Only `used` gets a gradient, and a small one: what the bucket would send, were the
        # residual of `idle` not put back, would come from `idle`.
        backward_with({used: torch.randn(3000, generator=gen) * 1e-6})
        opt.step()
        out[name] = {
            "residual_before": residual_before,
            "residual_after": opt.residual(idle),
            "grad_none": idle.grad is None,
            "idle_unchanged": torch.equal(idle.detach(), idle_before),
        }
        opt.zero_grad()
        backward_with(
            {used: torch.randn(3000, generator=gen), idle: torch.randn(3000, generator=gen)}
        )
        opt.step()
        out[name]["params"] = flat([used, idle])
    return out


ELEMENTS_CONFIGS = {
    # name: (compressor, dense fallback expected at W = 2)
    "threshold": (lambda: sparsecomm.Threshold(1.645), False),  # ~10% sent
    "topk": (lambda: sparsecomm.TopK(0.05), False),
    "fp16": (lambda: sparsecomm.Cast(torch.float16), False),
    "dense": (sparsecomm.Dense, False),
    "topk-fallback": (lambda: sparsecomm.TopK(0.6), True),  # 2 x 1800 >= 3000
    "threshold-fallback": (lambda: sparsecomm.Threshold(0.2), True),  # ~84% sent
}


def elements_sent(rank, world_size, group):
    """12.6 (e): ``last_stats.elements_sent`` against this rank's own count of what it
    sends: the 10-element bias travels dense (min_compress_numel=100); the 3000-element
    weight sends, by the compressors' definitions, every element with |g + r| >= t
    (Threshold), k (TopK) or all (Cast, Dense). Returns, per step, the reported figures and
    this rank's count; the test decides the dense fallback from every rank's count."""
    out = {}
    for name, (compressor, _) in ELEMENTS_CONFIGS.items():
        comp = compressor()
        weight = torch.nn.Parameter(torch.zeros(3000))
        bias = torch.nn.Parameter(torch.zeros(10))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([weight, bias], lr=0.01), comp, min_compress_numel=100,
            process_group=group,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(100 + rank)
        steps = []
        for _ in range(2):
            grad = torch.randn(3000, generator=gen)
            acc = grad + opt.residual(weight)
            if isinstance(comp, sparsecomm.Threshold):
                count = int((acc.abs() >= comp.threshold).sum())
            elif isinstance(comp, sparsecomm.TopK):
                count = comp.k_for(3000)
            else:
                count = 3000
            backward_with({weight: grad, bias: torch.randn(10, generator=gen)})
            opt.step()
            opt.zero_grad()
            stats = opt.last_stats
            steps.append(
                {
                    "count": count,
                    "elements_sent": stats.elements_sent,
                    "elements": stats.elements,
                    "bytes_sent": stats.bytes_sent,
                }
            )
        out[name] = steps
    return out


SCENARIOS = {
    "float64_everywhere": float64_everywhere,
    "meta_everywhere": meta_everywhere,
    "add_group_float64": add_group_float64,
    "add_group_mid_step": add_group_mid_step,
    "overflow": overflow,
    "overflow_grad_scaler": overflow_grad_scaler,
    "nan_residual": nan_residual,
    "sum_overflow": sum_overflow,
    "half_params": half_params,
    "zero_element": zero_element,
    "no_cap": no_cap,
    "unused_residual": unused_residual,
    "elements_sent": elements_sent,
    "inside_ddp": inside_ddp,
    "sharded": sharded,
    "step_ahead": step_ahead,
    "settings_apart": settings_apart,
}


def run_scenarios(rank, world_size, names, collective_timeout: float):
    """Run the named scenarios one after another, each on a process group of its own (so a
    scenario that leaves the ranks out of step cannot spoil the next), and return
    ``{name: ("ok", result) | ("error", traceback)}``."""
    results = {}
    for name in names:
        group = dist.new_group(timeout=timedelta(seconds=collective_timeout))
        try:
            results[name] = ("ok", SCENARIOS[name](rank, world_size, group))
        except Exception:
            results[name] = ("error", traceback.format_exc())
        finally:
            dist.destroy_process_group(group)
    return results


# ------------------------------------------------------------------ the wrapped step raises


class FlakySGD(torch.optim.SGD):
    """SGD whose ``fail_at``-th call of ``step`` raises (None: never), before it changes
    anything, as an out-of-memory error in an optimizer's first step would."""

    def __init__(self, params, fail_at=None, **kwargs):
        super().__init__(params, **kwargs)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated failure in the wrapped optimizer's step")
        return super().step(closure)


def wrapped_step_raises(rank, world_size, exchange: str, raising: list, then: str):
    """Six steps of ``TopK(0.05)`` with a density warm-up; at step 2 the wrapped
    optimizer's step raises on the ranks in ``raising``. Then, ``then``:

    - ``"retry"``: those ranks call ``opt.step()`` again;
    - ``"synchronize"``: every step is ``opt.synchronize(); opt.step()``, and the retry too;
    - ``"zero_grad"``: they go on (``opt.zero_grad()``, as every step);
    - ``"model.zero_grad"``: every step clears with ``model.zero_grad()`` instead;
    - ``"reload"``: they go on, and every rank then loads the model and optimizer state
      it had before step 2;
    - ``"drop"``: every step clears with ``model.zero_grad()``, and at step 3 those ranks'
      backward fails before any gradient (``opt.drop_step()``);
    - ``"by_hand"``: every step clears with ``model.zero_grad()``, and at step 3 every
      rank sets its gradients by hand, then ``opt.synchronize(); opt.step()``.

    Returns the (shared) parameters, the steps taken and each error a rank saw: ``(step,
    type, start of the message, whether the step left the residuals as they were)``."""
    model = make_model()
    fail_at = 3 if rank in raising else None
    inner = FlakySGD(model.parameters(), fail_at=fail_at, lr=0.05, momentum=0.9)
    compressor = sparsecomm.TopK(0.05, warmup_steps=6)
    opt = sparsecomm.CompressedOptimizer(inner, compressor, exchange=exchange, bucket_cap_mb=0.01)
    clear = opt.zero_grad
    if then in ("model.zero_grad", "drop", "by_hand"):
        clear = model.zero_grad

    def step():
        if then == "synchronize" or (then == "by_hand" and step_index == 3):
            opt.synchronize()
        opt.step()

    errors, saved = [], None
    for step_index in range(6):
        if step_index == 2 and then == "reload":
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if step_index == 3 and then == "reload":
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        before = opt.residual(model[0].weight)
        x, y = batch(rank, step_index)
        if step_index == 3 and then == "drop" and rank in raising:
            opt.drop_step()  # (its forward ran out of memory, say)
        elif step_index == 3 and then == "by_hand":
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (rank + 1))
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            step()
        except RuntimeError as error:
            kept = torch.equal(before, opt.residual(model[0].weight))
            errors.append((step_index, type(error).__name__, str(error)[:100], kept))
            if then in ("retry", "synchronize") and "simulated" in str(error):
                step()
        clear()
    if exchange == "local_updates":  # each rank's model is the shared one less its residual
        with opt.shared_parameters():
            return flat(model.parameters()), opt.steps_taken, errors
    return flat(model.parameters()), opt.steps_taken, errors


def skip_on_some_ranks(rank, world_size, skipping: list, clear: str):
    """Six steps of ``TopK(0.05)`` (overlap on, so from step 1 on backward exchanges); at
    step 2 the ranks in ``skipping`` throw the exchanged gradients away instead of
    stepping: ``clear`` is ``"opt.zero_grad"``, or ``"model.zero_grad"`` (the next
    backward then skips the step). Returns the parameters, the steps taken and each error
    a rank saw: ``(step, type, start of the message, whether the residuals stayed)``."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05), bucket_cap_mb=0.01)
    errors = []
    for step_index in range(6):
        before = opt.residual(model[0].weight)
        x, y = batch(rank, step_index)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step_index == 2 and rank in skipping:
            (opt.zero_grad if clear == "opt.zero_grad" else model.zero_grad)()
            continue
        try:
            opt.step()
        except RuntimeError as error:
            kept = torch.equal(before, opt.residual(model[0].weight))
            errors.append((step_index, type(error).__name__, str(error)[:100], kept))
        opt.zero_grad()
    return flat(model.parameters()), opt.steps_taken, errors
