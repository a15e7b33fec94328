#!/usr/bin/env bash
# NeMo 2.0.0 / 2.1.0 / 2.2.1 (NeMo 1.x MegatronGPTModel) on the CPU with the megatron-core of
# their NeMo Framework containers (24.09: 0.9.0, 24.12: 0.10.0, 25.02: 0.11.0): the CPU smoke
# run's model and overrides, 3 steps, four runs of 4 gloo processes each (by hand, not in CI:
# ~3 minutes per version on 2 cores; results in benchmarks/results/nemo_2x_cpu.md):
#   aligned  examples/megatron_gpt_pretraining.py, the mixin (2.1/2.2 only: the example's
#            LossReport is a lightning.pytorch callback, NeMo 2.0's Trainer pytorch_lightning's);
#   stock    NeMo's stock flow with the plugin through its Lightning entry point;
#   off      the plugin off (2.0: the stock flow with policy=off);
#   fault    the plugin's all-gather wait removed: its losses must differ (2.1/2.2).
# Without the smoke run's checkpoint save/resume: on the CPU these megatron-core versions fail to
# save torch Adam's per-parameter step (see the results file).
# Nothing is installed into .venv: the wheels' nemo/ and megatron/core/ are unpacked under
# .nemo2x/ and put ahead of .venv's on PYTHONPATH, with the packages these versions import and
# .venv lacks (pip install --no-deps --target .nemo2x/deps).
#   validation/smoke_nemo_2x.sh 2.1.0 0.10.0      # NeMo version, megatron-core version
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NEMO="$1"; MCORE="$2"
PY="$ROOT/.venv/bin/python"; PIP=("$ROOT/.venv/bin/pip" -q --disable-pip-version-check)
CACHE="$ROOT/.nemo2x"; OUT="${SMOKE_DIR:-$(mktemp -d -t nemo2x.XXXXXX)}"
mkdir -p "$CACHE"
if [ ! -d "$CACHE/nemo-$NEMO/nemo" ]; then
  "${PIP[@]}" download --no-deps --only-binary=:all: "nemo_toolkit==$NEMO" -d "$CACHE"
  unzip -q -o "$CACHE"/nemo_toolkit-"$NEMO"-*.whl 'nemo/*' -d "$CACHE/nemo-$NEMO"
fi
if [ ! -d "$CACHE/mcore-$MCORE/megatron" ]; then
  "${PIP[@]}" download --no-deps --only-binary=:all: "megatron-core==$MCORE" -d "$CACHE"
  unzip -q -o "$CACHE"/megatron_core-"$MCORE"-*.whl 'megatron/core/*' -d "$CACHE/mcore-$MCORE"
fi
if [ ! -f "$CACHE/deps/.installed" ]; then
  "${PIP[@]}" install --no-deps --target "$CACHE/deps" h5py faiss-cpu tensorstore 'zarr<3' \
    'numcodecs<0.16' asciitree fasteners deprecated
  touch "$CACHE/deps/.installed"
fi
LIBS="$CACHE/nemo-$NEMO:$CACHE/mcore-$MCORE:$CACHE/deps"
echo "smoke_nemo_2x: NeMo $NEMO + megatron-core $MCORE; runs in $OUT"

run() {  # run <name> <faults> <python args...>
  local name="$1" faults="$2"; shift 2
  local pypath="$ROOT:$ROOT/tests:$LIBS" start=$SECONDS
  [ -n "$faults" ] && pypath="$ROOT/tests/smoke_faults:$pypath"
  mkdir -p "$OUT/$name"
  if ! PATH="$ROOT/.venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH="$pypath" \
      NEMO_FP8_ALIGN_SMOKE_FAULTS="$faults" "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node 4 "$@" trainer.accelerator=cpu trainer.devices=4 trainer.max_steps=3 \
      "hydra.run.dir=$OUT/$name/hydra" > "$OUT/$name/log.txt" 2>&1; then
    echo "smoke_nemo_2x: run '$name' failed; last lines of $OUT/$name/log.txt:" >&2
    tail -n 30 "$OUT/$name/log.txt" >&2
    exit 1
  fi
  echo "smoke_nemo_2x: run '$name' finished in $((SECONDS - start)) s"
}
telemetry() {
  echo "model.fp8_transpose_align.telemetry_path=\"$OUT/$1/telemetry.rank{rank}.jsonl\""
}
example() {  # example <name> <faults> <overrides...>
  local name="$1" faults="$2"; shift 2
  run "$name" "$faults" "$ROOT/examples/megatron_gpt_pretraining.py" \
    --config-name megatron_gpt_cpu_smoke "exp_manager.exp_dir=$OUT/$name/exp" \
    "report_dir=$OUT/$name" "$(telemetry "$name")" "$@"
}
stock() {  # stock <name> <policy> <overrides...>
  local name="$1" policy="$2"; shift 2
  run "$name" "" -m support.run_nemo_cpu "$ROOT/examples/stock_megatron_gpt_pretraining.py" \
    --config-name megatron_gpt_cpu trainer.logger=true "+trainer.default_root_dir=$OUT/$name/exp" \
    exp_manager.name=null "+model.fp8_transpose_align.policy=$policy" "+$(telemetry "$name")" "$@"
}

if [[ "$NEMO" == 2.0.* ]]; then
  # NeMo 2.0 takes DDP's overlap_param_gather from this key (2.1 on: overlap_param_sync).
  EXTRA=(+model.optim.overlap_param_gather=true)
  stock stock aligned "${EXTRA[@]}"
  stock off off "${EXTRA[@]}"
else
  example aligned deferred_all_gather model.fp8_transpose_align.policy=aligned
  stock stock aligned
  example off deferred_all_gather model.fp8_transpose_align.enabled=false
  example fault deferred_all_gather,no_wait,unchecked model.fp8_transpose_align.policy=aligned
fi
"$PY" "$ROOT/validation/smoke_nemo_2x_check.py" "$OUT"
