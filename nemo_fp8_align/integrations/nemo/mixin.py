"""``FP8TransposeAlignMixin``: aligned FP8 weight transposes for NeMo's ``MegatronGPTModel``.

Put it first in the bases::

    class MegatronGPTFP8AlignModel(FP8TransposeAlignMixin, MegatronGPTModel):
        pass

A thin shim over :class:`~nemo_fp8_align.integrations.nemo.session.NeMoSession`, which does the
work (the callback reaches the same session through instance attributes instead). What the mixin
adds itself: the startup check (:func:`~nemo_fp8_align.integrations.nemo.build.startup_check`)
runs on the model config *before* ``MegatronGPTModel`` builds anything, and raises one error
listing every violation with its Hydra fix; and NeMo's methods the session needs are overridden
to pass through it (``setup_mcore_distributed_parallel``, ``fwd_bwd_step``,
``sync_overlap_parameters``, the Lightning hooks).

Class attributes:
    fp8_align_weights: :class:`FP8Weights` the aligner transposes (default TE;
        ``FP8Weights.REFERENCE`` for the reference FP8 weights of the CPU layers, where TE is
        absent: the TE-only config keys are then not required by the startup check).
    fp8_align_log_every_n_steps: gather and log the metrics every this many steps (None: the
        trainer's ``log_every_n_steps``), as the callback's ``log_every_n_steps``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations.nemo.build import FP8Weights, check_telemetry_path, startup_check
from nemo_fp8_align.integrations.nemo.session import NeMoSession, check_log_every_n_steps

__all__ = ["FP8TransposeAlignMixin", "FP8Weights"]

logger = logging.getLogger(__name__)


class FP8TransposeAlignMixin:
    """Adds aligned FP8 weight transposes to ``MegatronGPTModel`` (list it first in the bases)."""

    fp8_align_weights: FP8Weights = FP8Weights.TE
    fp8_align_log_every_n_steps: Optional[int] = None

    def __init__(self, cfg: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        weights = FP8Weights(self.fp8_align_weights)
        every = check_log_every_n_steps(
            self.fp8_align_log_every_n_steps,
            setting=f"{type(self).__name__}.fp8_align_log_every_n_steps")
        # Before MegatronGPTModel builds anything: a bad config fails in seconds, not after
        # model construction and process-group setup.
        align = startup_check(cfg, trainer, weights=weights)
        super().__init__(cfg, trainer, *args, **kwargs)
        self._fp8_align_session = NeMoSession(self, align, weights=weights,
                                              log_every_n_steps=every, entry="mixin")

    # ------------------------------------------------------------------ public state
    @property
    def fp8_align_session(self) -> NeMoSession:
        """The plugin's wiring into this model (:class:`NeMoSession`)."""
        return self._fp8_align_session

    @property
    def fp8_align_config(self) -> AlignConfig:
        """The plugin's settings read from ``model.fp8_transpose_align``."""
        return self._fp8_align_session.config

    @property
    def fp8_aligner(self) -> Any:
        """The rank's :class:`TransposeAligner` while training (None otherwise)."""
        return self._fp8_align_session.aligner

    # ------------------------------------------------------------------ NeMo's methods
    def setup_mcore_distributed_parallel(self) -> None:
        if not self.fp8_align_config.active:
            # Plugin off: NeMo's DDP setup unchanged (no bucket workaround, no bucket check).
            return super().setup_mcore_distributed_parallel()
        return self._fp8_align_session.setup_ddp(super().setup_mcore_distributed_parallel)

    def fwd_bwd_step(self, dataloader_iter: Any, forward_only: bool,
                     first_val_step: Any = None) -> Any:
        return self._fp8_align_session.fwd_bwd_step(super().fwd_bwd_step, dataloader_iter,
                                                    forward_only, first_val_step)

    def sync_overlap_parameters(self, params: Any = None) -> None:
        return self._fp8_align_session.sync_overlap_parameters(super().sync_overlap_parameters,
                                                               params)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, stage: Optional[str] = None) -> None:
        if stage == "fit" and self.fp8_align_config.active:
            check_telemetry_path(self.fp8_align_config.telemetry_path)  # before any work
        super().setup(stage)

    def on_train_start(self) -> None:
        super().on_train_start()
        self.fp8_align_attach()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().on_train_batch_end(*args, **kwargs)
        except BaseException:
            self.fp8_align_detach()  # Lightning runs no teardown of the model after it
            raise
        self._fp8_align_session.log_metrics(self.trainer)

    def on_train_end(self) -> None:
        self._fp8_align_session.close(agree=True)  # every rank, after the last step
        super().on_train_end()

    def teardown(self, stage: str) -> None:
        self.fp8_align_detach()
        super().teardown(stage)

    def fp8_align_attach(self) -> bool:
        """Build and attach the rank's aligner (idempotent); returns whether it is active."""
        if not self.fp8_align_config.active:
            logger.info("nemo_fp8_align: disabled by model.fp8_transpose_align")
            return False
        return self._fp8_align_session.attach()

    def fp8_align_detach(self) -> None:
        """Remove the aligner's hooks and chunk claim (idempotent)."""
        self._fp8_align_session.close()
