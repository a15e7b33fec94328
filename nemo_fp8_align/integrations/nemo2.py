"""The plugin in NeMo 2 (``nemo.lightning``: ``MegatronStrategy``, ``nemo.collections.llm``), as
one Lightning callback::

    import nemo.lightning as nl
    from megatron.core.distributed import DistributedDataParallelConfig
    from nemo_fp8_align.integrations.nemo2 import FP8TransposeAlignNeMo2

    strategy = nl.MegatronStrategy(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                          overlap_param_gather=True, align_param_gather=True))
    plugins = nl.MegatronMixedPrecision(precision="bf16-mixed", fp8="hybrid",
                                        fp8_param_gather=True)
    trainer = nl.Trainer(strategy=strategy, plugins=plugins,
                         callbacks=[FP8TransposeAlignNeMo2()], ...)

What NeMo 2.3.3 does around it (``nemo/lightning/``), read in its source:

- ``MegatronStrategy.setup`` (after every callback's ``setup``) builds ``MegatronParallel``: a
  ``ModuleList`` of the LightningModule and, for VP >= 2, ``io.reinit`` copies of it, one per
  virtual stage, each configured with that virtual rank; ``init_ddp`` replaces each one's
  ``.module`` with megatron-core's ``DistributedDataParallel`` (NeMo's ``DDP`` subclass). Those
  DDP instances, ``[m.module for m in strategy.megatron_parallel]``, are the chunks the aligner
  attaches to (what ``get_megatron_optimizer`` is given too).
- ``config.param_sync_func = [chunk.start_param_sync ...]`` is bound once, on every chunk's
  config, by ``_strategy_lib.setup_megatron_optimizer`` (the optimizer's construction inside
  ``MegatronStrategy.setup``), and only with ``overlap_param_gather`` and ``align_param_gather``
  both on; the list holds the DDP instances' bound methods, which the adapter points at its
  wrappers. ``finalize_model_grads_func`` is bound by ``MegatronOptimizerModule.on_fit_start``;
  it calls each chunk's ``finish_grad_sync`` through NeMo's attribute proxy, which finds the
  adapter's wrapper on chunk 0's DDP instance (the step end).
- M is megatron-core's microbatch calculator (``MegatronDataSampler.setup`` initialises it):
  :func:`megatron.core.num_microbatches_calculator.get_num_microbatches`, asked at each step.
- ``on_train_start`` fires after all of that and after a checkpoint's restore, before the first
  training step: the callback attaches there and detaches at ``on_train_end`` / ``teardown`` /
  ``on_exception``.
- ``MegatronStrategy.save_checkpoint`` calls ``megatron_parallel.force_param_sync()`` (each DDP
  chunk's ``start_param_sync(force_sync=True)``) with the distributed optimizer and
  ``overlap_param_gather``: a forced call is not a launch for the aligner, and on megatron-core
  < 0.18 the adapter's forced-sync watch rebuilds the transposes it leaves stale. Validation
  forwards run without gradients and are not counted as training forwards.
- ``MegatronCommOverlapCallback.setup`` rewrites the DDP overlap flags (with one data-parallel
  rank it turns ``overlap_param_gather`` and ``align_param_gather`` off unless passed to it):
  the startup check therefore runs at ``on_train_start``, on the flags the DDP chunks were built
  with, and names that callback's arguments when it is there.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, List, Optional

from lightning.pytorch import Callback
from typing_extensions import override

from nemo_fp8_align.config import AlignConfig

__all__ = ["FP8TransposeAlignNeMo2", "NeMo2ConfigError", "check_trainer", "nemo2_chunks",
           "nemo2_violations"]

logger = logging.getLogger(__name__)


class NeMo2ConfigError(ValueError):
    """The NeMo 2 trainer has settings that stop the plugin from working (every one listed)."""


def nemo2_chunks(trainer: Any) -> List[Any]:
    """This rank's megatron-core DDP chunks, in virtual-stage order, of a set-up
    ``MegatronStrategy``."""
    parallel = getattr(trainer.strategy, "megatron_parallel", None)
    if parallel is None:
        raise RuntimeError("FP8TransposeAlignNeMo2: trainer.strategy has no megatron_parallel "
                           "(MegatronStrategy.setup has not run, or this is not NeMo 2's "
                           "MegatronStrategy)")
    return [stage.module for stage in parallel]


def _precision_plugin(trainer: Any) -> Any:
    strategy = trainer.strategy
    return getattr(strategy, "precision_plugin", None) or getattr(strategy,
                                                                  "_precision_plugin", None)


def _fp8_gather_arg(plugin: Any) -> str:
    """How this NeMo spells the FP8-parameter switch of ``MegatronMixedPrecision``
    (``fp8_param_gather`` in 2.2 on, ``fp8_params`` before)."""
    try:
        params = inspect.signature(type(plugin).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    return "fp8_params" if "fp8_params" in params else "fp8_param_gather"


def nemo2_violations(trainer: Any, *, te_weights: bool = True) -> List[str]:
    """Every setting of a NeMo 2 trainer that stops the plugin, each with the argument that
    fixes it; empty when none. ``te_weights``: the FP8 weights are Transformer Engine's (the
    precision plugin's FP8 settings are then required; reference weights need none)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from nemo.lightning.pytorch.strategies import MegatronStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, MegatronStrategy):
        return [f"trainer.strategy is {type(strategy).__name__}, not NeMo's MegatronStrategy: "
                "the plugin attaches to MegatronStrategy's megatron-core DDP chunks. Fix: "
                "nl.Trainer(strategy=nl.MegatronStrategy(...))"]
    found: List[str] = []
    pp = strategy.pipeline_model_parallel_size or 1
    vp = strategy.virtual_pipeline_model_parallel_size
    if pp < 2:
        found.append(f"MegatronStrategy.pipeline_model_parallel_size={pp}: the plugin aligns "
                     "FP8 transposes across pipeline ranks (>= 2). Fix: "
                     "MegatronStrategy(pipeline_model_parallel_size=2) (or more; num_layers "
                     "divisible by pipeline x virtual size)")
    if vp is None or vp < 2:
        found.append(f"MegatronStrategy.virtual_pipeline_model_parallel_size={vp}: the plugin "
                     "needs the interleaved schedule (>= 2 model chunks per pipeline rank). Fix: "
                     "MegatronStrategy(virtual_pipeline_model_parallel_size=2) (num_layers "
                     "divisible by pipeline_model_parallel_size x 2)")
    ddp = getattr(strategy, "ddp_config", None)
    # By class name: its module imports nemo.collections.llm, which needs nemo_run.
    overlap_cb = [cb for cb in trainer.callbacks if type(cb).__name__ ==
                  "MegatronCommOverlapCallback"]
    via_cb = (" and, with MegatronCommOverlapCallback in the callbacks (it rewrites these flags "
              "at setup), MegatronCommOverlapCallback({}=True)") if overlap_cb else ""
    if not isinstance(ddp, DistributedDataParallelConfig):
        found.append(f"MegatronStrategy(ddp={getattr(strategy, '_ddp', ddp)!r}): the plugin "
                     "needs megatron-core's DDP and distributed optimizer. Fix: "
                     "MegatronStrategy(ddp=DistributedDataParallelConfig("
                     "use_distributed_optimizer=True, overlap_param_gather=True, "
                     "align_param_gather=True))")
    else:
        optim_cfg = getattr(getattr(trainer.lightning_module, "optim", None), "config", None)
        if not ddp.use_distributed_optimizer:
            found.append("DistributedDataParallelConfig.use_distributed_optimizer=False: the "
                         "distributed optimizer's parameter all-gather is what the plugin "
                         "aligns. Fix: OptimizerConfig(use_distributed_optimizer=True) in the "
                         "model's MegatronOptimizerModule (MegatronStrategy copies it into "
                         "DistributedDataParallelConfig.use_distributed_optimizer)"
                         + ("" if optim_cfg is not None else
                            " and DistributedDataParallelConfig(use_distributed_optimizer=True)"))
        if not ddp.overlap_param_gather:
            found.append("DistributedDataParallelConfig.overlap_param_gather=False: the "
                         "all-gather runs synchronously, nothing to align. Fix: "
                         "DistributedDataParallelConfig(overlap_param_gather=True)"
                         + via_cb.format("overlap_param_gather"))
        if not getattr(ddp, "align_param_gather", False):
            found.append("DistributedDataParallelConfig.align_param_gather=False: NeMo binds "
                         "the schedule's param_sync_func only with it, and the plugin places "
                         "each chunk's transposes at that launch's slot. Fix: "
                         "DistributedDataParallelConfig(align_param_gather=True)"
                         + via_cb.format("align_param_gather"))
    if te_weights:
        plugin = _precision_plugin(trainer)
        dtype = getattr(plugin, "dtype_config", None)
        if dtype is None:
            found.append(f"precision plugin {type(plugin).__name__}: FP8 weights need NeMo's "
                         "MegatronMixedPrecision. Fix: nl.MegatronMixedPrecision("
                         "precision='bf16-mixed', fp8='hybrid', fp8_param_gather=True)")
        else:
            arg = _fp8_gather_arg(plugin)
            if not dtype.fp8:
                found.append(f"MegatronMixedPrecision(fp8={dtype.fp8!r}): no FP8 GEMMs, no FP8 "
                             "transposes. Fix: MegatronMixedPrecision(fp8='hybrid')")
            if not (getattr(dtype, "fp8_param_gather", False) and getattr(dtype, "fp8_param",
                                                                          True)):
                found.append(f"MegatronMixedPrecision({arg}=False): the parameters are not "
                             "Transformer Engine FP8 tensors, so the all-gather carries no FP8 "
                             f"bytes to transpose. Fix: MegatronMixedPrecision({arg}=True)")
    return found


