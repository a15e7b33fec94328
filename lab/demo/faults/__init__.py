"""Named faults for proving that the checks can fail (mutation testing of the engine).

A test tool of the lab (``python -m lab.demo --fault NAME``), run from a checkout: the installed
package holds no fault injection.

Each fault patches one thing the alignment claims rest on, in the process that calls
:func:`inject` (the demo's spawned ranks do it when ``DemoOptions.fault`` is set), and returns an
undo. ``tests/test_faults.py`` runs the demo under each fault and requires the demo's verdict
(telemetry judge, independent build evidence, exactly-once counts, bit-identity with the plugin
off, the GEMMs' stale-byte checks) to fail. A fault nothing catches is a missing test.

:data:`RANK_ERRORS` are not engine faults: each makes the plugin find an error on one rank only
(the job's last rank, in step 1), the way a real job meets it, so that ``tests/test_no_hang.py``
can show every rank stopping at that step's end with its own message instead of hanging;
:data:`END_ERRORS` do the same at the run's end (the last step's telemetry write, the detach),
where an error used to be only logged and the job exited 0.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Any, Callable, Dict

import torch

from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter
from nemo_fp8_align.adapters.mcore_optimizer import McoreOptimizerAdapter
from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule
from nemo_fp8_align.backends.reference import ReferenceBackend
from lab.demo import train

__all__ = ["ALL", "BETWEEN_STEPS_ERRORS", "END_ERRORS", "FAULTS", "HARMLESS", "IN_MEGATRON_LM",
           "RANK_ERRORS", "STARTUP_ERRORS", "inject"]

Undo = Callable[[], None]


def _patch(owner: Any, name: str, value: Any) -> Undo:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    return lambda: setattr(owner, name, original)


def deferred_all_gather() -> Undo:
    """Not a fault: a slow network taken to its limit. A DDP bucket group's asynchronous
    parameter all-gather delivers its bytes only when someone waits for it (the collective runs
    at the wait, in the same order on every data-parallel rank), so an FP8 copy taken before the
    wait is always built from last step's bytes. A correct plugin is unaffected. megatron-core
    >= 0.9 (its ``_ParamAndGradBucketGroup``); on 0.7/0.8 the optimizer's chain gathers and this
    changes nothing."""
    try:
        from megatron.core.distributed.param_and_grad_buffer import (
            _ParamAndGradBucketGroup as group_class)
    except ImportError:
        return lambda: None
    original = group_class.start_param_sync

    class _Deferred:
        def __init__(self, group: Any) -> None:
            self.group = group

        def wait(self) -> None:
            self.group.param_gather_handle = None
            original(self.group, force_sync=True)  # the all-gather itself, synchronous

    def start_param_sync(self: Any, force_sync: bool = False) -> None:
        if force_sync or not self.ddp_config.overlap_param_gather:
            return original(self, force_sync=force_sync)
        self.param_gather_handle = _Deferred(self)
        self.param_gather_dispatched = True
        return None
    return _patch(group_class, "start_param_sync", start_param_sync)


def _with_deferred_all_gather(patch: Callable[[], Undo]) -> Undo:
    """``patch`` with the all-gathers deferred to their wait: what a fault that skips or
    precedes the wait builds is then stale on every run, not only when gloo has not delivered
    yet (it often has, on a CPU: CI saw such a fault survive)."""
    undo_defer, undo_patch = deferred_all_gather(), patch()
    return lambda: (undo_patch(), undo_defer())


def no_wait() -> Undo:
    """Finishing a chunk's all-gather returns at once and claims it is complete (the DDP
    chunks' on >= 0.9, the DistributedOptimizer's chain on 0.7/0.8)."""
    def patch() -> Undo:
        undo_wait = _patch(McoreDDPAdapter, "wait", lambda self, chunk: None)
        undo_finish = _patch(McoreDDPAdapter, "finish", lambda self, chunk: True)
        undo_chain = _patch(McoreOptimizerAdapter, "finish", lambda self, chunk: True)
        return lambda: (undo_chain(), undo_finish(), undo_wait())
    return _with_deferred_all_gather(patch)


def transpose_before_all_gather() -> Undo:
    """The transposes are built first and the all-gather is waited for afterwards."""
    original = TransposeAligner._handle

    def handle(self: TransposeAligner, chunk: int, vmid: int) -> None:
        if chunk not in self._done:
            self.backend.build_transposes(self.weights[chunk])
        original(self, chunk, vmid)
    return _with_deferred_all_gather(lambda: _patch(TransposeAligner, "_handle", handle))


def slot_shift() -> Undo:
    """The trigger is one forward late on every pipeline rank but the first."""
    original = InterleavedSchedule.trigger_vmid

    def trigger_vmid(self: InterleavedSchedule, rank: int, chunk: int) -> int:
        v = original(self, rank, chunk)
        return v + 1 if rank > 0 and v != AT_START else v
    return _patch(InterleavedSchedule, "trigger_vmid", trigger_vmid)


def slot_shift_unreported() -> Undo:
    """As ``slot_shift``, but the records report the planned slot: as a cluster run's telemetry
    would, where the aligner's own counter is the plan. Only observed evidence (the core
    telemetry's ``obs_*`` and the demo's :mod:`~lab.demo.evidence`) can see it."""
    undo_shift = slot_shift()
    original = TransposeAligner._emit

    def emit(self: TransposeAligner, chunk: int, *, vmid: int, **fields: Any) -> None:
        if self.config.policy.value == "aligned" and vmid != AT_START:
            vmid = max(self.schedule.aligned_slot(chunk) - self.pp_rank, 0)
        original(self, chunk, vmid=vmid, **fields)
    undo_emit = _patch(TransposeAligner, "_emit", emit)
    return lambda: (undo_emit(), undo_shift())


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
    original = McoreDDPAdapter.bucket_groups

    def bucket_groups(self: McoreDDPAdapter, chunk: int) -> Any:
        return list(reversed(original(self, chunk)))
    return _patch(McoreDDPAdapter, "bucket_groups", bucket_groups)


FAULTY_STEP = 1  #: the step in which a RANK_ERRORS fault strikes


def _the_faulty_rank() -> bool:
    dist = torch.distributed
    return dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1


def _extra_forward(after: bool, loop: str) -> Undo:
    """On the faulty rank, in the faulty step, the step's first (``after``: last) forward step
    also calls its model chunk once more, with gradients: an extra chunk forward. ``loop``: the
    demo's own schedule loop or Megatron-LM's ``train()``, whose forward step it wraps."""
    counter: Dict[str, Any] = {"step": None, "calls": 0}

    def forward(step: int, opts: Any, model: torch.nn.Module, own: Callable[[], Any]) -> Any:
        if step != FAULTY_STEP or not _the_faulty_rank():
            return own()
        if counter["step"] != step:
            counter.update(step=step, calls=0)
        counter["calls"] += 1
        if counter["calls"] == 1 and not after:
            _call_chunk_again(model, opts)
        out = own()
        if counter["calls"] == opts.microbatches * opts.vp and after:
            _call_chunk_again(model, opts)
        return out
    if loop == "megatron-lm":
        return _wrap_megatron_lm_forward_step(forward)
    return _wrap_demo_forward_step(forward)


def _call_chunk_again(model: torch.nn.Module, opts: Any) -> None:
    tokens = torch.zeros(opts.micro_batch_size, opts.model.seq_length, dtype=torch.long,
                         device=opts.device)
    model(tokens, tokens)  # output dropped: the step's gradients are unchanged


def _wrap_demo_forward_step(forward: Callable[..., Any]) -> Undo:
    """The demo loop's forward step, told its step by ``PipelineRun.forward_backward``."""
    current: Dict[str, Any] = {}
    run_step, forward_step = train.PipelineRun.forward_backward, train._forward_step

    def forward_backward(self: Any, step: int) -> Any:
        current.update(step=step, opts=self.opts)
        try:
            return run_step(self, step)
        finally:
            current.clear()

    def faulty_forward_step(data_iterator: Any, model: torch.nn.Module, probe: Any = None) -> Any:
        def own() -> Any:
            return forward_step(data_iterator, model, probe)
        return forward(current["step"], current["opts"], model, own) if current else own()
    undo_step = _patch(train.PipelineRun, "forward_backward", forward_backward)
    undo_forward = _patch(train, "_forward_step", faulty_forward_step)
    return lambda: (undo_forward(), undo_step())


