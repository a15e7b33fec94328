#!/usr/bin/env bash
# CPU smoke run of the NeMo integration (CI): NeMo 2.3.3 MegatronGPTModel, 4 gloo processes,
# PP=2 x DP=2, VP=2, mcore_distributed_optim, mock data, 3 steps and one validation pass each
# (six runs, about 9 minutes on 2 cores).
# The transformer layers' GEMMs read reference FP8 weights (forward on the FP8 data, data
# gradient on the cached FP8 transpose: support.reference_fp8_layers), and with
# DP=2 the all-gathers really change the parameter bytes, so a transpose built at the wrong time
# changes the loss.
#
#   1. aligned: examples/megatron_gpt_pretraining.py with FP8TransposeAlignMixin, policy=aligned;
#               it also saves NeMo's distributed checkpoint (exp_manager's checkpoint callback,
#               torch_dist format) at the validation after step 2, then trains step 3;
#   2. stock:   NeMo's stock flow (examples/stock_megatron_gpt_pretraining.py: MegatronGPTModel,
#               no mixin, no plugin code) on conf/megatron_gpt_cpu.yaml; the plugin comes in only
#               through its Lightning entry point, switched on by Hydra overrides alone; its
#               metrics go to Lightning's CSV logger;
#   3. lazy:    as 2 with policy=lazy (the A/B baseline: each rank at its first use, same losses,
#               the logger's slot skew PP-1);
#   4. off:     as 1 with enabled=false;
#   5. fault:   as 1 with the plugin's all-gather wait removed (tests/smoke_faults: no_wait) and
#               the GEMMs' provenance check off: the negative control. Its losses must DIFFER
#               from 'off', or the comparison below could not catch a stale transpose.
#   6. resume:  as 1, a new process resumed from 1's step-2 checkpoint the way a cluster job is
#               (exp_manager.resume_from_checkpoint: NeMo sets trainer.ckpt_path, as
#               resume_if_exists does with the newest '-last' one): trains step 3 only. (1
#               cannot serve resume_if_exists: NeMo's last checkpoint would be written at the
#               end of training, after step 3.)
# Runs 1, 4, 5 and 6 run with the all-gathers deferred to their wait (tests/smoke_faults:
# deferred_all_gather, a slow network), so early FP8 copies are stale deterministically.
#
# Checks: telemetry of 1, 2 (and 3, as lazy) judged by record_problems (aligned slot on every
# pipeline rank, after the all-gather, every weight once per step, timestamps in order) on every
# (step, chunk, pp rank, dp rank); 2 placed exactly as 1; the logger rows of 2 and 3 carry the
# gathered metrics; the losses of 1, 2 and 3 equal 4's bit for bit (1's with its checkpoint
# saved after step 2); 5's differ; 4 wrote no telemetry; 6 resumed from the step-2 checkpoint,
# its step-3 loss equals 4's bit for bit and its telemetry passes the same checks for step 3
# (placed as in 1, one record per chunk and rank: no hook doubled by the restore).
# With SMOKE_NEMO_DP1=1 also (2 processes): PP=2 DP=1 aligned vs lazy, sizes that trigger
# megatron-core 0.12.3's shared-embedding bucket bug, which the plugin works around only while
# active (with the plugin off NeMo itself stops there, so 'off' is no baseline at these sizes).
#
# Exit status is non-zero when a run fails or a check does not hold. Usage:
#   validation/smoke_nemo.sh [extra Hydra overrides for every run...]
# Environment: PYTHON (default: python on PATH), SMOKE_DIR (default: a fresh temp dir),
# SMOKE_NEMO_DP1 (default 0), SMOKE_NEMO_CHECK_ONLY=1 (no runs: report on and check the runs
# already in SMOKE_DIR; the tests use it to prove the checks fail when they should).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${SMOKE_DIR:-$(mktemp -d -t nemo_fp8_align_smoke.XXXXXX)}"
mkdir -p "$OUT"
CHECK_ONLY="${SMOKE_NEMO_CHECK_ONLY:-0}"
RUNS=(aligned stock lazy off fault resume dp1 dp1_lazy)
if [ "$CHECK_ONLY" != "1" ]; then
  for r in "${RUNS[@]}"; do rm -rf "${OUT:?}/$r"; done  # a reused SMOKE_DIR must not feed old runs
fi
echo "smoke_nemo: runs, logs and telemetry in $OUT"
# tests/ holds the CPU patches (support.run_nemo_cpu, support.cpu_nemo): test scaffolding,
# kept out of the installed package.
export PYTHONPATH="$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 4 processes on 2 cores

NPROC=4
FAULTS_DIR="$ROOT/tests/smoke_faults"
telemetry() { echo "model.fp8_transpose_align.telemetry_path=\"$OUT/$1/telemetry.rank{rank}.jsonl\""; }

