"""The schedule model against megatron-core's own schedule (the installed library)."""

import inspect
import itertools

import pytest

from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule, ScheduleError
from support.configs import has_group_size, model_config

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def _valid_shapes(max_pp=4, max_vp=4, max_m=13):
    for pp, vp, m in itertools.product(range(2, max_pp + 1), range(2, max_vp + 1), range(2, max_m + 1)):
        for n in range(pp, m + 1):
            if m >= pp and not 0 < m % n < pp:
                yield pp, vp, m, n


@pytest.mark.parametrize("pp,vp,m,n", list(_valid_shapes()))
def test_forward_table_matches_megatron_core(pp, vp, m, n):
    if not hasattr(schedules, "get_schedule_table"):
        pytest.skip("megatron-core < 0.12 builds the interleaved order inside "
                    "forward_backward_pipelining_with_interleaving (no get_schedule_table): the "
                    "demo runs on that schedule judge the model there (test_engine_mcore; a chunk "
                    "run out of the model's order raises StepMismatchError)")
    ours = InterleavedSchedule(pp, vp, m, n)
    assert list(ours.forward_table) == schedules.get_schedule_table(m, vp, n)


@pytest.mark.parametrize("pp,vp,m,n", list(_valid_shapes()))
def test_trigger_is_after_launch_and_before_first_use(pp, vp, m, n):
    s = InterleavedSchedule(pp, vp, m, n)
    for rank, chunk in itertools.product(range(pp), range(vp)):
        trigger = s.trigger_vmid(rank, chunk)
        # The all-gather is launched no later than the transposes that consume it ...
        assert s.param_sync_launch_vmid(rank, chunk) <= trigger or chunk == 0
        # ... and the transposes are ready before the chunk's first forward on this rank.
        assert trigger <= s.first_vmid(chunk)
        # Every rank lands on the same wall-clock slot: the chunk's first forward.
        assert s.slot_of(rank, trigger) == s.aligned_slot(chunk) == s.first_vmid(chunk)
        if trigger != AT_START:
            assert s.chunk_of(trigger) in (chunk - 1, chunk)


def test_first_vmid_is_the_first_microbatch_of_each_chunk():
    s = InterleavedSchedule(4, 3, 8)
    for chunk in range(3):
        v = s.first_vmid(chunk)
        assert s.forward_table[v] == (0, chunk)
        assert all(c != chunk for _, c in s.forward_table[:v])


def test_legacy_order_equals_group_size_pp():
    for pp, vp, k in itertools.product(range(2, 5), range(2, 4), range(1, 4)):
        m = pp * k
        legacy = InterleavedSchedule(pp, vp, m, legacy_order=True)
        assert legacy.forward_table == InterleavedSchedule(pp, vp, m, pp).forward_table


def test_known_triggers_pp4_vp2():
    s = InterleavedSchedule(4, 2, 8)
    assert [s.trigger_vmid(r, 1) for r in range(4)] == [4, 3, 2, 1]
    assert [s.trigger_vmid(r, 0) for r in range(4)] == [AT_START] * 4


@pytest.mark.parametrize("kwargs,needle", [
    (dict(pp=1, vp=2, microbatches=4), "pipeline_model_parallel_size=1"),
    (dict(pp=2, vp=1, microbatches=4), "virtual_pipeline_model_parallel_size=1"),
    (dict(pp=4, vp=2, microbatches=3), "num_microbatches=3 < pipeline_model_parallel_size=4"),
    (dict(pp=2, vp=2, microbatches=4, group_size=5), "microbatch_group_size_per_vp_stage=5"),
    (dict(pp=4, vp=2, microbatches=8, group_size=3), "microbatch_group_size_per_vp_stage=3"),
    (dict(pp=2, vp=2, microbatches=5, group_size=2), "num_microbatches=5 mod"),
    (dict(pp=4, vp=2, microbatches=6, legacy_order=True), "not a multiple"),
])
def test_bad_shapes_raise_clear_errors(kwargs, needle):
    with pytest.raises(ScheduleError, match=needle.replace("(", r"\(")):
        InterleavedSchedule(**kwargs)


def test_rejects_exactly_what_megatron_core_rejects():
    """Our validation accepts a shape iff megatron-core's table exists and its checks pass."""
    for pp, m, n in itertools.product(range(2, 5), range(1, 12), range(1, 12)):
        megatron_ok = pp <= n <= m and not 0 < m % n < pp
        try:
            InterleavedSchedule(pp, 2, m, n)
            ours_ok = True
        except ScheduleError:
            ours_ok = False
        assert ours_ok == megatron_ok, (pp, m, n)


