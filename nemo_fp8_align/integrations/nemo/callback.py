"""``FP8TransposeAlignment``: the aligned FP8 transposes as a Lightning callback.

For NeMo GPT models that do not subclass with
:class:`~nemo_fp8_align.integrations.nemo.mixin.FP8TransposeAlignMixin`::

    trainer = MegatronTrainerBuilder(cfg).create_trainer(callbacks=[FP8TransposeAlignment()])

Without arguments it follows ``model.fp8_transpose_align`` (arguments passed win over the block).
Where the training script cannot be changed (NeMo's stock ``megatron_gpt_pretraining.py``, the
NeMo-Framework-Launcher), the package's Lightning ``callbacks_factory`` entry points
(:func:`callbacks_factory`) add one to every Trainer; it stays inert unless the model config has
the block and it enables the plugin (``+model.fp8_transpose_align.policy=aligned``).

Lifecycle: ``setup`` (fit only) reads the block and runs the startup check on ``pl_module.cfg``;
``on_train_start`` builds and attaches the rank's aligner; each training batch
(``on_train_batch_start`` .. ``on_train_batch_end``) wraps the launch functions NeMo binds into
``config.param_sync_func`` (``pl_module.sync_overlap_parameters`` for Apex, each chunk's
``start_param_sync`` for megatron-core DDP) and unwraps them afterwards, so validation passes
inside ``fit`` see NeMo unchanged; ``on_train_batch_end`` gathers the step's records over the
pipeline ranks and logs them once (:mod:`nemo_fp8_align.integrations.nemo.metrics`); ``teardown`` and
``on_exception`` detach everything.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Union

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations.nemo.metrics import last_step_records, log_step_metrics
from nemo_fp8_align.integrations.nemo.mixin import (
    FP8TransposeAlignMixin,
    FP8Weights,
    build_aligner,
    check_buckets,
    check_telemetry_path,
    detect_weights,
    first_param_index,
    hide_shared_embedding_flags,
    model_chunks,
    restore_shared_embedding_flags,
    schedule_launch,
    startup_check,
)

__all__ = ["FP8TransposeAlignment", "callbacks_factory", "pl_callbacks_factory"]

logger = logging.getLogger(__name__)


_UNSET: Any = object()  # "not passed": the value comes from model.fp8_transpose_align


class FP8TransposeAlignment(Callback):
    """Builds each model chunk's FP8 transposes at its aligned interleaved-schedule slot.

    Settings not passed here come from the model config's ``model.fp8_transpose_align`` block
    (read at ``setup``; AlignConfig's defaults where the block is absent), so
    ``FP8TransposeAlignment()`` follows the YAML and its Hydra overrides; settings passed here
    win over the block.

    Args:
        enabled: master switch (``False``: the callback does nothing).
        policy: ``"aligned"`` (the fix), ``"lazy"`` (observe only), ``"off"``.
        telemetry_path: JSON-lines file per rank (``{rank}`` is replaced), or None.
        use_triton_kernel: on CUDA, one batched transpose kernel per chunk.
        te_kernel_writes_transpose: let that kernel write TE's transpose buffers directly.
        weights: ``"te"`` (Transformer Engine FP8 parameters, ``model.fp8_params=True``) or
            ``"reference"`` (the reference FP8 weights the chunks' layers hold, CPU runs without
            TE); None: ``"reference"`` when the chunks hold such weights, else ``"te"``.
        log_every_n_steps: gather and log the metrics every this many steps (None: the
            trainer's ``log_every_n_steps``).
    """

    def __init__(self, *, enabled: Any = _UNSET, policy: Any = _UNSET,
                 telemetry_path: Any = _UNSET, use_triton_kernel: Any = _UNSET,
                 te_kernel_writes_transpose: Any = _UNSET,
                 weights: Union[None, str, FP8Weights] = None,
                 log_every_n_steps: Optional[int] = None) -> None:
        super().__init__()
        if enabled is not _UNSET and not isinstance(enabled, bool):
            raise TypeError(f"FP8TransposeAlignment(enabled={enabled!r}): expected True or False")
        if log_every_n_steps is not None and (type(log_every_n_steps) is not int
                                              or log_every_n_steps < 1):
            raise ValueError(f"FP8TransposeAlignment(log_every_n_steps={log_every_n_steps!r}): "
                             "expected an int >= 1 (or None: the trainer's log_every_n_steps)")
        try:
            self.weights = None if weights is None else FP8Weights(weights)
        except ValueError:
            raise ValueError(
                f"FP8TransposeAlignment(weights={weights!r}): use one of "
                + ", ".join(w.value for w in FP8Weights) + " (or None: detected)") from None
        given = dict(enabled=enabled, policy=policy, telemetry_path=telemetry_path,
                     use_triton_kernel=use_triton_kernel,
                     te_kernel_writes_transpose=te_kernel_writes_transpose)
        #: Settings passed to the constructor; the rest come from the model config at setup.
        self.overrides = {k: v for k, v in given.items() if v is not _UNSET}
        # AlignConfig validates the policy and names the choices; setup re-reads the block.
        self.config = AlignConfig(**self.overrides)
        self.log_every_n_steps = log_every_n_steps
        #: Created by the Lightning callbacks-factory entry point (see :func:`callbacks_factory`):
        #: inert unless the model config's block is present and enables the plugin.
        self.from_entry_point = False
        #: Steps whose telemetry was counted, and transposes built, over the callback's life.
        self.steps = 0
        self.transposes = 0
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._aligner: Any = None
        self._first_param: Dict[int, int] = {}
        self._wrapped: List[Any] = []
        self._active = False
        self._weights = self.weights
        self._counted_step = -1

    @property
    @override
    def state_key(self) -> str:
        # The entry point adds one to every Trainer: its checkpoint state must not collide with
        # a callback the user passes (Lightning refuses two stateful callbacks with one key).
        return self._generate_state_key(from_entry_point=self.from_entry_point)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_aligner", "_first_param", "_wrapped", "_active", "_weights",
                    "_counted_step"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._active = False
        if stage != "fit":
            return
        cfg = getattr(pl_module, "cfg", None)
        if self.from_entry_point:
            reason = _entry_point_inert_reason(self, trainer, pl_module, cfg)
            if reason:
                logger.debug("nemo_fp8_align: entry-point callback inert: %s", reason)
                return
        elif cfg is None:
            raise TypeError(f"FP8TransposeAlignment needs a NeMo Megatron GPT model (with .cfg); "
                            f"got {type(pl_module).__name__}")
        self.config = self._resolve(cfg)
        if not self.config.active:
            return
        if isinstance(pl_module, FP8TransposeAlignMixin):
            raise RuntimeError(
                f"You have added the FP8TransposeAlignment callback and are using "
                f"{type(pl_module).__name__}, which already has FP8TransposeAlignMixin. Either "
                "remove the callback or use a model class without the mixin.")
        others = [cb for cb in trainer.callbacks
                  if isinstance(cb, FP8TransposeAlignment) and cb is not self
                  and not cb.from_entry_point]
        if others and not self.from_entry_point:
            raise RuntimeError(
                f"trainer.callbacks holds {len(others) + 1} FP8TransposeAlignment callbacks: the "
                "plugin attaches once per model. Keep one (its settings win over "
                "model.fp8_transpose_align).")
        self._weights = self.weights or detect_weights(model_chunks(pl_module))
        startup_check(self._cfg_with_block(cfg), trainer, weights=self._weights)
        check_telemetry_path(self.config.telemetry_path)
        self._active = True
        if getattr(pl_module, "use_mcore_dist_optim", False):
            self._wrap_ddp_setup(pl_module)

    def _resolve(self, cfg: Any) -> AlignConfig:
        """``model.fp8_transpose_align`` (checked: unknown keys and bad values raise) with this
        callback's own settings on top."""
        from nemo_fp8_align.config_check.check import align_config_from

        return dataclasses.replace(align_config_from(cfg), **self.overrides)

    def _wrap_ddp_setup(self, pl_module: Any) -> None:
        """megatron-core 0.12.3's shared-embedding bucket bug stops NeMo's interleaved path
        (see :func:`nemo_fp8_align.integrations.nemo.mixin.shared_embedding_bucket_workaround`); NeMo sets
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

        from nemo_fp8_align.config_check.structured import BLOCK_KEY, block_values

        merged = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        # Every AlignConfig field, from the dataclass itself: none can be dropped here.
        OmegaConf.update(merged, BLOCK_KEY, block_values(self.config), merge=False,
                         force_add=True)
        return merged

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._active or self._aligner is not None:
            return
        aligner = build_aligner(pl_module, self.config, weights=self._weights)
        if aligner.attach():
            self._aligner = aligner
            self._first_param = first_param_index(model_chunks(pl_module))
            # Lightning's rank-zero logger is the one NeMo's logs show (once, not per rank).
            rank_zero_info(
                f"nemo_fp8_align: {self.config.policy.value} FP8 transposes attached "
                f"({'entry point' if self.from_entry_point else 'callback'}; "
                f"{len(aligner.weights)} chunks, FP8 weights per chunk "
                f"{[len(w) for w in aligner.weights]}, backend {aligner.backend.name})")

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._aligner is not None:
            # Telemetry steps follow global_step (also after a resume from a checkpoint).
            self._aligner.set_next_step(trainer.global_step)
            self._wrap_launches(pl_module)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._unwrap_launches()
        if self._aligner is None:
            return
        self._aligner.on_step_end()  # every forward planned ran (NeMo has no finalize hook for it)
        new = last_step_records(self._aligner.records)
        if new and new[-1].step != self._counted_step:
            self._counted_step = new[-1].step
            self.transposes += sum(r.transposed for r in new)
            self.steps += 1
        else:
            new = []
        log_step_metrics(pl_module, trainer, new, every_n_steps=self.log_every_n_steps)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning may not reach teardown's hooks after an exception: leave NeMo as it was.
        self.teardown(trainer, pl_module, "fit")

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
        # Lightning saves no key for an empty state: an inert callback (the entry point's, on
        # every Trainer) then leaves checkpoints as without the plugin, which load anywhere
        # without Lightning's missing-callback warning.
        if not (self._active or self.steps or self.transposes):
            return {}
        return {"steps": self.steps, "transposes": self.transposes}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.steps = int(state_dict.get("steps", self.steps))
        self.transposes = int(state_dict.get("transposes", self.transposes))


# ---------------------------------------------------------------------------------------------
# Lightning callbacks-factory entry points (pyproject.toml [project.entry-points])


def _entry_point_inert_reason(callback: FP8TransposeAlignment, trainer: Any, pl_module: Any,
                              cfg: Any) -> str:
    """Why the entry-point callback does nothing for this model ('' = it attaches)."""
    from nemo_fp8_align.config_check.structured import BLOCK_KEY

    get = getattr(cfg, "get", None)
    if get is None:
        return f"{type(pl_module).__name__} has no NeMo model config (.cfg)"
    block = get(BLOCK_KEY)
    if block is None:
        return f"model.{BLOCK_KEY} is not in the model config"
    if isinstance(pl_module, FP8TransposeAlignMixin):
        return f"{type(pl_module).__name__} has FP8TransposeAlignMixin, which attaches the plugin"
    if any(isinstance(cb, FP8TransposeAlignment) and cb is not callback
           for cb in trainer.callbacks):
        return "trainer.callbacks already holds an FP8TransposeAlignment callback"
    return ""


def callbacks_factory() -> List[Callback]:
    """``lightning.pytorch.callbacks_factory`` entry point: one inert-by-default callback.

    Lightning calls it in every ``Trainer.__init__``, before any model exists; the callback
    decides at ``setup`` from the model config (see :func:`_entry_point_inert_reason`)."""
    callback = FP8TransposeAlignment()
    callback.from_entry_point = True
    return [callback]


def pl_callbacks_factory() -> List[Any]:
    """``pytorch_lightning.callbacks_factory`` entry point: the same for ``pytorch_lightning``
    Trainers (the callback class is then also a ``pytorch_lightning.Callback``)."""
    callback = __getattr__("FP8TransposeAlignmentPL")()
    callback.from_entry_point = True
    return [callback]


def __getattr__(name: str) -> Any:
    # FP8TransposeAlignmentPL is built on first use: importing pytorch_lightning (a second copy
    # of Lightning, loaded only by its own Trainers) would slow every other import of this module.
    if name != "FP8TransposeAlignmentPL":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import pytorch_lightning

    cls = type(name, (FP8TransposeAlignment, pytorch_lightning.Callback),
               {"__module__": __name__, "__doc__": "FP8TransposeAlignment for pytorch_lightning."})
    globals()[name] = cls
    return cls
