"""The adapter for megatron-core DDP chunks (core_r0.9+), the all-gather owner of every megatron-
core loop: Megatron-LM's ``train()``, Megatron-Bridge, NeMo's ``mcore_distributed_optim``,
``align_fp8_transposes`` in a user's loop.

Launches. Every such loop launches a chunk's parameter all-gather through that chunk's
``start_param_sync``: Megatron-LM's ``train()`` and Megatron-Bridge bind
``config.param_sync_func = [chunk.start_param_sync for chunk in model]`` right before their loop
(None for the first iteration after a start or a load, then back), NeMo binds the same list
inside every ``fwd_bwd_step``, and a user's loop binds it once. A wrapper on each chunk
*instance* is found by every one of those lookups, whenever they happen; a list bound before the
wrap is pointed at the wrappers. The step's end is chunk 0's ``finish_grad_sync``, the first
thing megatron-core's ``finalize_model_grads`` does on every rank, before the gradient
collectives (NeMo closes the step itself: ``owns_step_end=False``).

Finishing. megatron-core's own forward pre-hooks call ``finish_param_sync`` lazily at each
rank's first use of a bucket; the adapter calls it earlier, at the aligned slot, for every
bucket group of the chunk (the dense ones and the expert-parallel ones). On core >= 0.16 with
Transformer Engine, ``finish_param_sync`` also runs TE's post-all-gather processing (the
transposes), so the backend then finds nothing left to build. Later pre-hooks find no pending
handle and do nothing. With ``OptimizerConfig(overlap_param_gather_with_optimizer_step=True)``,
``get_megatron_optimizer`` marks chunk 0's DDP instance, and chunk 0's all-gather is dispatched
by the optimizer step (``ChainedOptimizer.step_with_ready_grads``), not by the schedule: the
schedule's ``start_param_sync`` returns at once for it. Before the first optimizer step, and
after a step skipped for inf/nan (``ChainedOptimizer.step`` returns before dispatching), nothing
was dispatched; megatron-core's own pre-hook then dispatches and waits at first use, and
``finish`` does the same at the aligned slot: the same one all-gather, on the same group, in the
same order on every rank of that group, and the schedule dispatches nothing for chunk 0
afterwards.

Forced all-gathers (megatron-core < 0.18). A forced all-gather
(``DistributedDataParallel.start_param_sync(force_sync=True)``: Megatron-LM's evaluation and
checkpoint save through ``disable_forward_pre_hook()``, any caller's
``disable_forward_pre_hook(param_sync=True)``) either waits for the all-gather in flight or runs
one synchronously. megatron-core 0.16 and 0.17 run no post-all-gather processing on that path,
and the next ``finish_param_sync`` finds no handle to wait for, so it runs none either. With
Transformer Engine >= 2.10, megatron-core casts FP8 parameters with
``manual_post_all_gather_processing=True``: the transposes then stay flagged valid but hold the
old weights, and a backward reads them (Megatron-LM PRs #4560/#4562/#4563; from 0.18 the bucket
group's ``_post_param_sync`` runs after a forced all-gather too).

With ``overlap_param_gather_with_optimizer_step`` the hazard is in every such forced sync: the
optimizer step has dispatched chunk 0's all-gather, the forced sync waits for it, and the
schedule dispatches nothing more for chunk 0 before its forwards. (Otherwise the schedule's next
launch gathers again and megatron-core post-processes that one.)

:class:`ForcedSyncWatch` wraps each bucket group's ``start_param_sync`` (an instance attribute,
removed by :meth:`ForcedSyncWatch.remove`) on megatron-core versions whose bucket groups have no
``_post_param_sync``; after a forced call returns, it rebuilds those of that group's transposes
that are flagged valid from the bytes just gathered (the invalid ones are built as usual). On
>= 0.18 nothing is wrapped: megatron-core's own post-processing runs, and a second build would be
wasted work.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align import errors, support
from nemo_fp8_align.core.adapter import is_launch

__all__ = ["ForcedSyncWatch", "GradSyncStepEnd", "McoreDDPAdapter", "param_of",
           "post_processes_forced_sync"]

_ABSENT = object()


def _check_overlapped(chunk: int, ddp_config: Any) -> None:
    """Without ``overlap_param_gather`` the chunk's all-gather runs synchronously inside
    ``start_param_sync`` (nothing in flight to align) and megatron-core's
    ``finish_param_sync`` asserts it (0.9 on). NeMo 2.0.0 sets it from
    ``model.optim.overlap_param_gather`` while binding the schedule's ``start_param_sync`` from
    ``overlap_param_sync`` (2.1 on: both from ``overlap_param_sync``): seen on NeMo 2.0.0."""
    from nemo_fp8_align.errors import UnsupportedSetupError

    if ddp_config is None or getattr(ddp_config, "overlap_param_gather", True):
        return
    raise UnsupportedSetupError(
        f"model chunk {chunk}: DistributedDataParallelConfig.overlap_param_gather=False: its "
        "parameter all-gather runs synchronously in start_param_sync, so there is nothing to "
        "align. Fix: DistributedDataParallelConfig(overlap_param_gather=True, "
        "align_param_gather=True); in NeMo model.optim.overlap_param_sync=true and "
        "model.optim.align_param_gather=true (NeMo 2.0.0 reads this setting from "
        "model.optim.overlap_param_gather: set model.optim.overlap_param_gather=true too)")


class McoreDDPAdapter:
    """:class:`~nemo_fp8_align.core.adapter.Adapter` over megatron-core DDP chunks.

    Args:
        chunks: this rank's DDP-wrapped model chunks, in schedule order.
        config: the ``TransformerConfig`` the schedule reads (its ``param_sync_func`` tells a
            training pass from a forward-only one, and is checked for functions the adapter
            does not see); None: not read (NeMo binds it inside its own step).
        owns_step_end: report the step end at chunk 0's ``finish_grad_sync``.

    The forced-all-gather watch rebuilds the weights :meth:`weights_to_align` returned (none
    before it is asked: no watch).
    """

    launched_before_loop = 2  #: the schedule's pre-loop calls (chunks 0 and 1)

    def __init__(self, chunks: Sequence[Any], config: Any = None, *,
                 owns_step_end: bool = True) -> None:
        for i, chunk in enumerate(chunks):
            self._check_chunk(i, chunk)
        self._end = GradSyncStepEnd(chunks) if owns_step_end else None
        self.chunks = list(chunks)
        self.config = config
        self.owns_step_end = owns_step_end
        #: ``(weights per chunk, backend)`` for the forced-all-gather watch (None: no watch).
        self._forced_sync: Optional[Tuple[Sequence[Sequence[Any]], Any]] = None
        self._originals: List[Any] = []
        self._wrapped: List[Any] = []
        self._watch: Any = None
        self._rebound: Optional[tuple] = None  # (the list a loop had bound, ours in its place)

    def weights_to_align(self, weights: Sequence[Sequence[Any]], *, backend: Any,
                         config: Any) -> List[List[Any]]:
        """The refused setups of ``config`` and the recipes the installed megatron-core cannot
        post-process raise; MXFP8 weights that megatron-core does not re-quantize after the
        all-gather (the chunk's ``ddp_config.reuse_grad_buf_for_mxfp8_param_ag`` off) carry no
        work and are left out. The rest are also what the forced-all-gather watch rebuilds."""
        kept = [support.weights_with_work(list(w), backend, requantized=_requantizes_mxfp8(chunk))
                for w, chunk in zip(weights, self.chunks)]
        support.refuse_path(config, kept, backend, support.mcore_features())
        self._forced_sync = (kept, backend)
        return kept

    @staticmethod
    def _check_chunk(i: int, chunk: Any) -> None:
        if not callable(getattr(chunk, "start_param_sync", None)) \
                or not hasattr(chunk, "bucket_groups"):
            raise TypeError(
                f"model chunk {i} is a {type(chunk).__name__}, not megatron-core's "
                "DistributedDataParallel (no 'start_param_sync' / 'bucket_groups'): wrap each "
                "chunk in megatron.core.distributed.DistributedDataParallel with "
                "overlap_param_gather=True and use_distributed_optimizer=True")
        _check_overlapped(i, getattr(chunk, "ddp_config", None))

    # ------------------------------------------------------------------ finishing a chunk
    def bucket_groups(self, chunk: int) -> List[Any]:
        """The chunk's bucket groups: the dense ones, then the expert-parallel ones."""
        ddp = self.chunks[chunk]
        return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))

    def _dispatched_by_optimizer(self, chunk: int) -> bool:
        # Set on the DDP instance by get_megatron_optimizer (DistributedDataParallelConfig has
        # no such field in any megatron-core version).
        return bool(getattr(self.chunks[chunk], "overlap_param_gather_with_optimizer_step", False))

    def wait(self, chunk: int) -> None:
        """Wait for ``chunk``'s in-flight all-gathers only, without megatron-core's FP8
        post-processing (on >= 0.16 with TE >= 2.10 that is the transposes' build, run by
        ``finish_param_sync``): the aligner times the wait apart from the build."""
        by_optimizer = self._dispatched_by_optimizer(chunk)
        for group in self.bucket_groups(chunk):
            if not self._check_launched(group, chunk, by_optimizer):
                group.start_param_sync()  # what megatron-core's pre-hook would dispatch
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()  # finish_param_sync's own wait then returns

    def finish(self, chunk: int) -> bool:
        by_optimizer = self._dispatched_by_optimizer(chunk)
        for group in self.bucket_groups(chunk):
            self._check_launched(group, chunk, by_optimizer)  # undispatched: dispatched below
            # skip_next_bucket_dispatch: with align_param_gather the schedule dispatches every
            # chunk's all-gather itself; dispatching the next bucket here would reorder them.
            group.finish_param_sync(skip_next_bucket_dispatch=True)
        return self.finished(chunk)

    @staticmethod
    def _check_launched(group: Any, chunk: int, by_optimizer: bool) -> bool:
        """Whether ``group``'s all-gather was dispatched; raises where only the schedule could
        have (an undispatched group of a chunk the optimizer step dispatches is for the caller
        to dispatch, as megatron-core's own pre-hook does at first use)."""
        if group.param_gather_dispatched:
            return True
        if not by_optimizer:
            # finish_param_sync would issue the all-gather itself and the schedule's later
            # start_param_sync a duplicate one: a collective out of order on this rank.
            raise RuntimeError(
                f"model chunk {chunk}: its parameter all-gather was not launched before its "
                "aligned slot. The schedule launches it through config.param_sync_func, which "
                "needs DistributedDataParallelConfig(overlap_param_gather=True, "
                "align_param_gather=True) and config.param_sync_func = "
                "[chunk.start_param_sync for chunk in model].")
        return False

    def finished(self, chunk: int) -> bool:
        return all(g.param_gather_dispatched and g.param_gather_handle is None
                   for g in self.bucket_groups(chunk))

    # ------------------------------------------------------------------ the schedule hold
    def install(self, on_launch: Callable[[int], None], on_end: Callable[[], None]) -> None:
        try:
            self._originals = [c.start_param_sync for c in self.chunks]
            self._wrapped = [_launch_then(i, fn, on_launch)
                             for i, fn in enumerate(self._originals)]
            for chunk, fn in zip(self.chunks, self._wrapped):
                chunk.start_param_sync = fn  # an instance attribute: every lookup finds it
            if self._end is not None:
                self._end.install(on_end)
            self._rebind_bound_list()
            if self._forced_sync is not None:
                self._watch = self._watch_forced_syncs(*self._forced_sync)
        except BaseException:
            self.restore()
            raise

    @property
    def forced_syncs(self) -> Any:
        """The forced-all-gather watch (None where megatron-core post-processes them itself)."""
        return self._watch

    def _rebind_bound_list(self) -> None:
        """A loop that bound the list before the wrap holds the original bound methods: point
        its entries at the wrappers."""
        funcs = getattr(self.config, "param_sync_func", None)
        entries = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if funcs is not None and len(entries) == len(self.chunks) \
                and all(f == o for f, o in zip(entries, self._originals)):
            bound = list(self._wrapped)
            self._rebound = (funcs, bound if isinstance(funcs, (list, tuple)) else bound[0])
            self.config.param_sync_func = self._rebound[1]

    def training(self) -> bool:
        # megatron-core's loops set param_sync_func to None for forward-only passes and for
        # Megatron-LM's first iteration after a load (which launches nothing).
        return torch.is_grad_enabled() and (
            self.config is None or getattr(self.config, "param_sync_func", None) is not None)

    def check(self) -> None:
        funcs: Optional[Any] = getattr(self.config, "param_sync_func", None)
        if funcs is None or not self._wrapped:
            return
        entries = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if len(entries) != len(self._wrapped) or any(
                f is not w for f, w in zip(entries, self._wrapped)):
            raise errors.foreign_param_sync()

    def restore(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        for chunk, fn in zip(self.chunks, self._wrapped):
            if chunk.__dict__.get("start_param_sync") is fn:
                del chunk.__dict__["start_param_sync"]
        if self._end is not None:
            self._end.restore()
        funcs = getattr(self.config, "param_sync_func", None)
        if self._rebound is not None and funcs is self._rebound[1]:
            self.config.param_sync_func = self._rebound[0]  # the very object it was
        elif isinstance(funcs, list) and any(f is w for f, w in zip(funcs, self._wrapped)):
            self.config.param_sync_func = [o if f is w else f for f, w, o in
                                           zip(funcs, self._wrapped, self._originals)]
        elif self._wrapped and funcs is self._wrapped[0]:
            self.config.param_sync_func = self._originals[0]
        self._wrapped, self._originals, self._rebound = [], [], None

    def _watch_forced_syncs(self, weights: Sequence[Sequence[Any]],
                            backend: Any) -> Optional["ForcedSyncWatch"]:
        """The watch over this adapter's bucket groups (None where megatron-core
        post-processes forced all-gathers itself)."""
        watch = ForcedSyncWatch([self.bucket_groups(c) for c in range(len(weights))], weights,
                                backend)
        return watch if watch.active else None


def _launch_then(chunk: int, fn: Callable[..., Any],
                 on_launch: Callable[[int], None]) -> Callable[..., Any]:
    def start_param_sync(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if is_launch(kwargs):
            on_launch(chunk)
        return out
    return start_param_sync


def _requantizes_mxfp8(chunk: Any) -> bool:
    """Whether megatron-core re-quantizes the chunk's MXFP8 parameters after the all-gather."""
    ddp_config = getattr(chunk, "ddp_config", None)
    return bool(getattr(ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False))


class GradSyncStepEnd:
    """The step end both megatron-core adapters report: chunk 0's ``finish_grad_sync``, wrapped
    on the instance (the first thing ``finalize_model_grads`` does on every rank, before the
    gradient collectives), with its undo.

    When the step end raises (the agreement found an error on some rank: every rank raises
    here), the overlapped gradient reduce-scatters of every chunk are still in flight: each
    chunk's ``finish_grad_sync`` waits for them first (the same collectives, in the same order,
    that ``finalize_model_grads`` would have waited for on every rank), then the error is
    raised, so no rank leaves a collective behind on its way out.

    Args:
        chunks: the model chunks, megatron-core ``DistributedDataParallel``; chunk 0's is wrapped.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        chunk = chunks[0]
        if not callable(getattr(chunk, "finish_grad_sync", None)):
            raise TypeError(f"model chunk 0 is a {type(chunk).__name__} without "
                            "finish_grad_sync: wrap each chunk in megatron-core's "
                            "DistributedDataParallel")
        self.chunk = chunk
        self.chunks = list(chunks)
        self._wrapper: Any = None

    def install(self, on_end: Callable[[], None]) -> None:
        finish = self.chunk.finish_grad_sync
        others = self.chunks[1:]

        def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
            try:
                on_end()  # before the grad collectives: at the same point on every rank
            except BaseException:
                finish(*args, **kwargs)  # wait for what is in flight, then raise
                for chunk in others:
                    chunk.finish_grad_sync()
                raise
            return finish(*args, **kwargs)
        self._wrapper = finish_grad_sync
        self.chunk.finish_grad_sync = finish_grad_sync

    def restore(self) -> None:
        """Remove the wrapper if it is still the one in place (a later wrap stays)."""
        if self._wrapper is not None \
                and self.chunk.__dict__.get("finish_grad_sync") is self._wrapper:
            del self.chunk.__dict__["finish_grad_sync"]
        self._wrapper = None


def post_processes_forced_sync(bucket_group: Any) -> bool:
    """Whether megatron-core runs its post-all-gather processing after a forced all-gather of
    ``bucket_group`` (megatron-core >= 0.18: ``_post_param_sync``)."""
    return callable(getattr(type(bucket_group), "_post_param_sync", None))


def _forced(args: Tuple[Any, ...], kwargs: dict) -> bool:
    # Bucket groups take ``start_param_sync(self, force_sync=False)``; DDP passes it by name.
    return bool(kwargs.get("force_sync", args[0] if args else False))


def param_of(weight: Any) -> Any:
    # A reference FP8 weight derives from its DDP parameter (``source``); a TE Float8Tensor is
    # the parameter. Read from __dict__: no attribute hook of the tensor class runs.
    return getattr(weight, "__dict__", {}).get("source", weight)


class ForcedSyncWatch:
    """After every forced all-gather of a bucket group that megatron-core does not
    post-process, rebuilds the transposes of the weights in that group.

    A rebuild that fails is held, not raised: the forced all-gather runs between steps
    (evaluation, a checkpoint save), where raising on one rank would leave its peers blocked in
    the evaluation's pipeline receives. The aligner reports it at the next step end's agreement,
    on every rank (:meth:`take_failures`), before any optimizer step uses that step's gradients.

    Args:
        groups: per model chunk, its bucket groups (dense and expert-parallel).
        weights: per model chunk, its FP8 weights.
        backend: builds them (:meth:`~nemo_fp8_align.backends.protocol.FP8TransposeBackend.rebuild_transposes`).
    """

    def __init__(self, groups: Sequence[Sequence[Any]], weights: Sequence[Sequence[Any]],
                 backend: Any) -> None:
        self.backend = backend
        #: Transposes rebuilt after forced all-gathers (telemetry, tests).
        self.rebuilt = 0
        self._failures: List[Exception] = []
        self._wrapped: List[Tuple[Any, Any]] = []  # (group, what its instance attribute was)
        try:
            for chunk_groups, chunk_weights in zip(groups, weights):
                for group in chunk_groups:
                    if not post_processes_forced_sync(group):
                        ids = {id(p) for bucket in group.buckets for p in bucket.params}
                        self._wrap(group, [w for w in chunk_weights if id(param_of(w)) in ids])
        except BaseException:
            self.remove()  # all or nothing: no group keeps a wrapper over this watch
            raise

    @property
    def active(self) -> bool:
        return bool(self._wrapped)

    def _wrap(self, group: Any, weights: List[Any]) -> None:
        previous = vars(group).get("start_param_sync", _ABSENT)
        original = group.start_param_sync  # megatron-core's bound method (or a wrapper of it)

        def start_param_sync(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if _forced(args, kwargs):  # synchronous: the bytes are in place
                # Only transposes flagged valid can hold old bytes unseen; invalid ones are built
                # at the aligned slot or at first use anyway (TE without manual processing).
                try:
                    self._rebuild(weights)
                except Exception as err:  # rank-local: held for the next step end's agreement
                    self._failures.append(err)
            return out

        group.start_param_sync = start_param_sync
        self._wrapped.append((group, previous))

    def _rebuild(self, weights: List[Any]) -> None:
        # Only transposes flagged valid can hold old bytes unseen; invalid ones are built at the
        # aligned slot or at first use anyway (TE without manual processing).
        flagged = [w for w in weights if self.backend.has_valid_transpose(w)]
        if flagged:
            with torch.no_grad():  # an evaluation's caller may have autograd on
                self.rebuilt += self.backend.rebuild_transposes(flagged)

    def take_failures(self) -> List[Exception]:
        """The rebuild failures held since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def remove(self) -> None:
        """Put back what each wrapped group had (idempotent)."""
        for group, previous in reversed(self._wrapped):
            if previous is _ABSENT:
                vars(group).pop("start_param_sync", None)
            else:
                group.start_param_sync = previous
        self._wrapped.clear()
