"""Workaround for megatron-core 0.12.3's shared-embedding bucket bug (NeMo 2.3.3's VP path).

See :func:`shared_embedding_bucket_workaround`; used by the mixin and the callback around the
construction of the DDP buffers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence

import torch
from nemo_fp8_align.errors import SharedEmbeddingBucketError

__all__ = ["SharedEmbeddingBucketError", "check_buckets", "hide_shared_embedding_flags",
           "restore_shared_embedding_flags", "shared_embedding_bucket_workaround"]


@contextlib.contextmanager
def shared_embedding_bucket_workaround(chunks: Sequence[torch.nn.Module], *,
                                       data_parallel_size: int) -> Iterator[None]:
    """Build megatron-core DDP around ``chunks`` without 0.12.3's shared-embedding bucket bug.

    megatron-core 0.12.3 gives a ``shared_embedding`` parameter its own bucket when the
    distributed optimizer is used. When it closes the bucket before that parameter it pads the
    bucket's end to a multiple of lcm(DP, 128) only if the running offset is not already a
    multiple of DP, but the parameter's own start is not moved to that padded end. If the
    offset is a multiple of DP but not of lcm(DP, 128) (e.g. DP=1 and parameters whose sizes
    are not multiples of 128), the shared parameter starts inside the previous bucket, the
    DistributedOptimizer finds it in two buckets and asserts "Param should not be in
    param_gbuf_map". Fixed upstream by 0.16 (the parameter starts at the padded end).

    The separate bucket only matters with DP > 1 (both pipeline ends must shard the shared
    weight the same way across data-parallel replicas). So with DP == 1 the flag is hidden while
    the buffers are built, and restored afterwards; with DP > 1 the buffers are checked after
    construction and a :class:`SharedEmbeddingBucketError` names the cause and the fixes.
    """
    hidden = hide_shared_embedding_flags(chunks, data_parallel_size=data_parallel_size)
    try:
        yield
    finally:
        restore_shared_embedding_flags(hidden)


def hide_shared_embedding_flags(chunks: Sequence[torch.nn.Module], *,
                                data_parallel_size: int) -> List[torch.nn.Parameter]:
    """With DP == 1, clear ``shared_embedding`` on ``chunks``' parameters and return them
    (see :func:`shared_embedding_bucket_workaround`); with DP > 1, change nothing."""
    if data_parallel_size != 1:
        return []
    flagged = [p for chunk in chunks for p in chunk.parameters()
               if getattr(p, "shared_embedding", False)]
    for p in flagged:
        p.shared_embedding = False
    return flagged


def restore_shared_embedding_flags(params: Sequence[torch.nn.Parameter]) -> None:
    for p in params:
        p.shared_embedding = True


def check_buckets(ddp_chunks: Sequence[Any]) -> None:
    """Raise :class:`SharedEmbeddingBucketError` if a parameter spills out of its bucket."""
    for c, ddp in enumerate(ddp_chunks):
        for buffer in list(getattr(ddp, "buffers", [])) + list(
                getattr(ddp, "expert_parallel_buffers", [])):
            indices = getattr(buffer, "bucket_indices", None)
            if indices is None:
                continue
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                b_start, b_end = indices[bucket_id]
                if start < b_start or end > b_end:
                    raise SharedEmbeddingBucketError(
                        f"model chunk {c}: a parameter of shape {tuple(param.shape)} occupies "
                        f"[{start}, {end}) of its gradient buffer but its bucket {bucket_id} is "
                        f"[{b_start}, {b_end}): megatron-core 0.12.3's shared-embedding bucket "
                        "padding bug (the DistributedOptimizer would assert 'Param should not "
                        "be in param_gbuf_map'). Use hidden_size / ffn_hidden_size that are "
                        "multiples of 128, a data-parallel size that is a multiple of 128 or "
                        "1, or model.share_embeddings_and_output_weights=False.")