def _wrap_megatron_lm_forward_step(forward: Callable[..., Any]) -> Undo:
    """The forward step the ``--loop megatron-lm`` rank hands to ``pretrain``; the step is
    Megatron-LM's own iteration counter (``args.curr_iteration``). The wrapper keeps the
    two-argument signature ``train()`` inspects."""
    from lab.demo import megatron_lm_loop

    make = megatron_lm_loop._forward_step

    def make_faulty(book: Any) -> Callable[[Any, Any], Any]:
        forward_step = make(book)

        def faulty_forward_step(data_iterator: Any, model: Any) -> Any:
            from megatron.training.global_vars import get_args

            return forward(int(get_args().curr_iteration), book.opts, model,
                           lambda: forward_step(data_iterator, model))
        return faulty_forward_step
    return _patch(megatron_lm_loop, "_forward_step", make_faulty)


def mismatch_on_one_rank(loop: str = "schedule") -> Undo:
    """One rank runs an extra chunk forward at the start of a step: its next forwards run
    other chunks than its schedule says (StepMismatchError, wrong chunk)."""
    return _extra_forward(after=False, loop=loop)


def extra_forward_on_one_rank(loop: str = "schedule") -> Undo:
    """One rank runs an extra chunk forward after the step's last one (StepMismatchError,
    a forward beyond the schedule's)."""
    return _extra_forward(after=True, loop=loop)


