"""What really happened to a chunk's transposes, observed apart from the engine's own counter.

The aligner's records say where the aligner *meant* to build (``slot`` is ``vmid + pp_rank``
from its own forward counter: under ``aligned`` it equals the plan by construction). When
telemetry is on, a :class:`BuildObserver` also records what happened, with hooks of its own:

* forward pre/post hooks on each chunk's *inner* module (``chunk.module`` of a DDP wrapper),
  which run after the aligner's and DDP's pre-hooks: they count the forwards this rank really
  started and finished in the step;
* the backend's build entry: ``watch_builds`` where the backend has it (Transformer Engine, whose
  own ``_create_transpose`` / ``transpose_2d`` is also what megatron-core's post-all-gather
  processing calls inside ``finish_param_sync``), else a wrapper of ``build_transposes``, whoever
  calls it (the aligner at a slot, a linear layer at first use).

Each build is placed as ``(k, inside)``: after ``k`` finished forwards, with (``inside``) or
without a forward running. :func:`observed_problems` compares that with the position the
record's schedule shape says the policy puts it at.
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence,
                    Tuple)

from nemo_fp8_align.core.schedule import InterleavedSchedule

if TYPE_CHECKING:  # torch is imported on use: `report` reads records without it
    import torch

__all__ = ["BuildObserver", "RecordExtras", "expected_position", "first_steps",
           "observed_problems", "schedule_of", "valid_from_the_start"]

Position = Tuple[int, bool]


class BuildObserver:
    """Per-rank log of this step's forwards and transpose builds, by chunk.

    Which training step is open is the one thing it shares with the engine: ``step_of()``
    (the open step's number, None between steps; the aligner's, opened by the schedule's launch
    of chunk 0), or :meth:`open_step` / :meth:`close_step` without it. Between steps nothing is
    logged.
    """

    def __init__(self, chunks: Sequence["torch.nn.Module"], weights: Sequence[Sequence[Any]],
                 backend: Any, step_of: Optional[Callable[[], Optional[int]]] = None) -> None:
        self._chunk_of = {id(w): c for c, ws in enumerate(weights) for w in ws}
        self._backend = backend
        self._open = False
        self._step_of, self._seen_step = step_of, None
        self.started = self.ended = 0
        self.builds: Dict[int, List[Position]] = {}
        self._handles = []
        self._undo: Callable[[], None] = lambda: None
        try:
            for module in chunks:
                inner = getattr(module, "module", module)
                self._handles.append(inner.register_forward_pre_hook(self._started))
                self._handles.append(inner.register_forward_hook(self._ended))
            watch = getattr(backend, "watch_builds", None)
            self._undo = watch(self._built) if watch is not None else self._wrap_build()
        except BaseException:
            self.close()  # nothing left behind
            raise

    def _wrap_build(self) -> Callable[[], None]:
        """Observe ``build_transposes`` on the backend's class: layers may hold their own backend
        instance (a NeMo model's FP8 layers do); builds of other chunks' weights are ignored.
        Through the process-wide dispatcher (:mod:`~nemo_fp8_align.class_patch`)."""
        from nemo_fp8_align.class_patch import observe_method

        def stale(backend: Any, args: tuple, kwargs: dict) -> List[Any]:
            weights = args[0] if args else kwargs.get("weights", ())
            weights = list(weights)
            return [w for w in weights if not backend.has_valid_transpose(w)]

        def built(backend: Any, args: tuple, kwargs: dict, before: List[Any], out: Any) -> None:
            for w in before:
                if backend.has_valid_transpose(w):
                    self._built(w)
        return observe_method(type(self._backend), "build_transposes", built, before=stale).remove

    def _in_step(self) -> bool:
        if self._step_of is not None:
            step = self._step_of()
            if step is None:
                return False
            if step != self._seen_step:  # a new step: count from zero
                self._seen_step = step
                self.open_step()
        return self._open

    def _started(self, module: "torch.nn.Module", args: Any) -> None:
        import torch

        if self._in_step() and torch.is_grad_enabled():
            self.started += 1

    def _ended(self, module: "torch.nn.Module", args: Any, output: Any) -> None:
        import torch

        if self._in_step() and torch.is_grad_enabled():
            self.ended += 1

    def _built(self, weight: Any) -> None:
        chunk = self._chunk_of.get(id(weight))
        if chunk is not None and self._in_step():
            self.builds.setdefault(chunk, []).append((self.ended, self.started != self.ended))

    def open_step(self) -> None:
        self._open, self.started, self.ended, self.builds = True, 0, 0, {}

    def close_step(self) -> None:
        self._open = False

    def fields(self, chunk: int, pp_rank: int, aligned_slot: int) -> Dict[str, Any]:
        """The record's ``obs_*`` fields for ``chunk``: builds seen, their distinct positions
        and the schedule slot of the first. A build before the rank's first forward only bounds
        the slot to ``[0, pp_rank]``: it is reported as the aligned slot when that lies there."""
        seen = self.builds.get(chunk, []) if self._in_step() else []
        at = sorted(set(seen))
        slot = None
        if at:
            slot = _slot(at[0], pp_rank, aligned_slot)
        return {"obs_built": len(seen), "obs_at": [list(p) for p in at], "obs_slot": slot}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._undo()
        self._open = False


def schedule_of(r: Mapping[str, Any]) -> Optional[InterleavedSchedule]:
    """The schedule a record's shape fields describe (None for records without them)."""
    if any(r.get(k) is None for k in ("pp_size", "vp_size", "microbatches")):
        return None
    return InterleavedSchedule(r["pp_size"], r["vp_size"], r["microbatches"],
                               r.get("group_size"), legacy_order=bool(r.get("legacy_order")))


def expected_position(schedule: InterleavedSchedule, policy: str, pp_rank: int,
                      chunk: int) -> Position:
    """Where ``policy`` builds ``chunk``'s transposes on ``pp_rank``: ``aligned`` before the
    rank's forward ``max(T_c - r, 0)`` (chunk 0 before the first), ``lazy`` inside forward T_c."""
    if policy == "lazy":
        return schedule.first_vmid(chunk), True
    return max(schedule.trigger_vmid(pp_rank, chunk), 0), False


def _slot(position: Sequence[Any], pp_rank: int, aligned_slot: int) -> int:
    k, inside = position
    return k + pp_rank if (k or inside) else min(aligned_slot, pp_rank)


def _where(position: Sequence[Any], pp_rank: int, aligned_slot: int) -> str:
    k, inside = position
    return (f"{'inside' if inside else 'before'} forward {k} of this rank's step (slot "
            f"{_slot(position, pp_rank, aligned_slot)})")


def first_steps(records: Iterable[Mapping[str, Any]]) -> Dict[str, int]:
    """Each run's first step (``run``: one id per aligner, so a resumed job's process has its
    own)."""
    first: Dict[str, int] = {}
    for r in records:
        run = r.get("run", "")
        first[run] = min(first.get(run, r["step"]), r["step"])
    return first


def valid_from_the_start(r: Mapping[str, Any], first_of_run: bool) -> bool:
    """A run's first step where no transpose was stale: every weight's transpose valid at the
    slot, none built by the plugin nor observed built. Fresh ``fp8_model_init`` weights (and
    weights just loaded) carry valid transposes until the first optimizer step changes them, so
    there is nothing to build or to observe; later in a run the same record would be a stale
    transpose flagged valid, which only a build could show."""
    return (first_of_run and r.get("obs_built") == 0 and r.get("transposed") == 0
            and r.get("valid") == r.get("weights"))


def observed_problems(r: Mapping[str, Any], where: str, policy: str, *,
                      first_of_run: bool = False) -> List[str]:
    """What the record's observed builds (``obs_*``) contradict: every weight built once, all at
    the position the policy and the schedule shape give. Nothing for records without them, nor
    for a run's first step with nothing stale (:func:`valid_from_the_start`)."""
    if r.get("obs_built") is None or not r.get("weights") or valid_from_the_start(r, first_of_run):
        return []
    out: List[str] = []
    built, weights, at = r["obs_built"], r["weights"], [tuple(p) for p in r.get("obs_at") or []]
    if built != weights:
        out.append(f"{where}: observed {built} transpose builds of {weights} FP8 weights in the "
                   "step (expected each built exactly once" + (
                       ", none seen before the chunk's first use" if built == 0 else "") + ")")
    schedule = schedule_of(r)
    if schedule is not None and at:
        rank, t_c = r["pp_rank"], r["aligned_slot"]
        want = expected_position(schedule, policy, rank, r["chunk"])
        wrong = [p for p in at if p != want]
        if wrong:
            out.append(f"{where}: observed built {', '.join(_where(p, rank, t_c) for p in wrong)}"
                       f"; {policy} means {_where(want, rank, t_c)}")
    return out


class RecordExtras:
    """What an aligner's records carry beyond its own state: the schedule shape, the
    data-parallel and world sizes (what should exist) and, with telemetry on, the observed
    builds of a :class:`BuildObserver` (what really happened)."""

    def __init__(self, dp_size: Optional[int]) -> None:
        import torch

        dist = torch.distributed
        up = dist.is_available() and dist.is_initialized()
        self.dp_size, self.world_size = dp_size, (dist.get_world_size() if up else None)
        self.observer: Optional[BuildObserver] = None
        self._kinds: Dict[int, str] = {}

    def attach(self, aligner: Any) -> bool:
        """Start observing (with telemetry on); True, for the aligner's ``attach``."""
        if aligner.telemetry is not None and self.observer is None:
            self.observer = BuildObserver(aligner.chunks, aligner.weights, aligner.backend,
                                          step_of=lambda: aligner._step if aligner._vmid is not
                                          None else None)
        return True

    def detach(self) -> None:
        if self.observer is not None:
            self.observer.close()
            self.observer = None

    def kind(self, aligner: Any, chunk: int) -> str:
        """The chunk's post-all-gather work (read once: a chunk's weights do not change)."""
        if chunk not in self._kinds:
            from nemo_fp8_align.support import chunk_kind, kind_of

            self._kinds[chunk] = chunk_kind(kind_of(aligner.backend, w)
                                            for w in aligner.weights[chunk])
        return self._kinds[chunk]

    def fields(self, aligner: Any, chunk: int) -> Dict[str, Any]:
        s = aligner.schedule
        out = dict(kind=self.kind(aligner, chunk), pp_size=s.pp, vp_size=s.vp, microbatches=s.microbatches,
                   group_size=None if s.legacy_order else s.n, legacy_order=s.legacy_order,
                   dp_size=self.dp_size, world_size=self.world_size)
        if self.observer is not None:
            out.update(self.observer.fields(chunk, aligner.pp_rank, s.aligned_slot(chunk)))
        return out
