"""Two real megatron-core ``DistributedDataParallel`` chunks of the demo GPT (reference FP8
weights) in a 1-process gloo world: what the attach paths see (tests/test_entry_points.py,
tests/test_doc_snippets.py).

The pipeline rank and size are the one stand-in: a 1-process world has one pipeline rank, and
the interleaved schedule needs two, so ``resolve_ranks`` is made to report PP=2 (what it reads
from real groups is tests/test_groups.py)."""

import contextlib

import torch

from support.one_process import gloo_world

#: The microbatches per step the chunks' calculator is set up for.
MICROBATCHES = 2


@contextlib.contextmanager
def ddp_chunks(monkeypatch):
    """Yields ``(chunks, config, backend)``: the chunks with ``config.param_sync_func`` bound as
    megatron-core's ``overlap_param_gather`` + ``align_param_gather`` bind it."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_align.backends.reference import ReferenceBackend
    from lab.demo.model import DemoModelConfig, GPTChunk
    from nemo_fp8_align.adapters import groups

    real = groups.resolve_ranks
    monkeypatch.setattr(groups, "resolve_ranks", lambda *a, **k: groups.ParallelRanks(
        pp_rank=0, pp_size=2, dp_rank=0, dp_size=1, pp_group=None, pp_source="test",
        dp_source=real(*a, **k).dp_source))
    with gloo_world():
        parallel_state.initialize_model_parallel(1, 1)
        init_num_microbatches_calculator(0, None, MICROBATCHES, 1, 1)
        try:
            backend = ReferenceBackend()
            config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       params_dtype=torch.float32, use_cpu_initialization=True)
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                overlap_param_gather=True, overlap_grad_reduce=True,
                                                align_param_gather=True)
            chunks = [DistributedDataParallel(config, ddp, GPTChunk(
                DemoModelConfig(), config=config, stage=0, vp_stage=v, pre_process=v == 0,
                post_process=v == 1, backend=backend)) for v in range(2)]
            config.param_sync_func = [c.start_param_sync for c in chunks]
            config.microbatch_group_size_per_vp_stage = 2  # N = PP of the stand-in pipeline
            yield chunks, config, backend
        finally:
            destroy_num_microbatches_calculator()
