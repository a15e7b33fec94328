"""NeMo 2 (``nemo.lightning``) with ``FP8TransposeAlignNeMo2``, on the CPU over gloo.

Real ``nl.Trainer`` + ``MegatronStrategy`` fits (:mod:`support.nemo2_fit`): a small
megatron-core GPT, PP=2 x VP=2 on 2 ranks, megatron-core DDP with the distributed optimizer,
``overlap_param_gather`` and ``align_param_gather``, GEMMs on reference FP8 weights, 3 steps,
with NeMo 2's own ``MegatronCommOverlapCallback`` (as NeMo's recipes add it; it rewrites the DDP
overlap flags at setup, here passed ``overlap_param_gather=True, align_param_gather=True``):

- aligned (validating after every step: forward-only schedules with the plugin attached; and
  saving a checkpoint mid-fit after step 2: ``MegatronStrategy.save_checkpoint`` forces every
  chunk's all-gather while the plugin is attached), off, lazy;
- the aligned slots equal on every pipeline rank, every chunk, every step; the judge goes red
  on the lazy run (the alignment removed: each rank at its own first use);
- losses bit-identical to off;
- a one-rank fault (rank 1's transposes raise in step 2) stops both ranks with the plugin's
  error; a new process resumed from the step-2 checkpoint runs step 3 with the same loss and
  aligned slots;
- the startup check on real ``MegatronStrategy`` / ``MegatronMixedPrecision`` /
  ``DistributedDataParallelConfig`` objects (:mod:`support.nemo2_check`), and in a fit where
  ``MegatronCommOverlapCallback()``'s defaults turn the overlap flags off (one data-parallel
  rank): every rank raises, naming that callback's arguments.

``nemo.lightning`` needs ``fiddle`` and ``nvidia-resiliency-ext`` beyond what NeMo 1.x needs;
they are looked for in the environment and in ``.venv/nemo2-deps`` (``pip install --target``).
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPS = os.environ.get("NEMO_FP8_ALIGN_NEMO2_DEPS", os.path.join(ROOT, ".venv", "nemo2-deps"))
PP, VP, STEPS = 2, 2, 3
#: MegatronCommOverlapCallback(overlap_param_gather=True, align_param_gather=True)
COMM_OVERLAP = ["--comm-overlap", "gather"]

pytestmark = [pytest.mark.nemo, pytest.mark.slow]


def _pythonpath():
    """PYTHONPATH for the NeMo 2 processes; skips where ``nemo.lightning`` cannot import."""
    if importlib.util.find_spec("nemo") is None:
        pytest.skip("needs nemo_toolkit 2.3.3")
    extra = [DEPS] if os.path.isdir(os.path.join(DEPS, "fiddle")) else []
    if not extra and importlib.util.find_spec("fiddle") is None:
        pytest.skip(f"nemo.lightning needs fiddle and nvidia-resiliency-ext (not installed, "
                    f"nor in {DEPS})")
    return os.pathsep.join(extra + [ROOT, os.path.join(ROOT, "tests")])


def fit(out, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(PP), "-m", "support.nemo2_fit", str(out), *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
        cwd=os.path.join(ROOT, "tests"))
    return proc


def losses(out):
    path = os.path.join(out, "loss.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def records(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "telemetry.rank*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def judge(rows, steps):
    """Problems with the alignment in ``rows`` ([] when every chunk of every pipeline rank
    built its transposes exactly once per step, at the aligned slot, after its all-gather,
    and the aligned slot of a chunk is the same on every rank)."""
    problems = []
    for step in steps:
        for chunk in range(VP):
            slots = set()
            for pp_rank in range(PP):
                mine = [r for r in rows if (r["step"], r["pp_rank"], r["chunk"])
                        == (step, pp_rank, chunk)]
                where = f"step {step}, pipeline rank {pp_rank}, chunk {chunk}"
                if len(mine) != 1:
                    problems.append(f"{where}: {len(mine)} records, expected exactly 1")
                    continue
                r = mine[0]
                slots.add(r["aligned_slot"])
                if r["slot"] != r["aligned_slot"]:
                    problems.append(f"{where}: built at slot {r['slot']}, aligned slot is "
                                    f"{r['aligned_slot']}")
                if not r["after_all_gather"] or r["transposed"] != r["weights"] \
                        or r["weights"] == 0:
                    problems.append(f"{where}: {r['transposed']} of {r['weights']} built, "
                                    f"after all-gather: {r['after_all_gather']}")
            if len(slots) > 1:
                problems.append(f"step {step}, chunk {chunk}: aligned slots differ across "
                                f"pipeline ranks: {sorted(slots)}")
    return problems


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("nemo2")
    out = {}
    for name, args in (("aligned", ["--policy", "aligned", "--save-at", "2", "--val-every", "1"]),
                       ("off", ["--policy", "off"]), ("lazy", ["--policy", "lazy"])):
        proc = fit(base / name, *args, *COMM_OVERLAP, "--steps", str(STEPS))
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:],
                                      _errors(base / name))
        out[name] = base / name
    return out


def _errors(out):
    return {os.path.basename(p): open(p).read()[-2000:]
            for p in glob.glob(os.path.join(out, "error.rank*.txt"))}


def test_aligned_slots_equal_on_every_pipeline_rank(runs):
    rows = records(runs["aligned"])
    assert {r["policy"] for r in rows} == {"aligned"}
    assert {(r["pp_rank"], r["pp_size"]) for r in rows} == {(0, PP), (1, PP)}
    assert judge(rows, range(STEPS)) == []
    # T_c - r: chunk 1 built before the forward that precedes its first use on rank 1
    assert {(r["pp_rank"], r["chunk"], r["vmid"]) for r in rows} == {
        (0, 0, -1), (0, 1, 2), (1, 0, -1), (1, 1, 1)}


def test_the_slot_judge_goes_red_without_the_alignment(runs):
    """The lazy run (the plugin observing only: each rank builds at its own first use) is what
    a run without the alignment looks like: the judge names rank 1's late slots."""
    problems = judge(records(runs["lazy"]), range(STEPS))
    assert any("pipeline rank 1, chunk 0: built at slot 1, aligned slot is 0" in p
               for p in problems), problems
    assert any("pipeline rank 1, chunk 1: built at slot 3, aligned slot is 2" in p
               for p in problems), problems
    assert not any("pipeline rank 0" in p for p in problems), problems


