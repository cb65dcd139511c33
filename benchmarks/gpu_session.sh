#!/usr/bin/env bash
# Everything sparsecomm checks on a GPU machine, in one call of under nine minutes (the device
# kills a command at ten). Parts, in this order, each under its own timeout:
#
#   GPU tests                 cap 200 s  tests/test_kernel_*.py, test_compressors.py, test_gpu.py
#   GPT step table            cap 210 s  bench_step.py --model gpt (issue 11's rows and targets)
#   GPT step, fused AdamW     cap 150 s  the same with AdamW(fused=True) in every row: the rows
#                                        that step ahead of the verdict beside /wait ones
#   1e9 linear rows           cap  90 s  bench_step.py --params 1e9: DDP, Cast(bf16), TopK(0.01)
#   1e9 step profile          cap  90 s  profile_step.py: DDP and TopK(0.01) per operator
#   step() overhead           cap  60 s  bench_overhead.py at n = 1e7 and 1e8
#   kernel benchmarks         cap 190 s  bench_kernels.py, its own budget set from the time left
#   top-k breakdown           cap  90 s  bench_topk.py (EF loop, per-kernel profile, tile sweep)
#   CatchUpAdamW step         cap  60 s  bench_catchup.py: its kernel against torch's AdamW
#   training quality          cap 150 s  quality_gpt.py: GPT loss under AdamW, dense vs recipes
#   validation quality        cap 420 s  compare.py --task charlm on one GPU, a 19M char-LM:
#                                        validation bits per byte against step and bytes
#
# A part's timeout is its cap or the time left of SESSION_BUDGET_S (default 520 s), whichever
# is less; a part with less left than it needs is skipped, a failing one is reported and the
# next one runs. Outputs go to $OUT (default ./gpu-out): each part's full log, the tables as
# markdown (bench_gpt.md, bench_gpt_fused.md, bench_step.md, bench_overhead.md, bench_kernels.md), and
# session.txt with each part's status and time; the end of stdout repeats the tables.
# SKIP="bench_kernels bench_topk quality_gpt" leaves out the parts writing those logs.
# QUALITY_RECIPES="dense,topk-catchup-warmup" picks quality_gpt.py's recipes (default: all);
# CHARLM_RUNS="dense topk-updates-warmup-0.01" compare.py's runs (default: below);
# GPT_VARIANTS="DDP,TopK(0.01),TopK(0.01)/adam" the GPT step table's rows (default: its own),
# FUSED_VARIANTS those of the fused-AdamW table.
# TOPK_BASELINE=path/to/topk.py also times that version of the top-k module beside this one.
# SMOKE=1 runs every part at tiny sizes (on a CPU: a test of this script, not a measurement).
#
#     bash benchmarks/gpu_session.sh            # on a machine with CUDA, from the repo root
set -uo pipefail
export OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SESSION_BUDGET_S=${SESSION_BUDGET_S:-520}
SMOKE=${SMOKE:-0}
START=$(date +%s)
rm -f "$OUT/session.txt" "$OUT/bench_gpt.md" "$OUT/bench_gpt_fused.md" "$OUT/bench_step.md" \
  "$OUT/bench_overhead.md"

elapsed() { echo $(( $(date +%s) - START )); }
stamp() { echo "$(date -u +%H:%M:%S) UTC, +$(elapsed) s"; }
# Launcher and profiler chatter, kept in the logs, left out of what is shown here.
quiet() { grep -v -E '^(USDT:|[WI][0-9]{4} |\*{10})|OMP_NUM_THREADS|^ *$'; }

# run_part NAME CAP_S MIN_S LOG SHOW CMD...: CMD under a timeout of min(CAP_S, time left),
# or skipped when less than MIN_S is left or when SKIP names its log's stem (e.g.
# SKIP="bench_kernels bench_topk"); full output in $OUT/LOG, its last SHOW lines here.
run_part() {
  local name=$1 cap=$2 min=$3 log=$4 show=$5
  shift 5
  local limit=$(( SESSION_BUDGET_S - $(elapsed) ))
  (( limit > cap )) && limit=$cap
  echo
  echo "== $name [$(stamp)], timeout ${limit} s"
  if [[ " ${SKIP:-} " == *" ${log%.*} "* ]]; then
    echo "-- $name: SKIPPED (SKIP names ${log%.*})" | tee -a "$OUT/session.txt"
    return 0
  fi
  if (( limit < min )); then
    echo "-- $name: SKIPPED, ${limit} s left of the session (needs ${min} s)" \
      | tee -a "$OUT/session.txt"
    return 0
  fi
  local began=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  quiet < "$OUT/$log" | tail -n "$show"
  local status=ok
  if (( rc == 124 || rc == 137 )); then
    status="TIMED OUT after ${limit} s (what it wrote is in $OUT/$log)"
  elif (( rc != 0 )); then
    status="FAILED with exit code $rc (see $OUT/$log)"
  fi
  echo "-- $name: $status; took $(( $(date +%s) - began )) s [$(stamp)]" | tee -a "$OUT/session.txt"
}