def check_trainer(trainer: Any, *, te_weights: bool = True) -> None:
    """Raise :class:`NeMo2ConfigError` listing every violation of :func:`nemo2_violations`."""
    found = nemo2_violations(trainer, te_weights=te_weights)
    if found:
        lines = "\n".join(f"  - {v}" for v in found)
        raise NeMo2ConfigError(
            f"{len(found)} NeMo 2 setting(s) stop the aligned FP8-transpose plugin from "
            f"working:\n{lines}\nApply the fixes above, or remove FP8TransposeAlignNeMo2 "
            "(or pass align_config=AlignConfig(enabled=False)).")


class FP8TransposeAlignNeMo2(Callback):
    """Attaches the aligned FP8-transpose engine to a NeMo 2 ``MegatronStrategy``'s DDP chunks
    at ``on_train_start`` (through :func:`nemo_fp8_align.assemble.assemble`; the adapter closes
    each step at chunk 0's ``finish_grad_sync``) and detaches it at fit end or on an exception.

    Args:
        align_config: policy and telemetry (``AlignConfig(enabled=False)``: the callback is
            inert: no check, nothing attached, nothing imported).
        backend, weights_of: the FP8 backend and how to find a chunk's FP8 weights (None:
            Transformer Engine's backend and its ``weights_of``; the CPU runs pass the reference
            backend and ``reference_weights_of``).
        check: run the startup check on the strategy, precision plugin and DDP config.
    """

    def __init__(self, *, align_config: AlignConfig = AlignConfig(), backend: Any = None,
                 weights_of: Optional[Callable[[Any], List[Any]]] = None,
                 check: bool = True) -> None:
        super().__init__()
        if not isinstance(align_config, AlignConfig):
            raise TypeError(f"FP8TransposeAlignNeMo2(align_config={align_config!r}): pass an "
                            "AlignConfig")
        self.align_config, self.backend, self.weights_of = align_config, backend, weights_of
        self.check = check
        self.aligner: Any = None

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._detach()  # a second fit with this callback: attach to the new chunks
        if not self.align_config.active:
            return
        te_weights = self.backend is None or str(getattr(self.backend, "name", "")).startswith(
            "te")
        if self.check:
            check_trainer(trainer, te_weights=te_weights)
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.utils import get_model_config

        from nemo_fp8_align.assemble import assemble

        chunks = nemo2_chunks(trainer)
        self.aligner = assemble(
            chunks, num_microbatches=get_num_microbatches, config=get_model_config(chunks[0]),
            backend=self.backend, weights_of=self.weights_of, align_config=self.align_config,
            label="attaching nemo_fp8_align, NeMo 2 callback")
        # Records numbered by Lightning's global step (a resumed run goes on counting).
        self.aligner.step_number = lambda: int(trainer.global_step)
        if self.aligner.attached:
            logger.info("nemo_fp8_align: %s FP8 transposes attached (NeMo 2 callback; %d "
                        "chunks)", self.align_config.policy.value, len(chunks))

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Lightning ends fit here on every rank: what a rank still holds stops every rank
        # (on_exception and teardown detach locally).
        aligner, self.aligner = self.aligner, None
        if aligner is not None:
            aligner.detach(agree=True)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._detach()

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._detach()

    def _detach(self) -> None:
        aligner, self.aligner = self.aligner, None
        if aligner is not None:
            aligner.detach()
