"""align_fp8_transposes' startup checks on megatron-core's real config class (no process group
needed). The refusal table's rows are in tests/test_refusals.py; the optimizer-step all-gather
(once refused here on a made-up config attribute) is supported: tests/test_gather_with_optimizer.py."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes  # noqa: E402
from support.one_process import agree_alone  # noqa: E402


def test_a_telemetry_path_shared_by_several_ranks_is_refused(monkeypatch, tmp_path):
    from nemo_fp8_align.config import AlignConfig

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    agree_alone(monkeypatch)  # no process group: this rank's own error, as with one rank
    chunk = torch.nn.Linear(1, 1)
    config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2)
    config.param_sync_func = [print, print]
    with pytest.raises(ValueError, match=r"AlignConfig.telemetry_path=.* has no \{rank\} but 2 "
                                         r"ranks.*Fix: AlignConfig.telemetry_path=<dir>"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, backend=None,
                             weights_of=lambda c: [], config=config,
                             align_config=AlignConfig(telemetry_path=str(tmp_path / "t.jsonl")))
    assert config.param_sync_func == [print, print] and not chunk._forward_pre_hooks


def test_a_refused_attach_leaves_no_telemetry_file(tmp_path):
    """Issue 40: the startup check of the telemetry path created the file (it opened it to see
    that it could), so a refused attach (here: no Transformer Engine for the default backend)
    left an empty telemetry file behind; so did ``policy=off``, which runs the same check."""
    from nemo_fp8_align.config import AlignConfig

    chunk = torch.nn.Linear(1, 1)
    config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2)
    config.param_sync_func = [print, print]
    path = tmp_path / "t.jsonl"
    with pytest.raises(ImportError, match="Transformer Engine is not importable"):
        align_fp8_transposes([chunk, chunk], num_microbatches=4, config=config,
                             align_config=AlignConfig(telemetry_path=str(path)))
    assert not path.exists()
