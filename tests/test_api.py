"""align_fp8_transposes' refusals (no process group needed)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_fp8_align.integrations.megatron import align_fp8_transposes  # noqa: E402


def test_overlap_param_gather_with_optimizer_step_is_refused_with_the_reason():
    chunk = torch.nn.Linear(1, 1)
    chunk.ddp_config = SimpleNamespace(overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(ValueError, match="launched by the optimizer step"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, backend=None,
                             weights_of=lambda c: [])


@pytest.mark.parametrize("scope", ["full_iteration", ["full_iteration"],
                                   [SimpleNamespace(name="full_iteration")]])
def test_whole_step_cuda_graphs_are_refused_before_anything_is_wrapped(scope):
    # megatron-core 0.16's cuda_graph_scope=full_iteration: a str, a list, or CudaGraphScope enums.
    chunk = torch.nn.Linear(1, 1)
    config = SimpleNamespace(cuda_graph_scope=scope, param_sync_func=[print, print])
    with pytest.raises(ValueError, match="full_iteration.*per-layer CUDA graphs"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, backend=None,
                             weights_of=lambda c: [], config=config)
    assert config.param_sync_func == [print, print] and not chunk._forward_pre_hooks


def test_a_telemetry_path_shared_by_several_ranks_is_refused(monkeypatch, tmp_path):
    from nemo_fp8_align.config import AlignConfig

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    chunk = torch.nn.Linear(1, 1)
    config = SimpleNamespace(param_sync_func=[print, print])
    with pytest.raises(ValueError, match=r"AlignConfig.telemetry_path=.* has no \{rank\} but 2 "
                                         r"ranks.*Fix: AlignConfig.telemetry_path=<dir>"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, backend=None,
                             weights_of=lambda c: [], config=config,
                             align_config=AlignConfig(telemetry_path=str(tmp_path / "t.jsonl")))
    assert config.param_sync_func == [print, print] and not chunk._forward_pre_hooks
