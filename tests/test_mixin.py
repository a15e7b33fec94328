"""FP8TransposeAlignMixin on NeMo 2.3.3's real MegatronGPTModel class.

Real: the class hierarchy (MRO, super() chain), the startup check at construction (before
MegatronGPTModel.__init__ builds anything), the launch notifications around NeMo's
fwd_bwd_step / sync_overlap_parameters (NeMo's own methods replaced by recorders), and
megatron-core 0.12.3's shared-embedding bucket bug with real DDP buffers in a subprocess.
End-to-end training is tests/test_smoke_nemo.py.
"""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.nemo

gpt = pytest.importorskip(
    "nemo.collections.nlp.models.language_modeling.megatron_gpt_model",
    reason="needs nemo_toolkit 2.3.3 (MegatronGPTModel)")
MegatronGPTModel = gpt.MegatronGPTModel

from nemo_fp8_align.config import AlignConfig  # noqa: E402
from nemo_fp8_align.config_check.check import FP8AlignConfigError  # noqa: E402
from nemo_fp8_align.integrations.nemo.build import startup_check  # noqa: E402
from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin, FP8Weights  # noqa: E402
from nemo_fp8_align.integrations.nemo import session as session_module  # noqa: E402
from nemo_fp8_align.integrations.nemo.session import NeMoSession  # noqa: E402
from nemo_fp8_align.adapters.apex import ApexAdapter  # noqa: E402
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter  # noqa: E402
from support.standins.apex_dfa import StandInDistributedFusedAdam  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "conf", "megatron_gpt_cpu_smoke.yaml")


class AlignedGPT(FP8TransposeAlignMixin, MegatronGPTModel):
    pass


class ReferenceGPT(AlignedGPT):
    fp8_align_weights = FP8Weights.REFERENCE


CPU = os.path.join(ROOT, "conf", "megatron_gpt_cpu.yaml")


def smoke_cfg():
    """conf/megatron_gpt_cpu_smoke.yaml as Hydra composes it (on conf/megatron_gpt_cpu.yaml)."""
    smoke = OmegaConf.load(SMOKE)
    smoke.pop("defaults")
    return OmegaConf.merge(OmegaConf.load(CPU), smoke)


def trainer(world_size=2, global_step=0):
    """Lightning's real Trainer over world_size CPU processes (none is started before fit)."""
    from lightning.pytorch import Trainer

    real = Trainer(accelerator="cpu", devices=world_size,
                   strategy="ddp" if world_size > 1 else "auto", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1)
    set_global_step(real, global_step)
    return real


def set_global_step(real_trainer, step):
    """The optimizer steps Trainer.global_step reports (a read-only property) without a model."""
    loop = real_trainer.fit_loop.epoch_loop.automatic_optimization
    loop.optim_progress.optimizer.step.total.completed = step
    assert real_trainer.global_step == step


def test_mixin_comes_first_and_chains_to_nemo():
    mro = AlignedGPT.__mro__
    assert mro.index(FP8TransposeAlignMixin) < mro.index(MegatronGPTModel)
    for name in ("fwd_bwd_step", "sync_overlap_parameters", "setup_mcore_distributed_parallel",
                 "on_train_start", "on_train_end", "teardown"):
        assert getattr(AlignedGPT, name) is getattr(FP8TransposeAlignMixin, name), name
        assert hasattr(super(FP8TransposeAlignMixin, AlignedGPT), name), name


def test_check_raises_before_megatron_gpt_model_builds_anything(monkeypatch):
    built = []
    monkeypatch.setattr(MegatronGPTModel, "__init__", lambda self, *a, **k: built.append(1))
    cfg = smoke_cfg()
    cfg.model.optim.align_param_gather = False
    cfg.model.virtual_pipeline_model_parallel_size = 1
    with pytest.raises(FP8AlignConfigError) as err:
        AlignedGPT(cfg.model, trainer())
    assert built == []
    keys = {v.key for v in err.value.violations}
    # Every violation at once, TE ones included for TE weights.
    assert {"model.optim.align_param_gather", "model.virtual_pipeline_model_parallel_size",
            "model.fp8_params", "model.transformer_engine"} <= keys


