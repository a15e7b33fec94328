"""A hybrid (Mamba) model's ``--hybrid-layer-pattern`` as Megatron-LM 0.19.2's
``validate_args`` reads it: the pattern, not ``--num-layers``, gives the layer count (one symbol a
layer, before the first MTP separator ``/``), and its ``|``-separated segments give the pipeline
stages (VP = segments / PP; the VP flags and the layout string are asserted absent). So a VP fix
for a hybrid model is the pattern cut into PP x VP segments (:func:`with_segments`). Pure string
work on Megatron-LM's parsed arguments.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["HYBRID", "hybrid_layers", "hybrid_pattern", "hybrid_segments", "with_segments"]

HYBRID = "--hybrid-layer-pattern"
_PIPE, _MTP = "|", "/"


def hybrid_pattern(args: Mapping[str, Any]) -> Optional[str]:
    """The pattern Megatron-LM builds from (``--hybrid-override-pattern`` is its old name)."""
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")
    return pattern if isinstance(pattern, str) and pattern else None


def _main(pattern: str) -> str:
    return pattern.split(_MTP, 1)[0]


def hybrid_layers(pattern: str) -> int:
    """The main decoder's layers (Megatron-LM sets ``num_layers`` to this)."""
    return len(_main(pattern).replace(_PIPE, ""))


def hybrid_segments(pattern: str) -> int:
    """The pipeline segments of the main pattern (pipes + 1)."""
    return _main(pattern).count(_PIPE) + 1


def with_segments(pattern: str, stages: int) -> str:
    """``pattern`` with its main part cut into ``stages`` contiguous segments as even as can be
    (the longer ones first), the MTP part kept."""
    main, sep, mtp = pattern.partition(_MTP)
    layers = main.replace(_PIPE, "")
    size, extra = divmod(len(layers), stages)
    parts, at = [], 0
    for i in range(stages):
        n = size + (i < extra)
        parts.append(layers[at:at + n])
        at += n
    return _PIPE.join(parts) + sep + mtp
