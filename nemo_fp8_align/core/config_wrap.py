"""The aligner's hold on megatron-core's schedule functions: the ``param_sync_func`` entries
and ``finalize_model_grads_func`` of the ``TransformerConfig`` the schedule reads, wrapped so
the aligner hears each chunk's all-gather launch and the step's end; with an undo, and a check
that nobody replaced them later (which would leave the aligner blind without a word)."""

from __future__ import annotations

from typing import Any, Callable, Dict

from nemo_fp8_align import errors

__all__ = ["ConfigWrap"]


class ConfigWrap:
    """Wraps ``model_config``'s functions on construction; :meth:`restore` undoes it."""

    def __init__(self, model_config: Any, vp: int, on_launch: Callable[[int], None],
                 on_end: Callable[[], None]) -> None:
        funcs = model_config.param_sync_func
        if funcs is None:
            raise ValueError(
                "config.param_sync_func is None: the aligned FP8 transposes need the schedule's "
                "aligned all-gather launches. Set DistributedDataParallelConfig("
                "overlap_param_gather=True, align_param_gather=True) and config.param_sync_func "
                "= [chunk.start_param_sync for chunk in model] before attaching.")
        per_chunk = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * vp
        if len(per_chunk) != vp:
            raise ValueError(f"config.param_sync_func has {len(per_chunk)} entries for {vp} "
                             "model chunks")
        finalize = getattr(model_config, "finalize_model_grads_func", None)
        self.config = model_config
        self.originals: Dict[str, Any] = {"param_sync_func": funcs,
                                          "finalize_model_grads_func": finalize}
        model_config.param_sync_func = [_launch_then(c, f, on_launch)
                                        for c, f in enumerate(per_chunk)]
        if finalize is not None:
            model_config.finalize_model_grads_func = _end_then(finalize, on_end)
        self.wrapped = {name: getattr(model_config, name, None) for name in self.originals}

    def check(self) -> None:
        """Raise :class:`~nemo_fp8_align.errors.ScheduleRebindError` if a wrapped
        function was replaced (megatron-core's forward-only passes set ``param_sync_func`` to
        None and back: the same object, so not a replacement)."""
        for name, ours in self.wrapped.items():
            now = getattr(self.config, name, None)
            if now is not ours and not (name == "param_sync_func" and now is None):
                raise errors.rebound(name)

    def ends_steps(self) -> bool:
        """Whether megatron-core's ``finalize_model_grads_func`` is ours: every rank then reaches
        the aligner's step end, where an error found inside the step can stop all of them."""
        name = "finalize_model_grads_func"
        ours = self.wrapped[name]
        return ours is not None and getattr(self.config, name, None) is ours

    def restore(self) -> None:
        """Put the original functions back where ours still are (one replaced since stays)."""
        for name, value in self.originals.items():
            if getattr(self.config, name, None) is self.wrapped[name]:
                setattr(self.config, name, value)


def _launch_then(chunk: int, fn: Callable[..., Any],
                 on_launch: Callable[[int], None]) -> Callable[..., Any]:
    def launch_then_notify(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        on_launch(chunk)
        return out
    return launch_then_notify


def _end_then(finalize: Callable[..., Any], on_end: Callable[[], None]) -> Callable[..., Any]:
    def check_then_finalize(*args: Any, **kwargs: Any) -> Any:
        on_end()  # before finalize's own collectives: at the same point on every rank
        return finalize(*args, **kwargs)
    return check_then_finalize
