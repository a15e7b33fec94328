"""Finishing a model chunk's parameter all-gather in megatron-core's DDP (core_r0.9+).

megatron-core's own forward pre-hooks call ``finish_param_sync`` lazily at each rank's first use
of a bucket; this adapter lets the aligner call it earlier, at the aligned slot, for every bucket
group of the chunk (the dense ones and the expert-parallel ones). On core 0.16 with Transformer
Engine, ``finish_param_sync`` also runs TE's post-all-gather processing (the transposes), so the
backend then finds nothing left to build. Later pre-hooks find no pending handle and do nothing.
"""

from __future__ import annotations

from typing import Any, List, Sequence

__all__ = ["McoreParamSync"]


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
        self._chunks = list(ddp_chunks)

    def _bucket_groups(self, chunk: int) -> List[Any]:
        ddp = self._chunks[chunk]
        return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))

    def wait(self, chunk: int) -> None:
        """Wait for ``chunk``'s in-flight all-gathers only, without megatron-core's FP8
        post-processing (on >= 0.16 with TE >= 2.10 that is the transposes' build, run by
        ``finish_param_sync``): the aligner times the wait apart from the build."""
        for group in self._bucket_groups(chunk):
            self._check_launched(group, chunk)
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()  # finish_param_sync's own wait then returns

    def finish(self, chunk: int) -> bool:
        for group in self._bucket_groups(chunk):
            self._check_launched(group, chunk)
            # skip_next_bucket_dispatch: with align_param_gather the schedule dispatches every
            # chunk's all-gather itself; dispatching the next bucket here would reorder them.
            group.finish_param_sync(skip_next_bucket_dispatch=True)
        return self.finished(chunk)

    @staticmethod
    def _check_launched(group: Any, chunk: int) -> None:
        if not group.param_gather_dispatched:
            # finish_param_sync would issue the all-gather itself and the schedule's later
            # start_param_sync a duplicate one: a collective out of order on this rank.
            raise RuntimeError(
                f"model chunk {chunk}: its parameter all-gather was not launched before its "
                "aligned slot. The schedule launches it through config.param_sync_func, which "
                "needs DistributedDataParallelConfig(overlap_param_gather=True, "
                "align_param_gather=True) and config.param_sync_func = "
                "[chunk.start_param_sync for chunk in model].")

    def finished(self, chunk: int) -> bool:
        return all(g.param_gather_dispatched and g.param_gather_handle is None
                   for g in self._bucket_groups(chunk))
