"""FP8TransposeAlignment with a real Lightning Trainer (CPU, one process).

The NeMo model is replaced by a small LightningModule that looks like one to the callback
(``cfg``, ``model`` chunks with ``start_param_sync``, ``use_mcore_dist_optim``) and whose
training_step calls ``fwd_bwd_step``, which makes the schedule's pre-loop launches, as NeMo's
does; ``build_aligner`` (which needs megatron-core's parallel state) is replaced by a recorder. The callback on NeMo's real
MegatronGPTModel runs in tests/test_smoke_nemo.py.
"""

import dataclasses
import logging
import os
import pickle
import typing
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

from nemo_fp8_align.adapters.apex import ApexAdapter  # noqa: E402
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter  # noqa: E402
from support.standins.apex_dfa import StandInDistributedFusedAdam  # noqa: E402
from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.telemetry import TransposeRecord
from nemo_fp8_align.integrations.nemo import session as session_module
from nemo_fp8_align.integrations.nemo.callback import FP8TransposeAlignment
from nemo_fp8_align.config_check.check import FP8AlignConfigError, align_config_from
from nemo_fp8_align.integrations.nemo.mixin import FP8Weights
from nemo_fp8_align.integrations.nemo.session import NeMoSession

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "conf", "megatron_gpt_cpu_smoke.yaml")
CPU = os.path.join(ROOT, "conf", "megatron_gpt_cpu.yaml")


def smoke_cfg():
    """conf/megatron_gpt_cpu_smoke.yaml as Hydra composes it (on conf/megatron_gpt_cpu.yaml)."""
    smoke = OmegaConf.load(SMOKE)
    smoke.pop("defaults")
    return OmegaConf.merge(OmegaConf.load(CPU), smoke)


def test_constructor_checks_its_arguments():
    with pytest.raises(ValueError, match="aligned, lazy, off"):
        FP8TransposeAlignment(policy="sometimes")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        FP8TransposeAlignment(log_every_n_steps=0)
    with pytest.raises(ValueError, match="te, reference"):
        FP8TransposeAlignment(weights="int8")
    with pytest.raises(TypeError, match="enabled"):
        FP8TransposeAlignment(enabled="yes")
    assert FP8TransposeAlignment(policy="lazy").config.policy is Policy.LAZY


def test_picklable_and_state_dict_round_trip():
    cb = FP8TransposeAlignment(policy="aligned", weights="reference")
    cb.steps, cb.transposes = 3, 27
    cb._session = object()  # runtime state never travels
    clone = pickle.loads(pickle.dumps(cb))
    assert clone._session is None and clone.config == cb.config and clone.steps == 3
    fresh = FP8TransposeAlignment()
    fresh.load_state_dict(cb.state_dict())
    assert (fresh.steps, fresh.transposes) == (3, 27)
    fresh.load_state_dict({})  # missing keys: keep what it has
    assert (fresh.steps, fresh.transposes) == (3, 27)


class Chunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.started = []

    def start_param_sync(self, *params, force_sync=False):
        self.started.append(bool(params))

    def forward(self, x):
        return self.lin(x)


class NemoLikeModule(LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.use_mcore_dist_optim = True
        self.model = torch.nn.ModuleList([Chunk(), Chunk()])
        self.ddp_setups = 0

    def setup_mcore_distributed_parallel(self):
        self.ddp_setups += 1

    def training_step(self, batch, batch_idx):
        # NeMo's training_step runs the step's forwards and backwards in fwd_bwd_step.
        loss = self.fwd_bwd_step(iter([batch]), False)
        self.log("model_loss", loss.detach())  # the model's own metric, as NeMo's loss
        return loss

    def fwd_bwd_step(self, dataloader_iter, forward_only, first_val_step=None):
        # NeMo binds param_sync_func from the chunks inside the step, then the schedule's
        # pre-loop calls pass the parameters positionally.
        funcs = [chunk.start_param_sync for chunk in self.model]
        funcs[0](self.model[0].parameters())
        funcs[1](self.model[1].parameters())
        self.model[0].start_param_sync(force_sync=True)  # a keyword-only caller: not a launch
        return self.model[1](self.model[0](next(dataloader_iter))).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(3, 4), batch_size=1)


