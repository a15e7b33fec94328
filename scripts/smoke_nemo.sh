#!/usr/bin/env bash
# CPU smoke run of the NeMo integration (CI): NeMo 2.3.3 MegatronGPTModel + FP8TransposeAlignMixin,
# 2 gloo processes, PP=2, VP=2, mcore_distributed_optim, mock data, 3 steps, through
# examples/megatron_gpt_pretraining.py and conf/megatron_gpt_cpu_smoke.yaml.
#
#   (each run: 3 training steps and one validation pass at step 2, which must trigger nothing)
#   1. plugin on  (policy=aligned, FP8TransposeAlignMixin): prints the alignment report, checks it;
#   2. plugin on through the FP8TransposeAlignment callback on a plain MegatronGPTModel: the same
#      checks, and the same slots as run 1;
#   3. plugin off (enabled=false): same data, same seed; losses must equal runs 1 and 2 bit for bit.
#
# With SMOKE_NEMO_DP2=1 also (4 processes, about 45 s more): PP=2 x DP=2 x VP=2, plugin on and
# off, hidden sizes multiples of 128 (megatron-core 0.12.3's shared-embedding bucket bug stops
# DP=2 otherwise; see nemo_fp8_align.nemo.mixin.shared_embedding_bucket_workaround).
#
# Exit status is non-zero when a run fails or a check does not hold. Usage:
#   scripts/smoke_nemo.sh [extra Hydra overrides...]
# Environment: PYTHON (default: python on PATH), SMOKE_DIR (default: a fresh temp dir),
# SMOKE_NEMO_DP2 (default 0), SMOKE_NEMO_CHECK_ONLY=1 (no runs: report on and check the runs
# already in SMOKE_DIR; the tests use it to prove the checks fail when they should).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${SMOKE_DIR:-$(mktemp -d -t nemo_fp8_align_smoke.XXXXXX)}"
mkdir -p "$OUT"
CHECK_ONLY="${SMOKE_NEMO_CHECK_ONLY:-0}"
if [ "$CHECK_ONLY" != "1" ]; then
  rm -rf "$OUT"/{aligned,callback,off,dp2,dp2_off}  # a reused SMOKE_DIR must not feed old runs
fi
echo "smoke_nemo: runs, logs and telemetry in $OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2 processes on 2 cores

NPROC=2
run() {  # run <name> <overrides...>
  local name="$1"; shift
  local dir="$OUT/$name"
  rm -rf "$dir"; mkdir -p "$dir"
  local start=$SECONDS
  if ! "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
      "$ROOT/examples/megatron_gpt_pretraining.py" --config-name megatron_gpt_cpu_smoke \
      trainer.accelerator=cpu trainer.devices="$NPROC" trainer.max_steps=3 \
      "exp_manager.exp_dir=$dir/exp" "hydra.run.dir=$dir/hydra" "report_dir=$dir" "$@" \
      > "$dir/log.txt" 2>&1; then
    echo "smoke_nemo: run '$name' failed; last lines of $dir/log.txt:" >&2
    tail -n 40 "$dir/log.txt" >&2
    exit 1
  fi
  echo "smoke_nemo: run '$name' finished in $((SECONDS - start)) s"
}

if [ "$CHECK_ONLY" != "1" ]; then
  run aligned "model.fp8_transpose_align.policy=aligned" \
    "model.fp8_transpose_align.telemetry_path=\"$OUT/aligned/telemetry.rank{rank}.jsonl\"" "$@"
  run callback fp8_align_via=callback "model.fp8_transpose_align.policy=aligned" \
    "model.fp8_transpose_align.telemetry_path=\"$OUT/callback/telemetry.rank{rank}.jsonl\"" "$@"
  run off "model.fp8_transpose_align.enabled=false" \
    "model.fp8_transpose_align.telemetry_path=\"$OUT/off/telemetry.rank{rank}.jsonl\"" "$@"
  if [ "${SMOKE_NEMO_DP2:-0}" = "1" ]; then
    NPROC=4
    DP2=(model.global_batch_size=8 model.hidden_size=128 model.ffn_hidden_size=512)
    run dp2 "${DP2[@]}" "model.fp8_transpose_align.policy=aligned" \
      "model.fp8_transpose_align.telemetry_path=\"$OUT/dp2/telemetry.rank{rank}.jsonl\"" "$@"
    run dp2_off "${DP2[@]}" "model.fp8_transpose_align.enabled=false" "$@"
  fi
fi

"$PYTHON" - "$OUT" <<'EOF'
"""Alignment report of the 'aligned' run, and the checks that make the smoke run fail."""
import glob
import json
import math
import os
import sys
from collections import defaultdict

