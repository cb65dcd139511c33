"""Functions run on gloo ranks by tests/test_overlap.py: the exchange during backward, and
the DDP comm-hook front door. Each takes ``(rank, world_size, ...)`` and returns plain data."""

from __future__ import annotations

import contextlib
import copy
import io

import torch

import sparsecomm

IN, HIDDEN, OUT = 24, 48, 5


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def batch(rank: int, step: int, size: int = 16):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, IN, generator=gen), torch.randn(size, OUT, generator=gen)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def wrap(model, compressor, **kwargs):
    """AdamW inside, or ``inner="shared-moment"``: SharedMomentAdamW refreshed every 3rd step
    (with ``exchange="local_updates"``)."""
    if kwargs.pop("inner", "adamw") == "shared-moment":
        inner = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-3, refresh_every=3)
        kwargs.setdefault("exchange", "local_updates")
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sparsecomm.CompressedOptimizer(
        inner,
        compressor,
        bucket_cap_mb=kwargs.pop("bucket_cap_mb", 0.01),  # several buckets
        **kwargs,
    )


def overlap_matches_step(rank, world_size, compressor, steps):
    """The same training with the exchange during backward and inside step(): the same
    bits. Also returns how many steps found their gradients already averaged after
    backward (the overlap path)."""
    out = {}
    for overlap in (True, False):
        model = make_model()
        opt = wrap(model, compressor, overlap=overlap)
        averaged_after_backward = 0
        for step in range(steps):
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            averaged_after_backward += int(opt._synchronized)
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing
        out[overlap] = (flat(model), averaged_after_backward)
    return out


def accumulate(rank, world_size, compressor, micro):
    """``micro`` micro-batches per step under no_sync against the same sum of gradients
    exchanged once by step() (overlap=False): the same bits."""
    out = []
    for use_no_sync in (True, False):
        model = make_model()
        opt = wrap(model, compressor, overlap=use_no_sync)
        for step in range(3):
            for i in range(micro):
                last = i == micro - 1
                with opt.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                    x, y = batch(rank, 10 * step + i)
                    torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(flat(model))
    return out


def changing_used_set(rank, world_size, compressor):
    """Which layers a rank uses changes every step and differs between ranks; one head is
    never used. Ranks stay in sync, and the head keeps grad None and its residual."""
    model = make_model()
    head = torch.nn.Linear(HIDDEN, 3)
    params = list(model.parameters()) + list(head.parameters())
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(params, lr=0.05, momentum=0.9), compressor, bucket_cap_mb=0.01
    )
    head_none = []
    for step in range(6):
        x, y = batch(rank, step)
        hidden = model[1](model[0](x))
        if (step + rank) % 2 == 0:
            hidden = model[3](model[2](hidden))
        torch.nn.functional.mse_loss(model[4](hidden), y).backward()
        opt.step()
        head_none.append(head.weight.grad is None and head.bias.grad is None)
        opt.zero_grad()
    return flat(model), head_none


