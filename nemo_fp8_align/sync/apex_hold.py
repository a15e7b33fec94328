"""The aligner's hold on the schedule with Apex's ``DistributedFusedAdam`` (NeMo's
``distributed_fused_adam``): the launch is the schedule's call of NeMo's
``sync_overlap_parameters(params)`` (bound as ``config.param_sync_func`` inside NeMo's own step),
mapped back to its chunk by the first parameter passed. NeMo closes the step itself.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import torch

from nemo_fp8_align.core.hold import is_launch

__all__ = ["ApexHold"]


class ApexHold:
    """:class:`~nemo_fp8_align.core.hold.ScheduleHold` over Apex's parameter syncs.

    Whoever routes the launches (NeMo's session, a harness binding Apex's sync into a config)
    calls :meth:`launched` with the parameters the schedule passed, or binds :meth:`wrap`.
    """

    owns_step_end = False
    launched_before_loop = 2  #: the schedule's pre-loop calls (chunks 0 and 1)

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        # ``id`` of each chunk's first parameter -> chunk: the schedule passes
        # ``model[c].parameters()``, read once by the caller.
        self._chunk_of: Dict[int, int] = {
            id(next(iter(chunk.parameters()))): c for c, chunk in enumerate(chunks)}
        self._on_launch: Optional[Callable[[int], None]] = None

    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        self._on_launch = on_launch

    def launched(self, params: Sequence[Any], **kwargs: Any) -> None:
        """The schedule's parameter sync for ``params`` has just been started."""
        chunk = self._chunk_of.get(id(params[0])) if params else None
        if self._on_launch is not None and chunk is not None and is_launch(kwargs):
            self._on_launch(chunk)

    def wrap(self, sync: Callable[..., Any]) -> Callable[..., Any]:
        """``sync`` (a ``param_sync_func`` taking a chunk's parameters) reporting its launches."""
        def param_sync(params: Iterable[Any] = None, **kwargs: Any) -> Any:
            params = list(params) if params is not None else []  # the schedule passes a generator
            out = sync(params, **kwargs)
            self.launched(params, **kwargs)
            return out
        return param_sync

    def training(self) -> bool:
        return torch.is_grad_enabled()

    def check(self) -> None:
        """Nothing to check: NeMo binds its own ``sync_overlap_parameters`` every step."""

    def restore(self) -> None:
        self._on_launch = None
