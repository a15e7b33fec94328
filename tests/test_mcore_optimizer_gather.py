"""megatron-core 0.7.0 and 0.8.0, whose DistributedOptimizer owns the parameter all-gather (one
chain per optimizer from ``zero_grad``, no per-chunk ``start_param_sync``): the engine through
:class:`~nemo_fp8_align.adapters.mcore_optimizer.McoreOptimizerAdapter`, on the real schedule,
DDP and DistributedOptimizer of the installed version (make test puts each first on
PYTHONPATH). One shared multi-rank run per policy: aligned, lazy (megatron-core alone), off.

0.7.0 refuses interleaving with PP = 2 (its own check), so it runs PP = 4; 0.8.0 runs PP = 2
with three chunks (chunk 2's all-gather is chained from chunk 1's, inside the loop). DP = 2:
the next step's bytes of the other rank's shard arrive only through the all-gather that the
aligned finish waits for.
"""

import contextlib
import sys

import pytest

pytest.importorskip("megatron.core")

from nemo_fp8_align import mcore_versions as mcore_version  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not mcore_version.optimizer_owns_gather(),
    reason="megatron-core >= 0.9: the DDP chunks own the all-gather (test_engine_mcore)")]

from nemo_fp8_align.core.schedule import InterleavedSchedule  # noqa: E402
from lab.demo.launch import alignment_problems, differences  # noqa: E402
from support.demo_runs import demo  # noqa: E402


def _shape():
    """(pp, vp, dp, m): PP 4 on 0.7 (it refuses PP 2 with interleaving), else PP 2 and VP 3."""
    if mcore_version.installed_version().startswith("0.7."):
        return 4, 2, 2, 4
    return 2, 3, 2, 4


def _run(policy):
    return demo(*_shape(), policy, steps=3)


def _slots(result, step, chunk):
    return {r["pp_rank"]: r["slot"] for r in result.records
            if r["step"] == step and r["chunk"] == chunk and r["dp_rank"] == 0}


def test_aligned_same_slot_on_every_rank_once_per_step_after_the_gather():
    pp, vp, _, m = _shape()
    model = InterleavedSchedule(pp, vp, m, legacy_order=True)
    run = _run("aligned")
    assert alignment_problems(run) == []
    for step in range(3):
        for chunk in range(vp):
            assert set(_slots(run, step, chunk).values()) == {model.aligned_slot(chunk)}, \
                (step, chunk, _slots(run, step, chunk))
    assert all(r["after_all_gather"] and r["transposed"] == r["weights"] for r in run.records)
    assert all(r["legacy_order"] for r in run.records)  # before 0.10: groups of PP
    for rank in run.ranks:  # pipeline rank 0's chunk 0 is bucketed (megatron-core buckets
        # nothing else): its chain runs through several all-gathers inside the chunk
        assert all(n >= 1 for n in rank["chain_handles"])
        assert (rank["chain_handles"][0] > 1) == (rank["pp_rank"] == 0), rank["chain_handles"]
    for rank in run.ranks:
        assert all(b == 1 for step in rank["builds_per_step"] for b in step)


def test_lazy_is_megatron_core_alone_each_rank_at_its_first_use():
    pp, vp, _, m = _shape()
    model = InterleavedSchedule(pp, vp, m, legacy_order=True)
    run = _run("lazy")
    assert alignment_problems(run) == []
    for chunk in range(vp):
        assert _slots(run, 2, chunk) == {r: model.aligned_slot(chunk) + r for r in range(pp)}


def test_bit_identical_to_the_plugin_off():
    off = _run("off")
    assert off.records == []  # off: never attached
    for policy in ("aligned", "lazy"):
        assert differences(_run(policy), off) == [], policy


def test_schedule_finishing_each_chunk_itself_delay_param_gather():
    """Megatron-LM's ``--delay-param-gather`` of that era binds the optimizer's
    ``finish_param_sync`` as the schedule's ``param_sync_func`` (here one per chunk): the
    schedule then waits chunk c's chain at its launch slot, before the aligned one; the hold
    sees those dispatches too, and the run stays aligned and bit-identical to off."""
    pp, vp, _, m = _shape()
    model = InterleavedSchedule(pp, vp, m, legacy_order=True)
    run = demo(*_shape(), "aligned", steps=3, delay_param_gather=True)
    assert alignment_problems(run) == []
    for chunk in range(vp):
        assert set(_slots(run, 2, chunk).values()) == {model.aligned_slot(chunk)}
    assert differences(run, _run("off")) == []


