"""The aligned FP8-transpose engine: hooks that build each chunk's transposes at its slot.

One :class:`TransposeAligner` per rank. A step starts at the pre-loop launches (chunks 0, 1;
the adapter's ``launched_before_loop``); forward pre-hooks count this rank's forward virtual
microbatches, and at chunk c's trigger it finishes c's all-gather and builds its transposes:

* chunk 0 right after the last pre-loop launch (slot 0 on every rank, before the first
  receive, which module pre-hooks alone could not reach on ranks r > 0);
* chunk c >= 1 before forward ``v = T_c - r`` on rank r (slot T_c on every rank), which on
  ranks r > 0 falls inside chunk c-1's forwards.

It hears launches and step ends through its :class:`~nemo_fp8_align.core.adapter.Adapter`; a
step end never heard is taken at the next step's first launch (the same point on every rank). An
error inside a step is kept, the rest of the step runs without the plugin, and every rank of the
model raises at the step end (:mod:`~nemo_fp8_align.core.step_end`); the step end's own
rank-local work (the telemetry flush, the listeners) runs before that agreement, so its
failures reach the same step's agreement, the last step's included. What is still held when the
run ends (a forced all-gather's rebuild after the last step end, the final flush) is agreed on
by ``detach(agree=True)``. ``num_microbatches`` may be a function, asked at each
step's start, so a step of another size is re-planned instead of misaligned.

Policy ``lazy`` only observes where transposes get built (first use), for A/B runs. Attach is
all-or-nothing; inside a CUDA-graph capture no transpose is ever built.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from nemo_fp8_align import errors
from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.gpu_spans import GpuSpans
from nemo_fp8_align.core.adapter import Adapter, Listener, run_listeners
from nemo_fp8_align.core.observe import RecordExtras
from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule
from nemo_fp8_align.core import step_end
from nemo_fp8_align.core.telemetry import TelemetryWriter, TransposeRecord
from nemo_fp8_align.backends.protocol import FP8TransposeBackend
from nemo_fp8_align.errors import StepMismatchError, TransposeVerifyError

__all__ = ["StepMismatchError", "TransposeAligner", "TransposeVerifyError", "claim", "holder_of",
           "release"]

logger = logging.getLogger(__name__)

RECORDS_KEPT = 4096  #: records kept in memory (4096-8191, the newest; the file keeps all)


# --- Which aligner holds each model chunk, so that a second attachment is refused.
#
# Two aligners on one chunk (the NeMo mixin and the callback, two callbacks, a script that attaches
# twice) would each count the chunk's forwards and each build its transposes: double work and, with
# two counters, two different slots. The registry is process-wide on purpose: the hooks it guards
# are process-wide too (they live on the modules).
#
# Weak references both ways: the chunk is a weak key and the owner a weak value. The owner (an
# aligner) holds its chunks strongly, so a strong value would keep every claimed chunk alive through
# this module-global dict until ``release``; with weak references an attached model that its
# training script drops (detached or not) is freed by the garbage collector, and its entry goes
# with it.
_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def holder_of(chunk: torch.nn.Module) -> Any:
    """The live owner that claimed ``chunk``, or None."""
    ref = _OWNERS.get(chunk)
    return ref() if ref is not None else None


def claim(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Record ``owner`` as the aligner of every chunk; refuse (claiming none) if another holds
    one."""
    for i, chunk in enumerate(chunks):
        holder = holder_of(chunk)
        if holder is not None and holder is not owner:
            raise RuntimeError(
                f"nemo_fp8_align: model chunk {i} ({type(chunk).__name__}) already has an "
                f"aligned FP8-transpose engine attached ({holder!r}). Attach the plugin once: "
                "use either FP8TransposeAlignMixin or the FP8TransposeAlignment callback (one "
                "instance), or detach the first engine before attaching another.")
    for chunk in chunks:
        _OWNERS[chunk] = weakref.ref(owner)


