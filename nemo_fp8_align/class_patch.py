"""One per-process dispatcher for the plugin's patches of methods on classes.

Observing a build means wrapping a class's method (Transformer Engine's ``Float8Tensor``
``_create_transpose``, a backend's ``build_transposes``), and several aligners may observe at
once (one model per aligner). Stacking one wrapper per aligner can only be undone newest first:
detaching the older aligner first would either leave its wrapper in place (observing every
instance, keeping its model alive) or remove the newer one's. Here each (class, method) gets
one wrapper, installed by the first observer and removed by the last; the observers live in a
registry, so any detach order is clean.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Dict, Tuple

__all__ = ["PatchHandle", "observe_method", "patched_methods"]

#: Called after the original method with (instance, args, kwargs, before, result); ``before`` is
#: what the observer's ``before`` callable returned (None without one).
After = Callable[[Any, tuple, dict, Any, Any], None]

_MISSING = object()


class _Patch:
    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name
        self.own = cls.__dict__.get(name, _MISSING)  # else inherited: deleted on removal
        self.original = getattr(cls, name)
        self.observers: Dict[int, Tuple[Any, After]] = {}
        patch = self

        @functools.wraps(self.original)
        def observed(instance: Any, *args: Any, **kwargs: Any) -> Any:
            live = list(patch.observers.values())
            befores = [before(instance, args, kwargs) if before else None for before, _ in live]
            out = patch.original(instance, *args, **kwargs)
            for (_, after), seen in zip(live, befores):
                after(instance, args, kwargs, seen, out)
            return out
        self.wrapper = observed
        setattr(cls, name, observed)

    def remove(self) -> None:
        if self.cls.__dict__.get(self.name) is not self.wrapper:
            return  # someone patched over ours since: leave theirs (it calls ours, now inert)
        if self.own is _MISSING:
            delattr(self.cls, self.name)
        else:
            setattr(self.cls, self.name, self.own)


_PATCHES: Dict[Tuple[type, str], _Patch] = {}
_IDS = itertools.count()


class PatchHandle:
    """One observer of one patched method; :meth:`remove` is idempotent."""

    def __init__(self, key: Tuple[type, str], observer_id: int) -> None:
        self._key, self._id = key, observer_id

    def remove(self) -> None:
        patch = _PATCHES.get(self._key)
        if patch is None or patch.observers.pop(self._id, None) is None:
            return
        if not patch.observers:
            patch.remove()
            del _PATCHES[self._key]


def observe_method(cls: type, name: str, after: After,
                   before: Callable[[Any, tuple, dict], Any] = None) -> PatchHandle:
    """Call ``after`` (and ``before``) around every call of ``cls.name`` until the handle is
    removed. Raises AttributeError, patching nothing, if ``cls`` has no such method."""
    key = (cls, name)
    getattr(cls, name)  # AttributeError before anything is patched
    patch = _PATCHES.get(key)
    if patch is None:
        patch = _PATCHES[key] = _Patch(cls, name)
    observer_id = next(_IDS)
    patch.observers[observer_id] = (before, after)
    return PatchHandle(key, observer_id)


def patched_methods() -> Dict[Tuple[type, str], int]:
    """(class, method) -> number of live observers: what is patched now (tests, leaks)."""
    return {key: len(p.observers) for key, p in _PATCHES.items()}
