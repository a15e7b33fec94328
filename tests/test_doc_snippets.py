"""Every fenced block of README.md and docs/*.md is run as written (issue 24 item 7), so that a
documented form cannot rot again: a block with no handler below fails
``test_every_block_has_a_handler``.

How each kind of block is run:
- ``$ command`` transcripts and bare command blocks: the command, in a sandbox directory that sees
  the repository's ``conf/`` and ``tests/`` (and the launcher tree the block names, from
  tests/data/upstream), its output compared line by line with the block (a line ending in ``...``
  is a prefix, ``... (text)`` stands for elided lines; where a block shows timings, a number stands
  for any number); the exit status as ``echo $?`` shows, else 1 where the block shows ``FAILED``,
  else 0. ``check`` commands that print a fix line are re-run with the line pasted (exit 0).
- output blocks: the command the text around them names (``make demo``'s arguments from the
  Makefile), compared line for line.
- Python blocks: executed with ``exec`` in a fresh namespace where the surrounding text says what
  the block's free names are (``cfg``: the project's plain NeMo CPU config; ``model`` and ``M``:
  real megatron-core DDP chunks, tests/support/ddp_chunks.py; Megatron-LM's ``args``: its own parser
  on the demo's command line). Without Transformer Engine (this CPU machine) the documented
  default backend must give the install hint and leave nothing attached.

What is not run here, and where it is instead: ``make test`` (CI runs it: ``.ci/run``), the
training command of the NeMo example on its GPU config (here the command's overrides are composed
and checked as the model's startup check does; the README's CPU variant of it is run as written),
Megatron-LM's ``pretrain`` and Bridge's ``pretrain`` around the hook and the callback (the hook in
Megatron-LM's real loop: tests/test_megatron_lm_loop.py; Bridge's loop does not import on a CPU
machine: its real ``CallbackManager`` fires the callback here), the ``pip install`` lines of
docs/install.md (CI installs the same pins through ``make``; here each extra and pin they name is
checked against pyproject.toml), and the smoke run's output in docs/testing.md (compared by
tests/test_smoke_nemo.py, the one test that produces it).
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from support.doc_blocks import ROOT, Block, blocks, missing_lines

TE_HINT = "Transformer Engine is not importable"


# --- running commands as a shell user would, in a sandbox -------------------------------------

@pytest.fixture
def sandbox(tmp_path):
    """A working directory with the repository's inputs (read through links) and room for what
    the commands write (``benchmarks/results/``, telemetry files)."""
    for name in ("conf", "tests", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "launcher_scripts").mkdir()
    (tmp_path / "launcher_scripts" / "conf").symlink_to(ROOT / "tests/data/upstream/launcher_conf")
    return tmp_path


#: The lab's demo as documented (run from a checkout: the repository root on the path).
LAB_DEMO = ["python", "-m", "lab.demo"]


def run_command(line, cwd):
    """``nemo-fp8-align ARGS`` as this interpreter's module (the venv's console script), or
    ``python -m lab.demo ARGS`` with this interpreter."""
    argv = shlex.split(line, comments=True)
    if argv[0] in ("python", ".venv/bin/python") and argv[1:3] == LAB_DEMO[1:]:  # the docs'
        # checkout spelling names the venv `make demo` builds: this interpreter's
        command = [sys.executable, "-m", "lab.demo"] + argv[3:]
    elif argv[0] == "nemo-fp8-align":
        command = [sys.executable, "-m", "nemo_fp8_align"] + argv[1:]
    else:
        raise AssertionError(f"no runner for {argv[0]!r} (a documented command this test "
                             f"cannot run: give it a handler)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def commands(text):
    """Shell lines, backslash continuations joined."""
    joined = text.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


def transcript(text):
    """``[(command, expected output)]`` of a ``$ command`` block."""
    steps = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("$ "):
            steps.append([line[2:].strip(), []])
        else:
            steps[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in steps]


def expected_status(output):
    return 1 if any(line.startswith("FAILED") for line in output.splitlines()) else 0


def run_transcript(block, cwd, numbers, consecutive=True):
    last, statuses, echoed = None, [], set()
    for cmd, want in transcript(block.text):
        if cmd == "echo $?":
            assert last is not None and str(last.returncode) == want.strip(), (block.key, want)
            echoed.add(statuses[-1][0])
            continue
        last = run_command(cmd, cwd)
        shown = last.stdout + last.stderr  # a terminal shows both: verdicts go to stdout,
        # the demo's per-rank failures to stderr
        assert missing_lines(want, shown, numbers=numbers, consecutive=consecutive) == [], \
            f"{block.file}:{block.line} `{cmd}` printed:\n{shown[-4000:]}"
        statuses.append((cmd, last.returncode, expected_status(want)))
    for cmd, got, want in statuses:  # unless `echo $?` said otherwise
        assert got == want or cmd in echoed, (cmd, got, want)


# --- handlers ---------------------------------------------------------------------------------

def quick_start(block, **_):
    """The two quick-start commands are the Makefile's targets, CI runs the second, and the
    first runs the demo whose output the README shows (next block)."""
    assert [c.split("#")[0].strip() for c in commands(block.text)] == ["make demo", "make test"]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")
    assert demo_args()  # `make demo` runs `python -m lab.demo $(DEMO_ARGS)`


def demo_args():
    dry = subprocess.run(["make", "-n", "-s", "demo"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    line = next(x for x in dry.splitlines() if "-m lab.demo" in x)
    return line.split("-m lab.demo", 1)[1].strip()


def demo_output(block, sandbox, **_):
    pytest.importorskip("megatron.core")
    out = run_command(f"python -m lab.demo {demo_args()}", sandbox)
    assert out.returncode == 0, out.stderr[-3000:]
    assert missing_lines(block.text, out.stdout, consecutive=True) == [], out.stdout


def mixin_class(block, **_):
    pytest.importorskip("nemo.collections.nlp.models.language_modeling.megatron_gpt_model")
    namespace = {}
    exec(compile(block.text, block.key, "exec"), namespace)
    from nemo_fp8_align import FP8TransposeAlignMixin
    model = namespace["MegatronGPTFP8AlignModel"]
    assert model.__mro__[1] is FP8TransposeAlignMixin and model.__mro__[2] is namespace[
        "MegatronGPTModel"]


def callback_trainer(block, **_):
    """``cfg``: the project's plain NeMo config for the CPU (conf/megatron_gpt_cpu.yaml), one
    device, under the tests' NeMo CPU patches."""
    pytest.importorskip("nemo.collections.nlp.parts.megatron_trainer_builder")
    from omegaconf import OmegaConf

    from nemo_fp8_align import FP8TransposeAlignment
    from support.cpu_nemo import enable_nemo_cpu_compat

    cfg = OmegaConf.load(ROOT / "conf" / "megatron_gpt_cpu.yaml")
    cfg.trainer.devices = 1
    compat = enable_nemo_cpu_compat()
    try:
        namespace = {"cfg": cfg}
        exec(compile(block.text, block.key, "exec"), namespace)
    finally:
        compat.undo()
    ours = [c for c in namespace["trainer"].callbacks
            if isinstance(c, FP8TransposeAlignment) and not c.from_entry_point]
    assert len(ours) == 1  # the entry point's own instance stays inert beside it


