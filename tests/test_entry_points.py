"""Attaching through each megatron-core entry point is all or nothing, and the documented
zero-argument forms work (issue 24): ``align_fp8_transposes``, ``megatron_lm.attach`` and
``megatron_lm.post_wrap_hook()`` on megatron-core's real ``DistributedDataParallel`` chunks in a
1-process gloo world.

The chunks and their one stand-in (PP=2 reported in a 1-process world): tests/support/ddp_chunks.py.
The multi-rank runs (faults stopping every rank, the aligned runs bit-identical to off) are
tests/test_no_hang.py, tests/test_engine_mcore.py, tests/test_megatron_lm_loop.py and
tests/test_bridge_callback.py.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_fp8_align import mcore_versions as mcore_version  # noqa: E402

if mcore_version.optimizer_owns_gather():
    pytest.skip(f"megatron-core {mcore_version.installed_version()}: DDP has no "
                "overlap_param_gather and the chunks no start_param_sync (what these attach to); "
                "the entry point there takes optimizer=, and its all-or-nothing attach is "
                "tests/test_mcore_optimizer_gather.py's", allow_module_level=True)

from nemo_fp8_align.config import AlignConfig  # noqa: E402
from nemo_fp8_align.core import aligner as claims  # noqa: E402
from nemo_fp8_align.class_patch import observe_method, patched_methods  # noqa: E402
from nemo_fp8_align.integrations import megatron_lm  # noqa: E402
from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes  # noqa: E402
from nemo_fp8_align.adapters.mcore_ddp import ForcedSyncWatch, McoreDDPAdapter  # noqa: E402
from support.attach_leftovers import leftovers, module_hooks  # noqa: E402
from support.ddp_chunks import ddp_chunks  # noqa: E402


@pytest.fixture
def model(monkeypatch):
    with ddp_chunks(monkeypatch) as built:
        yield built


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


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_the_documented_default_backend_gives_the_install_hint_and_leaves_nothing(model, entry):
    """The README's zero-argument forms (``post_wrap_hook()``) used to crash with
    AttributeError: 'TransformerConfig' object has no attribute 'use_triton_kernel'. Without
    Transformer Engine (this machine) the default backend is an ImportError with the hint."""
    chunks, config, _ = model
    bound, hooks = config.param_sync_func, module_hooks(chunks)
    with pytest.raises(ImportError, match="Transformer Engine is not importable"):
        ENTRIES[entry](chunks, config)
    assert leftovers(chunks, config, bound, hooks) == []


def _fail(*_a, **_k):
    raise OSError("injected failure")


def _fail_after_one(method):
    """``method`` running once, then failing."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            _fail()
        return method(*args, **kwargs)
    return wrapped


#: Attach stages, in order, each made to fail: (what, object, attribute).
STAGES = {
    "claim": lambda mp: mp.setattr(claims, "claim", _fail),
    "hold rebinding the bound list": lambda mp: mp.setattr(McoreDDPAdapter, "_rebind_bound_list",
                                                           _fail),
    "forced-sync watch": lambda mp: mp.setattr(McoreDDPAdapter, "_watch_forced_syncs", _fail),
    # Part-way: the watch wraps the first bucket group, then fails on the second (issue 40).
    "forced-sync watch, second bucket group": lambda mp: mp.setattr(
        ForcedSyncWatch, "_wrap", _fail_after_one(ForcedSyncWatch._wrap)),
    "forward hooks": lambda mp: mp.setattr(torch.nn.Module, "register_forward_hook", _fail),
    "build observer (telemetry)": lambda mp: mp.setattr(
        "nemo_fp8_align.core.observe.BuildObserver._started", property(_fail)),
    "metrics listener": lambda mp: mp.setattr(megatron_lm, "WriterMetrics", _fail),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_failing_attach_leaves_nothing_and_a_retry_attaches(model, entry, stage, tmp_path):
    chunks, config, backend = model
    bound, hooks = config.param_sync_func, module_hooks(chunks)
    kw = dict(backend=backend, weights_of=_weights,
              align_config=AlignConfig(telemetry_path=str(tmp_path / "t.jsonl")))
    with pytest.MonkeyPatch.context() as mp:
        STAGES[stage](mp)
        try:
            aligner = ENTRIES[entry](chunks, config, **kw)
        except OSError:
            aligner = None
    if aligner is not None:  # the stage is not on this entry point's way (e.g. no listener)
        assert stage in ("metrics listener", "forced-sync watch",
                         "forced-sync watch, second bucket group") and aligner.attached
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
