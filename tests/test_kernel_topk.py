"""The Triton top-k launcher against its torch reference, bit for bit.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors (set up in
conftest.py), so these tests keep to a few thousand elements; the tests marked ``gpu`` run
the sizes the kernel is built for.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from conftest import DEVICE, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from sparsecomm.triton_kernels import _indirect
from sparsecomm.triton_kernels import topk as topk_module
from sparsecomm.triton_kernels.topk import topk_compress, topk_compress_ref
from strategies import SIZES, gradients

# numpy (the interpreter's arithmetic) warns where float32 overflows or makes NaN, as meant.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def small_tiles():
    """Shrink every tile so that a few hundred elements span many programs and chunks,
    the chunk scan needs several tiles, candidate slices cross block boundaries, a level's
    program walks several chunks, and the bound comes from a strided sample."""
    with mock.patch.multiple(
        topk_module,
        _SAMPLE_SIZE=64,
        _SAMPLE_BLOCK=16,
        _CHUNK_BLOCK=64,
        _CHUNK_ITERS=2,
        _LEVEL_CHUNKS=3,
        _CAND_BLOCK=32,
        _SCAN_BLOCK=4,
    ):
        yield


# The interpreter runs each program in Python: small tiles cost about a second per call at
# a thousand elements, so they are used on a few hundred elements only.
SMALL_TILE_SIZES = [1, 127, 128, 129, 300, 700]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _first_difference(name: str, expected: torch.Tensor, actual: torch.Tensor) -> str:
    if expected.shape != actual.shape:
        return f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    where = (expected != actual).nonzero().flatten()[:8].tolist()
    rows = ", ".join(f"[{i}] {actual[i].item()!r} != {expected[i].item()!r}" for i in where)
    return f"{name}: {int((expected != actual).sum())} elements differ, first: {rows}"


def assert_matches_reference(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int, through_addresses: bool = False
) -> None:
    """``through_addresses``: the launcher gets decoy tensors (NaN, which would show in the
    result if read) and the real buffers' addresses in an ``addresses`` table."""
    grad = grad.to(DEVICE)
    residual = None if residual is None else residual.to(DEVICE)
    ref_residual = None if residual is None else residual.clone()
    out_residual = None if residual is None else residual.clone()
    ref_index, ref_value = topk_compress_ref(grad.clone(), ref_residual, k)
    if through_addresses:
        real_grad = grad.clone()
        decoys = [torch.full_like(grad, math.nan), None]
        if residual is not None:
            decoys[1] = torch.full_like(grad, math.nan)
        table = _indirect.table(grad.device, real_grad, out_residual)
        index, value = topk_compress(decoys[0], decoys[1], k, addresses=table)
        assert torch.equal(real_grad, grad)  # read, not written
        assert all(d is None or d.isnan().all() for d in decoys)  # never touched
    else:
        index, value = topk_compress(grad.clone(), out_residual, k)
    assert index.dtype == torch.int32 and value.dtype == torch.float32
    assert index.device == grad.device and value.device == grad.device
    assert torch.equal(index, ref_index), _first_difference("indices", ref_index, index)
    assert torch.equal(_bits(value), _bits(ref_value)), _first_difference(
        "value bits", _bits(ref_value), _bits(value)
    )
    if residual is not None:
        assert torch.equal(_bits(out_residual), _bits(ref_residual)), _first_difference(
            "residual bits", _bits(ref_residual), _bits(out_residual)
        )