def test_reference_weights_do_not_require_te_keys_but_everything_else(monkeypatch):
    built = []
    monkeypatch.setattr(MegatronGPTModel, "__init__", lambda self, *a, **k: built.append(1))
    cfg = smoke_cfg()
    model = ReferenceGPT(cfg.model, trainer())  # the smoke config passes the check
    assert built == [1]
    assert model.fp8_align_config.active
    cfg.model.optim.overlap_param_sync = False
    with pytest.raises(FP8AlignConfigError) as err:
        ReferenceGPT(cfg.model, trainer())
    assert [v.key for v in err.value.violations] == ["model.optim.overlap_param_sync"]


def test_microbatch_rule_uses_the_trainer_world_size():
    cfg = smoke_cfg()
    startup_check(cfg.model, trainer(4), weights=FP8Weights.REFERENCE)  # DP=2: M=4 fits
    with pytest.raises(FP8AlignConfigError, match="global_batch_size"):
        startup_check(cfg.model, trainer(16), weights=FP8Weights.REFERENCE)  # DP=8: M=1 < PP


def test_disabled_plugin_checks_nothing(monkeypatch):
    monkeypatch.setattr(MegatronGPTModel, "__init__", lambda self, *a, **k: None)
    cfg = smoke_cfg()
    cfg.model.fp8_transpose_align.enabled = False
    cfg.model.optim.name = "fused_adam"
    assert not AlignedGPT(cfg.model, trainer()).fp8_align_config.active


def test_a_block_value_align_config_rejects_hides_no_other_violation(monkeypatch):
    monkeypatch.setattr(MegatronGPTModel, "__init__", lambda self, *a, **k: None)
    cfg = smoke_cfg()
    cfg.model.fp8_transpose_align.verify_every_n_steps = -1  # AlignConfig raises ValueError
    cfg.model.optim.overlap_param_sync = False
    with pytest.raises(FP8AlignConfigError) as err:
        ReferenceGPT(cfg.model, trainer())
    assert [v.key for v in err.value.violations] == [
        "model.fp8_transpose_align.verify_every_n_steps", "model.optim.overlap_param_sync"]


# ---------------------------------------------------------------------------------------------
# megatron-core DDP setup: the shared-embedding bucket workaround only with the plugin active


def spilling_ddp(param):
    """A DDP chunk whose gradient buffer puts ``param`` past its bucket's end (the 0.12.3 bug).

    A stand-in: a real DistributedDataParallel needs a process group and a model laid out to
    hit the bug; test_megatron_core_0123_shared_embedding_bucket_bug_and_workaround does that
    in a subprocess."""
    buffer = SimpleNamespace(bucket_indices=[(0, 10)], param_index_map={param: (5, 20, 0)})
    return SimpleNamespace(buffers=[buffer])


@pytest.mark.parametrize("enabled", [True, False], ids=["active", "off"])
def test_ddp_setup_workaround_only_when_the_plugin_is_active(monkeypatch, enabled):
    from megatron.core import parallel_state

    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.errors import SharedEmbeddingBucketError

    seen = []

    def nemo_setup(self):  # what NeMo's does: build DDP around self.model
        seen.append([p.shared_embedding for p in shared])
        self.model = [spilling_ddp(shared[0]) if dp == 2 else SimpleNamespace(buffers=[])]  # as ^

    monkeypatch.setattr(MegatronGPTModel, "setup_mcore_distributed_parallel", nemo_setup)
    for dp in (1, 2):
        monkeypatch.setattr(parallel_state, "get_data_parallel_world_size",
                            lambda with_context_parallel=False, dp=dp: dp)
        model = bare_model(use_mcore=True)
        model.fp8_align_session.config = AlignConfig(enabled=enabled)
        shared = [next(iter(model.model[0].parameters()))]
        shared[0].shared_embedding = True
        if enabled and dp == 2:
            with pytest.raises(SharedEmbeddingBucketError):
                model.setup_mcore_distributed_parallel()
        else:
            model.setup_mcore_distributed_parallel()  # off: NeMo's spill is NeMo's own
        assert shared[0].shared_embedding is True  # restored / never touched
    # DP=1: NeMo builds its buffers with the flag hidden only while the plugin is active.
    assert seen == [[not enabled], [True]]


# ---------------------------------------------------------------------------------------------
# launch notifications around NeMo's fwd_bwd_step


