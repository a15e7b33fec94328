"""GPU times of the aligned slot: CUDA events where the records' timestamps are host times.

On a GPU the host's ``t_gathered`` / ``t_done`` say when the host finished waiting for the
all-gather handle (with NCCL: when it made the stream wait) and enqueued the transposes, not when
the GPU got there. :class:`GpuSpans` records a CUDA event on the current stream at the slot,
after the all-gather wait and after the build, and at the step end (every build of the step is
long enqueued, and done on the GPU before the backward that reads it) turns them into
``gpu_wait_ms`` (how long the stream waited for the all-gather) and ``gpu_build_ms`` (the build's
kernels, megatron-core's post-processing included) of the chunk's record. Without CUDA (or off)
it does nothing and the records keep ``None`` there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["GpuSpans"]


class GpuSpans:
    """Per chunk: events at the slot, after the wait, after the build (``mark`` three times)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._marks: Dict[int, List[Any]] = {}
        self._held: List[Tuple[Any, List[Any]]] = []  # (record, its three events)

    def mark(self, chunk: int) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream, where the forward and backward run
            self._marks.setdefault(chunk, []).append(event)

    def hold(self, record: Any, chunk: int) -> bool:
        """Keep ``record`` until :meth:`resolve` when its chunk has events; returns whether."""
        events = self._marks.pop(chunk, None)
        if events is None or len(events) != 3:
            return False
        self._held.append((record, events))
        return True

    def resolve(self, records: List[Any]) -> List[Any]:
        """The held records with their GPU times, replaced in ``records`` (the newest entries
        of the aligner's list); returns them, in order, for the telemetry file."""
        done = []
        for record, (slot, gathered, built) in self._held:
            built.synchronize()  # long complete at the step end; never blocks in the schedule
            new = dataclasses.replace(record, gpu_wait_ms=slot.elapsed_time(gathered),
                                      gpu_build_ms=gathered.elapsed_time(built))
            for i in range(len(records) - 1, -1, -1):
                if records[i] is record:
                    records[i] = new
                    break
            done.append(new)
        self._held, self._marks = [], {}
        return done
