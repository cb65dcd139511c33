"""Functions that run on each gloo rank in the distributed tests (see ``_dist.run_ranks``).

Kept apart from the test modules so that a spawned worker imports only torch and
sparsecomm. Every function takes ``(rank, world_size, ...)`` and returns plain data.
"""

from __future__ import annotations

import io

import torch

import sparsecomm

IN, HIDDEN, OUT = 24, 48, 5


def make_model(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, hidden),  # 1152 + 48: one compressed, one dense
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),  # 2304 + 48
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, OUT),  # 240 + 5: small, dense
    )


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "dgc":  # the momentum lives in the wrapper (see wrap)
        return torch.optim.SGD(params, lr=0.05)
    if name in ("adamw", "adamw-updates", "adamw-local"):  # exchange: see wrap
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "catchup":
        return sparsecomm.CatchUpAdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "shared-local":  # exchange="local_updates"; refreshed at steps 1, 4, 7, ...
        return sparsecomm.SharedMomentAdamW(params, lr=1e-3, weight_decay=0.01, refresh_every=3)
    raise ValueError(name)


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at this step: depends on nothing else, so runs can be replayed."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, IN, generator=gen)
    y = torch.randn(size, OUT, generator=gen)
    return x, y


def train_step(model, opt, rank, step) -> None:
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def wrap(model, compressor, optimizer="sgd", **kwargs):
    return sparsecomm.CompressedOptimizer(
        make_optimizer(optimizer, model.parameters()),
        compressor=compressor,
        bucket_cap_mb=kwargs.pop("bucket_cap_mb", 0.01),  # ~2600 elements: several buckets
        momentum_correction=0.9 if optimizer == "dgc" else None,
        exchange={
            "adamw-updates": "updates",
            "adamw-local": "local_updates",
            "shared-local": "local_updates",
        }.get(optimizer, "gradients"),
        **kwargs,
    )


# ------------------------------------------------------------------ sync


def sync(rank, world_size, configs, steps):
    """Train from a different random init on each rank; return the final parameters of
    each (compressor, optimizer) config."""
    out = []
    for compressor, optimizer in configs:
        model = make_model(seed=rank)  # differs by rank: the wrapper must broadcast
        opt = wrap(model, compressor, optimizer)
        for step in range(steps):
            train_step(model, opt, rank, step)
        out.append(flat_params(model))
    return out


# ------------------------------------------------------------------ aggregation


def aggregation(rank, world_size, compressors, cases):
    """For each compressor: one parameter of ``numel`` elements (lr 0, so it stays at zero),
    compressed whatever its size; each case is one step in which autograd hands this rank
    the gradient ``case[rank]``. Records, per step, this rank's residual before and after
    and the averaged gradient the wrapped optimizer got, and the last step's stats. What
    the rank sent is not recorded: the test derives it from the gradient and the residual
    before, with the kernels' references, and adds the ranks' messages up itself."""
    numel = cases[0][rank].numel()
    out = []
    for compressor in compressors:
        param = torch.nn.Parameter(torch.zeros(numel))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([param], lr=0.0),
            compressor=compressor,
            min_compress_numel=0,
            profile=True,
        )
        records = []
        for case in cases:
            before = opt.residual(param)  # before backward: backward may already send
            (param * case[rank]).sum().backward()  # param.grad is exactly case[rank]
            opt.step()
            records.append((before, opt.residual(param), param.grad.clone()))
            opt.zero_grad()
        out.append((records, opt.last_stats))
    return out


# ------------------------------------------------------------------ average