class FakeAligner:
    weights = [[None] * 4, [None] * 4]
    backend = type("Backend", (), {"name": "fake"})

    def __init__(self, module=None):
        self.records, self.launched, self.attached_ = [], [], False
        # The adapter NeMo's path picks (assemble.pick_adapter): the real launch reporting.
        self.adapter = None if module is None else fake_adapter(module)

    @property
    def attached(self):
        return self.attached_

    def attach(self):
        # As TransposeAligner.attach: the adapter reports the launches from here on.
        self.attached_ = True
        if self.adapter is not None:
            self.adapter.install(self.on_param_sync_launched, self.on_step_end)
        return True

    def detach(self, *, agree=False):
        self.attached_ = False
        self.detached_with = getattr(self, "detached_with", []) + [agree]
        if self.adapter is not None:
            self.adapter.restore()

    def set_next_step(self, step):
        self.next_steps = getattr(self, "next_steps", []) + [step]

    def on_step_end(self):
        self.step_ends = getattr(self, "step_ends", 0) + 1

    def on_param_sync_launched(self, chunk):
        self.launched.append(chunk)
        if chunk == 1:  # the slot-0 chunk is built after chunk 1's launch
            step = len(self.records) // 2
            for c in (0, 1):
                self.records.append(TransposeRecord(
                    step=step, pp_rank=0, dp_rank=0, chunk=c, policy="aligned",
                    backend="fake", vmid=-1 if c == 0 else 2, slot=2 * c, aligned_slot=2 * c,
                    transposed=4, weights=4, after_all_gather=True, seconds=0.001))


class _Complete:
    """Every chunk's all-gather is complete when asked (the fake chunks have no buckets)."""

    def finish(self, chunk):
        return True

    def finished(self, chunk):
        return True


class FinishedMcore(_Complete, McoreDDPAdapter):
    pass


class FinishedApex(_Complete, ApexAdapter):
    pass


def fake_adapter(module):
    if module.use_mcore_dist_optim:
        for chunk in module.model:
            chunk.bucket_groups = []  # what megatron-core's adapter checks for
        return FinishedMcore(module.model, None, owns_step_end=False)
    optimizer = StandInDistributedFusedAdam([list(c.parameters()) for c in module.model])
    return FinishedApex(optimizer, module.model)


class MemoryLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def run_fit(monkeypatch, cb, module, logger=None):
    aligners = []

    def fake_build(model, config, *, weights, entry):
        aligners.append(FakeAligner(model))
        aligners[-1].config, aligners[-1].weights_kind = config, weights
        aligners[-1].attach()  # build_aligner returns it attached (assemble attaches)
        return aligners[-1]

    monkeypatch.setattr(session_module, "build_aligner", fake_build)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=logger or False,
                      callbacks=cb if isinstance(cb, list) else [cb],
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module)
    return trainer, aligners


def test_real_trainer_attaches_wraps_per_batch_logs_and_detaches(monkeypatch):
    cfg = smoke_cfg().model
    logger = MemoryLogger()
    cb = FP8TransposeAlignment(weights="reference")
    module = NemoLikeModule(cfg)
    trainer, aligners = run_fit(monkeypatch, cb, module, logger)
    (aligner,) = aligners
    assert aligner.launched == [0, 1] * 3  # schedule launches only, every step
    assert module.model[0].started == [True, False] * 3  # NeMo's launches still ran
    assert not aligner.attached_  # detached at the end of training
    # on_train_end, where every rank ends: what is still held stops every rank (agree=True)
    assert aligner.detached_with == [True]
    assert all("start_param_sync" not in c.__dict__ for c in module.model)
    assert "setup_mcore_distributed_parallel" not in module.__dict__
    assert cb._session is None and (cb.steps, cb.transposes) == (3, 24)
    logged = [row for row in logger.rows if "fp8_align/chunk1/slot_skew" in row[1]]
    assert len(logged) == 3
    # One logger row per step, the same row (and step) as the model's own metric.
    assert [step for step, _ in logged] == [0, 1, 2]
    assert all("model_loss" in metrics for _, metrics in logged)
    assert logged[0][1]["fp8_align/chunk1/slot_skew"] == 0.0
    assert logged[0][1]["fp8_align/chunk0/transposes_built"] == 4.0
    assert logged[0][1]["fp8_align/records"] == 2.0