from nemo_fp8_align.engine.telemetry import read_records, record_problems

out = sys.argv[1]
errors = []

def losses(name):
    path = os.path.join(out, name, "loss.jsonl")
    if not os.path.exists(path):
        errors.append(f"{name}: no loss report at {path}")
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

def records(name):
    return read_records(glob.glob(os.path.join(out, name, "telemetry.rank*.jsonl")))

def report(name, rows):
    steps = sorted({r["step"] for r in rows})
    chunks = sorted({r["chunk"] for r in rows})
    ranks = sorted({r["pp_rank"] for r in rows})
    print("\nAlignment report, run '%s' (policy=aligned, PP=%d, VP=%d, %d steps, backend %s)" % (
        name, len(ranks), len(chunks), len(steps), rows[0]["backend"] if rows else "?"))
    print("%-6s %-12s %-28s %-22s %s" % ("chunk", "aligned slot", "slot per pp rank (all steps)",
                                         "transposes per step", "after all-gather"))
    for c in chunks:
        mine = [r for r in rows if r["chunk"] == c]
        slots = {p: sorted({r["slot"] for r in mine if r["pp_rank"] == p}) for p in ranks}
        per_step = defaultdict(int)
        for r in mine:
            per_step[r["step"]] += r["transposed"]
        aligned = sorted({r["aligned_slot"] for r in mine})
        print("%-6d %-12s %-28s %-22s %s" % (
            c, aligned, " ".join(f"r{p}:{s}" for p, s in slots.items()),
            " ".join(str(per_step[s]) for s in steps), all(r["after_all_gather"] for r in mine)))
    check(name, rows, steps, chunks, ranks)


def check(name, rows, steps, chunks, ranks):
    if len(steps) < 3:
        errors.append(f"{name}: telemetry covers {len(steps)} steps, expected >= 3")
    if len(ranks) != 2 or len(chunks) != 2:
        errors.append(f"{name}: telemetry has pp ranks {ranks} and chunks {chunks}, expected "
                      "2 and 2")
    errors.extend(f"{name}: {problem}" for problem in record_problems(rows, policy="aligned"))
    seen = {(r["step"], r["chunk"], r["pp_rank"]) for r in rows}
    # The smoke config's shape (PP=2, VP=2), not what the telemetry happens to contain.
    expected = {(s, c, p) for s in steps for c in range(2) for p in range(2)}
    missing = expected - seen
    if missing:
        errors.append(f"{name}: no transposes recorded for (step, chunk, pp rank) "
                      f"{sorted(missing)}")


def placement(rows):
    return sorted((r["step"], r["chunk"], r["pp_rank"], r["vmid"], r["slot"], r["transposed"])
                  for r in rows)


mixin_rows, callback_rows = records("aligned"), records("callback")
report("aligned", mixin_rows)
report("callback", callback_rows)
if placement(mixin_rows) != placement(callback_rows):
    errors.append("the callback run placed transposes differently from the mixin run")
if records("off"):
    errors.append("plugin disabled but telemetry was written")
dp2 = os.path.isdir(os.path.join(out, "dp2"))
if dp2:
    dp2_rows = records("dp2")
    report("dp2", dp2_rows)
    if sorted({r["dp_rank"] for r in dp2_rows}) != [0, 1]:
        errors.append("dp2: telemetry does not come from data-parallel ranks 0 and 1")

runs = {name: losses(name) for name in ("aligned", "callback", "off")}
for name, rows in runs.items():
    print("losses  %-9s %s" % (name + ":", [r["loss"] for r in rows]))
    if len(rows) < 3 or not all(math.isfinite(r["loss"]) for r in rows):
        errors.append(f"{name}: {len(rows)} finite step losses reported, expected >= 3")
for name in ("aligned", "callback"):
    if runs[name] != runs["off"]:
        errors.append(f"losses differ between run '{name}' and the plugin-off run")
if dp2:
    on2, off2 = losses("dp2"), losses("dp2_off")
    print("losses  dp2:      %s\nlosses  dp2_off:  %s" % ([r["loss"] for r in on2],
                                                         [r["loss"] for r in off2]))
    if len(on2) < 3 or on2 != off2:
        errors.append("dp2: losses differ with the plugin on and off (or fewer than 3 steps)")

if errors:
    print("\nsmoke_nemo: FAILED")
    for e in errors:
        print("  - " + e)
    sys.exit(1)
print("\nsmoke_nemo: OK (mixin and callback: every chunk's transposes at its aligned slot on "
      "every pipeline rank, once per step, after its all-gather; losses identical with the "
      "plugin off)")
EOF
