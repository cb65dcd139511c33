"""Kernels reading their buffers through an ``addresses`` table compile for the GPU as
well as the direct ones: for sm_90, on this machine, with the same 16-byte loads and
stores (the hint that the addresses are aligned reaches the compiler). That they compute
the direct call's bits is tested in tests/test_kernel_topk.py and test_kernel_cast.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ptx_counts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / "_sm90_ptx.py")],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("compiling the kernels for sm_90 took over 600 s")
    if done.returncode:
        if "ptxas" in done.stderr and "not found" in done.stderr.lower():
            pytest.skip("this Triton install has no ptxas to compile for sm_90")
        pytest.fail(f"compiling for sm_90 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["counts"]


@pytest.mark.parametrize("name", ["sample", "candidates", "level0", "write", "cast"])
@pytest.mark.parametrize("residual", [False, True])
def test_indirect_kernels_keep_the_vector_loads_and_stores(ptx_counts, name, residual):
    direct = ptx_counts[f"{name} residual={residual} indirect=False"]
    indirect = ptx_counts[f"{name} residual={residual} indirect=True"]
    assert indirect == direct, f"16-byte loads, stores: direct {direct}, indirect {indirect}"


@pytest.mark.parametrize("name", ["candidates", "cast"])
def test_the_passes_over_the_data_are_vectorised(ptx_counts, name):
    """So that the comparison above compares something: the passes that stream the
    buffers load 16 bytes at a time."""
    loads, _ = ptx_counts[f"{name} residual=True indirect=True"]
    assert loads >= 8
