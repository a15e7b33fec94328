"""Install: the extras in pyproject.toml, and the one-line hint a missing dependency gives."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from nemo_fp8_align.cli.common import CHECK_NEEDS, missing_dependency
from lab.demo.cli import DEMO_NEEDS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def name_of(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_an_extra_for_each_optional_stack() -> None:
    assert {"hydra", "mcore", "nemo", "te", "test"} <= set(EXTRAS)
    assert {name_of(r) for r in EXTRAS["mcore"]} >= {"megatron-core"}
    assert {name_of(r) for r in EXTRAS["hydra"]} == {"hydra-core", "omegaconf"}
    assert {name_of(r) for r in EXTRAS["te"]} == {"transformer-engine"}


def test_extras_pin_the_tested_versions() -> None:
    pins = {name_of(r): r for extra in EXTRAS.values() for r in extra}
    # A range: every megatron-core line the project ran (0.7.0-0.12.3, 0.16.1, 0.17.1-0.19.2).
    assert pins["megatron-core"] == "megatron-core>=0.7.0,<0.20"
    assert pins["transformer-engine"] == "transformer-engine[pytorch]==2.20.2"
    assert "1.3.2" in pins["hydra-core"] and "2.3.0" in pins["omegaconf"]
    # The nemo extra carries the CPU stack CI installs (requirements/cpu.txt), version for version.
    lines = [line.strip() for line in (ROOT / "requirements" / "cpu.txt").open()]
    cpu = {name_of(line): line for line in lines if line and not line.startswith("#")}
    for requirement in EXTRAS["nemo"]:
        assert cpu.get(name_of(requirement)) == requirement, requirement


def test_no_extra_names_torch_and_ci_installs_none() -> None:
    # An extra naming torch could pull a multi-GB CUDA build over the pinned CPU one.
    for extra, requirements in EXTRAS.items():
        assert "torch" not in {name_of(r) for r in requirements}, extra
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"pip install[^\n]*\.\[", makefile)


@pytest.mark.parametrize("needs", [CHECK_NEEDS, DEMO_NEEDS])
def test_hints_name_extras_that_exist(needs) -> None:
    for _module, _distribution, extra in needs:
        assert extra in EXTRAS


def test_missing_dependency_is_one_line_naming_the_extra() -> None:
    needs = (("omegaconf", "omegaconf", "hydra"), ("no_such_module_xyz", "no-such-dist", "mcore"))
    assert missing_dependency("demo", needs) == (
        "'demo' needs no-such-dist, which is not installed: pip install 'nemo_fp8_align[mcore]'")
    assert missing_dependency("check", (("no_such_parent.sub", "x", "hydra"),)).endswith(
        "pip install 'nemo_fp8_align[hydra]'")
    assert missing_dependency("check", CHECK_NEEDS) is None  # installed here


# Runs the CLI with the named modules made unimportable (a meta-path finder that refuses them),
# as on a machine where they were never installed.
HIDE = textwrap.dedent("""
    import sys
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {hidden!r}:
                raise ModuleNotFoundError(name)
    sys.meta_path.insert(0, Hide())
    for m in list(sys.modules):
        if m.split('.')[0] in {hidden!r}:
            del sys.modules[m]
    from {module} import main
    sys.exit(main({argv!r}))
""")


@pytest.mark.parametrize("hidden,module,argv,extra,distribution", [
    (["hydra"], "nemo_fp8_align.cli", ["check", "conf/megatron_gpt_fp8_align.yaml"], "hydra",
     "hydra-core"),
    (["omegaconf", "hydra"], "nemo_fp8_align.cli", ["check", "conf/megatron_gpt_fp8_align.yaml"],
     "hydra", "omegaconf"),
    (["megatron"], "lab.demo.cli", [], "mcore", "megatron-core"),  # python -m lab.demo
])
def test_cli_without_a_dependency_prints_one_line(hidden, module, argv, extra,
                                                  distribution) -> None:
    code = HIDE.format(hidden=set(hidden), module=module, argv=argv)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert f"needs {distribution}, which is not installed" in lines[0]
    assert lines[0].endswith(f"pip install 'nemo_fp8_align[{extra}]'")
    assert "Traceback" not in run.stderr


def test_mcore_extra_accepts_every_line_make_test_runs() -> None:
    """The Makefile's megatron-core lines (run by make test, 0.7.0 and 0.8.0 through the
    optimizer's all-gather hold) satisfy the [mcore] extra, and its lower bound is the oldest."""
    import re

    from packaging.requirements import Requirement

    spec = Requirement(next(r for r in EXTRAS["mcore"] if name_of(r) == "megatron-core")).specifier
    make = (ROOT / "Makefile").read_text()

    def line(name):
        return re.search(rf"^{name} \?= (.*)$", make, re.M).group(1).split()

    ran = (line("MCORE_LINES") + line("MCORE_OLD_LINES") + line("MCORE_OPTIMIZER_LINES")
           + ["0.12.3", "0.16.1", "0.19.2"])
    assert {"0.7.0", "0.8.0", "0.9.0"} <= set(ran) and all(spec.contains(v) for v in ran), \
        (spec, ran)
    assert not spec.contains("0.6.0")  # never run: below the oldest line
