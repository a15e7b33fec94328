"""The one-GPU MPS step-time benchmark (benchmarks/pipeline_step_time_mps.py): its planner
comparison, its argument checks, and its CPU dry run (gloo), so it keeps working without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mps_analysis  # noqa: E402


class _B:
    pp, vp, microbatches = 4, 2, 8


def _uniform(f=4.0, b=10.0, t=3.0, extra=0.0):
    return {(r, c): {"forward": f, "backward": b, "transpose": t, "first_extra": extra}
            for r in range(_B.pp) for c in range(_B.vp)}


def test_per_rank_prediction_equals_planner_for_uniform_costs():
    plain = mps_analysis.predict(4, 2, 8, 4.0, 10.0, 3.0, 0.3)
    per_rank = mps_analysis.predict_per_rank(_B, _uniform(), 0.3, host_overlap=False)
    assert per_rank == pytest.approx(plain, abs=1e-9)
    assert plain["lazy"] > plain["aligned"] > plain["none"]


def test_host_wait_longer_than_the_transposes_hides_the_lazy_ones():
    pred = mps_analysis.predict_per_rank(_B, _uniform(t=1.0, extra=2.0), 0.3, host_overlap=True)
    assert pred["lazy"] == pytest.approx(pred["none"])  # lazy builds fill the host wait
    assert pred["aligned"] > pred["none"]  # aligned builds run at their slot, on top of it
    slower = mps_analysis.predict_per_rank(_B, _uniform(t=1.0, extra=0.0), 0.3, host_overlap=True)
    assert slower["lazy"] > slower["none"]


def test_rounds_rotate_and_bad_arguments_are_refused():
    import pipeline_step_time_mps as bench

    b = bench.bench_of(bench.parse(["--out", "x", "--transposes", "te,torch"]))
    assert b.segments(0)[0] == ("off", "te") and b.segments(1)[0] == ("lazy", "te")
    assert sorted(b.segments(0)) == sorted(b.segments(5))
    with pytest.raises(SystemExit):
        bench.bench_of(bench.parse(["--out", "x", "--policies", "off,eager"]))
    with pytest.raises(SystemExit):
        bench.bench_of(bench.parse(["--out", "x", "--discard", "12"]))


@pytest.mark.slow
def test_cpu_dry_run(tmp_path):
    pytest.importorskip("megatron.core")
    import inspect

    from megatron.core.models.gpt import GPTModel

    if "vp_stage" not in inspect.signature(GPTModel.__init__).parameters:
        # The harness builds chunks the way megatron-core >= 0.14 does (GPTModel(vp_stage=c));
        # make test runs this file on 0.16.1 and 0.19.2 too.
        pytest.skip("the real-stack harness needs megatron-core >= 0.14 (GPTModel vp_stage)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_step_time_mps.py"), "--cpu-dry-run",
         "--pp", "2", "--vp", "2", "--microbatches", "4", "--hidden", "64", "--heads", "4",
         "--seq", "16", "--micro-batch-size", "1", "--rounds", "2", "--steps-per-segment", "3",
         "--discard", "1", "--warmup", "1", "--gpu-only-steps", "2", "--out", str(tmp_path),
         "--name", "dry"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (cfg,) = summary["configs"]
    assert {p: g["step"]["n"] for p, g in cfg["groups"].items()} == \
        {"off": 4, "lazy": 4, "aligned": 4}  # 2 rounds x (3 steps - 1 discarded)
    assert set(cfg["saving"]["paired_per_round_ms"]) >= {"min", "median", "max"}
    # the gpu-only segment (after the rounds, never in a policy's figures) gives every rank and
    # chunk a host and a GPU time per call: the two-clock planner's inputs
    two = cfg["two_clock_costs"]
    assert sorted(two) == ["r0c0", "r0c1", "r1c0", "r1c1"]
    assert all(v[k] > 0 for v in two.values() for k in ("forward_host", "forward_gpu",
                                                          "backward_host", "backward_gpu"))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    calib = [s for s in rank0["segments"] if s["policy"] == "gpu_only"]
    assert len(calib) == 1 and len(calib[0]["rows"]) == 2
    assert len(calib[0]["rows"][0]["host_forward"]) == len(calib[0]["rows"][0]["forward"]) == 8
    text = (tmp_path / "dry.md").read_text()
    assert "| aligned | 4 |" in text and "Observed placement" in text
    assert "Host and GPU time per call" in text
