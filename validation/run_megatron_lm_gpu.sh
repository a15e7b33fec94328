#!/bin/bash
# One device call for issue 27: Megatron-LM's own train() (megatron-core 0.19.2 wheel) on one GPU
# with Transformer Engine 2.20.2 FP8 weights, the pipeline ranks sharing the GPU through CUDA MPS.
# Installs TE (core library stripped to sm_90), megatron-core 0.19.2, omegaconf and pydantic from
# the bundle that validation/run_real_stack.sh's header describes (H200=path, default ../../.h200,
# with megatron-core 0.19.2 in mc19/; spare/typing_extensions-*.whl, used only where the image's is
# too old for pydantic), builds TE's PyTorch extension (or takes te_torch_ext.so.gz
# from the bundle), starts MPS, then runs
#   checks: validation/megatron_lm_gpu.py at PP=2 VP=2 and PP=4 VP=2 side by side
#   bench:  benchmarks/megatron_lm_step_time.py at PP=4 VP=2 and PP=2 VP=2 (5 rounds x 12
#           iterations per segment, 2 not timed: 50 timed per policy), then PP=BW_PP (2) VP=2 with
#           blockwise FP8 weights (--fp8-recipe blockwise, TE's column-wise build only) in the
#           time left (fewer rounds if its warm-up says they would not fit). JOBS="pp4 pp2
#           blockwise" (default; any subset, in the order given) picks the jobs. On an H100
#           (2026-12-06): TE's extension built in ~100 s; a PP=4 job of 5 rounds x 10 took 101 s.
# Usage (repo root): bash validation/run_megatron_lm_gpu.sh [checks|bench|all|resume] [BUDGET_S]
#   resume: only the aligned job and the saved-and-resumed one, PP=2 and PP=4
set -o pipefail
export PYTHONUNBUFFERED=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/mlm
REPO=$PWD; H=$(cd "${H200:-$REPO/../../.h200}" && pwd); T0=$(date +%s)
WHAT=${1:-all}; BUDGET=${2:-570}; BW_PP=${BW_PP:-2}  # the blockwise job's PP (beside that shape)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 + $1 )) -lt "$BUDGET" ]; }
pack() { tar czf "$OUT"/mlm_gpu.tar.gz -C /tmp mlm; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  "$H"/tecore/*.whl "$H"/transformer_engine-2.20.2-py3-none-any.whl "$H"/mc19/megatron_core-0.19.2-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 "$H"/pydantic-*.whl \
  "$H"/pydantic_core-*.whl "$H"/annotated_types-*.whl "$H"/typing_inspection-*.whl \
  "$H"/omegaconf-*.whl "$H"/antlr4_python3_runtime-*.whl || exit 1
# pydantic needs a recent typing_extensions: the spare one only where the image's is too old
PYTHONPATH=/tmp/site3 python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q \
  --no-index --no-deps --target /tmp/site3 "$H"/spare/typing_extensions-*.whl
python3 -c "import yaml" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site3 .whl/PyYAML-*.whl
gunzip -c "$H"/libte_sm90.so.gz > /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so
echo "libtransformer_engine.so sha256 want $(cat "$H"/libte_sm90.sha256) got $(sha256sum /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so | cut -c1-64)"
EXT=transformer_engine_torch.cpython-312-x86_64-linux-gnu.so
if [ -f "$H"/te_torch_ext.so.gz ]; then
  gunzip -c "$H"/te_torch_ext.so.gz > /tmp/site/transformer_engine/wheel_lib/$EXT; el "TE extension from the bundle"
else
  (mkdir -p /tmp/tebuild && tar xzf "$H"/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild &&
   cd /tmp/tebuild/transformer_engine_torch-2.20.2 &&
   PYTHONPATH=/tmp/site MAX_JOBS=16 NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch \
     python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site2 . &&
   cp /tmp/site2/transformer_engine/wheel_lib/$EXT /tmp/site/transformer_engine/wheel_lib/ &&
   echo TE_BUILD_OK) > /tmp/mlm/te_build.log 2>&1
  el "TE extension build: $(tail -1 /tmp/mlm/te_build.log)"
  gzip -c /tmp/site/transformer_engine/wheel_lib/$EXT > "$OUT"/te_torch_ext.so.gz  # for a later call
fi
export PYTHONPATH=/tmp/site:/tmp/site3:$REPO
python3 -c "import torch, transformer_engine as t, transformer_engine.pytorch, megatron.core as m, megatron.training; print('torch', torch.__version__, 'TE', t.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && el "MPS daemon started"
if [ "$WHAT" = resume ]; then
  for pp in 2 4; do
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / pp)) timeout -k 10 150 python3 validation/megatron_lm_gpu.py \
      --pp $pp --resume 3 --resume-only --out /tmp/mlm/resume_pp$pp > /tmp/mlm/resume_pp$pp.log 2>&1 &
  done
  wait; el "resume checks done"
  grep -hE "^\[(PASS|FAIL)\]|^SUMMARY" /tmp/mlm/resume_pp2.log /tmp/mlm/resume_pp4.log | cut -c1-900
  pack; WHAT=none
fi
if [ "$WHAT" != bench ] && [ "$WHAT" != none ]; then
  el "start checks PP=2 and PP=4"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout -k 10 200 python3 validation/megatron_lm_gpu.py --pp 2 \
    --resume 3 --fault capture_on_one_rank --out /tmp/mlm/checks_pp2 > /tmp/mlm/checks_pp2.log 2>&1 &
  P2=$!
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 timeout -k 10 200 python3 validation/megatron_lm_gpu.py --pp 4 \
    --resume 3 --fault capture_on_one_rank --out /tmp/mlm/checks_pp4 > /tmp/mlm/checks_pp4.log 2>&1 &
  P4=$!
  wait $P2; el "checks PP=2 rc=$?"; wait $P4; el "checks PP=4 rc=$?"
  grep -hE "^\[(PASS|FAIL)\]|^SUMMARY" /tmp/mlm/checks_pp2.log /tmp/mlm/checks_pp4.log | cut -c1-900
  grep -hE "Error|error" /tmp/mlm/checks_pp4.log | grep -v Warning | head -5 | cut -c1-600
  pack
fi
bench() {  # name, seconds it needs (estimate), args...: skipped unless that much of BUDGET is
  local name=$1 need=$2 rest; shift 2  # left; stopped at the end of BUDGET in any case
  rest=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$rest" -ge "$need" ] || { el "SKIPPED $name (needs ~$need s, $rest s left)"; return; }
  el "start $name"
  timeout -k 10 "$rest" python3 benchmarks/megatron_lm_step_time.py --out /tmp/mlm/"$name" \
    --results /tmp/mlm/"$name".md "$@" > /tmp/mlm/"$name".log 2>&1
  el "end $name rc=$?"; grep -E "^\| |Problems" /tmp/mlm/"$name".md 2>/dev/null | head -30
  tail -4 /tmp/mlm/"$name".log | cut -c1-600; pack
}
if [ "$WHAT" != checks ] && [ "$WHAT" != none ]; then
  SHAPE="--hidden 2048 --heads 16 --micro-batch-size 1 --steps-per-segment 12 --rounds 5"
  for job in ${JOBS:-pp4 pp2 blockwise}; do
    case $job in
      pp4) CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 bench step_time_pp4 125 --pp 4 $SHAPE --time-budget 0;;
      pp2) CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 bench step_time_pp2 95 --pp 2 $SHAPE --time-budget 0;;
      blockwise)  # its rounds get what is left (at least 2, fewer than 5 where they would not fit)
        REST=$(( BUDGET - ($(date +%s) - T0) - 45 ))  # the job's start and warm-up take ~40 s
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / BW_PP)) bench step_time_pp${BW_PP}_blockwise 70 \
          --pp "$BW_PP" $SHAPE --time-budget "$REST" --fp8-recipe blockwise --transposes te;;
      *) el "unknown job $job (JOBS: pp4 pp2 blockwise)";;
    esac
  done
fi
echo quit | nvidia-cuda-mps-control
pack; el done
