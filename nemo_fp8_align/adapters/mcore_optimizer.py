"""The adapter where megatron-core's DistributedOptimizer owns the parameter all-gather (megatron-
core 0.7 and 0.8: ``OptimizerConfig.overlap_param_gather``).

There the all-gathers are one chain per optimizer instance, bucket after bucket in forward order
across all chunks (``model_index_to_all_gather_handle_index_map`` names each chunk's indices):
``zero_grad`` dispatches the first; whoever waits index i (the optimizer's global forward pre-
hook at each rank's first use, or ``finish_param_sync(model_index)``) dispatches i + 1. The DDP
chunks have no ``start_param_sync``. ``finish_param_sync(chunk)`` waits the chunk's in-flight
handles in index order, dispatching each next one as the pre-hook would: the same collectives in
the same order, only earlier; a handle not yet dispatched is left alone (no new collective).

A handle of None means either "not dispatched yet" or "waited":
:meth:`McoreOptimizerAdapter.record` (called for every dispatch) tells them apart, for the chain
under way: each optimizer step starts a new list of handles
(``_reset_metadata_and_sync_gather_all_model_params``), so dispatches recorded into an older
list say nothing about the new bytes. A step whose optimizer update did not succeed (before the
first step, or skipped for inf/nan) dispatches nothing: the parameters are unchanged, hence
complete.

Launches. There the schedule launches nothing per chunk (Megatron-LM binds no
``param_sync_func`` unless ``--delay-param-gather``, and then the optimizer's
``finish_param_sync``): the step's all-gathers start in ``optimizer.zero_grad()``, which every
loop of that era calls before the schedule (Megatron-LM's ``train_step``, NeMo's
``training_step``), and chain on from there. So the hold wraps each DistributedOptimizer's
``_dispatch_gather_model_params`` (an instance attribute, found by every caller: ``zero_grad``,
the pre-hook chain, ``finish_param_sync``, forced gathers): a launch of chunk c is the dispatch
of c's first all-gather (the same :func:`~nemo_fp8_align.core.adapter.is_launch` rule: not
forced, gradients on). Only chunk 0 is launched before the loop, so the aligner handles the
slot-0 chunks right after it. The step's end is chunk 0's ``finish_grad_sync``, as for
:class:`~nemo_fp8_align.adapters.mcore_ddp.McoreDDPAdapter`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from nemo_fp8_align import mcore_versions, support
from nemo_fp8_align.adapters.mcore_ddp import GradSyncStepEnd, param_of
from nemo_fp8_align.core.adapter import is_launch
from nemo_fp8_align.errors import UnsupportedSetupError

__all__ = ["McoreOptimizerAdapter", "distributed_optimizers"]


def distributed_optimizers(optimizer: Any) -> List[Any]:
    """The DistributedOptimizer instances under ``optimizer`` (a ``ChainedOptimizer`` holds
    one for the dense and one for the expert-parallel parameters), dense first."""
    inner = getattr(optimizer, "chained_optimizers", None)
    found = [optimizer] if inner is None else list(inner)
    return [o for o in found if hasattr(o, "model_index_to_all_gather_handle_index_map")]


class McoreOptimizerAdapter:
    """:class:`~nemo_fp8_align.core.adapter.Adapter` over megatron-core 0.7/0.8's
    DistributedOptimizer all-gather chain.

    Args:
        chunks: this rank's DDP-wrapped model chunks, in schedule order.
        optimizer: what ``get_megatron_optimizer`` returned (DistributedOptimizer or
            ChainedOptimizer of them).
        owns_step_end: report the step end at chunk 0's ``finish_grad_sync``.
    """

    #: Launched before the schedule's loop: chunk 0 only (``zero_grad``).
    launched_before_loop = 1

    def __init__(self, chunks: Sequence[Any], optimizer: Any, *,
                 owns_step_end: bool = True) -> None:
        self.optimizers = distributed_optimizers(optimizer)
        if not self.optimizers:
            raise UnsupportedSetupError(
                f"optimizer={type(optimizer).__name__}: not megatron-core's DistributedOptimizer "
                "(nor a ChainedOptimizer of them), whose parameter all-gather the plugin aligns "
                "on megatron-core 0.7/0.8. Fix: get_megatron_optimizer(OptimizerConfig("
                "use_distributed_optimizer=True, overlap_param_gather=True), model)")
        for opt in self.optimizers:
            if not getattr(opt, "overlap_param_gather", False):
                raise UnsupportedSetupError(
                    "OptimizerConfig.overlap_param_gather=False: the distributed optimizer "
                    "all-gathers every parameter synchronously inside its step, so there is no "
                    "all-gather in flight to align. Fix: OptimizerConfig(overlap_param_gather="
                    "True) (Megatron-LM --overlap-param-gather), or policy=off")
        self._dispatched: List[Set[int]] = [set() for _ in self.optimizers]
        self._chain: List[Any] = [None for _ in self.optimizers]  # the handle list they went to
        self._first: List[Dict[int, int]] = [  # per optimizer: first index -> its chunk
            {ids[0]: chunk for chunk, ids in
             opt.model_index_to_all_gather_handle_index_map.items() if ids}
            for opt in self.optimizers]
        self._end = GradSyncStepEnd(chunks) if owns_step_end else None
        self.chunks = list(chunks)
        self.owns_step_end = owns_step_end
        self._wrapped: List[Tuple[Any, Any]] = []  # (optimizer, its wrapper)

    def weights_to_align(self, weights: Sequence[Sequence[Any]], *, backend: Any,
                         config: Any) -> List[List[Any]]:
        """The refused setups of ``config`` and the recipes megatron-core 0.7/0.8 cannot
        post-process raise, and so do Transformer Engine FP8 parameters: this DDP never
        gathers into them. Every weight is kept otherwise."""
        kept = [list(w) for w in weights]
        support.refuse_path(config, kept, backend, support.mcore_features())
        problem = mcore_versions.fp8_parameter_problem([param_of(w) for w in sum(kept, [])])
        if problem is not None:
            raise UnsupportedSetupError(problem)
        return kept

    # ------------------------------------------------------------------ finishing a chunk
    def record(self, k: int, index: int) -> Optional[int]:
        """Optimizer ``k`` has just dispatched all-gather ``index``: remember it; return the
        chunk whose chain it starts (None if it is not a chunk's first)."""
        handles = self.optimizers[k].all_gather_handles
        if index == 0 or handles is not self._chain[k]:  # a new chain: zero_grad, a forced
            self._dispatched[k], self._chain[k] = set(), handles  # all-gather, a step between
        self._dispatched[k].add(index)
        return self._first[k].get(index)

    def finish(self, chunk: int) -> bool:
        for opt in self.optimizers:  # waits what is in flight; dispatches only the chain's next
            opt.finish_param_sync(chunk)
        return self.finished(chunk)

    def finished(self, chunk: int) -> bool:
        return all(self._complete(k, opt, chunk) for k, opt in enumerate(self.optimizers))

    def _complete(self, k: int, opt: Any, chunk: int) -> bool:
        if not opt.update_successful:  # nothing was gathered: the bytes did not change
            return True
        if opt.all_gather_handles is not self._chain[k]:  # stepped since: nothing dispatched
            return False
        ids = opt.model_index_to_all_gather_handle_index_map.get(chunk, [])
        return all(i in self._dispatched[k] and opt.all_gather_handles[i] is None for i in ids)

    # ------------------------------------------------------------------ the schedule hold
    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        try:
            for k, opt in enumerate(self.optimizers):
                wrapper = _dispatch_then(k, opt._dispatch_gather_model_params, self,
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


def _dispatch_then(k: int, dispatch: Callable[..., Any], adapter: McoreOptimizerAdapter,
                   on_launch: Any) -> Callable[..., Any]:
    # megatron-core calls it as (index), (all_gather_handle_index=0) or (index, force_sync=...).
    def _dispatch_gather_model_params(*args: Any, **kwargs: Any) -> Any:
        out = dispatch(*args, **kwargs)
        index = args[0] if args else kwargs["all_gather_handle_index"]
        chunk = adapter.record(k, index)
        if on_launch is not None and chunk is not None and is_launch(kwargs):
            on_launch(chunk)
        return out
    return _dispatch_gather_model_params
