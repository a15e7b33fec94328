"""The aligner's hold on a megatron-core schedule: the DDP chunks themselves.

Every megatron-core training loop launches a chunk's parameter all-gather through that chunk's
``start_param_sync``: Megatron-LM's ``train()`` and Megatron-Bridge bind
``config.param_sync_func = [chunk.start_param_sync for chunk in model]`` right before their loop
(None for the first iteration after a start or a load, then back), NeMo binds the same list
inside every ``fwd_bwd_step``, and a user's loop binds it once. A wrapper on each chunk
*instance* is found by every one of those lookups, whenever they happen; a list bound before the
wrap is pointed at the wrappers. The step's end is chunk 0's ``finish_grad_sync``, the first
thing megatron-core's ``finalize_model_grads`` does on every rank, before the gradient
collectives (NeMo closes the step itself: ``owns_step_end=False``).

On megatron-core < 0.18 the hold also rebuilds the transposes after a forced synchronous
all-gather (:mod:`~nemo_fp8_align.sync.forced_sync`): that is megatron-core knowledge, kept here.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from nemo_fp8_align import errors
from nemo_fp8_align.core.hold import is_launch

__all__ = ["GradSyncStepEnd", "McoreChunkHold"]


class McoreChunkHold:
    """:class:`~nemo_fp8_align.core.hold.ScheduleHold` over megatron-core DDP chunks.

    Args:
        chunks: this rank's DDP-wrapped model chunks, in schedule order.
        config: the ``TransformerConfig`` the schedule reads (its ``param_sync_func`` tells a
            training pass from a forward-only one, and is checked for functions the hold does
            not see); None: not read (NeMo binds it inside its own step).
        owns_step_end: report the step end at chunk 0's ``finish_grad_sync``.
        forced_sync: ``(param_sync, weights, backend)`` for the forced-all-gather watch (None:
            no watch).
    """

    launched_before_loop = 2  #: the schedule's pre-loop calls (chunks 0 and 1)

    def __init__(self, chunks: Sequence[Any], config: Any = None, *, owns_step_end: bool = True,
                 forced_sync: Optional[tuple] = None) -> None:
        for i, chunk in enumerate(chunks):
            if not callable(getattr(chunk, "start_param_sync", None)):
                raise TypeError(f"model chunk {i} is a {type(chunk).__name__} without "
                                "start_param_sync: wrap each chunk in megatron-core's "
                                "DistributedDataParallel with overlap_param_gather=True")
        self._end = GradSyncStepEnd(chunks[0]) if owns_step_end else None
        self.chunks = list(chunks)
        self.config = config
        self.owns_step_end = owns_step_end
        self._forced_sync = forced_sync
        self._originals: List[Any] = []
        self._wrapped: List[Any] = []
        self._watch: Any = None
        self._rebound: Optional[tuple] = None  # (the list a loop had bound, ours in its place)

    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        try:
            self._originals = [c.start_param_sync for c in self.chunks]
            self._wrapped = [_launch_then(i, fn, on_launch)
                             for i, fn in enumerate(self._originals)]
            for chunk, fn in zip(self.chunks, self._wrapped):
                chunk.start_param_sync = fn  # an instance attribute: every lookup finds it
            if self._end is not None:
                self._end.install(on_end)
            self._rebind_bound_list()
            if self._forced_sync is not None:
                from nemo_fp8_align.sync.forced_sync import watch_forced_syncs

                self._watch = watch_forced_syncs(*self._forced_sync)
        except BaseException:
            self.restore()
            raise

    @property
    def forced_syncs(self) -> Any:
        """The forced-all-gather watch (None where megatron-core post-processes them itself)."""
        return self._watch

    def _rebind_bound_list(self) -> None:
        """A loop that bound the list before the wrap holds the original bound methods: point
        its entries at the wrappers."""
        funcs = getattr(self.config, "param_sync_func", None)
        entries = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if funcs is not None and len(entries) == len(self.chunks) \
                and all(f == o for f, o in zip(entries, self._originals)):
            bound = list(self._wrapped)
            self._rebound = (funcs, bound if isinstance(funcs, (list, tuple)) else bound[0])
            self.config.param_sync_func = self._rebound[1]

    def training(self) -> bool:
        # megatron-core's loops set param_sync_func to None for forward-only passes and for
        # Megatron-LM's first iteration after a load (which launches nothing).
        return torch.is_grad_enabled() and (
            self.config is None or getattr(self.config, "param_sync_func", None) is not None)

    def check(self) -> None:
        funcs: Optional[Any] = getattr(self.config, "param_sync_func", None)
        if funcs is None or not self._wrapped:
            return
        entries = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if len(entries) != len(self._wrapped) or any(
                f is not w for f, w in zip(entries, self._wrapped)):
            raise errors.foreign_param_sync()

    def restore(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        for chunk, fn in zip(self.chunks, self._wrapped):
            if chunk.__dict__.get("start_param_sync") is fn:
                del chunk.__dict__["start_param_sync"]
        if self._end is not None:
            self._end.restore()
        funcs = getattr(self.config, "param_sync_func", None)
        if self._rebound is not None and funcs is self._rebound[1]:
            self.config.param_sync_func = self._rebound[0]  # the very object it was
        elif isinstance(funcs, list) and any(f is w for f, w in zip(funcs, self._wrapped)):
            self.config.param_sync_func = [o if f is w else f for f, w, o in
                                           zip(funcs, self._wrapped, self._originals)]
        elif self._wrapped and funcs is self._wrapped[0]:
            self.config.param_sync_func = self._originals[0]
        self._wrapped, self._originals, self._rebound = [], [], None


def _launch_then(chunk: int, fn: Callable[..., Any],
                 on_launch: Callable[[int], None]) -> Callable[..., Any]:
    def start_param_sync(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if is_launch(kwargs):
            on_launch(chunk)
        return out
    return start_param_sync


class GradSyncStepEnd:
    """The step end both megatron-core holds report: chunk 0's ``finish_grad_sync``, wrapped on
    the instance (the first thing ``finalize_model_grads`` does on every rank, before the
    gradient collectives), with its undo.

    Args:
        chunk: model chunk 0, a megatron-core ``DistributedDataParallel``.
    """

    def __init__(self, chunk: Any) -> None:
        if not callable(getattr(chunk, "finish_grad_sync", None)):
            raise TypeError(f"model chunk 0 is a {type(chunk).__name__} without "
                            "finish_grad_sync: wrap each chunk in megatron-core's "
                            "DistributedDataParallel")
        self.chunk = chunk
        self._wrapper: Any = None

    def install(self, on_end: Callable[[], None]) -> None:
        finish = self.chunk.finish_grad_sync

        def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
            on_end()  # before the grad collectives: at the same point on every rank
            return finish(*args, **kwargs)
        self._wrapper = finish_grad_sync
        self.chunk.finish_grad_sync = finish_grad_sync

    def restore(self) -> None:
        """Remove the wrapper if it is still the one in place (a later wrap stays)."""
        if self._wrapper is not None \
                and self.chunk.__dict__.get("finish_grad_sync") is self._wrapper:
            del self.chunk.__dict__["finish_grad_sync"]
        self._wrapper = None
