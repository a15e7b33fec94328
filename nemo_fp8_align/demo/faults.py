"""Named faults for proving that the checks can fail (mutation testing of the engine).

Each fault patches one thing the alignment claims rest on, in the process that calls
:func:`inject` (the demo's spawned ranks do it when ``DemoOptions.fault`` is set), and returns an
undo. ``tests/test_faults.py`` runs the demo under each fault and requires the demo's verdict
(telemetry judge, independent build evidence, exactly-once counts, bit-identity with the plugin
off, the GEMMs' stale-byte checks) to fail. A fault nothing catches is a missing test.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.sync.mcore import McoreParamSync
from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule
from nemo_fp8_align.backends.reference import ReferenceBackend

__all__ = ["FAULTS", "HARMLESS", "inject"]

Undo = Callable[[], None]


def _patch(owner: Any, name: str, value: Any) -> Undo:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    return lambda: setattr(owner, name, original)


def no_wait() -> Undo:
    """Finishing a chunk's all-gather returns at once and claims it is complete."""
    return _patch(McoreParamSync, "finish", lambda self, chunk: True)


def transpose_before_all_gather() -> Undo:
    """The transposes are built first and the all-gather is waited for afterwards."""
    original = TransposeAligner._handle

    def handle(self: TransposeAligner, chunk: int, vmid: int) -> None:
        if chunk not in self._done:
            self.backend.build_transposes(self.weights[chunk])
        original(self, chunk, vmid)
    return _patch(TransposeAligner, "_handle", handle)


def slot_shift() -> Undo:
    """The trigger is one forward late on every pipeline rank but the first."""
    original = InterleavedSchedule.trigger_vmid

    def trigger_vmid(self: InterleavedSchedule, rank: int, chunk: int) -> int:
        v = original(self, rank, chunk)
        return v + 1 if rank > 0 and v != AT_START else v
    return _patch(InterleavedSchedule, "trigger_vmid", trigger_vmid)


def _drop_trigger(chunk_of: Callable[[int], int]) -> Undo:
    original = TransposeAligner._plan

    def plan(self: TransposeAligner, schedule: InterleavedSchedule) -> None:
        original(self, schedule)
        skipped = chunk_of(schedule.vp)
        self._triggers = {v: [c for c in cs if c != skipped] for v, cs in self._triggers.items()}
    return _patch(TransposeAligner, "_plan", plan)


def skip_chunk() -> Undo:
    """Chunk 1 is not handled at its slot (the safety net builds it at first use)."""
    return _drop_trigger(lambda vp: 1)


def last_chunk_to_first_use() -> Undo:
    """The last chunk is left entirely to its first use: no slot, no safety net."""
    undo_plan = _drop_trigger(lambda vp: vp - 1)
    original = TransposeAligner._handle

    def handle(self: TransposeAligner, chunk: int, vmid: int) -> None:
        if chunk != self.schedule.vp - 1:
            original(self, chunk, vmid)
    undo_handle = _patch(TransposeAligner, "_handle", handle)
    return lambda: (undo_handle(), undo_plan())


def transpose_twice() -> Undo:
    """Every build is done twice (the cache reset and rebuilt in between)."""
    original = ReferenceBackend.build_transposes

    def build(self: ReferenceBackend, weights: Any) -> int:
        n = original(self, weights)
        for w in weights:
            w.transpose_valid = False
        return n + original(self, weights)
    return _patch(ReferenceBackend, "build_transposes", build)


def reversed_bucket_order() -> Undo:
    """Not a fault: a chunk's bucket groups are finished in the opposite order. megatron-core
    orders buckets by the backward pass, unlike the forward order (Megatron-LM #950 ran a chunk
    on last step's weights that way); finishing every group at the slot must not depend on it."""
    original = McoreParamSync._bucket_groups

    def bucket_groups(self: McoreParamSync, chunk: int) -> Any:
        return list(reversed(original(self, chunk)))
    return _patch(McoreParamSync, "_bucket_groups", bucket_groups)


FAULTS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (
    no_wait, transpose_before_all_gather, slot_shift, skip_chunk, last_chunk_to_first_use,
    transpose_twice)}
#: Variations that must change nothing the checks see.
HARMLESS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (reversed_bucket_order,)}


def inject(name: str) -> Undo:
    """Apply the named fault (or harmless variation) in this process; returns its undo."""
    known = {**FAULTS, **HARMLESS}
    if name not in known:
        raise ValueError(f"fault={name!r} is not a known fault; choose one of: "
                         + ", ".join(sorted(known)))
    return known[name]()
