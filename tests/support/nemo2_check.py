"""The NeMo 2 callback's startup check on real ``nemo.lightning`` objects, in one process
(no fit): tests ONLY.

    python -m support.nemo2_check

Builds ``MegatronStrategy`` / ``MegatronMixedPrecision`` / ``DistributedDataParallelConfig``
objects as a NeMo 2 user writes them, puts them on a trainer stand-in (the check reads
``trainer.strategy``, ``trainer.callbacks`` and ``trainer.lightning_module.optim``) and prints
one JSON object: per case, the violations :func:`nemo2_violations` lists, or the error
:class:`FP8TransposeAlignNeMo2` raises at ``on_train_start``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Dict, List


def _trainer(strategy: Any, precision: Any = None, callbacks: Any = (),
             optim_config: Any = None) -> Any:
    if precision is not None:
        strategy.precision_plugin = precision
    module = SimpleNamespace(optim=SimpleNamespace(config=optim_config))
    return SimpleNamespace(strategy=strategy, callbacks=list(callbacks),
                           lightning_module=module, global_step=0)


def main() -> None:
    import nemo.lightning as nl
    from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig
    from megatron.core.optimizer import OptimizerConfig

    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.integrations.nemo2 import (FP8TransposeAlignNeMo2, NeMo2ConfigError,
                                                   nemo2_violations)

    good_ddp = dict(use_distributed_optimizer=True, overlap_param_gather=True,
                    align_param_gather=True)
    fp8 = dict(precision="bf16-mixed", fp8="hybrid", fp8_param_gather=True)
    out: Dict[str, Any] = {}

    def case(name: str, trainer: Any, te_weights: bool = True) -> None:
        out[name] = nemo2_violations(trainer, te_weights=te_weights)

    case("good", _trainer(nl.MegatronStrategy(pipeline_model_parallel_size=2,
                                              virtual_pipeline_model_parallel_size=2,
                                              ddp=DDPConfig(**good_ddp)),
                          nl.MegatronMixedPrecision(**fp8)))
    # Everything wrong at once: every violation listed, each with its fix.
    case("all_wrong", _trainer(nl.MegatronStrategy(ddp=DDPConfig()),
                               nl.MegatronMixedPrecision(precision="bf16-mixed"),
                               optim_config=OptimizerConfig()))
    case("pytorch_ddp", _trainer(nl.MegatronStrategy(pipeline_model_parallel_size=2,
                                                     virtual_pipeline_model_parallel_size=2,
                                                     ddp="pytorch"),
                                 nl.MegatronMixedPrecision(**fp8)))
    # Reference weights (CPU runs, no TE): the precision plugin's FP8 settings are not needed.
    case("reference_bf16", _trainer(nl.MegatronStrategy(pipeline_model_parallel_size=2,
                                                        virtual_pipeline_model_parallel_size=2,
                                                        ddp=DDPConfig(**good_ddp)),
                                    nl.MegatronMixedPrecision(precision="bf16-mixed")),
         te_weights=False)
    # MegatronCommOverlapCallback rewrites the overlap flags at setup: its arguments named.
    # Its module imports nemo.collections.llm (megatron_comm_overlap.py:23), which does not
    # import here (nemo_run): a stand-in of that class name, which is all the check reads.
    comm_overlap = type("MegatronCommOverlapCallback", (), {})()
    case("comm_overlap", _trainer(nl.MegatronStrategy(pipeline_model_parallel_size=2,
                                                      virtual_pipeline_model_parallel_size=2,
                                                      ddp=DDPConfig(use_distributed_optimizer=True)),
                                  nl.MegatronMixedPrecision(**fp8),
                                  callbacks=[comm_overlap]))

    def raised(callback: Any, trainer: Any) -> Any:
        try:
            callback.on_train_start(trainer, trainer.lightning_module)
        except NeMo2ConfigError as err:
            return {"type": type(err).__name__, "message": str(err)}
        return {"aligner": callback.aligner is not None}

    bad = _trainer(nl.MegatronStrategy(ddp=DDPConfig()), nl.MegatronMixedPrecision("32"))
    out["callback_raises"] = raised(FP8TransposeAlignNeMo2(), bad)
    bad = _trainer(nl.MegatronStrategy(ddp=DDPConfig()), nl.MegatronMixedPrecision("32"))
    out["callback_off_inert"] = raised(
        FP8TransposeAlignNeMo2(align_config=AlignConfig(enabled=False)), bad)
    bad = _trainer(nl.MegatronStrategy(ddp=DDPConfig()), nl.MegatronMixedPrecision("32"))
    out["policy_off_inert"] = raised(
        FP8TransposeAlignNeMo2(align_config=AlignConfig(policy="off")), bad)
    print("NEMO2_CHECK " + json.dumps(out))


if __name__ == "__main__":
    main()
