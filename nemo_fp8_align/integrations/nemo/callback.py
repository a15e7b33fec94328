"""``FP8TransposeAlignment``: the aligned FP8 transposes as a Lightning callback.

For NeMo GPT models that do not subclass with
:class:`~nemo_fp8_align.integrations.nemo.mixin.FP8TransposeAlignMixin`::

    trainer = MegatronTrainerBuilder(cfg).create_trainer(callbacks=[FP8TransposeAlignment()])

Without arguments it follows ``model.fp8_transpose_align`` (arguments passed win over the block).
Where the training script cannot be changed (NeMo's stock ``megatron_gpt_pretraining.py``, the
NeMo-Framework-Launcher), the package's Lightning ``callbacks_factory`` entry points
(:func:`callbacks_factory`) add one to every Trainer; it stays inert unless the model config has
the block and it enables the plugin (``+model.fp8_transpose_align.policy=aligned``).

The Lightning hooks only: the work is done by
:class:`~nemo_fp8_align.integrations.nemo.session.NeMoSession`, the wiring the mixin uses too.
``setup`` (fit only) reads the block, runs the startup check on ``pl_module.cfg`` and opens the
session, which shadows the model's ``fwd_bwd_step`` (and ``setup_mcore_distributed_parallel``,
or for Apex ``sync_overlap_parameters``) on the instance until it closes; ``on_train_start``
attaches the rank's aligner; ``on_train_batch_end`` logs the step's metrics once; ``teardown``
and ``on_exception`` close the session.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Union

from lightning.pytorch import Callback
from typing_extensions import override

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations.nemo.build import (FP8Weights, check_telemetry_path,
                                                   detect_weights, model_chunks, startup_check)
from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin
from nemo_fp8_align.integrations.nemo.session import NeMoSession, check_log_every_n_steps

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
        check_log_every_n_steps(log_every_n_steps,
                                setting="FP8TransposeAlignment.log_every_n_steps")
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
        self._session: Optional[NeMoSession] = None  # open from setup (fit) to teardown
        self._weights = self.weights

    @property
    def aligner(self) -> Any:
        """The rank's :class:`TransposeAligner` while training (None otherwise)."""
        return self._session.aligner if self._session is not None else None

    @property
    @override
    def state_key(self) -> str:
        # The entry point adds one to every Trainer: its checkpoint state must not collide with
        # a callback the user passes (Lightning refuses two stateful callbacks with one key).
        return self._generate_state_key(from_entry_point=self.from_entry_point)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_session", "_weights"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close_session()
        if stage != "fit":
            return
        cfg = getattr(pl_module, "cfg", None)
        if self.from_entry_point:
            reason = _entry_point_inert_reason(self, trainer, pl_module, cfg)
            if reason:
                logger.debug("nemo_fp8_align: entry-point callback inert: %s", reason)
                return
        elif cfg is None or not callable(getattr(pl_module, "fwd_bwd_step", None)):
            raise TypeError(f"FP8TransposeAlignment needs a NeMo Megatron GPT model (with .cfg "
                            f"and fwd_bwd_step); got {type(pl_module).__name__}")
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
        self._session = NeMoSession(pl_module, self.config, weights=self._weights,
                                    log_every_n_steps=self.log_every_n_steps,
                                    entry="entry point" if self.from_entry_point else "callback")
        self._session.shadow_module_methods()

    def _resolve(self, cfg: Any) -> AlignConfig:
        """``model.fp8_transpose_align`` (checked: unknown keys and bad values raise) with this
        callback's own settings on top."""
        from nemo_fp8_align.config_check.check import align_config_from

        return dataclasses.replace(align_config_from(cfg), **self.overrides)

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
        if self._session is not None:
            self._session.attach()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._session is None:
            return
        new = self._session.log_metrics(trainer)
        if new:
            self.transposes += sum(r.transposed for r in new)
            self.steps += 1

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Every rank, after the last step: what the aligner still holds stops every rank.
        self._close_session(agree=True)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning may not reach teardown's hooks after an exception: leave NeMo as it was.
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close_session()

    def _close_session(self, *, agree: bool = False) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close(agree=agree)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> Dict[str, Any]:
        # Lightning saves no key for an empty state: an inert callback (the entry point's, on
        # every Trainer) then leaves checkpoints as without the plugin, which load anywhere
        # without Lightning's missing-callback warning.
        if not (self._session is not None or self.steps or self.transposes):
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
    if not callable(getattr(pl_module, "fwd_bwd_step", None)):
        return f"{type(pl_module).__name__} has no fwd_bwd_step (not a NeMo Megatron GPT model)"
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
