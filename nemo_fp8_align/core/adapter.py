"""What the aligner needs from a distributed optimizer: one :class:`Adapter` per implementation.

The aligner must hear two things from the training loop: each model chunk's parameter
all-gather launch (the schedule's ``param_sync_func`` calls: chunk 0's opens a training step)
and the step's end (every forward and backward ran, before the gradient collectives); and it
must be able to finish a chunk's all-gather at the chunk's aligned slot. An adapter does both,
for one distributed optimizer (:mod:`nemo_fp8_align.adapters`):

* :class:`~nemo_fp8_align.adapters.mcore_ddp.McoreDDPAdapter`: megatron-core DDP chunks
  (>= 0.9), for every megatron-core loop (Megatron-LM's ``train()``, Megatron-Bridge, NeMo's
  mcore optimizer, ``align_fp8_transposes`` in a user's loop);
* :class:`~nemo_fp8_align.adapters.mcore_optimizer.McoreOptimizerAdapter`: megatron-core
  0.7/0.8, whose DistributedOptimizer owns the all-gather (launched from ``zero_grad``, then
  chained);
* :class:`~nemo_fp8_align.adapters.apex.ApexAdapter`: NeMo's Apex ``DistributedFusedAdam``.

One definition of "a launch" (:func:`is_launch`): the schedule's call, i.e. not forced (a
synchronous all-gather before an evaluation or a save, or the optimizer's dispatch) and made
with gradients enabled (evaluation and validation loops run under ``no_grad``/inference mode).
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Adapter", "Listener", "is_launch", "run_listeners"]

#: Called once per step at the step end, on every rank at the same point, whatever the step's
#: outcome, just before the step end's agreement (which reports the listener's own error too).
Listener = Callable[[], None]


def is_launch(kwargs: Mapping[str, Any]) -> bool:
    """Whether a ``start_param_sync`` call with keyword arguments ``kwargs`` is the schedule's
    launch of a training step (megatron-core's forced callers pass their flags by keyword)."""
    forced = kwargs.get("force_sync", False) or kwargs.get("force_dispatch", False)
    return not forced and torch.is_grad_enabled()


@runtime_checkable
class Adapter(Protocol):
    """One distributed optimizer, as the aligner sees it: its schedule hold (installed by
    :meth:`~nemo_fp8_align.core.aligner.TransposeAligner.attach`, undone by :meth:`restore`)
    and its chunk all-gather finish.

    An implementation may also have ``wait(chunk)``: wait for the in-flight all-gather alone,
    before ``finish`` runs any post-processing (megatron-core >= 0.16 builds the FP8 transposes
    there), so that the aligner times the wait apart from the build; and ``forced_syncs``: the
    watch that rebuilds transposes after a forced synchronous all-gather (None where none is
    needed).
    """

    #: Whether the adapter reports the step end itself (else the caller calls ``on_step_end``).
    owns_step_end: bool

    #: How many chunks are launched before the schedule's loop, before any pipeline
    #: communication (the schedule's pre-loop calls: 2; an optimizer's chain: 1). After the
    #: last of them the aligner handles the slot-0 chunks on every rank.
    launched_before_loop: int

    def weights_to_align(self, weights: Sequence[Sequence[Any]], *, backend: Any,
                         config: Any) -> List[List[Any]]:
        """This path's refusals, then its work: raise
        :class:`~nemo_fp8_align.errors.UnsupportedSetupError` naming every setup of ``config``
        (the ``TransformerConfig`` the schedule reads) and every recipe of ``weights`` (per
        chunk, FP8 weights as ``backend`` finds them) that this optimizer's path cannot align;
        else return, per chunk, the weights whose post-all-gather work is left to place."""

    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        """Start reporting launches (``on_launch(chunk)``) and, if :attr:`owns_step_end`, the
        step end (``on_end()``). Leaves nothing behind when it raises."""

    def training(self) -> bool:
        """Whether a forward running now belongs to a training step (not forward-only)."""

    def check(self) -> None:
        """Raise :class:`~nemo_fp8_align.errors.ScheduleRebindError` if the schedule would call
        launch functions the adapter does not see."""

    def restore(self) -> None:
        """Undo :meth:`install` (idempotent)."""

    def finish(self, chunk: int) -> bool:
        """Wait for ``chunk``'s in-flight all-gather (issuing no new collective); return
        whether the chunk's parameters now hold this step's values."""

    def finished(self, chunk: int) -> bool:
        """Observe, without waiting, whether ``chunk``'s all-gather has completed."""


def run_listeners(listeners: List[Listener]) -> List[BaseException]:
    """Run every listener; return their errors (each listener runs whatever the others did)."""
    errors: List[BaseException] = []
    for listener in listeners:
        try:
            listener()
        except Exception as err:  # rank-local (I/O): reported by the step end's agreement
            errors.append(err)
    return errors
