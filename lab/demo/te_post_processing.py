"""megatron-core's FP8 post-all-gather processing, done for the demo's reference weights as
megatron-core does it for Transformer Engine's (``demo --manual-post-processing``).

With TE >= 2.10, megatron-core >= 0.16 casts FP8 parameters with
``manual_post_all_gather_processing=True`` and rebuilds their transposes itself once an
all-gather completes (``post_all_gather_processing``, which only knows TE tensors). The demo's
:class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` with ``manual_post_processing``
keeps its transpose flagged valid across new data as TE's does; this module rebuilds it where
the installed megatron-core post-processes, and only there:

* 0.16 / 0.17: in ``finish_param_sync``, when it waited for an all-gather (in flight, or
  dispatched by itself), not after a forced synchronous all-gather: the hazard
  :mod:`nemo_fp8_align.adapters.mcore_ddp` closes;
* >= 0.18: in the bucket group's ``_post_param_sync`` (also run after forced all-gathers).

So the CPU runs meet the stale transposes a real TE job meets, on each megatron-core version.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from nemo_fp8_align.adapters.mcore_ddp import param_of, post_processes_forced_sync

__all__ = ["emulate_post_processing"]


def _has_post_processing() -> bool:
    from megatron.core.distributed import param_and_grad_buffer

    return hasattr(param_and_grad_buffer, "post_all_gather_processing")  # from 0.16


def emulate_post_processing(ddp_chunks: Sequence[Any], weights: Sequence[Sequence[Any]],
                            backend: Any) -> Callable[[], None]:
    """Install the emulation on every bucket group of ``ddp_chunks``; returns the undo."""
    if not _has_post_processing():
        import megatron.core

        raise ValueError(
            f"--manual-post-processing: megatron-core {megatron.core.__version__} has no FP8 "
            "post-all-gather processing (megatron-core >= 0.16 has): run it on >= 0.16, or "
            "leave it off")
    wrapped: List[Any] = []
    for chunk, chunk_weights in zip(ddp_chunks, weights):
        for group in list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", [])):
            ids = {id(p) for bucket in group.buckets for p in bucket.params}
            mine = [w for w in chunk_weights if id(param_of(w)) in ids]
            name = "_post_param_sync" if post_processes_forced_sync(group) else "finish_param_sync"
            setattr(group, name, _rebuilding(getattr(group, name), group, mine, backend, name))
            wrapped.append((group, name))

    def undo() -> None:
        for group, name in wrapped:
            vars(group).pop(name, None)
    return undo


def _rebuilding(original: Callable[..., Any], group: Any, weights: List[Any], backend: Any,
                name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        # finish_param_sync post-processes after waiting for an all-gather: one in flight, or
        # one it dispatches itself (nothing dispatched yet); not after a forced synchronous one.
        waits = (name == "_post_param_sync" or group.param_gather_handle is not None
                 or not group.param_gather_dispatched)
        out = original(*args, **kwargs)
        if waits and weights:
            backend.rebuild_transposes(weights)
        return out
    return call
