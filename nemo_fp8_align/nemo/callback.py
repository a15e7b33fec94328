"""``FP8TransposeAlignment``: the aligned FP8 transposes as a Lightning callback.

For NeMo GPT models that do not subclass with
:class:`~nemo_fp8_align.nemo.mixin.FP8TransposeAlignMixin`::

    trainer = MegatronTrainerBuilder(cfg).create_trainer(
        callbacks=[FP8TransposeAlignment(policy="aligned")])

Lifecycle: ``setup`` (fit only) runs the startup check on ``pl_module.cfg`` with this
callback's settings; ``on_train_start`` builds and attaches the rank's aligner; each training
batch (``on_train_batch_start`` .. ``on_train_batch_end``) wraps the launch functions NeMo binds
into ``config.param_sync_func`` (``pl_module.sync_overlap_parameters`` for Apex, each chunk's
``start_param_sync`` for megatron-core DDP) and unwraps them afterwards, so validation passes
inside ``fit`` see NeMo unchanged; ``on_train_batch_end`` logs the step's telemetry through
``trainer.logger`` on global rank 0; ``teardown`` detaches everything.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Union

from lightning.pytorch import Callback
from typing_extensions import override

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.nemo.mixin import (
    FP8TransposeAlignMixin,
    FP8Weights,
    build_aligner,
    check_buckets,
    first_param_index,
    hide_shared_embedding_flags,
    model_chunks,
    restore_shared_embedding_flags,
    schedule_launch,
    startup_check,
)

__all__ = ["FP8TransposeAlignment"]

logger = logging.getLogger(__name__)


class FP8TransposeAlignment(Callback):
    """Builds each model chunk's FP8 transposes at its aligned interleaved-schedule slot.

    Args:
        enabled: master switch (``False``: the callback does nothing).
        policy: ``"aligned"`` (the fix), ``"lazy"`` (observe only), ``"off"``.
        telemetry_path: JSON-lines file per rank (``{rank}`` is replaced), or None.
        use_triton_kernel: on CUDA, one batched transpose kernel per chunk.
        te_kernel_writes_transpose: let that kernel write TE's transpose buffers directly.
        weights: ``"te"`` (Transformer Engine FP8 parameters, ``model.fp8_params=True``) or
            ``"reference"`` (plain-torch FP8 shadows; for CPU runs without TE).
        log_every_n_steps: log telemetry to ``trainer.logger`` every this many steps.
    """

    def __init__(self, *, enabled: bool = True, policy: Union[str, Policy] = Policy.ALIGNED,
                 telemetry_path: Optional[str] = None, use_triton_kernel: bool = True,
                 te_kernel_writes_transpose: bool = False,
                 weights: Union[str, FP8Weights] = FP8Weights.TE,
                 log_every_n_steps: int = 1) -> None:
        super().__init__()
        if not isinstance(enabled, bool):
            raise TypeError(f"FP8TransposeAlignment(enabled={enabled!r}): expected True or False")
        if type(log_every_n_steps) is not int or log_every_n_steps < 1:
            raise ValueError(f"FP8TransposeAlignment(log_every_n_steps={log_every_n_steps!r}): "
                             "expected an int >= 1")
        try:
            self.weights = FP8Weights(weights)
        except ValueError:
            raise ValueError(
                f"FP8TransposeAlignment(weights={weights!r}): use one of "
                + ", ".join(w.value for w in FP8Weights)) from None
        # AlignConfig validates the policy and names the choices.
        self.config = AlignConfig(enabled=enabled, policy=policy, telemetry_path=telemetry_path,
                                  use_triton_kernel=use_triton_kernel,
                                  te_kernel_writes_transpose=te_kernel_writes_transpose)
        self.log_every_n_steps = log_every_n_steps
        #: Steps whose telemetry was logged, and transposes built, over the callback's life.
        self.steps = 0
        self.transposes = 0
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._aligner: Any = None
        self._reference: List[Any] = []
        self._first_param: Dict[int, int] = {}
        self._wrapped: List[Any] = []
        self._logged = 0

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_aligner", "_reference", "_first_param", "_wrapped", "_logged"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self.config.active:
            return
        if isinstance(pl_module, FP8TransposeAlignMixin):
            raise RuntimeError(
                f"You have added the FP8TransposeAlignment callback and are using "
                f"{type(pl_module).__name__}, which already has FP8TransposeAlignMixin. Either "
                "remove the callback or use a model class without the mixin.")
        cfg = getattr(pl_module, "cfg", None)
        if cfg is None:
            raise TypeError(f"FP8TransposeAlignment needs a NeMo Megatron GPT model (with .cfg); "
                            f"got {type(pl_module).__name__}")
        startup_check(self._cfg_with_block(cfg), trainer, weights=self.weights)
        if getattr(pl_module, "use_mcore_dist_optim", False):
            self._wrap_ddp_setup(pl_module)

    def _wrap_ddp_setup(self, pl_module: Any) -> None:
        """megatron-core 0.12.3's shared-embedding bucket bug stops NeMo's interleaved path
        (see :func:`nemo_fp8_align.nemo.mixin.shared_embedding_bucket_workaround`); NeMo sets
        the flag again in its own ``setup``, so the workaround wraps the DDP construction
        itself (NLPDDPStrategy.configure_ddp calls ``model.setup_mcore_distributed_parallel``)."""
        original = pl_module.setup_mcore_distributed_parallel

        def setup_mcore_distributed_parallel() -> None:
            from megatron.core import parallel_state

            del pl_module.setup_mcore_distributed_parallel  # once: back to NeMo's method
            dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
            hidden = hide_shared_embedding_flags(model_chunks(pl_module), data_parallel_size=dp)
            try:
                original()
            finally:
                restore_shared_embedding_flags(hidden)
            check_buckets(model_chunks(pl_module))

        pl_module.setup_mcore_distributed_parallel = setup_mcore_distributed_parallel

    def _cfg_with_block(self, cfg: Any) -> Any:
        """The model config with ``fp8_transpose_align`` replaced by this callback's settings."""
        from omegaconf import OmegaConf

        from nemo_fp8_align.nemo.structured import BLOCK_KEY

        merged = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        block = {"enabled": self.config.enabled, "policy": self.config.policy.value,
                 "telemetry_path": self.config.telemetry_path,
                 "use_triton_kernel": self.config.use_triton_kernel,
                 "te_kernel_writes_transpose": self.config.te_kernel_writes_transpose}
        OmegaConf.update(merged, BLOCK_KEY, block, merge=False, force_add=True)
        return merged

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.config.active or self._aligner is not None:
            return
        aligner, self._reference = build_aligner(pl_module, self.config, weights=self.weights)
        if aligner.attach():
            self._aligner = aligner
            self._first_param = first_param_index(model_chunks(pl_module))

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._aligner is None:
            return
        # New step: the optimizer changed the high-precision weights; shadows are stale.
        for weight in self._reference:
            weight.invalidate()
        self._wrap_launches(pl_module)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._unwrap_launches()
        if self._aligner is None:
            return
        new = self._aligner.records[self._logged:]
        self._logged = len(self._aligner.records)
        self.transposes += sum(r.transposed for r in new)
        self.steps += 1
        if (trainer.logger is None or not trainer.is_global_zero
                or self.steps % self.log_every_n_steps):
            return
        metrics: Dict[str, float] = {}
        for r in new:
            prefix = f"fp8_align/chunk{r.chunk}"
            metrics[f"{prefix}/slot"] = float(r.slot)
            metrics[f"{prefix}/aligned_slot"] = float(r.aligned_slot)
            metrics[f"{prefix}/transposed"] = float(r.transposed)
            metrics[f"{prefix}/after_all_gather"] = float(r.after_all_gather)
            if r.seconds is not None:
                metrics[f"{prefix}/seconds"] = float(r.seconds)
        if metrics:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if "setup_mcore_distributed_parallel" in pl_module.__dict__:
            del pl_module.setup_mcore_distributed_parallel
        self._unwrap_launches()
        if self._aligner is not None:
            self._aligner.detach()
        self._reset_runtime()

    # ------------------------------------------------------------------ launch wrappers
    def _wrap_launches(self, pl_module: Any) -> None:
        aligner = self._aligner
        if getattr(pl_module, "use_mcore_dist_optim", False):
            for c, chunk in enumerate(model_chunks(pl_module)):
                chunk.start_param_sync = schedule_launch(aligner, c, chunk.start_param_sync)
                self._wrapped.append((chunk, "start_param_sync"))
        else:
            original = pl_module.sync_overlap_parameters
            first = self._first_param

            def sync_overlap_parameters(params: Any = None) -> None:
                if params is None:
                    return original(params)
                params = list(params)  # the schedule passes a generator: read it once
                original(params)
                chunk = first.get(id(params[0])) if params else None
                if chunk is not None:
                    aligner.on_param_sync_launched(chunk)
                return None

            pl_module.sync_overlap_parameters = sync_overlap_parameters
            self._wrapped.append((pl_module, "sync_overlap_parameters"))

    def _unwrap_launches(self) -> None:
        for owner, name in self._wrapped:
            if name in owner.__dict__:
                delattr(owner, name)
        self._wrapped = []

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"steps": self.steps, "transposes": self.transposes}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.steps = int(state_dict.get("steps", self.steps))
        self.transposes = int(state_dict.get("transposes", self.transposes))