class FakeAligner:
    attached = True
    weights, backend = [[], []], None  # what the session reads

    def __init__(self):
        self.launched, self.steps, self.step_ends = [], [], 0

    def set_next_step(self, step):
        self.steps.append(step)

    def on_step_end(self):
        self.step_ends += 1

    def on_param_sync_launched(self, chunk):
        self.launched.append(chunk)

    def param_sync_wrapper(self, chunk, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.on_param_sync_launched(chunk)
            return out
        return wrapped


class FakeDDPChunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.started = 0
        self.bucket_groups = []  # what megatron-core's adapter checks for (no buckets here)

    def start_param_sync(self, *unused, force_sync=False):
        self.started += 1

    def finish_grad_sync(self):
        self.grad_synced = getattr(self, "grad_synced", 0) + 1


class FinishedMcore(McoreDDPAdapter):
    """megatron-core's adapter (its launch wrappers: the real code) whose chunks' all-gathers
    are complete when asked."""

    def finish(self, chunk):
        return True

    def finished(self, chunk):
        return True


class FinishedApex(ApexAdapter):
    """Apex's adapter (its launch reports: the real code) whose chunks' all-gathers are
    complete when asked."""

    def finish(self, chunk):
        return True

    def finished(self, chunk):
        return True


def fake_adapter(model):
    """The adapter NeMo's path picks (build_aligner, assemble.pick_adapter) over the fake chunks:
    megatron-core's (its step end: chunk 0's finish_grad_sync, which NeMo's finalize_model_grads
    calls), or Apex's over the stand-in of its optimizer (the session closes the step)."""
    if model.use_mcore_dist_optim:
        return FinishedMcore(model.model, None, owns_step_end=True)
    optimizer = StandInDistributedFusedAdam([list(c.parameters()) for c in model.model])
    return FinishedApex(optimizer, model.model)


def bare_model(use_mcore):
    model = AlignedGPT.__new__(AlignedGPT)
    torch.nn.Module.__init__(model)
    model.use_mcore_dist_optim = use_mcore
    model.model = [FakeDDPChunk(), FakeDDPChunk()]
    # The session attach() would give it: the aligner, each chunk's first parameter.
    model._fp8_align_session = NeMoSession(model, AlignConfig(), weights=FP8Weights.REFERENCE)
    aligner = model.fp8_align_session.aligner = FakeAligner()
    hold = aligner.adapter = fake_adapter(model)
    hold.install(aligner.on_param_sync_launched, aligner.on_step_end)  # as aligner.attach does
    aligner.detach = lambda agree=False: hold.restore()
    model._fabric, model._jit_is_scripting = None, False
    model._trainer = trainer(1, global_step=7)
    return model


def nemo_like_fwd_bwd_step(self, dataloader_iter, forward_only, first_val_step=None):
    # What NeMo 2.3.3 does: bind param_sync_func, then the schedule's pre-loop calls.
    if self.use_mcore_dist_optim:
        funcs = None if forward_only else [c.start_param_sync for c in self.model]
    else:
        funcs = None if forward_only else [self.sync_overlap_parameters] * len(self.model)
    if funcs is not None:
        funcs[0](self.model[0].parameters())
        funcs[1](self.model[1].parameters())
        if self.use_mcore_dist_optim:  # a keyword-only caller is not a schedule launch
            self.model[0].start_param_sync(force_sync=True)
            for chunk in self.model:  # megatron-core's finalize_model_grads, NeMo's mcore path
                chunk.finish_grad_sync()
    return "loss"


@pytest.mark.parametrize("use_mcore", [True, False], ids=["mcore", "apex"])
def test_training_step_launches_reach_the_aligner_and_nothing_is_left_behind(
        monkeypatch, use_mcore):
    monkeypatch.setattr(MegatronGPTModel, "fwd_bwd_step", nemo_like_fwd_bwd_step)
    synced = []
    monkeypatch.setattr(MegatronGPTModel, "sync_overlap_parameters",
                        lambda self, params=None: synced.append(list(params)))
    model = bare_model(use_mcore)
    assert model.fwd_bwd_step(iter([]), forward_only=False) == "loss"
    assert model.fp8_aligner.launched == [0, 1]
    # Numbered by the trainer's global_step (resume-proof), and closed once: by megatron-core's
    # finalize_model_grads inside fwd_bwd (mcore), or when fwd_bwd returns (Apex).
    assert model.fp8_aligner.steps == [7] and model.fp8_aligner.step_ends == 1
    if use_mcore:
        assert [c.started for c in model.model] == [2, 1]
        model.fp8_align_detach()
        assert all("start_param_sync" not in c.__dict__ for c in model.model)
    else:
        assert [len(p) for p in synced] == [2, 2]  # NeMo still got every parameter
    assert not model.fp8_align_session.in_training_step


@pytest.mark.parametrize("use_mcore", [True, False], ids=["mcore", "apex"])
def test_forward_only_passes_notify_nothing(monkeypatch, use_mcore):
    monkeypatch.setattr(MegatronGPTModel, "fwd_bwd_step", nemo_like_fwd_bwd_step)
    monkeypatch.setattr(MegatronGPTModel, "sync_overlap_parameters", lambda self, params=None: None)
    model = bare_model(use_mcore)
    model.fwd_bwd_step(iter([]), forward_only=True)
    model.sync_overlap_parameters(model.model[0].parameters())  # outside a training step
    assert model.fp8_aligner.launched == []


def test_detach_is_idempotent():
    model = bare_model(True)
    detached = []
    hold = model._fp8_align_session.aligner.adapter
    model.fp8_aligner.detach = lambda agree=False: (detached.append(1), hold.restore())
    model.fp8_align_detach()
    model.fp8_align_detach()
    assert detached == [1] and model.fp8_aligner is None


# ---------------------------------------------------------------------------------------------
# megatron-core 0.12.3 shared-embedding bucket bug (real DDP buffers, own process group)

BUCKET_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from lab.demo.cpu_redirects import enable_cpu_compat
    enable_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from nemo_fp8_align.integrations.nemo.bucket_workaround import (
        SharedEmbeddingBucketError, check_buckets, shared_embedding_bucket_workaround)

    def build(workaround):
        torch.manual_seed(0)
        module = torch.nn.Module()
        module.embedding = torch.nn.Parameter(torch.randn(256, 32))  # first: bucketed last
        module.embedding.shared_embedding = True
        module.norm = torch.nn.Parameter(torch.ones(32))  # 32 values: offset 64, not 128
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                   overlap_param_gather=True)
        with shared_embedding_bucket_workaround([module], data_parallel_size=1) \\
                if workaround else open(os.devnull):
            ddp = DistributedDataParallel(config, ddp_config, module)
        return ddp

    ddp = build(workaround=False)
    try:
        check_buckets([ddp])
        print("NO-BUG")
    except SharedEmbeddingBucketError:
        print("BUG-DETECTED")
    try:
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
        print("OPTIMIZER-OK")
    except AssertionError as err:
        print("OPTIMIZER-ASSERT", "param_gbuf_map" in str(err))
    ddp = build(workaround=True)
    check_buckets([ddp])
    assert ddp.module.embedding.shared_embedding is True  # restored after construction
    get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    print("WORKAROUND-OK")
