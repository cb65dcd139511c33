"""The bookkeeping of CompressGraphs (which compressions run eagerly, which are captured,
which replay, which graphs are dropped), on CPU with a stand-in for CUDA graphs. That the
graphs give eager compression's bits is tested on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sparsecomm
from sparsecomm._engine import CompressGraphs


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays."""

    replays = 0

    def replay(self):
        FakeGraph.replays += 1


class Counting(sparsecomm.TopK):
    """TopK that counts its compress calls and records the addresses table it was given
    (as the values it held at the call)."""

    def __init__(self, density):
        super().__init__(density)
        self.calls, self.tables = 0, []

    def compress(self, grad, residual, world_size, addresses=None):
        self.calls += 1
        self.tables.append(None if addresses is None else addresses.tolist())
        return super().compress(grad, residual, world_size, addresses)


def fake_cuda(monkeypatch):
    captures = []

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode=None):
        captures.append(g)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    FakeGraph.replays = 0
    return captures


def test_one_graph_per_bucket_serves_buffers_that_move(monkeypatch):
    """Eager the first time, captured the second, replayed from then on, while the buffers
    swap and move every step; before each replay the table holds that step's addresses."""
    captures = fake_cuda(monkeypatch)
    graphs, compressor = CompressGraphs(), Counting(0.1)
    signature = compressor.graph_signature(100)
    alive, messages, expected = [], [], []
    for _ in range(6):
        g, r = torch.randn(100), torch.randn(100)  # new buffers every step
        alive += [g, r]  # so that no buffer comes back at a freed one's address
        expected.append([g.data_ptr(), r.data_ptr(), 0])
        messages.append(graphs.compress(compressor, g, r, 1, signature, owner=0))
        assert graphs.tables[0].table.tolist() == expected[-1]
    assert compressor.calls == 2 and len(captures) == 1 == graphs.captured
    assert compressor.tables == expected[:2]  # eager and captured, both through the table
    assert FakeGraph.replays == graphs.replays == 5
    # A replay hands out the captured tensors again, in a new Message.
    assert messages[4].indices is messages[1].indices and messages[4] is not messages[1]
    assert messages[4].known_peak is messages[1].known_peak is not None


def test_a_bucket_keeps_the_graph_of_its_latest_key(monkeypatch):
    fake_cuda(monkeypatch)
    graphs = CompressGraphs()
    a, b = torch.randn(100), torch.randn(100)
    for density in (0.1, 0.2, 0.3):  # a schedule changing k: each k seen three times
        compressor = Counting(density)
        signature = compressor.graph_signature(100)
        for g, r in [(a, b), (b, a), (a, b)]:
            graphs.compress(compressor, g, r, 1, signature, owner=0)
        assert compressor.calls == 2  # eager, captured, replayed
    assert list(graphs.graphs) == [0] and graphs.graphs[0][0][2] == ("TopK", 30, torch.float32)
    assert graphs.captured == 3
    # A key seen once at a time (k changing every step) is never captured.
    once = CompressGraphs()
    for density in (0.05, 0.08, 0.11, 0.14, 0.17, 0.2):  # k = 5, 8, 11, ...
        compressor = Counting(density)
        once.compress(compressor, a, b, 1, compressor.graph_signature(100), owner=0)
    assert once.graphs == {} and once.replays == 0


def test_cast_captures_write_into_one_wire_buffer_per_bucket(monkeypatch):
    fake_cuda(monkeypatch)
    graphs = CompressGraphs()

    class CountingCast(sparsecomm.Cast):
        outs: list = []

        def compress(self, grad, residual, world_size, out=None, addresses=None):
            CountingCast.outs.append((out, addresses.tolist()))
            return super().compress(grad, residual, world_size, out, addresses)

    compressor = CountingCast(torch.bfloat16)
    a, b = torch.randn(64), torch.randn(64)
    signature = compressor.graph_signature(64)
    for g, r in [(a, b), (b, a), (a, b), (b, a)]:
        graphs.compress(compressor, g, r, 2, signature, owner=3)
    (eager, eager_table), (captured, captured_table) = CountingCast.outs
    assert eager is captured is not None  # every step writes the one buffer
    assert captured.dtype == torch.bfloat16 and captured.numel() == 64
    assert eager_table == [a.data_ptr(), b.data_ptr(), captured.data_ptr()]
    assert captured_table == [b.data_ptr(), a.data_ptr(), captured.data_ptr()]
    assert graphs.tables[3].table.tolist() == [b.data_ptr(), a.data_ptr(), captured.data_ptr()]


def test_a_bucket_whose_key_keeps_changing_stops_capturing(monkeypatch):
    """A key that changes every other step is captured and never replayed: after
    MAX_CAPTURES - 1 captures without a replay the bucket compresses eagerly; a replay in
    between resets the count."""
    captures = fake_cuda(monkeypatch)
    graphs = CompressGraphs()
    g, r = torch.randn(100), torch.randn(100)
    for step in range(CompressGraphs.MAX_CAPTURES + 3):
        compressor = Counting(0.01 * (1 + step % 2))  # k = 1, 2, 1, 2, ...
        for _ in range(2):  # seen once (eager), then captured
            graphs.compress(compressor, g, r, 1, compressor.graph_signature(100), owner=0)
    assert len(captures) == graphs.captured == CompressGraphs.MAX_CAPTURES - 1
    assert not graphs.active(0) and graphs.active(1)
    assert graphs.graphs == {}
    # Another bucket that replays keeps capturing past the count.
    graphs2 = CompressGraphs()
    for step in range(3 * CompressGraphs.MAX_CAPTURES):
        compressor = Counting(0.01 * (1 + (step // 3) % 2))  # k changes every third step
        graphs2.compress(compressor, g, r, 1, compressor.graph_signature(100), owner=0)
    assert graphs2.active(0) and graphs2.replays >= CompressGraphs.MAX_CAPTURES


def test_a_buffer_at_an_odd_address_is_compressed_eagerly(monkeypatch):
    """The kernels read buffers through the table with 16-byte loads: a view starting
    off a 16-byte boundary is compressed eagerly, with its own address."""
    captures = fake_cuda(monkeypatch)
    graphs, compressor = CompressGraphs(), Counting(0.1)
    flat = torch.randn(201)
    g, r = flat[1:101], flat[101:201]  # 4 bytes past an aligned start
    for _ in range(3):
        graphs.compress(compressor, g, r, 1, compressor.graph_signature(100), owner=0)
    assert compressor.calls == 3 and compressor.tables == [None] * 3 and not captures


def test_a_compressor_failing_through_the_table_compresses_without_graphs(monkeypatch):
    """Should the kernels that read the address table fail (they do not compile on some
    Triton), the step still goes on: eagerly, without the table, from then on."""
    captures = fake_cuda(monkeypatch)

    class Failing(Counting):
        def compress(self, grad, residual, world_size, addresses=None):
            if addresses is not None:
                raise RuntimeError("no int-to-pointer cast here")
            return super().compress(grad, residual, world_size)

    graphs, compressor = CompressGraphs(), Failing(0.1)
    g, r = torch.randn(100), torch.randn(100)
    expected_r = r.clone()
    expected = sparsecomm.TopK(0.1).compress(g.clone(), expected_r, 1)
    with pytest.warns(RuntimeWarning, match="without CUDA graphs"):
        message = graphs.compress(compressor, g, r, 1, compressor.graph_signature(100), 0)
    assert torch.equal(message.indices, expected.indices) and torch.equal(r, expected_r)
    assert graphs.failed and not graphs.active(0) and not captures
