"""``NeMoSession``: the one wiring of the plugin into a NeMo 1.x ``MegatronGPTModel``.

The model mixin (:mod:`.mixin`) and the Lightning callback (:mod:`.callback`) are two ways in;
everything that touches NeMo at run time is here, once:

* the megatron-core DDP setup (:meth:`~NeMoSession.setup_ddp`): megatron-core 0.12.3's
  shared-embedding bucket workaround around NeMo's ``setup_mcore_distributed_parallel`` and the
  bucket check after it (:mod:`.bucket_workaround`);
* :meth:`~NeMoSession.attach`: the rank's aligner built for the model
  (:func:`~.build.build_aligner`), attached, one log line (global rank 0);
* the launches: NeMo re-binds ``config.param_sync_func`` inside every ``fwd_bwd_step``, from the
  chunks' ``start_param_sync`` (megatron-core DDP: the aligner's
  :class:`~nemo_fp8_align.adapters.mcore_ddp.McoreDDPAdapter` wraps them on the instances, as
  for every megatron-core loop) or from its own ``sync_overlap_parameters`` (Apex:
  :meth:`~NeMoSession.sync_overlap_parameters` reports to the
  :class:`~nemo_fp8_align.adapters.apex.ApexAdapter`). Validation runs without gradients and
  launches nothing (:func:`~nemo_fp8_align.core.adapter.is_launch`);
* the training step (:meth:`~NeMoSession.fwd_bwd_step`): closed inside it by megatron-core's
  ``finalize_model_grads`` (``mcore_distributed_optim``: the adapter's step end, as on every
  megatron-core path), or when it returns (Apex, whose optimizer has no per-step call);
* :meth:`~NeMoSession.log_metrics` after each training batch (each step once,
  :mod:`nemo_fp8_align.core.metrics`);
* :meth:`~NeMoSession.close`: hooks, chunk claim and every shadow removed; idempotent, and run
  on every error raised through the session, because Lightning runs no LightningModule
  ``teardown`` after an exception (the mixin would otherwise leave its hooks and claim behind).

Where the step is closed. NeMo 2.3.3's ``MegatronGPTModel.training_step`` calls
``fwd_bwd_step(dataloader_iter, False)``, which runs every forward and backward of the step
(megatron-core's schedule, ``finalize_model_grads`` included); the rest of ``training_step``
runs no forward (gradient all-reduces, the embedding wgrad drain). Lightning's automatic
optimization then runs ``on_before_optimizer_step`` and the optimizer step (NeMo's ``backward``
and ``optimizer_zero_grad`` are no-ops), and only after that ``on_train_batch_end``. So the
return of the training ``fwd_bwd_step`` is the exact point where "every planned forward ran" is
known, the point the megatron-core entry point judges at (``finalize_model_grads_func``, which
NeMo's ``mcore_distributed_optim`` path runs inside ``fwd_bwd_step``: there the adapter closes
the step). The step is closed there, by the mixin and the callback alike, in the same ``try`` as
its launches:
a step that did not run as planned raises before the optimizer applies its update; no step is
left open across Lightning code the session does not see; and no skipped Lightning hook
(``on_train_batch_start`` returning -1 ends the epoch without ``on_train_batch_end``) can leave
a launch wrapper behind for the next batch to stack a second one on.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations.nemo.bucket_workaround import (check_buckets,
                                                               shared_embedding_bucket_workaround)
from nemo_fp8_align.adapters.groups import data_parallel, pipeline_group
from nemo_fp8_align.integrations.nemo.build import FP8Weights, build_aligner, model_chunks
from nemo_fp8_align.core.metrics import gather_step_metrics, last_step_records

__all__ = ["NeMoSession", "check_log_every_n_steps"]

logger = logging.getLogger(__name__)

_ABSENT: Any = object()


def check_log_every_n_steps(value: Optional[int], *, setting: str) -> Optional[int]:
    """``value`` if it is None or an int >= 1; else a ValueError naming ``setting``."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{setting}={value!r}: expected an int >= 1 (or None: the trainer's "
                         "log_every_n_steps)")
    return value


class _Shadows:
    """Instance attributes set over methods of NeMo objects; :meth:`restore` removes them (or
    puts back an instance value that was there before), newest first."""

    def __init__(self) -> None:
        self._saved: List[tuple] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, before = self._saved.pop()
            if before is not _ABSENT:
                setattr(owner, name, before)
            elif name in owner.__dict__:
                delattr(owner, name)


