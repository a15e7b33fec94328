"""A new user's mistakes on the command line: each gets a clear error (exit 2) naming the flag or
key, the value and the fix, before any work starts, and never a traceback. One table for the
lab's ``demo`` (``python -m lab.demo``) and the ``check`` command; plus a scan that no
user-facing text names a file that the project does not ship.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import List

import pytest

from lab.demo.cli import main as demo_main
from nemo_fp8_align.cli import main

ROOT = Path(__file__).resolve().parents[1]
FP8_ALIGN = "conf/megatron_gpt_fp8_align.yaml"
LAUNCHER = "conf/launcher/gpt3_175b_fp8_align.yaml"


@pytest.fixture
def no_demo_run(monkeypatch):
    """Fail loudly if the demo would start: its launcher module refuses to be imported."""
    fake = types.ModuleType("lab.demo.launch")

    def refuse(name: str):
        # Dunder lookups are Python's own (inspect.getmodule walks sys.modules for __file__ when
        # the first torch import registers its ops): answer them as a plain module would, or
        # that import fails half-way and every later test sees a partially initialised torch.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"the demo started ({name}) although its flags were invalid")

    fake.__getattr__ = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lab.demo.launch", fake)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "comments.yaml").write_text("# only a comment\n")
    (tmp_path / "model3.yaml").write_text("trainer:\n  devices: 8\nmodel: 3\n")
    (tmp_path / "cfg.yml").write_text("model: {}\n")
    return tmp_path


# (argv, what stderr must contain; every fragment). {tmp} is the fixture's folder.
ROWS = [
    # --- demo -----------------------------------------------------------------------------------
    (["demo", "--dp", "0"], ["--dp 0:", "pass --dp 1"]),
    (["demo", "--dp", "-2"], ["--dp -2:", "pass --dp 1"]),
    (["demo", "--pp", "1"], ["--pp 1:", "at least 2 pipeline ranks", "pass --pp 2"]),
    (["demo", "--vp", "0"], ["--vp 0:", "pass --vp 2"]),
    (["demo", "--steps", "0"], ["--steps 0:", "nothing would be trained", "--steps 1"]),
    (["demo", "--steps", "-1"], ["--steps -1:", "--steps 1"]),
    (["demo", "--microbatches", "1"], ["--microbatches 1:", "pass --microbatches 2"]),
    (["demo", "--pp", "4", "--microbatches", "6"],
     ["--microbatches 6:", "6 mod N = 2", "pass --microbatches 8"]),
    (["demo", "--group-size", "1"], ["--group-size 1:", "pass --group-size 2"]),
    (["demo", "--microbatches", "4", "--group-size", "5"], ["--group-size 5:", "2 <= N <= 4"]),
    (["demo", "--telemetry", "{tmp}/no/such/dir/t.jsonl"],
     ["--telemetry {tmp}/no/such/dir/t.jsonl:", "does not exist", "mkdir -p"]),
    (["demo", "--telemetry", "{tmp}"], ["--telemetry {tmp}:", "is a directory",
                                        "{tmp}/telemetry.jsonl"]),
    (["demo", "--telemetry", ""], ["--telemetry '':", "not a file name"]),
    # --- check ----------------------------------------------------------------------------------
    (["check", FP8_ALIGN, "--data-parallel-size", "0"],
     ["--data-parallel-size 0:", "must be an int >= 1", "leave the flag out"]),
    (["check", FP8_ALIGN, "--data-parallel-size", "-4"], ["--data-parallel-size -4:"]),
    (["check", LAUNCHER, "--data-parallel-size", "16"],
     ["--data-parallel-size: found 16; expected 32", "fix: trainer.num_nodes=64"]),
    (["check", LAUNCHER, "trainer.num_nodes=127"],
     ["trainer.num_nodes: found 127", "multiple of 4", "fix: trainer.num_nodes=128"]),
    (["check", LAUNCHER, "trainer.num_nodes=0"], ["trainer.num_nodes: found 0",
                                                   "fix: trainer.num_nodes=1"]),
    (["check", LAUNCHER, "trainer.devices=-3"], ["trainer.devices: found -3",
                                                  "fix: trainer.devices=8"]),
    (["check", FP8_ALIGN, "model.fp8_parms=True"],
     ["model.fp8_parms=True:", "did you mean model.fp8_params?", "fix: model.fp8_params=True"]),
    (["check", FP8_ALIGN, "trainer.num_node=2"],
     ["did you mean trainer.num_nodes?", "fix: trainer.num_nodes=2"]),
    (["check", FP8_ALIGN, "model.global_batch_size=0"],
     ["model.global_batch_size: found 0", "an int >= 1"]),
    (["check", FP8_ALIGN, "model.pipeline_model_parallel_size=-2"],
     ["model.pipeline_model_parallel_size: found -2", "fix: model.pipeline_model_parallel_size=2"]),
    (["check", "{tmp}/empty.yaml"], ["{tmp}/empty.yaml: the file holds no settings"]),
    (["check", "{tmp}/comments.yaml"], ["{tmp}/comments.yaml: the file holds no settings"]),
    (["check", "{tmp}/model3.yaml"], ["model: found 3 (a int)", "YAML block of keys"]),
    (["check", "{tmp}/cfg.yml"], ["Hydra reads only .yaml files", "cfg.yaml"]),
    (["check", "{tmp}/missing.yaml"], ["{tmp}/missing.yaml: no such file"]),
]


@pytest.mark.parametrize("argv,fragments", ROWS, ids=[" ".join(r[0])[:60] for r in ROWS])
def test_user_mistake_gets_a_clear_error(argv: List[str], fragments: List[str], files,
                                         no_demo_run, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    tmp = str(files)
    argv = [a.replace("{tmp}", tmp) for a in argv]
    # a "demo" row is the lab's `python -m lab.demo`, the rest the shipped command line
    status = demo_main(argv[1:]) if argv[0] == "demo" else main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "OK" not in out and "Traceback" not in err
    for fragment in fragments:  # errors on stderr; check's violation list is its result: stdout
        assert fragment.replace("{tmp}", tmp) in (err if "error:" in err else out), (out, err)
    if argv[0] == "demo" or "error:" in err:
        assert len(err.strip().splitlines()) == 1, err  # one line, not a report


def test_demo_policy_typo_is_argparse_choice_error() -> None:
    run = subprocess.run([sys.executable, "-m", "lab.demo", "--policy", "eager"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--policy: invalid choice: 'eager' (choose from" in run.stderr
    assert "Traceback" not in run.stderr


# --- no user-facing text names a file that is not shipped ---------------------------------------

#: Example names (what a user would pass) and upstream files, not files of this project.
EXAMPLE_NAMES = {"telemetry.jsonl", "CONFIG.yaml", "main.py"}
FILE_NAME = re.compile(r"[\w./-]+\.(?:md|yaml|yml|py|sh|txt|toml|json|jsonl)\b")


def tracked_files() -> List[str]:
    """The files a clone has (git ls-files); every file on disk outside git."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return listed.stdout.split() or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]


def test_package_text_names_only_files_that_exist() -> None:
    paths = tracked_files()
    known = set(paths) | {Path(p).name for p in paths} | EXAMPLE_NAMES
    unknown = []
    sources = [ROOT / p for p in paths if p.startswith("nemo_fp8_align/") and p.endswith(".py")]
    for path in sorted(sources):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in FILE_NAME.findall(node.value):
                    if name not in known and Path(name).name not in known:
                        unknown.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert unknown == []
