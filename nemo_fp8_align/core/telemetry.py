"""Per-step, per-chunk telemetry: where a chunk's transposes ran, how many, whether the chunk's
all-gather had finished first, and when (monotonic timestamps). One JSON object per
(step, pp_rank, dp_rank, chunk, rank, run)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from nemo_fp8_align.core.observe import first_steps, observed_problems, schedule_of
from nemo_fp8_align.errors import TelemetryError
from typing import IO, Any, Iterable, List, Mapping, Optional

__all__ = ["TransposeRecord", "TelemetryWriter", "read_records", "record_problems"]


@dataclass(frozen=True)
class TransposeRecord:
    """What happened to one chunk's transposes in one training step on one rank.

    ``vmid`` is this rank's forward virtual-microbatch index before which the transposes ran
    (-1: at the start of the schedule, before any pipeline communication); ``slot`` is the
    schedule slot of that position (``vmid + pp_rank``, 0 for -1). With ``aligned`` every rank
    reports ``slot == aligned_slot``. ``transposed`` counts the transposes the plugin's backend
    built; ``valid`` counts the chunk's weights whose transpose was valid right after the chunk
    was handled (``aligned``) or after its first use (``lazy``): where megatron-core's own
    post-all-gather processing builds them inside the ``finish_param_sync`` the plugin calls,
    ``transposed`` is 0 and ``valid`` is ``weights``. ``seconds`` is host time of finishing the
    all-gather plus building the transposes (``None`` under ``lazy``, where the build is only
    observed).

    Timestamps are ``time.monotonic()`` seconds, one clock for every process of a host:
    ``t_launch`` the chunk's all-gather launch on this rank (``None`` if not seen), ``t_slot``
    when the plugin reached the chunk's slot (``lazy``: its first forward began), ``t_gathered``
    when its all-gather was complete (``None`` under ``lazy``), ``t_done`` when its transposes
    were valid (``lazy``: after the first forward), ``t_first_use`` when the chunk's first
    forward of the step began computing (after the plugin's pre-hook).

    On a GPU, ``gpu_wait_ms`` and ``gpu_build_ms`` are CUDA-event times on the current stream
    (slot to all-gather complete, then to transposes built; ``core/gpu_spans.py``); ``None``
    without CUDA or under ``lazy``.

    ``rank`` is the process's global rank (-1 without torch.distributed), so tensor- and
    context-parallel peers, which share pp and dp ranks, stay apart; ``run`` is one id per
    aligner, so a resumed job re-running steps into the same file is not a duplicate.

    What should exist: ``pp_size``, ``vp_size``, ``microbatches`` (M), ``group_size`` (N in use)
    and ``legacy_order`` give the step's schedule; ``dp_size`` and ``world_size`` the ranks that
    write records (``None``: not known to the writer). What was observed
    (:mod:`~nemo_fp8_align.core.observe`, when telemetry is on): ``obs_built`` transposes of the
    chunk seen built in the step, ``obs_at`` their distinct positions ``[k, inside]`` (after k
    finished forwards of this rank, inside a running one or not), ``obs_slot`` the slot of the
    first (``None``: not observed).

    ``kind`` is the chunk's post-all-gather work (:mod:`~nemo_fp8_align.support`):
    ``transpose`` (per-tensor FP8; records written before the field existed read as it),
    ``columnwise`` (blockwise FP8), ``requantize`` (MXFP8 with grad-buffer reuse),
    ``nvfp4-transpose``, or several joined with ``+``. ``transposed``, ``valid`` and
    ``obs_built`` count weights post-processed, whatever the kind.
    """

    step: int
    pp_rank: int
    dp_rank: int
    chunk: int
    policy: str
    backend: str
    vmid: int
    slot: int
    aligned_slot: int
    transposed: int
    weights: int
    after_all_gather: bool
    seconds: Optional[float]
    valid: int = -1
    t_launch: Optional[float] = None
    t_slot: Optional[float] = None
    t_gathered: Optional[float] = None
    t_done: Optional[float] = None
    t_first_use: Optional[float] = None
    rank: int = -1
    run: str = ""
    gpu_wait_ms: Optional[float] = None
    gpu_build_ms: Optional[float] = None
    pp_size: Optional[int] = None
    vp_size: Optional[int] = None
    microbatches: Optional[int] = None
    group_size: Optional[int] = None
    legacy_order: bool = False
    dp_size: Optional[int] = None
    world_size: Optional[int] = None
    obs_built: Optional[int] = None
    obs_at: Optional[List[List[Any]]] = None
    obs_slot: Optional[int] = None
    kind: str = "transpose"

    def to_json(self) -> str:
        # Every field is a plain value: vars() is enough, and 4x faster than asdict()'s deep copy
        # (per record on the training hot path; benchmarks/hook_cost.py).
        return json.dumps(vars(self), sort_keys=True)


class TelemetryWriter:
    """Appends records as JSON lines to ``path`` (opened lazily).

    Flushed by :meth:`flush`, which the aligner calls once per training step (at its end, or at
    the next step's start), not per record: a flush per line cost more host time per chunk per
    microbatch than the plugin's hooks themselves (benchmarks/hook_cost.py). A crash loses at
    most the step in flight."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Optional[IO[str]] = None

    def _failed(self, err: OSError, what: str) -> TelemetryError:
        """A write, flush or close that failed (a full disk, a lost mount), as the plugin's
        error naming the file and the fix."""
        return TelemetryError(
            f"nemo_fp8_align: telemetry_path={self.path}: could not {what} it ({err}); free "
            "space there or pass a writable telemetry_path, or leave telemetry_path unset to "
            "train without telemetry")

    def write(self, record: TransposeRecord) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(record.to_json() + "\n")
        except OSError as err:
            raise self._failed(err, "write") from err

    def write_all(self, records: Iterable[TransposeRecord]) -> None:
        """Write ``records`` and flush (a step's end)."""
        for record in records:
            self.write(record)
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as err:
                raise self._failed(err, "write") from err

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as err:
                raise self._failed(err, "write") from err


def read_records(paths: Iterable[str]) -> List[dict]:
    """Load the JSON-lines files written by :class:`TelemetryWriter`, sorted by position."""
    rows: List[dict] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    rows.sort(key=lambda r: (r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]))
    return rows


def _time_problems(r: Mapping, policy: str) -> List[str]:
    """The order the timestamps must follow (skipped for records written before they existed)."""
    order = ["t_launch", "t_slot", "t_gathered", "t_done"] if policy == "aligned" else \
        ["t_launch", "t_slot", "t_done"]
    if policy == "aligned":
        order.append("t_first_use")  # aligned: valid before the rank first computes the chunk
    times = [(k, r.get(k)) for k in order if r.get(k) is not None]
    return [f"{a} {ta:.6f} > {b} {tb:.6f}" for (a, ta), (b, tb) in zip(times, times[1:])
            if ta > tb]


#: The end of a record's problem when its chunk or pipeline rank lies outside its schedule.
_OUTSIDE = " (chunk and pipeline rank lie in [0, VP) and [0, PP))"


def _shape_problems(r: Mapping, where: str) -> List[str]:
    """The record's aligned slot against the schedule its own shape fields describe."""
    schedule = schedule_of(r)
    if schedule is None:
        return []
    if not 0 <= r["chunk"] < schedule.vp or not 0 <= r["pp_rank"] < schedule.pp:
        return [f"{where}: outside the schedule's PP={schedule.pp} VP={schedule.vp}{_OUTSIDE}"]
    t_c = schedule.first_vmid(r["chunk"])
    if r["aligned_slot"] != t_c:
        return [f"{where}: aligned slot {r['aligned_slot']}, but PP={schedule.pp} "
                f"VP={schedule.vp} M={schedule.microbatches} N={schedule.n} put the chunk's "
                f"first forward at slot {t_c}"]
    return []


def record_problems(records: Iterable[Mapping], *, policy: str = "aligned",
                    observed_builds: bool = True) -> List[str]:
    """Every invariant the records break, as sentences (empty when all hold).

    Per record: the slot is the chunk's aligned slot (``lazy``: plus the pipeline rank), the
    all-gather had finished, every weight of the chunk had a valid transpose and none was built
    twice, and the timestamps run launch <= slot <= all-gather complete <= transposes valid
    (<= first use, under ``aligned``); the aligned slot is the one the record's schedule shape
    gives; the observed builds (``obs_*``) happened once each, where the policy puts them; and
    exactly one record per (step, chunk, pp_rank, dp_rank, rank, run). Which records should
    exist is :func:`~nemo_fp8_align.core.completeness.completeness_problems`. The demo, the NeMo smoke run, ``report`` and the step-time benchmarks
    all judge their telemetry with this one function. ``observed_builds=False`` leaves out the
    observed builds: where megatron-core builds the transposes itself (demo
    ``--manual-post-processing``), also between steps after a forced all-gather.
    """
    problems: List[str] = []
    seen: Counter = Counter()
    records = list(records)
    first = first_steps(records)
    for r in records:
        key = (r["step"], r["chunk"], r["pp_rank"], r["dp_rank"], r.get("rank", -1),
               r.get("run", ""))
        seen[key] += 1
        where = f"step {key[0]} chunk {key[1]} pp rank {key[2]} dp rank {key[3]}"
        want = r["aligned_slot"] + (r["pp_rank"] if policy == "lazy" else 0)
        if r["slot"] != want:
            problems.append(f"{where}: transposes at slot {r['slot']}, "
                            f"{'lazy' if policy == 'lazy' else 'aligned'} slot is {want}")
        if not r["after_all_gather"]:
            problems.append(f"{where}: transposes built before the chunk's all-gather finished")
        valid = r.get("valid", -1)
        valid = r["transposed"] if valid is None or valid < 0 else valid
        # A chunk may hold no FP8 weight (first/last layers kept in BF16): nothing to build.
        if valid != r["weights"] or r["transposed"] > r["weights"]:
            problems.append(f"{where}: {valid} of {r['weights']} transposes valid, "
                            f"{r['transposed']} built (expected all valid, each built once)")
        problems.extend(f"{where}: timestamps out of order: {p}" for p in _time_problems(r, policy))
        shape = _shape_problems(r, where)
        problems.extend(shape)
        # a chunk or pipeline rank outside its own schedule has no expected position to
        # compare the observed builds with (the schedule model would raise on it)
        if observed_builds and not any(p.endswith(_OUTSIDE) for p in shape):
            problems.extend(observed_problems(r, where, policy,
                                              first_of_run=r["step"] == first[key[5]]))
    problems.extend(f"step/chunk/pp/dp/rank/run {key}: {n} records, expected exactly 1"
                    for key, n in seen.items() if n != 1)
    return problems