@pytest.mark.parametrize("fault,seen", [
    ("no_wait", "StaleFP8Error"),  # the chain's finish skipped: built before the gather
    ("slot_shift", "aligned slot"),  # one forward late on every rank but the first
])
def test_the_fault_battery_s_engine_faults_are_caught_here_too(fault, seen):
    from lab.demo.launch import DemoRankError

    try:
        run = demo(*_shape(), "aligned", steps=3, fault=fault)
        problems = alignment_problems(run) + differences(run, _run("off"))
    except DemoRankError as err:
        problems = str(err).splitlines()
    assert any(seen in p for p in problems), problems


@pytest.mark.parametrize("fault", ["mismatch_on_one_rank", "extra_forward_on_one_rank"])
def test_an_error_on_one_rank_stops_every_rank_at_the_step_end(fault):
    """The step end of this hold (chunk 0's finish_grad_sync) carries the agreement: the faulty
    rank's error stops every rank there, each with its own message (test_no_hang's check)."""
    from nemo_fp8_align.config import Policy
    from lab.demo.launch import DemoRankError, run_demo
    from lab.demo.train import DemoOptions
    from support.rank_errors import check_every_rank_stopped

    pp, _, dp, m = _shape()  # VP 2: the messages support/rank_errors.py expects
    opts = DemoOptions(pp=pp, vp=2, dp=dp, microbatches=m, steps=2, policy=Policy.ALIGNED,
                       fault=fault, pg_timeout_s=60.0)
    with pytest.raises(DemoRankError) as info:
        run_demo(opts)
    check_every_rank_stopped(opts, info.value, fault)


def test_without_the_optimizer_align_fp8_transposes_says_how():
    from nemo_fp8_align.errors import UnsupportedSetupError
    from nemo_fp8_align.assemble import _optimizer_owned

    with pytest.raises(UnsupportedSetupError, match=r"megatron-core 0\.[78]\.0: the parameter "
                       r"all-gather belongs to the DistributedOptimizer.*optimizer=<what "
                       "get_megatron_optimizer returned>"):
        _optimizer_owned(None)


