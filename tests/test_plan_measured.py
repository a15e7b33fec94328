"""The planner calibrated with measured durations (issue 27 item 3): per-(rank, chunk) costs,
the host wait at a chunk's first forward and the shared-GPU slowdown inside planner/simulate.py,
``plan --measured-*-ms`` / ``--ranks-share-gpu`` / ``--format json``, and the errors naming the
flag."""

import json
import sys
import types
from pathlib import Path

import pytest

from nemo_fp8_align.cli import main
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner import ChunkCosts, Costs, Placement, simulate
from nemo_fp8_align.planner.measured import SHARED_GPU_SLOWDOWN, measured_costs

ROOT = Path(__file__).resolve().parents[1]
S = InterleavedSchedule(4, 2, 8)
# the MPS benchmark's model (benchmarks/results/pipeline_step_time_mps_h200.md): 1 layer per chunk
MPS_SHAPE = ["--layers", "8", "--hidden", "4096", "--heads", "32", "--ffn", "16384", "--seq",
             "1024", "--tp", "1", "--pp", "4", "--vp", "2", "--micro-batch", "2",
             "--global-batch", "16", "--no-overlap-p2p-comm", "--no-batch-p2p-comm"]


def _steps(costs, schedule=S):
    return {p: simulate(schedule, p, costs).step_time for p in (Placement.NONE, Placement.LAZY,
                                                                 Placement.ALIGNED)}


def test_uniform_per_chunk_table_is_the_uniform_model():
    uniform = Costs(forward=4.0, backward=10.0, transpose=3.0, p2p=0.3)
    table = measured_costs(Costs(forward=1.0, backward=1.0), 4, 2,
                           {"forward": [4e3], "backward": [1e4], "transpose": [3e3]}, p2p_ms=300)
    assert table.per_chunk is not None
    assert _steps(table) == pytest.approx(_steps(uniform))


def test_a_heavier_chunk_on_one_rank_is_its_own():
    # the first stage's chunk 0 carries the embedding: only its forwards take longer
    rows = [[ChunkCosts(1.0, 2.0) for _ in range(2)] for _ in range(4)]
    rows[0][0] = ChunkCosts(1.5, 2.0)
    tl = simulate(S, Placement.NONE, Costs(1.0, 2.0, per_chunk=tuple(map(tuple, rows))))
    assert {i.end - i.start for i in tl.of_kind("forward", 0) if i.chunk == 0} == {1.5}
    assert {i.end - i.start for i in tl.of_kind("forward", 1)} == {1.0}
    assert tl.step_time > simulate(S, Placement.NONE, Costs(1.0, 2.0)).step_time
    with pytest.raises(ValueError, match="PP=4 ranks of VP=2 chunks"):
        simulate(S, Placement.NONE, Costs(1.0, 2.0, per_chunk=tuple(map(tuple, rows[:3]))))


def test_lazy_transposes_fill_the_first_forwards_host_wait():
    hidden = _steps(Costs(1.0, 2.0, transpose=0.1, host_wait=0.3))
    assert hidden[Placement.LAZY] == pytest.approx(hidden[Placement.NONE])  # max(0.1, 0.3)
    assert hidden[Placement.ALIGNED] > hidden[Placement.NONE]  # at its slot, on top of the wait
    longer = _steps(Costs(1.0, 2.0, transpose=0.5, host_wait=0.3))
    # the lazy first forward costs max(delta, wait) = 0.5: 0.2 more than the wait on each
    base = _steps(Costs(1.0, 2.0, host_wait=0.3))[Placement.NONE]
    assert longer[Placement.LAZY] == pytest.approx(
        base + (_steps(Costs(1.0, 2.0, transpose=0.2))[Placement.LAZY]
                - _steps(Costs(1.0, 2.0))[Placement.NONE]))
    tl = simulate(S, Placement.NONE, Costs(1.0, 2.0, host_wait=0.3))
    assert len(tl.of_kind("host_wait")) == S.pp * S.vp  # once per chunk per rank per step


def test_ranks_sharing_a_gpu_slow_only_the_transposes_built_at_once():
    alone, shared = Costs(1.0, 2.0, transpose=0.1), Costs(1.0, 2.0, transpose=0.1,
                                                           shared_gpu_slowdown=1.5)
    for placement, factor in ((Placement.ALIGNED, 1.5), (Placement.LAZY, 1.0)):
        spans = {round(i.end - i.start, 9)
                 for i in simulate(S, placement, shared).of_kind("transpose")}
        assert spans == {round(0.1 * factor, 9)}, placement
    assert simulate(S, Placement.ALIGNED, shared).step_time > \
        simulate(S, Placement.ALIGNED, alone).step_time


