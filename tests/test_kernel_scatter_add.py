"""The Triton scatter-add kernel against ``scatter_add_ref``: the same bits, every time."""

from __future__ import annotations

import contextlib
import math
import re
from unittest import mock

import pytest
import torch
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from sparsecomm.triton_kernels import scatter_add as scatter_module
from sparsecomm.triton_kernels.scatter_add import scatter_add, scatter_add_ref
from strategies import gradients

# Output elements per tile while small_tiles() is on.
SMALL_TILE = 64

# numpy (the interpreter's arithmetic) warns where float32 overflows or makes NaN, as meant.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The three implementations, by the name the tests' parameters give them.
IMPLS = {"kernel": scatter_add, "ref": scatter_add_ref, "cpu": scatter_module.scatter_add_cpu}

SCALES = [1.0, 0.125, 1 / 3, 0.1, 1 / 8]


@contextlib.contextmanager
def small_tiles():
    """Tiles of 64 elements, pair blocks of 16, 4 boundaries per search program: a few
    thousand elements span many tiles, a rank's pairs in one tile span several blocks."""
    with mock.patch.multiple(scatter_module, TILE_SIZE=SMALL_TILE, PAIR_BLOCK=16, SEARCH_BLOCK=4):
        yield


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality, except that any NaN matches any NaN (payloads are not part of it)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    both_nan = actual.isnan() & expected.isnan()
    differ = (actual.view(torch.int32) != expected.view(torch.int32)) & ~both_nan
    if differ.any():
        where = differ.nonzero().flatten()[:10].tolist()
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} elements differ, first at "
            f"{where}: got {actual[where].tolist()}, expected {expected[where].tolist()}"
        )


def random_messages(world_size, numel, counts, pad, values, seed, device=DEVICE):
    """[world_size, m] messages: row r starts with counts[r] unique ascending indices.

    The padding after them holds garbage (out-of-range indices, NaN values) that both the
    kernel and the reference must ignore.
    """
    gen = torch.Generator().manual_seed(seed)
    m = max(counts, default=0) + pad
    indices = torch.randint(-5, numel + 5, (world_size, m), generator=gen, dtype=torch.int32)
    for rank, count in enumerate(counts):
        chosen = torch.randperm(numel, generator=gen)[:count].sort().values
        indices[rank, :count] = chosen.to(torch.int32)
    values = values.reshape(world_size, m).clone()
    for rank, count in enumerate(counts):
        values[rank, count:] = math.nan
    return indices.to(device), values.to(device)


def check_against_ref(indices, values, counts, numel, scale):
    out = scatter_add(indices, values, counts, numel, scale)
    expected = scatter_add_ref(indices, values, counts, numel, scale)
    assert out.dtype == torch.float32 and out.device == values.device
    assert_same_bits(out, expected, "sum")
    return out


@st.composite
def messages(draw, max_numel: int = 3000):
    world_size = draw(st.integers(1, 8))
    numel = draw(
        st.one_of(st.sampled_from([1, 2, 7, SMALL_TILE, SMALL_TILE + 1]), st.integers(1, max_numel))
    )
    dense = draw(st.booleans())
    if dense:
        counts = [numel] * world_size
    else:
        counts = draw(
            st.lists(st.integers(0, min(numel, 300)), min_size=world_size, max_size=world_size)
        )
    pad = draw(st.integers(0, 3))
    m = max(counts) + pad
    if world_size * m > 0:
        values = draw(gradients(sizes=[world_size * m]))
    else:
        values = torch.empty(0)
    seed = draw(st.integers(0, 2**31 - 1))
    indices, values = random_messages(world_size, numel, counts, pad, values, seed)
    # counts=None means every entry is real, so only without padding.
    counts_arg = None if pad == 0 and draw(st.booleans()) and len(set(counts)) == 1 else counts
    scale = draw(st.sampled_from(SCALES))
    return indices, values, counts_arg, numel, scale


@given(messages())
def test_matches_reference(case):
    check_against_ref(*case)