@st.composite
def topk_cases(draw, max_size: int = 3000):
    grad = draw(gradients(max_size=max_size))
    n = grad.numel()
    residual = draw(
        st.one_of(
            st.none(),
            st.just(torch.zeros(n)),
            gradients(sizes=[n]),
        )
    )
    edges = sorted({0, 1, n // 100, n // 2, n - 1, n})
    k = draw(st.one_of(st.sampled_from(edges), st.integers(0, n)))
    return grad, residual, max(0, k)


@settings(max_examples=examples(40))
@given(case=topk_cases())
def test_matches_reference(case):
    assert_matches_reference(*case)


@settings(max_examples=examples(20))
@given(case=topk_cases(max_size=700))
def test_matches_reference_with_small_tiles(case):
    with small_tiles():
        assert_matches_reference(*case)


@settings(max_examples=examples(15))
@given(case=topk_cases(max_size=700))
def test_matches_reference_through_addresses(case):
    grad, residual, k = case
    with small_tiles():
        assert_matches_reference(grad, residual, max(k, 1), through_addresses=True)


def test_addresses_arguments():
    grad, residual = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    table = _indirect.table(grad.device, grad, residual)
    with pytest.raises(ValueError, match="k >= 1"):
        topk_compress(grad, residual, 0, addresses=table)
    with pytest.raises(ValueError, match="int64 tensor of 3"):
        topk_compress(grad, residual, 1, addresses=table[:2])
    with pytest.raises(ValueError, match="multiple of 16"):
        flat = torch.randn(65, device=DEVICE)
        topk_compress(flat[1:], None, 1, addresses=table)


@pytest.mark.parametrize("n", SIZES)
def test_k_edges(n):
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen)
    residual = torch.randn(n, generator=gen)
    for k in sorted({0, 1, n}):
        assert_matches_reference(grad, residual, k)
        assert_matches_reference(grad, None, k)


@pytest.mark.parametrize("n", SMALL_TILE_SIZES)
def test_k_edges_with_small_tiles(n):
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen)
    with small_tiles():
        for k in sorted({1, n // 2, n} - {0}):
            assert_matches_reference(grad, torch.randn(n, generator=gen), k)


def test_empty():
    index, value = topk_compress(torch.empty(0, device=DEVICE), torch.empty(0, device=DEVICE), 0)
    assert index.shape == (0,) and index.dtype == torch.int32
    assert value.shape == (0,) and value.dtype == torch.float32


def test_single_element():
    for value in [0.0, -0.0, -2.5, math.inf, math.nan]:
        assert_matches_reference(torch.tensor([value]), torch.tensor([1.0]), 1)
        assert_matches_reference(torch.tensor([value]), torch.tensor([1.0]), 0)
        assert_matches_reference(torch.tensor([value]), None, 1)


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("with_residual", [False, True])
def test_nan_ranks_above_infinity(with_residual):
    n = 1000
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(n, generator=gen)
    grad[[3, 500, 999]] = math.nan
    grad[[10, 11]] = -math.nan
    grad[[20, 700]] = math.inf
    grad[21] = -math.inf
    residual = torch.randn(n, generator=gen) if with_residual else None
    for k in [1, 3, 5, 6, 8, 9, 100, n]:
        assert_matches_reference(grad, residual, k)
    with small_tiles():
        for k in [5, 9]:
            assert_matches_reference(grad[:300], None if residual is None else residual[:300], k)


def test_nan_from_residual_and_payloads():
    # NaN whose payload and sign differ: all of them share the top keys, ranked by bits.
    n = 300
    grad = torch.zeros(n)
    grad[[5, 50, 150]] = torch.tensor([_nan(0x7FC00001), _nan(-0x00400000), _nan(0x7FFFFFFF)])
    residual = torch.zeros(n)
    residual[[6, 60]] = math.nan
    residual[[7]] = -math.inf
    grad[7] = math.inf  # inf + -inf = NaN
    for k in [1, 2, 4, 6, 7, 10]:
        assert_matches_reference(grad, residual, k)


@pytest.mark.parametrize("fill", [0.0, -0.0, 1.0, -3.0, 1e-45])
def test_all_equal(fill):
    for n in [1, 33, 4097]:
        grad = torch.full((n,), fill)
        for k in sorted({1, n // 3, n} - {0}):
            assert_matches_reference(grad, torch.zeros(n), k)
    with small_tiles():
        grad = torch.full((300,), fill)
        for k in [1, 150, 299]:
            assert_matches_reference(grad, None, k)


def test_ties_at_the_boundary():
    # Many exact ties at the k-th magnitude, spread over chunks: the lowest indices win.
    gen = torch.Generator().manual_seed(3)
    n = 4096
    levels = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 1e-45, -1e-45])
    grad = levels[torch.randint(0, len(levels), (n,), generator=gen)]
    for k in [1, 100, 512, 1025, 2048, 3000, 4095]:
        assert_matches_reference(grad, None, k)
    with small_tiles():
        for k in [1, 100, 301, 500]:
            assert_matches_reference(grad[:700], torch.zeros(700), k)


def test_keys_differing_only_in_low_digits():
    # Magnitudes one ulp apart: every radix level has to split them.
    n = 2000
    base = torch.tensor(1.0).view(torch.int32).item()
    gen = torch.Generator().manual_seed(11)
    bits = base + torch.randint(0, 600, (n,), generator=gen, dtype=torch.int32)
    grad = bits.view(torch.float32) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    for k in [1, 17, 999, 1500]:
        assert_matches_reference(grad, None, k)
    with small_tiles():
        for k in [17, 299]:
            assert_matches_reference(grad[:700], torch.zeros(700), k)


def _sampled(n: int, k: int) -> torch.Tensor:
    """Where the kernel samples, by the torch copy of its hash (``_sample_positions_ref``).
    ``test_kernel_samples_the_reference_positions`` checks the kernel against it."""
    samples, stride, _ = topk_module._sample_bound(n, k)
    return topk_module._sample_positions_ref(samples, stride)


class _StopAfterSample(Exception):
    pass


def kernel_trace(grad: torch.Tensor, residual: torch.Tensor | None, k: int, full: bool = True):
    """Run ``topk_compress`` and record what its own kernels decided: ``sample_hist`` (the
    sample kernel's histogram of fine key bins, its copies added up), ``bound`` (the key
    the sample kernel chose as the lower bound for candidates, a uint32), and, with
    ``full``, ``total`` (how many elements the pass kept as candidates: fewer than ``k``
    means the kernel took its every-element fallback) and ``out`` (its result). Without
    ``full`` it stops after the sample kernel, which reads only the sampled elements, so
    tensors of millions of elements stay cheap in the interpreter."""
    record = {}
    real_sample, real_candidates = (
        topk_module._topk_sample_kernel,
        topk_module._topk_candidates_kernel,
    )

    class Sample:
        def __getitem__(self, grid):
            def launch(grad_ptr, acc_ptr, addresses, sample_hist, done, window, *args, **kwargs):
                real_sample[grid](
                    grad_ptr, acc_ptr, addresses, sample_hist, done, window, *args, **kwargs
                )
                copies = sample_hist.view(kwargs["COPIES"], -1)
                record["sample_hist"] = copies.sum(0).cpu()
                record["bound"] = int(window.item()) & 0xFFFFFFFF
                if not full:
                    raise _StopAfterSample

            return launch

    class Candidates:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                real_candidates[grid](*args, **kwargs)
                # (grad, acc, addresses, window, ..., total, n)
                record["total"] = int(args[7].item())

            return launch

    with mock.patch.multiple(
        topk_module, _topk_sample_kernel=Sample(), _topk_candidates_kernel=Candidates()
    ):
        try:
            record["out"] = topk_compress(grad, residual, k)
        except _StopAfterSample:
            pass
    return record


def _fine(acc: torch.Tensor) -> torch.Tensor:
    """The fine bin of each element's key, as the kernel computes it: (bits << 1) >> 19."""
    keys = (acc.view(torch.int32).to(torch.int64) << 1) & 0xFFFFFFFF
    return keys >> (32 - topk_module._FINE_BITS)


def _kernel_reach(acc: torch.Tensor, k: int) -> int:
    """How many elements reach the bound the kernel's own sample sets for this ``k``:
    the kernel's sample kernel picks the bound, torch counts the keys at or above it (the
    candidates pass keeps exactly those)."""
    bound = kernel_trace(acc, None, k, full=False)["bound"]
    keys = (acc.view(torch.int32).to(torch.int64) << 1) & 0xFFFFFFFF
    return int((keys >= bound).sum())


def _assert_same_as_reference(record, grad, k):
    ref_index, ref_value = topk_compress_ref(grad.clone(), None, k)
    index, value = record["out"]
    assert torch.equal(index, ref_index), _first_difference("indices", ref_index, index)
    assert torch.equal(_bits(value), _bits(ref_value))


def _planted(n: int, seed: int, rest: float, sampled_value: float) -> torch.Tensor:
    """``rest + U[0, 1)`` everywhere but at the positions the kernel samples, which hold
    ``sampled_value * (1 + U[0, 1))``."""
    gen = torch.Generator().manual_seed(seed)
    grad = rest + torch.rand(n, generator=gen)
    sampled = _sampled(n, 1)
    grad[sampled] = sampled_value * (1 + torch.rand(sampled.numel(), generator=gen))
    return grad


def test_sample_bound_too_high_falls_back():
    # Every sampled position holds a large value, the rest small ones: the sample puts its
    # bound above all but the sampled elements, fewer than k, so the kernel must make every
    # element a candidate. Its own counters show it did; the result must not change.
    with small_tiles():
        n = 1000
        samples = _sampled(n, 1).numel()
        grad = _planted(n, seed=2, rest=0.0, sampled_value=100.0).to(DEVICE)
        planted_bins = _fine(torch.tensor([100.0]))
        for k in [samples + 1, 200, 300]:
            record = kernel_trace(grad.clone(), None, k)
            hist = record["sample_hist"]
            # The kernel sampled exactly the planted positions: every sampled key is large.
            assert int(hist[int(planted_bins) :].sum()) == samples == int(hist.sum())
            assert record["total"] < k, record["total"]  # too few: the kernel's fallback
            _assert_same_as_reference(record, grad, k)
            assert_matches_reference(grad, torch.zeros(n), k)
            assert_matches_reference(grad, torch.zeros(n), k, through_addresses=True)
            assert_matches_reference(grad, None, k, through_addresses=True)


def test_sample_bound_below_every_element():
    # The sample sees only the small values: its bound keeps almost every element, and the
    # kernel has enough candidates without the fallback.
    with small_tiles():
        n = 640
        samples = _sampled(n, 1).numel()
        grad = _planted(n, seed=4, rest=100.0, sampled_value=1e-3).to(DEVICE)
        for k in [1, 10, 300]:
            record = kernel_trace(grad.clone(), None, k)
            assert record["total"] >= n - samples and record["total"] >= k, record["total"]
            _assert_same_as_reference(record, grad, k)
            assert_matches_reference(grad, torch.randn(n).to(DEVICE), k)


@pytest.mark.parametrize("n", [5, 64, 1000, 10**6 + 3])
def test_kernel_samples_the_reference_positions(n):
    # A 1.0 at each position _sample_positions_ref names, zeros elsewhere: the kernel's
    # histogram must hold every sampled key in the bin of 1.0 (with the residual added,
    # as the kernel adds it before it samples).
    samples = _sampled(n, 1).numel()
    grad = torch.zeros(n)
    grad[_sampled(n, 1)] = 0.5
    residual = torch.zeros(n)
    residual[_sampled(n, 1)] = 0.5
    hist = kernel_trace(grad.to(DEVICE), residual.to(DEVICE), 1, full=False)["sample_hist"]
    assert int(hist[int(_fine(torch.tensor([1.0])))]) == samples == int(hist.sum())


def test_sample_positions():
    # One position in each stretch of the stride, in order, inside the tensor.
    for n in [1, 5, 64, 65, 1000, 10**6 + 3]:
        samples, stride, _ = topk_module._sample_bound(n, 1)
        positions = topk_module._sample_positions_ref(samples, stride)
        assert positions.numel() == samples == min(n, topk_module._SAMPLE_SIZE)
        assert torch.equal(positions // stride, torch.arange(samples))
        assert int(positions.max()) < n
        if stride >= 16:  # not one fixed offset: that would alias with row lengths
            assert (positions % stride).unique().numel() > samples // 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_bound_on_low_rank_weight_gradients(seed):
    # A 4096-wide linear layer's weight gradient, delta^T x over a batch of 8: every row
    # mixes the same few input rows, so the columns differ in scale. Its 16.8M elements
    # make a stride of 256, which divides the rows: a plain stride would see 16 of the
    # 4096 columns, and reached 5301 (fewer than k, the slow path) to 141571 for
    # k = 16777 on these seeds. The hashed positions must see typical columns.
    gen = torch.Generator().manual_seed(seed)
    width, batch = 4096, 8
    x = torch.randn(batch, width, generator=gen) * torch.rand(width, generator=gen) ** 4
    grad = (torch.randn(batch, width, generator=gen).T @ x).reshape(-1)
    for k in [grad.numel() // 1000, grad.numel() // 100]:
        reached = _kernel_reach(grad.to(DEVICE), k)
        assert k <= reached <= 2.5 * k, (k, reached)


def test_sample_bound_is_tight_on_gradient_like_data():
    # The point of the sample: on normal data only a few percent more than k elements are
    # candidates (the margin plus one fine bin), not a whole binade.
    gen = torch.Generator().manual_seed(9)
    acc = torch.randn(10**6, generator=gen)
    for k in [10**3, 10**4, 10**5]:
        reached = _kernel_reach(acc.to(DEVICE), k)
        assert k <= reached <= 1.8 * k + 200, (k, reached)


def test_residual_none_leaves_grad_untouched():
    grad = torch.randn(500, device=DEVICE)
    before = grad.clone()
    topk_compress(grad, None, 50)
    assert torch.equal(_bits(grad), _bits(before))


def test_conservation():
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(3000, generator=gen).to(DEVICE)
    residual = torch.randn(3000, generator=gen).to(DEVICE)
    acc = grad + residual
    index, value = topk_compress(grad, residual, 300)
    sent = torch.zeros_like(acc)
    sent[index.long()] = value
    assert torch.equal(_bits(sent + residual), _bits(acc))


def _x(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((_x(10, dtype=torch.float64), None, 1), ValueError, "float32"),
        ((_x(10, dtype=torch.float16), None, 1), ValueError, "float32"),
        ((_x(2, 5), None, 1), ValueError, "1-D"),
        ((_x(()), None, 0), ValueError, "1-D"),
        ((_x(20)[::2], None, 1), ValueError, "contiguous"),
        ((_x(10), _x(20)[::2], 1), ValueError, "contiguous"),
        ((_x(10), _x(11), 1), ValueError, "shape"),
        ((_x(10), _x(10, dtype=torch.float64), 1), ValueError, "float32"),
        ((_x(10), None, 11), ValueError, "k must be in"),
        ((_x(10), None, -1), ValueError, "k must be in"),
        ((_x(0), None, 1), ValueError, "k must be in"),
        ((_x(10), None, 2.0), TypeError, "k must be"),
        ((_x(10), None, True), TypeError, "k must be"),
        (([1.0, 2.0], None, 1), TypeError, "grad"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        topk_compress(*args)


# ---- GPU only: the sizes the kernel is built for ------------------------------------------


def _gpu_inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, device="cuda", generator=gen)
    if kind == "all_equal":
        return torch.full((n,), -0.75, device="cuda")
    if kind == "ties":
        levels = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0], device="cuda")
        return levels[torch.randint(0, len(levels), (n,), device="cuda", generator=gen)]
    if kind == "heavy_tail":
        x = torch.randn(n, device="cuda", generator=gen)
        return x / torch.rand(n, device="cuda", generator=gen).clamp_min(1e-6)
    raise ValueError(kind)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n", [10**6 + 3, 10**7, 10**8])
@pytest.mark.parametrize("density", [1e-3, 1e-2])
@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "heavy_tail"])
def test_gpu_large(n, density, kind):
    k = math.ceil(density * n)
    grad = _gpu_inputs(kind, n, seed=n)
    residual = _gpu_inputs("normal", n, seed=n + 1) * 0.5 if kind == "normal" else None
    assert_matches_reference(grad, residual, k)
    if kind != "normal":
        assert_matches_reference(grad, torch.zeros_like(grad), k)
    del grad, residual
    torch.cuda.empty_cache()


@pytest.mark.gpu
@requires_cuda
def test_gpu_sample_bound_too_high():
    # Large values exactly at the sampled positions: fewer than k reach the sample's
    # bound, so the kernel takes its slow path; the bits must not change.
    n = 10**7 + 1
    sampled = _sampled(n, 1).cuda()
    grad = _gpu_inputs("normal", n, seed=5)
    grad[sampled] += 1e3
    k = 2 * sampled.numel()
    record = kernel_trace(grad.clone(), None, k)
    assert record["total"] < k, record["total"]  # the kernel took its fallback
    _assert_same_as_reference(record, grad, k)
    assert_matches_reference(grad, _gpu_inputs("normal", n, seed=6), k)


@pytest.mark.gpu
@requires_cuda
def test_gpu_denormals_and_nan():
    n = 10**7
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(n, device="cuda", generator=gen) * 1e-39  # mostly denormal
    grad[:: 10**5] = math.nan
    residual = torch.randn(n, device="cuda", generator=gen) * 1e-40
    for k in [1, 100, 101, 10**4, 10**6]:
        assert_matches_reference(grad, residual, k)