def non_default(field: "dataclasses.Field") -> Any:
    """A valid value of an AlignConfig field other than its default, from its type."""
    hint = typing.get_type_hints(AlignConfig)[field.name]
    if hint is bool:
        return not field.default
    if hint is int:
        return field.default + 7
    if hint is Policy:
        return next(p for p in Policy if p is not field.default)
    if typing.Optional[str] == hint:
        return "/results/fp8_align.rank{rank}.jsonl"
    raise AssertionError(f"AlignConfig.{field.name}: give this test a value of type {hint}")


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(AlignConfig)] + ["all"])
def test_startup_check_sees_every_align_config_field_of_the_callback(name):
    # The check runs on the model config with the block replaced by the callback's settings:
    # every AlignConfig field must survive that round trip (one at a time, then all at once).
    changed = {f.name: non_default(f) for f in dataclasses.fields(AlignConfig)
               if name in (f.name, "all")}
    cb = FP8TransposeAlignment()
    cb.config = AlignConfig(**changed)
    cfg = smoke_cfg().model
    assert align_config_from(cb._cfg_with_block(cfg)) == cb.config != AlignConfig()


def test_setup_runs_the_startup_check_with_the_callbacks_settings(monkeypatch):
    cfg = smoke_cfg().model
    cfg.optim.align_param_gather = False
    with pytest.raises(FP8AlignConfigError, match="align_param_gather"):
        run_fit(monkeypatch, FP8TransposeAlignment(weights="reference"), NemoLikeModule(cfg))
    # The callback's own settings win over the YAML block: disabled means no check at all.
    cfg.fp8_transpose_align.enabled = True
    _, aligners = run_fit(monkeypatch, FP8TransposeAlignment(enabled=False),
                          NemoLikeModule(cfg))
    assert aligners == []


def test_te_weights_require_the_te_keys(monkeypatch):
    cfg = smoke_cfg().model  # fp8_params=False: fine for reference weights only
    with pytest.raises(FP8AlignConfigError, match="fp8_params"):
        run_fit(monkeypatch, FP8TransposeAlignment(weights="te"), NemoLikeModule(cfg))


def test_refuses_a_model_that_already_has_the_mixin(monkeypatch):
    from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin

    class Both(FP8TransposeAlignMixin, NemoLikeModule):
        def __init__(self, cfg):
            NemoLikeModule.__init__(self, cfg)

    with pytest.raises(RuntimeError, match="already has FP8TransposeAlignMixin"):
        run_fit(monkeypatch, FP8TransposeAlignment(weights="reference"),
                Both(smoke_cfg().model))


def test_not_a_nemo_model(monkeypatch):
    module = NemoLikeModule(None)
    with pytest.raises(TypeError, match="NeMo Megatron GPT model"):
        run_fit(monkeypatch, FP8TransposeAlignment(), module)