def match_ddp(rank, world_size, steps):
    """Dense() against DistributedDataParallel, and TopK(1.0) / Threshold(0.0) against
    Dense(), from the same init and data."""
    results = {}
    ddp_model = make_model(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = make_optimizer("sgd", ddp.parameters())
    for step in range(steps):
        train_step(ddp, ddp_opt, rank, step)
    results["ddp"] = flat_params(ddp_model)
    for name, compressor in [
        ("dense", sparsecomm.Dense()),
        ("topk1", sparsecomm.TopK(1.0)),
        ("threshold0", sparsecomm.Threshold(0.0)),
    ]:
        model = make_model(seed=0)
        opt = wrap(model, compressor, min_compress_numel=0)
        for step in range(steps):
            train_step(model, opt, rank, step)
        results[name] = flat_params(model)
    return results


# ------------------------------------------------------------------ resume


def resume(rank, world_size, phase, directory, configs, save_at, steps):
    """phase 'full': train ``steps`` steps. 'first': train ``save_at`` steps and save.
    'second': new processes load the checkpoint and train on to ``steps``."""
    out = []
    for index, (compressor, optimizer) in enumerate(configs):
        model = make_model(seed=0)
        path = f"{directory}/config{index}_rank{rank}.pt"
        if phase == "second":
            saved = torch.load(path, weights_only=True)
            model.load_state_dict(saved["model"])
        opt = wrap(model, compressor, optimizer)
        first = 0
        if phase == "second":
            opt.load_state_dict(saved["optimizer"])
            first = save_at
        last = save_at if phase == "first" else steps
        for step in range(first, last):
            train_step(model, opt, rank, step)
        if phase == "first":
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            with open(path, "wb") as f:
                f.write(buffer.getvalue())
        with opt.shared_parameters():  # (exchange="local_updates": each rank's differ)
            out.append(flat_params(model))
    return out


def local_updates(rank, world_size, steps):
    """exchange="local_updates" on two ranks: per step, this rank's parameters, the shared
    ones (inside shared_parameters()) and its residuals."""
    model = make_model(seed=rank)
    opt = wrap(model, sparsecomm.TopK(0.05), "adamw-local")
    records = []
    for step in range(steps):
        train_step(model, opt, rank, step)
        local = flat_params(model)
        with opt.shared_parameters():
            shared = flat_params(model)
        residual = torch.cat([opt.residual(p).reshape(-1) for p in model.parameters()])
        records.append((local, shared, residual, flat_params(model)))
    return records


def shared_moment(rank, world_size, steps, refresh_every, average_dtype=torch.float32):
    """Dense() with exchange="updates" around SharedMomentAdamW, from one init on every
    rank. Returns its parameters, its bytes sent per step, the shared moment (divided by
    its weight) and ``shared_at`` after each step, and the ranks' averaged gradient of each
    step, which every rank computes from every rank's batch, as the reference."""
    model = make_model(seed=0)
    inner = sparsecomm.SharedMomentAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.01,
        refresh_every=refresh_every,
        average_dtype=average_dtype,
    )
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.Dense(), exchange="updates")
    sent, moments, refreshed, averages = [], [], [], []
    for step in range(steps):
        average = []
        for param in model.parameters():  # every rank's gradient at these parameters
            grads = []
            for other in range(world_size):
                x, y = batch(other, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                grads.append(torch.autograd.grad(loss, param)[0])
            average.append((sum(grads) / world_size).reshape(-1))
        averages.append(torch.cat(average))
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sent.append(opt.last_stats.bytes_sent)
        states = [inner.state[p] for p in model.parameters()]
        moments.append(
            torch.cat([(s["shared_exp_avg_sq"] / s["shared_weight"]).reshape(-1) for s in states])
        )
        refreshed.append(states[0]["shared_at"])
    return flat_params(model), sent, moments, refreshed, averages


def shared_moment_unused(rank, world_size):
    """SharedMomentAdamW with a refresh every step around a model of three linear maps:
    ``always`` used by every rank at every step, ``first`` only at step 0, ``second`` at
    step 1 by rank 1 alone. Returns, after each of the two steps, each map's weight's
    shared state (``shared_exp_avg_sq``, ``shared_weight``, ``shared_at``) and the bytes
    sent, and rank 1's gradient of ``second`` at step 1."""
    torch.manual_seed(0)
    maps = torch.nn.ModuleDict(
        {name: torch.nn.Linear(4, 4, bias=False) for name in ("always", "first", "second")}
    )
    inner = sparsecomm.SharedMomentAdamW(
        maps.parameters(), lr=1e-2, refresh_every=1, average_dtype=torch.float32
    )
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.Dense(), exchange="updates")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    states, sent, second_grad = [], [], None
    for step in range(2):
        used = ["always"] + (["first"] if step == 0 else ["second"] if rank == 1 else [])
        sum(maps[name](x).square().sum() for name in used).backward()
        if step == 1 and rank == 1:
            second_grad = maps["second"].weight.grad.clone()
        opt.step()
        opt.zero_grad()
        sent.append(opt.last_stats.bytes_sent)
        states.append(
            {
                name: {
                    key: (value.clone() if torch.is_tensor(value) else value)
                    for key, value in inner.state[maps[name].weight].items()
                    if key.startswith("shared")
                }
                for name in maps
                if inner.state[maps[name].weight]
            }
        )
    return states, sent, second_grad