@given(messages(max_numel=700))
def test_matches_reference_with_small_tiles(case):
    with small_tiles():
        check_against_ref(*case)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_world_sizes_overlapping_ranks(world_size):
    # Every rank sends many of the same elements, so each element sums up to 8 values in
    # rank order; the values are chosen so that the order changes the rounding.
    numel = 5 * SMALL_TILE + 17
    gen = torch.Generator().manual_seed(world_size)
    counts = [int(c) for c in torch.randint(numel // 2, numel + 1, (world_size,), generator=gen)]
    values = torch.randn(world_size * (max(counts) + 1), generator=gen)
    values = values * torch.tensor([1e8, 1.0, 1e-8])[torch.arange(values.numel()) % 3]
    indices, values = random_messages(world_size, numel, counts, 1, values, world_size)
    for scale in [1.0, 1 / 3]:
        check_against_ref(indices, values, counts, numel, scale)
        with small_tiles():
            check_against_ref(indices, values, counts, numel, scale)


def test_negative_zero_and_special_values():
    nan, inf = math.nan, math.inf
    indices = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], dtype=torch.int32)
    values = torch.tensor(
        [[-0.0, -0.0, inf, 3.4028235e38, nan, 1.0], [-0.0, -inf, 3.4028235e38, 1.0, 1.0, -1.0]]
    )
    out = check_against_ref(indices.to(DEVICE), values.to(DEVICE), None, 8, 1.0)
    # 0.0 + -0.0 is +0.0: the reference's sum starts from +0.0.
    assert out.view(torch.int32)[[0, 1, 7]].tolist() == [0, 0, 0]
    assert out[2].isnan() and out[3] == inf and out[4].isnan()
    assert out[5:7].tolist() == [2.0, -1.0]
    check_against_ref(indices.to(DEVICE), values.to(DEVICE), [3, 6], 8, 0.25)


def test_out_of_range_entries_past_the_count_are_ignored():
    indices = torch.tensor([[0, 7, -1, 9999], [3, 5000, 5000, -7]], dtype=torch.int32)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    out = check_against_ref(indices.to(DEVICE), values.to(DEVICE), [2, 1], 8, 1.0)
    assert out.tolist() == [1.0, 0, 0, 5.0, 0, 0, 0, 2.0]


def test_reference_order_within_a_rank_does_not_matter():
    # The kernel takes each rank's indices ascending (as the compressors send them); the
    # reference takes any unique ones. The same pairs in another order give the same sum.
    gen = torch.Generator().manual_seed(5)
    numel = 3 * SMALL_TILE + 1
    rows = [torch.randperm(numel, generator=gen)[:120].sort().values for _ in range(3)]
    indices = torch.stack(rows).int()
    values = torch.randn(3, 120, generator=gen)
    shuffle = torch.randperm(120, generator=gen)
    shuffled = scatter_add_ref(indices[:, shuffle], values[:, shuffle], None, numel, 0.5)
    with small_tiles():
        out = scatter_add(indices.to(DEVICE), values.to(DEVICE), None, numel, 0.5)
    assert_same_bits(out.cpu(), shuffled, "sum of the pairs in another order")


def test_deterministic():
    numel = 5 * SMALL_TILE
    gen = torch.Generator().manual_seed(0)
    counts = [numel, numel // 2, 3, 0]
    values = torch.randn(4 * numel, generator=gen) * 1e3
    indices, values = random_messages(4, numel, counts, 0, values, 1)
    with small_tiles():
        first = check_against_ref(indices, values, counts, numel, 0.25)
        second = scatter_add(indices, values, counts, numel, 0.25)
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))


@pytest.mark.parametrize(
    "shape, numel, counts",
    [((0, 5), 10, None), ((3, 0), 10, None), ((3, 0), 10, [0, 0, 0]), ((2, 4), 0, [0, 0])],
)
def test_empty(shape, numel, counts):
    indices = torch.zeros(shape, dtype=torch.int32, device=DEVICE)
    values = torch.ones(shape, device=DEVICE)
    check_against_ref(indices, values, counts, numel, 0.5)


def test_numel_one():
    indices = torch.zeros((3, 1), dtype=torch.int32, device=DEVICE)
    values = torch.tensor([[0.1], [0.2], [0.3]], device=DEVICE)
    check_against_ref(indices, values, None, 1, 1 / 3)


BAD_ARGUMENTS = [
    ((torch.zeros(4, dtype=torch.int32), torch.zeros(4), None, 4, 1.0), "indices must be"),
    ((torch.zeros(2, 4), torch.zeros(2, 4), None, 4, 1.0), "indices must be"),
    ((torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4), None, 4, 1.0), "indices must be"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3), None, 4, 1.0), "values must be"),
    (
        (
            torch.zeros(2, 4, dtype=torch.int32),
            torch.zeros(2, 4, dtype=torch.float16),
            None,
            4,
            1.0,
        ),
        "values must be",
    ),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), [1], 4, 1.0), "counts must"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), [1, 5], 4, 1.0), "counts must"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), [-1, 2], 4, 1.0), "counts must"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), None, -1, 1.0), "numel must"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), None, 2**31, 1.0), "numel must"),
]


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_arguments(args, message):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(ValueError, match=message):
        scatter_add(*args)


_I = torch.zeros(2, 4, dtype=torch.int32)
_V = torch.zeros(2, 4)

