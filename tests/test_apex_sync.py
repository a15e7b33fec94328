"""ApexAdapter against a stand-in of Apex DistributedFusedAdam's bucket state machine.

Apex is not installable here: everything in this file runs against tests/support/standins/apex_dfa.py,
never against Apex itself. Covered: the cases NeMo PR #9481 got wrong (the last chunk; a second
``_param_copy`` resetting the transpose cache; a bucket not READY at the slot), and the adapter
driven by TransposeAligner through a simulated NeMo interleaved schedule.
"""

import logging

import pytest
import torch
from support.standins.apex_dfa import FakeFP8Backend, FakeFP8Param, StandInDistributedFusedAdam

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.adapters.apex import ApexAdapter


def make_chunks(vp, per_chunk=2, shape=(3, 4)):
    return [[FakeFP8Param(shape, f"c{c}.w{i}") for i in range(per_chunk)] for c in range(vp)]


def new_values(chunks, step):
    return {id(p): torch.full(object.__getattribute__(p, "data").shape, float(step + 1 + j))
            for j, p in enumerate(p for ps in chunks for p in ps)}


def raw(p, name):
    return object.__getattribute__(p, name)


class ParamsChunk:
    """A model chunk as the adapter reads it: ``parameters()`` (the stand-in parameters are not
    torch tensors, so no torch module can hold them)."""

    def __init__(self, params):
        self._params = list(params)

    def parameters(self):
        return iter(self._params)


def as_modules(chunks):
    return [ParamsChunk(ps) for ps in chunks]


def nemo_buckets(chunks):
    # NeMo (VP): one bucket per model chunk, list reversed: bucket 0 holds the last chunk.
    return list(reversed(chunks))


def test_rejects_an_optimizer_without_apex_buckets():
    with pytest.raises(TypeError, match="distributed_fused_adam"):
        ApexAdapter(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), [])


def test_ready_chunk_is_copied_without_any_collective():
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    values = new_values(chunks, 0)
    opt.step(values, launch_first=False)
    opt._try_start_bucket_param_sync(chunks[0])  # schedule: launch chunk 0 ...
    opt._try_start_bucket_param_sync(chunks[1])  # ... then chunk 1, which finishes chunk 0
    assert opt._params_buckets[1].status is opt.ParameterStatus.READY
    sync = ApexAdapter(opt, as_modules(chunks))
    assert not sync.finished(0)
    before = list(opt.events)
    assert sync.finish(0) is True
    assert opt.events == before  # READY: no launch, no wait, no blocking all-gather
    for p in chunks[0]:
        assert not raw(p, "_pre_forward_hook_is_enabled")
        assert torch.equal(raw(p, "data"), values[id(p)])
        assert raw(p, "cache_resets") == 1  # disarmed before the copy: no nested second copy
    assert sync.blocking_all_gathers == [0, 0]


def test_syncing_chunk_is_waited_for_then_copied():
    # NeMo's bucket order (last chunk first) makes step() launch the last chunk's bucket; the
    # pre-loop launch of chunk 1 then finds nothing SHARDED and does not finish chunk 0.
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    values = new_values(chunks, 0)
    opt.step(values)
    opt._try_start_bucket_param_sync(chunks[0])
    opt._try_start_bucket_param_sync(chunks[1])
    assert opt._params_buckets[1].status is opt.ParameterStatus.SYNCING
    sync = ApexAdapter(opt, as_modules(chunks))
    assert sync.finish(0) is True
    assert opt.events[-1] == ("wait", (1,))
    assert all(torch.equal(raw(p, "data"), values[id(p)]) for p in chunks[0])


def test_last_chunk_still_syncing_is_waited_for_then_copied():
    chunks = make_chunks(3)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    values = new_values(chunks, 0)
    opt.step(values, launch_first=False)
    for c in range(3):  # the schedule launches every chunk; nothing launches after the last
        opt._try_start_bucket_param_sync(chunks[c])
    last, bucket_of_last = 2, 0
    assert opt._params_buckets[bucket_of_last].status is opt.ParameterStatus.SYNCING
    sync = ApexAdapter(opt, as_modules(chunks))
    assert sync.finish(last) is True
    assert ("wait", (bucket_of_last,)) in opt.events
    assert not any(e[0] == "blocking_all_gather" for e in opt.events)
    assert all(torch.equal(raw(p, "data"), values[id(p)]) for p in chunks[last])
    assert sync.finished(last)