def shared_moment_step(model, opt, step, device="cpu"):
    """One step of a SharedMomentAdamW ``opt`` alone, as its wrapper would drive it on 2
    ranks: the world size said, a refresh when due (seeded random sums), then rank 0's
    batch."""
    opt.set_world_size(2)
    if opt.average_gradient_due():
        gen = torch.Generator().manual_seed(step)
        opt.take_average_gradient(
            {p: torch.randn(p.shape, generator=gen).to(device) for p in model.parameters()}
        )
    x, y = (t.to(device) for t in batch(0, step))
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def shared_moment_out_of_step(rank, world_size):
    """Rank 1's SharedMomentAdamW one step ahead of rank 0's (as if stepped outside the
    wrapper): the next step must be refused on both, before anything is sent or stepped.
    Returns the refusal's message and whether the parameters stayed as they were."""
    model = make_model(seed=0)
    inner = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2, refresh_every=2)
    opt = sparsecomm.CompressedOptimizer(inner, sparsecomm.TopK(0.05), exchange="local_updates")
    train_step(model, opt, rank, 0)
    inner.steps += rank
    before = flat_params(model)
    x, y = batch(rank, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error), torch.equal(before, flat_params(model))
    return "no refusal", False


def shared_moment_against_dense(rank, world_size):
    """One step of Dense() with exchange="updates" around SharedMomentAdamW (a refresh, in
    float32) and around AdamW, beside AdamW on the ranks' averaged gradient; each rank's
    loss is a part shared by every rank plus a smaller one of its own. Returns the three
    models' parameters after the step and every rank's gradient at the start."""
    models = [make_model(seed=0) for _ in range(3)]
    shared = sparsecomm.CompressedOptimizer(
        sparsecomm.SharedMomentAdamW(
            models[0].parameters(), lr=1e-2, weight_decay=0.0, average_dtype=torch.float32
        ),
        sparsecomm.Dense(),
        exchange="updates",
    )
    per_rank = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.0),
        sparsecomm.Dense(),
        exchange="updates",
    )
    dense = torch.optim.AdamW(models[2].parameters(), lr=1e-2, weight_decay=0.0, foreach=False)

    def loss(model, who):
        x, y = batch(1000, 0)  # every rank's
        own_x, own_y = batch(who, 0)
        mse = torch.nn.functional.mse_loss
        return mse(model(x), y) + 0.2 * mse(model(own_x), own_y)

    grads = []
    for who in range(world_size):
        loss(models[2], who).backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in models[2].parameters()]))
        dense.zero_grad()
    for model, opt in ((models[0], shared), (models[1], per_rank)):
        loss(model, rank).backward()
        opt.step()
        opt.zero_grad()
    for who in range(world_size):
        (loss(models[2], who) / world_size).backward()
    dense.step()
    return [flat_params(m) for m in models], grads


def resumed_at_different_steps(rank, world_size):
    """Each rank saves after steps 2 and 4. New optimizers: the ranks load saves of
    different steps, or only rank 0 loads one (each case's error message, or None). Then,
    mid-run, rank 0 alone reloads its save of the step it is at: training goes on in sync
    (the parameters after two more steps)."""
    model = make_model(seed=0)
    opt = wrap(model, sparsecomm.TopK(0.05, warmup_steps=10))
    saves = {}
    for step in range(4):
        train_step(model, opt, rank, step)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        saves[step + 1] = buffer.getvalue()

    def load(step):
        return torch.load(io.BytesIO(saves[step]), weights_only=True)

    messages = []
    for case in ("different steps", "rank 0 only"):
        opt = wrap(model, sparsecomm.TopK(0.05, warmup_steps=10))
        if case == "different steps" or rank == 0:
            opt.load_state_dict(load(4 if rank == 0 else 2))
        try:
            train_step(model, opt, rank, 10)
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
            opt.zero_grad()
    opt = wrap(model, sparsecomm.TopK(0.05, warmup_steps=10))
    opt.load_state_dict(load(4))
    train_step(model, opt, rank, 4)  # overlapping from here: exchanges start in hooks
    if rank == 0:
        opt.load_state_dict(opt.state_dict())
    for step in (5, 6):
        train_step(model, opt, rank, step)
    return messages, flat_params(model)