launch() {  # launch <name> <faults> <python args...>
  local name="$1" faults="$2"; shift 2
  local dir="$OUT/$name" start=$SECONDS
  mkdir -p "$dir"
  local pypath="$PYTHONPATH"
  [ -n "$faults" ] && pypath="$FAULTS_DIR:$PYTHONPATH"
  if ! PYTHONPATH="$pypath" NEMO_FP8_ALIGN_SMOKE_FAULTS="$faults" "$PYTHON" \
      -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$@" \
      trainer.accelerator=cpu trainer.devices="$NPROC" trainer.max_steps=3 \
      "hydra.run.dir=$dir/hydra" > "$dir/log.txt" 2>&1; then
    # The launcher's summary fills the log's tail; the failing rank's own cause (a traceback, a
    # Hydra error, a C++ abort's "terminate called ... what():") comes before the launcher's
    # first "closing signal" / "failed (exitcode" line.
    local log="$dir/log.txt" first
    first="$(grep -n -m 1 -E "closing signal|failed \(exitcode" "$log" | cut -d: -f1 || true)"
    echo "smoke_nemo: run '$name' failed; the ranks' last lines in $log:" >&2
    head -n "$(( ${first:-1000000} - 1 ))" "$log" | tail -n 40 >&2
    echo "smoke_nemo: the launcher's summary:" >&2
    tail -n 25 "$log" >&2
    exit 1
  fi
  echo "smoke_nemo: run '$name' finished in $((SECONDS - start)) s"
}

stock() {  # stock <name> <policy> <overrides...>
  # NeMo's stock flow: no plugin in the script or the config, Hydra overrides only ('+': the
  # stock config has no such block). Lightning's CSV logger (no TensorBoard here) receives
  # NeMo's metrics and the plugin's; exp_manager then takes its directory from the logger.
  local name="$1" policy="$2"; shift 2
  launch "$name" "" -m support.run_nemo_cpu \
    "$ROOT/examples/stock_megatron_gpt_pretraining.py" --config-name megatron_gpt_cpu \
    trainer.logger=true "+trainer.default_root_dir=$OUT/$name/exp" exp_manager.name=null \
    "+model.fp8_transpose_align.policy=$policy" "+$(telemetry "$name")" "$@"
}

example() {  # example <name> <faults> <overrides...>: the project's example script
  local name="$1" faults="$2"; shift 2
  launch "$name" "$faults" "$ROOT/examples/megatron_gpt_pretraining.py" \
    --config-name megatron_gpt_cpu_smoke "exp_manager.exp_dir=$OUT/$name/exp" \
    "report_dir=$OUT/$name" "$@"
}

saved_checkpoint() {  # saved_checkpoint <run>: the step-2 checkpoint directory it wrote
  local found
  found="$(find "$OUT/$1/exp" -path '*/checkpoints/*' -type d -name '*-step=2-*' \
    ! -name '*unfinished*' | head -n 1)"
  if [ -z "$found" ]; then
    echo "smoke_nemo: run '$1' wrote no step-2 checkpoint under $OUT/$1/exp" >&2
    exit 1
  fi
  echo "$found"
}

if [ "$CHECK_ONLY" != "1" ]; then
  SAVING=(exp_manager.create_checkpoint_callback=true)
  example aligned deferred_all_gather "model.fp8_transpose_align.policy=aligned" \
    "$(telemetry aligned)" "${SAVING[@]}" "$@"
  CKPT="$(saved_checkpoint aligned)"
  example resume deferred_all_gather "model.fp8_transpose_align.policy=aligned" \
    "$(telemetry resume)" "${SAVING[@]}" "exp_manager.resume_from_checkpoint=\"$CKPT\"" "$@"
  stock stock aligned "$@"
  stock lazy lazy "$@"
  example off deferred_all_gather "model.fp8_transpose_align.enabled=false" \
    "$(telemetry off)" "$@"
  example fault deferred_all_gather,no_wait,unchecked "model.fp8_transpose_align.policy=aligned" \
    "$(telemetry fault)" "$@"
  if [ "${SMOKE_NEMO_DP1:-0}" = "1" ]; then
    NPROC=2
    DP1=(model.global_batch_size=4 model.hidden_size=32 model.ffn_hidden_size=64)
    example dp1 "" "${DP1[@]}" "model.fp8_transpose_align.policy=aligned" "$(telemetry dp1)" "$@"
    example dp1_lazy "" "${DP1[@]}" "model.fp8_transpose_align.policy=lazy" "$(telemetry dp1_lazy)" "$@"
  fi
fi

"$PYTHON" "$ROOT/validation/smoke_nemo_check.py" "$OUT"