def example_command(block, sandbox, **_):
    """The training command's config and overrides, composed as the example's hydra_runner
    composes them, pass the plugin's startup check (what the model runs at construction)."""
    pytest.importorskip("hydra", reason="check reads NeMo configs through hydra-core")
    argv = shlex.split(commands(block.text)[0])
    assert argv[:2] == ["python", "examples/megatron_gpt_pretraining.py"]
    script = (ROOT / argv[1]).read_text()
    assert 'config_path="../conf"' in script.replace("'", '"'), "the example reads conf/"
    name = argv[argv.index("--config-name") + 1]
    overrides = argv[argv.index("--config-name") + 2:]
    out = run_command(shlex.join(["nemo-fp8-align", "check", f"conf/{name}.yaml"] + overrides),
                      sandbox)
    assert out.returncode == 0 and ": OK" in out.stdout, out.stdout + out.stderr


def cpu_example_command(block, sandbox, **_):
    """The example on the CPU config, run as written (4 gloo processes, about a minute) in the
    sandbox, the venv's ``torchrun`` being this interpreter's ``torch.distributed.run`` (the
    example puts the checkout and its tests/ on the path itself). It trains to the end and logs
    the plugin's attach line once (the README's "did it work" log)."""
    pytest.importorskip("nemo.collections.nlp.models.language_modeling.megatron_gpt_model")
    argv = shlex.split(commands(block.text)[0])
    assert argv[0] == ".venv/bin/torchrun", block.text
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run"] + argv[1:], cwd=sandbox,
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    shown = out.stdout + out.stderr
    assert out.returncode == 0, shown[-4000:]
    assert shown.count("nemo_fp8_align: aligned FP8 transposes attached (mixin;") == 1, shown[-4000:]