def _in_faulty_step(method: str, action: Callable[[TransposeAligner, int], None],
                    before: bool) -> Undo:
    original = getattr(TransposeAligner, method)

    def patched(self: TransposeAligner, chunk: int, *args: Any) -> None:
        hit = _the_faulty_rank() and self._step == FAULTY_STEP and chunk == 1
        if hit and before:
            action(self, chunk)
        original(self, chunk, *args)
        if hit and not before:
            action(self, chunk)
    return _patch(TransposeAligner, method, patched)


def capture_on_one_rank(loop: str = "schedule") -> Undo:
    """One rank's forward at chunk 1's slot runs inside a CUDA-graph capture (as a per-layer
    graph captured during training would): the capture refusal."""
    import nemo_fp8_align.core.aligner as aligner_module

    original_on_forward = TransposeAligner._on_forward

    def on_forward(self: TransposeAligner, chunk: int) -> None:
        capturing = _the_faulty_rank() and self._step == FAULTY_STEP
        undo = _patch(aligner_module, "_capturing_cuda_graph", lambda: True) if capturing \
            else (lambda: None)
        try:
            original_on_forward(self, chunk)
        finally:
            undo()
    return _patch(TransposeAligner, "_on_forward", on_forward)


def verify_fails_on_one_rank(loop: str = "schedule") -> Undo:
    """Verify mode on; on one rank a byte of chunk 1's first transpose is flipped right after
    the plugin built it: TransposeVerifyError at the chunk's first use."""
    def corrupt(self: TransposeAligner, chunk: int) -> None:
        self.config = dataclasses.replace(self.config, verify_every_n_steps=1)
        weight = self.weights[chunk][0]
        weight.transpose.view(torch.uint8)[0, 0] ^= 1
    return _in_faulty_step("_handle", corrupt, before=False)


