"""Which aligner holds each model chunk, so that a second attachment is refused.

Two aligners on one chunk (the NeMo mixin and the callback, two callbacks, a script that attaches
twice) would each count the chunk's forwards and each build its transposes: double work and, with
two counters, two different slots. The registry is process-wide on purpose: the hooks it guards
are process-wide too (they live on the modules). Weak keys: a model that is freed leaves no entry.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

__all__ = ["claim", "release"]

_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def claim(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Record ``owner`` as the aligner of every chunk; refuse (claiming none) if another holds
    one."""
    for i, chunk in enumerate(chunks):
        holder = _OWNERS.get(chunk)
        if holder is not None and holder is not owner:
            raise RuntimeError(
                f"nemo_fp8_align: model chunk {i} ({type(chunk).__name__}) already has an "
                f"aligned FP8-transpose engine attached ({holder!r}). Attach the plugin once: "
                "use either FP8TransposeAlignMixin or the FP8TransposeAlignment callback (one "
                "instance), or detach the first engine before attaching another.")
    for chunk in chunks:
        _OWNERS[chunk] = owner


def release(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Forget ``owner``'s chunks (others' entries stay)."""
    for chunk in chunks:
        if _OWNERS.get(chunk) is owner:
            del _OWNERS[chunk]
