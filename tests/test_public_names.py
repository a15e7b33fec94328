"""The package's public names: what a training script calls or catches, nothing internal, and
``import nemo_fp8_align`` imports no training framework (nor torch)."""

import importlib
import subprocess
import sys

import pytest

import nemo_fp8_align

PUBLIC = {
    "align_fp8_transposes", "FP8TransposeAlignment", "FP8TransposeAlignMixin",
    "AlignConfig", "Policy", "TEBackend", "check_config", "FP8AlignConfigError",
    "CudaGraphCaptureError", "ScheduleError", "ScheduleRebindError",
    "SharedEmbeddingBucketError", "StepMismatchError", "TransposeVerifyError",
    "UnsupportedSetupError",
}
HEAVY = ("torch", "megatron", "nemo", "lightning", "pytorch_lightning", "transformer_engine",
         "omegaconf", "hydra", "apex")


def test_all_is_the_documented_public_names():
    assert set(nemo_fp8_align.__all__) == PUBLIC
    assert len(nemo_fp8_align.__all__) == len(PUBLIC)
    assert PUBLIC <= set(dir(nemo_fp8_align))


def test_importing_the_package_imports_no_framework():
    code = ("import sys, nemo_fp8_align; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_resolves_to_its_module_object(name):
    value = getattr(nemo_fp8_align, name)
    module = importlib.import_module(value.__module__)
    assert getattr(module, name) is value


@pytest.mark.parametrize("name,module", [("TransposeAligner", "core.aligner"),
                                         ("ReferenceBackend", "backends.reference"),
                                         ("StaleFP8Error", "errors")])
def test_internal_names_are_not_exported_but_live_in_their_module(name, module):
    with pytest.raises(AttributeError, match=f"no attribute '{name}'$"):
        getattr(nemo_fp8_align, name)
    assert hasattr(importlib.import_module(f"nemo_fp8_align.{module}"), name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'$"):
        nemo_fp8_align.no_such_name  # noqa: B018
