"""Which aligner holds each model chunk, so that a second attachment is refused.

Two aligners on one chunk (the NeMo mixin and the callback, two callbacks, a script that attaches
twice) would each count the chunk's forwards and each build its transposes: double work and, with
two counters, two different slots. The registry is process-wide on purpose: the hooks it guards
are process-wide too (they live on the modules).

Weak references both ways: the chunk is a weak key and the owner a weak value. The owner (an
aligner) holds its chunks strongly, so a strong value would keep every claimed chunk alive through
this module-global dict until ``release``; with weak references an attached model that its
training script drops (detached or not) is freed by the garbage collector, and its entry goes
with it.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

__all__ = ["claim", "holder_of", "release"]

_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def holder_of(chunk: torch.nn.Module) -> Any:
    """The live owner that claimed ``chunk``, or None."""
    ref = _OWNERS.get(chunk)
    return ref() if ref is not None else None


def claim(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Record ``owner`` as the aligner of every chunk; refuse (claiming none) if another holds
    one."""
    for i, chunk in enumerate(chunks):
        holder = holder_of(chunk)
        if holder is not None and holder is not owner:
            raise RuntimeError(
                f"nemo_fp8_align: model chunk {i} ({type(chunk).__name__}) already has an "
                f"aligned FP8-transpose engine attached ({holder!r}). Attach the plugin once: "
                "use either FP8TransposeAlignMixin or the FP8TransposeAlignment callback (one "
                "instance), or detach the first engine before attaching another.")
    for chunk in chunks:
        _OWNERS[chunk] = weakref.ref(owner)


def release(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Forget ``owner``'s chunks (others' entries stay)."""
    for chunk in chunks:
        if holder_of(chunk) is owner:
            del _OWNERS[chunk]
