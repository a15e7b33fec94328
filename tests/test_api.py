"""align_fp8_transposes' refusals (no process group needed)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_fp8_align.engine.api import align_fp8_transposes  # noqa: E402


def test_overlap_param_gather_with_optimizer_step_is_refused_with_the_reason():
    chunk = torch.nn.Linear(1, 1)
    chunk.ddp_config = SimpleNamespace(overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(ValueError, match="launched by the optimizer step"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, backend=None,
                             weights_of=lambda c: [])
