"""One entry point for megatron-core training loops (Megatron-LM style, Megatron-Bridge, NeMo 2).

Call it after the DDP-wrapped model chunks exist and ``config.param_sync_func`` has been set to
``[chunk.start_param_sync for chunk in model]`` (which megatron-core's training loops do when
``overlap_param_gather`` and ``align_param_gather`` are on)::

    aligner = align_fp8_transposes(model, num_microbatches=M, backend=TEBackend())
    ...  # train: forward_backward_func(...) as usual
    aligner.detach()
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from nemo_fp8_align.assemble import DERIVED, assemble
from nemo_fp8_align.backends.protocol import FP8TransposeBackend
from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core.aligner import TransposeAligner

__all__ = ["align_fp8_transposes"]


def align_fp8_transposes(
    model: Sequence[torch.nn.Module], *, num_microbatches: Union[int, Callable[[], int]],
    backend: Optional[FP8TransposeBackend] = None,
    weights_of: Optional[Callable[[torch.nn.Module], List[Any]]] = None, config: Any = None,
    align_config: AlignConfig = AlignConfig(), pp_rank: Optional[int] = None,
    dp_rank: Optional[int] = None, pg_collection: Any = None, error_group: Any = DERIVED,
    optimizer: Any = None,
) -> TransposeAligner:
    """Attach the aligned FP8-transpose engine to megatron-core DDP model chunks.

    Every rank of the model calls it at the same point: its startup checks end in one
    agreement, so a check failing on one rank (an unwritable telemetry path, say) raises on
    every rank, and no rank is left attached.

    Args:
        model: this rank's DDP-wrapped model chunks, in schedule order.
        num_microbatches: microbatches per training step (M); must be the value the schedule
            gets, or the aligner stops with an error at the first mismatching forward.
        backend: the FP8 backend owning the chunks' FP8 weights (None: Transformer Engine's,
            built from ``align_config``).
        weights_of: returns the FP8 weights of one chunk (None: the backend's ``weights_of``).
        config: the ``TransformerConfig`` the schedule reads; defaults to ``model[0].config``.
        align_config: policy and telemetry settings.
        pp_rank, dp_rank: default to the model's groups (below).
        pg_collection: the ``ProcessGroupCollection`` the model and schedule were built with
            (megatron-core >= 0.14); None: the chunks' own DDP groups, else ``parallel_state``
            (:mod:`nemo_fp8_align.adapters.groups`).
        error_group: the ranks that stop together when one finds an error (default: every rank
            of the model, :func:`~nemo_fp8_align.adapters.groups.model_group`).
        optimizer: what ``get_megatron_optimizer`` returned. Needed on megatron-core 0.7/0.8,
            whose DistributedOptimizer owns the parameter all-gather (not read on >= 0.9, where
            the DDP chunks own it).

    The engine hears the schedule through the chunks (:class:`~nemo_fp8_align.adapters.
    mcore_ddp.McoreDDPAdapter`): each chunk's ``start_param_sync`` and chunk 0's ``finish_grad_sync``, so a
    loop may bind ``config.param_sync_func = [chunk.start_param_sync for chunk in model]`` before
    or after this call, and re-bind it (Megatron-LM's ``train()``, Megatron-Bridge, NeMo). On
    megatron-core 0.7/0.8 it hears the optimizer's all-gather chain instead (:class:`~nemo_fp8_
    align.adapters.mcore_optimizer.McoreOptimizerAdapter`), launched by ``optimizer.zero_grad()``.
    """
    return assemble(model, num_microbatches=num_microbatches, config=config, backend=backend,
                    weights_of=weights_of, align_config=align_config, optimizer=optimizer,
                    pg_collection=pg_collection, pp_rank=pp_rank, dp_rank=dp_rank,
                    error_group=error_group)
