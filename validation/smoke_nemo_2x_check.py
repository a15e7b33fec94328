"""Checks of validation/smoke_nemo_2x.sh's runs (NeMo 2.0-2.2 on the CPU): the aligned and stock
runs' telemetry passes record_problems with one record per step, chunk and rank (3 steps x 2
chunks x 4 ranks); their losses equal the plugin-off run's bit for bit; the fault run's differ;
the off run wrote no telemetry. Prints the losses; exit status 1 when a check fails.

    python validation/smoke_nemo_2x_check.py RUN_DIR
"""

import csv
import glob
import json
import os
import sys

from nemo_fp8_align.core.telemetry import record_problems

RECORDS = 3 * 2 * 4


def losses(run_dir):
    """The example's LossReport (loss.jsonl), else Lightning's CSV logger (the stock flow)."""
    report = os.path.join(run_dir, "loss.jsonl")
    if os.path.exists(report):
        return [json.loads(line)["loss"] for line in open(report)]
    for path in glob.glob(os.path.join(run_dir, "exp", "**", "metrics.csv"), recursive=True):
        found = [float(r["reduced_train_loss"]) for r in csv.DictReader(open(path))
                 if r.get("reduced_train_loss")]
        if found:
            return found
    return None


def records(run_dir):
    rows = [json.loads(line) for path in sorted(glob.glob(os.path.join(run_dir, "telemetry.rank*")))
            for line in open(path)]
    return [r for r in rows if "chunk" in r]


def main(out):
    runs = {name: os.path.join(out, name) for name in ("aligned", "stock", "off", "fault")
            if os.path.isdir(os.path.join(out, name))}
    failures = []
    got = {name: losses(path) for name, path in runs.items()}
    for name, values in got.items():
        print(f"losses  {name}: {values}")
    for name in ("aligned", "stock"):
        if name in runs:
            recs = records(runs[name])
            problems = record_problems(recs)
            if problems or len(recs) != RECORDS:
                failures.append(f"{name}: {len(recs)} records (want {RECORDS}); {problems[:3]}")
            if got[name] is None or got[name] != got.get("off"):
                failures.append(f"{name}: losses {got[name]} differ from off {got.get('off')}")
    if records(runs["off"]):
        failures.append("off: the plugin off wrote telemetry")
    if "fault" in runs and (got["fault"] is None or got["fault"] == got["off"]):
        failures.append("fault: its losses equal off's, so a stale transpose would not show")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
