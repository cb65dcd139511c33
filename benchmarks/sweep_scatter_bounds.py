"""Sweep the tile-boundary search of the scatter-add (``SEARCH_BLOCK``, ``SEARCH_WARPS`` in
``triton_kernels/scatter_add.py``) on a GPU: time the whole ``scatter_add`` (bounds, then
tiles) for a 1e9-model bucket (16.7M elements, one rank at 1%) and for the kernel target's
case (1e8 elements, 8 ranks of 1e6 pairs), checking each setting's bits against the first's.

    python benchmarks/sweep_scatter_bounds.py
"""

import torch
import triton.testing
from sparsecomm.triton_kernels import scatter_add as sa

CASES = [  # (numel, world size, pairs per rank)
    (1 << 24, 1, 167_773),
    (100_000_000, 8, 1_000_000),
]
SETTINGS = [(1024, 4), (256, 4), (128, 4), (128, 1), (64, 2), (64, 1), (32, 1)]


def case(numel, world_size, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = [
        torch.randperm(numel, device="cuda", generator=g)[:m].sort().values
        for _ in range(world_size)
    ]
    indices = torch.stack(rows).to(torch.int32)
    values = torch.randn(world_size, m, device="cuda", generator=g)
    return indices, values


def main():
    print("| numel | W | pairs/rank | SEARCH_BLOCK | SEARCH_WARPS | scatter_add ms | same bits |")
    print("|---|---|---|---|---|---|---|")
    for numel, world_size, m in CASES:
        indices, values = case(numel, world_size, m)
        first = None
        for block, warps in SETTINGS:
            sa.SEARCH_BLOCK, sa.SEARCH_WARPS = block, warps
            out = torch.empty(numel, device="cuda")
            result = sa.scatter_add(indices, values, None, numel, 0.5, out=out).clone()
            first = result if first is None else first
            same = torch.equal(result.view(torch.int32), first.view(torch.int32))
            ms = triton.testing.do_bench(
                lambda i=indices, v=values, n=numel, o=out: sa.scatter_add(
                    i, v, None, n, 0.5, out=o
                ),
                rep=200,
            )
            print(f"| {numel:.3g} | {world_size} | {m} | {block} | {warps} | {ms:.4f} | {same} |")


if __name__ == "__main__":
    main()