# ------------------------------------------------------------------ no hangs


def mismatched_model(rank, world_size):
    hidden = HIDDEN + (1 if rank == 1 else 0)
    model = make_model(seed=0, hidden=hidden)
    try:
        wrap(model, sparsecomm.TopK(0.1))
    except ValueError as error:
        return str(error)
    return None


def mismatched_count(rank, world_size):
    model = make_model(seed=0)
    params = list(model.parameters())
    if rank == 0:
        params = params[:-1]
    try:
        sparsecomm.CompressedOptimizer(torch.optim.SGD(params, lr=0.1), sparsecomm.TopK(0.1))
    except ValueError as error:
        return str(error)
    return None


def _snapshot(model, opt):
    return (
        flat_params(model),
        [opt.residual(p) for p in model.parameters()],
        {k: v.clone() for k, v in _inner_state(opt).items()},
    )


def _inner_state(opt):
    out = {}
    for i, state in enumerate(opt.optimizer.state.values()):
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"{i}.{key}"] = value
    return out


def _same(a, b) -> bool:
    params_a, residuals_a, state_a = a
    params_b, residuals_b, state_b = b
    return (
        torch.equal(params_a, params_b)
        and all(torch.equal(x, y) for x, y in zip(residuals_a, residuals_b))
        and state_a.keys() == state_b.keys()
        and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    )


def nan_on_one_rank(rank, world_size, bad_value):
    model = make_model(seed=0)
    opt = wrap(model, sparsecomm.TopK(0.05), "adamw")
    for step in range(3):
        train_step(model, opt, rank, step)
    before = _snapshot(model, opt)
    x, y = batch(rank, 3)

    def poison(grad):  # during backward: the bucket is sent before backward returns
        grad = grad.clone()
        grad[3, 7] = bad_value
        return grad

    handle = model[2].weight.register_hook(poison) if rank == 1 else None
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    except sparsecomm.NonFiniteGradientError as error:
        caught = (type(error).__name__, error.ranks, str(error))
    else:
        caught = None
    if handle is not None:
        handle.remove()
    unchanged = _same(before, _snapshot(model, opt))
    # The group still works: a clean step goes through on every rank.
    opt.zero_grad()
    train_step(model, opt, rank, 4)
    return caught, unchanged, flat_params(model)


def unused_parameters(rank, world_size):
    """Rank 1 never uses the middle layer; nobody uses an extra head."""
    model = make_model(seed=0)
    head = torch.nn.Linear(HIDDEN, 3)
    params = list(model.parameters()) + list(head.parameters())
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(params, lr=0.05, momentum=0.9), sparsecomm.TopK(0.1), bucket_cap_mb=0.01
    )
    for step in range(5):
        x, y = batch(rank, step)
        hidden = model[1](model[0](x))
        if rank != 1:
            hidden = model[3](model[2](hidden))
        loss = torch.nn.functional.mse_loss(model[4](hidden), y)
        loss.backward()
        opt.step()
        head_grads_none = head.weight.grad is None and head.bias.grad is None
        middle_has_grad = model[2].weight.grad is not None
        opt.zero_grad()
    return flat_params(model), head_grads_none, middle_has_grad