def test_unlaunched_bucket_runs_one_blocking_all_gather_and_is_reported(caplog):
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    values = new_values(chunks, 0)
    opt.step(values)  # launches bucket 0 (chunk 1) only; chunk 0's bucket stays SHARDED
    sync = ApexAdapter(opt, as_modules(chunks))
    with caplog.at_level(logging.WARNING, logger="nemo_fp8_align.adapters.apex"):
        assert sync.finish(0) is True
    assert [e[0] for e in opt.events].count("blocking_all_gather") == 1
    assert sync.blocking_all_gathers == [1, 0]
    assert "had not been launched" in caplog.text
    assert all(torch.equal(raw(p, "data"), values[id(p)]) for p in chunks[0])


def shared_bucket_setup():
    # A bucket that also holds a parameter of another chunk (NeMo appends leftover params to
    # the first chunk's bucket) stays live after this chunk's copy.
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam([[chunks[1][1]], chunks[0] + [chunks[1][0]]])
    values = new_values(chunks, 0)
    opt.step(values)
    opt._try_start_bucket_param_sync(chunks[0])
    opt._finish_bucket_param_sync()
    return chunks, opt, values


def test_a_second_param_copy_resets_the_transpose_cache():
    # The hazard itself (docs/design.md, section 3a): the stand-in, like NeMo's _param_copy_fragments,
    # resets the cache of every parameter it copies; the bucket is still live.
    chunks, opt, _ = shared_bucket_setup()
    backend = FakeFP8Backend()
    sync = ApexAdapter(opt, as_modules(chunks))
    sync.finish(0)
    backend.build_transposes(chunks[0])
    assert 1 in opt._params_buckets
    opt._param_copy(chunks[0])
    assert not any(backend.has_valid_transpose(p) for p in chunks[0])


def test_adapter_leaves_no_armed_hook_behind_so_first_use_keeps_the_transposes():
    chunks, opt, values = shared_bucket_setup()
    backend = FakeFP8Backend()
    sync = ApexAdapter(opt, as_modules(chunks))
    assert sync.finish(0)
    backend.build_transposes(chunks[0])
    resets = [raw(p, "cache_resets") for p in chunks[0]]
    events = list(opt.events)
    for p in chunks[0]:  # first use in the chunk's forward
        _ = p.data
    assert all(backend.has_valid_transpose(p) for p in chunks[0])
    assert [raw(p, "cache_resets") for p in chunks[0]] == resets == [1, 1]
    assert opt.events == events
    assert all(torch.equal(raw(p, "transpose_cache"), values[id(p)].t()) for p in chunks[0])


def test_nothing_armed_means_nothing_to_do():
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks), overlap_param_sync=False)
    opt.step(new_values(chunks, 0))  # blocking param sync inside step (e.g. DP = 1)
    sync = ApexAdapter(opt, as_modules(chunks))
    before = list(opt.events)
    assert sync.finish(0) and sync.finish(1)
    assert opt.events == before


def test_finished_observes_only():
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    opt.step(new_values(chunks, 0))
    sync = ApexAdapter(opt, as_modules(chunks))
    before = list(opt.events)
    assert sync.finished(0) is False and sync.finished(1) is False
    assert opt.events == before
    assert all(raw(p, "_pre_forward_hook_is_enabled") for ps in chunks for p in ps)


class ChunkModule(torch.nn.Module):
    """A model chunk whose forward reads its FP8 parameters (firing armed Apex hooks)."""

    def __init__(self, params):
        super().__init__()
        self.fp8_params = params

    def forward(self, x):
        for p in self.fp8_params:
            _ = p.data
        return x


def run_interleaved_step(aligner, opt, chunks, modules, schedule, rank):
    """megatron-core's launch rule with NeMo's param_sync_func (sync_overlap_parameters)."""
    def launch(c):
        opt._try_start_bucket_param_sync(chunks[c])
        aligner.on_param_sync_launched(c)

    launch(0)
    launch(1)
    for v in range(schedule.total):
        t = v + rank
        if t < schedule.total:
            c = schedule.chunk_of(t)
            if schedule.first_vmid(c) == t and 1 < c + 1 < schedule.vp:
                launch(c + 1)
        modules[schedule.chunk_of(v)](torch.zeros(1))


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_aligner_with_apex_adapter_through_a_simulated_nemo_schedule(rank):
    pp, vp, m = 3, 3, 6
    schedule = InterleavedSchedule(pp=pp, vp=vp, microbatches=m)
    chunks = make_chunks(vp)
    modules = [ChunkModule(ps) for ps in chunks]
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    backend = FakeFP8Backend()
    sync = ApexAdapter(opt, as_modules(chunks))
    aligner = TransposeAligner(modules, schedule=schedule, pp_rank=rank, dp_rank=0,
                               adapter=sync, weights=chunks, backend=backend,
                               config=AlignConfig())
    assert aligner.attach()
    for step in range(2):
        values = new_values(chunks, step)
        opt.step(values)
        run_interleaved_step(aligner, opt, chunks, modules, schedule, rank)
        mine = [r for r in aligner.records if r.step == step]
        assert sorted(r.chunk for r in mine) == list(range(vp))  # the last chunk too
        for r in mine:
            assert r.slot == r.aligned_slot and r.after_all_gather
            assert r.transposed == len(chunks[r.chunk])
        for ps in chunks:  # transposes still valid after every forward, and of this step
            for p in ps:
                assert backend.has_valid_transpose(p)
                assert torch.equal(raw(p, "transpose_cache"), values[id(p)].t())
        assert sync.blocking_all_gathers == [0] * vp
        assert not any(e[0] == "blocking_all_gather" for e in opt.events)
    aligner.detach()


