"""Observing Transformer Engine's own transpose builds, whoever triggers them.

Where TE builds a ``Float8Tensor``'s transpose itself (megatron-core's post-all-gather
processing inside ``finish_param_sync``, TE's ``post_all_gather_processing``, a module at first
use), no call of the plugin's backend is involved; the one entry every such build goes through
is the tensor class's own method: ``_create_transpose`` (TE 2.x) or ``transpose_2d`` (TE 1.x).
:func:`watch_te_builds` wraps it on the class, reports each call that left the tensor's transpose
valid, and returns the undo. The kernel path (``te_kernel_writes_transpose``) writes the buffers
without TE and is reported by the backend itself.
"""

from __future__ import annotations

from typing import Any, Callable, List

__all__ = ["watch_te_builds"]


def watch_te_builds(backend: Any, on_built: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``on_built(tensor)`` after every TE build of a Float8Tensor transpose; returns the
    undo (removes this observer from the class's method, restores the backend's kernel builder).
    The class method is patched through the process-wide dispatcher
    (:mod:`~nemo_fp8_align.class_patch`): observers of several aligners detach in any order."""
    from nemo_fp8_align.class_patch import observe_method

    cls = backend.float8_cls
    from nemo_fp8_align.backends.te_api import BUILD_METHOD

    name = BUILD_METHOD[backend.generation]
    undos: List[Callable[[], None]] = []
    if getattr(cls, name, None) is not None:
        def built(tensor: Any, args: tuple, kwargs: dict, before: Any, out: Any) -> None:
            if backend.has_valid_transpose(tensor):
                on_built(tensor)
        undos.append(observe_method(cls, name, built).remove)
    undos.extend(_watch_columnwise(backend, on_built))
    kernel = backend._build_with_kernel

    def build_with_kernel(stale: List[Any]) -> None:
        kernel(stale)
        for w in stale:
            on_built(w)
    backend._build_with_kernel = build_with_kernel
    undos.append(lambda: backend.__dict__.pop("_build_with_kernel", None))

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()
    return undo_all


def _watch_columnwise(backend: Any, on_built: Callable[[Any], None]) -> List[Callable[[], None]]:
    """Observe TE's column-wise builds of block-scaled weights; returns the undos."""
    from nemo_fp8_align.backends.te_blocks import block_classes
    from nemo_fp8_align.class_patch import observe_method

    def built(tensor: Any, args: tuple, kwargs: dict, before: Any, out: Any) -> None:
        if backend.has_valid_transpose(tensor):
            on_built(tensor)
    undos = [observe_method(cls, "_create_columnwise", built).remove
             for cls, _kind in block_classes(backend.api)
             if getattr(cls, "_create_columnwise", None) is not None]
    utils = getattr(backend.api, "tensor_utils", None)
    batched = getattr(utils, "_nvfp4_2d_multi_tensor_transpose", None)
    if batched is not None:  # a module function: TE's post_all_gather_processing calls it by name
        def batch(tensors: List[Any], *args: Any, **kwargs: Any) -> Any:
            out = batched(tensors, *args, **kwargs)
            for t in tensors:
                on_built(t)
            return out
        setattr(utils, "_nvfp4_2d_multi_tensor_transpose", batch)
        undos.append(lambda: setattr(utils, "_nvfp4_2d_multi_tensor_transpose", batched))
    return undos