def _ddp_model(monkeypatch):
    pytest.importorskip("megatron.core")
    from support.ddp_chunks import ddp_chunks
    return ddp_chunks(monkeypatch)


def align_snippet(block, monkeypatch, **_):
    """``model`` and ``M``: real DDP chunks with ``param_sync_func`` bound (the sentence above
    the block); without TE the first line gives the install hint and nothing is attached."""
    from support.attach_leftovers import leftovers, module_hooks
    with _ddp_model(monkeypatch) as (chunks, config, _):
        from support.ddp_chunks import MICROBATCHES
        bound, hooks = config.param_sync_func, module_hooks(chunks)
        with pytest.raises(ImportError, match=TE_HINT):
            exec(compile(block.text, block.key, "exec"), {"model": chunks, "M": MICROBATCHES})
        assert leftovers(chunks, config, bound, hooks) == []


def megatron_lm_snippet(block, monkeypatch, **_):
    """``args``: Megatron-LM 0.19.2's own parser on the demo's command line with an FP8 run's
    flags (the startup check passes them); ``pretrain`` is
    called for real up to the model: its config container is built by Megatron-LM, and the
    ``post_wrap_hooks`` it carries run on real DDP chunks as ``get_model`` runs them. Without TE
    the hook gives the install hint and leaves nothing."""
    pytest.importorskip("megatron.training.argument_utils",
                        reason="Megatron-LM's loop ships in the megatron-core 0.19 wheel")
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args

    from lab.demo.megatron_lm_loop import megatron_lm_argv
    from lab.demo.options import DemoOptions
    from support.attach_leftovers import leftovers, module_hooks

    argv = megatron_lm_argv(DemoOptions(pp=2, vp=2, dp=1, microbatches=4, steps=2),
                            exit_at=None, save=None, load=None)
    argv[argv.index("--transformer-impl") + 1] = "transformer_engine"  # an FP8 run's line
    argv += ["--fp8-format", "hybrid", "--fp8-param-gather", "--bf16"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + argv)
    monkeypatch.setenv("WORLD_SIZE", "2")  # PP=2: Megatron-LM divides the world by it
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    args = parse_and_validate_args()
    destroy_num_microbatches_calculator()  # the chunks below set up their own
    called = {}

    def pretrain(container, datasets_provider, model_type, forward_step):
        called.update(container=container, model_type=model_type)

    namespace = {"args": args, "pretrain": pretrain, "ModelType": ModelType,
                 "train_valid_test_datasets_provider": object(), "forward_step": object()}
    exec(compile(block.text, block.key, "exec"), namespace)
    hooks_on_config = called["container"].model.post_wrap_hooks
    assert hooks_on_config and hooks_on_config[-1].__name__ == "fp8_align_post_wrap_hook"
    with _ddp_model(monkeypatch) as (chunks, config, _):
        import torch
        # the startup check reads the world from torch.distributed: the 2 processes of the
        # stand-in pipeline (PP=2 reported in a 1-process world)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
        bound, hooks = config.param_sync_func, module_hooks(chunks)
        with pytest.raises(ImportError, match=TE_HINT):
            for hook in hooks_on_config:
                hook(chunks)
        assert leftovers(chunks, config, bound, hooks) == []


def bridge_snippet(block, monkeypatch, **_):
    """``pretrain``: megatron-bridge 0.6.2's ``CallbackManager`` (its real callbacks.py) takes
    the ``callbacks`` list and fires ``on_train_start`` on real DDP chunks, as Bridge's
    ``train()`` does; ``config`` (Bridge's ConfigContainer, checked by the callback in
    tests/test_bridge_callback.py) and ``forward_step_func`` are not read before it."""
    from support.bridge import load_bridge_callbacks
    from support.attach_leftovers import leftovers, module_hooks
    bridge = load_bridge_callbacks()
    with _ddp_model(monkeypatch) as (chunks, config, _):
        bound, hooks = config.param_sync_func, module_hooks(chunks)

        def pretrain(cfg, forward_step_func, callbacks):
            manager = bridge.normalize_callbacks(callbacks)  # as Bridge's pretrain() does
            if bridge.should_fire(manager, "on_train_start"):
                manager.fire("on_train_start", bridge.CallbackContext(state=None, model=chunks))

        namespace = {"pretrain": pretrain, "config": None, "forward_step_func": object()}
        with pytest.raises(ImportError, match=TE_HINT):
            exec(compile(block.text, block.key, "exec"), namespace)
        assert leftovers(chunks, config, bound, hooks) == []


