"""The refusal table (support.py) on megatron-core's own config classes, on every
version in CI: each row fires for the setting built the way megatron-core accepts it on that
version, and where megatron-core has no such setting, megatron-core itself rejects it."""

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from packaging.version import Version  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.errors import UnsupportedSetupError  # noqa: E402
from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes  # noqa: E402
from nemo_fp8_align.support import REFUSALS, Setup, fired  # noqa: E402

from nemo_fp8_align.mcore_versions import installed_version  # noqa: E402

# megatron-core 0.7.0 has no megatron.core.__version__ (its package_info has).
MCORE = Version(Version(installed_version()).base_version)
FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
BASE = dict(num_layers=4, hidden_size=8, num_attention_heads=2)
MOE = dict(num_moe_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
           bf16=True, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
           pipeline_dtype=torch.bfloat16)

#: (row key, TransformerConfig arguments, megatron-core versions that accept them)
CASES = [
    ("whole_step_graphs_scope", dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
     lambda v: Version("0.16") <= v < Version("0.18")),
    ("whole_step_graphs_scope", dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]),
     lambda v: Version("0.16") <= v < Version("0.18")),
    # >= 0.18: __post_init__ migrates the deprecated scope to cuda_graph_impl, still refused.
    ("whole_step_graphs_impl", dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"),
     lambda v: v >= Version("0.18")),
    ("whole_step_graphs_impl", dict(cuda_graph_impl="full_iteration"),
     lambda v: v >= Version("0.18")),
    ("combined_1f1b", dict(overlap_moe_expert_parallel_comm=True, **MOE),
     lambda v: v >= Version("0.16")),
]


def _why_not_built(kwargs, err=None):
    """The skip reason of a case this version cannot build: the fields it lacks, else its own
    rejection."""
    missing = sorted(set(kwargs) - FIELDS)
    if missing:
        return f"megatron-core {MCORE} has no TransformerConfig field {', '.join(missing)}"
    if err is not None:
        return f"megatron-core {MCORE} rejects {kwargs} ({type(err).__name__}: {err})"
    return f"megatron-core {MCORE} does not take {kwargs} as this row's setting"


@pytest.mark.parametrize("key,kwargs,accepts", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_row_fires_on_the_real_config_where_megatron_core_has_the_setting(key, kwargs,
                                                                               accepts):
    row = next(r for r in REFUSALS if r.key == key)
    if not accepts(MCORE):
        # The setting cannot be expressed on this version: megatron-core rejects it itself, or
        # (>= 0.18) migrates it to another row's setting, which must then refuse it.
        try:
            config = TransformerConfig(**BASE, **kwargs)
        except (TypeError, AssertionError, ValueError) as err:
            pytest.skip(f"{_why_not_built(kwargs, err)}: nothing for row {key} to refuse")
        assert row.value(Setup(config=config)) is None
        assert fired(Setup(config=config)), f"{kwargs} builds on {MCORE} but no row refuses it"
    else:
        config = TransformerConfig(**BASE, **kwargs)
        messages = fired(Setup(config=config))
        assert row.value(Setup(config=config)) is not None
        assert any(m.startswith(row.setting + "=") and "Fix:" in m for m in messages), messages


def test_default_and_per_layer_configs_fire_nothing():
    assert fired(Setup(config=TransformerConfig(**BASE))) == []
    if "cuda_graph_impl" in FIELDS:  # >= 0.16: per-layer graphs are not refused
        for impl in ("local", "transformer_engine"):
            assert fired(Setup(config=TransformerConfig(**BASE, cuda_graph_impl=impl))) == []
    if "overlap_moe_expert_parallel_comm" in FIELDS:
        assert fired(Setup(config=TransformerConfig(**BASE, **MOE))) == []


def test_versions_without_the_settings_have_no_such_fields():
    if MCORE < Version("0.16"):  # 0.12.3: neither whole-step graphs nor the combined schedule
        assert not {"cuda_graph_impl", "overlap_moe_expert_parallel_comm"} & FIELDS
    else:
        assert {"cuda_graph_impl", "overlap_moe_expert_parallel_comm"} <= FIELDS


@pytest.mark.parametrize("key,kwargs,accepts", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_align_fp8_transposes_refuses_before_anything_is_wrapped(key, kwargs, accepts,
                                                                 monkeypatch):
    """On real DDP chunks (the refusal is the DDP adapter's, before the aligner is built): the
    row's message with its fix, and nothing wrapped, hooked or claimed."""
    from support.ddp_chunks import MICROBATCHES, ddp_chunks

    from nemo_fp8_align.core.aligner import holder_of

    if not accepts(MCORE):
        pytest.skip(_why_not_built(kwargs))
    config = TransformerConfig(**BASE, **kwargs)
    row = next(r for r in REFUSALS if r.key == key)
    with ddp_chunks(monkeypatch) as (chunks, chunk_config, backend):
        config.param_sync_func = bound = list(chunk_config.param_sync_func)
        if hasattr(config, "microbatch_group_size_per_vp_stage"):
            config.microbatch_group_size_per_vp_stage = 2  # N = PP of the stand-in pipeline
        hooks = [len(c._forward_pre_hooks) for c in chunks]
        with pytest.raises(UnsupportedSetupError,
                           match=row.setting.replace(".", r"\.") + ".*Fix:"):
            align_fp8_transposes(chunks, num_microbatches=MICROBATCHES, backend=backend,
                                 weights_of=lambda c: c.module.fp8_weights(), config=config)
        assert config.param_sync_func == bound
        assert [len(c._forward_pre_hooks) for c in chunks] == hooks
        assert all("start_param_sync" not in vars(c) and holder_of(c) is None for c in chunks)


def test_every_row_is_covered_by_a_case():
    assert {r.key for r in REFUSALS} == {c[0] for c in CASES}


@pytest.mark.parametrize("key,kwargs,accepts", CASES[-1:], ids=[CASES[-1][0]])
def test_policy_off_the_fix_every_row_names_attaches_nothing_and_refuses_nothing(
        key, kwargs, accepts, monkeypatch):
    from support.ddp_chunks import MICROBATCHES, ddp_chunks

    from nemo_fp8_align.config import AlignConfig, Policy

    if not accepts(MCORE):
        pytest.skip(_why_not_built(kwargs))
    config = TransformerConfig(**BASE, **kwargs)
    with ddp_chunks(monkeypatch) as (chunks, chunk_config, backend):
        config.param_sync_func = list(chunk_config.param_sync_func)
        if hasattr(config, "microbatch_group_size_per_vp_stage"):
            config.microbatch_group_size_per_vp_stage = 2
        aligner = align_fp8_transposes(chunks, num_microbatches=MICROBATCHES, backend=backend,
                                       weights_of=lambda c: c.module.fp8_weights(),
                                       config=config, align_config=AlignConfig(policy=Policy.OFF))
        assert not aligner.attached
        assert all("start_param_sync" not in vars(c) for c in chunks)