# TypeError for a wrong type or dtype, ValueError for a wrong shape, size or value: the
# rule of every checker in triton_kernels (a wrong dtype's DtypeError is both).
TYPED_BAD_ARGUMENTS = [
    (([[0, 1]], _V, None, 4, 1.0, None), TypeError, "indices and values must be tensors"),
    ((_I, _V.tolist(), None, 4, 1.0, None), TypeError, "indices and values must be tensors"),
    ((_I.long(), _V, None, 4, 1.0, None), TypeError, "indices must be"),
    ((_I, _V.half(), None, 4, 1.0, None), TypeError, "values must be"),
    ((_I[0], _V[0], None, 4, 1.0, None), ValueError, "indices must be"),
    ((_I, _V, None, 4.0, 1.0, None), TypeError, "numel must be an int"),
    ((_I, _V, None, True, 1.0, None), TypeError, "numel must be an int"),
    ((_I, _V, None, 2**31, 1.0, None), ValueError, "numel must be"),
    ((_I, _V, [1.5, 2], 4, 1.0, None), TypeError, "counts must"),
    ((_I, _V, [1, 2, 3], 4, 1.0, None), ValueError, "counts must"),
    ((_I, _V, None, 4, 1.0, [0.0] * 4), TypeError, "out must be"),
    ((_I, _V, None, 4, 1.0, torch.zeros(4, dtype=torch.float64)), TypeError, "out must be"),
    ((_I, _V, None, 4, 1.0, torch.zeros(5)), ValueError, "out must be"),
    ((_I, _V, None, 4, 1.0, "strided"), ValueError, "out must be"),
]