@contextlib.contextmanager
def _one_process_optimizer(monkeypatch):
    """megatron-core's own DDP chunks and DistributedOptimizer in a 1-process gloo world (PP 2
    reported, as tests/support/ddp_chunks.py does for the DDP path): yields (chunks, config,
    backend, optimizer, the inner optimizers)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_align.backends.reference import ReferenceBackend
    from lab.demo.mcore_versions import ddp_groups
    from lab.demo.model import DemoModelConfig, GPTChunk
    from lab.demo.options import DemoOptions
    from lab.demo.train import _optimizer
    from nemo_fp8_align.adapters import groups
    from support.one_process import gloo_world

    real = groups.resolve_ranks
    monkeypatch.setattr(groups, "resolve_ranks", lambda *a, **k: groups.ParallelRanks(
        pp_rank=0, pp_size=2, dp_rank=0, dp_size=1, pp_group=None, pp_source="test",
        dp_source=real(*a, **k).dp_source))
    with gloo_world():
        parallel_state.initialize_model_parallel(1, 1)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   params_dtype=torch.float32, use_cpu_initialization=True)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            overlap_grad_reduce=True)
        backend = ReferenceBackend()
        chunks = [DistributedDataParallel(config, ddp, GPTChunk(
            DemoModelConfig(), config=config, stage=0, vp_stage=v, pre_process=v == 0,
            post_process=v == 1, backend=backend), **ddp_groups()) for v in range(2)]
        optimizer = _optimizer(chunks, DemoOptions())
        yield chunks, config, backend, optimizer, list(
            getattr(optimizer, "chained_optimizers", [optimizer]))


def test_the_hold_on_a_real_optimizer_chain_and_nothing_left_after_restore(monkeypatch):
    """One process, megatron-core's own DDP chunks and DistributedOptimizer (DP 1): launches are
    the dispatches of each chunk's first all-gather; a chunk is complete only once this step's
    chain has gathered it (after an optimizer step, an older chain's record says nothing);
    restore leaves no instance attribute behind."""
    from nemo_fp8_align.adapters.mcore_optimizer import McoreOptimizerAdapter

    with _one_process_optimizer(monkeypatch) as (chunks, _, _, optimizer, _):
        sync = hold = McoreOptimizerAdapter(chunks, optimizer)
        launched, ends = [], []
        hold.install(launched.append, lambda: ends.append(1))
        (inner,) = sync.optimizers
        assert "_dispatch_gather_model_params" in vars(inner)
        optimizer.zero_grad()  # before any update: nothing to gather, the bytes are complete
        assert launched == [0] and sync.finished(0) and sync.finished(1)
        optimizer.step()
        assert not sync.finished(0) and not sync.finished(1)  # new bytes, nothing dispatched
        optimizer.zero_grad()
        assert launched == [0, 0] and not sync.finished(0)  # in flight
        assert sync.finish(0) and launched == [0, 0, 1]  # waiting chunk 0 dispatched chunk 1's
        assert not sync.finished(1) and sync.finish(1)
        with pytest.raises(AssertionError, match="Communication call has not been issued"):
            chunks[0].finish_grad_sync()  # megatron-core's own, after the step end: no backward ran
        assert ends == [1]
        hold.restore()
        assert "_dispatch_gather_model_params" not in vars(inner)
        assert "finish_grad_sync" not in vars(chunks[0])


def _fail(*_a, **_k):
    raise OSError("injected failure")


#: Attach stages on this path, in order, each made to fail (tests/test_entry_points.py's for
#: the DDP chunks' path, which 0.7/0.8 do not have).
STAGES = {
    "claim": lambda mp: mp.setattr("nemo_fp8_align.core.aligner.claim", _fail),
    "forward hooks": lambda mp: mp.setattr("torch.nn.Module.register_forward_hook", _fail),
    "build observer (telemetry)": lambda mp: mp.setattr(
        "nemo_fp8_align.core.observe.BuildObserver._started", property(_fail)),
    "optimizer hold": lambda mp: mp.setattr(
        "nemo_fp8_align.adapters.mcore_optimizer.McoreOptimizerAdapter.install", _fail),
}


def _weights(chunk):
    return chunk.module.fp8_weights()


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_failing_attach_through_the_optimizer_leaves_nothing_and_a_retry_attaches(
        monkeypatch, stage, tmp_path):
    """align_fp8_transposes(..., optimizer=) on megatron-core's own DDP chunks and
    DistributedOptimizer: whichever stage fails, nothing is left (hooks, claims, class
    patches, the optimizer's dispatch wrapper, chunk 0's step end), and a second try
    attaches."""
    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.core import aligner as claims
    from nemo_fp8_align.class_patch import patched_methods
    from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes
    from support.attach_leftovers import module_hooks

    with _one_process_optimizer(monkeypatch) as (chunks, config, backend, optimizer, inners):
        hooks = module_hooks(chunks)

        def leftovers():
            found = [] if module_hooks(chunks) == hooks else ["module hooks"]
            found += [f"claim on chunk {c}" for c, chunk in enumerate(chunks)
                      if claims.holder_of(chunk) is not None]
            found += [f"class patch {k}" for k in patched_methods()]
            found += ["dispatch wrapper" for o in inners
                      if "_dispatch_gather_model_params" in vars(o)]
            return found + ["chunk 0's finish_grad_sync" for _ in [0]
                            if "finish_grad_sync" in vars(chunks[0])]

        def attach():
            return align_fp8_transposes(
                chunks, num_microbatches=2, config=config, backend=backend, weights_of=_weights,
                optimizer=optimizer,
                align_config=AlignConfig(telemetry_path=str(tmp_path / "t.jsonl")))

        with pytest.MonkeyPatch.context() as mp:
            STAGES[stage](mp)
            with pytest.raises(OSError, match="injected failure"):
                attach()
        assert leftovers() == []
        aligner = attach()  # nothing refuses a second try
        assert aligner.attached and any("_dispatch_gather_model_params" in vars(o)
                                        for o in inners)
        aligner.detach()
        assert leftovers() == []


def test_megatron_lm_attach_with_the_optimizer_counts_microbatches_as_that_era_does(
        monkeypatch):
    """``megatron_lm.attach(model, optimizer=...)``: the microbatch count is megatron-core's
    calculator on 0.8, and Megatron-LM's own ``megatron.training.global_vars`` on 0.7, which
    has no megatron-core calculator (it stopped with ModuleNotFoundError). No Megatron-LM of
    that era is installed here: a module with its ``get_num_microbatches`` stands in for it."""
    import importlib.util
    import types

    from nemo_fp8_align.integrations import megatron_lm

    if importlib.util.find_spec("megatron.core.num_microbatches_calculator") is not None:
        from megatron.core import num_microbatches_calculator as calculator

        # the global is put back as it was after the test (0.8 has no destroy function)
        monkeypatch.setattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
        calculator.init_num_microbatches_calculator(0, None, 2, 1, 1)
        expected = calculator.get_num_microbatches
    else:
        training = types.ModuleType("megatron.training")
        global_vars = types.ModuleType("megatron.training.global_vars")
        global_vars.get_num_microbatches = expected = lambda: 2
        training.global_vars = global_vars
        monkeypatch.setitem(sys.modules, "megatron.training", training)
        monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    with _one_process_optimizer(monkeypatch) as (chunks, _, backend, optimizer, inners):
        aligner = megatron_lm.attach(chunks, args=None, backend=backend, weights_of=_weights,
                                     optimizer=optimizer, log_metrics=False)
        try:
            assert aligner.attached and aligner._num_microbatches is expected
            assert any("_dispatch_gather_model_params" in vars(o) for o in inners)
        finally:
            aligner.detach()
