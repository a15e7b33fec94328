"""The aligner's hold on the schedule through the DDP chunks themselves, for training loops that
re-bind ``config.param_sync_func`` (Megatron-LM's ``train()``, Megatron-Bridge's ``setup``).

Those loops bind ``config.param_sync_func = [chunk.start_param_sync for chunk in model]`` right
before their loop, set it to None for the first iteration after a start or a load, and put it
back. Wrapping the config's list (what :class:`~nemo_fp8_align.core.config_wrap.ConfigWrap`
does) would be undone by that; wrapping each chunk's ``start_param_sync`` on the instance is
not: the loop's own ``chunk.start_param_sync`` lookup then finds the wrapper. So here the
rebinding is expected, and :meth:`ChunkWrap.check` only refuses a ``param_sync_func`` that holds
functions which are not the chunks' (the aligner would be blind to them).

The step's end is heard at chunk 0's ``finish_grad_sync`` (the first thing megatron-core's
``finalize_model_grads`` does), whatever function the loop binds as
``finalize_model_grads_func``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from nemo_fp8_align import errors

__all__ = ["ChunkWrap", "schedule_wrap"]


def schedule_wrap(aligner: Any, model_config: Any, rebinding_loop: bool) -> Any:
    """The aligner's hold on the schedule: on the chunks for a rebinding loop, else on the
    config (:class:`~nemo_fp8_align.core.config_wrap.ConfigWrap`)."""
    from nemo_fp8_align.core.config_wrap import ConfigWrap

    hooks = (aligner.on_param_sync_launched, aligner.on_step_end)
    if rebinding_loop:
        return ChunkWrap(aligner.chunks, model_config, *hooks)
    return ConfigWrap(model_config, aligner.schedule.vp, *hooks)


class ChunkWrap:
    """Wraps each chunk's ``start_param_sync`` (and chunk 0's ``finish_grad_sync``) on the
    instance; :meth:`restore` undoes it. ``config`` is the ``TransformerConfig`` the schedule
    reads (its ``param_sync_func`` tells training from forward-only passes)."""

    def __init__(self, chunks: Sequence[Any], model_config: Any,
                 on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        for i, chunk in enumerate(chunks):
            if not callable(getattr(chunk, "start_param_sync", None)):
                raise TypeError(f"model chunk {i} is a {type(chunk).__name__} without "
                                "start_param_sync: wrap each chunk in megatron-core's "
                                "DistributedDataParallel with overlap_param_gather=True")
        self.config = model_config
        self.chunks = list(chunks)
        self.originals: List[Any] = [c.start_param_sync for c in self.chunks]
        self.wrapped: List[Any] = [_launch_then(i, fn, on_launch)
                                   for i, fn in enumerate(self.originals)]
        for chunk, fn in zip(self.chunks, self.wrapped):
            chunk.start_param_sync = fn  # an instance attribute: the loop's lookup finds it
        #: Called after each step's end passed the aligner's checks, at the same point on every
        #: rank (before the gradient collectives): e.g. a logger gathering the step's records.
        self.step_end_listeners: List[Callable[[], None]] = []
        self._finish = self.chunks[0].finish_grad_sync
        self.chunks[0].finish_grad_sync = _end_then(self._finish, on_end, self.step_end_listeners)
        self._rebind_bound_list()

    def _rebind_bound_list(self) -> None:
        """A loop that bound the list before the wrap (Bridge fires its callbacks after
        binding) holds the original bound methods: point its entries at the wrappers."""
        funcs = self.config.param_sync_func
        if isinstance(funcs, (list, tuple)) and len(funcs) == len(self.chunks) \
                and all(f == o for f, o in zip(funcs, self.originals)):
            self.config.param_sync_func = list(self.wrapped)

    def check(self) -> None:
        """Raise :class:`~nemo_fp8_align.errors.ScheduleRebindError` if the schedule would call
        functions that are not the chunks' (wrapped) ``start_param_sync``."""
        funcs: Optional[Any] = self.config.param_sync_func
        if funcs is None:  # the loop's first iteration, or a forward-only pass
            return
        entries = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if len(entries) != len(self.wrapped) or any(
                f is not w for f, w in zip(entries, self.wrapped)):
            raise errors.foreign_param_sync()

    def restore(self) -> None:
        """Remove the instance wrappers (the class methods show through again) and put the
        originals back into a config list that still holds the wrappers."""
        for chunk, fn in zip(self.chunks, self.wrapped):
            if chunk.__dict__.get("start_param_sync") is fn:
                del chunk.__dict__["start_param_sync"]
        if "finish_grad_sync" in self.chunks[0].__dict__:
            del self.chunks[0].__dict__["finish_grad_sync"]
        funcs = self.config.param_sync_func
        if isinstance(funcs, list) and any(f is w for f, w in zip(funcs, self.wrapped)):
            self.config.param_sync_func = [o if f is w else f for f, w, o in
                                           zip(funcs, self.wrapped, self.originals)]


def _launch_then(chunk: int, fn: Callable[..., Any],
                 on_launch: Callable[[int], None]) -> Callable[..., Any]:
    def start_param_sync(*args: Any, force_sync: bool = False, force_dispatch: bool = False,
                         **kwargs: Any) -> Any:
        out = fn(*args, force_sync=force_sync, force_dispatch=force_dispatch, **kwargs)
        # Forced calls are not the schedule's launches: a synchronous all-gather before an
        # evaluation or a save (force_sync), the optimizer's dispatch (force_dispatch).
        if not force_sync and not force_dispatch:
            on_launch(chunk)
        return out
    return start_param_sync


def _end_then(finish: Callable[..., Any], on_end: Callable[[], None],
              listeners: List[Callable[[], None]]) -> Callable[..., Any]:
    def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
        on_end()  # before the grad collectives: at the same point on every rank
        for listener in listeners:
            listener()
        return finish(*args, **kwargs)
    return finish_grad_sync