class NeMoSession:
    """The plugin on one NeMo GPT model on this rank: build, launches, step close, metrics.

    Args:
        module: the ``MegatronGPTModel`` (NeMo's ``model`` chunks, ``use_mcore_dist_optim``,
            ``fwd_bwd_step``, ``sync_overlap_parameters``, ``trainer``).
        config: the plugin's settings (already checked).
        weights: which FP8 weights the aligner transposes.
        log_every_n_steps: gather and log the metrics every this many steps (None: the
            trainer's ``log_every_n_steps``).
        entry: how the plugin was turned on, for the log line ("mixin", "callback", ...).
    """

    def __init__(self, module: Any, config: AlignConfig, *, weights: FP8Weights,
                 log_every_n_steps: Optional[int] = None, entry: str = "mixin") -> None:
        self.module = module
        self.config = config
        self.weights = FP8Weights(weights)
        self.log_every_n_steps = check_log_every_n_steps(log_every_n_steps,
                                                         setting="log_every_n_steps")
        self.entry = entry
        #: The rank's :class:`~nemo_fp8_align.core.aligner.TransposeAligner` while attached.
        self.aligner: Any = None
        #: True for the length of a training ``fwd_bwd_step``.
        self.in_training_step = False
        self._logged_step = -1
        self._stepped = False  # a training fwd_bwd_step ran since the last batch end
        self._warned_no_step = False
        self._shadows = _Shadows()  # on the module until close (the callback's way in)

    # ------------------------------------------------------------------ the callback's way in
    def shadow_module_methods(self) -> None:
        """Route NeMo's calls into the session without a model subclass (the callback): the
        module's own methods are shadowed on the instance until :meth:`close`."""
        module = self.module
        if getattr(module, "use_mcore_dist_optim", False):
            # NLPDDPStrategy.configure_ddp calls it after the callbacks' setup; NeMo sets the
            # shared-embedding flag again in its own setup, so only the call itself can hide it.
            self._shadows.set(module, "setup_mcore_distributed_parallel",
                              partial(self.setup_ddp, module.setup_mcore_distributed_parallel))
        else:
            self._shadows.set(module, "sync_overlap_parameters",
                              partial(self.sync_overlap_parameters, module.sync_overlap_parameters))
        self._shadows.set(module, "fwd_bwd_step", partial(self.fwd_bwd_step, module.fwd_bwd_step))

    # ------------------------------------------------------------------ setup
    def setup_ddp(self, run: Callable[[], Any]) -> None:
        """``run`` (NeMo's ``setup_mcore_distributed_parallel``) with megatron-core 0.12.3's
        shared-embedding bucket workaround, then the bucket check (mcore optimizer only)."""
        _, dp, _ = data_parallel(model_chunks(self.module), with_context_parallel=True)
        with shared_embedding_bucket_workaround(model_chunks(self.module), data_parallel_size=dp):
            run()
        if getattr(self.module, "use_mcore_dist_optim", False):
            check_buckets(model_chunks(self.module))

    def attach(self) -> bool:
        """Build and attach the rank's aligner (idempotent); returns whether it is active."""
        if self.aligner is not None:
            return self.aligner.attached
        try:
            # Every rank attaches here; a failure on one (its telemetry path, say) stops all,
            # and leaves nothing attached on any.
            aligner = build_aligner(self.module, self.config, weights=self.weights,
                                    entry=self.entry)
            if not aligner.attached:
                return False
            self.aligner = aligner
            self._announce(aligner)
        except BaseException:
            self.close()
            raise
        return True

    def _announce(self, aligner: Any) -> None:
        from lightning.pytorch.utilities import rank_zero_info

        cfg = getattr(self.module, "cfg", None) or {}
        optim = cfg.get("optim") or {}
        counts = [len(w) for w in aligner.weights]
        if not any(counts):
            logger.warning(
                "nemo_fp8_align: no FP8 weights found in the model chunks (model.fp8_params=%s): "
                "nothing to transpose. With Transformer Engine, model.fp8=True and "
                "model.fp8_params=True build Float8Tensor parameters.", cfg.get("fp8_params"))
        # Lightning's rank-zero logger is the one NeMo's logs show (once, not per rank).
        rank_zero_info(
            f"nemo_fp8_align: {self.config.policy.value} FP8 transposes attached ({self.entry}; "
            f"{len(counts)} chunks, FP8 weights per chunk {counts}, backend "
            f"{aligner.backend.name}, optimizer {optim.get('name')}, "
            f"overlap_param_sync={optim.get('overlap_param_sync')})")

    # ------------------------------------------------------------------ per step
    def fwd_bwd_step(self, run: Callable[..., Any], dataloader_iter: Any, forward_only: bool,
                     first_val_step: Any = None) -> Any:
        """``run`` (NeMo's ``fwd_bwd_step``); a training one reports its launches and closes
        the step when it returns (see the module docstring); any error closes the session."""
        aligner = self.aligner  # set only while attached
        if forward_only or aligner is None:
            return run(dataloader_iter, forward_only, first_val_step)
        try:
            # Telemetry steps follow global_step (also after a resume from a checkpoint).
            aligner.set_next_step(self.module.trainer.global_step)
            self.in_training_step = True
            try:
                out = run(dataloader_iter, forward_only, first_val_step)
            finally:
                self.in_training_step = False
            if not aligner.adapter.owns_step_end:  # Apex: no step end of its own
                aligner.on_step_end()  # every planned forward ran: judged before the optimizer step
        except BaseException:
            self.close()
            raise
        self._stepped = True
        return out

    def sync_overlap_parameters(self, run: Callable[[Any], Any], params: Any = None) -> None:
        """``run`` (NeMo's Apex ``sync_overlap_parameters``); inside a training step, the
        chunk whose parameters were passed is reported as launched."""
        adapter = getattr(self.aligner, "adapter", None)  # while attached
        # Only NeMo's schedule calls inside the training step are launches (NeMo also syncs
        # parameters around validation).
        if params is None or not self.in_training_step or not hasattr(adapter, "launched"):
            return run(params)
        params = list(params)  # the schedule passes a generator: read it once
        run(params)
        adapter.launched(params)
        return None

    def log_metrics(self, trainer: Any) -> List[Any]:
        """After each training batch, on every rank (the gather over the pipeline ranks and the
        agreement on its outcome are collectives; rank 0 logs): the newest step's metrics, each
        step once. Returns that step's records ([] when the batch brought none). A failure on
        one rank (reading its records, rank 0's ``log_dict``) raises on every rank."""
        aligner = self.aligner
        if aligner is None:
            return []
        self._warn_if_no_step()
        new = last_step_records(aligner.records)
        if not new or new[-1].step == self._logged_step:
            new = []
        else:
            self._logged_step = new[-1].step
        try:
            log_step_metrics(self.module, trainer, new, every_n_steps=self.log_every_n_steps,
                             error_group=getattr(aligner, "_error_group", None))
        except BaseException:
            self.close()
            raise
        return new

    def _warn_if_no_step(self) -> None:
        stepped, self._stepped = self._stepped, False
        if not stepped and not self._warned_no_step:
            self._warned_no_step = True
            logger.warning(
                "nemo_fp8_align: a training batch ended without a training fwd_bwd_step: %s's "
                "training_step does not call self.fwd_bwd_step(dataloader_iter, False), so the "
                "plugin saw no launch and aligned nothing", type(self.module).__name__)

    # ------------------------------------------------------------------ end
    def close(self, *, agree: bool = False) -> None:
        """Remove the aligner's hooks and chunk claim and every shadow (idempotent).
        ``agree=True`` where every rank closes at the same point (Lightning's ``on_train_end``,
        after the last step): what the aligner still holds then stops every rank
        (:meth:`~nemo_fp8_align.core.aligner.TransposeAligner.detach`); on an error's way out
        the close stays local."""
        aligner, self.aligner = self.aligner, None
        self.in_training_step = False
        try:
            self._shadows.restore()
        finally:
            if aligner is not None:
                aligner.detach(agree=agree)


