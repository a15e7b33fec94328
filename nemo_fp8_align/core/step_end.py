"""Stopping every rank at once: the step-end agreement on this rank's first plugin error.

An error the plugin finds inside a training step (a forward pre-hook seeing an extra forward or
a wrong chunk, a CUDA-graph capture, a transpose that fails verification) is seen by one rank
only. Raised there, inside the schedule, it leaves the other pipeline stages blocked in their
p2p receives (and the data-parallel peers in their collectives) until the NCCL/gloo timeout.
So the aligner keeps its first error of the step, sits the rest of the step out (the transposes
are then built at first use, as with the plugin off) and, at the step end every rank reaches
(megatron-core's ``finalize_model_grads_func``, or NeMo's call after ``fwd_bwd_step``), every
rank calls :func:`agree`: one 4-byte all-reduce (MAX) over the job's ranks says whether any rank
failed; only then an ``all_gather_object`` of the messages follows, and every rank raises,
its own message first. Both collectives sit outside the schedule, at the same point on every
rank, once per step (the invariant "no new collectives" is about the schedule's own).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch

from nemo_fp8_align import errors

__all__ = ["agree", "agreed", "combined_error"]

Report = Optional[Tuple[str, str, str]]  # (rank label, error class name, message)


def _flag_device(group: Any) -> torch.device:
    backend = str(torch.distributed.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")  # a CPU flag where the group can: no GPU synchronisation
    return torch.device("cuda", torch.cuda.current_device())


def agree(own: Optional[BaseException], *, label: str, group: Any = None) -> None:
    """Every rank of ``group`` (None: the default group, i.e. every rank of the job) calls this
    at the same point. Returns if no rank has an error; otherwise raises on every rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if own is not None:
            raise own
        return
    flag = torch.tensor([0 if own is None else 1], dtype=torch.int32,
                        device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    reports: List[Report] = [None] * dist.get_world_size(group)
    mine = None if own is None else (label, type(own).__name__, str(own))
    dist.all_gather_object(reports, mine, group=group)
    raise combined_error(own, label, reports) from own


def combined_error(own: Optional[BaseException], label: str,
                   reports: List[Report]) -> BaseException:
    """This rank's error (on a rank with none, one of the first failing rank's class): its own
    message first, then what the other failing ranks reported, one line each."""
    failed = [r for r in reports if r is not None]
    others = [f"  {who}: {cls}: {msg}" for who, cls, msg in failed if who != label]
    summary = (f"nemo_fp8_align stopped this training step on all {len(reports)} ranks at its "
               f"end; {len(failed)} found a problem")
    if own is not None:
        cls: type = type(own)
        message = f"{own}\n{summary}" + (", the others:\n" + "\n".join(others) if others else
                                          ", this rank only.")
    else:
        name = failed[0][1]
        cls = getattr(errors, name, RuntimeError)
        cls = cls if isinstance(cls, type) and issubclass(cls, BaseException) else RuntimeError
        message = (f"nemo_fp8_align: {label} found no problem of its own; {summary}:\n"
                   + "\n".join(others))
    try:
        return cls(message)
    except TypeError:  # an exception class with another constructor: keep the text
        return RuntimeError(message)


@contextlib.contextmanager
def agreed(*, label: str, group: Any = None) -> Iterator[None]:
    """Run the body on every rank of ``group``, then agree on its outcome: an exception on any
    rank raises on every rank (startup checks that can fail on one rank alone: a telemetry
    path, an import, a claim). One small collective, at the same point on every rank."""
    try:
        yield
    except Exception as err:
        agree(err, label=label, group=group)
        raise  # single process: agree re-raised it already
    agree(None, label=label, group=group)