def args_check_fails_on_one_rank(loop: str = "megatron-lm") -> Undo:
    """Megatron-LM's argument check fails on one rank only (at attach, before any step): every
    rank must stop there with the plugin's error, none left waiting in the attach's agreement."""
    from nemo_fp8_align.errors import MegatronLMArgsError
    from nemo_fp8_align.integrations import megatron_lm

    original = megatron_lm.check_args

    def check_args(args: Any, world_size: Any = None) -> None:
        if _the_faulty_rank():
            raise MegatronLMArgsError("nemo_fp8_align (injected): Megatron-LM's arguments "
                                      "fail the check on this rank only")
        original(args, world_size)
    return _patch(megatron_lm, "check_args", check_args)


def rebuild_fails_on_one_rank(loop: str = "schedule") -> Undo:
    """On one rank the forced-sync watch's rebuild (after the evaluation's forced all-gather,
    between steps) fails: every rank must stop at the next step's end with the plugin's error,
    none left in the evaluation's pipeline receives."""
    from nemo_fp8_align.adapters.mcore_ddp import ForcedSyncWatch
    from nemo_fp8_align.errors import StaleFP8Error

    original = ForcedSyncWatch.__dict__["_rebuild"]

    def rebuild(self: Any, weights: Any) -> None:
        if _the_faulty_rank():
            raise StaleFP8Error("nemo_fp8_align (injected): the transposes could not be "
                                "rebuilt after a forced all-gather on this rank only")
        original(self, weights)
    return _patch(ForcedSyncWatch, "_rebuild", rebuild)


def metrics_fail_on_one_rank(loop: str = "megatron-lm") -> Undo:
    """The metrics listener fails on one rank before its gather (reading step 1's records), at
    step 1's end: every rank must stop with the plugin's error, none left in the listener's
    all_gather_object."""
    from nemo_fp8_align.core import metrics

    original = metrics.__dict__["_compact"]

    def compact(record: Any) -> Any:
        if _the_faulty_rank() and getattr(record, "step", None) == FAULTY_STEP:
            raise OSError("injected: this rank's step records could not be read")
        return original(record)
    return _patch(metrics, "_compact", compact)


LAST_STEP = 2  #: the last step of a 3-step run (the demo's default --steps 3)


class _FullDisk:
    """A telemetry file on a full disk: every write and flush fails with ENOSPC."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def _full(self, *args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected)")

    write = flush = _full

    def close(self) -> None:
        self._file.close()


def _disk_full_at(when: Callable[[TransposeAligner], bool]) -> Undo:
    """On the faulty rank, the aligner's telemetry file fills up when ``when(aligner)`` holds
    at a flush (the step end's, or the detach's): the real writer meets ENOSPC."""
    original = TransposeAligner._flush

    def flush(self: TransposeAligner) -> None:
        writer = self.telemetry
        if writer is not None and _the_faulty_rank() and when(self):
            if writer._file is None:
                writer._file = open(writer.path, "a", encoding="utf-8")
            if not isinstance(writer._file, _FullDisk):
                writer._file = _FullDisk(writer._file)
        original(self)
    return _patch(TransposeAligner, "_flush", flush)


def telemetry_fails_at_the_last_step(loop: str = "schedule") -> Undo:
    """The telemetry write fails (disk full) on one rank at the last step's end (step 2 of a
    3-step run): every rank must stop there with the plugin's error, not exit 0 after a log
    line (no later step end is left to report it)."""
    return _disk_full_at(lambda aligner: aligner.attached and aligner._step == LAST_STEP)


def detach_fails_on_one_rank(loop: str = "schedule") -> Undo:
    """The final telemetry flush fails (disk full) on one rank while the aligner detaches at the
    end of the run: every rank must stop with the plugin's error, none left in the teardown's
    barrier."""
    return _disk_full_at(lambda aligner: not aligner.attached)


def rebuild_fails_after_the_last_step(loop: str = "schedule") -> Undo:
    """On one rank the forced-sync watch's rebuild fails in the evaluation after the last step
    (step 2 of a 3-step run, ``--eval-between-steps``): no step end follows, so the failure is
    held to the detach, where every rank must stop with the plugin's error."""
    from nemo_fp8_align.adapters.mcore_ddp import ForcedSyncWatch
    from nemo_fp8_align.errors import StaleFP8Error

    current: Dict[str, int] = {}
    original, evaluate = ForcedSyncWatch.__dict__["_rebuild"], train.PipelineRun.evaluate

    def rebuild(self: Any, weights: Any) -> None:
        if _the_faulty_rank() and current.get("step") == LAST_STEP:
            raise StaleFP8Error("nemo_fp8_align (injected): the transposes could not be "
                                "rebuilt after the last evaluation's forced all-gather on this "
                                "rank only")
        original(self, weights)

    def evaluate_step(self: Any, step: int) -> None:
        current["step"] = step
        evaluate(self, step)
    undo_rebuild = _patch(ForcedSyncWatch, "_rebuild", rebuild)
    undo_eval = _patch(train.PipelineRun, "evaluate", evaluate_step)
    return lambda: (undo_eval(), undo_rebuild())


