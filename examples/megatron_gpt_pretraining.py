"""NeMo 1.x-style GPT pretraining with aligned FP8 weight transposes.

The same flow as NeMo's ``examples/nlp/language_modeling/megatron_gpt_pretraining.py``
(``hydra_runner`` -> ``MegatronTrainerBuilder`` -> ``exp_manager`` -> model -> ``trainer.fit``),
with the model class extended by :class:`~nemo_fp8_align.integrations.nemo.mixin.FP8TransposeAlignMixin`.
Everything is driven by Hydra overrides on a config under ``conf/``::

    torchrun --nproc-per-node 4 examples/megatron_gpt_pretraining.py \\
        --config-name megatron_gpt_cpu_smoke model.fp8_transpose_align.policy=aligned

With ``trainer.accelerator=cpu`` the NeMo-on-CPU patches of
:mod:`support.cpu_nemo` are switched on first (tests and the CPU smoke run only):
no Transformer Engine there, so the transformer layers compute through reference FP8 weights and
the model class says so (:class:`MegatronGPTFP8AlignReferenceModel`). ``fp8_align_via=callback``
attaches the plugin as the :class:`~nemo_fp8_align.integrations.nemo.callback.FP8TransposeAlignment` callback
on NeMo's plain ``MegatronGPTModel`` instead. NeMo's stock script, with no change at all, is
``examples/stock_megatron_gpt_pretraining.py``.
"""

from __future__ import annotations

import json
import os
import sys

from lightning.pytorch import Callback
from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
from nemo.collections.nlp.parts.megatron_trainer_builder import MegatronTrainerBuilder
from nemo.core.config import hydra_runner
from nemo.utils import logging
from nemo.utils.exp_manager import exp_manager
from omegaconf import OmegaConf

# Run as a script from a checkout: make the package importable without installing it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from nemo_fp8_align.integrations.nemo.callback import FP8TransposeAlignment  # noqa: E402
from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin, FP8Weights  # noqa: E402
from nemo_fp8_align.config_check.structured import register_configs  # noqa: E402

# The model.fp8_transpose_align block is a structured config: register it before Hydra composes.
register_configs()


class MegatronGPTFP8AlignModel(FP8TransposeAlignMixin, MegatronGPTModel):
    """MegatronGPTModel whose FP8 transposes are built at the aligned schedule slot."""


class MegatronGPTFP8AlignReferenceModel(MegatronGPTFP8AlignModel):
    """CPU runs, where Transformer Engine is absent: the aligner builds the reference FP8 weights
    the transformer layers compute with (support.reference_fp8_layers: forward GEMM
    on the FP8 data, data-gradient GEMM on the cached transpose)."""

    fp8_align_weights = FP8Weights.REFERENCE


class LossReport(Callback):
    """Writes each step's ``reduced_train_loss`` (rank 0 holds it) to ``<report_dir>/loss.jsonl``,
    for the smoke run's plugin-on / plugin-off comparison. Enabled by ``report_dir=<dir>``."""

    def __init__(self, report_dir: str) -> None:
        self.path = os.path.join(report_dir, "loss.jsonl")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.callback_metrics.get("reduced_train_loss")
        if trainer.global_rank != 0 or loss is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")


@hydra_runner(config_path="../conf", config_name="megatron_gpt_fp8_align")
def main(cfg) -> None:
    logging.info("\n\n************** Experiment configuration ***********")
    logging.info(f"\n{OmegaConf.to_yaml(cfg)}")
    on_cpu = cfg.trainer.get("accelerator") == "cpu"
    if on_cpu:
        # The CPU patches are test scaffolding (tests/support/), not part of the package.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
        from support.cpu_nemo import enable_nemo_cpu_compat

        enable_nemo_cpu_compat()
    weights = FP8Weights.REFERENCE if on_cpu else FP8Weights.TE
    report_dir = cfg.get("report_dir")
    callbacks = [LossReport(report_dir)] if report_dir else []
    via_callback = cfg.get("fp8_align_via", "mixin") == "callback"
    if via_callback:
        # The same plugin for models that are not subclassed: it reads the same block.
        callbacks.append(FP8TransposeAlignment(weights=weights))
        model_cls = MegatronGPTModel
    else:
        model_cls = MegatronGPTFP8AlignReferenceModel if on_cpu else MegatronGPTFP8AlignModel
    trainer = MegatronTrainerBuilder(cfg).create_trainer(callbacks=callbacks or None)
    exp_manager(trainer, cfg.exp_manager)
    model = model_cls(cfg.model, trainer)
    trainer.fit(model)
    if on_cpu:  # gloo ranks tear their groups down together before exiting (test scaffolding)
        from support.run_nemo_cpu import leave_together

        leave_together()


if __name__ == "__main__":
    main()
