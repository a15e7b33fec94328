"""The multi-GPU step-time benchmark script, run on CPU/gloo so it keeps working without GPUs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_step_time_cpu_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_step_time.py"), "--device", "cpu",
         "--spawn", "2", "--pp", "2", "--vp", "2", "--microbatches", "4", "--seq", "16",
         "--hidden", "64", "--heads", "4", "--vocab", "128", "--layers-per-chunk", "1",
         "--steps", "2", "--warmup", "1", "--out", str(tmp_path), "--name", "smoke"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "smoke.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| off") or
            line.startswith("| lazy") or line.startswith("| aligned")]
    assert len(rows) == 3 and all(row.rstrip().endswith("| OK |") for row in rows), report
    data = json.loads((tmp_path / "smoke.json").read_text())
    aligned = data["aligned"]
    assert {len(r["step_ms"]) for r in aligned} == {2}
    # Under aligned every (chunk, slot, aligned_slot) has slot == aligned_slot on both ranks.
    assert all(s == a for r in aligned for _, s, a in r["slots"]) and aligned[0]["slots"]
    lazy_slots = {(r["pp_rank"], c, s) for r in data["lazy"] for c, s, _ in r["slots"]}
    assert (1, 1, 3) in lazy_slots  # lazy: pp rank 1 builds chunk 1 one slot late
