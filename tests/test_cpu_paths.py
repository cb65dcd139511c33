"""The fast CPU paths (``*_cpu``) against the torch references (``*_ref``), bit for bit.

Every output and the in-place residual are compared as raw bits (``.view(torch.int32)``,
NaN payloads included, except for the cast, see ``assert_bits``): a CPU path does the
reference's float32 arithmetic with the same torch ops and only reorganises the integer
work. Also: the dispatch in ``sparsecomm._ops`` and the argument checks, which every
launcher and CPU path shares.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from sparsecomm.triton_kernels import _checks, _cpu
from sparsecomm.triton_kernels import cast as cast_module
from sparsecomm.triton_kernels import scatter_add as scatter_module
from sparsecomm.triton_kernels import threshold as threshold_module
from sparsecomm.triton_kernels import topk as topk_module
from sparsecomm.triton_kernels.cast import cast_compress_cpu, cast_compress_ref
from sparsecomm.triton_kernels.scatter_add import scatter_add_cpu, scatter_add_ref
from sparsecomm.triton_kernels.threshold import threshold_compress_cpu, threshold_compress_ref
from sparsecomm.triton_kernels.topk import topk_compress_cpu, topk_compress_ref
from strategies import gradients

from sparsecomm import _ops
from sparsecomm import triton_kernels as kernels

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

NAN, INF = math.nan, math.inf
SIZES = [1, 7, 1023, 1025, 123457]
KINDS = ["normal", "all_equal", "ties", "zeros", "negative_zero", "extremes", "non_finite", "mixed"]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


def assert_bits(
    actual: torch.Tensor, expected: torch.Tensor, what: str, nan_payload: bool = True
) -> None:
    """Equal bits. With ``nan_payload=False`` any NaN matches any NaN: for values that torch's
    float arithmetic makes (the cast), whose NaN payloads depend on which of torch's code
    paths (vector body, scalar tail, thread split) handled the element, so that even the
    reference's own NaN bits change with the thread count and the CPU's vector width."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    both_nan = None
    if actual.dtype.is_floating_point:
        if not nan_payload:
            both_nan = actual.isnan() & expected.isnan()
        actual, expected = bits(actual), bits(expected)
    differ = actual != expected
    if both_nan is not None:
        differ &= ~both_nan
    if differ.any():
        where = differ.nonzero().flatten()[:8].tolist()
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} differ, first at {where}: "
            f"got {actual[where].tolist()}, expected {expected[where].tolist()}"
        )


