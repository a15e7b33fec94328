import pytest
import torch

from nemo_fp8_align.demo.cpu_redirects import enable_cpu_compat


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
