"""Where the aligner's pipeline / data-parallel rank and size come from (adapters/groups.py):
an explicit ``pg_collection``, else the DDP chunks' own groups, else ``parallel_state``.

Unit tests on megatron-core's real ProcessGroupCollection and DistributedDataParallel in a
1-process gloo group; then 4 gloo processes whose model runs PP=4 with explicit groups while
``parallel_state`` says PP=2 (tests/support/explicit_groups.py).
"""

import inspect

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel,  # noqa: E402
                                       DistributedDataParallelConfig)
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.adapters.groups import pipeline_group, resolve_ranks  # noqa: E402
from support.one_process import gloo_world  # noqa: E402

try:
    from megatron.core.process_groups_config import ProcessGroupCollection
except ImportError:  # megatron-core < 0.14
    ProcessGroupCollection = None

EXPLICIT = ProcessGroupCollection is not None and \
    "pg_collection" in inspect.signature(DistributedDataParallel.__init__).parameters
needs_explicit = pytest.mark.skipif(
    not EXPLICIT, reason="megatron-core < 0.14: DDP and the schedules take no pg_collection")


@pytest.fixture
def one_rank():
    """A 1-process gloo world with the CPU shims; parallel_state left uninitialised."""
    with gloo_world():
        yield


def _collection(**names):
    return ProcessGroupCollection(**{k: dist.new_group([0]) for k in names})


def _ddp(pg_collection=None):
    from nemo_fp8_align.backends.reference import ReferenceBackend
    from lab.demo.model import DemoModelConfig, GPTChunk

    backend = ReferenceBackend()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               params_dtype=torch.float32, use_cpu_initialization=True)
    module = GPTChunk(DemoModelConfig(), config=config, stage=0, vp_stage=0, pre_process=True,
                      post_process=True, backend=backend)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
        align_param_gather=True)
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    return config, DistributedDataParallel(config, ddp_config, module, **kwargs), backend


@needs_explicit
def test_an_explicit_pg_collection_is_used_without_parallel_state(one_rank):
    pgc = _collection(pp=1, dp=1, dp_cp=1)
    assert not parallel_state.model_parallel_is_initialized()
    ranks = resolve_ranks([], pgc)
    assert (ranks.pp_group, ranks.pp_source, ranks.dp_source) == (
        pgc.pp, "pg_collection.pp", "pg_collection.dp")
    assert (ranks.pp_rank, ranks.pp_size, ranks.dp_rank, ranks.dp_size) == (0, 1, 0, 1)
    assert resolve_ranks([], pgc, with_context_parallel=True).dp_source == "pg_collection.dp_cp"
    assert pipeline_group([], pgc) is pgc.pp


@needs_explicit
def test_the_ddp_chunks_groups_are_used_and_absent_fields_fall_through(one_rank):
    built = _collection(pp=1, tp=1, ep=1, dp=1, dp_cp=1, expt_dp=1)
    _, chunk, _ = _ddp(built)
    assert chunk.pp_group is built.pp
    ranks = resolve_ranks([chunk], with_context_parallel=True)
    assert (ranks.pp_group, ranks.pp_source, ranks.dp_source) == (
        built.pp, "model[0].pp_group", "model[0].dp_cp_group")
    # A collection without pp (megatron-core's fields are optional): pp from the chunk.
    partial = _collection(dp=1)
    ranks = resolve_ranks([chunk], partial)
    assert (ranks.pp_source, ranks.dp_source) == ("model[0].pp_group", "pg_collection.dp")
    assert resolve_ranks([chunk.module], built).pp_source == "pg_collection.pp"


def test_without_explicit_groups_parallel_state_is_used(one_rank):
    parallel_state.initialize_model_parallel()
    _, chunk, _ = _ddp()
    ranks = resolve_ranks([chunk], with_context_parallel=True)
    assert ranks.pp_group is parallel_state.get_pipeline_model_parallel_group()
    # megatron-core >= 0.14's DDP keeps parallel_state's groups; older DDP keeps none.
    assert ranks.pp_source == ("model[0].pp_group" if EXPLICIT else "parallel_state")
    assert (ranks.pp_rank, ranks.pp_size, ranks.dp_rank, ranks.dp_size) == (0, 1, 0, 1)


@needs_explicit
def test_four_ranks_get_the_models_pipeline_not_parallel_states(tmp_path):
    """parallel_state: PP=2 x DP=2; the model, DDP, optimizer and schedule: PP=4 (explicit).
    The aligner attached without pg_collection finds the chunks' groups: records of pipeline
    rank 0..3 of 4, every chunk's transposes at its aligned slot, both steps run; explicit
    groups that disagree are refused; align_fp8_transposes(pg_collection=) takes the same."""
    from support.explicit_groups import GLOBAL_PP, M, MODEL_PP, STEPS, VP, run_all

    from nemo_fp8_align.core.schedule import InterleavedSchedule

    results = run_all(str(tmp_path))
    schedule = InterleavedSchedule(MODEL_PP, VP, M)
    assert [r["model_pp_rank"] for r in results] == [0, 1, 2, 3]
    # What the old code read: parallel_state's pipeline (ranks 0, 0, 1, 1 of 2).
    assert [(r["global_pp_rank"], r["global_pp_size"]) for r in results] == \
        [(0, GLOBAL_PP), (0, GLOBAL_PP), (1, GLOBAL_PP), (1, GLOBAL_PP)]
    for r in results:
        rank = r["model_pp_rank"]
        assert (r["aligner_pp_rank"], r["aligner_pp_size"]) == (rank, MODEL_PP), r
        recs = r["records"]
        assert sorted((x["step"], x["chunk"]) for x in recs) == \
            [(s, c) for s in range(STEPS) for c in range(VP)], recs
        for x in recs:
            assert x["pp_rank"] == rank and x["slot"] == x["aligned_slot"] == \
                schedule.aligned_slot(x["chunk"]), x
            if x["chunk"] > 0:  # chunk 0 is built at the step start (vmid -1)
                assert x["vmid"] == schedule.trigger_vmid(rank, x["chunk"]), x
            assert x["transposed"] > 0, x
        assert "model[0].pp_group has ranks [0, 1, 2, 3] but pg_collection.pp has ranks " \
            in r["disagree_pg"], r["disagree_pg"]
        assert "model[1].pp_group has ranks " in r["disagree_chunks"] and \
            "but model[0].pp_group has ranks [0, 1, 2, 3]" in r["disagree_chunks"], r
        assert (r["kw_pp_rank"], r["kw_pp_size"]) == (rank, MODEL_PP), r
        assert "Fix: build every model chunk with the same pg_collection" in r["disagree_pg"]
