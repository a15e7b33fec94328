"""The layer split's last fixes, where no parallel layout fits (:mod:`.fix_search`): the layer
count nearest the given one that splits (a change of the model, which the message says) and the
VP that splits the layers as they are. Pure functions over the split's verdict
(:func:`~.rules.split.layer_split_error`); only the command line's fix search runs them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from nemo_fp8_align.config_check.rules.split import divisors, layer_split_error

__all__ = ["num_layers_fix", "vp_fix"]


def num_layers_fix(layers: int, pp: int, vp: Optional[int], *rest: Any) -> Any:
    """The layer count nearest ``layers``, fewer or more (more on a tie), that splits: the
    smallest change of the model (78 layers, not 98, where 80 do not split)."""
    span = min(4 * pp * (vp or 1), 5_000)  # a huge PP or VP must not become a huge list
    nearest = sorted(range(max(layers - span, 1), layers + span + 1),
                     key=lambda n: (abs(n - layers), -n))
    return _first_valid([n for n in nearest if n != layers],
                        lambda n: layer_split_error(n, pp, vp, *rest) is None, None)


def vp_fix(layers: int, pp: int, vp: Optional[int], *rest: Any) -> Optional[int]:
    """The VP >= 2 nearest the current one that splits these layers, or None."""
    per_rank = max(layers // pp, 1)
    candidates = sorted(divisors(per_rank), key=lambda d: (abs(d - (vp or 2)), d))
    found = _first_valid([d for d in candidates if d >= 2],
                         lambda d: layer_split_error(layers, pp, d, *rest) is None, None)
    return found


def _first_valid(candidates: Any, ok: Callable[[Any], bool], otherwise: Any) -> Any:
    for count, candidate in enumerate(candidates):
        if count >= 10_000:
            break  # huge sizes: do not search forever for a suggestion
        if ok(candidate):
            return candidate
    return otherwise
