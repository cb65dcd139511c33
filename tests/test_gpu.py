"""The optimizer on CUDA tensors, through the Triton kernels (skipped without a GPU).

Each compressor's CUDA step must equal the CPU reference step bit for bit (the kernels return
exactly what their references return), and ranks sharing the GPU over gloo must end with
bitwise-identical parameters.
"""

import copy

import _overlap_workers
import _workers
import pytest
import torch
from _dist import run_ranks

import sparsecomm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMPRESSORS = [
    sparsecomm.Dense(),
    sparsecomm.Cast(torch.float16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Threshold(2e-3),
    sparsecomm.TopK(0.05),
    sparsecomm.TopK(0.001),
    sparsecomm.TopK(0.05, value_dtype=torch.bfloat16),
]


def _run_local(device, compressor, steps=10):
    model = _workers.make_model(seed=0).to(device)
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        compressor=compressor,
        min_compress_numel=0,
    )
    for step in range(steps):
        x, y = (t.to(device) for t in _workers.batch(0, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    residual = torch.cat([opt.residual(p).reshape(-1) for p in model.parameters()])
    return _workers.flat_params(model).cpu(), residual.cpu()


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_cuda_training_runs_and_tracks_the_cpu_run(compressor):
    cpu_params, cpu_residual = _run_local("cpu", compressor)
    gpu_params, gpu_residual = _run_local("cuda", compressor)
    # The model's own matmuls differ between CPU and GPU; compare the compression by
    # feeding identical gradients instead when the forward differs.
    if not torch.equal(cpu_params, gpu_params):
        torch.testing.assert_close(gpu_params, cpu_params, rtol=1e-3, atol=1e-3)
    assert torch.isfinite(gpu_residual).all()


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_cuda_compression_is_bit_identical_to_reference(compressor, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    for numel in (1, 1023, 123457, 10_000_019):
        grad = torch.randn(numel, generator=gen)
        grad[::5] = 0.5  # ties
        residual = torch.randn(numel, generator=gen) * 1e-3
        outputs = {}
        for device in ("cpu", "cuda"):
            g, r = grad.to(device), residual.clone().to(device)
            message = compressor.compress(g, r, world_size=4)
            outputs[device] = (message.decode().cpu(), r.cpu())
        sent_cpu, res_cpu = outputs["cpu"]
        sent_gpu, res_gpu = outputs["cuda"]
        assert torch.equal(sent_cpu.view(torch.int32), sent_gpu.view(torch.int32)), numel
        assert torch.equal(res_cpu.view(torch.int32), res_gpu.view(torch.int32)), numel


def _sync_on_cuda(rank, world_size, configs, steps):
    torch.cuda.set_device(0)
    out = []
    for compressor in configs:
        model = _workers.make_model(seed=rank).cuda()
        opt = _workers.wrap(model, compressor, "sgd")
        for step in range(steps):
            x, y = (t.cuda() for t in _workers.batch(rank, step))
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(_workers.flat_params(model).cpu())
    return out


def test_ranks_sharing_the_gpu_over_gloo_stay_bitwise_identical():
    results = run_ranks(_sync_on_cuda, 2, COMPRESSORS, 20, timeout=300)
    for index, compressor in enumerate(COMPRESSORS):
        a, b = results[0][index], results[1][index]
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), compressor


def _run_cuda(compressor, overlap, steps=6):
    model = _workers.make_model(seed=0).cuda()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        compressor=compressor,
        bucket_cap_mb=0.01,
        overlap=overlap,
    )
    for step in range(steps):
        x, y = (t.cuda() for t in _workers.batch(0, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _workers.flat_params(model).cpu()


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_cuda_overlap_gives_the_bits_of_the_exchange_in_step(compressor):
    a, b = _run_cuda(compressor, True), _run_cuda(compressor, False)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), compressor


def test_cuda_nonfinite_gradient_during_backward_raises_and_keeps_residual():
    model = _workers.make_model(seed=0).cuda()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), sparsecomm.TopK(0.05)
    )
    for step in range(2):
        x, y = (t.cuda() for t in _workers.batch(0, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    residual = opt.residual(model[0].weight)
    handle = model[0].weight.register_hook(lambda g: g * float("nan"))
    x, y = (t.cuda() for t in _workers.batch(0, 2))
    torch.nn.functional.mse_loss(model(x), y).backward()
    handle.remove()
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    assert torch.equal(residual, opt.residual(model[0].weight))


def _train_ddp_hook_cuda(compressor, steps: int, **hook_kwargs):
    """DDP (one NCCL rank, small buckets) with sparsecomm's hook, SGD on the tests' small
    model for ``steps`` steps: the final parameters (on the CPU) and the hook state."""
    model = _workers.make_model(seed=0).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state, hook = sparsecomm.ddp_comm_hook(compressor, **hook_kwargs)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        x, y = (t.cuda() for t in _workers.batch(0, step))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _workers.flat_params(model).cpu(), state


def test_cuda_ddp_hook_runs_on_nccl(tmp_path):
    """World size 1 over NCCL, every compressor: DDP with the hook trains (parameters move,
    stay finite), the hook counts its bytes, and its residuals live on the GPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for compressor in COMPRESSORS:
            start = _workers.flat_params(_workers.make_model(seed=0))
            end, state = _train_ddp_hook_cuda(compressor, steps=4)
            assert torch.isfinite(end).all() and not torch.equal(start, end), compressor
            assert state.last_bytes_sent > 0, compressor
            assert all(r.is_cuda for r in state.residuals.values()), compressor
    finally:
        dist.destroy_process_group()


def test_cuda_ddp_hook_graphs_give_the_bits_of_eager_launches(tmp_path):
    """The hook's compression replayed from CUDA graphs (``cuda_graphs=True``) trains to the
    same bits as launched eagerly, over DDP's buckets on one NCCL rank; the graphs replay."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for compressor in GRAPHED:
            eager, _ = _train_ddp_hook_cuda(compressor, steps=12)
            graphed, state = _train_ddp_hook_cuda(compressor, steps=12, cuda_graphs=True)
            assert torch.equal(eager.view(torch.int32), graphed.view(torch.int32)), compressor
            assert state.graphs.replays > 0, compressor
    finally:
        dist.destroy_process_group()


GRAPHED = [
    sparsecomm.TopK(0.05),
    sparsecomm.TopK(0.05, warmup_steps=4),  # k changes for 4 steps: graphs come after
    # The rounding runs after each replay, on the buffers the bucket has at that step.
    sparsecomm.TopK(0.05, value_dtype=torch.bfloat16),
    sparsecomm.Cast(torch.bfloat16),
    sparsecomm.Cast(),
]


def _train_graphed_cuda(compressor, cuda_graphs: bool, steps: int = 12, nan_at=None):
    model = _workers.make_model(seed=0).cuda()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        compressor,
        bucket_cap_mb=0.01,
        min_compress_numel=0,
        cuda_graphs=cuda_graphs,
    )
    refused = []
    for step in range(steps):
        x, y = (t.cuda() for t in _workers.batch(0, step))
        handle = None
        if step == nan_at:
            handle = model[0].weight.register_hook(lambda g: g * float("nan"))
        torch.nn.functional.mse_loss(model(x), y).backward()
        if handle is not None:
            handle.remove()
        before = opt.residual(model[0].weight)
        try:
            opt.step()
        except sparsecomm.NonFiniteGradientError:
            refused.append(step)
            assert torch.equal(before, opt.residual(model[0].weight)), "residual changed"
        opt.zero_grad()
    return _workers.flat_params(model).cpu(), opt, refused


@pytest.mark.parametrize("compressor", GRAPHED, ids=repr)
def test_cuda_graphs_replay_the_bits_of_eager_compression(compressor):
    eager, _, _ = _train_graphed_cuda(compressor, cuda_graphs=False)
    graphed, opt, _ = _train_graphed_cuda(compressor, cuda_graphs=True)
    assert len(opt._engine.buckets) > 1
    # Step 1 exchanges in step(); from step 2 on buckets go during backward, their
    # buffers swapping: each (bucket, buffer) key runs eagerly, then is captured, then
    # replayed.
    assert opt._engine.graphs.replays >= len(opt._engine.buckets) * 4
    assert not opt._engine.graphs.failed
    assert torch.equal(eager.view(torch.int32), graphed.view(torch.int32))


@pytest.mark.parametrize("compressor", GRAPHED, ids=repr)
def test_cuda_graphs_refuse_a_nan_step_like_eager_compression(compressor):
    eager, _, refused_eager = _train_graphed_cuda(compressor, cuda_graphs=False, nan_at=5)
    graphed, opt, refused_graphed = _train_graphed_cuda(compressor, cuda_graphs=True, nan_at=5)
    assert refused_eager == refused_graphed == [5]
    assert opt._engine.graphs.replays > 0
    assert torch.equal(eager.view(torch.int32), graphed.view(torch.int32))


def _train_momentum_corrected_cuda(cuda_graphs: bool, steps: int = 10):
    model = _workers.make_model(seed=0).cuda()
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        sparsecomm.TopK(0.05, warmup_steps=3),
        bucket_cap_mb=0.01,
        min_compress_numel=0,
        momentum_correction=0.9,
        cuda_graphs=cuda_graphs,
    )
    for step in range(steps):
        x, y = (t.cuda() for t in _workers.batch(0, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _workers.flat_params(model).cpu(), opt


def test_cuda_graphs_with_momentum_correction_and_warm_up_give_eager_bits():
    eager, _ = _train_momentum_corrected_cuda(cuda_graphs=False)
    graphed, opt = _train_momentum_corrected_cuda(cuda_graphs=True)
    assert opt._engine.graphs.replays > 0
    assert torch.equal(eager.view(torch.int32), graphed.view(torch.int32))


def test_cuda_ddp_hook_graphs_give_eager_bits(tmp_path):
    """World size 1 over NCCL: DDP with the hook, compression from CUDA graphs or eager,
    the same parameters bit for bit; the graphs did replay."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for compressor in (
            sparsecomm.TopK(0.05),
            sparsecomm.TopK(0.05, value_dtype=torch.bfloat16),
            sparsecomm.Cast(torch.bfloat16),
        ):
            ends, states = [], []
            for cuda_graphs in (False, True):
                end, state = _train_ddp_hook_cuda(compressor, steps=8, cuda_graphs=cuda_graphs)
                ends.append(end)
                states.append(state)
            assert states[0].graphs is None and states[1].graphs.replays > 0, compressor
            assert torch.equal(ends[0].view(torch.int32), ends[1].view(torch.int32)), compressor
    finally:
        dist.destroy_process_group()


def test_cuda_ddp_hook_gives_back_what_a_skipped_step_sent():
    """The hook on CUDA, messages from CUDA graphs: an Inf in one bucket's gradient skips
    the step; that bucket drops its residual, the other keeps its residual plus its
    gradient, bit for bit."""
    for compressor in (sparsecomm.TopK(0.1), sparsecomm.TopK(0.1, value_dtype=torch.bfloat16)):
        expected, after = _overlap_workers.hook_skip_on_one_bucket(torch.device("cuda"), compressor)
        assert torch.equal(after[0], expected[0]), compressor
        assert not after[1].any(), compressor


def _train_side_stream_cuda(compressor, side_stream: bool, cuda_graphs: bool, steps: int = 6):
    """A 2048x2048 layer (a bucket of its own, which adopts autograd's gradient) between
    small layers, with or without the side stream."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 2048),
        torch.nn.Tanh(), torch.nn.Linear(2048, 8),
    ).cuda()  # fmt: skip
    produced = []  # registered before the optimizer's hook, so it runs first
    model[2].weight.register_post_accumulate_grad_hook(lambda p: produced.append(p.grad.data_ptr()))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        compressor,
        bucket_cap_mb=1,
        cuda_graphs=cuda_graphs,
    )
    opt._engine.side_stream = side_stream
    big = opt._engine.member_of[id(model[2].weight)][0]
    adopted = 0
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)
        torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
        # Autograd's tensor is the bucket's buffer: its average (Dense), or its residual.
        kept = [b.data_ptr() for b in (big.grad_buffer, big.residual) if b is not None]
        adopted += produced[-1] in kept
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return flat, opt, big, adopted


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize(
    "compressor", [sparsecomm.Dense(), sparsecomm.Cast(torch.bfloat16), sparsecomm.TopK(0.01)],
    ids=repr,
)  # fmt: skip
def test_cuda_side_stream_gives_the_bits_of_the_current_stream(compressor, cuda_graphs):
    on, opt, big, adopted = _train_side_stream_cuda(compressor, True, cuda_graphs)
    off, opt_off, _, _ = _train_side_stream_cuda(compressor, False, cuda_graphs)
    assert opt._engine.streams and not opt_off._engine.streams
    assert big.adopts and adopted >= 4  # every step after the first, graphs or not
    if cuda_graphs:  # the graphs replay on buffers that move (through the address table)
        assert opt._engine.graphs.replays > 0 or isinstance(compressor, sparsecomm.Dense)
        assert not opt._engine.graphs.failed
    assert torch.equal(on.view(torch.int32), off.view(torch.int32)), compressor


