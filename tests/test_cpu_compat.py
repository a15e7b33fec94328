import pytest
import torch

from lab.demo.cpu_redirects import enable_cpu_compat


def test_redirects_and_undo():
    original_type = torch.Tensor.type
    compat = enable_cpu_compat()
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        torch.cuda.synchronize()
    finally:
        compat.undo()
        compat.undo()  # idempotent
    assert torch.Tensor.type is original_type
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_refuses_on_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="refuses to patch"):
        enable_cpu_compat()


def test_current_stream_is_a_host_stand_in_and_undone():
    # megatron-core 0.19's start_grad_sync waits on the current stream's events unconditionally.
    original = torch.cuda.current_stream
    compat = enable_cpu_compat()
    try:
        stream = torch.cuda.current_stream()
        stream.wait_event(object())
        stream.wait_stream(stream)
        stream.synchronize()
    finally:
        compat.undo()
    assert torch.cuda.current_stream is original


def test_the_demo_asks_for_a_group_size_only_where_megatron_core_has_one():
    """megatron-core < 0.10's TransformerConfig has no ``microbatch_group_size_per_vp_stage``
    (0.9.0's raised TypeError at the demo's config: seen); there the demo passes none, and a
    ``--group-size`` is refused with the setting named."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from lab.demo.train import _group_size

    assert _group_size(TransformerConfig, 3) == {"microbatch_group_size_per_vp_stage": 3}

    @dataclasses.dataclass
    class PreTenConfig:  # the field set that matters: no group size
        num_layers: int = 0

    assert _group_size(PreTenConfig, None) == {}
    with pytest.raises(ValueError, match=r"--group-size 3: .*< 0.10.* leave --group-size out"):
        _group_size(PreTenConfig, 3)