class ApexLikeModule(NemoLikeModule):
    """The Apex path: NeMo binds ``self.sync_overlap_parameters`` as param_sync_func."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.use_mcore_dist_optim = False
        self.synced = []

    def sync_overlap_parameters(self, params=None):
        self.synced.append(None if params is None else len(list(params)))

    def fwd_bwd_step(self, dataloader_iter, forward_only, first_val_step=None):
        func = self.sync_overlap_parameters  # what NeMo's fwd_bwd_step binds
        func(self.model[0].parameters())
        func(self.model[1].parameters())
        func()  # not a schedule launch (no parameters)
        return self.model[1](self.model[0](next(dataloader_iter))).sum()


def test_real_trainer_apex_path_wraps_sync_overlap_parameters(monkeypatch):
    cfg = smoke_cfg().model
    cfg.optim.name = "distributed_fused_adam"
    module = ApexLikeModule(cfg)
    _, aligners = run_fit(monkeypatch, FP8TransposeAlignment(weights="reference"), module)
    (aligner,) = aligners
    assert aligner.launched == [0, 1] * 3
    assert module.synced == [2, 2, None] * 3  # NeMo's method still got every parameter
    assert "sync_overlap_parameters" not in module.__dict__


# ---------------------------------------------------------------------------------------------
# settings from the model config, the Lightning entry point, lifecycle


class FP8Layer(torch.nn.Module):
    """A layer holding a reference FP8 weight, as the CPU layers do (weights detected)."""

    def __init__(self):
        super().__init__()
        from nemo_fp8_align.backends.reference import ReferenceFP8Weight

        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.fp8_weight = ReferenceFP8Weight(self.weight)

    def forward(self, x):
        return x @ self.weight.t()


class ReferenceChunk(Chunk):
    def __init__(self):
        super().__init__()
        self.lin = FP8Layer()


class ReferenceNemoLikeModule(NemoLikeModule):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.model = torch.nn.ModuleList([ReferenceChunk(), ReferenceChunk()])


def entry_point_callbacks(trainer):
    return [cb for cb in trainer.callbacks
            if isinstance(cb, FP8TransposeAlignment) and cb.from_entry_point]


def test_no_arguments_follow_the_model_config_block(monkeypatch):
    cfg = smoke_cfg().model
    cfg.fp8_transpose_align.policy = "lazy"
    cfg.fp8_transpose_align.telemetry_path = None
    cb = FP8TransposeAlignment()
    _, (aligner,) = run_fit(monkeypatch, cb, ReferenceNemoLikeModule(cfg))
    assert aligner.config.policy is Policy.LAZY
    assert aligner.weights_kind is FP8Weights.REFERENCE  # detected from the layers
    # Arguments passed win over the block; the rest still come from it.
    cfg.fp8_transpose_align.telemetry_path = "/tmp/x{rank}.jsonl"
    _, (aligner,) = run_fit(monkeypatch, FP8TransposeAlignment(policy="aligned"),
                            ReferenceNemoLikeModule(cfg))
    assert aligner.config.policy is Policy.ALIGNED
    assert aligner.config.telemetry_path == "/tmp/x{rank}.jsonl"
    cfg.fp8_transpose_align.enabled = False
    _, aligners = run_fit(monkeypatch, FP8TransposeAlignment(), ReferenceNemoLikeModule(cfg))
    assert aligners == []
    cfg.fp8_transpose_align.enabled = True
    cfg.fp8_transpose_align.polcy = "lazy"  # a typo in the block is an error, not ignored
    with pytest.raises(FP8AlignConfigError, match="polcy"):
        run_fit(monkeypatch, FP8TransposeAlignment(), ReferenceNemoLikeModule(cfg))


def test_entry_point_is_registered_and_inert_without_the_block(monkeypatch):
    cfg = smoke_cfg().model
    cfg.pop("fp8_transpose_align")
    trainer, aligners = run_fit(monkeypatch, [], ReferenceNemoLikeModule(cfg))
    (cb,) = entry_point_callbacks(trainer)  # pip install put it into every Trainer
    assert aligners == [] and cb.steps == 0
    # A model that is not NeMo's at all: nothing happens either.
    trainer, aligners = run_fit(monkeypatch, [], NemoLikeModule(None))
    assert aligners == []


def test_entry_point_attaches_when_the_block_enables_the_plugin(monkeypatch, caplog):
    cfg = smoke_cfg().model
    module = ReferenceNemoLikeModule(cfg)
    with caplog.at_level(logging.INFO):
        trainer, (aligner,) = run_fit(monkeypatch, [], module)
    assert "aligned FP8 transposes attached (entry point" in caplog.text
    (cb,) = entry_point_callbacks(trainer)
    assert aligner.launched == [0, 1] * 3 and cb.steps == 3
    assert not aligner.attached_ and all("start_param_sync" not in c.__dict__ for c in module.model)
    cfg.fp8_transpose_align.enabled = False
    _, aligners = run_fit(monkeypatch, [], ReferenceNemoLikeModule(cfg))
    assert aligners == []


def test_entry_point_steps_aside_for_the_mixin_and_an_explicit_callback(monkeypatch):
    from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin

    class WithMixin(FP8TransposeAlignMixin, ReferenceNemoLikeModule):
        def __init__(self, cfg):
            ReferenceNemoLikeModule.__init__(self, cfg)
            # The mixin's state with its own plugin off: only the entry point could attach.
            self._fp8_align_session = NeMoSession(self, AlignConfig(enabled=False),
                                                  weights=FP8Weights.REFERENCE)

    _, aligners = run_fit(monkeypatch, [], WithMixin(smoke_cfg().model))
    assert aligners == []
    explicit = FP8TransposeAlignment(policy="lazy")
    trainer, (aligner,) = run_fit(monkeypatch, [explicit], ReferenceNemoLikeModule(
        smoke_cfg().model))
    assert aligner.config.policy is Policy.LAZY and explicit.steps == 3
    assert entry_point_callbacks(trainer)[0].steps == 0


def test_two_explicit_callbacks_are_refused():
    with pytest.raises(RuntimeError, match="more than one stateful callback"):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                callbacks=[FP8TransposeAlignment(), FP8TransposeAlignment()])


class FailingModule(ReferenceNemoLikeModule):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        raise ValueError("boom")


def test_exception_inside_fit_detaches_and_unwraps(monkeypatch):
    cb = FP8TransposeAlignment()
    module = FailingModule(smoke_cfg().model)
    with pytest.raises(ValueError, match="boom"):
        run_fit(monkeypatch, cb, module)
    assert cb._session is None and cb.aligner is None
    assert all("start_param_sync" not in c.__dict__ for c in module.model)


def test_repeated_fit_attaches_once_per_fit(monkeypatch):
    cb = FP8TransposeAlignment()
    module = ReferenceNemoLikeModule(smoke_cfg().model)
    _, first = run_fit(monkeypatch, cb, module)
    _, second = run_fit(monkeypatch, cb, module)
    assert len(first) == len(second) == 1 and not first[0].attached_
    assert second[0].launched == [0, 1] * 3  # no launch notified twice: one wrapper per chunk


def test_steps_follow_global_step_across_a_resume(monkeypatch, tmp_path):
    cfg = smoke_cfg().model
    trainer, (first,) = run_fit(monkeypatch, FP8TransposeAlignment(), ReferenceNemoLikeModule(cfg))
    assert first.next_steps == [0, 1, 2] and first.step_ends == 3
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    aligners = []
    monkeypatch.setattr(session_module, "build_aligner",
                        lambda model, config, **kw: aligners.append(FakeAligner(model))
                        or aligners[-1].attach() and aligners[-1])
    resumed = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False,
                      callbacks=[FP8TransposeAlignment()], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    resumed.fit(ReferenceNemoLikeModule(cfg), ckpt_path=ckpt)
    assert aligners[0].next_steps == [3, 4]  # not 0, 1: the telemetry continues


def test_unwritable_or_shared_telemetry_path_fails_at_setup(monkeypatch, tmp_path):
    cfg = smoke_cfg().model
    cfg.fp8_transpose_align.telemetry_path = str(tmp_path / "missing_dir" / "t.rank{rank}.jsonl")
    with pytest.raises(ValueError, match="cannot write .*missing_dir"):
        run_fit(monkeypatch, FP8TransposeAlignment(), ReferenceNemoLikeModule(cfg))
    from nemo_fp8_align.integrations.nemo.build import check_telemetry_path
    from support.one_process import agree_alone

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    agree_alone(monkeypatch)  # no process group: this rank's own error, as with one rank
    with pytest.raises(ValueError, match=r"no \{rank\} but 4 ranks"):
        check_telemetry_path(str(tmp_path / "shared.jsonl"))


class ValidatingModule(ReferenceNemoLikeModule):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model[1](self.model[0](batch)).sum())

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(2, 4), batch_size=1)

    test_step = validation_step
    test_dataloader = val_dataloader


def test_validate_and_test_around_fit_attach_nothing(monkeypatch):
    cb = FP8TransposeAlignment()
    module = ValidatingModule(smoke_cfg().model)
    trainer, aligners = run_fit(monkeypatch, cb, module)
    assert len(aligners) == 1 and not aligners[0].attached_
    trainer.validate(module, verbose=False)
    trainer.test(module, verbose=False)
    assert len(aligners) == 1 and cb._session is None  # forward-only: no aligner, no wrappers
    assert all("start_param_sync" not in c.__dict__ for c in module.model)
    trainer.fit(module)  # again (max_steps already reached): nothing left attached afterwards
    assert all(not a.attached_ for a in aligners)


# ---------------------------------------------------------------------------------------------
# one wiring with the mixin (integrations/nemo/session.py): where the step closes, skipped hooks


class SkipsFirstBatch(ReferenceNemoLikeModule):
    """Its on_train_batch_start returns -1 on the first batch: Lightning 2.4 has already run the
    callbacks' on_train_batch_start, then ends the epoch (StopIteration) with no training step
    and no on_train_batch_end; training goes on in the next epoch."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == 0:
            return -1
        return None


