"""``demo --loop megatron-lm --device cuda``'s CPU-testable parts: the judge that reads Transformer
Engine's own transpose builds (demo/megatron_lm_gpu_judge.py) on builds placed where the
schedule says and where it does not, the GPU command line, and the CLI's refusals. The GPU run
itself is validation/megatron_lm_gpu.py (benchmarks/results/megatron_lm_loop_gpu.md). No
processes, no megatron-core import: well under a second."""

import pytest

from nemo_fp8_align.config import Policy
from nemo_fp8_align.core.observe import expected_position
from nemo_fp8_align.core.schedule import InterleavedSchedule
from lab.demo.megatron_lm_gpu import gpu_argv
from lab.demo.megatron_lm_gpu_judge import gpu_problems, observed_slots
from lab.demo.options import DemoOptions

OPTS = DemoOptions(pp=2, vp=2, microbatches=4, steps=3, device="cuda", policy=Policy.OFF)
SCHEDULE = InterleavedSchedule(2, 2, 4, None)
WEIGHTS = 2  # FP8 weights per chunk


def _forwards(step):
    """Forward i of a step runs over [100 step + i, 100 step + i + 0.5]."""
    return [[step, 100.0 * step + i, 100.0 * step + i + 0.5]
            for i in range(SCHEDULE.microbatches * SCHEDULE.vp)]


def _time_at(step, position):
    k, inside = position
    return 100.0 * step + k + (0.25 if inside else -0.25)


def _rank(pp_rank, policy, move=None, twice=False):
    """One rank's view: every weight built once per step where ``policy`` puts it; ``move``:
    (step, chunk) built one forward later; ``twice``: chunk 1's first weight built twice."""
    events, forwards = [], []
    for step in range(OPTS.steps):
        forwards += _forwards(step)
        for chunk in range(OPTS.vp):
            k, inside = expected_position(SCHEDULE, policy, pp_rank, chunk)
            if move == (step, chunk):
                k += 1
            for w in range(WEIGHTS + (1 if twice and chunk == 1 and step == 1 else 0)):
                events.append({"kind": "build", "weight": f"c{chunk}w{w % WEIGHTS}",
                               "chunk": chunk, "step": step, "phase": "fwd_bwd",
                               "t": _time_at(step, (k, inside))})
    return {"rank": pp_rank, "pp_rank": pp_rank, "events": events, "forwards": forwards,
            "weights": [WEIGHTS] * OPTS.vp, "weight_types": ["Float8Tensor"], "records": [],
            "first_use_valid": {}}


def test_builds_at_first_use_pass_with_the_plugin_off():
    assert gpu_problems(OPTS, [_rank(0, "lazy"), _rank(1, "lazy")]) == []


def test_a_build_away_from_first_use_is_named():
    problems = gpu_problems(OPTS, [_rank(0, "lazy"), _rank(1, "lazy", move=(2, 1))])
    assert problems == [f"rank 1 step 2 chunk 1: TE built the transposes at slot(s) "
                        f"[{SCHEDULE.first_vmid(1) + 2}]; off means "
                        f"{SCHEDULE.first_vmid(1) + 1}"]


def test_a_weight_built_twice_is_named():
    problems = gpu_problems(OPTS, [_rank(0, "lazy", twice=True), _rank(1, "lazy")])
    assert problems == ["rank 0 step 1 chunk 1: builds per weight {'c1w0': 2, 'c1w1': 1} "
                        "(expected each of 2 weights once)"]


def test_aligned_builds_stand_for_the_same_slot_on_every_rank():
    """Rank r builds before its forward T_c - r: the slot T_c on both ranks; one forward later
    on one rank is another slot there."""
    seen = [observed_slots(OPTS, _rank(r, "aligned")) for r in (0, 1)]
    assert seen[0] == seen[1]
    assert seen[0][(1, 1)] == {SCHEDULE.aligned_slot(1)}
    moved = observed_slots(OPTS, _rank(1, "aligned", move=(1, 1)))
    assert moved[(1, 1)] == {SCHEDULE.aligned_slot(1) + 1}


def test_builds_of_an_evaluation_before_the_step_count_once_or_twice():
    rank = _rank(0, "lazy")
    rank["events"].append({"kind": "build", "weight": "c0w0", "chunk": 0, "step": 1,
                           "phase": "eval", "t": 199.9})
    ok = gpu_problems(OPTS, [rank, _rank(1, "lazy")])
    assert ok == []
    rank["events"] = [e for e in rank["events"]
                      if not (e["step"] == 2 and e["chunk"] == 0 and e["weight"] == "c0w1")]
    assert gpu_problems(OPTS, [rank, _rank(1, "lazy")]) == [
        "rank 0 step 2 chunk 0: builds per weight {'c0w0': 1} in the step, {'c0w0': 1} before "
        "it (expected each of 2 weights once or twice in all)"]


