"""``demo --recipe blockwise|nvfp4|mxfp8``: the reference weights' post-all-gather work, run by
megatron-core's own post-processing code path, as it runs Transformer Engine's.

megatron-core (>= 0.16) decides *when* to post-process: in ``finish_param_sync`` after it waited
for an all-gather (0.16 / 0.17, inline), or in the bucket group's ``_post_param_sync`` (>= 0.18,
also after forced all-gathers). It collects the bucket's quantized parameters with its own
predicate (``is_float8tensor`` on 0.16 / 0.17, ``_param_uses_quantized_storage`` on >= 0.18),
which knows only TE classes, and hands them to ``post_all_gather_processing``, which calls TE's.
This module points those two names of megatron-core's ``param_and_grad_buffer`` module at the
reference weights: the predicate also answers True for a DDP parameter that has a reference
weight, and the post-processing rebuilds those weights (cast from the gathered bytes, then the
column-wise copy: :class:`~nemo_fp8_align.backends.reference.ReferenceBackend`'s
``rebuild_transposes``). Everything else (which bucket groups, whether a wait happened, who
calls ``finish_param_sync`` and when) is megatron-core's code, unchanged. Installed after the
DDP chunks are built (their buffers laid out as for plain parameters), undone on close; the
demo's CPU runs only.

MXFP8 (``DistributedDataParallelConfig(fp8_param_gather=True,
reuse_grad_buf_for_mxfp8_param_ag=True)``, megatron-core >= 0.19): ``_post_param_sync`` takes its
grad-buffer-reuse branch: for every bucket whose parameters all pass the predicate (the MXFP8
weights' BF16 parameters sit in a buffer of their own), ``copy_tensor_to_quantized_param(param,
gathered values)``, pointed here at the reference weight (stage the values, re-quantize both
copies), then megatron-core zeroes the bucket's parameter buffer itself.

The weights keep their column-wise copy flagged valid across a new cast, as TE's do under
``manual_post_all_gather_processing=True``: without the post-processing the backward would read
the old one (the provenance check raises).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

from nemo_fp8_align.adapters.mcore_ddp import param_of

__all__ = ["route_post_processing"]


def _predicate_name(pgb: Any) -> str:
    return ("_param_uses_quantized_storage" if hasattr(pgb, "_param_uses_quantized_storage")
            else "is_float8tensor")


def route_post_processing(weights: Sequence[Any], backend: Any) -> Callable[[], None]:
    """Route megatron-core's post-all-gather processing to ``weights``; returns the undo."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    if not hasattr(pgb, "post_all_gather_processing"):
        import megatron.core

        raise ValueError(f"--recipe: megatron-core {megatron.core.__version__} runs no "
                         "post-all-gather processing (>= 0.16 does); run it on >= 0.16")
    by_param: Dict[int, Any] = {id(param_of(w)): w for w in weights}
    for w in weights:
        w.manual_post_processing = True
    name = _predicate_name(pgb)
    original_predicate, original_post = getattr(pgb, name), pgb.post_all_gather_processing

    def quantized(param: Any) -> bool:
        return id(param) in by_param or original_predicate(param)

    def post_all_gather_processing(params: Any) -> None:
        params = params if isinstance(params, list) else [params]
        mine = [by_param[id(p)] for p in params if id(p) in by_param]
        if mine:
            backend.rebuild_transposes(mine)
        others = [p for p in params if id(p) not in by_param]
        if others:
            original_post(others)

    original_copy = getattr(pgb, "copy_tensor_to_quantized_param", None)

    def copy_tensor_to_quantized_param(param: Any, src: Any) -> None:
        weight = by_param.get(id(param))
        if weight is None:
            return original_copy(param, src)
        weight.stage(src)
        backend.rebuild_transposes([weight])

    setattr(pgb, name, quantized)
    pgb.post_all_gather_processing = post_all_gather_processing
    if original_copy is not None:
        pgb.copy_tensor_to_quantized_param = copy_tensor_to_quantized_param

    def undo() -> None:
        setattr(pgb, name, original_predicate)
        pgb.post_all_gather_processing = original_post
        if original_copy is not None:
            pgb.copy_tensor_to_quantized_param = original_copy
    return undo
