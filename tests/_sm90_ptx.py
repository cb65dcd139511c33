"""Compiles the kernels that read buffers through ``addresses`` for an H100/H200 (sm_90)
on this machine, with no GPU (Triton's compiler and ptxas need none), and prints, per
kernel and mode, how many 16-byte loads and stores its PTX has: one JSON object.

Run in a process of its own, without TRITON_INTERPRET (under the interpreter ``@triton.jit``
gives interpreted functions, which do not compile). Used by tests/test_indirect.py.
"""

from __future__ import annotations

import inspect
import json
import os

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from sparsecomm.triton_kernels import cast, topk  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
I32 = "*i32"
TYPES = dict(
    addresses_ptr="*i64", sample_hist_ptr=I32, done_ptr=I32, window_ptr=I32,
    cand_index_ptr=I32, cand_count_ptr=I32, total_ptr=I32, hist_ptr=I32,
    chunk_stats_ptr=I32, chunk_offsets_ptr=I32, out_index_ptr=I32, half_ptr="*bf16",
    scale="fp32", inv_scale="fp32",
)  # fmt: skip


def ptx(kernel, constexprs: dict, num_warps: int) -> str:
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        default = "*fp32" if name.endswith("_ptr") else "i32"
        signature[name] = "constexpr" if name in constexprs else TYPES.get(name, default)
    # As a launch on 16-byte aligned buffers and sizes divisible by 16 specialises.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name].startswith("*") or signature[name] == "i32"
    }
    fixed = {(names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps}).asm["ptx"]


def kernels(indirect: bool, residual: bool):
    yield (
        "sample",
        topk._topk_sample_kernel,
        4,
        dict(HAS_RESIDUAL=residual, INDIRECT=indirect, BLOCK=1024, FINE_BITS=13, COPIES=4),
    )
    yield (
        "candidates",
        topk._topk_candidates_kernel,
        4,
        dict(HAS_RESIDUAL=residual, INDIRECT=indirect, BLOCK=2048, ITERS=16, ROW=4),
    )
    yield "level0", topk._topk_level_kernel, 4, dict(
        LEVEL=0, ACC_SLOT=1 if residual else 0, INDIRECT=indirect, CHUNK=32768,
        CHUNKS_PER_PROGRAM=4, BLOCK=1024, NUM_BINS=256,
    )  # fmt: skip
    yield "write", topk._topk_write_kernel, 4, dict(
        HAS_RESIDUAL=residual, INDIRECT=indirect, CHUNK=32768, BLOCK=1024, NUM_BINS=256,
        NUM_LEVELS=4,
    )  # fmt: skip
    yield "cast", cast._cast_compress_kernel, 8, dict(
        LIMIT=3.0e38, FLOAT32_MAX=3.4028234663852886e38, HAS_RESIDUAL=residual,
        INDIRECT=indirect, BLOCK_SIZE=4096,
    )  # fmt: skip


def main():
    counts = {}
    for indirect in (False, True):
        for residual in (False, True):
            for name, kernel, warps, constexprs in kernels(indirect, residual):
                text = ptx(kernel, constexprs, warps)
                key = f"{name} residual={residual} indirect={indirect}"
                counts[key] = [text.count("ld.global.v4"), text.count("st.global.v4")]
    print(json.dumps({"triton": triton.__version__, "counts": counts}))


if __name__ == "__main__":
    main()