def make(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)

    def pick(levels):
        return torch.tensor(levels)[torch.randint(0, len(levels), (n,), generator=gen)]

    if kind == "normal":
        return torch.randn(n, generator=gen)
    if kind == "all_equal":
        return torch.full((n,), -0.75)
    if kind == "ties":
        return pick([0.0, -0.0, 1.0, -1.0, 2.0, -2.0])
    if kind == "zeros":  # a sparse gradient: mostly exact zeros
        x = torch.zeros(n)
        x[torch.randint(0, n, (max(1, n // 200),), generator=gen)] = 1.5
        return x
    if kind == "negative_zero":
        return pick([-0.0, 0.0, -1e-45])
    if kind == "extremes":  # huge and tiny magnitudes, denormals
        return pick([3.4028235e38, -3.4028235e38, 1e30, -1e-30, 1e-45, -1e-45, 1.1754942e-38])
    if kind == "non_finite":
        x = torch.randn(n, generator=gen)
        x[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = NAN
        x[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = INF
        x[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = -INF
        # A negative NaN and a signalling-pattern NaN, whose payloads must survive.
        x.view(torch.int32)[torch.randint(0, n, (max(1, n // 100),), generator=gen)] = -4194303
        x.view(torch.int32)[torch.randint(0, n, (max(1, n // 100),), generator=gen)] = 0x7F800001
        return x
    if kind == "mixed":
        x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 30, (n,), generator=gen)
        x[::7] = x[0]
        return x
    raise ValueError(kind)


def residual_for(kind: str, n: int, seed: int) -> torch.Tensor:
    if kind == "all_equal":
        return torch.zeros(n)
    if kind == "negative_zero":
        return torch.full((n,), -0.0)
    return make("normal" if kind != "non_finite" else "non_finite", n, seed + 1) * 0.5


# ---- top-k -------------------------------------------------------------------------------


def check_topk(grad: torch.Tensor, residual: torch.Tensor | None, k: int):
    grad_before = grad.clone()
    cpu_residual = None if residual is None else residual.clone()
    ref_residual = None if residual is None else residual.clone()
    indices, values = topk_compress_cpu(grad, cpu_residual, k)
    ref_indices, ref_values = topk_compress_ref(grad, ref_residual, k)
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    assert_bits(indices, ref_indices, "indices")
    assert_bits(values, ref_values, "values")
    if residual is not None:
        assert_bits(cpu_residual, ref_residual, "residual")
        # The sum added beforehand (the bucket engine's path): the same message, and the
        # new residual left in place of the sum.
        acc = grad + residual
        acc_indices, acc_values = topk_compress_cpu(acc, None, k, accumulated=True)
        assert_bits(acc_indices, ref_indices, "indices (accumulated)")
        assert_bits(acc_values, ref_values, "values (accumulated)")
        assert_bits(acc, ref_residual, "residual (accumulated)")
    assert_bits(grad, grad_before, "grad (must not change)")
    return indices, values, cpu_residual


def ks_for(n: int) -> list[int]:
    return sorted({0, 1, max(1, n // 1000), max(1, n // 100), n // 2, max(n - 1, 0), n})


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_matches_reference(kind, n):
    grad = make(kind, n, seed=n)
    for k in ks_for(n):
        check_topk(grad, residual_for(kind, n, seed=n), k)
        check_topk(grad, None, k)


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "non_finite"])
def test_topk_many_chunks(kind):
    # Several chunks, the last one short; the candidates of many chunks are joined.
    n = 3 * _cpu.CHUNK + 5
    grad = make(kind, n, seed=3)
    for k in [1, n // 1000, n // 100, n // 3]:
        check_topk(grad, residual_for(kind, n, seed=3), k)


@pytest.mark.parametrize("sample_min", [16, 4096])
def test_topk_small_chunks(sample_min):
    # The chunked path (not the direct one of small tensors) on small tensors: many chunks,
    # a sample of 16 strided keys or one of the whole tensor.
    with mock.patch.multiple(topk_module, _CPU_DIRECT_MAX=0, _CPU_SAMPLE_MIN=sample_min):
        with mock.patch.object(_cpu, "CHUNK", 64):
            for kind in KINDS:
                grad = make(kind, 1000, seed=1)
                for k in ks_for(1000):
                    check_topk(grad, residual_for(kind, 1000, seed=1), k)


def test_topk_bound_too_high_takes_the_next_bound():
    # Large values exactly at the sampled positions: the sample puts the bound above the
    # k-th largest key, fewer than k reach it, and the pass over acc runs again lower down.
    n = 200_003
    samples = max(topk_module._CPU_SAMPLE_MIN, n // topk_module._CPU_SAMPLE_STRIDE)
    sampled = topk_module._cpu_sample_positions(samples, n // samples)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grad[sampled] += 1e3
    k = 2 * sampled.numel()
    calls = []
    real = _cpu.Candidates

    def spy(n, lo, *args, **kwargs):
        calls.append(lo)
        return real(n, lo, *args, **kwargs)

    residual = torch.randn(n)
    check_topk(grad, residual, k)
    with mock.patch.object(_cpu, "Candidates", spy):
        topk_compress_cpu(grad, residual.clone(), k)
    assert len(calls) >= 2 and calls == sorted(calls, reverse=True)


def test_topk_sparse_gradient_beyond_its_non_zeros():
    # 100 non-zeros, k = 1000: every non-zero, then the first 900 zeros by index (+0.0 and
    # -0.0 tie).
    n = 100_000
    grad = torch.zeros(n)
    grad[::2] = -0.0
    positions = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:100]
    grad[positions] = torch.randn(100)
    indices, _, _ = check_topk(grad, torch.zeros(n), 1000)
    zeros = sorted(set(range(n)) - set(positions.tolist()))[:900]
    assert indices.tolist() == sorted(set(positions.tolist()) | set(zeros))


def test_topk_ties_go_to_the_lower_index():
    grad = torch.tensor([1.0, -2.0, 2.0, -0.0, 0.0, 2.0, -2.0, NAN, 1.0])
    indices, values, _ = check_topk(grad, torch.zeros(9), 3)
    assert indices.tolist() == [1, 2, 7]  # NaN above every number, then the first two 2s
    indices, _, _ = check_topk(grad, None, 6)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7]


def test_topk_magnitude_order_is_the_bits_order():
    # -0.0 == 0.0; NaN above inf (negative NaN too); denormals above zero.
    grad = torch.tensor([-0.0, 0.0, 1e-45, -INF, INF, -NAN, 3.4028235e38])
    for k in range(8):
        check_topk(grad, None, k)
    indices, _, _ = check_topk(grad, None, 4)
    assert indices.tolist() == [3, 4, 5, 6]


# ---- threshold ---------------------------------------------------------------------------


def check_threshold(grad, residual, threshold):
    grad_before = grad.clone()
    cpu_residual = None if residual is None else residual.clone()
    ref_residual = None if residual is None else residual.clone()
    indices, values, count = threshold_compress_cpu(grad, cpu_residual, threshold)
    ref_indices, ref_values, ref_count = threshold_compress_ref(grad, ref_residual, threshold)
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == int(ref_count)
    assert_bits(indices, ref_indices, "indices")
    assert_bits(values, ref_values, "values")
    if residual is not None:
        assert_bits(cpu_residual, ref_residual, "residual")
        acc = grad + residual  # added beforehand, as in check_topk
        acc_indices, acc_values, acc_count = threshold_compress_cpu(
            acc, None, threshold, accumulated=True
        )
        assert int(acc_count) == int(ref_count)
        assert_bits(acc_indices, ref_indices, "indices (accumulated)")
        assert_bits(acc_values, ref_values, "values (accumulated)")
        assert_bits(acc, ref_residual, "residual (accumulated)")
    assert_bits(grad, grad_before, "grad (must not change)")
    return indices, values, cpu_residual


THRESHOLDS = [0.0, -0.0, 1e-45, 1e-30, 0.5, 1.0, 2.0, 65504.0, 3.4028235e38, 1e39, INF]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_threshold_matches_reference(kind, n):
    grad = make(kind, n, seed=n)
    for threshold in THRESHOLDS:
        check_threshold(grad, residual_for(kind, n, seed=n), threshold)
        check_threshold(grad, None, threshold)


def test_threshold_many_and_small_chunks():
    n = 3 * _cpu.CHUNK + 5
    grad = make("non_finite", n, seed=4)
    for threshold in [0.0, 2.5, INF]:
        check_threshold(grad, residual_for("normal", n, seed=4), threshold)
    with mock.patch.object(_cpu, "CHUNK", 64):
        for kind in KINDS:
            for threshold in THRESHOLDS:
                check_threshold(make(kind, 1000, 5), residual_for(kind, 1000, 5), threshold)


def test_threshold_sends_nan():
    grad = torch.tensor([NAN, 0.5, -NAN, INF, 3.0])
    indices, values, residual = check_threshold(grad, torch.zeros(5), 1.0)
    assert indices.tolist() == [0, 2, 3, 4]
    assert residual.tolist() == [0.0, 0.5, 0.0, 0.0, 0.0]


# ---- cast --------------------------------------------------------------------------------


def check_cast(grad, residual, dtype, scale):
    cpu_residual = None if residual is None else residual.clone()
    ref_residual = None if residual is None else residual.clone()
    half = cast_compress_cpu(grad, cpu_residual, dtype, scale)
    ref_half = cast_compress_ref(grad, ref_residual, dtype, scale)
    assert_bits(half, ref_half, f"{dtype} values", nan_payload=False)
    if residual is not None:
        assert_bits(cpu_residual, ref_residual, "residual", nan_payload=False)
    return half, cpu_residual


SCALES = [1.0, 0.5, 2.0**-10, 4.0]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_matches_reference(kind, n, dtype):
    grad = make(kind, n, seed=n) * (3e4 if kind == "normal" else 1.0)
    for scale in SCALES:
        check_cast(grad, residual_for(kind, n, seed=n), dtype, scale)
        check_cast(grad, None, dtype, scale)


def test_cast_many_and_small_chunks():
    n = 3 * _cpu.CHUNK + 5
    grad = make("non_finite", n, seed=6) * 1e5
    for dtype in [torch.float16, torch.bfloat16]:
        check_cast(grad, residual_for("normal", n, 6), dtype, 0.125)
    with mock.patch.object(_cpu, "CHUNK", 64):
        for kind in KINDS:
            check_cast(make(kind, 1000, 7), residual_for(kind, 1000, 7), torch.float16, 1.0)


def test_cast_infinity_is_sent():
    grad = torch.tensor([INF, -INF, 1e6, NAN, 3e38])
    residual = torch.tensor([0.0, 0.0, 0.0, 0.0, 3e38])  # 3e38 + 3e38 overflows to inf
    half, new_residual = check_cast(grad, residual, torch.float16, 1.0)
    assert half.tolist()[:3] == [INF, -INF, 65504.0] and half[3].isnan() and half[4] == INF
    assert new_residual[[0, 1, 4]].tolist() == [0.0, 0.0, 0.0]
    assert new_residual[2] == 1e6 - 65504.0 and new_residual[3].isnan()


# ---- scatter-add -------------------------------------------------------------------------


def messages(world_size, numel, counts, seed, ascending=True, pad=1):
    gen = torch.Generator().manual_seed(seed)
    m = max(counts, default=0) + pad
    indices = torch.randint(-5, numel + 5, (world_size, m), generator=gen, dtype=torch.int32)
    values = torch.randn(world_size, m, generator=gen)
    values *= torch.tensor([1e8, 1.0, 1e-8, -3.0])[torch.arange(m) % 4]
    for rank, count in enumerate(counts):
        chosen = torch.randperm(numel, generator=gen)[:count]
        indices[rank, :count] = (chosen.sort().values if ascending else chosen).int()
        values[rank, count:] = NAN
    return indices, values


def check_scatter(indices, values, counts, numel, scale):
    expected = scatter_add_ref(indices, values, counts, numel, scale)
    assert_bits(scatter_add_cpu(indices, values, counts, numel, scale), expected, "sum")
    out = torch.full((numel,), NAN)
    assert scatter_add_cpu(indices, values, counts, numel, scale, out=out) is out
    assert_bits(out, expected, "sum into out")


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("ascending", [True, False])
def test_scatter_add_matches_reference(numel, ascending):
    for world_size in [1, 3, 8]:
        gen = torch.Generator().manual_seed(world_size)
        counts = torch.randint(0, numel + 1, (world_size,), generator=gen).tolist()
        indices, values = messages(world_size, numel, counts, numel, ascending)
        for scale in [1.0, 1 / 3, 0.125]:
            check_scatter(indices, values, counts, numel, scale)
        dense, dense_values = messages(world_size, numel, [numel] * world_size, 1, pad=0)
        check_scatter(dense, dense_values, None, numel, 1 / world_size)


def test_scatter_add_tiled():
    # Above the tiling threshold (shrunk here), in small tiles: rank order per element kept.
    numel = 10_000
    counts = [numel, numel // 2, 0, 37, numel]
    indices, values = messages(5, numel, counts, 9)
    with mock.patch.object(scatter_module, "_TILED_MIN_NUMEL", 0):
        with mock.patch.object(_cpu, "CHUNK", 512):
            for scale in [1.0, 1 / 3]:
                check_scatter(indices, values, counts, numel, scale)
            with pytest.raises(IndexError):
                bad = indices.clone()
                bad[1, 0] = -1
                scatter_add_cpu(bad, values, counts, numel, 1.0)


def test_scatter_add_negative_zero_and_empty():
    indices = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    values = torch.tensor([[-0.0, -0.0], [-0.0, INF]])
    check_scatter(indices, values, None, 4, 1.0)
    out = scatter_add_cpu(indices, values, None, 4, 1.0)
    assert bits(out).tolist()[:2] == [0, 0]  # 0.0 + -0.0 is +0.0
    for shape, numel, counts in [((0, 5), 10, None), ((3, 0), 10, None), ((2, 4), 0, [0, 0])]:
        check_scatter(torch.zeros(shape, dtype=torch.int32), torch.ones(shape), counts, numel, 0.5)


def test_empty_buckets():
    grad, residual = torch.empty(0), torch.empty(0)
    check_topk(grad, residual, 0)
    check_threshold(grad, residual, 1.0)
    check_threshold(grad, None, 0.0)
    half, _ = check_cast(grad, residual, torch.float16, 1.0)
    assert half.shape == (0,) and half.dtype == torch.float16


# ---- hypothesis properties -----------------------------------------------------------------


@st.composite
def buckets(draw):
    grad = draw(gradients(max_size=3000))
    residual = draw(st.one_of(st.none(), gradients(sizes=[grad.numel()])))
    return grad, residual


@given(buckets(), st.data())
def test_topk_property(bucket, data):
    grad, residual = bucket
    k = data.draw(st.integers(0, grad.numel()))
    acc = grad if residual is None else grad + residual
    indices, values, new_residual = check_topk(grad, residual, k)
    assert indices.numel() == k and bool((indices[1:] > indices[:-1]).all())
    if residual is not None:
        # Nothing is lost: what was sent plus what stays is acc, bit for bit.
        rebuilt = new_residual.clone()
        rebuilt[indices.long()] = values
        assert_bits(rebuilt, acc, "sent + kept")


@given(buckets(), st.sampled_from(THRESHOLDS))
def test_threshold_property(bucket, threshold):
    grad, residual = bucket
    indices, values, new_residual = check_threshold(grad, residual, threshold)
    t32 = torch.tensor(threshold, dtype=torch.float32)
    assert (~(values.abs() < t32)).all()  # sent: at or above t, or NaN
    if residual is not None:
        unsent = torch.ones(grad.numel(), dtype=torch.bool)
        unsent[indices.long()] = False
        assert (new_residual[unsent].abs() < t32).all()  # kept: below t, never NaN


@given(buckets(), st.sampled_from([torch.float16, torch.bfloat16]), st.sampled_from(SCALES))
def test_cast_property(bucket, dtype, scale):
    grad, residual = bucket
    half, _ = check_cast(grad, residual, dtype, scale)
    acc = grad if residual is None else grad + residual
    assert torch.equal(half.isinf(), acc.isinf())  # only an infinite acc goes out infinite


@given(
    st.integers(1, 8),
    st.integers(1, 2000),
    st.data(),
    st.sampled_from([1.0, 0.125, 1 / 3, 0.1]),
)
def test_scatter_add_property(world_size, numel, data, scale):
    counts = data.draw(st.lists(st.integers(0, numel), min_size=world_size, max_size=world_size))
    ascending = data.draw(st.booleans())
    indices, values = messages(world_size, numel, counts, data.draw(st.integers(0, 2**20)),
                               ascending)  # fmt: skip
    with mock.patch.object(_cpu, "CHUNK", 256):
        with mock.patch.object(scatter_module, "_TILED_MIN_NUMEL", 0):
            check_scatter(indices, values, counts, numel, scale)


# ---- dispatch ----------------------------------------------------------------------------

OPERATIONS = {
    "threshold_compress": (threshold_module, (torch.ones(8), None, 0.5)),
    "topk_compress": (topk_module, (torch.ones(8), None, 2)),
    "cast_compress": (cast_module, (torch.ones(8), None, torch.float16, 1.0)),
    "scatter_add": (
        scatter_module,
        (torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2), None, 4, 1.0),
    ),
}


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("name", OPERATIONS)
@pytest.mark.parametrize(
    "mode, suffix",
    [
        (None, "_cpu"),
        ("auto", "_cpu"),
        ("torch", "_ref"),
        pytest.param(
            "triton",
            "",
            marks=pytest.mark.skipif(
                not INTERPRETED, reason="kernels on CPU tensors need TRITON_INTERPRET=1"
            ),  # fmt: skip
        ),
    ],
)
def test_dispatch_of_cpu_tensors(monkeypatch, name, mode, suffix):
    module, args = OPERATIONS[name]
    if mode is None:
        monkeypatch.delenv("SPARSECOMM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
    called = []
    for candidate in ["", "_cpu", "_ref"]:
        real = getattr(module, name + candidate)

        def spy(*a, _real=real, _which=candidate, **kw):
            called.append(_which)
            return _real(*a, **kw)

        monkeypatch.setattr(module, name + candidate, spy)
    getattr(_ops, name)(*args)
    assert called == [suffix]


@pytest.mark.parametrize(
    "mode, expected",
    [(None, "round_pairs_ref"), ("torch", "round_pairs_ref")]
    + ([("triton", "round_pairs")] if INTERPRETED else []),
)
def test_dispatch_of_round_pairs(monkeypatch, mode, expected):
    """A message's pairs are few: on a CPU the reference's torch ops are its path."""
    from sparsecomm.triton_kernels import cast

    if mode is None:
        monkeypatch.delenv("SPARSECOMM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
    called = []
    for name in ["round_pairs", "round_pairs_ref"]:
        real = getattr(cast, name)
        monkeypatch.setattr(
            cast, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a)
        )
    values = torch.tensor([1.0 + 2.0**-9, 3.0])
    _ops.round_pairs(values, torch.tensor([1, 0]), torch.zeros(2), torch.bfloat16)
    assert called == [expected]


def test_dispatch_rejects_unknown_mode(monkeypatch):
    monkeypatch.setenv("SPARSECOMM_KERNELS", "numpy")
    with pytest.raises(ValueError, match="SPARSECOMM_KERNELS"):
        _ops.topk_compress(torch.ones(4), None, 1)


def test_dispatch_passes_out(monkeypatch):
    monkeypatch.delenv("SPARSECOMM_KERNELS", raising=False)
    out = torch.full((4,), NAN)
    indices = torch.tensor([[1, 3]], dtype=torch.int32)
    result = _ops.scatter_add(indices, torch.ones(1, 2), None, 4, 0.5, out=out)
    assert result is out and out.tolist() == [0.0, 0.5, 0.0, 0.5]


# ---- the shared argument checks -------------------------------------------------------------

GRAD_IMPLS = {
    "threshold": (threshold_module.threshold_compress, threshold_compress_cpu, 0.5),
    "topk": (topk_module.topk_compress, topk_compress_cpu, 1),
    "cast": (cast_module.cast_compress, cast_compress_cpu, torch.float16),
}

# (grad, residual, error): the same error type from every launcher and CPU path.
BAD_BUCKETS = [
    ([0.0, 1.0], None, TypeError),
    (torch.zeros(4, dtype=torch.float64), None, TypeError),
    (torch.zeros(4, dtype=torch.float16), None, TypeError),
    (torch.zeros(4, dtype=torch.int32), None, TypeError),
    (torch.zeros(2, 2), None, ValueError),
    (torch.zeros(()), None, ValueError),
    (torch.zeros(8)[::2], None, ValueError),
    (torch.zeros(4), [0.0] * 4, TypeError),
    (torch.zeros(4), torch.zeros(4, dtype=torch.float64), TypeError),
    (torch.zeros(4), torch.zeros(5), ValueError),
    (torch.zeros(4), torch.zeros(1, 4), ValueError),
    (torch.zeros(4), torch.zeros(8)[::2], ValueError),
]


@pytest.mark.parametrize("op", GRAD_IMPLS)
@pytest.mark.parametrize("grad, residual, error", BAD_BUCKETS)
def test_checks_are_shared(op, grad, residual, error):
    launcher, cpu, extra = GRAD_IMPLS[op]
    raised = []
    for impl in (launcher, cpu):
        with pytest.raises(error) as info:
            impl(grad, residual, extra)
        raised.append(type(info.value))
    assert raised[0] is raised[1]
    if raised[0] is _checks.DtypeError:  # a dtype: TypeError, and ValueError as it was
        assert issubclass(raised[0], TypeError) and issubclass(raised[0], ValueError)


@pytest.mark.parametrize("op", GRAD_IMPLS)
def test_max_numel_is_checked_everywhere(op):
    launcher, cpu, extra = GRAD_IMPLS[op]
    with mock.patch.object(_checks, "MAX_NUMEL", 5):
        for impl, device in ((launcher, DEVICE), (cpu, "cpu")):
            with pytest.raises(ValueError, match="int32 indices address at most 5"):
                impl(torch.zeros(6, device=device), None, extra)
            impl(torch.zeros(5, device=device), None, extra)


def test_one_max_numel():
    assert kernels.MAX_NUMEL == 2**31 - 1
    assert threshold_module.MAX_NUMEL is kernels.MAX_NUMEL is _checks.MAX_NUMEL
    assert scatter_module.MAX_NUMEL is kernels.MAX_NUMEL


@pytest.mark.parametrize(
    "k, error", [(-1, ValueError), (9, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_k_checks(k, error):
    for impl in (topk_module.topk_compress, topk_compress_cpu):
        with pytest.raises(error, match="k must be"):
            impl(torch.zeros(8), None, k)


@pytest.mark.parametrize(
    "threshold, error", [(-1.0, ValueError), (NAN, ValueError), ("1", TypeError), (None, TypeError)]
)
def test_threshold_checks(threshold, error):
    for impl in (threshold_module.threshold_compress, threshold_compress_cpu):
        with pytest.raises(error, match="threshold must be"):
            impl(torch.zeros(8), None, threshold)


@pytest.mark.parametrize(
    "dtype, scale, error",
    [
        (torch.float32, 1.0, TypeError),
        (torch.float16, 3.0, ValueError),
        (torch.float16, "1", TypeError),
    ],
)
def test_cast_checks(dtype, scale, error):
    for impl in (cast_module.cast_compress, cast_compress_cpu):
        with pytest.raises(error):
            impl(torch.zeros(8), None, dtype, scale)


def test_cpu_paths_refuse_other_devices():
    meta = torch.zeros(4, device="meta")
    for impl, extra in [(topk_compress_cpu, 1), (threshold_compress_cpu, 0.5)]:
        with pytest.raises(ValueError, match="CPU tensors"):
            impl(meta, None, extra)


# ---- the sum added beforehand, through the dispatch --------------------------------------


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_accumulated_dispatch_matches_compress(mode, monkeypatch):
    """``_ops.*_compress_accumulated`` (the CPU path, or the reference followed by zeroing
    what was sent) leaves in ``acc`` what ``*_compress`` leaves in ``residual``."""
    monkeypatch.setenv("SPARSECOMM_KERNELS", mode)
    n = 70_001
    for kind in ["normal", "ties", "zeros", "non_finite"]:
        grad, residual = make(kind, n, seed=7), residual_for(kind, n, seed=7)
        for op, accumulated, arg in [
            (_ops.topk_compress, _ops.topk_compress_accumulated, 700),
            (_ops.threshold_compress, _ops.threshold_compress_accumulated, 0.5),
        ]:
            ref_residual = residual.clone()
            expected = op(grad, ref_residual, arg)
            acc = grad + residual
            got = accumulated(acc, arg)
            for ours, theirs in zip(got, expected):
                assert_bits(ours, theirs, f"{op.__name__} ({kind})")
            assert_bits(acc, ref_residual, f"{op.__name__} residual ({kind})")


def test_accumulated_takes_no_residual():
    grad = torch.randn(100)
    with pytest.raises(ValueError, match="residual=None"):
        topk_compress_cpu(grad, torch.zeros(100), 5, accumulated=True)
    with pytest.raises(ValueError, match="residual=None"):
        threshold_compress_cpu(grad, torch.zeros(100), 0.5, accumulated=True)