def test_losses_bit_identical_to_off(runs):
    aligned, off = losses(runs["aligned"]), losses(runs["off"])
    assert sorted(off) == list(range(1, STEPS + 1))
    assert aligned == off  # exact: float.hex
    assert losses(runs["lazy"]) == off


def test_validation_between_steps_leaves_the_steps_aligned(runs):
    """NeMo 2's validation runs the schedule forward-only (megatron-core sets param_sync_func
    to None for it, DDP's pre-hooks gather at first use): not a training step for the plugin.
    The aligned run validated after every step; its slots and losses are checked above."""
    for rank in range(PP):
        with open(runs["aligned"] / f"val.rank{rank}.jsonl") as f:
            after = [json.loads(line)["after_step"] for line in f]
        assert after == list(range(1, STEPS + 1))
    assert not glob.glob(os.path.join(runs["off"], "val.rank*.jsonl"))


def test_policy_off_is_inert(runs):
    assert records(runs["off"]) == []
    assert not glob.glob(os.path.join(runs["off"], "telemetry.rank*.jsonl"))


def test_checkpoint_mid_fit_then_resume(runs, tmp_path):
    """The aligned run saved after step 2 through MegatronStrategy.save_checkpoint (its
    force_param_sync ran with the plugin attached; the losses after it matched off above). A
    new process resumes from it: step 3 has the uninterrupted run's loss, bit for bit, and
    its transposes at the aligned slots, numbered by the resumed global step."""
    ckpt = runs["aligned"] / "ckpt"
    assert ckpt.is_dir()
    proc = fit(tmp_path / "resume", "--policy", "aligned", "--steps", str(STEPS),
               "--resume", str(ckpt), *COMM_OVERLAP)
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-3000:],
                                  _errors(tmp_path / "resume"))
    assert losses(tmp_path / "resume") == {STEPS: losses(runs["off"])[STEPS]}
    rows = records(tmp_path / "resume")
    assert {r["step"] for r in rows} == {STEPS - 1}
    assert judge(rows, [STEPS - 1]) == []
    first = {r["run"] for r in records(runs["aligned"])}
    assert not first & {r["run"] for r in rows}  # a new process's records


