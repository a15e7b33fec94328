"""Where this rank's pipeline and data-parallel rank and size come from.

megatron-core >= 0.14 builds models with explicit process groups: ``DistributedDataParallel(...,
pg_collection=...)`` keeps them on the chunk (``pp_group``, ``dp_group``, ``dp_cp_group``) and the
schedules take ``pg_collection`` / ``p2p_communicator``. A job whose groups are not the global
``parallel_state`` (Megatron-Bridge, NeMo-RL, several models in one process) must be aligned with
the groups its model was built with. In order, each of the pipeline and the data-parallel group
comes from:

1. an explicit ``pg_collection`` (megatron-core's ``ProcessGroupCollection``: ``.pp``, and
   ``.dp_cp`` with context parallel or ``.dp`` without; an absent field falls through);
2. the chunks' own groups (DDP's ``chunk.pp_group``, ``chunk.dp_cp_group`` / ``chunk.dp_group``;
   an unwrapped module's ``chunk.pg_collection``), which must be the same on every chunk;
3. megatron-core's global ``parallel_state`` (megatron-core < 0.14 DDP keeps no groups).

Explicit groups that disagree (a ``pg_collection`` other than the chunks', chunks built with
different groups) raise a ``ValueError`` naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["ParallelRanks", "data_parallel", "model_group", "pipeline_group", "resolve_ranks"]


@dataclass(frozen=True)
class ParallelRanks:
    """This rank's place in its pipeline and data-parallel groups, and where each came from."""

    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pp_group: Any  # None: the global state's group could not be named (no parallel_state)
    pp_source: str
    dp_source: str


def _one(group: Any) -> Any:
    # megatron-core's DDP accepts a list of pipeline groups and ranks by the first of them.
    return group[0] if isinstance(group, (list, tuple)) and group else group


def _ranks(group: Any) -> Tuple[int, ...]:
    return tuple(torch.distributed.get_process_group_ranks(group))


def _field(owner: Any, name: str) -> Any:
    try:
        return _one(getattr(owner, name, None))
    except (AttributeError, AssertionError):  # megatron-core's collection raises on unset fields
        return None


def _explicit(chunks: Sequence[Any], pg_collection: Any, pg_field: str,
              chunk_field: str) -> Tuple[Any, Optional[str]]:
    """The group named by ``pg_collection.<pg_field>`` or every chunk's ``<chunk_field>``
    (checked to agree); (None, None) when neither names one."""
    found: List[Tuple[str, Any]] = []
    if pg_collection is not None and _field(pg_collection, pg_field) is not None:
        found.append((f"pg_collection.{pg_field}", _field(pg_collection, pg_field)))
    for c, chunk in enumerate(chunks):
        group, name = _field(chunk, chunk_field), f"model[{c}].{chunk_field}"
        if group is None:  # an unwrapped LanguageModule keeps the collection it was built with
            group, name = _field(_field(chunk, "pg_collection"), pg_field), \
                f"model[{c}].pg_collection.{pg_field}"
        if group is not None:
            found.append((name, group))
    if not found:
        return None, None
    first_name, first = found[0]
    for name, group in found[1:]:
        if group is not first and _ranks(group) != _ranks(first):
            raise ValueError(
                f"{name} has ranks {list(_ranks(group))} but {first_name} has ranks "
                f"{list(_ranks(first))}: the aligner needs the one group the schedule runs "
                f"with. Fix: build every model chunk with the same pg_collection and pass that "
                f"one to align_fp8_transposes(pg_collection=...), or pass none.")
    return first, first_name


def resolve_ranks(chunks: Sequence[Any] = (), pg_collection: Any = None, *,
                  with_context_parallel: bool = False) -> ParallelRanks:
    """Pipeline and data-parallel rank and size of this rank, from ``pg_collection``, else the
    DDP ``chunks``' groups, else ``parallel_state`` (see the module docstring)."""
    dist = torch.distributed
    pp_group, pp_source = _explicit(chunks, pg_collection, "pp", "pp_group")
    if pp_group is not None:
        pp_rank, pp_size = dist.get_rank(group=pp_group), dist.get_world_size(group=pp_group)
    else:
        from megatron.core import parallel_state  # optional dependency: imported on use

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_group = parallel_state.get_pipeline_model_parallel_group() \
            if parallel_state.model_parallel_is_initialized() else None
        pp_source = "parallel_state"
    dp_rank, dp_size, dp_source = data_parallel(chunks, pg_collection,
                                                with_context_parallel=with_context_parallel)
    return ParallelRanks(pp_rank=pp_rank, pp_size=pp_size, dp_rank=dp_rank, dp_size=dp_size,
                         pp_group=pp_group, pp_source=pp_source, dp_source=dp_source)


def data_parallel(chunks: Sequence[Any] = (), pg_collection: Any = None, *,
                  with_context_parallel: bool = False) -> Tuple[int, int, str]:
    """(rank, size, source) in the data-parallel group alone (with context parallel when
    asked), picked as :func:`resolve_ranks` does."""
    dp_field = "dp_cp" if with_context_parallel else "dp"
    group, source = _explicit(chunks, pg_collection, dp_field, f"{dp_field}_group")
    if group is not None:
        dist = torch.distributed
        return dist.get_rank(group=group), dist.get_world_size(group=group), str(source)
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(with_context_parallel=with_context_parallel),
            parallel_state.get_data_parallel_world_size(
                with_context_parallel=with_context_parallel), "parallel_state")


def pipeline_group(chunks: Sequence[Any] = (), pg_collection: Any = None) -> Any:
    """The pipeline group the model runs with (as :func:`resolve_ranks` picks it); None when
    there is none to name (``parallel_state`` uninitialised: a collective then uses the default
    group)."""
    group, _ = _explicit(chunks, pg_collection, "pp", "pp_group")
    if group is not None:
        return group
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - megatron-core is there whenever a model is
        return None
    return parallel_state.get_pipeline_model_parallel_group() \
        if parallel_state.model_parallel_is_initialized() else None


#: The groups a model's ranks exchange data in: an error on one must stop all of them.
_MODEL_FIELDS = (("pp", "pp_group"), ("tp", "tp_group"), ("cp", "cp_group"),
                 ("dp_cp", "dp_cp_group"), ("dp", "dp_group"))


def model_group(chunks: Sequence[Any] = (), pg_collection: Any = None) -> Any:
    """The process group spanning every rank of this rank's model: where the step-end
    agreement runs, so that an error on one rank stops exactly the ranks that would otherwise
    block on it. None (the job's default group) without a ``pg_collection``, or when the model
    spans the whole job.

    With explicit groups the model's ranks are the closure of this rank's pipeline,
    tensor-, context- and data-parallel groups: each round gathers the ranks known so far over
    each group (the same collectives, in the same order, on every rank of the model), and as
    many rounds as groups reach every rank of a product layout. Then a group of those ranks is
    created among them alone.
    """
    if pg_collection is None:
        return None
    dist = torch.distributed
    groups = []
    for pg_field, chunk_field in _MODEL_FIELDS:
        group, _ = _explicit(chunks, pg_collection, pg_field, chunk_field)
        if group is not None and all(group is not g for g in groups):
            groups.append(group)
    known = {dist.get_rank()}
    for _ in groups:
        for group in groups:
            gathered: List[Any] = [None] * dist.get_world_size(group=group)
            dist.all_gather_object(gathered, sorted(known), group=group)
            known.update(r for ranks in gathered for r in ranks)
    if len(known) == dist.get_world_size():
        return None
    # Only the model's ranks call this (another model of the job may be elsewhere).
    return dist.new_group(sorted(known), use_local_synchronization=True)