def release(chunks: Sequence[torch.nn.Module], owner: Any) -> None:
    """Forget ``owner``'s chunks (others' entries stay)."""
    for chunk in chunks:
        if holder_of(chunk) is owner:
            del _OWNERS[chunk]


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TransposeAligner:
    """Builds each model chunk's FP8 transposes at its aligned schedule slot on this rank.

    One aligner per model chunk: attaching a second one to a chunk raises.

    Args:
        model_chunks: this rank's model chunks in schedule order (the outer modules the
            schedule calls: hooks there run before DDP's own pre-hooks on inner modules).
        schedule: the step's interleaved schedule (the same on every rank).
        pp_rank, dp_rank, dp_size: this rank's pipeline and data-parallel ranks; the DP size.
        adapter: the distributed optimizer's :class:`~nemo_fp8_align.core.adapter.Adapter`:
            hears the schedule's launches and step end, finishes a chunk's all-gather.
        weights, backend: per chunk, the FP8 weights; the backend that builds their transposes.
        config, telemetry: policy and telemetry settings; an optional writer.
        clock: timestamps; ``time.monotonic`` is one clock for every process of a host.
        num_microbatches: optional function giving the coming step's M, asked at each start.
        error_group: the ranks that stop together on an error (None: the job's default group;
            :func:`~nemo_fp8_align.adapters.groups.model_group`).
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], *, schedule: InterleavedSchedule,
                 pp_rank: int, dp_rank: int, adapter: Adapter,
                 weights: Sequence[Sequence[Any]], backend: FP8TransposeBackend,
                 config: AlignConfig, telemetry: Optional[TelemetryWriter] = None,
                 clock: Callable[[], float] = time.monotonic,
                 num_microbatches: Optional[Callable[[], int]] = None,
                 error_group: Any = None, dp_size: Optional[int] = None) -> None:
        if len(model_chunks) != schedule.vp or len(weights) != schedule.vp:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={schedule.vp} but got "
                f"{len(model_chunks)} model chunks and {len(weights)} weight lists on this rank")
        if not 0 <= pp_rank < schedule.pp:
            raise ValueError(f"pp_rank={pp_rank} outside [0, pipeline_model_parallel_size="
                             f"{schedule.pp})")
        self.chunks = list(model_chunks)
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.adapter = adapter
        self.weights = [list(w) for w in weights]
        self.backend = backend
        self.config = config
        self.telemetry = telemetry
        self.records: List[TransposeRecord] = []  # bounded: the newest RECORDS_KEPT or more
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        self.run_id = uuid.uuid4().hex[:12]  # tells a resumed job's records from the first try's
        self._clock = clock
        self._num_microbatches = num_microbatches
        self._error_group = error_group
        self._failure: Optional[Exception] = None  # this rank's first error of the open step
        self._spans = GpuSpans(enabled=torch.cuda.is_available())  # GPU times at the step end
        self._extras = RecordExtras(dp_size)  # shape, sizes and (telemetry on) observed builds
        self._plan(schedule)
        self._handles: List[Any] = []
        self._hold: Optional[Adapter] = None  # the adapter while installed (attach)
        #: Run at each step end on every rank, whatever the step's outcome, just before the
        #: step end's agreement (e.g. a logger gathering the step's records: a collective every
        #: rank enters); a listener's error reaches that same agreement.
        self.step_end_listeners: List[Listener] = []
        self._step = -1
        self._vmid: Optional[int] = None  # forwards run in the open training step; None: closed
        self._done: set = set()  # chunks handled (aligned) or observed (lazy) this step
        self._pending: Dict[int, Dict[str, Any]] = {}  # aligned records awaiting first use
        self._observing: Dict[int, tuple] = {}  # lazy: (valid before, t) of a first forward
        self._launched: Dict[int, float] = {}
        self.unlaunched_forwards = 0  #: training forwards with no step open (after a load)
        self._unlaunched: set = set()
        self.step_number: Optional[Callable[[], int]] = None  # e.g. Megatron-LM's iteration

    def _plan(self, schedule: InterleavedSchedule) -> None:
        self.schedule = schedule
        self._triggers: Dict[int, List[int]] = {}
        for chunk in range(schedule.vp):
            self._triggers.setdefault(schedule.trigger_vmid(self.pp_rank, chunk), []).append(chunk)

    attached = property(lambda self: bool(self._handles))

    @property
    def forced_syncs(self) -> Any:
        """The adapter's forced-all-gather watch (megatron-core < 0.18), or None."""
        return getattr(self.adapter, "forced_syncs", None)

    def attach(self) -> bool:
        """Register the hooks and install the adapter (idempotent); whether the engine is
        active. All or nothing: if a stage raises, the earlier ones are undone. With an adapter
        not owning the step end, the caller reports step ends itself (``on_step_end``)."""
        if self.attached or not self.config.active:
            return self.attached
        needed, reason = self.backend.transpose_needed()
        if not needed:
            logger.info("nemo_fp8_align: inactive, no FP8 transpose to align: %s", reason)
            return False
        claim(self.chunks, self)  # refuses before anything is installed
        try:
            self._hold = self.adapter
            self.adapter.install(self.on_param_sync_launched, self.on_step_end)
            for chunk, module in enumerate(self.chunks):
                self._handles.append(module.register_forward_pre_hook(
                    partial(self._pre_forward, chunk), prepend=True))
                self._handles.append(module.register_forward_hook(
                    partial(self._post_forward, chunk)))
            self._extras.attach(self)  # with telemetry on, builds are observed too
        except BaseException:
            self._undo_attach()
            raise
        return True

    def _undo_attach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            self._extras.detach()
        finally:
            release(self.chunks, self)
            hold, self._hold = self._hold, None
            if hold is not None:
                hold.restore()

    def detach(self, *, agree: bool = False) -> None:
        """Undo :meth:`attach`, flush and close the telemetry (idempotent).

        ``agree=True``: every rank of the error group calls it at the same point (the end of a
        training run: the demo loops, the Bridge and NeMo 2 callbacks' ``on_train_end``). What
        this rank still holds (an error no step end reported, e.g. a forced all-gather's rebuild
        failing in a final evaluation or save after the last step end) and what fails here (the
        final telemetry flush, its close) then go through one agreement after the detach is
        complete: every rank raises the plugin's error, none is left in a later collective
        (the teardown barrier) waiting for a rank that raised alone.

        ``agree=False`` (the default): local, never a collective, never raises for what is
        held, which is logged. For the paths where the ranks do not detach at the same point:
        an exception on its way out (Lightning's ``on_exception``, NeMo's session close on an
        error), where a collective could wait for ranks that never come and a raise would hide
        the error already in flight. A failure of the final flush still raises here, locally.
        """
        watch = self.forced_syncs  # read before the adapter is restored
        held = ([self._failure] if self._failure is not None else []) + (
            watch.take_failures() if watch is not None else [])
        own: List[Exception] = []  # what fails in this detach
        self._undo_attach()
        self._vmid, self._failure = None, None
        try:
            try:
                self._flush()
            finally:
                if self.telemetry is not None:
                    self.telemetry.close()
        except Exception as err:
            if not agree:
                raise
            own.append(err)
        if agree:
            found = held + own
            step_end.agree(found[0] if found else None, group=self._error_group,
                           label=self._label(f"detaching after step {self._step}"))
            return
        for err in held:
            logger.error("nemo_fp8_align: detached with an error no step end reported (call "
                         "detach(agree=True) where every rank detaches at the same point, to "
                         "stop every rank with it): %s", err)

    def on_param_sync_launched(self, chunk: int) -> None:
        """The schedule has just launched ``chunk``'s all-gather. Chunk 0's opens a training
        step (ending a step still open: no end heard); after the last pre-loop launch, before
        any pipeline communication, the slot-0 chunks are handled on every rank."""
        if not self.attached:
            return
        if chunk == 0 and self._vmid is not None:
            self.on_step_end()
        self._aborting_on_error(self._on_launch, chunk)

    def _on_launch(self, chunk: int) -> None:
        if chunk == 0:
            self._open_step()
        if self._vmid is not None:
            self._launched[chunk] = self._clock()
        pre_loop = getattr(self._hold, "launched_before_loop", 2)  # the schedule's: chunks 0, 1
        if chunk == pre_loop - 1 and self._vmid == 0 and self.config.policy is Policy.ALIGNED:
            if _capturing_cuda_graph():  # a whole step captured (full-iteration graphs)
                self._refuse_inside_capture(AT_START)
            for c in self._triggers.get(AT_START, []):
                self._handle(c, AT_START)

    def _aborting_on_error(self, fn: Callable[..., None], *args: Any) -> None:
        if self._failure is not None:  # this step failed here: the plugin sits the rest out
            return
        try:
            fn(*args)
        except Exception as err:
            # Raised here, inside the schedule, it would leave the other ranks blocked in p2p:
            # kept for the step end every rank reaches, and the step's plan dropped.
            self._pending = {}
            self._failure = err
            logger.error("%s -- the rest of the step runs without nemo_fp8_align (transposes "
                         "built at first use); every rank stops at its end", err)

    def set_next_step(self, step: int) -> None:
        """Number the next training step ``step`` in the records (a resume's global step)."""
        if self._vmid is not None:
            raise RuntimeError(f"set_next_step({step}) inside training step {self._step}: call it "
                               "between steps")
        self._step = step - 1

    def on_step_end(self) -> None:
        """The step's forwards and backwards are over (every rank of the model, same point).
        Writes the telemetry and runs the listeners (on every rank, whatever the step's
        outcome: a listener may be a collective), then agrees: raises on every rank if any rank
        found an error in the step, held one from between steps, or failed writing or in a
        listener here. So every failure of a step is reported at that step's end, the last
        step's included."""
        if not self.attached:
            return
        failure, self._failure = self._failure, None
        watch = self.forced_syncs  # failures it held between steps (evaluation, saves)
        held = watch.take_failures() if watch is not None else []
        if self._vmid is not None:
            ran, self._vmid = self._vmid, None
            if failure is None and (ran != self.schedule.total or self._pending):
                failure = errors.step_mismatch(self._step, self.pp_rank, self.schedule, ran, (
                    f"ran {ran} forwards" + (f", chunks {sorted(self._pending)} never ran"
                                             if self._pending else "")))
        self._pending = {}
        try:
            self._flush()  # rank-local I/O: before the agreement, so that it reports it
        except Exception as err:
            held.append(err)
        held += run_listeners(self.step_end_listeners)
        step_end.agree(failure or (held[0] if held else None), group=self._error_group,
                       label=self._label(f"step {self._step}"))

    def _label(self, when: str) -> str:
        """This rank as the step-end agreement names it to the others."""
        return (f"rank {self.rank} (pipeline rank {self.pp_rank}, data-parallel rank "
                f"{self.dp_rank}, {when})")

    def _open_step(self) -> None:
        self._vmid = 0  # open (before anything can fail): a failure ends it at the step end
        self._done, self._pending, self._observing, self._launched = set(), {}, {}, {}
        if self._hold is not None:
            self._hold.check()
        if self._num_microbatches is not None:
            m = int(self._num_microbatches())
            if m != self.schedule.microbatches:  # raises ScheduleError for a shape mcore rejects
                self._plan(dataclasses.replace(self.schedule, microbatches=m))
        self._step = self.step_number() if self.step_number is not None else self._step + 1

    def _mismatch(self, ran: int, what: str) -> None:
        raise errors.step_mismatch(self._step, self.pp_rank, self.schedule, ran, what)

    def _training_forward(self) -> bool:
        if self._vmid is None:
            return False
        return self._hold.training() if self._hold is not None else torch.is_grad_enabled()

    def _pre_forward(self, chunk: int, module: torch.nn.Module, args: Any) -> None:
        self._aborting_on_error(
            self._on_forward if self._training_forward() else self._note_unlaunched, chunk)

    def _on_forward(self, chunk: int) -> None:
        vmid = self._vmid
        if vmid >= self.schedule.total:
            self._mismatch(vmid + 1, f"ran a forward beyond its {vmid}th (model chunk {chunk})")
        if chunk != self.schedule.chunk_of(vmid):
            raise errors.wrong_chunk(self._step, self.pp_rank, self.schedule, vmid, chunk)
        self._vmid = vmid + 1
        if _capturing_cuda_graph():
            self._refuse_inside_capture(vmid)
            return
        if self.config.policy is Policy.ALIGNED:
            for c in self._triggers.get(vmid, []):
                self._handle(c, vmid)
            if chunk not in self._done:
                # Safety net (never taken when the schedule matches): correctness first, the
                # telemetry will show the misplaced slot.
                self._handle(chunk, vmid)
            if chunk in self._pending:
                self._emit(chunk, t_first_use=self._clock(), **self._pending.pop(chunk))
                self._verify(chunk)
        elif chunk not in self._done:  # lazy: remember the cache state before first use
            self._done.add(chunk)
            before = [self.backend.has_valid_transpose(w) for w in self.weights[chunk]]
            self._observing[chunk] = (vmid, before, self._clock())

    def _note_unlaunched(self, chunk: int) -> None:
        """A forward with gradients but no open step (Megatron-LM's first iteration after a
        load: pre-hooks off, ``param_sync_func=None``): built at first use, counted, reported."""
        if self._vmid is not None or self._hold is None or not torch.is_grad_enabled():
            return
        if self._hold.training():  # launching, yet no step opened:
            self._hold.check()  # the schedule may be calling functions the adapter does not see
            return
        self._unlaunched.add(chunk)
        if self.unlaunched_forwards == 0:
            logger.warning("nemo_fp8_align: training forwards without all-gather launches "
                           "(param_sync_func None: Megatron-LM's first iteration after a load): "
                           "transposes built at first use until the next launched step")
        self.unlaunched_forwards += 1

    def _refuse_inside_capture(self, vmid: int) -> None:
        """Never act inside a CUDA-graph capture (a captured transpose replays on old bytes):
        work due here raises, held for the step end; nothing due: only counted."""
        due = [c for c in self._triggers.get(vmid, []) if c not in self._done]
        if self.config.policy is Policy.ALIGNED and due:
            raise errors.inside_capture(self._step, vmid, due)

    def _post_forward(self, chunk: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._aborting_on_error(self._after_forward, chunk)

    def _after_forward(self, chunk: int) -> None:
        if chunk in self._unlaunched:  # no launch, no slot: verified at every such forward
            self._unlaunched.discard(chunk)
            self._verify(chunk, always=True)
        if chunk not in self._observing or not self._training_forward():
            return
        vmid, before, t_slot = self._observing.pop(chunk)
        after = [self.backend.has_valid_transpose(w) for w in self.weights[chunk]]
        self._emit(chunk, vmid=vmid, transposed=sum(a and not b for b, a in zip(before, after)),
                   after_all_gather=self.adapter.finished(chunk), seconds=None,
                   valid=sum(after), t_slot=t_slot, t_done=self._clock(), t_first_use=t_slot)
        self._verify(chunk)

    def _verify(self, chunk: int, always: bool = False) -> None:
        """Verify mode: at the chunk's first use, every weight's transpose against its bytes."""
        n = self.config.verify_every_n_steps
        if not n or (self._step % n and not always):
            return
        for i, weight in enumerate(self.weights[chunk]):
            why = self.backend.transpose_mismatch(weight)
            if why is not None:
                name = getattr(weight, "name", "") or f"#{i}"
                raise TransposeVerifyError(
                    f"nemo_fp8_align verify: step {self._step}, pipeline rank {self.pp_rank}, "
                    f"model chunk {chunk}, FP8 weight {name}: {why}")

    def _handle(self, chunk: int, vmid: int) -> None:
        if chunk in self._done:
            return
        self._done.add(chunk)
        t_slot = self._clock()
        self._spans.mark(chunk)
        wait = getattr(self.adapter, "wait", None)
        if wait is not None:  # the all-gather alone: a build inside finish (megatron-core >= 0.16
            wait(chunk)  # with TE >= 2.10 post-processes there) is then not timed as waiting
        t_waited = self._clock()
        self._spans.mark(chunk)
        after_all_gather = self.adapter.finish(chunk)
        t_gathered = (t_waited if wait else self._clock()) if after_all_gather else None
        built = 0
        if after_all_gather:
            built = self.backend.build_transposes(self.weights[chunk])
        else:
            # A transpose of bytes the all-gather has not delivered is a wrong gradient: leave
            # the build to first use (after DDP's own wait) and let the telemetry show it.
            logger.warning("nemo_fp8_align: step %d chunk %d: all-gather not complete at the "
                           "aligned slot; transposes left to first use", self._step, chunk)
        t_done = self._clock()
        self._spans.mark(chunk)
        self._pending[chunk] = dict(
            vmid=vmid, transposed=built, after_all_gather=after_all_gather,
            seconds=t_done - t_slot, t_slot=t_slot, t_gathered=t_gathered, t_done=t_done,
            valid=sum(self.backend.has_valid_transpose(w) for w in self.weights[chunk]))

    def _emit(self, chunk: int, *, vmid: int, **fields: Any) -> None:
        record = TransposeRecord(
            step=self._step, pp_rank=self.pp_rank, dp_rank=self.dp_rank, chunk=chunk,
            policy=self.config.policy.value, backend=self.backend.name, vmid=vmid,
            slot=self.schedule.slot_of(self.pp_rank, vmid), weights=len(self.weights[chunk]),
            aligned_slot=self.schedule.aligned_slot(chunk), t_launch=self._launched.get(chunk),
            rank=self.rank, run=self.run_id, **fields, **self._extras.fields(self, chunk))
        self.records.append(record)
        if len(self.records) >= 2 * RECORDS_KEPT:  # trimmed in halves: amortised O(1) per record
            del self.records[:-RECORDS_KEPT]
        if not self._spans.hold(record, chunk) and self.telemetry is not None:
            self.telemetry.write(record)  # held ones are written with their GPU times

    def _flush(self) -> None:
        resolved = self._spans.resolve(self.records)  # resolved with or without a writer
        if self.telemetry is not None:
            self.telemetry.write_all(resolved)