class _Reached(Exception):
    """Raised once megatron-core's schedule got past its shape validation."""


class _Probe(__import__("torch").nn.Module):
    """A model chunk that stops the schedule when it reads ``model_type`` after validation."""

    def __init__(self, config, early_reads):
        super().__init__()
        self.config = config
        self.early_reads = early_reads  # reads of model_type that precede the shape checks

    @property
    def model_type(self):
        from megatron.core.enums import ModelType

        if self.early_reads > 0:
            self.early_reads -= 1
            return ModelType.encoder_or_decoder
        raise _Reached()


def _megatron_accepts(monkeypatch, pp, m, n):
    """Run megatron-core's real interleaved schedule just far enough to see its verdict."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from lab.demo.cpu_redirects import enable_cpu_compat

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: pp)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda *a, **k: 2)
    group = {"microbatch_group_size_per_vp_stage": n} if n is not None else {}
    config = model_config(pp, 2, overlap_p2p_comm=False, batch_p2p_comm=False, **group)
    kwargs, early_reads = {}, 0
    if "pg_collection" in inspect.signature(
            schedules.forward_backward_pipelining_with_interleaving).parameters:
        # megatron-core >= 0.14 takes its process groups as arguments: hand it a PP group of
        # the size under test, so no process group has to exist.
        from megatron.core.process_groups_config import ProcessGroupCollection

        # A torch ProcessGroup of pp ranks cannot exist in one process: a stub of its size and
        # rank. P2PCommunicator's constructor asks torch.distributed for the neighbours' global
        # ranks, which a stub has not: a stub of the two attributes the schedule reads first.
        group = SimpleNamespace(size=lambda: pp, rank=lambda: 0)
        kwargs = dict(p2p_communicator=SimpleNamespace(pp_group=group, config=config),
                      pg_collection=ProcessGroupCollection(tp=group, cp=group, embd=None,
                                                           pos_embd=None, pp=group, dp_cp=group))
        early_reads = 2  # it reads the model type (hasattr + getattr) before the shape checks
    compat = enable_cpu_compat()
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[iter([]), iter([])],
            model=[_Probe(config, early_reads), _Probe(config, early_reads)], num_microbatches=m, seq_length=4,
            micro_batch_size=1, **kwargs)
    except _Reached:
        return True
    except (ValueError, RuntimeError) as err:
        if any(text in str(err) for text in ("micro-batch", "M (the total micro-batches)",
                                             "not divisible by pipeline-model-parallel-size")):
            return False
        raise
    finally:
        compat.undo()
    raise AssertionError("megatron-core's schedule neither validated nor rejected the shape")


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_validation_agrees_with_megatron_core_itself(monkeypatch, pp):
    if not has_group_size():
        # megatron-core < 0.10: no N; M must be a multiple of PP (the legacy order's rule).
        for m in range(1, 13):
            try:
                InterleavedSchedule(pp, 2, m, legacy_order=True)
                ours = True
            except ScheduleError:
                ours = False
            assert ours == _megatron_accepts(monkeypatch, pp, m, None), (pp, m)
        return
    for m, n in itertools.product(range(1, 10), range(1, 10)):
        try:
            InterleavedSchedule(pp, 2, m, n)
            ours = True
        except ScheduleError:
            ours = False
        assert ours == _megatron_accepts(monkeypatch, pp, m, n), (pp, m, n)


def test_schedule_for_picks_the_order_of_the_installed_config():
    """The installed megatron-core's own TransformerConfig decides the order: grouped by N from
    0.10 on, the legacy order (groups of PP, M a multiple of PP) before (make test runs this on
    0.7.0, 0.8.0 and 0.9.0 too)."""
    from nemo_fp8_align.assemble import schedule_for

    if not has_group_size():
        old = schedule_for(model_config(2, 2), pp=2, vp=2, num_microbatches=6)
        assert old.legacy_order and old.n == 2
        with pytest.raises(ScheduleError, match="not a multiple"):
            schedule_for(model_config(2, 2), pp=2, vp=2, num_microbatches=5)
        return
    new = schedule_for(model_config(2, 2, microbatch_group_size_per_vp_stage=3), pp=2, vp=2,
                       num_microbatches=6)
    assert new.n == 3 and not new.legacy_order
    assert schedule_for(model_config(2, 2), pp=2, vp=2, num_microbatches=6).n == 2  # None: PP