@pytest.mark.parametrize("args, error, message", TYPED_BAD_ARGUMENTS)
@pytest.mark.parametrize("impl", ["kernel", "cpu"])
def test_bad_arguments_error_types(args, error, message, impl):
    fn = scatter_add if impl == "kernel" else scatter_module.scatter_add_cpu
    device = DEVICE if impl == "kernel" else "cpu"
    *args, out = (a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    if isinstance(out, str):  # a non-contiguous out, made on its device (.to() would copy)
        out = torch.zeros(8, device=device)[::2]
    with pytest.raises(error, match=message):
        fn(*args, out=out)


def three_messages(impl: str, numel: int):
    """For the ``out`` and ``skip`` tests: the implementation, its device, a generator, and
    three ranks' messages (one half full, one full, one empty) with their sum at scale 0.25."""
    fn = IMPLS[impl]
    device = "cpu" if impl == "cpu" else DEVICE
    gen = torch.Generator().manual_seed(numel)
    counts = [numel // 2, numel, 0]
    values = torch.randn(3 * (numel + 1), generator=gen)
    indices, values = random_messages(3, numel, counts, 1, values, numel, device=device)
    expected = scatter_add_ref(indices, values, counts, numel, 0.25)
    return fn, device, gen, counts, indices, values, expected


@pytest.mark.parametrize("impl", ["kernel", "ref", "cpu"])
@pytest.mark.parametrize("numel", [1, 7, SMALL_TILE + 1, 1000])
def test_out_is_overwritten_and_returned(impl, numel):
    fn, device, gen, counts, indices, values, expected = three_messages(impl, numel)
    # Garbage (NaN) in out must not leak into the sum: out is overwritten, not added to.
    for out in [torch.full((numel,), math.nan, device=device), torch.empty(1, numel)]:
        out = out.to(device)
        with small_tiles():
            result = fn(indices, values, counts, numel, 0.25, out=out)
        assert result is out
        assert_same_bits(out.reshape(-1), expected, "sum written into out")
    # With nothing to add, out is zeroed.
    out = torch.full((numel,), math.nan, device=device)
    assert fn(indices[:, :0].contiguous(), values[:, :0].contiguous(), None, numel, 1.0,
              out=out) is out  # fmt: skip
    assert out.view(torch.int32).eq(0).all()


@pytest.mark.parametrize("impl", ["kernel", "ref", "cpu"])
@pytest.mark.parametrize("numel", [1, SMALL_TILE + 1, 1000])
def test_skip_keeps_out_or_writes_the_sum(impl, numel):
    # skip (a bool read on the device) True: out keeps every bit, NaN and -0.0 included,
    # also with nothing to add; False: exactly the sum without skip.
    fn, device, gen, counts, indices, values, expected = three_messages(impl, numel)
    old = torch.randn(numel, generator=gen).to(device)
    old[0], old[-1] = math.nan, -0.0
    for m in [indices.shape[1], 0]:
        rows = indices[:, :m].contiguous(), values[:, :m].contiguous()
        out = old.clone()
        with small_tiles():
            skip = torch.tensor(True, device=device)
            assert fn(*rows, None if m == 0 else counts, numel, 0.25, out=out, skip=skip) is out
            assert_same_bits(out, old, "out under skip=True")
            skip = torch.tensor(False, device=device)
            fn(*rows, None if m == 0 else counts, numel, 0.25, out=out, skip=skip)
        assert_same_bits(out, expected if m else torch.zeros(numel, device=device), "skip=False")


@pytest.mark.parametrize("impl", ["kernel", "ref", "cpu"])
@pytest.mark.parametrize(
    "skip, out, error, message",
    [
        (True, "out", TypeError, "skip must be a one-element bool tensor"),
        (torch.tensor(1), "out", TypeError, "got dtype=torch.int64"),
        (torch.tensor([True, False]), "out", ValueError, "got 2 elements"),
        (torch.tensor(True), None, ValueError, "pass out=... with skip=..."),
    ],
)
def test_bad_skip(impl, skip, out, error, message):
    fn = IMPLS[impl]
    device = "cpu" if impl == "cpu" else DEVICE
    indices, values = random_messages(1, 8, [2], 0, torch.randn(2), 0, device=device)
    out = torch.zeros(8, device=device) if out == "out" else None
    if isinstance(skip, torch.Tensor):
        skip = skip.to(device)
    with pytest.raises(error, match=re.escape(message)):
        fn(indices, values, None, 8, 1.0, out=out, skip=skip)


def test_out_allocates_no_output():
    # The kernel writes into out: no new numel-sized buffer (the only allocations left are
    # the small tile-bounds scratch).
    numel = 5 * SMALL_TILE
    indices, values = random_messages(2, numel, [10, 20], 0, torch.randn(40), 0)
    out = torch.empty(numel, device=DEVICE)
    allocated = []
    real_empty = torch.empty

    def spy(*size, **kwargs):
        tensor = real_empty(*size, **kwargs)
        allocated.append(tensor.numel())
        return tensor

    with small_tiles(), mock.patch.object(scatter_module.torch, "empty", spy):
        scatter_add(indices, values, [10, 20], numel, 0.5, out=out)
    assert numel not in allocated


@pytest.mark.gpu
@needs_cuda
def test_devices_differ():
    with pytest.raises(ValueError, match="one device"):
        scatter_add(
            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2, device="cuda"), None, 4, 1.0
        )


def gpu_messages(world_size, numel, count, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # Unique ascending indices without a full permutation: sort random keys, keep the first
    # `count` positions of each row.
    rows = []
    for _ in range(world_size):
        keys = torch.rand(numel, device="cuda", generator=gen)
        rows.append(keys.topk(count, sorted=False).indices.sort().values.to(torch.int32))
    indices = torch.stack(rows)
    values = torch.randn(world_size, count, device="cuda", generator=gen) * 100
    return indices, values


@pytest.mark.gpu
@needs_cuda
def test_large_gpu_bit_exact():
    numel, count = 10**8, 10**6
    indices, values = gpu_messages(8, numel, count, 0)
    first = check_against_ref(indices, values, None, numel, 1 / 8)
    second = scatter_add(indices, values, None, numel, 1 / 8)
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))
    counts = [count, count // 2, 0, 17, count, 5, count - 1, 1]
    check_against_ref(indices, values, counts, numel, 1 / 3)


@pytest.mark.gpu
@needs_cuda
def test_large_gpu_dense_overlap():
    # Dense messages: every element gets 8 values, in rank order.
    numel = 10**7 + 5
    gen = torch.Generator(device="cuda").manual_seed(3)
    indices = torch.arange(numel, device="cuda", dtype=torch.int32).expand(8, numel).contiguous()
    values = torch.randn(8, numel, device="cuda", generator=gen)
    values[:, ::3] *= 1e8
    check_against_ref(indices, values, None, numel, 1 / 8)


@pytest.mark.gpu
@needs_cuda
def test_gpu_same_pairs_on_every_rank_repeatable():
    # Every rank sends the same 1e6 elements: each of them is read, added and written by
    # eight ranks in turn within one program. Any missing ordering between ranks would show
    # as sums that change from run to run.
    numel, count = 10**8 + 7, 10**6
    indices, values = gpu_messages(1, numel, count, 4)
    indices = indices.expand(8, count).contiguous()
    values = (
        torch.randn(8, count, device="cuda")
        * torch.tensor([1e8, 1.0, 1e-8], device="cuda")[torch.arange(count, device="cuda") % 3]
    )
    first = check_against_ref(indices, values, None, numel, 1 / 8)
    for _ in range(10):
        again = scatter_add(indices, values, None, numel, 1 / 8)
        assert torch.equal(first.view(torch.int32), again.view(torch.int32))