@pytest.mark.parametrize(
    "compressor", [sparsecomm.Cast(torch.bfloat16), sparsecomm.TopK(0.01)], ids=repr
)
def test_cuda_graphed_buckets_release_their_gradient_buffers_between_steps(compressor):
    """With CUDA graphs, zero_grad() drops the gradient buffers of buckets with a residual
    (as without graphs), the graphs keep replaying on the buffers allocated anew, and the
    parameters are eager compression's bit for bit."""
    ends = []
    for cuda_graphs in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512),
            torch.nn.Tanh(), torch.nn.Linear(512, 8),
        ).cuda()  # fmt: skip
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), compressor,
            bucket_cap_mb=0.5, cuda_graphs=cuda_graphs,
        )  # fmt: skip
        for step in range(8):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)
            torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            opt.step()
            opt.zero_grad()
            held = [b for b in opt._engine.buckets if b.residual is not None]
            assert held and all(b.grad_buffer is None for b in held)
        if cuda_graphs:
            assert opt._engine.graphs.replays >= len(held) * 4 and not opt._engine.graphs.failed
        ends.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
    assert torch.equal(ends[0].view(torch.int32), ends[1].view(torch.int32))


def _train_with_a_failed_backward_cuda(compressor, fail_at: int | None, cuda_graphs: bool):
    """Eight AdamW steps on CUDA; at step ``fail_at`` a first backward raises after the
    first layer (some buckets sent, some not reached), drop_step() drops it (step() then
    raises StepDroppedError), and the same batch runs again. Returns the parameters, the
    residuals and how many buckets the failed backward had launched."""
    model = _overlap_workers.make_model().cuda()
    opt = _overlap_workers.wrap(model, compressor, cuda_graphs=cuda_graphs)
    launched = None
    for step in range(8):
        x, y = (t.cuda() for t in _overlap_workers.batch(0, step))
        if step == fail_at:
            _overlap_workers._Boom.armed = True
            try:
                _overlap_workers._loss(model, x, y, boom_at=0).backward()
            except MemoryError:
                pass
            finally:
                _overlap_workers._Boom.armed = False
            launched = opt._engine.next_launch
            opt.drop_step()
            with pytest.raises(sparsecomm.StepDroppedError):
                opt.step()
            opt.zero_grad()
        _overlap_workers._loss(model, x, y, boom_at=None).backward()
        opt.step()
        opt.zero_grad()
    residuals = torch.cat([opt.residual(p).reshape(-1) for p in model.parameters()])
    return _overlap_workers.flat(model).cpu(), residuals.cpu(), launched


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("compressor", GRAPHED, ids=repr)
def test_cuda_drop_step_after_a_failed_backward_keeps_the_bits(compressor, cuda_graphs):
    clean = _train_with_a_failed_backward_cuda(compressor, None, cuda_graphs)
    failed = _train_with_a_failed_backward_cuda(compressor, 5, cuda_graphs)
    buckets = len(_overlap_workers.wrap(_overlap_workers.make_model(), compressor)._engine.buckets)
    assert 0 < failed[2] < buckets, (failed[2], buckets)  # sent some buckets, not all
    assert torch.equal(clean[0].view(torch.int32), failed[0].view(torch.int32))
    assert torch.equal(clean[1].view(torch.int32), failed[1].view(torch.int32))


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("compressor", [sparsecomm.TopK(0.02), sparsecomm.Cast(torch.bfloat16)])
def test_cuda_local_updates_keep_parameters_at_shared_less_residual(compressor, cuda_graphs):
    """exchange="local_updates" on CUDA, its buckets compressed eagerly or from CUDA graphs
    (whose buffers swap roles): each step, every parameter is its shared value less its
    residual, bit for bit, and the run gives the bits of the same run on the CPU."""
    ends = {}
    for device in ("cpu", "cuda"):
        model = _workers.make_model(seed=0).to(device)
        opt = sparsecomm.CompressedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            compressor,
            exchange="local_updates",
            min_compress_numel=0,
            **({"cuda_graphs": cuda_graphs} if device == "cuda" else {}),
        )
        for step in range(6):
            x, y = (t.to(device) for t in _workers.batch(0, step))
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            with opt.shared_parameters():
                shared = [p.detach().clone() for p in model.parameters()]
            for param, value in zip(model.parameters(), shared):
                assert torch.equal(param.detach(), value - opt.residual(param))
        if device == "cuda" and cuda_graphs and isinstance(compressor, sparsecomm.TopK):
            assert opt._engine.graphs.replays > 0 and not opt._engine.graphs.failed
        ends[device] = _workers.flat_params(model).cpu()
    # The model's matmuls differ between CPU and GPU; the exchange does not add to that.
    torch.testing.assert_close(ends["cuda"], ends["cpu"], rtol=1e-3, atol=1e-3)


