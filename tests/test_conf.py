"""The shipped configs: compose with Hydra, pass (or, for the base config, fail) the check, and
hold only keys that NeMo 2.3.3 / megatron-core 0.12.3 actually read."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.config_check.check import align_config_from, find_violations
from nemo_fp8_align.config_check.structured import (BLOCK_KEY, GROUP, NAME, AlignBlock, block_schema,
                                            register_configs)

CONF = Path(__file__).resolve().parents[1] / "conf"
# The launcher YAML names /opt/NeMo/... in hydra.searchpath, as NeMo-Framework-Launcher's do.
pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")


def composed(name: str, *overrides: str, config_dir: Path = CONF) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


# --- structured config of the plugin block ---

def test_block_schema_is_built_from_align_config():
    schema = block_schema()
    defaults = AlignConfig()
    assert list(schema.keys()) == [f.name for f in dataclasses.fields(AlignConfig)]
    for f in dataclasses.fields(AlignConfig):
        value = getattr(defaults, f.name)
        assert schema[f.name] == (value.value if isinstance(value, Policy) else value)
    assert AlignConfig(**OmegaConf.to_container(schema)) == defaults


def test_block_is_registered_in_the_config_store():
    from hydra.core.config_store import ConfigStore

    register_configs()
    register_configs()  # idempotent
    node = ConfigStore.instance().load(f"{GROUP}/{NAME}.yaml").node
    assert OmegaConf.get_type(node) is AlignBlock


def test_schema_rejects_unknown_keys():
    with pytest.raises(Exception, match="polcy"):
        OmegaConf.merge(block_schema(), {"polcy": "lazy"})


# --- megatron_gpt_fp8_align.yaml ---

def test_fp8_align_config_composes_and_passes():
    cfg = composed("megatron_gpt_fp8_align")
    assert find_violations(cfg) == []
    assert align_config_from(cfg) == AlignConfig()
    # Its block is the structured one (typed), and keys of the base config are kept.
    assert OmegaConf.get_type(cfg.model[BLOCK_KEY]) is AlignBlock
    assert cfg.model.hidden_size == 768 and cfg.model.data.seq_length == 1024
    # M = 16 / (1 * DP 8 / (TP 1 * PP 2)) = 4.
    InterleavedSchedule(cfg.model.pipeline_model_parallel_size,
                        cfg.model.virtual_pipeline_model_parallel_size, 4)


def test_fp8_align_block_can_be_overridden_and_typos_fail_at_compose():
    cfg = composed("megatron_gpt_fp8_align", "model.fp8_transpose_align.policy=lazy")
    assert align_config_from(cfg).policy is Policy.LAZY
    with pytest.raises(Exception, match="polcy"):
        composed("megatron_gpt_fp8_align", "model.fp8_transpose_align.polcy=lazy")


def test_base_config_composes_and_is_not_enough_for_the_plugin():
    cfg = composed("megatron_gpt_config")
    keys = {v.key for v in find_violations(cfg)}
    assert {"model.fp8", "model.fp8_params", "model.optim.name",
            "model.virtual_pipeline_model_parallel_size"} <= keys
    OmegaConf.resolve(cfg)  # every interpolation in the base config resolves on its own


# --- the NeMo-Framework-Launcher GPT-3 175B config ---

def test_launcher_config_passes_with_its_batch_arithmetic():
    cfg = composed("gpt3_175b_fp8_align", config_dir=CONF / "launcher")
    assert set(cfg) >= {"run", "trainer", "exp_manager", "model"}
    model, trainer = cfg.model, cfg.trainer
    assert (model.tensor_model_parallel_size, model.pipeline_model_parallel_size,
            model.virtual_pipeline_model_parallel_size) == (4, 8, 6)
    assert model.fp8_params is True and model[BLOCK_KEY].enabled is True
    dp = trainer.num_nodes * trainer.devices // (4 * 8)
    m = model.global_batch_size // (model.micro_batch_size * dp)
    assert (dp, m) == (32, 64)
    InterleavedSchedule(8, 6, m)
    assert (model.num_layers // 8) % 6 == 0
    assert find_violations(cfg) == []


def test_launcher_config_rejects_a_batch_that_breaks_the_schedule():
    cfg = composed("gpt3_175b_fp8_align", "model.global_batch_size=2000",
                   config_dir=CONF / "launcher")  # M = 62.5
    assert [v.key for v in find_violations(cfg)] == ["model.global_batch_size"]


# --- every key is one NeMo 2.3.3 / megatron-core 0.12.3 knows ---

def _source_words() -> set:
    spec = importlib.util.find_spec("nemo")
    core = importlib.util.find_spec("megatron")
    if spec is None or core is None or not spec.submodule_search_locations:
        pytest.skip("nemo_toolkit / megatron-core not installed")
    site = Path(next(iter(spec.submodule_search_locations))).parent
    words: set = set()
    for sub in ("nemo/collections/nlp", "nemo/core", "nemo/utils", "nemo/lightning",
                "megatron/core"):
        for path in (site / sub).rglob("*.py"):
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text(errors="ignore")))
    return words


def _keys(node: DictConfig, prefix: str = ""):
    for key in node.keys():
        yield prefix + str(key)
        value = node._get_node(key)
        if isinstance(value, DictConfig) and key not in ("checkpoint_callback_params",
                                                         "wandb_logger_kwargs", BLOCK_KEY):
            yield from _keys(value, f"{prefix}{key}.")


@pytest.mark.parametrize("path", ["megatron_gpt_config.yaml", "megatron_gpt_fp8_align.yaml",
                                  "launcher/gpt3_175b_fp8_align.yaml"])
def test_config_keys_are_read_by_nemo_or_megatron(path):
    words = _source_words()
    cfg = OmegaConf.load(CONF / path)
    launcher_only = {"defaults", "hydra", "run"}
    unknown = [key for key in _keys(cfg) if key.split(".")[0] not in launcher_only
               and key.rsplit(".", 1)[-1] not in words and key != f"model.{BLOCK_KEY}"]
    assert unknown == []
