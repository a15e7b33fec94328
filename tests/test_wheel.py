"""The wheel is the plugin: built from the checkout, installed alone into a fresh virtual
environment, every command it ships runs there.

The fresh environment sees the heavy dependencies (torch, omegaconf, Hydra, megatron-core) of
the environment running the tests through a ``.pth`` line naming that environment's
site-packages. A directory added by a ``.pth`` line does not get its own ``.pth`` files run, so
the tests' editable install of the checkout (a ``.pth`` hook) is not seen there: the package
imported is the wheel's, which the test asserts, and every command runs from a directory
outside the checkout with no ``PYTHONPATH``. A module the package reached in the checkout only
(lab/, validation/, tests/) would fail here as in a user's ``pip install``.
"""

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support.wheel import PACKAGE, ROOT, build_wheel

pytestmark = pytest.mark.slow

DATA = ROOT / "tests" / "data"

#: Each command ``nemo-fp8-align --help`` lists, its runs from the installed wheel:
#: (arguments, expected exit status, a line its output must hold).
RUNS = {
    "check": [
        ([str(ROOT / "conf" / "megatron_gpt_fp8_align.yaml")], 0, "OK (policy=aligned)"),
        ([str(ROOT / "conf" / "launcher" / "gpt3_175b_fp8_align.yaml")], 0,
         "OK (policy=aligned)"),
        # Megatron-LM's arguments, one precondition missing: the violation and its fix
        (["--megatron-lm", "--", "--pipeline-model-parallel-size", "2",
          "--num-layers-per-virtual-pipeline-stage", "2", "--num-layers", "8",
          "--use-distributed-optimizer", "--overlap-param-gather", "--fp8-format", "hybrid",
          "--fp8-param-gather", "--micro-batch-size", "1", "--global-batch-size", "8"], 2,
         "--overlap-grad-reduce"),
    ],
    "plan": [
        (["--layers", "8", "--hidden", "1024", "--heads", "16", "--ffn", "4096", "--seq", "1024",
          "--tp", "1", "--pp", "2", "--vp", "2", "--dp", "1", "--global-batch", "8"], 0,
         "8 layers, hidden 1024"),
    ],
    "report": [
        ([str(DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl")], 0,
         "OK: every record passes the invariants"),
        ([str(DATA / "telemetry_observed_pp2_vp2_dp2_slot_shift_unreported.jsonl")], 1, "FAILED"),
    ],
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh environment's ``bin``, a working directory outside the checkout, the
    environment variables to run with)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp / "build")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # the tests' pip installs into the fresh environment (--python): no pip bootstrap there
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    (Path(site.stdout.strip()) / "host_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return venv / "bin", cwd, env


def _run(installed, argv, timeout=120):
    bin_dir, cwd, env = installed
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_package_imported_is_the_wheels(installed):
    bin_dir, _, _ = installed
    where = _run(installed, ["python", "-c", f"import {PACKAGE}, torch, omegaconf, "
                             f"megatron.core; print({PACKAGE}.__file__)"])
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(bin_dir.parent), where.stdout
    assert not Path(where.stdout.strip()).is_relative_to(ROOT)
    # nor is anything of the checkout importable there: the lab, validation, the tests' support
    for name in ("lab", "validation", "support"):
        found = _run(installed, ["python", "-c", f"import {name}"])
        assert found.returncode == 1 and "ModuleNotFoundError" in found.stderr, name


def test_help_lists_exactly_the_commands_run_here(installed):
    """Every command the installed CLI ships is run below; one added to the CLI and not here
    fails this test. ``demo`` is the lab's (``python -m lab.demo``), not a shipped command."""
    helped = _run(installed, ["nemo-fp8-align", "--help"])
    assert helped.returncode == 0, helped.stderr
    listed = re.search(r"\{([\w,-]+)\}", helped.stdout).group(1).split(",")
    assert sorted(listed) == sorted(RUNS) and "demo" not in listed
    as_module = _run(installed, ["python", "-m", PACKAGE, "--help"])
    assert as_module.returncode == 0 and f"{{{','.join(listed)}}}" in as_module.stdout


@pytest.mark.parametrize("command,argv,status,says", [
    pytest.param(command, argv, status, says, id=f"{command}-{i}")
    for command, runs in RUNS.items() for i, (argv, status, says) in enumerate(runs)])
def test_each_shipped_command_runs_from_the_wheel(installed, command, argv, status, says):
    run = _run(installed, ["nemo-fp8-align", command, *argv])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == status, (run.stdout[-3000:], run.stderr[-3000:])
    assert says in run.stdout + run.stderr, run.stdout[-3000:]
