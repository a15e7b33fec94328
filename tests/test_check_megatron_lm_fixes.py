"""``check --megatron-lm``'s fixes (issue 25 item 2): one line of changes to the argument list,
applied, parsed and checked again before it is printed; per-violation fixes that agree with it;
the world size said as processes; ``--format json`` with the NeMo mode's keys. In-process calls
of the command (no subprocess): each case is a few milliseconds."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import List, Tuple

import pytest

from nemo_fp8_align.cli.check import add_check_parser

UPSTREAM = Path(__file__).parent / "data" / "upstream" / "megatron_lm"
GOOD = ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer "
        "--overlap-param-gather --overlap-grad-reduce --micro-batch-size 1 "
        "--global-batch-size 16 --bf16 --seq-length 128 --lr 1e-4").split()
#: The keys NeMo mode's JSON has (cli/check_output.py); Megatron-LM mode has them too.
NEMO_KEYS = {"ok", "violations", "fix_overrides", "fix_passes", "left", "plugin_off", "notes"}


def upstream(name: str) -> List[str]:
    return [a for a in (UPSTREAM / name).read_text().split("\n") if a]


def check(world: int, argv: List[str], *flags: str) -> Tuple[int, str]:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", "--megatron-lm", "--world-size", str(world), *flags,
                              "--", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = args.func(args, out=out, err=err)
    assert err.getvalue() == "", err.getvalue()  # results on stdout
    return status, out.getvalue()


def as_json(world: int, argv: List[str]) -> Tuple[int, dict]:
    status, out = check(world, argv, "--format", "json")
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one JSON object
    return status, json.loads(lines[0])


def test_gpt_oss_gets_one_line_that_passes_and_fixes_that_agree_with_it():
    """Was: --num-virtual-stages-per-pipeline-rank 2 for one violation, 3 (with PP 4) for the
    next, and no combined line."""
    argv = upstream("gptoss_02_train.args")
    status, out = check(8, argv)
    assert status == 2
    assert "re-checked: the arguments pass with them" in out, out
    line = out.split("re-checked: the arguments pass with them):\n", 1)[1].splitlines()[0]
    assert "--pipeline-model-parallel-size 4" in line
    assert "--num-virtual-stages-per-pipeline-rank 3" in line
    _, payload = as_json(8, argv)
    chosen = {}  # flag -> the one value every fix gives it
    for v in payload["violations"]:
        for edit in v["fix"].split("; "):
            flag, _, value = edit.partition(" ") if not edit.startswith("drop ") else (edit, "", "")
            assert chosen.setdefault(flag, value) == value, payload["violations"]
    # pasted as the JSON says (fixed_argv is the list the re-check parsed)
    assert payload["fix_passes"] is True
    assert check(payload["fix_world_size"] or 8, payload["fixed_argv"])[0] == 0


def test_the_fixed_list_is_the_given_one_with_the_line_applied():
    argv = " ".join(GOOD).replace("--num-layers-per-virtual-pipeline-stage 2",
                                  "--num-virtual-stages-per-pipeline-rank 2").split()
    argv += ["--pipeline-model-parallel-size", "3", "--no-align-param-gather"]
    status, payload = as_json(4, argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_overrides"] == ["--pipeline-model-parallel-size", "2"]
    assert payload["fix_drop"] == ["--no-align-param-gather"]
    fixed = payload["fixed_argv"]
    assert fixed.count("--pipeline-model-parallel-size") == 1  # replaced, not appended twice
    assert "--no-align-param-gather" not in fixed
    assert check(4, fixed)[0] == 0
    # the world-size rule's words, where its fix is PP: a world size, not trainer.devices
    assert "the world size 4 to be a multiple of TP * PP * CP = 1 * 3 * 1" in check(4, argv)[1]
    assert "trainer." not in check(4, argv)[1]


def test_the_world_size_fix_is_processes_not_nodes():
    argv = upstream("train_gpt3_175b_distributed.args")
    status, out = check(8, argv)
    assert status == 2 and "num_nodes" not in out and "trainer." not in out, out
    assert "launch 128 processes (--world-size 128)" in out
    _, payload = as_json(8, argv)
    assert payload["fix_world_size"] == 128 and payload["fix_passes"] is True, payload
    assert check(128, payload["fixed_argv"])[0] == 0


def test_six_experts_get_one_expert_parallel_size_in_one_round():
    argv = GOOD + ["--num-experts", "6", "--expert-model-parallel-size", "8",
                   "--global-batch-size", "64"]
    _, payload = as_json(32, argv)
    assert payload["fix_overrides"] == ["--expert-model-parallel-size", "2"], payload
    assert payload["fix_passes"] is True


def test_json_has_the_nemo_keys_valid_or_not():
    status, payload = as_json(4, GOOD)
    assert status == 0 and payload["ok"] is True and payload["violations"] == []
    assert payload["fix_overrides"] == []
    assert [n for n in payload["notes"] if "megatron-core" not in n
            and not n.startswith("Megatron-LM's validate_args: ")] == [], payload["notes"]
    status, payload = as_json(4, GOOD + ["--no-align-param-gather"])
    assert status == 2 and NEMO_KEYS <= set(payload), sorted(payload)
    for v in payload["violations"]:
        assert set(v) == {"key", "found", "expected", "fix"}


def test_without_a_passing_combination_it_says_so_and_lists_the_hints():
    """A recipe is never a fix: no edit passes, and no line is claimed to."""
    argv = GOOD + ["--fp8-recipe", "custom", "--no-align-param-gather"]
    status, out = check(4, argv)
    assert status == 2 and "re-checked: the arguments pass" not in out, out
    assert "These changes fix part of it (re-checked):\n  drop --no-align-param-gather" in out
    assert "Still to decide by hand (no combination of the fixes passes):" in out
    assert "  - --fp8-recipe: " in out
    _, payload = as_json(4, argv)
    assert payload["fix_passes"] is False
    assert [v["key"] for v in payload["left"]] == ["--fp8-recipe"]


def test_layers_per_virtual_stage_that_do_not_divide_get_a_layout_not_a_world_size():
    """PP 3 on 4 processes with 2 layers per virtual stage (8 layers): VP is no whole number, and
    the layout search did not run, so the fix was 'launch 12 processes'; PP 2 keeps the world
    (VP 2, given as stages: the per-stage count 2 with PP 3 is what the VP rule reports)."""
    argv = GOOD + ["--pipeline-model-parallel-size", "3"]
    status, payload = as_json(4, argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_world_size"] is None, payload["fix_text"]
    assert "--pipeline-model-parallel-size 2" in payload["fix_text"], payload["fix_text"]
    assert check(4, payload["fixed_argv"])[0] == 0


def test_a_context_parallel_size_no_pipeline_size_fits_gets_the_nearest_cp():
    """CP 3 on 4 processes: no PP fits TP1 * CP3, so the world changed; CP 2 fits (sequence 128
    a multiple of 2 * CP), and CP 4 would not (128 % 8 = 0, but PP 2 then needs 8 processes)."""
    argv = GOOD + ["--context-parallel-size", "3"]
    _, payload = as_json(4, argv)
    assert payload["fix_overrides"] == ["--context-parallel-size", "2"], payload["fix_text"]
    assert payload["fix_world_size"] is None and payload["fix_passes"] is True


def test_the_world_size_fix_is_the_nearest_world_that_fits_the_batch():
    """5 processes at PP 2: NeMo's node arithmetic (devices per node fixed) said 10 processes and
    then a global batch of 20; a Megatron-LM job launches any count, and 4 keeps the batch."""
    status, out = check(5, GOOD)
    assert status == 2 and "launch 4 processes" in out, out
    _, payload = as_json(5, GOOD)
    assert payload["fix_world_size"] == 4 and payload["fix_overrides"] == [], payload["fix_text"]
    assert payload["fix_passes"] is True


def test_an_unquoted_step_schedule_is_fixed_by_quoting_it_not_by_dropping_its_entries():
    """Megatron-LM's GPT-3 example passes --step-batch-size-schedule's entries unquoted: its
    parser reads only the first and stops on the rest. Dropping them (the old fix) left a batch
    of 16 for the whole run; one quoted value keeps the ramp (every entry then checked)."""
    argv = upstream("train_gpt3_175b_distributed.args")
    _, payload = as_json(16, argv)
    stray = payload["violations"][0]
    assert stray["key"] == "2.4B:320", stray
    assert stray["fix"].startswith(
        "--step-batch-size-schedule '0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536'"), stray
    fixed = payload["fixed_argv"]
    at = fixed.index("--step-batch-size-schedule")
    assert fixed[at + 1] == "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", fixed


def test_script_flags_are_named_and_kept_by_the_fix_line():
    """gpt-oss's --enable-gpt-oss and --export-force-local-attention are flags pretrain_gpt.py
    adds itself (ModelOpt's arguments): the line used to drop them, breaking that script."""
    argv = upstream("gptoss_02_train.args")
    _, payload = as_json(8, argv)
    assert "--enable-gpt-oss" in payload["fixed_argv"]
    assert "--export-force-local-attention" in payload["fixed_argv"]
    assert payload["fix_drop"] == [] or not any("gpt-oss" in d or "local-attention" in d
                                                for d in payload["fix_drop"])
    assert any(n.startswith("not read: --export-force-local-attention --enable-gpt-oss")
               or n.startswith("not read: --enable-gpt-oss") for n in payload["notes"]), payload
    status, out = check(payload["fix_world_size"] or 8, payload["fixed_argv"])
    assert status == 0 and "note: not read: " in out, out


@pytest.mark.parametrize("vp_flag", ["--num-layers-per-virtual-pipeline-stage",
                                     "--num-virtual-stages-per-pipeline-rank"])
def test_no_layer_count_is_invented_where_none_is_given(vp_flag):
    """Without --num-layers the line set '--num-layers 4' (PP * VP: a model the user never
    chose) and passed; the layer count is the user's to give, and VP from layers per virtual
    stage is unknown without it (no VP fix guessed either)."""
    argv = " ".join(GOOD).replace("--num-layers-per-virtual-pipeline-stage", vp_flag).split()
    argv = [a for a in argv if a not in ("--num-layers", "8")]
    status, payload = as_json(4, argv)
    assert status == 2 and payload["fix_passes"] is False, payload["fix_text"]
    assert "--num-layers" not in payload["fix_overrides"], payload["fix_text"]
    assert [v["key"] for v in payload["violations"]] == ["--num-layers"], payload
    assert [v["key"] for v in payload["left"]] == ["--num-layers"]


def test_left_is_empty_when_the_line_passes():
    """Commit 032a14a: a line that passes leaves nothing to decide by hand, even where a
    violation's own fix was a sentence (the line made it moot)."""
    from nemo_fp8_align.cli.check_megatron_lm import _payload
    from nemo_fp8_align.config_check.fixes import FixLine
    from nemo_fp8_align.config_check.megatron_lm_edits import MEGATRON_LM
    from nemo_fp8_align.config_check.reader import Violation

    moot = Violation("--num-layers", "null", "an int >= 1", "--num-layers <the model's count>")
    line = FixLine(overrides=["--num-layers 8"], passes=True, manual=[moot],
                   spelling=MEGATRON_LM)
    payload = _payload([moot], line, GOOD, 4, 4, GOOD)
    assert payload["fix_passes"] is True and payload["left"] == []
    line.passes = False
    assert [v["key"] for v in _payload([moot], line, GOOD, 4, 4, GOOD)["left"]] == [
        "--num-layers"]


#: (virtual-pipeline flag, --num-layers, PP, world size, global batch, micro batch): layouts
#: for which the line changed --num-layers (and the batch and the world) though a layout with
#: a smaller micro batch fits the model, the batch and the world as given.
KEPT_MODEL = [
    ("--num-virtual-stages-per-pipeline-rank", 8, 3, 12, 16, 2),  # split: num_layers 8 -> 6
    ("--num-layers-per-virtual-pipeline-stage", 12, 5, 16, 16, 2),  # world 16 -> 20, layers 10
    ("--num-layers-per-virtual-pipeline-stage", 8, 5, 6, 16, 1),  # PP x VP x first x N at once
    ("--num-virtual-stages-per-pipeline-rank", 30, 4, 16, 16, 2),  # layers 30 -> 32
]


@pytest.mark.parametrize("flag,layers,pp,world,gbs,mbs", KEPT_MODEL)
def test_a_layout_with_a_smaller_micro_batch_comes_before_the_layer_count(
        flag, layers, pp, world, gbs, mbs):
    """Fix order (issue 25): the layout, then the micro batch with a layout, then the batch, the
    world, and the layer count last. Each line keeps --num-layers, the global batch and the
    world, gives VP in one flag only, and passes."""
    per_stage = "--num-layers-per-virtual-pipeline-stage"
    stages = "--num-virtual-stages-per-pipeline-rank"
    argv = " ".join(GOOD).replace(f"{per_stage} 2", f"{flag} 2").split()
    for name, value in (("--num-layers", layers), ("--pipeline-model-parallel-size", pp),
                        ("--global-batch-size", gbs), ("--micro-batch-size", mbs)):
        argv[argv.index(name) + 1] = str(value)
    status, payload = as_json(world, argv)
    assert status == 2 and payload["fix_passes"] is True, payload["fix_text"]
    for kept in ("--num-layers", "--global-batch-size"):
        assert kept not in payload["fix_overrides"], payload["fix_text"]
    assert payload["fix_world_size"] is None, payload["fix_text"]
    fixed = payload["fixed_argv"]
    assert (per_stage in fixed) + (stages in fixed) == 1, payload["fix_text"]
    assert check(world, fixed)[0] == 0


# --- a "did you mean" guess is text, never a flag of the fix line (issue 38 item 4) ----------


def test_a_guess_for_an_unknown_flag_is_never_pasted_into_the_fix_line():
    """Megatron-LM's multimodal scripts pass ``--dataloader-type external`` and their own
    ``--dataloader-save PATH`` (their parser adds it). The guess for the unknown flag
    (--dataloader-type) with its value was pasted as ``--dataloader-type PATH``, which replaced
    the user's ``external`` and which Megatron-LM's parser rejects. The fix line touches the
    unknown flag only; the guess stays in the text."""
    argv = GOOD + ["--dataloader-type", "external", "--dataloader-save", "/out/dataloader"]
    status, payload = as_json(4, argv)
    assert status == 2
    [v] = payload["violations"]
    assert v["key"] == "--dataloader-save" and "did you mean --dataloader-type?" in v["expected"]
    assert "--dataloader-type" not in v["fix"], v["fix"]
    assert "--dataloader-type" not in payload["fix_text"], payload["fix_text"]
    assert payload["fix_passes"] and payload["fix_drop"] == ["--dataloader-save"], payload
    at = payload["fixed_argv"].index("--dataloader-type")
    assert payload["fixed_argv"][at + 1] == "external", payload["fixed_argv"]


@pytest.mark.parametrize("unknown", [["--virtual-pipeline-model-parallel-size", "2"],
                                     ["--fp8-params"], ["--align-param-gather"]])
def test_no_guess_becomes_a_flag_of_the_fix_line(unknown):
    """The table of flags users bring from NeMo or older releases names the flag meant in the
    text; the fix line drops the unknown one and sets nothing on a guess (--align-param-gather's
    close match was --no-align-param-gather: pasted, it turned the setting off)."""
    status, payload = as_json(4, GOOD + unknown)
    assert status == 2
    [v] = payload["violations"]
    assert "did you mean" in v["expected"], v
    assert v["fix"] == f"drop {unknown[0]}", v["fix"]
    assert payload["fix_overrides"] == [] and payload["fix_passes"], payload


# --- a world-size fix keeps the layers where a layout fits at the new world size --------------


def test_a_world_size_fix_keeps_the_layers_where_a_layout_fits_at_the_new_world_size():
    """9 layers at PP 2 on 5 processes: no layout fits 5 (it is prime), so the world changes
    (to 4). The split rule, judging the world as given, also changed the model (--num-layers
    8), though at 4 processes PP 2 with a first stage of 3 layers and VP 3 keeps all 9."""
    argv = ("--pipeline-model-parallel-size 2 --num-layers 9 "
            "--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather "
            "--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce "
            "--micro-batch-size 1 --global-batch-size 16 --bf16 --seq-length 128 --lr 1e-4").split()
    status, payload = as_json(5, argv)
    assert status == 2
    assert payload["fix_passes"], payload
    assert payload["fix_world_size"] == 4, payload
    assert "--num-layers" not in payload["fix_overrides"], payload["fix_text"]
    at = payload["fixed_argv"].index("--num-layers")
    assert payload["fixed_argv"][at + 1] == "9", payload["fixed_argv"]
    # what the line asks for passes when pasted
    assert check(4, payload["fixed_argv"])[0] == 0