""")


@pytest.mark.slow
def test_megatron_core_0123_shared_embedding_bucket_bug_and_workaround():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = str(29500 + os.getpid() % 1000)
    out = subprocess.run([sys.executable, "-c", BUCKET_SCRIPT, port], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.split()
    assert "BUG-DETECTED" in lines
    assert "OPTIMIZER-ASSERT" in lines
    assert "WORKAROUND-OK" in lines


def test_nemo_cpu_patches_refuse_on_a_gpu_machine(monkeypatch):
    from support import cpu_nemo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_nemo, "_ACTIVE", None)
    with pytest.raises(RuntimeError, match="refuses to run on a machine with a GPU"):
        cpu_nemo.enable_nemo_cpu_compat()


def fake_te_api(float8_cls):
    from types import SimpleNamespace

    # Transformer Engine's API surface: TE does not import without CUDA.
    return SimpleNamespace(__version__="2.20.2", Float8Tensor=float8_cls,
                           is_non_tn_fp8_gemm_supported=lambda: False,
                           post_all_gather_processing=lambda weights: None, MXFP8Tensor=None,
                           Float8BlockwiseQTensor=None, NVFP4Tensor=None)


def test_te_weights_are_the_float8_parameters_of_each_chunk(monkeypatch):
    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.backends import te as te_backend
    from nemo_fp8_align.integrations.nemo import build

    class Float8Tensor(torch.nn.Parameter):  # stands in for TE's class
        pass

    monkeypatch.setattr(te_backend, "load_te_api", lambda: fake_te_api(Float8Tensor))
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    chunks[1].weight = Float8Tensor(torch.zeros(2, 2))
    backend, weights_of = build._backend_and_weights_of(AlignConfig(), FP8Weights.TE)
    assert backend.name == "te-2.20"
    assert [weights_of(c) for c in chunks] == [[], [chunks[1].weight]]


def test_te_weights_without_te_say_how_to_fix(monkeypatch):
    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.backends import te as te_backend
    from nemo_fp8_align.integrations.nemo import build

    def no_te():
        raise ImportError("Transformer Engine is not importable here.")

    monkeypatch.setattr(te_backend, "load_te_api", no_te)
    with pytest.raises(RuntimeError, match="fp8_transpose_align.enabled=False"):
        build._backend_and_weights_of(AlignConfig(), FP8Weights.TE)


def test_mixin_logs_each_step_once_with_the_gathered_metrics(monkeypatch):
    from nemo_fp8_align.core.telemetry import TransposeRecord

    monkeypatch.setattr(MegatronGPTModel, "on_train_batch_end", lambda self, *a, **k: None)
    logged = []
    monkeypatch.setattr(AlignedGPT, "log_dict",
                        lambda self, metrics, **kw: logged.append((metrics, kw)), raising=False)
    model = bare_model(use_mcore=True)

    def rec(step, chunk, slot):
        return TransposeRecord(step=step, pp_rank=0, dp_rank=0, chunk=chunk, policy="lazy",
                               backend="fake", vmid=slot, slot=slot, aligned_slot=slot,
                               transposed=3, weights=3, after_all_gather=True, seconds=None,
                               t_slot=1.0 + chunk, t_done=1.5 + chunk)

    model.fp8_aligner.records = [rec(0, 0, 0), rec(0, 1, 2)]
    model.on_train_batch_end(None, None, 0)
    model.on_train_batch_end(None, None, 0)  # no new step: nothing logged again
    (metrics, kwargs), = logged
    assert metrics["fp8_align/transposes_built"] == 6.0 and metrics["fp8_align/records"] == 2.0
    assert metrics["fp8_align/chunk1/slot_to_valid_ms"] == 500.0
    assert "fp8_align/chunk1/wait_ms" not in metrics  # lazy: the wait is not observed
    assert kwargs["rank_zero_only"] and kwargs["on_step"] and not kwargs["on_epoch"]


def test_exception_inside_a_training_step_detaches(monkeypatch):
    def failing_fwd_bwd_step(self, dataloader_iter, forward_only, first_val_step=None):
        [c.start_param_sync for c in self.model][0](self.model[0].parameters())
        raise ValueError("boom")

    monkeypatch.setattr(MegatronGPTModel, "fwd_bwd_step", failing_fwd_bwd_step)
    model = bare_model(use_mcore=True)
    detached = []
    hold = model._fp8_align_session.aligner.adapter
    model.fp8_aligner.detach = lambda agree=False: (detached.append(1), hold.restore())
    with pytest.raises(ValueError, match="boom"):
        model.fwd_bwd_step(iter([]), forward_only=False)
    assert detached == [1] and model.fp8_aligner is None
    assert all("start_param_sync" not in c.__dict__ for c in model.model)


# ---------------------------------------------------------------------------------------------
# one wiring with the callback (integrations/nemo/session.py): error paths, log_every_n_steps


def real_aligner(model):
    from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight
    from nemo_fp8_align.core.aligner import TransposeAligner
    from nemo_fp8_align.core.schedule import InterleavedSchedule

    chunks = model.model
    weights = [[ReferenceFP8Weight(chunk.lin.weight, name=f"chunk{c}")]
               for c, chunk in enumerate(chunks)]
    return TransposeAligner(chunks, schedule=InterleavedSchedule(2, 2, 4), pp_rank=0, dp_rank=0,
                            adapter=fake_adapter(model), weights=weights,
                            backend=ReferenceBackend(use_triton_kernel=False),
                            config=AlignConfig())


def attached_model(monkeypatch, use_mcore):
    """bare_model with a real aligner attached through the mixin's own attach."""
    from nemo_fp8_align.core import aligner as claims
    from nemo_fp8_align.integrations.nemo import session as session_module

    model = bare_model(use_mcore)
    model.fp8_align_session.aligner.adapter.restore()  # bare_model's, for the fake aligner
    model.fp8_align_session.aligner = None
    aligner = real_aligner(model)
    # What build_aligner returns: the aligner attached (assemble attaches it).
    monkeypatch.setattr(session_module, "build_aligner",
                        lambda m, config, **kw: (aligner.attach(), aligner)[1])
    assert model.fp8_align_attach()
    assert all(claims.holder_of(c) is aligner and c._forward_pre_hooks for c in model.model)
    return model


