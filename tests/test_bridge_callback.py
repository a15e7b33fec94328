"""The Megatron-Bridge callback: its config mapping onto the startup rules, with megatron-core's
real config classes, and Bridge's own CallbackManager registering and firing it where
megatron-bridge imports (it needs transformers >= 5.8; not in CI)."""

from types import SimpleNamespace

import torch

import pytest

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations  # noqa: E402
from nemo_fp8_align.integrations.bridge import FP8TransposeAlignCallback, bridge_args  # noqa: E402


def _cfg(**ddp):
    model = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                              pipeline_model_parallel_size=2,
                              virtual_pipeline_model_parallel_size=2, fp8="hybrid",
                              pipeline_dtype=torch.bfloat16)
    settings = dict(use_distributed_optimizer=True, overlap_param_gather=True,
                    overlap_grad_reduce=True, align_param_gather=True, fp8_param_gather=True)
    settings.update(ddp)
    # Megatron-Bridge's ConfigContainer (and its train/logger nodes): megatron-bridge is not
    # installed (it needs transformers >= 5.8); the real megatron-core configs go inside.
    return SimpleNamespace(
        model=model, ddp=DistributedDataParallelConfig(**settings),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=16, rampup_batch_size=None),
        logger=SimpleNamespace(log_interval=10))


def test_a_valid_bridge_config_passes_the_startup_rules():
    assert megatron_lm_violations(vars(bridge_args(_cfg())), world_size=4) == []


@pytest.mark.parametrize("ddp, flag", [
    (dict(overlap_param_gather=False), "--overlap-param-gather"),
    (dict(align_param_gather=False), "--no-align-param-gather"),
    (dict(fp8_param_gather=False), "--fp8-param-gather"),
])
def test_bridge_settings_that_stop_the_plugin_are_reported(ddp, flag):
    found = megatron_lm_violations(vars(bridge_args(_cfg(**ddp))), world_size=4)
    assert [v.key for v in found] == [flag]


def test_bridge_callback_manager_registers_and_fires_it():
    callbacks = pytest.importorskip("megatron.bridge.training.callbacks",
                                    reason="megatron-bridge (needs transformers >= 5.8)")
    seen = []

    class Recording(FP8TransposeAlignCallback):
        def on_data_init_start(self, context):
            seen.append(context.model)

    manager = callbacks.CallbackManager()
    manager.add(Recording())
    assert isinstance(Recording(), callbacks.Callback)
    manager.fire("on_data_init_start", callbacks.CallbackContext(state=None, model=["m"]))
    assert seen == [["m"]]


def test_align_config_is_checked_in_the_constructor():
    with pytest.raises(TypeError, match="AlignConfig"):
        FP8TransposeAlignCallback(align_config={"policy": "aligned"})
