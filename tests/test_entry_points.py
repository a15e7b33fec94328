"""Attaching through each megatron-core entry point is all or nothing, and the documented
zero-argument forms work (issue 24): ``align_fp8_transposes``, ``megatron_lm.attach`` and
``megatron_lm.post_wrap_hook()`` on megatron-core's real ``DistributedDataParallel`` chunks in a
1-process gloo world.

The pipeline rank and size are the one stand-in: a 1-process world has one pipeline rank, and
the interleaved schedule needs two, so ``resolve_ranks`` is made to report PP=2 (what it reads
from real groups is tests/test_groups.py). The multi-rank runs (faults stopping every rank, the
aligned runs bit-identical to off) are tests/test_no_hang.py, tests/test_engine_mcore.py,
tests/test_megatron_lm_loop.py and tests/test_bridge_callback.py.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel,  # noqa: E402
                                       DistributedDataParallelConfig)
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.config import AlignConfig  # noqa: E402
from nemo_fp8_align.core import claims  # noqa: E402
from nemo_fp8_align.core.class_patch import observe_method, patched_methods  # noqa: E402
from nemo_fp8_align.integrations import groups, megatron_lm  # noqa: E402
from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes  # noqa: E402
from nemo_fp8_align.sync.mcore_hold import McoreChunkHold  # noqa: E402
from support.one_process import gloo_world  # noqa: E402


@pytest.fixture
def model(monkeypatch):
    """Two real DDP chunks of the demo GPT (reference FP8 weights), their config with the
    schedule's launch list bound, in a 1-process gloo world."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    from nemo_fp8_align.backends.reference import ReferenceBackend
    from nemo_fp8_align.demo.model import DemoModelConfig, GPTChunk

    real = groups.resolve_ranks
    monkeypatch.setattr(groups, "resolve_ranks", lambda *a, **k: groups.ParallelRanks(
        pp_rank=0, pp_size=2, dp_rank=0, dp_size=1, pp_group=None, pp_source="test",
        dp_source=real(*a, **k).dp_source))
    with gloo_world():
        parallel_state.initialize_model_parallel(1, 1)
        init_num_microbatches_calculator(0, None, 2, 1, 1)
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


def _weights(chunk):
    return chunk.module.fp8_weights()


ENTRIES = {
    "align_fp8_transposes": lambda chunks, config, **kw: align_fp8_transposes(
        chunks, num_microbatches=2, config=config, **kw),
    "megatron_lm.attach": lambda chunks, config, **kw: megatron_lm.attach(chunks, args=None,
                                                                          **kw),
    "megatron_lm.post_wrap_hook": lambda chunks, config, **kw: (
        lambda hook: (hook(chunks), hook.aligners[0])[1])(megatron_lm.post_wrap_hook(args=None,
                                                                                     **kw)),
}


def _hooks(chunks):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks))
            for chunk in chunks for m in (chunk, chunk.module)]


def leftovers(chunks, config, bound, hooks):
    """Everything an attach may install, still there (``hooks``: the counts before it; DDP has
    forward pre-hooks of its own)."""
    found = [] if _hooks(chunks) == hooks else [f"hooks {_hooks(chunks)}, were {hooks}"]
    for c, chunk in enumerate(chunks):
        found += [f"chunk {c}.{n}" for n in ("start_param_sync", "finish_grad_sync")
                  if n in vars(chunk)]
        if claims.holder_of(chunk) is not None:
            found.append(f"claim on chunk {c}")
        found += [f"chunk {c} bucket group wrapped" for g in chunk.bucket_groups
                  if "start_param_sync" in vars(g)]
    if config.param_sync_func is not bound:
        found.append("config.param_sync_func replaced")
    found += [f"class patch {k}" for k in patched_methods()]
    return found


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_the_documented_default_backend_gives_the_install_hint_and_leaves_nothing(model, entry):
    """The README's zero-argument forms (``post_wrap_hook()``) used to crash with
    AttributeError: 'TransformerConfig' object has no attribute 'use_triton_kernel'. Without
    Transformer Engine (this machine) the default backend is an ImportError with the hint."""
    chunks, config, _ = model
    bound, hooks = config.param_sync_func, _hooks(chunks)
    with pytest.raises(ImportError, match="Transformer Engine is not importable"):
        ENTRIES[entry](chunks, config)
    assert leftovers(chunks, config, bound, hooks) == []


def _fail(*_a, **_k):
    raise OSError("injected failure")


#: Attach stages, in order, each made to fail: (what, object, attribute).
STAGES = {
    "claim": lambda mp: mp.setattr(claims, "claim", _fail),
    "hold rebinding the bound list": lambda mp: mp.setattr(McoreChunkHold, "_rebind_bound_list",
                                                           _fail),
    "forced-sync watch": lambda mp: mp.setattr("nemo_fp8_align.sync.forced_sync."
                                               "watch_forced_syncs", _fail),
    "forward hooks": lambda mp: mp.setattr(torch.nn.Module, "register_forward_hook", _fail),
    "build observer (telemetry)": lambda mp: mp.setattr(
        "nemo_fp8_align.core.observe.BuildObserver._started", property(_fail)),
    "metrics listener": lambda mp: mp.setattr(megatron_lm, "WriterMetrics", _fail),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_failing_attach_leaves_nothing_and_a_retry_attaches(model, entry, stage, tmp_path):
    chunks, config, backend = model
    bound, hooks = config.param_sync_func, _hooks(chunks)
    kw = dict(backend=backend, weights_of=_weights,
              align_config=AlignConfig(telemetry_path=str(tmp_path / "t.jsonl")))
    with pytest.MonkeyPatch.context() as mp:
        STAGES[stage](mp)
        try:
            aligner = ENTRIES[entry](chunks, config, **kw)
        except OSError:
            aligner = None
    if aligner is not None:  # the stage is not on this entry point's way (e.g. no listener)
        assert stage in ("metrics listener", "forced-sync watch") and aligner.attached
        aligner.detach()
    assert leftovers(chunks, config, bound, hooks) == []
    aligner = ENTRIES[entry](chunks, config, **kw)  # nothing refuses a second try
    assert aligner.attached and config.param_sync_func is not bound  # the wrappers are bound
    aligner.detach()
    assert leftovers(chunks, config, bound, hooks) == []


def test_class_patches_detach_in_any_order():
    """Two observers of one class method detached oldest first: the method is the original
    again and neither observer is called any more (a stack of wrappers leaked the first)."""
    class Built:
        def build(self, x):
            return x + 1

    original = Built.__dict__["build"]
    seen = []
    first = observe_method(Built, "build", lambda *a: seen.append("first"))
    second = observe_method(Built, "build", lambda *a: seen.append("second"))
    assert Built().build(1) == 2 and seen == ["first", "second"]
    first.remove()
    assert Built().build(1) == 2 and seen == ["first", "second", "second"]
    second.remove()
    assert Built.__dict__["build"] is original and patched_methods() == {}
    Built().build(1)
    assert seen == ["first", "second", "second"]
