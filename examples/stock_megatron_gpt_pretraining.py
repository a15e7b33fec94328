"""NeMo 2.3.3's stock GPT pretraining flow, step for step, with nothing of this project in it.

NeMo ships ``examples/nlp/language_modeling/megatron_gpt_pretraining.py`` in its repository, not in
the ``nemo_toolkit`` wheel; this file repeats that script's steps (``hydra_runner`` ->
``MegatronTrainerBuilder(cfg).create_trainer()`` -> ``exp_manager`` -> ``MegatronGPTModel`` ->
``trainer.fit``) so the smoke run can show the plugin loading the way it does on a cluster: the
package is installed, its Lightning ``callbacks_factory`` entry point adds an inert callback to
the Trainer, and Hydra overrides alone (``+model.fp8_transpose_align.policy=aligned``) switch it
on. On the CPU it runs under ``python -m support.run_nemo_cpu`` (the CPU patches).
"""

import torch.multiprocessing as mp
from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
from nemo.collections.nlp.parts.megatron_trainer_builder import MegatronTrainerBuilder
from nemo.core.config import hydra_runner
from nemo.utils import logging
from nemo.utils.exp_manager import exp_manager
from omegaconf.omegaconf import OmegaConf, open_dict

mp.set_start_method("spawn", force=True)


@hydra_runner(config_path="../conf", config_name="megatron_gpt_cpu")
def main(cfg) -> None:
    logging.info("\n\n************** Experiment configuration ***********")
    logging.info(f"\n{OmegaConf.to_yaml(cfg)}")

    trainer = MegatronTrainerBuilder(cfg).create_trainer()
    exp_manager(trainer, cfg.exp_manager)

    # As NeMo's script: the interpolation key is lost when Lightning saves hparams.
    with open_dict(cfg):
        cfg.model.precision = cfg.trainer.precision

    model = MegatronGPTModel(cfg.model, trainer)

    trainer.fit(model)


if __name__ == "__main__":
    main()