def backward_twice(rank, world_size):
    model = make_model()
    opt = wrap(model, sparsecomm.TopK(0.1))
    for step in range(2):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = batch(rank, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as error:
        return str(error)
    return None


class _Boom(torch.autograd.Function):
    """Identity forward; backward raises while ``armed`` (an out-of-memory stand-in)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Boom.armed:
            raise MemoryError("out of memory (test)")
        return grad


def _loss(model, x, y, boom_at):
    """The model's loss with _Boom after layer ``boom_at`` (None: nowhere)."""
    for index, layer in enumerate(model):
        x = layer(x)
        if index == boom_at:
            x = _Boom.apply(x)
    return torch.nn.functional.mse_loss(x, y)


def drop_and_retry(
    rank, world_size, compressor, boom_at_by_rank, wrap_kwargs=None, accumulate=None
):
    """Step 2's first backward raises on some ranks (after layer ``boom_at_by_rank[rank]``;
    None: it finishes; 4: before any parameter's gradient), each rank that caught the error
    calls drop_step(), every rank's step() raises StepDroppedError, and every rank runs the
    same batch again. ``accumulate``: the failing backward is the first of two
    micro-batches, inside no_sync(), and drop_step() is called after leaving no_sync
    ("after"), inside it ("inside"), or inside it with the accumulation then left
    unfinished and zero_grad() called instead of step() ("inside-zero_grad"). Returns, for
    the failing run and a clean one: the (shared) parameters, the residuals, the ranks the
    error named, the skipped steps and this rank's own parameters."""
    out = []
    for fail in (True, False):
        model = make_model()
        opt = wrap(model, compressor, **(wrap_kwargs or {}))
        named = None
        for step in range(4):
            x, y = batch(rank, step)
            if fail and step == 2:
                boom = boom_at_by_rank[rank]
                _Boom.armed = boom is not None
                try:
                    if accumulate in ("inside", "inside-zero_grad"):
                        with opt.no_sync():
                            try:
                                _loss(model, x, y, boom_at=boom).backward()
                            except MemoryError:
                                opt.drop_step()
                                opt.drop_step()  # twice: the second sends nothing
                    else:
                        with opt.no_sync() if accumulate else contextlib.nullcontext():
                            _loss(model, x, y, boom_at=boom).backward()
                except MemoryError:
                    opt.drop_step()
                    opt.drop_step()  # twice: the second sends nothing (or the ranks hang)
                finally:
                    _Boom.armed = False
                if not (accumulate == "inside-zero_grad" and boom is not None):
                    if accumulate:
                        _loss(model, x, y, boom_at=None).backward()
                    try:
                        opt.step()
                    except sparsecomm.StepDroppedError as error:
                        named = error.ranks
                opt.zero_grad()  # (inside-zero_grad: sends the dropping rank's part)
            if accumulate:
                with opt.no_sync():
                    _loss(model, x, y, boom_at=None).backward()
            _loss(model, x, y, boom_at=None).backward()
            opt.step()
            opt.zero_grad()
        residuals = torch.cat([opt.residual(p).reshape(-1) for p in model.parameters()])
        with opt.shared_parameters():  # (local_updates: the same bits on every rank)
            shared = flat(model)
        out.append((shared, residuals, named, opt.total_stats.skipped_steps, flat(model)))
    return out


def drop_under_grad_scaler(rank, world_size, boom_at_by_rank):
    """Step 2's first backward raises on the ranks ``boom_at_by_rank`` names, which call
    drop_step(); every rank then steps through its GradScaler. Returns each step's scale
    after update() and the parameters."""
    model = make_model()
    opt = wrap(model, sparsecomm.TopK(0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales = []
    for step in range(4):
        x, y = batch(rank, step)
        boom = boom_at_by_rank[rank] if step == 2 else None
        _Boom.armed = boom is not None
        try:
            scaler.scale(_loss(model, x, y, boom_at=boom)).backward()
        except MemoryError:
            opt.drop_step()
        finally:
            _Boom.armed = False
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, flat(model), opt.total_stats.skipped_steps


# ------------------------------------------------------------------ the DDP front door


def _ddp_train(rank, model, hook, steps, start=0, accumulate=1, bucket_cap_mb=0.01, optimizer=None):
    """DDP with ``hook = (state, fn)`` registered (None: DDP's own all-reduce), stepped by
    ``optimizer(params)`` (default SGD with momentum)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    if optimizer is None:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = optimizer(ddp.parameters())
    for step in range(start, steps):
        for i in range(accumulate):
            context = ddp.no_sync() if i < accumulate - 1 else contextlib.nullcontext()
            with context:
                x, y = batch(rank, 10 * step + i)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ddp, opt


def ddp_hook_in_sync(rank, world_size, compressor, steps):
    """Every compressor through DDP's hook: ranks hold the same bits, bytes are counted."""
    model = make_model()
    state, hook = sparsecomm.ddp_comm_hook(compressor)
    _ddp_train(rank, model, (state, hook), steps, accumulate=2)
    return flat(model), state.last_bytes_sent, state.iteration


def ddp_hook_catchup(rank, world_size, steps):
    """DDP's hook with TopK behind sparsecomm.CatchUpAdamW: the parameters and, per
    parameter, the smallest step at which a coordinate last received something."""
    model = make_model()
    hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1))
    _, opt = _ddp_train(
        rank, model, hook, steps, optimizer=lambda p: sparsecomm.CatchUpAdamW(p, lr=1e-2)
    )
    oldest = [int(s["last_step"].min()) for s in opt.state.values()]
    return flat(model), oldest


def ddp_hook_residual_buffers(rank, world_size, compressor, steps):
    """Each DDP bucket's residual tensor (its address) after every step: after DDP's bucket
    rebuild each bucket keeps one residual, not a new one each step."""
    model = make_model()
    state, hook = sparsecomm.ddp_comm_hook(compressor)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    addresses = []
    for step in range(steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        addresses.append({i: r.data_ptr() for i, r in state.residuals.items()})
    return addresses


def ddp_hook_under_grad_scaler(rank, world_size, hooked, overflow_at, steps, path, cap):
    """DDP (``cap`` MiB buckets) under ``GradScaler``, with ``TopK(0.1)``'s hook or without
    one; rank 0's loss overflows at each step of ``overflow_at``. Returns the scale after
    each step and, with the hook, why its state, saved after the last step to ``path``,
    did not load into a new hook state (None: it loaded)."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    state = None
    if hooked:
        state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1))
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step in range(steps):
        x, y = batch(rank, step)
        if step in overflow_at and rank == 0:
            x[0] = float("inf")  # NaN in more of the gradient than TopK sends
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    refused = None
    if state is not None:
        torch.save(state.state_dict(), f"{path}/hook_rank{rank}.pt")
        fresh, _ = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1))
        try:
            fresh.load_state_dict(torch.load(f"{path}/hook_rank{rank}.pt", weights_only=True))
        except ValueError as error:
            refused = str(error)
    return scales, refused


def _hook_residuals(state, model) -> list[torch.Tensor]:
    """The hook state's residual of each parameter of ``model`` (zeros where it has none)."""
    saved = state.state_dict()["residuals"]
    keys = [state._keys.get(id(p)) for p in model.parameters()]
    return [
        saved[key].view_as(p) if key in saved else torch.zeros_like(p)
        for key, p in zip(keys, model.parameters())
    ]


def ddp_hook_skip_gives_back_what_was_sent(
    rank, world_size, compressor, cap, overflow_at, look_after_skip
):
    """DDP under ``GradScaler`` with ``compressor``'s hook; rank 0's loss overflows at step
    ``overflow_at``, so the scaler skips that step on every rank. Returns the scales, each
    parameter's residual before that step plus the scaled gradient the rank computed for
    it (apart, on a copy of the model), the residuals right after the step
    (``look_after_skip``; else None: the hook settles the skipped step at the next
    iteration's first bucket instead of ``state_dict``), and the parameters at the end."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    state, hook = sparsecomm.ddp_comm_hook(compressor)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, expected, after = [], None, None
    for step in range(overflow_at + 3):
        x, y = batch(rank, step)
        if step == overflow_at:
            if rank == 0:
                x[0] = float("inf")
            replica = copy.deepcopy(model)
            scaler.scale(torch.nn.functional.mse_loss(replica(x), y)).backward()
            before = _hook_residuals(state, model)
            expected = [r + p.grad for r, p in zip(before, replica.parameters())]
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if step == overflow_at and look_after_skip:
            after = _hook_residuals(state, model)
    return scales, expected, after, flat(model)


def ddp_hook_dense_matches_ddp(rank, world_size, steps):
    plain, hooked = make_model(), make_model()
    _ddp_train(rank, plain, None, steps)
    _ddp_train(rank, hooked, sparsecomm.ddp_comm_hook(sparsecomm.Dense()), steps)
    return flat(plain), flat(hooked)


def ddp_hook_loaded_at_different_iterations(rank, world_size, thrown_away=0):
    """Rank 0 loads its hook state of iteration 2, rank 1 its state of iteration 1 (with a
    warm-up their densities would differ), after ``thrown_away`` backward passes of the
    new hook whose gradients are thrown away (as a resume loads once DDP has rebuilt its
    buckets); returns the error of the next backward."""
    model = make_model()
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1, warmup_steps=5))
    saves = []
    for step in range(2):
        _ddp_train(rank, model, (state, hook), step + 1, start=step)
        saves.append(copy.deepcopy(state.state_dict()))
    fresh, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1, warmup_steps=5))
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.01)
    ddp.register_comm_hook(fresh, hook)
    for step in range(thrown_away):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.zero_grad()
    fresh.load_state_dict(saves[1] if rank == 0 else saves[0])
    try:
        x, y = batch(rank, 9)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    except RuntimeError as error:
        return str(error)
    return None


def ddp_hook_collective_fails(rank, world_size, compressor, timeout_s):
    """DDP and the hook on a group whose collectives give up after ``timeout_s``; rank 1
    sits out step 2's backward (longer than that), so rank 0's collectives of that step
    fail. Returns rank 0's error of that backward as ``(type, message)``, or "no
    error"."""
    import datetime
    import time

    import torch.distributed as dist

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    ddp = torch.nn.parallel.DistributedDataParallel(
        make_model(), bucket_cap_mb=0.01, process_group=group
    )
    ddp.register_comm_hook(*sparsecomm.ddp_comm_hook(compressor, process_group=group))
    for step in range(3):  # (DDP's own collectives, rebuilding its buckets, are done by 2)
        if step == 2 and rank == 1:
            time.sleep(timeout_s + 3)
            return None
        x, y = batch(rank, step)
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        except Exception as error:  # (whatever the collective raised)
            return type(error).__name__, str(error)
    return "no error"


def ddp_hook_built_differently(rank, world_size, which):
    """The ranks build their hooks with different settings (``which``: "dtype", Cast
    fp16 on rank 0 and bf16 on rank 1; "dense_iterations", 0 against 2); returns the
    error of the first backward."""
    if which == "dtype":
        dtype = torch.float16 if rank == 0 else torch.bfloat16
        state, hook = sparsecomm.ddp_comm_hook(sparsecomm.Cast(dtype))
    else:
        state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1), dense_iterations=2 * rank)
    try:
        _ddp_train(rank, make_model(), (state, hook), 1)
    except RuntimeError as error:
        return str(error)
    return None


