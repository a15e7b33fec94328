"""The CPU stand-in for TE's FP8 Linear (support.reference_fp8_layers), in one gloo
process with megatron-core's parallel state: its GEMMs read the FP8 data and the cached FP8
transpose, so a wrong or stale transpose changes the gradient, and stale bytes raise."""

import socket

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

from support import reference_fp8_layers as layers  # noqa: E402
from nemo_fp8_align.backends.reference import StaleFP8Error  # noqa: E402


@pytest.fixture(scope="module")
def model_parallel():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def column(check_provenance=True):
    torch.manual_seed(0)
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    return layers.ReferenceFP8ColumnParallelLinear(
        8, 16, config=config, init_method=torch.nn.init.normal_, bias=True, gather_output=False,
        skip_bias_add=False, check_provenance=check_provenance)


def test_forward_reads_the_fp8_data_and_dgrad_the_cached_transpose(model_parallel):
    layer = column()
    x = torch.randn(3, 2, 8, requires_grad=True)
    y, _ = layer(x)
    fp8 = layer.fp8_weight
    assert fp8.transpose_valid and fp8.transposes_built == 1  # built at first use
    assert torch.equal(y, x @ fp8.dequantized().t() + layer.bias)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    assert torch.equal(dx, dy @ fp8.dequantized_transpose().t())
    fp8.transpose.copy_(torch.roll(fp8.transpose.float(), 1, 0).to(fp8.transpose.dtype))
    (dx_wrong,) = torch.autograd.grad(y, x, dy)
    assert not torch.equal(dx, dx_wrong)  # the backward reads the cached transpose


def test_bytes_changed_after_the_build_raise_or_change_the_result(model_parallel):
    layer = column()
    x = torch.randn(3, 2, 8)
    y_before, _ = layer(x)
    with torch.no_grad():
        layer.weight.add_(0.5)  # an all-gather delivering after the FP8 copy was taken
    with pytest.raises(StaleFP8Error, match="not the current ones"):
        layer(x)
    unchecked = column(check_provenance=False)
    y0, _ = unchecked(x)
    with torch.no_grad():
        unchecked.weight.add_(0.5)
    assert torch.equal(unchecked(x)[0], y0)  # computed with the stale copy
    layers.invalidate_reference_fp8_weights([unchecked])  # what the training loop does
    assert not torch.equal(unchecked(x)[0], y0) and unchecked.fp8_weight.transposes_built == 2
    assert y_before.shape == y0.shape


def test_spec_swaps_exactly_the_transformer_layer_linears():
    spec = layers.with_reference_fp8_linears(get_gpt_layer_local_spec())
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    found = {name: (s.module, s.params) for name, s in (
        ("qkv", attn.linear_qkv), ("proj", attn.linear_proj), ("fc1", mlp.linear_fc1),
        ("fc2", mlp.linear_fc2))}
    col, row = layers.ReferenceFP8ColumnParallelLinear, layers.ReferenceFP8RowParallelLinear
    assert found == {"qkv": (col, {"check_provenance": True}),
                     "proj": (row, {"check_provenance": True}),
                     "fc1": (col, {"check_provenance": True}),
                     "fc2": (row, {"check_provenance": True})}
    assert attn.core_attention is get_gpt_layer_local_spec().submodules.self_attention \
        .submodules.core_attention


def test_refuses_on_a_gpu_machine(model_parallel, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="refuses to build on a machine with a GPU"):
        column()