def test_a_skipped_on_train_batch_end_does_not_double_the_launch_wrapper(monkeypatch):
    cb = FP8TransposeAlignment()
    module = SkipsFirstBatch(smoke_cfg().model)
    trainer, (aligner,) = run_fit(monkeypatch, cb, module)
    assert trainer.current_epoch >= 1  # the skip really ended epoch 0
    assert aligner.launched == [0, 1] * 3  # every launch reported once, first batch included
    assert module.model[0].started == [True, False] * 3
    assert aligner.next_steps == [0, 1, 2] and aligner.step_ends == 3 and cb.steps == 3
    assert all("start_param_sync" not in c.__dict__ for c in module.model)


class RecordingSGD(torch.optim.SGD):
    def __init__(self, params, events):
        super().__init__(params, lr=0.1)
        self.events = events

    def step(self, closure=None):
        out = super().step(closure)
        self.events.append("optimizer step")
        return out


class OrderedModule(ReferenceNemoLikeModule):
    def __init__(self, cfg, events):
        super().__init__(cfg)
        self.events = events

    def configure_optimizers(self):
        return RecordingSGD(self.parameters(), self.events)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.events.append("batch end")


def test_the_step_closes_when_the_training_fwd_bwd_step_returns_before_the_optimizer_step(
        monkeypatch):
    # NeMo 2.3.3: training_step runs the step's forwards in fwd_bwd_step; Lightning's automatic
    # optimization then steps the optimizer, and only then calls on_train_batch_end. The step is
    # judged (on_step_end) before the optimizer applies it, as the mixin does.
    events = []
    monkeypatch.setattr(FakeAligner, "on_step_end", lambda self: events.append("step end"),
                        raising=False)
    cb = FP8TransposeAlignment()
    _, aligners = run_fit(monkeypatch, cb, OrderedModule(smoke_cfg().model, events))
    assert len(aligners) == 1
    assert events == ["step end", "optimizer step", "batch end"] * 3