def ddp_hook_resume(rank, world_size, directory, phase, save_at, steps, cap):
    """Train to ``save_at``, save model, optimizer and hook state; new processes load them
    and train on. Returns the parameters and the residual pieces per parameter."""
    model = make_model()
    state, hook = sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.1))
    path = f"{directory}/hook_rank{rank}.pt"
    if phase == "full":
        _ddp_train(rank, model, (state, hook), steps, bucket_cap_mb=cap)
        return flat(model), state.state_dict()["residuals"]
    if phase == "first":
        _, opt = _ddp_train(rank, model, (state, hook), save_at, bucket_cap_mb=cap)
        buffer = io.BytesIO()
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
            buffer,
        )
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
        return flat(model), state.state_dict()["residuals"]
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    if phase == "second":
        state.load_state_dict(saved["hook"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    ddp.register_comm_hook(state, hook)
    if phase == "after-a-backward":
        # A backward before the load (DDP rebuilds its buckets after it): the loaded
        # residuals still go to the parameters they were saved for.
        x, y = batch(rank, 10 * save_at)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.zero_grad()
        state.load_state_dict(saved["hook"])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(saved["opt"])
    for step in range(save_at, steps):
        x, y = batch(rank, 10 * step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat(model), state.state_dict()["residuals"]


class Bucket:
    """Just enough of torch.distributed.GradBucket for the hook on one process: a bucket
    of ``params`` (default: one parameter, the same every call) whose gradients are
    ``buffer``."""

    param = torch.nn.Parameter(torch.zeros(0))

    def __init__(self, buffer, index=0, last=True, params=None):
        self._buffer, self._index, self._last, self._params = buffer, index, last, params

    def parameters(self):
        if self._params is not None:
            return self._params
        self.param.data = torch.zeros(self._buffer.numel())
        return [self.param]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def hook_skip_on_one_bucket(device, compressor, steps: int = 6, bad_at: int = 4):
    """Two buckets of random gradients through the hook on one process (W = 1); at step
    ``bad_at`` bucket 1's gradient holds an Inf, so that step's averages are non-finite
    and the step counts as skipped. Returns, per bucket, its residual before that step
    plus its gradient there, and its residual right after it (both on the CPU)."""
    state, hook = sparsecomm.ddp_comm_hook(compressor)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 200)]
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        grads = [torch.randn(p.numel(), generator=generator).to(device) for p in params]
        if step == bad_at:
            grads[1][7] = float("inf")
            expected = [state.residuals[i] + g for i, g in enumerate(grads)]
        for index, (grad, param) in enumerate(zip(grads, params)):
            hook(state, Bucket(grad, index=index, last=index == 1, params=[param])).wait()
        if step == bad_at:
            saved = state.state_dict()["residuals"]
            after = [saved[0], saved[1]]
    if device.type == "cuda":
        assert state.graphs.replays > 0  # the skipped step's messages came from graphs
    return [e.cpu() for e in expected], [a.cpu() for a in after]