def nemo2_trainer(block, sandbox, **_):
    """NeMo 2's ``nl.Trainer`` built as written, in a new process (``nemo.lightning`` needs the
    packages of requirements/nemo2.txt, in ``.venv/nemo2-deps``): the callback is on it, and the
    plugin's startup check finds nothing in the way of the documented strategy, precision and
    DDP config (the fit itself: tests/test_nemo2_callback.py)."""
    deps = ROOT / ".venv" / "nemo2-deps"
    if not (deps / "fiddle").is_dir():
        pytest.importorskip("fiddle", reason="nemo.lightning needs requirements/nemo2.txt")
    pytest.importorskip("nemo", reason="needs nemo_toolkit 2.3.3")
    script = sandbox / "nemo2_snippet.py"
    script.write_text(block.text + "\nfrom nemo_fp8_align.integrations.nemo2 import nemo2_violations\n"
                      "print('CALLBACKS', [type(c).__name__ for c in trainer.callbacks])\n"
                      "print('VIOLATIONS', nemo2_violations(trainer))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(deps), str(ROOT)]))
    out = subprocess.run([sys.executable, str(script)], cwd=sandbox, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'FP8TransposeAlignNeMo2'" in out.stdout.split("CALLBACKS", 1)[1].splitlines()[0]
    assert "VIOLATIONS []" in out.stdout, out.stdout[-3000:]


def report_on_data(block, sandbox, **_):
    """A command on the repository's data: its output as shown (the README shows a few
    lines of the table: they need not be adjacent there)."""
    if "--plot" in block.text:
        pytest.importorskip("matplotlib", reason="--plot draws with matplotlib")
    run_transcript(block, sandbox, numbers=False, consecutive=block.file != "README.md")


def transcript_with_timings(block, sandbox, **_):
    if "demo" in block.text:
        pytest.importorskip("megatron.core")
    run_transcript(block, sandbox, numbers=True)


def ab_report(block, sandbox, **_):
    """``aligned.jsonl`` and ``lazy.jsonl``: the demo's telemetry of the two policies
    (tests/data/telemetry_observed_pp2_vp2_dp2_*.jsonl, written by ``demo --telemetry``)."""
    for policy in ("aligned", "lazy"):
        (sandbox / f"{policy}.jsonl").symlink_to(
            ROOT / f"tests/data/telemetry_observed_pp2_vp2_dp2_{policy}.jsonl")
    run_transcript(block, sandbox, numbers=True)


def check_commands(block, sandbox, **_):
    """Each ``check`` line; the placeholder ``CONFIG.yaml`` is the project's NeMo config. A
    violation list ends in one override line: pasted after the command, the config passes."""
    pytest.importorskip("hydra", reason="check reads NeMo configs through hydra-core")
    for line in commands(block.text):
        line = line.replace("CONFIG.yaml", "conf/megatron_gpt_fp8_align.yaml")
        out = run_command(line, sandbox)
        if "--format json" in line:
            assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True, out.stdout
            continue
        if out.returncode == 2 and "Fix them all with this override line" in out.stdout:
            fix = out.stdout.split("Fix them all with this override line", 1)[1].splitlines()[1]
            out = run_command(f"{line} {fix.strip()}", sandbox)
        assert out.returncode == 0 and ": OK" in out.stdout, (line, out.stdout, out.stderr)


def install_lines(block, **_):
    """Not run (CI installs the same pins through ``make``): every extra named exists in
    pyproject.toml, every ``name x.y.z`` or ``name==x.y.z`` is a version pinned there, in
    requirements/ or in the Makefile, and a range is the extra's own."""
    project = (ROOT / "pyproject.toml").read_text()
    pins = "\n".join(p.read_text() for p in [ROOT / "pyproject.toml", ROOT / "Makefile",
                                               *sorted((ROOT / "requirements").glob("*.txt"))])
    for line in commands(block.text):
        extra = re.search(r"\.\[(\w+)\]", line)
        if extra:
            assert re.search(rf"^{extra.group(1)} = \[", project, re.M), line
        for name, version in re.findall(r"([\w-]+)(?: |==)(\d+\.\d+\.\d+)\b", line):
            name = {"NeMo": "nemo_toolkit", "Engine": "transformer-engine"}.get(name, name)
            assert re.search(rf"{re.escape(name)}(\[\w+\])?==\s*{re.escape(version)}", pins,
                             re.I), f"docs/install.md names {name} {version}, pinned nowhere"
        for name, spec in re.findall(r"([\w-]+) (>=[\d.]+,<[\d.]+)", line):
            assert f'"{name}{spec}"' in project, f"docs/install.md: {name} {spec} is no extra's"


def smoke_output(block, **_):
    """Produced only by the smoke run: tests/test_smoke_nemo.py compares this block with the
    run's output. Here: what the block claims holds within it (the plugin's runs and off have
    the same losses, the no-wait fault differs after step 1, the resumed step 3 is aligned's)."""
    losses = {name: [float(x) for x in re.findall(r"\d+\.\d+", rest)] for name, rest in
              re.findall(r"^losses\s+(\w+):\s+(.*)$", block.text, re.M)}
    assert len(losses["aligned"]) == 3
    assert losses["stock"] == losses["lazy"] == losses["off"] == losses["aligned"]
    assert losses["fault"][0] == losses["off"][0] and losses["fault"][1:] != losses["off"][1:]
    assert losses["resume"] == [losses["aligned"][2]] and "resume:   {3: " in block.text


# (file, how the block's first line starts) -> handler
HANDLERS = [
    ("README.md", "make demo", quick_start),
    ("docs/testing.md", "nemo_fp8_align demo: PP=2", demo_output),
    ("README.md", "from nemo.collections.nlp.models.language_modeling", mixin_class),
    ("README.md", "from nemo.collections.nlp.parts.megatron_trainer_builder", callback_trainer),
    ("docs/nemo.md", "python examples/megatron_gpt_pretraining.py", example_command),
    ("README.md", ".venv/bin/torchrun", cpu_example_command),
    ("README.md", "import nemo.lightning as nl", nemo2_trainer),
    ("README.md", "from nemo_fp8_align import TEBackend", align_snippet),
    ("README.md", "from megatron.training.argument_utils", megatron_lm_snippet),
    ("README.md", "from nemo_fp8_align.integrations.bridge", bridge_snippet),
    ("README.md", "$ nemo-fp8-align report tests/data/", report_on_data),
    ("docs/configuration.md", "nemo-fp8-align check", check_commands),
    ("docs/install.md", "pip install", install_lines),
    ("docs/megatron-core.md", "from nemo_fp8_align import TEBackend", align_snippet),
    ("docs/planner.md", "$ nemo-fp8-align plan --model gpt3-175b", report_on_data),
    ("docs/planner.md", "$ nemo-fp8-align plan --model llama3-70b", report_on_data),
    ("docs/planner.md", "$ nemo-fp8-align plan --recipe mxfp8", report_on_data),
    ("docs/planner.md", "$ nemo-fp8-align plan --layers 8", report_on_data),
    ("docs/telemetry.md", "$ .venv/bin/python -m lab.demo", transcript_with_timings),
    ("docs/telemetry.md", "$ nemo-fp8-align report aligned.jsonl", ab_report),
    ("docs/testing.md", "chunk  aligned slot", smoke_output),
]


def handler_of(block: Block):
    found = [h for f, start, h in HANDLERS
             if f == block.file and block.text.lstrip().startswith(start)]
    return found[0] if len(found) == 1 else None


def test_every_block_has_a_handler():
    found = blocks()
    assert [b.key for b in found if handler_of(b) is None] == []
    for file, start, _ in HANDLERS:  # and no handler outlives its block
        assert sum(b.file == file and b.text.lstrip().startswith(start) for b in found) == 1, \
            (file, start)


def _id(block):
    handler = handler_of(block)
    return f"{block.file}:{block.line}:{handler.__name__ if handler else 'no_handler'}"


@pytest.mark.parametrize("block", blocks(), ids=_id)
def test_block_runs_as_documented(block, sandbox, monkeypatch):
    handler = handler_of(block)
    if handler is None:
        pytest.fail(f"{block.key}: no handler (test_every_block_has_a_handler)")
    handler(block, sandbox=sandbox, monkeypatch=monkeypatch)
