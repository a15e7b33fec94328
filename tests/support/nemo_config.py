"""The NeMo config the startup check's tests start from, and a helper to read one violation.
Used by ``tests/test_check.py`` and ``tests/test_check_fixes.py``."""

from omegaconf import OmegaConf


def seed_config(**model_overrides):
    """The seed's settings plus the design example: PP=4, VP=2, 8 GPUs (DP=2), M = 16 / 2 = 8."""
    cfg = OmegaConf.create({
        "trainer": {"devices": 8, "num_nodes": 1, "precision": "bf16"},
        "model": {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 4,
            "virtual_pipeline_model_parallel_size": 2,
            "num_layers": 16,
            "micro_batch_size": 1,
            "global_batch_size": 16,
            "megatron_amp_O2": True,
            "mcore_gpt": True,
            "transformer_engine": True,
            "fp8": True,
            "fp8_hybrid": True,
            "fp8_params": True,
            "optim": {"name": "distributed_fused_adam", "overlap_param_sync": True,
                      "overlap_grad_sync": True},
        },
    })
    for key, value in model_overrides.items():
        OmegaConf.update(cfg, "model." + key, value, force_add=True)
    return cfg


def only(violations):
    assert len(violations) == 1, "\n".join(map(str, violations))
    return violations[0]