def _recorded(name="call2_mcore0192_pp4.json", impl="torch"):
    data = json.loads((ROOT / "benchmarks/results/pipeline_step_time_mps_h200" / name).read_text())
    cfg = next(c for c in data["configs"] if c["transposes"] == impl)
    cells = [cfg["per_rank_costs"][f"r{r}c{c}"] for r in range(4) for c in range(2)]
    return data, cfg, cells


def _csv(cells, key):
    return ",".join(f"{max(0.0, x[key]):.6f}" for x in cells)


def test_plan_json_with_measured_durations_is_the_benchmarks_model(capsys):
    """plan's --measured-* flags and the MPS benchmark's analysis give the same prediction for
    a recorded run (one model: planner/simulate.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mps_analysis

    data, cfg, cells = _recorded()
    p2p = cfg["saving"]["planner_inputs_ms"]["p2p"]
    assert main(["plan", *MPS_SHAPE, "--format", "json",
                 "--measured-forward-ms", _csv(cells, "forward"),
                 "--measured-backward-ms", _csv(cells, "backward"),
                 "--measured-transpose-ms", _csv(cells, "transpose"),
                 "--measured-host-wait-ms", _csv(cells, "first_extra"),
                 "--measured-p2p-ms", f"{p2p:.6f}", "--ranks-share-gpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    costs = {(r, c): {k: round(max(0.0, v), 6) if k == "first_extra" else round(v, 6)
                      for k, v in cells[r * 2 + c].items()} for r in range(4) for c in range(2)}
    ref = mps_analysis.predict_per_rank(types.SimpleNamespace(**data["bench"]), costs,
                                        round(p2p, 6), True, SHARED_GPU_SLOWDOWN)
    assert out["saving_ms"] == pytest.approx(ref["lazy"] - ref["aligned"], abs=2e-6)
    assert out["step_ms"]["lazy"] == pytest.approx(ref["lazy"], abs=2e-6)
    assert out["saving_ms"] == pytest.approx(out["step_ms"]["lazy"] - out["step_ms"]["aligned"], abs=2e-6)
    assert out["policy_step_ms"] == {"off": out["step_ms"]["lazy"], "lazy": out["step_ms"]["lazy"],
                                     "aligned": out["step_ms"]["aligned"]}
    assert out["per_rank_chunk"] and out["shared_gpu_slowdown"] == pytest.approx(1.1304, abs=1e-4)
    # without the host wait the saving is the per-rank model's, larger (the MPS table: 20.9 ms)
    assert main(["plan", *MPS_SHAPE, "--format", "json",
                 "--measured-forward-ms", _csv(cells, "forward"),
                 "--measured-backward-ms", _csv(cells, "backward"),
                 "--measured-transpose-ms", _csv(cells, "transpose"),
                 "--measured-p2p-ms", f"{p2p:.6f}"]) == 0
    assert json.loads(capsys.readouterr().out)["saving_ms"] == pytest.approx(20.888, abs=0.01)


def test_measured_values_replace_the_derived_ones(capsys):
    assert main(["plan", *MPS_SHAPE, "--measured-forward-ms", "5", "--measured-p2p-ms", "0.25",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)["per_chunk_ms"]
    assert out["forward"] == pytest.approx(5.0) and out["p2p"] == pytest.approx(0.25)
    assert out["backward"] != pytest.approx(10.0)  # still derived from the sizes
    assert main(["plan", *MPS_SHAPE, "--measured-forward-ms", "5"]) == 0
    assert "measured (replacing the derived durations): --measured-forward-ms" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--measured-forward-ms", "0"], "--measured-forward-ms 0: must be > 0"),
    (["--measured-backward-ms", "-1"], "--measured-backward-ms -1: must be > 0"),
    (["--measured-transpose-ms", "-0.1"], "--measured-transpose-ms -0.1: must be >= 0"),
    (["--measured-host-wait-ms", "nan"], "--measured-host-wait-ms nan: must be >= 0"),
    (["--measured-p2p-ms", "-2"], "--measured-p2p-ms -2: must be >= 0"),
    (["--measured-p2p-ms", "inf"], "--measured-p2p-ms inf: must be >= 0"),
    (["--measured-forward-ms", "1,2,3"], "--measured-forward-ms: 3 values; give one"),
    (["--measured-forward-ms", "4.5ms"], "--measured-forward-ms '4.5ms': expected milliseconds"),
    (["--shared-gpu-slowdown", "1.2"], "without --ranks-share-gpu"),
    (["--ranks-share-gpu", "--shared-gpu-slowdown", "0.5"], "--shared-gpu-slowdown 0.5: must be >= 1"),
])
def test_bad_measured_values_name_the_flag(argv, needle, capsys):
    assert main(["plan", *MPS_SHAPE, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
