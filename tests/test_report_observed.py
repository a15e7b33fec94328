"""``report`` on telemetry with the schedule shape and the observed builds (a real demo run,
PP=2 VP=2 DP=2 M=4, 3 steps, 4 ranks): each case of issue 17 that used to pass now fails with
its reason, a misplaced build is caught from observed evidence alone, and the A/B summary."""

import json
from pathlib import Path

import pytest

from nemo_fp8_align.cli import main

DATA = Path(__file__).parent / "data"
ALIGNED = DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl"
LAZY = DATA / "telemetry_observed_pp2_vp2_dp2_lazy.jsonl"
#: demo --fault slot_shift_unreported: pp rank 1 builds chunk 1 one forward late, while its
#: records report the planned slot (as a cluster's records would: the aligner's counter is the plan)
MISPLACED = DATA / "telemetry_observed_pp2_vp2_dp2_slot_shift_unreported.jsonl"


def _rows(path=ALIGNED):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _report(capsys, *argv):
    code = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_real_runs_pass(capsys):
    for path in (ALIGNED, LAZY):
        code, out, err = _report(capsys, path)
        assert code == 0, err
        assert "schedule: PP=2 VP=2 DP=2 M=4 N=2, world size 4" in out


def test_one_record_deleted(tmp_path, capsys):
    rows = _rows()
    gone = rows.pop(5)
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 1
    assert (f"missing record: step {gone['step']} chunk {gone['chunk']} pp rank "
            f"{gone['pp_rank']} dp rank {gone['dp_rank']}") in out


def test_pp_rank_1_last_step_deleted(tmp_path, capsys):
    rows = [r for r in _rows() if not (r["pp_rank"] == 1 and r["step"] == 2)]
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 1
    for chunk in (0, 1):
        for dp in (0, 1):
            assert f"missing record: step 2 chunk {chunk} pp rank 1 dp rank {dp}" in out


def test_only_rank_0s_file(tmp_path, capsys):
    rows = [r for r in _rows() if r["rank"] == 0]
    code, out, err = _report(capsys, _write(tmp_path, rows, "t.rank0.jsonl"))
    assert code == 1
    assert "3 of 4 global ranks wrote no records (ranks 1, 2, 3)" in out
    assert "pipeline rank 1 wrote no records" in out
    assert "data-parallel rank 1 wrote no records" in out


def test_pp_rank_1_slot_and_aligned_slot_rewritten(tmp_path, capsys):
    rows = _rows()
    for r in rows:
        if r["pp_rank"] == 1:
            r["slot"] = r["aligned_slot"] = 1
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 1
    assert "step 0 chunk 0: ranks disagree on the aligned slot: slot 0 by pp/dp ranks 0/0, 0/1; " \
           "slot 1 by pp/dp ranks 1/0, 1/1" in out
    assert "aligned slot 1, but PP=2 VP=2 M=4 N=2 put the chunk's first forward at slot 0" in out


def test_misplaced_build_is_caught_from_observed_evidence(capsys):
    rows = _rows(MISPLACED)
    late = [r for r in rows if r["pp_rank"] == 1 and r["chunk"] == 1]
    assert {r["slot"] for r in late} == {2} and {r["obs_slot"] for r in late} == {3}
    code, out, err = _report(capsys, MISPLACED)
    assert code == 1
    assert "r0:[2] r1:[3]" in out  # the observed column shows it, the reported one cannot
    assert ("step 0 chunk 1 pp rank 1 dp rank 0: observed built before forward 2 of this rank's "
            "step (slot 3); aligned means before forward 1 of this rank's step (slot 2)") in out
    assert "transposes at slot" not in out  # the reported slot is the plan: only obs_* tell


def test_observed_build_twice_or_never(tmp_path, capsys):
    rows = _rows()
    rows[0]["obs_built"] = 8
    rows[1]["obs_built"], rows[1]["obs_at"], rows[1]["obs_slot"] = 0, [], None
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 1
    assert "observed 8 transpose builds of 4 FP8 weights" in out
    assert "observed 0 transpose builds of 4 FP8 weights in the step (expected each built " \
           "exactly once, none seen before the chunk's first use)" in out