def assert_nothing_left(model):
    from nemo_fp8_align.core import aligner as claims

    assert model.fp8_aligner is None
    for chunk in model.model:
        assert claims.holder_of(chunk) is None
        assert not chunk._forward_pre_hooks and not chunk._forward_hooks
        assert "start_param_sync" not in chunk.__dict__  # NeMo's launch function again
    assert "sync_overlap_parameters" not in model.__dict__


@pytest.mark.parametrize("use_mcore", [True, False], ids=["mcore", "apex"])
def test_an_error_raised_by_the_step_close_leaves_no_hook_and_no_claim(monkeypatch, use_mcore):
    from nemo_fp8_align.errors import StepMismatchError

    # Both pre-loop launches, then no forward at all: on_step_end raises (ran 0 of 8 forwards).
    monkeypatch.setattr(MegatronGPTModel, "fwd_bwd_step", nemo_like_fwd_bwd_step)
    monkeypatch.setattr(MegatronGPTModel, "sync_overlap_parameters", lambda self, params=None: None)
    model = attached_model(monkeypatch, use_mcore)
    with pytest.raises(StepMismatchError, match="ran 0 forwards"):
        model.fwd_bwd_step(iter([]), forward_only=False)
    assert_nothing_left(model)  # Lightning runs no teardown of the model after an exception


