"""The adapter for Apex's ``DistributedFusedAdam`` (NeMo's ``distributed_fused_adam``).

NeMo's ``distributed_fused_adam`` (``MegatronDistributedFusedAdam``, a subclass of Apex's
``DistributedFusedAdam``) keeps parameters sharded in *buckets*, each with a
``ParameterStatus``: SHARDED (not launched) -> SYNCING (all-gather in flight) -> READY
(gathered). ``_try_start_bucket_param_sync(params)`` launches the SHARDED buckets of ``params``
and, before that, finishes every all-gather in flight (``_finish_bucket_param_sync``: all
SYNCING buckets become READY). The gathered values reach a parameter only through
``_param_copy(params)``, normally run by Apex's pre-forward "hook" (a patched
``__getattribute__``: the first attribute access of a parameter whose
``_pre_forward_hook_is_enabled`` flag is set). For Transformer Engine FP8 parameters NeMo's
``_param_copy_fragments`` writes the bytes into ``Float8Tensor._data`` and then resets the
transpose cache.

What this means at a chunk's aligned slot, and what :meth:`ApexAdapter.finish` does:

* chunk c < C-1: the schedule has just launched chunk c+1, which finished chunk c's all-gather:
  c's buckets are READY. Copy them now (no collective, no wait) and clear the hook flags, so no
  second ``_param_copy`` of the same parameters resets the caches the plugin is about to fill
  (the transposes would be silently lost and rebuilt lazily, unaligned).
* the last chunk (which NeMo PR #9481 missed): nothing launches after it, so its buckets may
  still be SYNCING: wait for them first (``_finish_bucket_param_sync``), then copy.
* a bucket still SHARDED was never launched: ``_param_copy`` would start and finish a blocking
  all-gather for it. That keeps the parameters correct (a transpose of stale bytes would be a
  wrong gradient) and issues the same collective every data-parallel rank issues at the same
  point, but it is exposed: it is counted in :attr:`ApexAdapter.blocking_all_gathers` and
  logged once.

Only Apex's public bucket state machine is used (``ParameterStatus``, ``_params_buckets``,
``state[param]["fragments"]``, ``_finish_bucket_param_sync``, ``_param_copy``,
``_try_start_bucket_param_sync``, ``_pre_forward_hook_is_enabled``). Apex is not importable in
the CPU environment: the tests run this module against a stand-in of that state machine
(``tests/support/standins/apex_dfa.py``).

Launches: the schedule's call of NeMo's ``sync_overlap_parameters(params)`` (bound as
``config.param_sync_func`` inside NeMo's own step), reported to :meth:`ApexAdapter.launched` by
whoever routes it (NeMo's session) and mapped back to its chunk by the first parameter passed.
NeMo closes the step itself.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch

from nemo_fp8_align import support
from nemo_fp8_align.core.adapter import is_launch

__all__ = ["ApexAdapter"]

logger = logging.getLogger(__name__)

#: Apex attribute that arms the pre-forward "hook" of a parameter. Reading or writing it does
#: not trigger the hook (Apex lists it among the attributes its ``__getattribute__`` skips).
HOOK_FLAG = "_pre_forward_hook_is_enabled"


def _hook_enabled(param: Any) -> bool:
    return bool(getattr(param, HOOK_FLAG, False))


class ApexAdapter:
    """:class:`~nemo_fp8_align.core.adapter.Adapter` over Apex ``DistributedFusedAdam``.

    Args:
        optimizer: the ``DistributedFusedAdam`` (NeMo: ``MegatronDistributedFusedAdam``) that
            owns the parameters.
        chunks: this rank's model chunks, in schedule order. Their parameters are collected
            here, by identity only: build the adapter while the pre-forward hooks are off
            (before the first optimizer step).
    """

    owns_step_end = False  #: NeMo closes the step (its session calls ``on_step_end``)
    launched_before_loop = 2  #: the schedule's pre-loop calls (chunks 0 and 1)

    def __init__(self, optimizer: Any, chunks: Sequence[torch.nn.Module]) -> None:
        for name in ("_params_buckets", "_param_copy", "_finish_bucket_param_sync", "state",
                     "ParameterStatus"):
            if not hasattr(optimizer, name):
                raise TypeError(
                    f"{type(optimizer).__name__} has no '{name}': ApexAdapter needs Apex's "
                    "DistributedFusedAdam (NeMo optim.name=distributed_fused_adam). For "
                    "optim.name=mcore_distributed_optim use nemo_fp8_align.adapters.mcore_ddp."
                    "McoreDDPAdapter.")
        self.optimizer = optimizer
        self.chunk_params: List[List[Any]] = [list(c.parameters()) for c in chunks]
        # ``id`` of each chunk's first parameter -> chunk: the schedule passes
        # ``model[c].parameters()``, read once by the caller.
        self._chunk_of: Dict[int, int] = {id(p[0]): c for c, p in enumerate(self.chunk_params)
                                          if p}
        self._on_launch: Optional[Callable[[int], None]] = None
        #: Per chunk, how many times :meth:`finish` had to run a blocking all-gather because a
        #: bucket had never been launched (0 when the schedule launched everything in time).
        self.blocking_all_gathers: List[int] = [0] * len(self.chunk_params)
        self._warned = False

    def weights_to_align(self, weights: Sequence[Sequence[Any]], *, backend: Any,
                         config: Any) -> List[List[Any]]:
        """The refused setups of ``config`` raise, and so does every block-scaled recipe: no
        megatron-core post-processing runs on Apex's path, and the plugin never byte-transposes
        block-scaled data. Every weight is kept otherwise."""
        kept = [list(w) for w in weights]
        support.refuse_path(config, kept, backend, None, path="NeMo's Apex distributed_fused_adam")
        return kept

    # ------------------------------------------------------------------ bucket state
    def _bucket_ids(self, params: Sequence[Any]) -> Set[int]:
        """Ids of the live buckets (not yet copied out and freed) holding ``params``."""
        live = self.optimizer._params_buckets
        ids: Set[int] = set()
        for param in params:
            for fragment in self.optimizer.state[param].get("fragments", ()):
                if fragment.bucket_id in live:
                    ids.add(fragment.bucket_id)
        return ids

    def _statuses(self, bucket_ids: Set[int]) -> Dict[int, Any]:
        return {i: self.optimizer._params_buckets[i].status for i in sorted(bucket_ids)}

    def _lock(self) -> Any:
        lock = getattr(self.optimizer, "_lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ finishing a chunk
    def finish(self, chunk: int) -> bool:
        """Make ``chunk``'s parameters hold this step's values now; return True when they do."""
        status = self.optimizer.ParameterStatus
        with self._lock():
            pending = [p for p in self.chunk_params[chunk] if _hook_enabled(p)]
            if not pending:
                # Nothing armed: no overlapped sync this step (e.g. DP=1: Apex gathers
                # synchronously in step()), or the chunk was already copied.
                return self.finished(chunk)
            statuses = self._statuses(self._bucket_ids(pending))
            if any(s == status.SHARDED for s in statuses.values()):
                self.blocking_all_gathers[chunk] += 1
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "nemo_fp8_align: model chunk %d's parameter all-gather had not been "
                        "launched at its aligned slot; ran it blocking so the FP8 transposes "
                        "see this step's weights. Check that config.param_sync_func is NeMo's "
                        "sync_overlap_parameters (optim.overlap_param_sync=True).", chunk)
            elif any(s == status.SYNCING for s in statuses.values()):
                # The last chunk: nothing launched after it finished its all-gather.
                self.optimizer._finish_bucket_param_sync()
            # Disarm first: a second _param_copy of these parameters (Apex's hook at their
            # first use) would reset the transpose caches built right after this returns.
            for param in pending:
                setattr(param, HOOK_FLAG, False)
            try:
                self.optimizer._param_copy(pending)
            except BaseException:
                self._rearm_uncopied(pending)
                raise
            # What Apex's own hook does after a copy: keep the next bucket's all-gather going.
            if getattr(self.optimizer, "overlap_param_sync", False):
                self.optimizer._try_start_bucket_param_sync()
        return self.finished(chunk)

    def _rearm_uncopied(self, params: Sequence[Any]) -> None:
        """After a failed copy: re-arm every parameter whose bucket is still live, so that
        Apex's own hook copies it at first use (a parameter left disarmed and un-copied would
        compute with last step's bytes). Copied-out buckets are freed, and Apex's copy skips
        their parameters; a parameter copied from a live bucket is copied again: same bytes."""
        for param in params:
            if self._bucket_ids([param]):
                setattr(param, HOOK_FLAG, True)

    def finished(self, chunk: int) -> bool:
        """Whether ``chunk``'s parameters hold this step's values (observes only)."""
        params = self.chunk_params[chunk]
        if any(_hook_enabled(p) for p in params):
            return False
        status = self.optimizer.ParameterStatus
        return all(s == status.READY for s in self._statuses(self._bucket_ids(params)).values())

    # ------------------------------------------------------------------ the schedule hold
    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        self._on_launch = on_launch

    def launched(self, params: Sequence[Any], **kwargs: Any) -> None:
        """The schedule's parameter sync for ``params`` has just been started."""
        chunk = self._chunk_of.get(id(params[0])) if params else None
        if self._on_launch is not None and chunk is not None and is_launch(kwargs):
            self._on_launch(chunk)

    def training(self) -> bool:
        return torch.is_grad_enabled()

    def check(self) -> None:
        """Nothing to check: NeMo binds its own ``sync_overlap_parameters`` every step."""

    def restore(self) -> None:
        self._on_launch = None