def unfrozen_after_wrapping(rank, world_size):
    """The first layer frozen when wrapped and unfrozen after two steps: the next
    backward raises before it sends anything; wrapping again as the error says, with the
    state of the first wrapper, trains every layer in sync. Returns the error, whether
    the residuals of the third layer carried over, and the parameters."""
    model = make_model(seed=0)
    model[0].requires_grad_(False)
    opt = wrap(model, sparsecomm.TopK(0.1), "sgd")
    for step in range(2):
        train_step(model, opt, rank, step)
    model[0].requires_grad_(True)
    x, y = batch(rank, 2)
    error = None
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as caught:
        error = str(caught)
    opt.zero_grad()
    kept = opt.residual(model[2].weight).clone()
    state = opt.state_dict()
    opt = sparsecomm.CompressedOptimizer(opt.optimizer, sparsecomm.TopK(0.1), bucket_cap_mb=0.01)
    opt.load_state_dict(state)
    carried = torch.equal(opt.residual(model[2].weight), kept)
    first = model[0].weight.detach().clone()
    for step in range(2, 4):
        train_step(model, opt, rank, step)
    return error, carried, not torch.equal(model[0].weight, first), flat_params(model)


def grad_scaler_overflow(rank, world_size, clip=False):
    """Rank 1's gradient overflows at step 2 under GradScaler. With ``clip``, each step
    runs ``scaler.unscale_(opt); opt.synchronize(scaler)`` and clips, recording the norm
    of what it clipped (the average, so the same on every rank) at the good steps."""
    model = make_model(seed=0)
    opt = wrap(model, sparsecomm.TopK(0.05), "sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales, skipped, norms = [], [], []
    for step in range(4):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == 2 and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        before = _snapshot(model, opt)
        if clip:
            scaler.unscale_(opt)
            opt.synchronize(scaler)
            if step != 2:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        scaler.step(opt)
        scaler.update()
        skipped.append(_same(before, _snapshot(model, opt)))
        scales.append(scaler.get_scale())
        opt.zero_grad()
    residual_finite = all(torch.isfinite(opt.residual(p)).all() for p in model.parameters())
    params, skipped_steps = flat_params(model), opt.total_stats.skipped_steps
    return scales, skipped, residual_finite, params, skipped_steps, norms


def grad_scaler_synchronize_odd_ranks(rank, world_size):
    """``scaler.unscale_(opt); opt.synchronize(scaler); scaler.step(opt)`` on both ranks
    while rank 1 has no gradient (step 1) and while its backward raised and it dropped the
    step (step 2). Returns the scales and the parameters."""
    model = make_model(seed=0)
    opt = wrap(model, sparsecomm.TopK(0.05), "sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales = []
    for step in range(4):
        x, y = batch(rank, step)
        if rank == 1 and step == 2:
            opt.drop_step()  # as after a backward that raised
        elif not (rank == 1 and step == 1):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        opt.synchronize(scaler)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales, flat_params(model)


def updates_unfrozen_and_dropped(rank, world_size):
    """exchange='updates', the first layer unfrozen after wrapping; rank 0 steps, rank 1
    drops the step: both refuse it by name, neither waits for the other."""
    model = make_model(seed=0)
    model[0].requires_grad_(False)
    opt = wrap(model, sparsecomm.TopK(0.1), "adamw-updates")
    train_step(model, opt, rank, 0)
    model[0].requires_grad_(True)
    try:
        if rank == 0:
            x, y = batch(rank, 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        else:
            opt.drop_step()
    except RuntimeError as error:
        return str(error)
    return None


def residual_is_unscaled(rank, world_size):
    """Under GradScaler the residual equals what the same step leaves without a scaler."""
    out = []
    for use_scaler in (False, True):
        model = make_model(seed=0)
        opt = wrap(model, sparsecomm.TopK(0.05), "sgd")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=use_scaler)
        x, y = batch(rank, 0)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        out.append(torch.cat([opt.residual(p).reshape(-1) for p in model.parameters()]))
    return out


# ------------------------------------------------------------------ sparse-to-dense switch


def dense_switch(rank, world_size, cases):
    """One step of one 10000-element parameter under ``TopK(density, value_dtype=dtype)``
    for each ``(dtype, density)``: the bytes this rank sent, and whether the average is
    the same as a dense one of the same message would be (the switch changes no bits)."""
    out = []
    for dtype, density in cases:
        weight = torch.nn.Parameter(torch.zeros(10_000))
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD([weight], lr=1.0),
            sparsecomm.TopK(density, value_dtype=dtype),
            min_compress_numel=0,
        )
        weight.grad = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
        opt.step()
        out.append((opt.last_stats.bytes_sent, opt.last_stats.elements_sent))
    return out