FAULTS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (
    no_wait, transpose_before_all_gather, slot_shift, slot_shift_unreported, skip_chunk,
    last_chunk_to_first_use, transpose_twice)}
#: Variations that must change nothing the checks see.
HARMLESS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (
    reversed_bucket_order, deferred_all_gather)}
#: Errors the plugin finds on one rank only: every rank must stop at the step's end.
RANK_ERRORS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (
    mismatch_on_one_rank, extra_forward_on_one_rank, capture_on_one_rank,
    verify_fails_on_one_rank)}
#: Errors one rank meets between steps (a forced all-gather's rebuild): every rank must stop at
#: the next step's end, or (after the last step) at the detach. The demo's own loop only.
BETWEEN_STEPS_ERRORS: Dict[str, Callable[[], Undo]] = {f.__name__: f for f in (
    rebuild_fails_on_one_rank, rebuild_fails_after_the_last_step)}
#: Errors one rank meets at attach, in Megatron-LM's loop: every rank must stop at the attach.
STARTUP_ERRORS: Dict[str, Callable[[str], Undo]] = {f.__name__: f for f in (
    args_check_fails_on_one_rank, metrics_fail_on_one_rank)}
#: Errors one rank meets at the run's end (the last step's telemetry write, the detach), in
#: either loop: every rank must stop with the plugin's error and exit nonzero.
END_ERRORS: Dict[str, Callable[[str], Undo]] = {f.__name__: f for f in (
    telemetry_fails_at_the_last_step, detach_fails_on_one_rank)}
#: Every name ``--fault`` takes; those Megatron-LM's loop (``--loop megatron-lm``) takes.
ALL: Dict[str, Callable[..., Undo]] = {**FAULTS, **HARMLESS, **RANK_ERRORS, **STARTUP_ERRORS,
                                       **BETWEEN_STEPS_ERRORS, **END_ERRORS}
IN_MEGATRON_LM: Dict[str, Callable[[str], Undo]] = {**RANK_ERRORS, **STARTUP_ERRORS,
                                                    **END_ERRORS}


def inject(name: str, loop: str = "schedule") -> Undo:
    """Apply the named fault (or harmless variation) in this process; returns its undo.

    ``loop="megatron-lm"`` (``demo --loop megatron-lm``) takes :data:`IN_MEGATRON_LM` only: the
    engine faults are judged by the demo loop's own evidence."""
    if name not in ALL:
        raise ValueError(f"fault={name!r} is not a known fault; choose one of: "
                         + ", ".join(sorted(ALL)))
    if loop == "megatron-lm":
        if name not in IN_MEGATRON_LM:
            raise ValueError(f"fault={name!r} runs in the demo's own loop only; in Megatron-LM's "
                             "loop choose one of: " + ", ".join(sorted(IN_MEGATRON_LM)))
        return IN_MEGATRON_LM[name](loop)
    if name in STARTUP_ERRORS:
        raise ValueError(f"fault={name!r} runs in Megatron-LM's loop only (--loop megatron-lm)")
    return ALL[name]()
