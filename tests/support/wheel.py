"""The project's wheel, built as a release would build it: shared by the wheel allow-list
(tests/test_layout.py) and the install-and-run test (tests/test_wheel.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "nemo_fp8_align"
#: The checkout's Python folders that are not the plugin: run from a checkout, never shipped.
BESIDE = ("lab", "validation", "benchmarks", "tests")


def build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of the sources: an in-tree build would also pack whatever a
    stale ``build/`` or ``*.egg-info`` left there. The copy holds the package, the folders of
    Python beside it that must stay out of the wheel (pyproject.toml's packages.find is what
    keeps them out), and what the build reads (pyproject.toml, README.md)."""
    src = out / "src"
    for folder in (PACKAGE, *BESIDE):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = out.glob("*.whl")
    return wheel