def test_an_error_in_nemos_batch_end_leaves_no_hook_and_no_claim(monkeypatch):
    def failing_batch_end(self, *args, **kwargs):
        raise RuntimeError("NeMo's on_train_batch_end failed")

    monkeypatch.setattr(MegatronGPTModel, "on_train_batch_end", failing_batch_end)
    model = attached_model(monkeypatch, use_mcore=True)
    with pytest.raises(RuntimeError, match="on_train_batch_end failed"):
        model.on_train_batch_end(None, None, 0)
    assert_nothing_left(model)


def test_mixin_has_log_every_n_steps_as_the_callback(monkeypatch):
    from nemo_fp8_align.core.telemetry import TransposeRecord

    class EveryTwo(ReferenceGPT):
        fp8_align_log_every_n_steps = 2

    class Bad(ReferenceGPT):
        fp8_align_log_every_n_steps = 0

    monkeypatch.setattr(MegatronGPTModel, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(MegatronGPTModel, "on_train_batch_end", lambda self, *a, **k: None)
    with pytest.raises(ValueError, match="Bad.fp8_align_log_every_n_steps=0"):
        Bad(smoke_cfg().model, trainer())
    logged = []
    monkeypatch.setattr(AlignedGPT, "log_dict",
                        lambda self, metrics, **kw: logged.append(self.trainer.global_step),
                        raising=False)
    model = EveryTwo(smoke_cfg().model, trainer())
    aligner = FakeAligner()
    aligner.records = []
    model.__dict__.update(_fabric=None, _jit_is_scripting=False, model=[FakeDDPChunk()],
                          _trainer=trainer(1))
    model.fp8_align_session.aligner = aligner
    for step in range(4):  # the trainer's global_step counts the step just finished
        aligner.records.append(TransposeRecord(
            step=step, pp_rank=0, dp_rank=0, chunk=0, policy="aligned", backend="fake",
            vmid=-1, slot=0, aligned_slot=0, transposed=1, weights=1, after_all_gather=True,
            seconds=0.001))
        set_global_step(model.trainer, step + 1)
        model.on_train_batch_end(None, None, step)
    assert logged == [2, 4]  # not every step: the trainer's log_every_n_steps is 1


def test_train_end_detaches_in_an_agreement_and_an_error_path_locally(monkeypatch):
    """on_train_end runs on every rank after the last step: what the aligner still holds stops
    every rank there (detach(agree=True)); teardown and an error's way out stay local."""
    monkeypatch.setattr(MegatronGPTModel, "on_train_end", lambda self: None)
    for end, expected in (("on_train_end", [True]), ("fp8_align_detach", [False])):
        model = bare_model(True)
        hold = model._fp8_align_session.aligner.adapter
        agreed = []
        model.fp8_aligner.detach = lambda agree=False: (agreed.append(agree), hold.restore())
        getattr(model, end)()
        assert agreed == expected and model.fp8_aligner is None
