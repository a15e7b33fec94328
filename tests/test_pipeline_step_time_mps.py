"""The one-GPU MPS step-time benchmark (benchmarks/pipeline_step_time_mps.py): its planner
comparison, its argument checks, and its CPU dry run (gloo), so it keeps working without a GPU."""

import inspect
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


def _segment(policy, chunk_of, host_forward=None, span_forward=None, host_t1=0.2):
    """One segment of one rank (pp 2, vp 2, 4 microbatches) with one step: every forward 1 ms,
    backward 2 ms, each chunk's transposes 0.5 ms; host times 0.5 ms unless given."""
    n = len(chunk_of)
    row = {"forward": span_forward or [1.0] * n, "backward": [2.0] * n,
           "transpose_c0": [0.5], "transpose_c1": [0.5],
           "host_forward": host_forward or [0.5] * n, "host_backward": [0.5] * n,
           "host_transpose_c0": [0.2], "host_transpose_c1": [host_t1]}
    return {"policy": policy, "transposes": "te", "round": 0, "rows": [row], "backlog_ms": 15.0}


def test_gpu_times_leave_out_the_calls_past_the_backlog_cell_by_cell():
    from nemo_fp8_align.core.schedule import InterleavedSchedule

    class B:
        pp, vp, microbatches, transposes = 2, 2, 4, ("te",)

    sched = InterleavedSchedule(2, 2, 4)
    chunk_of = [sched.forward_table[v][1] for v in range(sched.total)]
    mine = [v for v, c in enumerate(chunk_of) if c == 0][:3]  # 3 of chunk 0's 4 forwards
    host = [20.0 if v in mine else 0.5 for v in range(len(chunk_of))]
    span = [30.0 if v in mine else 1.0 for v in range(len(chunk_of))]
    ranks = []
    for r in range(2):
        base = [_segment(p, chunk_of) for p in ("lazy", "aligned")]
        # rank 1: three forwards of chunk 0 waited for the host past the backlog (their spans
        # hold that wait); rank 0: every transpose of chunk 1 did
        gpu = (_segment("gpu_only", chunk_of, host, span) if r == 1
               else _segment("gpu_only", chunk_of, host_t1=16.0))
        ranks.append({"rank": r, "pp_rank": r, "segments": base + [gpu]})
    two = mps_analysis.two_clock_costs(B, ranks, "te", 0)
    assert two[(1, 0)]["forward_gpu"] == 1.0  # the 30 ms spans left out
    assert two[(1, 0)]["gpu_calls_dropped"] == pytest.approx(3 / 9)  # 4 F + 4 B + 1 T
    assert two[(0, 1)]["transpose_gpu"] is None and two[(0, 1)]["backlog_short"]
    assert [k for k, v in two.items() if v["backlog_short"]] == [(0, 1)]  # per cell, not pooled
    assert two[(0, 0)]["gpu_calls_dropped"] == 0.0 and two[(0, 0)]["transpose_gpu"] == 0.5


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
def _dry_run(tmp_path, *args):
    """The harness's CPU dry run (gloo) at PP=2 VP=2, 4 microbatches, a tiny GPT, 2 rounds."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import GPTModel

    if "vp_stage" not in inspect.signature(GPTModel.__init__).parameters:
        # The harness builds chunks the way megatron-core >= 0.14 does (GPTModel(vp_stage=c));
        # make test runs this file on 0.16.1 and 0.19.2 too.
        pytest.skip("the real-stack harness needs megatron-core >= 0.14 (GPTModel vp_stage)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_step_time_mps.py"), "--cpu-dry-run",
         "--pp", "2", "--vp", "2", "--microbatches", "4", "--hidden", "64", "--heads", "4",
         "--seq", "16", "--micro-batch-size", "1", "--rounds", "2", "--discard", "1",
         "--warmup", "1", "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cpu_dry_run(tmp_path):
    _dry_run(tmp_path, "--steps-per-segment", "3", "--gpu-only-steps", "2", "--name", "dry")
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
    assert rank0["backend"] == "mps_fast" and summary["p2p"]["mode"] == "host"


def test_cpu_dry_run_of_the_gpu_per_rank_mode(tmp_path):
    """``--p2p nccl`` (a GPU per rank, the cluster setup the planner models; never run on GPUs):
    plain process groups and megatron-core's own p2p, none of the MPS harness's groups."""
    _dry_run(tmp_path, "--p2p", "nccl", "--steps-per-segment", "2")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["p2p"]["mode"] == "nccl"
    assert {p: g["step"]["n"] for p, g in summary["configs"][0]["groups"].items()} == \
        {"off": 2, "lazy": 2, "aligned": 2}
    for r in range(2):
        rank = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rank["backend"] == "gloo" and rank["share_percent"] is None


def test_reanalyse_rebuilds_a_real_run_from_its_gzipped_rank_files(tmp_path):
    """Round 4's m12 run (one H100 split by MPS): the same figures from its rank files, and the
    gpu-only GPU times judged cell by cell (the run's own summary had one pooled flag)."""
    run = ROOT / "benchmarks" / "results" / "pipeline_step_time_mps_round4"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_step_time_mps.py"), "--reanalyse",
         str(run / "round3_pp4_m12.json"), "--ranks", str(run / "raw" / "round3_pp4_m12"),
         "--out", str(tmp_path), "--name", "m12"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    old = json.loads((run / "round3_pp4_m12.json").read_text())
    new = json.loads((tmp_path / "summary.json").read_text())
    for a, b in zip(old["configs"], new["configs"]):
        assert a["saving"]["paired_per_round_ms"] == pytest.approx(b["saving"]["paired_per_round_ms"])
        assert a["per_rank_costs"]["r3c1"] == pytest.approx(b["per_rank_costs"]["r3c1"])
        assert all(v["backlog_short"] for v in a["two_clock_costs"].values())  # pooled
        two = b["two_clock_costs"]
        assert not any(v["backlog_short"] for v in two.values())
        # the last stage's calls waited for the host past the backlog, the middle ones never
        assert two["r3c1"]["gpu_calls_dropped"] > 0.3 and two["r1c0"]["gpu_calls_dropped"] == 0
    assert "of gpu-only calls past the backlog" in (tmp_path / "m12.md").read_text()