@pytest.mark.parametrize("rank", [0, 1])
def test_with_the_real_te_backend_on_te_like_parameters(rank):
    # TEBackend (TE 2.x code path: _create_transpose) over stand-in Float8Tensor parameters
    # whose bytes come from the stand-in optimizer; Transformer Engine itself is not involved.
    from types import SimpleNamespace

    from support.standins.apex_dfa import FakeTEFloat8Param

    from nemo_fp8_align.backends.te import TEBackend

    # Transformer Engine's API surface: TE does not import without CUDA.
    api = SimpleNamespace(__version__="2.5.0", Float8Tensor=FakeTEFloat8Param,
                          is_non_tn_fp8_gemm_supported=lambda: False,
                          post_all_gather_processing=None, MXFP8Tensor=None,
                          Float8BlockwiseQTensor=None, NVFP4Tensor=None)
    backend = TEBackend(te_module=api)
    pp, vp, m = 2, 3, 4
    schedule = InterleavedSchedule(pp=pp, vp=vp, microbatches=m)
    chunks = [[FakeTEFloat8Param((3, 4), f"c{c}.w{i}") for i in range(2)] for c in range(vp)]
    modules = [ChunkModule(ps) for ps in chunks]
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    sync = ApexAdapter(opt, as_modules(chunks))
    aligner = TransposeAligner(modules, schedule=schedule, pp_rank=rank, dp_rank=0,
                               adapter=sync, weights=chunks, backend=backend,
                               config=AlignConfig())
    assert aligner.attach()
    for step in range(2):
        values = new_values(chunks, step)
        opt.step(values)
        run_interleaved_step(aligner, opt, chunks, modules, schedule, rank)
        mine = [r for r in aligner.records if r.step == step]
        assert sorted(r.chunk for r in mine) == list(range(vp))
        assert all(r.slot == r.aligned_slot and r.transposed == 2 for r in mine)
        for p in (p for ps in chunks for p in ps):
            assert backend.has_valid_transpose(p)  # not reset by a later copy
            assert torch.equal(raw(p, "_transpose"), values[id(p)].t())
    assert backend.transposes_built == 2 * vp * 2
    aligner.detach()


def failing_copy(opt, copied_first):
    """Apex's copy raising (a CUDA error, an OOM) after copying ``copied_first`` parameters."""
    real = opt._param_copy

    def copy(params):
        params = list(params)
        real(params[:copied_first])
        opt._param_copy = real  # from now on Apex's hook copies as usual
        raise RuntimeError("copy failed")
    opt._param_copy = copy


def test_a_copy_that_raises_leaves_no_parameter_disarmed_and_uncopied():
    chunks, opt, values = shared_bucket_setup()
    failing_copy(opt, copied_first=1)
    with pytest.raises(RuntimeError, match="copy failed"):
        ApexAdapter(opt, as_modules(chunks)).finish(0)
    assert all(raw(p, "_pre_forward_hook_is_enabled") for p in chunks[0])  # bucket still live
    for p in chunks[0]:  # first use: Apex's own hook copies what the failed copy did not
        assert torch.equal(p.data, values[id(p)])


def test_after_a_failed_copy_a_copied_out_bucket_is_not_re_armed():
    chunks = make_chunks(2)
    opt = StandInDistributedFusedAdam(nemo_buckets(chunks))
    values = new_values(chunks, 0)
    opt.step(values, launch_first=False)
    opt._try_start_bucket_param_sync(chunks[0])
    opt._try_start_bucket_param_sync(chunks[1])
    failing_copy(opt, copied_first=2)  # chunk 0's whole bucket copied, then the error
    with pytest.raises(RuntimeError, match="copy failed"):
        ApexAdapter(opt, as_modules(chunks)).finish(0)
    assert not any(raw(p, "_pre_forward_hook_is_enabled") for p in chunks[0])
    assert all(torch.equal(raw(p, "data"), values[id(p)]) for p in chunks[0])