def test_a_one_rank_fault_stops_every_rank(tmp_path):
    """Rank 1's transposes raise inside step 2's schedule: both ranks finish the step's
    communication and stop at its end with the plugin's error (rank 1 its own, rank 0 naming
    rank 1's); no rank hangs, step 2's loss is never written."""
    out = tmp_path / "fault"
    proc = fit(out, "--policy", "aligned", "--fault-rank", "1", "--fault-step", "1",
               "--steps", str(STEPS))
    assert proc.returncode != 0
    errors = _errors(out)
    assert sorted(errors) == ["error.rank0.txt", "error.rank1.txt"], proc.stderr[-3000:]
    assert "injected fault: rank 1, step 1" in errors["error.rank1.txt"]
    assert "this rank only" in errors["error.rank1.txt"]
    assert "stopped this training step on all 2 ranks" in errors["error.rank0.txt"]
    assert "rank 1 (pipeline rank 1, data-parallel rank 0, step 1): RuntimeError: injected " \
           "fault" in errors["error.rank0.txt"]
    assert sorted(losses(out)) == [1]


def test_startup_check_names_every_violation_in_nemo2_spelling():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
    proc = subprocess.run([sys.executable, "-m", "support.nemo2_check"], env=env,
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=os.path.join(ROOT, "tests"))
    line = [x for x in proc.stdout.splitlines() if x.startswith("NEMO2_CHECK ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[0][len("NEMO2_CHECK "):])
    assert got["good"] == [] and got["reference_bf16"] == []
    fixes = ["MegatronStrategy(pipeline_model_parallel_size=2)",
             "MegatronStrategy(virtual_pipeline_model_parallel_size=2)",
             "OptimizerConfig(use_distributed_optimizer=True)",
             "DistributedDataParallelConfig(overlap_param_gather=True)",
             "DistributedDataParallelConfig(align_param_gather=True)",
             "MegatronMixedPrecision(fp8='hybrid')",
             "MegatronMixedPrecision(fp8_param_gather=True)"]
    assert len(got["all_wrong"]) == len(fixes)
    for violation, fix in zip(got["all_wrong"], fixes):
        assert f"Fix: {fix}" in violation
    assert len(got["pytorch_ddp"]) == 1
    assert "MegatronStrategy(ddp=DistributedDataParallelConfig(" in got["pytorch_ddp"][0]
    assert [("MegatronCommOverlapCallback(overlap_param_gather=True)" in v,
             "MegatronCommOverlapCallback(align_param_gather=True)" in v)
            for v in got["comm_overlap"]] == [(True, False), (False, True)]
    raised = got["callback_raises"]
    assert raised["type"] == "NeMo2ConfigError"
    assert raised["message"].startswith("7 NeMo 2 setting(s) stop")
    assert got["callback_off_inert"] == {"aligner": False}
    assert got["policy_off_inert"] == {"aligner": False}


def test_comm_overlap_defaults_stop_every_rank_at_train_start(tmp_path):
    """MegatronCommOverlapCallback() with one data-parallel rank sets overlap_param_gather and
    align_param_gather False at its setup, after the user's DistributedDataParallelConfig: the
    check runs on what the DDP chunks were built with, on every rank, before any step."""
    out = tmp_path / "defaults"
    proc = fit(out, "--policy", "aligned", "--comm-overlap", "default", "--steps", "1")
    assert proc.returncode != 0
    errors = _errors(out)
    assert sorted(errors) == ["error.rank0.txt", "error.rank1.txt"], proc.stderr[-3000:]
    for text in errors.values():
        assert "NeMo2ConfigError: 2 NeMo 2 setting(s) stop" in text
        assert "MegatronCommOverlapCallback(overlap_param_gather=True)" in text
        assert "MegatronCommOverlapCallback(align_param_gather=True)" in text
    assert losses(out) == {} and records(out) == []
