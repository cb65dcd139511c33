"""The bookkeeping of CompressGraphs (which compressions run eagerly, which are captured,
which replay, which graphs are dropped), on CPU with a stand-in for CUDA graphs. That the
graphs give eager compression's bits is tested on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import contextlib

import torch

import sparsecomm
from sparsecomm._engine import CompressGraphs


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays."""

    replays = 0

    def replay(self):
        FakeGraph.replays += 1


class Counting(sparsecomm.TopK):
    """TopK that counts its compress calls and what it was asked to write into."""

    def __init__(self, density):
        super().__init__(density)
        self.calls, self.outs = 0, []

    def compress(self, grad, residual, world_size, out=None):
        self.calls += 1
        self.outs.append(out)
        return super().compress(grad, residual, world_size)


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


def test_eager_then_captured_then_replayed_per_buffer_pairing(monkeypatch):
    captures = fake_cuda(monkeypatch)
    graphs, compressor = CompressGraphs(), Counting(0.1)
    a, b = torch.randn(100), torch.randn(100)
    signature = compressor.graph_signature(100)
    pairings = [(a, b), (b, a)] * 3  # the buffers swap every step
    messages = [graphs.compress(compressor, g, r, 1, signature, owner=0) for g, r in pairings]
    # Each pairing: eager the first time, captured (one compress inside the capture) and
    # replayed the second, replayed from then on.
    assert compressor.calls == 4 and len(captures) == 2
    assert FakeGraph.replays == graphs.replays == 4
    # A replay hands out the captured tensors again, in a new Message.
    assert messages[4].indices is messages[2].indices and messages[4] is not messages[2]
    assert messages[4].known_peak is messages[2].known_peak is not None


def test_a_bucket_keeps_the_graphs_of_its_two_latest_keys(monkeypatch):
    fake_cuda(monkeypatch)
    graphs = CompressGraphs()
    a, b = torch.randn(100), torch.randn(100)
    for density in (0.1, 0.2, 0.3):  # a schedule changing k: each k seen twice per pairing
        compressor = Counting(density)
        signature = compressor.graph_signature(100)
        for g, r in [(a, b), (b, a), (a, b), (b, a)]:
            graphs.compress(compressor, g, r, 1, signature, owner=0)
    assert len(graphs.graphs) == 2  # only the last k's two pairings
    assert {key[3] for key in graphs.graphs} == {("TopK", 30)}
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

        def compress(self, grad, residual, world_size, out=None):
            CountingCast.outs.append(out)
            return super().compress(grad, residual, world_size, out)

    compressor = CountingCast(torch.bfloat16)
    a, b = torch.randn(64), torch.randn(64)
    signature = compressor.graph_signature(64)
    for g, r in [(a, b), (b, a), (a, b), (b, a)]:
        graphs.compress(compressor, g, r, 2, signature, owner=3)
    eager, captured = CountingCast.outs[:2], CountingCast.outs[2:]
    assert eager == [None, None]
    assert captured[0] is captured[1] is not None  # both pairings share the buffer
    assert captured[0].dtype == torch.bfloat16 and captured[0].numel() == 64


def test_a_bucket_whose_buffers_keep_moving_stops_capturing(monkeypatch):
    """Buffers at new addresses every step (each key seen twice, then never again): after
    MAX_CAPTURES - 1 captures without a replay the bucket compresses eagerly and its
    graphs are freed; a replay in between resets the count."""
    captures = fake_cuda(monkeypatch)
    graphs, compressor = CompressGraphs(), Counting(0.1)
    signature = compressor.graph_signature(100)
    alive = []  # so that no buffer comes back at a freed one's address
    for _ in range(CompressGraphs.MAX_CAPTURES + 3):
        g, r = torch.randn(100), torch.randn(100)  # new addresses
        alive += [g, r]
        for _ in range(2):  # seen once (eager), then captured
            graphs.compress(compressor, g, r, 1, signature, owner=0)
    assert len(captures) == graphs.captured == CompressGraphs.MAX_CAPTURES - 1
    assert not graphs.active(0) and graphs.active(1)
    assert not any(key in graphs.graphs for key in graphs.keys_of.get(0, []))
    assert graphs.graphs == {}
    # Another bucket that replays keeps capturing past the count.
    graphs2 = CompressGraphs()
    g, r = torch.randn(100), torch.randn(100)
    for step in range(3 * CompressGraphs.MAX_CAPTURES):
        if step % 3 == 0:
            g, r = torch.randn(100), torch.randn(100)
        graphs2.compress(compressor, g, r, 1, signature, owner=0)
    assert graphs2.active(0) and graphs2.replays >= CompressGraphs.MAX_CAPTURES
