"""The aligner's hold where megatron-core's DistributedOptimizer owns the parameter all-gather
(megatron-core 0.7 and 0.8).

There the schedule launches nothing per chunk (Megatron-LM binds no ``param_sync_func`` unless
``--delay-param-gather``, and then the optimizer's ``finish_param_sync``): the step's
all-gathers start in ``optimizer.zero_grad()``, which every loop of that era calls before the
schedule (Megatron-LM's ``train_step``, NeMo's ``training_step``), and chain on from there. So
the hold wraps each DistributedOptimizer's ``_dispatch_gather_model_params`` (an instance
attribute, found by every caller: ``zero_grad``, the pre-hook chain, ``finish_param_sync``,
forced gathers): a launch of chunk c is the dispatch of c's first all-gather (the same
:func:`~nemo_fp8_align.core.hold.is_launch` rule: not forced, gradients on). Only chunk 0 is
launched before the loop, so the aligner handles the slot-0 chunks right after it. The step's
end is chunk 0's ``finish_grad_sync``, as for :class:`~nemo_fp8_align.sync.mcore_hold.
McoreChunkHold`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import torch

from nemo_fp8_align.core.hold import is_launch
from nemo_fp8_align.sync.mcore_hold import GradSyncStepEnd
from nemo_fp8_align.sync.mcore_optimizer import McoreOptimizerParamSync

__all__ = ["McoreOptimizerHold"]


class McoreOptimizerHold:
    """:class:`~nemo_fp8_align.core.hold.ScheduleHold` over megatron-core 0.7/0.8's
    DistributedOptimizer all-gather chain.

    Args:
        chunks: this rank's DDP-wrapped model chunks, in schedule order.
        param_sync: the chain's bookkeeping, told of every dispatch.
        owns_step_end: report the step end at chunk 0's ``finish_grad_sync``.
    """

    #: Launched before the schedule's loop: chunk 0 only (``zero_grad``).
    launched_before_loop = 1

    def __init__(self, chunks: Sequence[Any], param_sync: McoreOptimizerParamSync, *,
                 owns_step_end: bool = True) -> None:
        self._end = GradSyncStepEnd(chunks[0]) if owns_step_end else None
        self.chunks = list(chunks)
        self.param_sync = param_sync
        self.owns_step_end = owns_step_end
        self._wrapped: List[Tuple[Any, Any]] = []  # (optimizer, its wrapper)

    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        try:
            for k, opt in enumerate(self.param_sync.optimizers):
                wrapper = _dispatch_then(k, opt._dispatch_gather_model_params, self.param_sync,
                                         on_launch if k == 0 else None)  # dense chain: launches
                opt._dispatch_gather_model_params = wrapper
                self._wrapped.append((opt, wrapper))
            if self._end is not None:
                self._end.install(on_end)
        except BaseException:
            self.restore()
            raise

    def training(self) -> bool:
        return torch.is_grad_enabled()

    def check(self) -> None:
        """Nothing to check: every dispatch, whoever calls it, goes through the wrapper."""

    def restore(self) -> None:
        for opt, wrapper in self._wrapped:
            if opt.__dict__.get("_dispatch_gather_model_params") is wrapper:
                del opt.__dict__["_dispatch_gather_model_params"]
        self._wrapped = []
        if self._end is not None:
            self._end.restore()


def _dispatch_then(k: int, dispatch: Callable[..., Any], param_sync: McoreOptimizerParamSync,
                   on_launch: Any) -> Callable[..., Any]:
    # megatron-core calls it as (index), (all_gather_handle_index=0) or (index, force_sync=...).
    def _dispatch_gather_model_params(*args: Any, **kwargs: Any) -> Any:
        out = dispatch(*args, **kwargs)
        index = args[0] if args else kwargs["all_gather_handle_index"]
        chunk = param_sync.record(k, index)
        if on_launch is not None and chunk is not None and is_launch(kwargs):
            on_launch(chunk)
        return out
    return _dispatch_gather_model_params
