#!/usr/bin/env bash
# Everything sparsecomm checks on a GPU machine, in one call of under ten minutes: the GPU
# tests, the kernel benchmarks, the top-k breakdown, and the whole-step benchmark. Outputs
# go to $OUT (default ./gpu-out). TOPK_BASELINE=path/to/topk.py also times that version of
# the top-k module beside this one.
#
#     bash benchmarks/gpu_session.sh            # on a machine with CUDA, from the repo root
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%d
} 2>&1 | tee "$OUT/env.txt"

# No network on the GPU machine, so no install: a link makes sparsecomm.triton_kernels
# importable from this tree as the installed package maps it.
ln -sfn ../triton_kernels sparsecomm/triton_kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import sparsecomm.triton_kernels.topk" || exit 1

echo "== GPU tests" | tee "$OUT/gpu_tests.txt"
# The kernel and compressor tests run on CUDA tensors here (natively, not interpreted),
# together with the tests marked gpu.
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_*.py \
  tests/test_compressors.py tests/test_gpu.py 2>&1 | tail -40 \
  | tee -a "$OUT/gpu_tests.txt"

echo "== kernel benchmarks"
BENCH_BUDGET_S=${BENCH_BUDGET_S:-120} timeout 190 python3 benchmarks/bench_kernels.py 2>&1 \
  | tail -60 | tee "$OUT/bench_kernels.txt"

echo "== top-k: EF loop, per-kernel profile, tile sweep"
timeout 90 python3 benchmarks/bench_topk.py --no-reference --profile --sweep \
  ${TOPK_BASELINE:+--baseline "$TOPK_BASELINE"} 2>&1 | grep -v "^Self\|Activity\|cudaDevice\|^ *$" \
  | tee "$OUT/bench_topk.txt"

echo "== step benchmark (one GPU)"
timeout 150 torchrun --standalone --nproc_per_node=1 benchmarks/bench_step.py \
  --params 1e8 --params 1e9 --steps 20 --warmup 5 --label "1 GPU" \
  --out "$OUT/bench_step.md" 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tail -20
