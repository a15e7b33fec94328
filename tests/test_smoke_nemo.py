"""The CI smoke run of the NeMo integration (scripts/smoke_nemo.sh) as a test.

Real NeMo 2.3.3 MegatronGPTModel on CPU, 2 gloo processes, PP=2, VP=2, mcore_distributed_optim,
3 steps, three runs (mixin, callback, plugin off): about a minute on 2 cores.
"""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.nemo, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_nemo(tmp_path):
    pytest.importorskip("nemo.collections.nlp.models.language_modeling.megatron_gpt_model",
                        reason="needs nemo_toolkit 2.3.3 (MegatronGPTModel)")
    env = dict(os.environ, PYTHON=sys.executable, SMOKE_DIR=str(tmp_path))
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "smoke_nemo.sh")], env=env,
                         capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "smoke_nemo: OK" in out.stdout
    for run in ("aligned", "callback"):
        assert f"Alignment report, run '{run}'" in out.stdout
