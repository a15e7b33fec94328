"""benchmarks/planner_calibration.py: the results file is what the script prints from the
recorded runs (nobody edits a verdict by hand), and its fit / held-out split is the one written
down before tuning (benchmarks/planner_calibration_split.md)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import planner_calibration as cal  # noqa: E402
from nemo_fp8_align.planner.measured import SHARED_GPU_SLOWDOWN  # noqa: E402

_LOCAL = "\n## Megatron-LM loop on the GPU"  # depends on another helper's worktree: not compared


def test_results_file_is_what_the_script_prints(tmp_path):
    out = tmp_path / "cal.md"
    assert cal.main(["--out", str(out)]) == 0
    made = out.read_text().split(_LOCAL)[0]
    kept = (ROOT / "benchmarks/results/planner_calibration.md").read_text().split(_LOCAL)[0]
    assert made.replace(f" --out {out}", "") == kept


def test_the_split_is_the_one_decided_before_tuning():
    runs = {p.stem for p in cal.RUNS.glob("*.json")}
    assert set(cal.FIT) | set(cal.HELD_OUT) == runs and not set(cal.FIT) & set(cal.HELD_OUT)
    written = (ROOT / "benchmarks/planner_calibration_split.md").read_text()
    fit = re.search(r"\*\*Fit \(1 run, 2 shapes\): `(\w+)`", written).group(1)
    held = re.search(r"\*\*Held out \(5 runs, 10 shapes\):\*\* (.*?)\n- ", written, re.S).group(1)
    assert (fit,) == cal.FIT and set(re.findall(r"`(\w+)`", held)) == set(cal.HELD_OUT)
    assert abs(cal.fit_slowdown() - SHARED_GPU_SLOWDOWN) < 1e-9  # the default the planner ships