# Time the kernel benchmarks may take: whatever the parts before them left.
left_for() {  # left_for CAP: min(CAP, time left)
  local limit=$(( SESSION_BUDGET_S - $(elapsed) ))
  (( limit > $1 )) && limit=$1
  echo "$limit"
}

if [[ $SMOKE == 1 ]]; then
  TESTS=(tests/test_gpu.py)
  GPT_ARGS=(--layers 2 --d-model 64 --heads 2 --vocab 256 --context 32 --batch 2
            --warmup 1 --steps 2 --interleave 2 --budget-s 60)
  FUSED_ARGS=("${GPT_ARGS[@]}" --budget-s 30)
  LINEAR_ARGS=(--params 1e7 --variants "DDP,Cast(bf16),TopK(0.01)" --batch 2 --warmup 0
               --steps 1 --repeats 1 --budget-s 30)
  PROFILE_ARGS=()
  SKIP="${SKIP:-} profile_step"  # it profiles CUDA steps only
  OVERHEAD_ARGS=(--sizes 1e4,1e5)
  QUALITY_ARGS=(--layers 1 --d-model 32 --heads 2 --vocab 64 --context 16 --batch 2
                --steps 4 --warmup 2)
  CATCHUP_ARGS=(--device cpu --scale 0.02 --steps 1)
  CHARLM_ARGS=(--steps 4 --eval-every 2 --density-warmup 2 --timeout 120
               --script-args="--width 32 --layers 1 --heads 2 --context 16")
  KERNEL_ENV=(env BENCH_DEVICE=cpu TRITON_INTERPRET=1 BENCH_SIZES=1e4 BENCH_SWEEP=0)
else
  # GPU_TESTS="tests/test_gpu.py ..." runs those instead (e.g. when no kernel changed).
  read -r -a TESTS <<< "${GPU_TESTS:-$(echo tests/test_kernel_*.py) tests/test_compressors.py tests/test_catchup.py tests/test_gpu.py}"
  # ~40 ms steps: 8 rows built at once (~30 GiB), 8 interleaved rounds of 10 steps per
  # row ~ 30 s of steps, plus builds, the kernel counts and the profile=True steps; no
  # round starts after 140 s.
  GPT_ARGS=(--warmup 10 --steps 10 --interleave 8 --budget-s 140)
  FUSED_ARGS=(--warmup 10 --steps 10 --interleave 8 --budget-s 90 --no-shares)
  LINEAR_ARGS=(--params 1e9 --variants "none,DDP,Cast(bf16),TopK(0.01)" --warmup 5 --steps 5
               --interleave 6 --budget-s 55)
  OVERHEAD_ARGS=(--sizes 1e7,1e8)
  QUALITY_ARGS=(--steps 100 --warmup 20)
  CATCHUP_ARGS=()
  # 19M parameters (width 512, 6 layers), a context of 128, 32 windows a step: 1000 steps
  # see about one pass over the standard library's top-level source.
  CHARLM_ARGS=(--steps 1000 --eval-every 50 --density-warmup 100 --lr 1e-3 --batch-size 32
               --timeout 150 --script-args="--width 512 --layers 6 --heads 8 --context 128
               --text-bytes 5000000 --val-batches 16")
  # PROFILE="--model gpt --variants DDP,TopK(0.01) --cprofile" profiles other rows instead.
  read -r -a PROFILE_ARGS <<< "${PROFILE:---model linear --params 1e9 --variants DDP,TopK(0.01) --warmup 3 --steps 2}"
  KERNEL_ENV=(env)
fi

echo "== environment [$(stamp)]"
{
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%d
} 2>&1 | tee "$OUT/env.txt"

# No network on the GPU machine, so no install: a link makes sparsecomm.triton_kernels
# importable from this tree as the installed package maps it.
ln -sfn ../triton_kernels sparsecomm/triton_kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import sparsecomm.triton_kernels.topk" || { echo "sparsecomm does not import"; exit 1; }

# The kernel and compressor tests run on CUDA tensors here (natively, not interpreted),
# together with the tests marked gpu.
run_part "GPU tests" 200 30 gpu_tests.txt 15 \
  python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}"