def test_a_chunk_without_fp8_weights_is_valid(tmp_path, capsys):
    rows = _rows()
    for r in rows:
        if r["chunk"] == 0:  # first_last_layers_bf16 with tensorwise: nothing to transpose
            r.update(weights=0, valid=0, transposed=0, obs_built=0, obs_at=[], obs_slot=None)
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 0, err
    assert "0/0" in out


def test_rank_template_expands(tmp_path, capsys):
    rows = _rows()
    for rank in range(4):
        _write(tmp_path, [r for r in rows if r["rank"] == rank], f"telemetry.rank{rank}.jsonl")
    code, out, _ = _report(capsys, tmp_path / "telemetry.rank{rank}.jsonl")
    assert code == 0 and out.startswith("24 records")
    (tmp_path / "telemetry.rank3.jsonl").unlink()
    code, out, err = _report(capsys, tmp_path / "telemetry.rank{rank}.jsonl")
    assert code == 1 and "1 of 4 global ranks wrote no records (ranks 3)" in out


def _no_matplotlib(monkeypatch):
    import nemo_fp8_align.planner.gantt as gantt

    def refuse():
        raise ImportError("--plot needs matplotlib: pip install matplotlib")
    monkeypatch.setattr(gantt, "require_matplotlib", refuse)


def test_plot_failure_never_hides_a_failed_verdict(tmp_path, capsys, monkeypatch):
    _no_matplotlib(monkeypatch)
    code, out, err = _report(capsys, MISPLACED, "--plot", tmp_path / "s.png")
    assert code == 1  # the verdict, not the picture's exit 2
    assert "observed built" in out and "needs matplotlib" in err


def test_plot_failure_after_an_ok_verdict_is_exit_2(tmp_path, capsys, monkeypatch):
    _no_matplotlib(monkeypatch)
    code, out, err = _report(capsys, ALIGNED, "--plot", tmp_path / "s.png")
    assert code == 2
    assert "OK: every record" in out and "needs matplotlib" in err


def test_plot_draws_the_observed_slots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, _ = _report(capsys, MISPLACED, "--plot", tmp_path / "s.png")
    assert code == 1 and (tmp_path / "s.png").stat().st_size > 1000
    assert f"wrote {tmp_path / 's.png'}" in out


def test_baseline_prints_an_ab_summary(capsys):
    code, out, _ = _report(capsys, ALIGNED, "--baseline", LAZY)
    assert code == 0
    assert "A/B: A = this run (policy aligned, 24 records), B = baseline (policy lazy, 24 records)" in out
    chunk1 = next(line for line in out.split("A/B:")[1].splitlines() if line.startswith("1 "))
    assert chunk1.split()[1:4] == ["0", "/", "1"]  # slot skew: aligned 0, lazy PP-1
    assert "B's verdict: OK" in out


def test_baseline_problems_fail(tmp_path, capsys):
    rows = _rows(LAZY)[1:]
    code, out, err = _report(capsys, ALIGNED, "--baseline", _write(tmp_path, rows))
    assert code == 1 and "FAILED: baseline: missing record" in out


#: NeMo 2.3.3's MegatronStrategy fit on one H100 (PP=2 VP=2 DP=1 M=4, 4 steps, TE 2.20.2
#: Float8Tensor weights, FP8TransposeAlignNeMo2; benchmarks/results/frameworks_gpu.md): at step 0
#: fp8_model_init's weights carry valid transposes, so nothing is built or observed there.
NEMO2_GPU = DATA / "telemetry_nemo2_h100_te_pp2_vp2_aligned.jsonl"


def test_a_real_te_runs_first_step_with_nothing_stale_is_named_not_observed(capsys):
    code, out, err = _report(capsys, str(NEMO2_GPU))
    assert code == 0, err
    assert "step 0 as built (each run's first step found every transpose valid" in out


def test_the_same_record_later_in_the_run_is_a_stale_transpose_flagged_valid(capsys, tmp_path):
    """Step 2 made to look like step 0 (valid, none built, none observed): mid-run the weights
    changed at the optimizer step, so a transpose no one built is stale however it is flagged."""
    rows = _rows(NEMO2_GPU)
    for r in rows:
        if r["step"] == 2:
            r.update(transposed=0, obs_built=0, obs_at=[], obs_slot=None)
    code, out, err = _report(capsys, _write(tmp_path, rows))
    assert code == 1, out
    assert "step 2 chunk 0 pp rank 0 dp rank 0: observed 0 transpose builds of 4 FP8 weights" \
        in out + err