def test_other_weights_than_te_float8_are_named():
    rank = _rank(0, "lazy")
    rank["weight_types"] = ["ReferenceFP8Weight"]
    assert gpu_problems(OPTS, [rank, _rank(1, "lazy")])[0].startswith(
        "FP8 weight types ['Float8Tensor', 'ReferenceFP8Weight']")


def test_gpu_argv_replaces_the_cpu_only_flags():
    cpu = ["--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend",
           "gloo", "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1",
           "--no-save-rng", "--no-load-rng", "--hidden-size", "64"]
    argv = gpu_argv(cpu, eval_interval=2, log_interval=5)
    assert argv == ["--hidden-size", "64", "--transformer-impl", "transformer_engine",
                    "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-param-gather",
                    "--bf16", "--attention-backend", "unfused", "--distributed-backend", "nccl",
                    "--log-interval", "5", "--eval-interval", "2", "--eval-iters", "1"]


def test_gpu_argv_carries_the_recipe_and_refuses_blackwell_ones():
    """The step-time benchmark's blockwise run (TE Float8BlockwiseQTensor weights) asks
    Megatron-LM for that recipe; the Blackwell-only ones are refused before Megatron-LM starts."""
    argv = gpu_argv([], eval_interval=0, log_interval=1, recipe="blockwise")
    assert argv[argv.index("--fp8-recipe") + 1] == "blockwise"
    with pytest.raises(ValueError, match="recipe='nvfp4'.*need Blackwell"):
        gpu_argv([], eval_interval=0, log_interval=1, recipe="nvfp4")


@pytest.mark.parametrize("argv, says", [
    (["--device", "cuda"], "--device cuda: runs Megatron-LM's loop only; pass --loop megatron-lm"),
    (["--device", "cuda", "--loop", "megatron-lm"], "--device cuda: no CUDA device is visible"),
])
def test_cli_refuses_device_cuda_where_it_cannot_run(argv, says, capsys):
    import torch

    from lab.demo.cli import main

    if "--loop" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_aligned_needs_valid_transposes_at_first_use_and_the_plugins_records():
    aligned = DemoOptions(pp=2, vp=2, microbatches=4, steps=3, device="cuda")
    problems = gpu_problems(aligned, [_rank(0, "aligned"), _rank(1, "aligned")])
    assert "rank 0 step 1 chunk 0: transposes valid at first use: None" in problems
    assert "rank 1 step 2 chunk 1: no plugin record" in problems
    assert "rank 0: 0 plugin records, expected 4" in problems
    assert not any("slot" in p for p in problems), problems  # the builds are where aligned says


def test_a_cuda_rank_runs_the_gpu_entry_point(monkeypatch):
    """launch_megatron_lm's rank entry hands --device cuda ranks to megatron_lm_gpu (the GPU
    run went through it; the CPU ranks keep megatron_lm_loop.run_rank)."""
    from lab.demo import launch_megatron_lm, megatron_lm_gpu

    calls = []
    monkeypatch.setattr(megatron_lm_gpu, "run_gpu_rank", lambda *a: calls.append(a))
    phase = {"exit_at": None, "save": None, "load": None}
    launch_megatron_lm._rank_main(1, 2, 1234, OPTS, "/tmp/run", phase, True)
    assert calls == [(1, 2, 1234, OPTS, "/tmp/run", phase)]


@pytest.mark.parametrize("device, method", [("cuda", "spawn"), ("cpu", "forkserver")])
def test_cuda_ranks_are_spawned_not_forked(device, method, monkeypatch):
    """With TE installed the fork server's preloaded megatron-core initialises CUDA, which forked
    ranks cannot use (seen on the H100: 'Cannot re-initialize CUDA in forked subprocess')."""
    import dataclasses

    from lab.demo import launch_megatron_lm

    seen = []

    def spawn_and_wait(target, world_size, args, timeout_s, start_method="forkserver"):
        seen.append(start_method)
        raise KeyboardInterrupt  # stop before any rank would start

    monkeypatch.setattr(launch_megatron_lm, "spawn_and_wait", spawn_and_wait)
    with pytest.raises(KeyboardInterrupt):
        launch_megatron_lm.run_megatron_lm_demo(dataclasses.replace(OPTS, device=device))
    assert seen == [method]
