"""megatron-core < 0.18: rebuilding the FP8 transposes after a forced synchronous all-gather.

A forced all-gather (``DistributedDataParallel.start_param_sync(force_sync=True)``: Megatron-LM's
evaluation and checkpoint save through ``disable_forward_pre_hook()``, any caller's
``disable_forward_pre_hook(param_sync=True)``) either waits for the all-gather in flight or runs
one synchronously. megatron-core 0.16 and 0.17 run no post-all-gather processing on that path,
and the next ``finish_param_sync`` finds no handle to wait for, so it runs none either. With
Transformer Engine >= 2.10, megatron-core casts FP8 parameters with
``manual_post_all_gather_processing=True``: the transposes then stay flagged valid but hold the
old weights, and a backward reads them (Megatron-LM PRs #4560/#4562/#4563; from 0.18 the bucket
group's ``_post_param_sync`` runs after a forced all-gather too).

With ``overlap_param_gather_with_optimizer_step`` the hazard is in every such forced sync: the
optimizer step has dispatched chunk 0's all-gather, the forced sync waits for it, and the
schedule dispatches nothing more for chunk 0 before its forwards. (Otherwise the schedule's
next launch gathers again and megatron-core post-processes that one.)

:class:`ForcedSyncWatch` wraps each bucket group's ``start_param_sync`` (an instance attribute,
removed by :meth:`ForcedSyncWatch.remove`) on megatron-core versions whose bucket groups have no
``_post_param_sync``; after a forced call returns, it rebuilds those of that group's transposes
that are flagged valid from the bytes just gathered (the invalid ones are built as usual). On >= 0.18 nothing is wrapped: megatron-core's own
post-processing runs, and a second build would be wasted work.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["ForcedSyncWatch", "param_of", "post_processes_forced_sync", "watch_forced_syncs"]

_ABSENT = object()


def post_processes_forced_sync(bucket_group: Any) -> bool:
    """Whether megatron-core runs its post-all-gather processing after a forced all-gather of
    ``bucket_group`` (megatron-core >= 0.18: ``_post_param_sync``)."""
    return callable(getattr(type(bucket_group), "_post_param_sync", None))


def _forced(args: Tuple[Any, ...], kwargs: dict) -> bool:
    # Bucket groups take ``start_param_sync(self, force_sync=False)``; DDP passes it by name.
    return bool(kwargs.get("force_sync", args[0] if args else False))


def param_of(weight: Any) -> Any:
    # A reference FP8 weight derives from its DDP parameter (``source``); a TE Float8Tensor is
    # the parameter. Read from __dict__: no attribute hook of the tensor class runs.
    return getattr(weight, "__dict__", {}).get("source", weight)


def watch_forced_syncs(param_sync: Any, weights: Sequence[Sequence[Any]],
                       backend: Any) -> Optional["ForcedSyncWatch"]:
    """The watch for ``param_sync``'s megatron-core chunks (None where it has no bucket groups,
    e.g. Apex's optimizer, or where megatron-core post-processes forced all-gathers itself)."""
    groups_of = getattr(param_sync, "bucket_groups", None)
    if groups_of is None:
        return None
    watch = ForcedSyncWatch([list(groups_of(c)) for c in range(len(weights))], weights, backend)
    return watch if watch.active else None


class ForcedSyncWatch:
    """After every forced all-gather of a bucket group that megatron-core does not
    post-process, rebuilds the transposes of the weights in that group.

    Args:
        groups: per model chunk, its bucket groups (dense and expert-parallel).
        weights: per model chunk, its FP8 weights.
        backend: builds them (:meth:`~nemo_fp8_align.backends.protocol.FP8TransposeBackend.rebuild_transposes`).
    """

    def __init__(self, groups: Sequence[Sequence[Any]], weights: Sequence[Sequence[Any]],
                 backend: Any) -> None:
        self.backend = backend
        #: Transposes rebuilt after forced all-gathers (telemetry, tests).
        self.rebuilt = 0
        self._wrapped: List[Tuple[Any, Any]] = []  # (group, what its instance attribute was)
        for chunk_groups, chunk_weights in zip(groups, weights):
            for group in chunk_groups:
                if not post_processes_forced_sync(group):
                    ids = {id(p) for bucket in group.buckets for p in bucket.params}
                    self._wrap(group, [w for w in chunk_weights if id(param_of(w)) in ids])

    @property
    def active(self) -> bool:
        return bool(self._wrapped)

    def _wrap(self, group: Any, weights: List[Any]) -> None:
        previous = vars(group).get("start_param_sync", _ABSENT)
        original = group.start_param_sync  # megatron-core's bound method (or a wrapper of it)

        def start_param_sync(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if _forced(args, kwargs):  # synchronous: the bytes are in place
                # Only transposes flagged valid can hold old bytes unseen; invalid ones are built
                # at the aligned slot or at first use anyway (TE without manual processing).
                flagged = [w for w in weights if self.backend.has_valid_transpose(w)]
                if flagged:
                    with torch.no_grad():  # an evaluation's caller may have autograd on
                        self.rebuilt += self.backend.rebuild_transposes(flagged)
            return out

        group.start_param_sync = start_param_sync
        self._wrapped.append((group, previous))

    def remove(self) -> None:
        """Put back what each wrapped group had (idempotent)."""
        for group, previous in reversed(self._wrapped):
            if previous is _ABSENT:
                vars(group).pop("start_param_sync", None)
            else:
                group.start_param_sync = previous
        self._wrapped.clear()
