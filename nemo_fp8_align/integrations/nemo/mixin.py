"""``FP8TransposeAlignMixin``: aligned FP8 weight transposes for NeMo's ``MegatronGPTModel``.

Put it first in the bases::

    class MegatronGPTFP8AlignModel(FP8TransposeAlignMixin, MegatronGPTModel):
        pass

What it adds to the model (nemo_toolkit 2.3.3, NeMo 1.x GPT path):

* construction: the startup check (:func:`nemo_fp8_align.config_check.check.check_config`) runs on the
  model config *before* ``MegatronGPTModel`` builds anything, and raises one error listing every
  violation with its Hydra fix;
* ``on_train_start``: one :class:`~nemo_fp8_align.core.aligner.TransposeAligner` per rank over
  ``self.model`` (the chunks the schedule calls), with the optimizer's chunk param-sync adapter
  (``optim.name=distributed_fused_adam``: :class:`~nemo_fp8_align.sync.apex.ApexParamSync`;
  ``mcore_distributed_optim``: :class:`~nemo_fp8_align.sync.mcore.McoreParamSync`);
* training ``fwd_bwd_step``: NeMo re-binds ``config.param_sync_func`` on every call, so the
  mixin does not wrap the config. Apex path: it overrides ``sync_overlap_parameters`` (what NeMo
  binds) and tells the aligner which chunk was launched. Megatron-core path: NeMo binds
  ``[chunk.start_param_sync for chunk in self.model]``, so for the duration of the training
  ``fwd_bwd_step`` each chunk's ``start_param_sync`` is shadowed by the aligner's wrapper;
  nothing else calls it there (the optimizer step and checkpointing run outside);
* ``on_train_end`` / ``teardown``: hooks removed, wrappers gone (idempotent).

Forward-only passes (validation) never launch through the wrappers, so they trigger nothing.

FP8 weights: ``model.fp8_params=True`` means Transformer Engine ``Float8Tensor`` parameters
(:attr:`FP8Weights.TE`, backend ``nemo_fp8_align.backends.te``). Where TE is absent (the CPU
smoke run), a model class may set ``fp8_align_weights = FP8Weights.REFERENCE``: the aligner then
builds the :class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` copies the chunks' layers
compute with (``module.fp8_weight``, e.g. the CPU layers of
:mod:`support.reference_fp8_layers`, whose forward GEMM reads the FP8 data and whose
data-gradient GEMM reads the cached transpose); the TE-only config keys are then not required
by the startup check. As with TE, the model, not the plugin, marks those caches stale after
each optimizer step.

It also carries a workaround for a megatron-core 0.12.3 bucketing bug that stops NeMo's
interleaved path with ``mcore_distributed_optim`` ("Param should not be in param_gbuf_map"):
see :func:`shared_embedding_bucket_workaround`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations.nemo.bucket_workaround import (SharedEmbeddingBucketError, check_buckets,
                                                   hide_shared_embedding_flags,
                                                   restore_shared_embedding_flags,
                                                   shared_embedding_bucket_workaround)

__all__ = ["FP8TransposeAlignMixin", "FP8Weights", "SharedEmbeddingBucketError", "build_aligner",
           "check_buckets", "check_telemetry_path", "detect_weights", "first_param_index", "hide_shared_embedding_flags",
           "model_chunks", "reference_weights_of", "restore_shared_embedding_flags",
           "schedule_launch", "shared_embedding_bucket_workaround", "startup_check"]

logger = logging.getLogger(__name__)

#: Config keys that only make sense with Transformer Engine FP8 weights; not required when the
#: model uses reference FP8 shadows (TE absent).
_TE_ONLY_KEYS = ("model.transformer_engine", "model.fp8", "model.fp8_params", "model.fp8_hybrid",
                 "model.fp8_e4m3")


class FP8Weights(str, enum.Enum):
    """Which FP8 weights the aligner transposes."""

    #: Transformer Engine ``Float8Tensor`` parameters (``model.fp8_params=True``).
    TE = "te"
    #: Plain-torch reference FP8 weights held by the chunks' layers as ``fp8_weight`` (no TE).
    REFERENCE = "reference"


def reference_weights_of(module: torch.nn.Module) -> List[Any]:
    """The :class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` objects ``module``'s layers
    compute with (held as ``fp8_weight``), in module order, each once, named by their layer."""
    from nemo_fp8_align.backends.reference import ReferenceFP8Weight

    found: List[Any] = []
    seen = set()
    for name, layer in module.named_modules():
        weight = layer.__dict__.get("fp8_weight")
        if isinstance(weight, ReferenceFP8Weight) and id(weight) not in seen:
            seen.add(id(weight))
            weight.name = name or weight.name
            found.append(weight)
    return found


def detect_weights(chunks: Sequence[torch.nn.Module]) -> FP8Weights:
    """REFERENCE when the chunks' layers hold reference FP8 weights (the CPU layers), else TE."""
    has_reference = any(reference_weights_of(chunk) for chunk in chunks)
    return FP8Weights.REFERENCE if has_reference else FP8Weights.TE


def startup_check(cfg: Any, trainer: Any = None, *,
                  weights: FP8Weights = FP8Weights.TE) -> AlignConfig:
    """Check the model config; return the plugin's :class:`AlignConfig`.

    Raises :class:`~nemo_fp8_align.config_check.check.FP8AlignConfigError` listing every violation.
    ``trainer`` (when given) supplies the data-parallel size for the microbatch rules.
    """
    from nemo_fp8_align.config_check.check import (FP8AlignConfigError, align_config_from,
                                                   find_violations, plugin_off_override)

    violations = find_violations(cfg, data_parallel_size=_data_parallel_size(cfg, trainer))
    if weights is FP8Weights.REFERENCE:
        violations = [v for v in violations if v.key not in _TE_ONLY_KEYS]
    if violations:
        raise FP8AlignConfigError(violations, off=plugin_off_override(cfg))
    return align_config_from(cfg)


def check_telemetry_path(path: Optional[str]) -> None:
    """:func:`nemo_fp8_align.integrations.megatron.check_telemetry_path`, naming the NeMo setting."""
    from nemo_fp8_align.integrations.megatron import check_telemetry_path as check

    check(path, key="model.fp8_transpose_align.telemetry_path")


def _data_parallel_size(cfg: Any, trainer: Any) -> Optional[int]:
    world = getattr(trainer, "world_size", None)
    if not isinstance(world, int) or world < 1:
        return None
    model_parallel = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "context_parallel_size"):
        value = cfg.get(key, 1)
        model_parallel *= value if isinstance(value, int) and value > 0 else 1
    return world // model_parallel if world % model_parallel == 0 else None


def model_chunks(model: Any) -> List[torch.nn.Module]:
    """The modules NeMo's schedule calls: ``model.model`` as a list (one per virtual stage)."""
    chunks = model.model
    return list(chunks) if isinstance(chunks, (list, tuple, torch.nn.ModuleList)) else [chunks]


def first_param_index(chunks: Sequence[torch.nn.Module]) -> Dict[int, int]:
    """``id`` of each chunk's first parameter -> chunk index: how a ``param_sync_func`` call
    (which receives ``model[c].parameters()``) is mapped back to its chunk."""
    return {id(next(iter(chunk.parameters()))): c for c, chunk in enumerate(chunks)}


def schedule_launch(aligner: Any, chunk: int, launch: Any) -> Any:
    """``launch`` (a megatron-core DDP chunk's ``start_param_sync``) that tells the aligner when
    the *schedule* calls it: the schedule passes the chunk's parameters positionally
    (``param_sync_func[c](model[c].parameters())``); megatron-core's other callers (the optimizer
    step with ``overlap_param_gather_with_optimizer_step``, ``disable_forward_pre_hook``) pass
    keywords only and are not a step's launches."""
    def start_param_sync(*args: Any, **kwargs: Any) -> Any:
        out = launch(*args, **kwargs)
        if args:
            aligner.on_param_sync_launched(chunk)
        return out
    return start_param_sync


def build_aligner(model: Any, config: AlignConfig, *,
                  weights: FP8Weights = FP8Weights.TE) -> Any:
    """The rank's :class:`TransposeAligner` for a set-up NeMo GPT model (not attached yet).

    Call after the optimizer exists and before the first optimizer step (Apex's pre-forward
    hooks are still disarmed then, so collecting parameters touches none).
    """
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_model_config

    from nemo_fp8_align.core.aligner import TransposeAligner
    from nemo_fp8_align.integrations.megatron import schedule_for, telemetry_writer

    chunks = model_chunks(model)
    schedule = schedule_for(get_model_config(chunks[0]),
                            pp=parallel_state.get_pipeline_model_parallel_world_size(),
                            vp=len(chunks), num_microbatches=get_num_microbatches())
    fp8_weights, backend = _weights_and_backend(chunks, config, weights)
    aligner = TransposeAligner(
        chunks, schedule=schedule, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
        param_sync=_param_sync(model, chunks), weights=fp8_weights, backend=backend,
        config=config, telemetry=telemetry_writer(config.telemetry_path))
    return aligner


def _param_sync(model: Any, chunks: Sequence[torch.nn.Module]) -> Any:
    if getattr(model, "use_mcore_dist_optim", False):
        from nemo_fp8_align.sync.mcore import McoreParamSync

        return McoreParamSync(chunks)
    from nemo_fp8_align.sync.apex import ApexParamSync

    return ApexParamSync(model._optimizer, [list(c.parameters()) for c in chunks])


def _weights_and_backend(chunks: Sequence[torch.nn.Module], config: AlignConfig,
                         weights: FP8Weights) -> Tuple[List[List[Any]], Any]:
    if weights is FP8Weights.REFERENCE:
        from nemo_fp8_align.backends.reference import ReferenceBackend

        return [reference_weights_of(chunk) for chunk in chunks], ReferenceBackend(
            use_triton_kernel=config.use_triton_kernel)
    backend = _te_backend(config)
    # By type() only: isinstance() on a parameter could fire an armed Apex hook.
    return [backend.weights_of(chunk) for chunk in chunks], backend


def _te_backend(config: AlignConfig) -> Any:
    """The Transformer Engine backend (:mod:`nemo_fp8_align.backends.te`)."""
    from nemo_fp8_align.backends import te as te_backend

    try:
        return te_backend.make_backend(config)
    except ImportError as err:
        raise RuntimeError(
            "model.fp8_params=True: the plugin transposes Transformer Engine FP8 weights, but "
            f"{err} Or turn the plugin off with model.fp8_transpose_align.enabled=False.") from err


class FP8TransposeAlignMixin:
    """Adds aligned FP8 weight transposes to ``MegatronGPTModel`` (list it first in the bases).

    Class attribute:
        fp8_align_weights: :class:`FP8Weights` the aligner transposes (default TE).
    """

    fp8_align_weights: FP8Weights = FP8Weights.TE

    def __init__(self, cfg: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        # Before MegatronGPTModel builds anything: a bad config fails in seconds, not after
        # model construction and process-group setup.
        align = startup_check(cfg, trainer, weights=FP8Weights(self.fp8_align_weights))
        super().__init__(cfg, trainer, *args, **kwargs)
        self._fp8_align_config = align
        self._fp8_aligner: Any = None
        self._fp8_align_chunk_of_first_param: Dict[int, int] = {}
        self._fp8_align_in_training_step = False
        self._fp8_align_logged_step = -1

    # ------------------------------------------------------------------ public state
    @property
    def fp8_align_config(self) -> AlignConfig:
        """The plugin's settings read from ``model.fp8_transpose_align``."""
        return self._fp8_align_config

    @property
    def fp8_aligner(self) -> Any:
        """The rank's :class:`TransposeAligner` while training (None otherwise)."""
        return self._fp8_aligner

    # ------------------------------------------------------------------ megatron-core DDP
    def setup_mcore_distributed_parallel(self) -> None:
        if not self._fp8_align_config.active:
            # Plugin off: NeMo's DDP setup unchanged (no bucket workaround, no bucket check).
            return super().setup_mcore_distributed_parallel()
        from megatron.core import parallel_state

        chunks = self.model if isinstance(self.model, list) else [self.model]
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        with shared_embedding_bucket_workaround(chunks, data_parallel_size=dp):
            super().setup_mcore_distributed_parallel()
        if getattr(self, "use_mcore_dist_optim", False):
            check_buckets(self.model if isinstance(self.model, list) else [self.model])

    # ------------------------------------------------------------------ lifecycle
    def setup(self, stage: Optional[str] = None) -> None:
        if stage == "fit" and self._fp8_align_config.active:
            check_telemetry_path(self._fp8_align_config.telemetry_path)  # before any work
        super().setup(stage)

    def on_train_start(self) -> None:
        super().on_train_start()
        self.fp8_align_attach()

    def on_train_end(self) -> None:
        self.fp8_align_detach()
        super().on_train_end()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(*args, **kwargs)
        aligner = self._fp8_aligner
        if aligner is None:
            return
        from nemo_fp8_align.integrations.nemo.metrics import last_step_records, log_step_metrics

        new = last_step_records(aligner.records)
        if not new or new[-1].step == self._fp8_align_logged_step:
            new = []
        else:
            self._fp8_align_logged_step = new[-1].step
        # Every rank: the gather over the pipeline ranks is a collective; rank 0 logs.
        log_step_metrics(self, self.trainer, new)

    def teardown(self, stage: str) -> None:
        self.fp8_align_detach()
        super().teardown(stage)

    def fp8_align_attach(self) -> bool:
        """Build and attach the rank's aligner (idempotent); returns whether it is active."""
        if self._fp8_aligner is not None:
            return self._fp8_aligner.attached
        if not self._fp8_align_config.active:
            logger.info("nemo_fp8_align: disabled by model.fp8_transpose_align")
            return False
        aligner = self._fp8_align_build()
        if aligner is None or not aligner.attach():
            return False
        self._fp8_aligner = aligner
        counts = [len(w) for w in aligner.weights]
        if not any(counts):
            logger.warning(
                "nemo_fp8_align: no FP8 weights found in the model chunks (model.fp8_params=%s): "
                "nothing to transpose. With Transformer Engine, model.fp8=True and "
                "model.fp8_params=True build Float8Tensor parameters.", self.cfg.get("fp8_params"))
        logger.info(
            "nemo_fp8_align: %s FP8 transposes on pipeline rank %d: %d chunks, FP8 weights per "
            "chunk %s (%s), optimizer %s (overlap_param_sync=%s)",
            self._fp8_align_config.policy.value, aligner.pp_rank, len(counts), counts,
            aligner.backend.name, self.cfg.optim.get("name"),
            self.cfg.optim.get("overlap_param_sync"))
        return True

    def fp8_align_detach(self) -> None:
        """Remove the aligner's hooks (idempotent)."""
        if self._fp8_aligner is not None:
            self._fp8_aligner.detach()
            self._fp8_aligner = None
        self._fp8_align_in_training_step = False

    def _fp8_align_build(self) -> Any:
        aligner = build_aligner(self, self._fp8_align_config,
                                weights=FP8Weights(self.fp8_align_weights))
        self._fp8_align_chunk_of_first_param = first_param_index(model_chunks(self))
        return aligner

    # ------------------------------------------------------------------ per step
    def fwd_bwd_step(self, dataloader_iter: Any, forward_only: bool,
                     first_val_step: Any = None) -> Any:
        aligner = self._fp8_aligner
        if forward_only or aligner is None or not aligner.attached:
            return super().fwd_bwd_step(dataloader_iter, forward_only, first_val_step)
        # Telemetry steps follow global_step (also after a resume from a checkpoint).
        aligner.set_next_step(self.trainer.global_step)
        try:
            with self._fp8_align_launch_notifications(aligner):
                out = super().fwd_bwd_step(dataloader_iter, forward_only, first_val_step)
        except BaseException:
            # A step cut short: no hooks or half-open step left behind (Lightning calls no
            # LightningModule teardown after an exception); a later fit attaches afresh.
            self.fp8_align_detach()
            raise
        aligner.on_step_end()  # every forward planned ran (NeMo has no finalize hook for it)
        return out

    @contextlib.contextmanager
    def _fp8_align_launch_notifications(self, aligner: Any) -> Iterator[None]:
        shadowed: List[torch.nn.Module] = []
        self._fp8_align_in_training_step = True
        try:
            if getattr(self, "use_mcore_dist_optim", False):
                # NeMo builds param_sync_func from these attributes inside fwd_bwd_step.
                for c, chunk in enumerate(model_chunks(self)):
                    chunk.start_param_sync = schedule_launch(aligner, c, chunk.start_param_sync)
                    shadowed.append(chunk)
            yield
        finally:
            self._fp8_align_in_training_step = False
            for chunk in shadowed:
                del chunk.start_param_sync

    def sync_overlap_parameters(self, params: Any = None) -> None:
        aligner = self._fp8_aligner
        if params is None or aligner is None or not self._fp8_align_in_training_step:
            return super().sync_overlap_parameters(params)
        params = list(params)  # the schedule passes a generator: read it once
        super().sync_overlap_parameters(params)
        chunk = self._fp8_align_chunk_of_first_param.get(id(params[0])) if params else None
        if chunk is not None:
            aligner.on_param_sync_launched(chunk)
        return None
