"""Finishing a model chunk's parameter all-gather in megatron-core's DDP (core_r0.9+).

megatron-core's own forward pre-hooks call ``finish_param_sync`` lazily at each rank's first use
of a bucket; this adapter lets the aligner call it earlier, at the aligned slot, for every bucket
group of the chunk (the dense ones and the expert-parallel ones). On core 0.16 with Transformer
Engine, ``finish_param_sync`` also runs TE's post-all-gather processing (the transposes), so the
backend then finds nothing left to build. Later pre-hooks find no pending handle and do nothing.

With ``OptimizerConfig(overlap_param_gather_with_optimizer_step=True)``, ``get_megatron_optimizer``
marks chunk 0's DDP instance, and chunk 0's all-gather is dispatched by the optimizer step
(``ChainedOptimizer.step_with_ready_grads``), not by the schedule: the schedule's
``start_param_sync`` returns at once for it. Before the first optimizer step, and after a step
skipped for inf/nan (``ChainedOptimizer.step`` returns before dispatching), nothing was dispatched;
megatron-core's own pre-hook then dispatches and waits at first use, and :meth:`finish` does the
same at the aligned slot: the same one all-gather, on the same group, in the same order on every
rank of that group, and the schedule dispatches nothing for chunk 0 afterwards.
"""

from __future__ import annotations

from typing import Any, List, Sequence

__all__ = ["McoreParamSync"]


def _check_overlapped(chunk: int, ddp_config: Any) -> None:
    """Without ``overlap_param_gather`` the chunk's all-gather runs synchronously inside
    ``start_param_sync`` (nothing in flight to align) and megatron-core's
    ``finish_param_sync`` asserts it (0.9 on). NeMo 2.0.0 sets it from
    ``model.optim.overlap_param_gather`` while binding the schedule's ``start_param_sync`` from
    ``overlap_param_sync`` (2.1 on: both from ``overlap_param_sync``): seen on NeMo 2.0.0."""
    from nemo_fp8_align.errors import UnsupportedSetupError

    if ddp_config is None or getattr(ddp_config, "overlap_param_gather", True):
        return
    raise UnsupportedSetupError(
        f"model chunk {chunk}: DistributedDataParallelConfig.overlap_param_gather=False: its "
        "parameter all-gather runs synchronously in start_param_sync, so there is nothing to "
        "align. Fix: DistributedDataParallelConfig(overlap_param_gather=True, "
        "align_param_gather=True); in NeMo model.optim.overlap_param_sync=true and "
        "model.optim.align_param_gather=true (NeMo 2.0.0 reads this setting from "
        "model.optim.overlap_param_gather: set model.optim.overlap_param_gather=true too)")


class McoreParamSync:
    """:class:`~nemo_fp8_align.core.aligner.ChunkParamSync` over megatron-core DDP chunks."""

    def __init__(self, ddp_chunks: Sequence[Any]) -> None:
        for i, chunk in enumerate(ddp_chunks):
            if not hasattr(chunk, "bucket_groups"):
                raise TypeError(
                    f"model chunk {i} is a {type(chunk).__name__}, not megatron-core's "
                    "DistributedDataParallel (no 'bucket_groups'): wrap each chunk in "
                    "megatron.core.distributed.DistributedDataParallel with "
                    "overlap_param_gather=True and use_distributed_optimizer=True")
            _check_overlapped(i, getattr(chunk, "ddp_config", None))
        self._chunks = list(ddp_chunks)

    def bucket_groups(self, chunk: int) -> List[Any]:
        """The chunk's bucket groups: the dense ones, then the expert-parallel ones."""
        ddp = self._chunks[chunk]
        return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))

    def _dispatched_by_optimizer(self, chunk: int) -> bool:
        # Set on the DDP instance by get_megatron_optimizer (DistributedDataParallelConfig has
        # no such field in any megatron-core version).
        return bool(getattr(self._chunks[chunk], "overlap_param_gather_with_optimizer_step", False))

    def wait(self, chunk: int) -> None:
        """Wait for ``chunk``'s in-flight all-gathers only, without megatron-core's FP8
        post-processing (on >= 0.16 with TE >= 2.10 that is the transposes' build, run by
        ``finish_param_sync``): the aligner times the wait apart from the build."""
        by_optimizer = self._dispatched_by_optimizer(chunk)
        for group in self.bucket_groups(chunk):
            if not self._check_launched(group, chunk, by_optimizer):
                group.start_param_sync()  # what megatron-core's pre-hook would dispatch
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()  # finish_param_sync's own wait then returns

    def finish(self, chunk: int) -> bool:
        by_optimizer = self._dispatched_by_optimizer(chunk)
        for group in self.bucket_groups(chunk):
            self._check_launched(group, chunk, by_optimizer)  # undispatched: dispatched below
            # skip_next_bucket_dispatch: with align_param_gather the schedule dispatches every
            # chunk's all-gather itself; dispatching the next bucket here would reorder them.
            group.finish_param_sync(skip_next_bucket_dispatch=True)
        return self.finished(chunk)

    @staticmethod
    def _check_launched(group: Any, chunk: int, by_optimizer: bool) -> bool:
        """Whether ``group``'s all-gather was dispatched; raises where only the schedule could
        have (an undispatched group of a chunk the optimizer step dispatches is for the caller
        to dispatch, as megatron-core's own pre-hook does at first use)."""
        if group.param_gather_dispatched:
            return True
        if not by_optimizer:
            # finish_param_sync would issue the all-gather itself and the schedule's later
            # start_param_sync a duplicate one: a collective out of order on this rank.
            raise RuntimeError(
                f"model chunk {chunk}: its parameter all-gather was not launched before its "
                "aligned slot. The schedule launches it through config.param_sync_func, which "
                "needs DistributedDataParallelConfig(overlap_param_gather=True, "
                "align_param_gather=True) and config.param_sync_func = "
                "[chunk.start_param_sync for chunk in model].")
        return False

    def finished(self, chunk: int) -> bool:
        return all(g.param_gather_dispatched and g.param_gather_handle is None
                   for g in self.bucket_groups(chunk))