run_part "GPT step table (one GPU)" 210 60 bench_gpt.log 3 \
  torchrun --standalone --nproc_per_node=1 benchmarks/bench_step.py --model gpt \
  "${GPT_ARGS[@]}" ${GPT_VARIANTS:+--variants "$GPT_VARIANTS"} --label "1 GPU" --out "$OUT/bench_gpt.md"

run_part "GPT step table, fused AdamW: stepped ahead of the verdict and /wait" 150 60 \
  bench_gpt_fused.log 3 \
  torchrun --standalone --nproc_per_node=1 benchmarks/bench_step.py --model gpt --adamw fused \
  "${FUSED_ARGS[@]}" --variants "${FUSED_VARIANTS:-DDP,DDP+fp16,Dense(),Dense()/wait,TopK(0.01),TopK(0.01)/wait,Cast(bf16),Cast(bf16)/wait}" \
  --label "1 GPU" --out "$OUT/bench_gpt_fused.md"

run_part "1e9-parameter linear rows (one GPU)" 90 30 bench_step.log 3 \
  torchrun --standalone --nproc_per_node=1 benchmarks/bench_step.py \
  "${LINEAR_ARGS[@]}" --label "1 GPU" --out "$OUT/bench_step.md"

run_part "where the 1e9 step goes (torch.profiler)" 90 30 profile_step.log 80 \
  torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py "${PROFILE_ARGS[@]}" \
  --out "$OUT/profile_step.txt"

run_part "CompressedOptimizer.step() overhead" 60 20 bench_overhead.log 3 \
  python3 benchmarks/bench_overhead.py "${OVERHEAD_ARGS[@]}" --out "$OUT/bench_overhead.md"

# bench_kernels checks its budget between sections (a 1e9 section takes up to ~40 s) and
# writes $OUT/bench_kernels.md after each, so a timeout keeps what was measured.
limit=$(left_for 190)
budget=$(( limit - 60 ))
(( budget > 120 )) && budget=120
(( budget < 10 )) && budget=10
export BENCH_BUDGET_S=${BENCH_BUDGET_S:-$budget}
echo "(kernel benchmarks: BENCH_BUDGET_S=$BENCH_BUDGET_S)"
run_part "kernel benchmarks" 190 40 bench_kernels.txt 4 \
  "${KERNEL_ENV[@]}" python3 benchmarks/bench_kernels.py

run_part "top-k: EF loop, per-kernel profile, tile sweep" 90 45 bench_topk.txt 12 \
  python3 benchmarks/bench_topk.py --no-reference --profile --sweep \
  ${TOPK_BASELINE:+--baseline "$TOPK_BASELINE"}

run_part "CatchUpAdamW step against AdamW" 60 20 bench_catchup.txt 12 \
  python3 benchmarks/bench_catchup.py "${CATCHUP_ARGS[@]}"

run_part "training quality (GPT, AdamW)" 150 30 quality_gpt.log 12 \
  torchrun --standalone --nproc_per_node=1 benchmarks/quality_gpt.py \
  "${QUALITY_ARGS[@]}" ${QUALITY_RECIPES:+--recipes "$QUALITY_RECIPES"} --out "$OUT/quality_gpt.md"

read -r -a CHARLM_RUNS <<< "${CHARLM_RUNS:-dense topk-ef-0.01 topk-warmup-0.01 topk-updates-warmup-0.01 topk-updates-dense-warmup-0.01 topk-catchup-adam-warmup-0.01 topk-updates-warmup-0.001 topk-updates-dense-warmup-0.001 topk-catchup-adam-warmup-0.001}"
run_part "validation quality (char-LM, one GPU)" 420 60 quality_charlm.log 16 \
  python3 examples/compare.py --task charlm --nproc 1 --name charlm-gpu --out "$OUT/charlm" \
  --density 0.01 0.001 "${CHARLM_ARGS[@]}" --runs "${CHARLM_RUNS[@]}"
# Its table and plot as they are; the runs' logs in one archive (fewer files to bring back).
if [[ -d $OUT/charlm ]]; then
  cp "$OUT"/charlm/charlm-gpu.{md,png} "$OUT"/ 2>/dev/null
  tar czf "$OUT/charlm.tgz" -C "$OUT" charlm && rm -rf "$OUT/charlm"
fi

echo
echo "== summary [$(stamp)]"
cat "$OUT/session.txt"
for table in bench_gpt.md bench_gpt_fused.md bench_step.md bench_overhead.md; do
  [[ -f $OUT/$table ]] && { echo; echo "### $OUT/$table"; cat "$OUT/$table"; }
done
echo
echo "kernel tables: $OUT/bench_kernels.md, $OUT/bench_topk.txt; logs: $OUT/*.log, $OUT/*.txt"
