#!/bin/bash
# One device call for issue 20: install Transformer Engine 2.20.2 (core library stripped to sm_90,
# validation/strip_fatbin.py), megatron-core 0.19.2 and 0.16.1 from .h200/ (carried), build TE's
# PyTorch extension, start CUDA MPS, and run benchmarks/pipeline_step_time_mps.py per
# configuration while time is left. Results (Markdown + JSON per run) under $OUT.
# Usage (from a copy of the repo whose parent holds .h200/, e.g. .gpuwork/repo):
#   bash validation/run_step_time_mps.sh [BUDGET_SECONDS] [first|second|round2a|round2b|round2c|round3a|round3b|round4a|round4b|round5a|round5b]
# round5a/round5b need 4 GPUs (a GPU per pipeline rank, no MPS); never run yet.
# .h200/ is made on the CPU machine as validation/run_real_stack.sh's header says, but with only
# transformer-engine-cu13 (library stripped, gzipped), transformer-engine, pydantic,
# pydantic-core, annotated-types, typing-inspection, megatron-core 0.19.2 (.h200/) and 0.16.1
# (.h200/m16/), and transformer_engine_torch-2.20.2.tar.gz (/work/shared/gpu).
# If .h200/te_torch_ext.so.gz exists (an extension built by an earlier call) it is used as is.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bench
REPO=$PWD; H=$(cd "${H200:-$REPO/../../.h200}" && pwd); T0=$(date +%s); BUDGET=${1:-560}
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { [ $(( $(date +%s) - T0 + $1 )) -lt "$BUDGET" ]; }  # true if $1 more seconds fit
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  "$H"/tecore/*.whl "$H"/transformer_engine-2.20.2-py3-none-any.whl || exit 1
# 0.19.2 at the top of .h200/ (this script's layout) or in mc19/ (run_megatron_lm_gpu.sh's); 0.16.1
# (m16/) only where a case needs it: round 2 runs 0.19.2 alone.
W19=$(ls "$H"/megatron_core-0.19.2-*.whl "$H"/mc19/megatron_core-0.19.2-*.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/m19 "$W19" || exit 1
if ls "$H"/m16/megatron_core-0.16.1-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/m16 "$H"/m16/megatron_core-0.16.1-*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 "$H"/pydantic-*.whl \
  "$H"/pydantic_core-*.whl "$H"/annotated_types-*.whl "$H"/typing_inspection-*.whl || exit 1
gunzip -c "$H"/libte_sm90.so.gz > /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so
echo "libtransformer_engine.so sha256 want $(cat "$H"/libte_sm90.sha256) got $(sha256sum /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so | cut -c1-64)"
EXT=transformer_engine_torch.cpython-312-x86_64-linux-gnu.so
if [ -f "$H"/te_torch_ext.so.gz ]; then
  gunzip -c "$H"/te_torch_ext.so.gz > /tmp/site/transformer_engine/wheel_lib/$EXT; el "TE extension from .h200"
else
  (mkdir -p /tmp/tebuild && tar xzf "$H"/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild &&
   cd /tmp/tebuild/transformer_engine_torch-2.20.2 &&
   PYTHONPATH=/tmp/site MAX_JOBS=16 NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch \
     python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site2 . &&
   cp /tmp/site2/transformer_engine/wheel_lib/$EXT /tmp/site/transformer_engine/wheel_lib/ &&
   echo TE_BUILD_OK) > /tmp/bench/te_build.log 2>&1
  el "TE extension build: $(tail -1 /tmp/bench/te_build.log)"
  gzip -c /tmp/site/transformer_engine/wheel_lib/$EXT > "$OUT"/te_torch_ext.so.gz  # for a later call
fi
CASE=${2:-first}
if [ "${CASE#round5}" = "$CASE" ]; then  # every case but round 5 shares one GPU under MPS
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && el "MPS daemon started"
else  # round 5: a GPU per rank, NCCL (NVLink multicast off, as the device tool asks)
  export NCCL_NVLS_ENABLE=0; el "no MPS: $(nvidia-smi -L | wc -l) GPUs"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
bench() {  # name, mcore dir, limit s, args...
  local name=$1 mc=$2 limit=$3; shift 3
  left "$limit" || { el "SKIPPED $name (needs $limit s)"; return; }
  el "start $name"
  PYTHONPATH=$mc:/tmp/site:/tmp/site3:$REPO timeout -k 10 "$limit" python3 \
    benchmarks/pipeline_step_time_mps.py --name "$name" --out /tmp/bench/"$name" "$@" \
    > /tmp/bench/"$name".log 2>&1
  el "end $name rc=$?"
  grep -E "^\| |^- (lazy|planner|p2p)|did not complete|Error|error" /tmp/bench/"$name".log | grep -v Warn | cut -c1-400 | head -30
  tar czf "$OUT"/bench.tar.gz -C /tmp bench 2>/dev/null  # what comes back even if cut short
}
COMMON="--vp 2 --microbatches 8 --hidden 4096 --heads 32 --seq 1024 --micro-batch-size 2 --transposes te,torch"
case $CASE in
first)  # 2026-12-03, call 1 (as run)
  bench mcore0192_pp2 /tmp/m19 170 --pp 2 $COMMON --warmup 3 --time-budget 100
  bench mcore0192_pp4 /tmp/m19 200 --pp 4 $COMMON --warmup 3 --time-budget 130
  bench mcore0161_pp2 /tmp/m16 150 --pp 2 $COMMON --warmup 3 --time-budget 100 --rounds 5
  bench mcore0161_pp4 /tmp/m16 170 --pp 4 $COMMON --warmup 3 --time-budget 100 --rounds 5;;
second)  # call 2: >= 50 timed steps per policy, PP=4 on both versions first
  bench mcore0192_pp4_r5 /tmp/m19 230 --pp 4 $COMMON --rounds 5
  bench mcore0161_pp4_r5 /tmp/m16 230 --pp 4 $COMMON --rounds 5
  bench mcore0192_pp2_r6 /tmp/m19 125 --pp 2 $COMMON --rounds 6;;
round2a)  # issue 27, round 2 (pre-registered in records/planner-calibration-round2.md), call 1
  R2="--heads 32 --seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5"
  bench round2_pp4_vp4 /tmp/m19 290 --pp 4 --vp 4 --microbatches 8 --hidden 4096 $R2 --time-budget 230
  bench round2_pp2_m16 /tmp/m19 200 --pp 2 --vp 2 --microbatches 16 --hidden 4096 $R2 --time-budget 150;;
round2b)  # issue 27, round 2, call 2
  bench round2_pp4_h6144 /tmp/m19 300 --pp 4 --vp 2 --microbatches 8 --hidden 6144 --heads 48 \
    --seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --time-budget 240;;
round2c)  # issue 27, round 2 retried on an H200 (2026-12-07; the amendment in
  # records/planner-calibration-round2.md): round2_pp4_vp4 as registered, then the PP=2 shape
  # again under its own name (the H100's 3-round run stays judged beside it)
  R2="--heads 32 --seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5"
  bench round2_pp4_vp4 /tmp/m19 290 --pp 4 --vp 4 --microbatches 8 --hidden 4096 $R2 --time-budget 230
  bench round2_pp2_m16_h200 /tmp/m19 200 --pp 2 --vp 2 --microbatches 16 --hidden 4096 $R2 --time-budget 150;;
round3a)  # issue 27, round 3 (pre-registered in records/planner-calibration-round3.md), call 1
  R3="--seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5"
  bench round3_pp4_vp4_h3072 /tmp/m19 250 --pp 4 --vp 4 --microbatches 8 --hidden 3072 --heads 24 $R3 --time-budget 200
  bench round3_pp4_h5120 /tmp/m19 280 --pp 4 --vp 2 --microbatches 8 --hidden 5120 --heads 40 $R3 --time-budget 225;;
round4a)  # issue 27, round 4 (pre-registered in records/planner-calibration-round4.md), call 1:
  # round 3's two unmeasured shapes, 3 rounds each (the time budgets), with the gpu-only segment
  R4="--seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --gpu-only-steps 3"
  bench round3_pp4_h5120 /tmp/m19 250 --pp 4 --vp 2 --microbatches 8 --hidden 5120 --heads 40 $R4 --time-budget 180
  bench round3_pp4_m12 /tmp/m19 290 --pp 4 --vp 2 --microbatches 12 --hidden 4096 --heads 32 $R4 --time-budget 235;;
round4b)  # issue 27, round 4, call 2
  bench round4_pp4_vp4_h2048 /tmp/m19 300 --pp 4 --vp 4 --microbatches 8 --hidden 2048 --heads 16 \
    --seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --gpu-only-steps 3 --time-budget 240;;
round5a)  # issue 27, round 5 (pre-registered in records/planner-calibration-round5.md): a GPU
  # per pipeline rank (4 GPUs), NCCL; rounds 3 and 4's shapes, call 1
  R5="--seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --p2p nccl"
  bench round5_pp4_vp4_h3072 /tmp/m19 280 --pp 4 --vp 4 --microbatches 8 --hidden 3072 --heads 24 $R5 --time-budget 220
  bench round5_pp4_h5120 /tmp/m19 280 --pp 4 --vp 2 --microbatches 8 --hidden 5120 --heads 40 $R5 --time-budget 220;;
round5b)  # issue 27, round 5, call 2
  R5="--seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --p2p nccl"
  bench round5_pp4_m12 /tmp/m19 280 --pp 4 --vp 2 --microbatches 12 --hidden 4096 --heads 32 $R5 --time-budget 220
  bench round5_pp4_vp4_h2048 /tmp/m19 280 --pp 4 --vp 4 --microbatches 8 --hidden 2048 --heads 16 $R5 --time-budget 220;;
round3b)  # issue 27, round 3, call 2
  bench round3_pp4_m12 /tmp/m19 300 --pp 4 --vp 2 --microbatches 12 --hidden 4096 --heads 32 \
    --seq 1024 --micro-batch-size 2 --transposes te,torch --rounds 5 --time-budget 245;;
esac
[ -n "$CUDA_MPS_PIPE_DIRECTORY" ] && echo quit | nvidia-cuda-mps-control
tar czf "$OUT"/bench.tar.gz -C /tmp bench 2>/dev/null
el "done"