def test_cuda_shared_moment_adamw_steps_as_on_the_cpu():
    """SharedMomentAdamW on CUDA steps a group in foreach launches: the same moments and
    parameters as the CPU's tensor-by-tensor step, to rounding, with the shared moment in
    use (as on 2 ranks) and refreshed every other step."""
    results = []
    for device in ("cpu", "cuda"):
        model = _workers.make_model(seed=0).to(device)
        opt = sparsecomm.SharedMomentAdamW(model.parameters(), lr=1e-2, refresh_every=2)
        for step in range(6):
            _workers.shared_moment_step(model, opt, step, device)
        results.append(_workers.flat_params(model).cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exchange", ["updates", "local_updates"])
def test_cuda_updates_conserve_the_local_update(exchange):
    """The update exchanges on CUDA, where the update is taken and applied in foreach
    launches: per step, sent + new residual = old residual + the update the wrapped AdamW
    made, bit for bit, and the shared parameter moves by what was sent."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3000, device="cuda"))
    other = torch.nn.Parameter(torch.randn(70, device="cuda"))  # a second tensor in the lists
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW([param, other], lr=1e-2), sparsecomm.TopK(0.02), exchange=exchange
    )
    twin = torch.nn.Parameter(torch.zeros(3000, device="cuda"))
    twin_other = torch.nn.Parameter(torch.zeros(70, device="cuda"))
    twin_opt = torch.optim.AdamW([twin, twin_other], lr=1e-2)
    for _ in range(4):
        grad = torch.randn(3000, device="cuda")
        residual = opt.residual(param).clone()
        with opt.shared_parameters():
            old = param.detach().clone()
            old_other = other.detach().clone()
        twin_opt.load_state_dict(copy.deepcopy(opt.optimizer.state_dict()))  # no aliasing
        with torch.no_grad():  # the wrapped AdamW steps from this rank's own parameters
            twin.copy_(param)
            twin_other.copy_(other)
        twin.grad, twin_other.grad = grad.clone(), torch.ones(70, device="cuda")
        twin_opt.step()
        update = torch.sub(param.detach(), twin.detach())
        ((param * grad).sum() + other.sum()).backward()
        opt.step()
        sent = param.grad
        assert torch.equal(sent + opt.residual(param), residual + update)
        with opt.shared_parameters():
            assert torch.equal(param.detach(), old - sent)
            assert not torch.equal(other.detach(), old_other)  # it moved too
        opt.zero_grad()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_cuda_updates_refuse_a_nonfinite_gradient_anywhere_in_a_large_tensor(bad):
    """The update exchange's check before the wrapped optimizer steps (each gradient's
    inf norm, in one foreach launch on CUDA) finds one bad element among 3e6."""
    param = torch.nn.Parameter(torch.zeros(3_000_000, device="cuda"))
    opt = sparsecomm.CompressedOptimizer(
        torch.optim.AdamW([param], lr=1e-2), sparsecomm.TopK(0.01), exchange="updates"
    )
    grad = torch.randn(3_000_000, device="cuda")
    grad[2_345_678] = bad
    (param * grad).sum().backward()
    with pytest.raises(sparsecomm.NonFiniteGradientError):
        opt.step()
    assert torch.count_nonzero(param.detach()) == 0


@pytest.mark.parametrize(
    "compressor", [sparsecomm.TopK(0.1), sparsecomm.Dense(), sparsecomm.Cast(torch.bfloat16)],
    ids=repr,
)  # fmt: skip
def test_cuda_fused_adamw_stepped_ahead_of_the_verdict_matches_one_stepped_after(compressor):
    """On CUDA the host waits for the verdict only after it has queued the fused step (the
    copy that keeps a refused step's residual is decided on the device): the same bits."""
    import _safety_workers
    from test_safety import check_step_ahead

    runs = {
        ahead: _safety_workers._step_ahead_run(
            0, 1, None, ahead=ahead, device="cuda", compressor=copy.deepcopy(compressor)
        )
        for ahead in (True, False)
    }
    check_step_ahead(runs[True], runs[False])