def log_step_metrics(module: Any, trainer: Any, records: Sequence[Any], *,
                     every_n_steps: Optional[int] = None,
                     error_group: Any = None) -> Dict[str, float]:
    """Gather the finished step's records over the pipeline ranks and log them once (global
    rank 0) through ``module.log_dict``, on the logger step of NeMo's own metrics. Every rank of
    ``error_group`` (None: the job's) calls it after every training batch (the gather is a
    collective); returns the metrics.

    Rank 0's ``log_dict`` runs on rank 0 alone, after the gather: a logger failing there would
    leave the other ranks training on into collectives rank 0 never reaches. So the gather and
    the log are agreed on (one 4-byte all-reduce on each logging step, the same steps on every
    rank): a failure on any rank raises :class:`~nemo_fp8_align.errors.MetricsError` on every
    rank."""
    from nemo_fp8_align.core.step_end import agreed
    from nemo_fp8_align.errors import MetricsError

    every = every_n_steps or getattr(trainer, "log_every_n_steps", 1) or 1
    if trainer.global_step % every:  # global_step counts this step already: the same on all ranks
        return {}
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    chunks = model_chunks(module) if hasattr(module, "model") else []
    with agreed(label=f"rank {rank} (logging the plugin's metrics at global step "
                      f"{trainer.global_step})", group=error_group):
        metrics = gather_step_metrics(records, group=pipeline_group(chunks))
        if trainer.is_global_zero and metrics:
            try:
                module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1,
                                rank_zero_only=True)
            except Exception as err:
                raise MetricsError(
                    f"nemo_fp8_align: global rank {rank} could not log the plugin's step "
                    f"metrics: {type(module).__name__}.log_dict raised {type(err).__name__}: "
                    f"{err}; fix the trainer's logger (trainer.logger), then resume from the last "
                    "checkpoint") from err
    return metrics
