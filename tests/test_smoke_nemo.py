"""The CI smoke run of the NeMo integration (scripts/smoke_nemo.sh).

``test_smoke_nemo``: real NeMo 2.3.3 MegatronGPTModel on CPU, 2 gloo processes, PP=2, VP=2,
mcore_distributed_optim, 3 steps, three runs (mixin, callback, plugin off): under a minute on
2 cores. The other tests feed the script's checks made-up runs (``SMOKE_NEMO_CHECK_ONLY=1``) to
show that they fail when a transpose is misplaced, missing or repeated, or a loss differs.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "smoke_nemo.sh")
LOSSES = [8.367643356323242, 8.349407196044922, 8.36095142364502]


def run_script(out_dir, check_only, timeout):
    env = dict(os.environ, PYTHON=sys.executable, SMOKE_DIR=str(out_dir),
               SMOKE_NEMO_CHECK_ONLY="1" if check_only else "0")
    return subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def record(step, pp_rank, chunk):
    aligned = 2 * chunk  # PP=2, VP=2, M=4: T_0 = 0, T_1 = 2
    vmid = -1 if chunk == 0 else aligned - pp_rank
    return {"step": step, "pp_rank": pp_rank, "dp_rank": 0, "chunk": chunk, "policy": "aligned",
            "backend": "reference", "vmid": vmid, "slot": aligned, "aligned_slot": aligned,
            "transposed": 4, "weights": 4, "after_all_gather": True, "seconds": 0.001}


def write_runs(tmp_path, mutate=None):
    for name in ("aligned", "callback", "off"):
        run = tmp_path / name
        run.mkdir()
        with open(run / "loss.jsonl", "w") as f:
            for i, loss in enumerate(LOSSES):
                f.write(json.dumps({"step": i + 1, "loss": loss}) + "\n")
        if name == "off":
            continue
        for pp_rank in (0, 1):
            rows = [record(s, pp_rank, c) for s in range(3) for c in (0, 1)]
            if mutate and name == "aligned":
                rows = mutate(pp_rank, rows)
            with open(run / f"telemetry.rank{pp_rank}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def test_checks_pass_on_good_runs(tmp_path):
    write_runs(tmp_path)
    out = run_script(tmp_path, check_only=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "r0:[2] r1:[2]" in out.stdout


def misplace(pp_rank, rows):
    if pp_rank == 1:
        rows[1] = dict(rows[1], vmid=2, slot=3)  # chunk 1 at its own first forward: lazy
    return rows


def repeat(pp_rank, rows):
    return rows + rows[:1]


def lose_last_chunk(pp_rank, rows):
    return [r for r in rows if r["chunk"] == 0]


def before_all_gather(pp_rank, rows):
    return [dict(r, after_all_gather=False) if r["chunk"] == 1 else r for r in rows]


@pytest.mark.parametrize("mutate, message", [
    (misplace, "aligned slot is 2"),
    (repeat, "expected exactly 1"),
    (lose_last_chunk, "no transposes recorded"),
    (before_all_gather, "before the chunk's all-gather finished"),
], ids=["misplaced", "twice", "last-chunk-missing", "before-all-gather"])
def test_checks_fail_on_bad_telemetry(tmp_path, mutate, message):
    write_runs(tmp_path, mutate)
    out = run_script(tmp_path, check_only=True, timeout=120)
    assert out.returncode != 0 and message in out.stdout, out.stdout + out.stderr


def test_checks_fail_when_losses_differ(tmp_path):
    write_runs(tmp_path)
    with open(tmp_path / "off" / "loss.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 8.3}) + "\n")
    out = run_script(tmp_path, check_only=True, timeout=120)
    assert out.returncode != 0 and "losses differ" in out.stdout


@pytest.mark.nemo
@pytest.mark.slow
def test_smoke_nemo(tmp_path):
    pytest.importorskip("nemo.collections.nlp.models.language_modeling.megatron_gpt_model",
                        reason="needs nemo_toolkit 2.3.3 (MegatronGPTModel)")
    out = run_script(tmp_path, check_only=False, timeout=480)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "smoke_nemo: OK" in out.stdout
    for run in ("aligned", "callback"):
        assert f"Alignment report, run '{run}'" in out.stdout
