"""The Megatron-Bridge callback: its config mapping onto the startup rules, with megatron-core's
real config classes, and megatron-bridge 0.6.2's own ``training/callbacks.py`` (standard library
only; ``make test`` fetches the wheel into .bridge-wheel/) registering and firing it as Bridge's
``setup()`` and ``train()`` do, on real megatron-core DDP chunks in 2 gloo processes.

Bridge's package does not import here (its ``__init__`` needs transformers and Transformer
Engine), so its ``CallbackManager`` is loaded by path; ``setup()``'s ``num_epochs`` guard and
``train()``'s order of events around the callbacks are replayed below, each line citing Bridge
0.6.2's source."""

import importlib
import os
import sys
from types import SimpleNamespace

import torch

import pytest

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_fp8_align.config import AlignConfig, Policy  # noqa: E402
from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations  # noqa: E402
from nemo_fp8_align.integrations.bridge import FP8TransposeAlignCallback, bridge_args  # noqa: E402
from support.bridge import BRIDGE_CALLBACKS, load_bridge_callbacks  # noqa: E402

@pytest.fixture
def callbacks():
    return load_bridge_callbacks()


def _cfg(num_epochs=None, **ddp):
    model = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                              pipeline_model_parallel_size=2,
                              virtual_pipeline_model_parallel_size=2, fp8="hybrid",
                              pipeline_dtype=torch.bfloat16)
    settings = dict(use_distributed_optimizer=True, overlap_param_gather=True,
                    overlap_grad_reduce=True, align_param_gather=True, fp8_param_gather=True)
    settings.update(ddp)
    # Megatron-Bridge's ConfigContainer (and its train/logger nodes): its config module imports
    # the whole of Bridge; the real megatron-core configs go inside.
    return SimpleNamespace(
        model=model, ddp=DistributedDataParallelConfig(**settings),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=16, rampup_batch_size=None,
                              num_epochs=num_epochs),
        logger=SimpleNamespace(log_interval=10))


def bridge_setup_callbacks(callbacks, manager, cfg, context):
    """What Bridge 0.6.2's ``training/setup.py::setup`` does with the callbacks: with
    ``train.num_epochs`` set, refuse any ``on_data_init_start`` callback (lines 314-316), and
    later, after binding ``param_sync_func`` (``_update_model_config_funcs``, line 437), fire
    ``on_data_init_start`` (lines 449-457)."""
    if cfg.train.num_epochs is not None:
        if callbacks.should_fire(manager, "on_data_init_start"):
            raise ValueError("num_epochs is not supported with on_data_init_start callbacks")
    if callbacks.should_fire(manager, "on_data_init_start"):
        manager.fire("on_data_init_start", context)


def test_a_valid_bridge_config_passes_the_startup_rules():
    assert megatron_lm_violations(vars(bridge_args(_cfg())), world_size=4) == []


@pytest.mark.parametrize("ddp, flag", [
    (dict(overlap_param_gather=False), "--overlap-param-gather"),
    (dict(align_param_gather=False), "--no-align-param-gather"),
    (dict(fp8_param_gather=False), "--fp8-param-gather"),
])
def test_bridge_settings_that_stop_the_plugin_are_reported(ddp, flag):
    found = megatron_lm_violations(vars(bridge_args(_cfg(**ddp))), world_size=4)
    assert [v.key for v in found] == [flag]


def test_bridge_callback_manager_registers_it_on_train_start_and_train_end(callbacks):
    """Duck-typed (not a subclass of Bridge's ``Callback``): Bridge's ``CallbackManager.add``
    registers its two methods by name, and nothing on ``on_data_init_start``."""
    callback = FP8TransposeAlignCallback()
    assert not isinstance(callback, callbacks.Callback)
    manager = callbacks.normalize_callbacks([callback])  # what pretrain(callbacks=[...]) does
    registered = {e for e in callbacks.VALID_EVENTS if manager.list_callbacks(e)}
    assert registered == {"on_train_start", "on_train_end"}
    assert manager.list_callbacks("on_train_start") == [callback.on_train_start]
    assert not callbacks.should_fire(manager, "on_data_init_start")


def test_a_num_epochs_config_passes_bridges_setup(callbacks):
    """Bridge 0.6.2's ``setup`` raises ValueError for an ``on_data_init_start`` callback when
    ``train.num_epochs`` is set; the plugin's callback registers none."""
    manager = callbacks.normalize_callbacks([FP8TransposeAlignCallback()])
    context = callbacks.CallbackContext(state=SimpleNamespace(cfg=_cfg(num_epochs=1)), model=[])
    bridge_setup_callbacks(callbacks, manager, _cfg(num_epochs=1), context)  # does not raise


def test_importing_it_needs_neither_bridge_nor_transformer_engine(monkeypatch):
    """An installed Transformer Engine without CUDA raises RuntimeError at import (and Bridge's
    package imports TE): the module must import whatever importing either of them raises."""
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformer_engine" or name.startswith("megatron.bridge"):
                raise RuntimeError(f"importing {name}: no CUDA (as TE without a GPU)")
            return None

    import nemo_fp8_align.integrations as integrations

    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "nemo_fp8_align.integrations.bridge", raising=False)
    monkeypatch.setattr(integrations, "bridge", None, raising=False)
    for name in [n for n in sys.modules if n.startswith(("megatron.bridge", "transformer_engine"))]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("nemo_fp8_align.integrations.bridge")
    assert module.FP8TransposeAlignCallback().aligner is None


def test_align_config_is_checked_in_the_constructor():
    with pytest.raises(TypeError, match="AlignConfig"):
        FP8TransposeAlignCallback(align_config={"policy": "aligned"})


# --- Bridge's train() around the callback, on real megatron-core DDP chunks (2 gloo ranks) ----

STEPS = 3


def bridge_train(callbacks, manager, state, run, callback):
    """Bridge 0.6.2's ``training/train.py::train`` where it touches the callbacks and
    ``param_sync_func`` (``should_toggle_forward_pre_hook``: distributed optimizer with
    overlapped all-gathers), one training step being the demo's forward-backward and optimizer
    step. Returns what the test checks, seen at each point."""
    model, config, seen = run.chunks, run.config, {}

    def context():
        return callbacks.CallbackContext(state=state, model=model, user_state=manager.user_state,
                                         optimizer=run.optimizer)

    if callbacks.should_fire(manager, "on_train_start"):  # lines 349-359
        manager.fire("on_train_start", context())
    seen["wrapped_at_start"] = _wrapped(model)
    seen["bound_at_start"] = _bound_wrappers(config, model)
    param_sync_func = config.param_sync_func  # line 365: stashed after on_train_start
    for chunk in model:  # lines 368-371: the first iteration without pre-hooks or launches
        chunk.disable_forward_pre_hook(param_sync=False)
    config.param_sync_func = None
    start_iteration = state.train_state.step
    while state.train_state.step < STEPS:  # line 377
        run.forward_backward(state.train_state.step)
        run.optimizer_step()
        if state.train_state.step == start_iteration:  # lines 536-548: the stash goes back
            for chunk in model:
                chunk.enable_forward_pre_hook()
            config.param_sync_func = param_sync_func
            seen["bound_after_first"] = _bound_wrappers(config, model)
        state.train_state.step += 1  # line 564
    for chunk in model:  # line 777: disable_forward_pre_hook(model, optimizer=optimizer)
        chunk.disable_forward_pre_hook()  # param_sync=True: a forced synchronous all-gather
    seen["records"] = [dict(step=r.step, chunk=r.chunk, slot=r.slot,
                            aligned_slot=r.aligned_slot, after_all_gather=r.after_all_gather)
                       for r in callback.aligner.records]
    seen["unlaunched_forwards"] = callback.aligner.unlaunched_forwards
    if callbacks.should_fire(manager, "on_train_end"):  # lines 810-820
        manager.fire("on_train_end", context())
    seen["wrapped_at_end"] = _wrapped(model)
    return seen


def _wrapped(model):
    """Which chunks carry the plugin's ``start_param_sync`` on the instance."""
    return [int("start_param_sync" in vars(chunk)) for chunk in model]


def _bound_wrappers(config, model):
    funcs = config.param_sync_func
    return isinstance(funcs, list) and len(funcs) == len(model) and all(
        f is vars(chunk).get("start_param_sync") for f, chunk in zip(funcs, model))


def _bridge_rank(rank, world_size, port, callbacks_path, out_dir):
    """One rank: the demo's PP=2 x VP=2 chunks, bound as Bridge's setup binds them, then Bridge's
    setup and train around the callback; then an in-process restart's second train() on a
    rebuilt model without on_train_end between."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                          init_num_microbatches_calculator)

    from lab.demo.options import DemoOptions
    from lab.demo.ranks import write_error, write_result
    from lab.demo.train import PipelineRun, distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Policy off: the demo builds no engine of its own; it binds param_sync_func after building.
    opts = DemoOptions(pp=2, vp=2, dp=1, microbatches=4, steps=STEPS, policy=Policy.OFF,
                       rebinding_loop=True, pg_timeout_s=120)
    try:
        with distributed(rank, world_size, opts):
            callbacks = load_bridge_callbacks(callbacks_path)
            init_num_microbatches_calculator(rank, None, opts.microbatches * opts.micro_batch_size,
                                             opts.micro_batch_size, 1)
            run = PipelineRun(opts, None)
            callback = FP8TransposeAlignCallback(
                backend=run.backend, weights_of=lambda chunk: chunk.module.fp8_weights(),
                align_config=AlignConfig(policy=Policy.ALIGNED))
            manager = callbacks.normalize_callbacks([callback])
            cfg = _cfg(num_epochs=1)
            cfg.train.micro_batch_size = opts.micro_batch_size
            cfg.train.global_batch_size = opts.microbatches * opts.micro_batch_size
            state = SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0))
            bridge_setup_callbacks(callbacks, manager, cfg, callbacks.CallbackContext(
                state=state, model=run.chunks, user_state=manager.user_state))
            result = bridge_train(callbacks, manager, state, run, callback)
            run.close()
            # An in-process restart: a new model, its train() started without on_train_end.
            first = PipelineRun(opts, None)
            manager.fire("on_train_start", callbacks.CallbackContext(
                state=state, model=first.chunks, user_state=manager.user_state))
            second = PipelineRun(opts, None)
            manager.fire("on_train_start", callbacks.CallbackContext(
                state=state, model=second.chunks, user_state=manager.user_state))
            result["restart_wrapped"] = [_wrapped(first.chunks), _wrapped(second.chunks)]
            manager.fire("on_train_end", callbacks.CallbackContext(
                state=state, model=second.chunks, user_state=manager.user_state))
            result["restart_wrapped_at_end"] = _wrapped(second.chunks)
            first.close()
            second.close()
            destroy_num_microbatches_calculator()
            write_result(out_dir, rank, result)
    except Exception as err:
        write_error(out_dir, rank, err)
        raise


@pytest.mark.slow
def test_bridge_train_attaches_at_train_start_and_detaches_at_train_end(callbacks, tmp_path):
    """Through Bridge's own CallbackManager, with ``train.num_epochs`` set: nothing attached
    during setup; at ``on_train_start`` the chunks are wrapped and the bound list points at the
    wrappers, so train()'s stash and restore keep the plugin in the loop (the first iteration
    runs without launches, the next two aligned); ``on_train_end`` takes every wrapper off. A
    restarted train() on a rebuilt model moves the engine to the new chunks."""
    from lab.demo.ranks import read_results, spawn_and_wait

    codes = spawn_and_wait(_bridge_rank, 2, (str(BRIDGE_CALLBACKS), str(tmp_path)), timeout_s=120)
    for rank in read_results(str(tmp_path), codes):
        assert rank["wrapped_at_start"] == [1, 1] and rank["bound_at_start"]
        assert rank["bound_after_first"]
        assert rank["unlaunched_forwards"] > 0  # the first iteration: param_sync_func None
        assert sorted({r["step"] for r in rank["records"]}) == [1, 2]
        assert len(rank["records"]) == 2 * 2  # launched steps x chunks
        assert all(r["slot"] == r["aligned_slot"] and r["after_all_gather"]
                   for r in rank["records"])
        assert rank["wrapped_at_end"] == [0, 0]
        assert rank["restart_wrapped"] == [[0, 0], [1, 1]]
        assert rank["restart_wrapped_at_end"] == [0, 0]


# --- a plugin error on one rank stops both ranks in Bridge's train() (issue 24 item 6) ---------

def _bridge_fault_rank(rank, world_size, port, callbacks_path, out_dir):
    """One rank: for each fault of ``RANK_ERRORS`` in turn (one process group for all four:
    the error is raised after the step end's agreement, with no collective left pending), a
    new model, the callback through Bridge's ``CallbackManager``, and Bridge's ``train()`` until
    the plugin's error; what each rank raised, and when."""
    import time

    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                          init_num_microbatches_calculator)

    from lab.demo.faults import RANK_ERRORS, inject
    from lab.demo.options import DemoOptions
    from lab.demo.ranks import write_error, write_result
    from lab.demo.train import PipelineRun, distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = DemoOptions(pp=2, vp=2, dp=1, microbatches=4, steps=STEPS, policy=Policy.OFF,
                       rebinding_loop=True, pg_timeout_s=60)
    raised = {}
    try:
        with distributed(rank, world_size, opts):
            callbacks = load_bridge_callbacks(callbacks_path)
            init_num_microbatches_calculator(rank, None, opts.microbatches * opts.micro_batch_size,
                                             opts.micro_batch_size, 1)
            for fault in sorted(RANK_ERRORS):
                undo, run = inject(fault), PipelineRun(opts, None)
                callback = FP8TransposeAlignCallback(
                    backend=run.backend, weights_of=lambda chunk: chunk.module.fp8_weights(),
                    align_config=AlignConfig(policy=Policy.ALIGNED))
                manager = callbacks.normalize_callbacks([callback])
                state = SimpleNamespace(cfg=None, train_state=SimpleNamespace(step=0))
                try:
                    bridge_train(callbacks, manager, state, run, callback)
                    raised[fault] = None
                except Exception as err:  # noqa: BLE001 - what each rank raised is the result
                    raised[fault] = (f"rank {rank}: {type(err).__name__}: {err}", time.time())
                finally:
                    undo()
                    callback.on_train_end(None)  # Bridge's train() does not reach it
                    run.close()
            destroy_num_microbatches_calculator()
            write_result(out_dir, rank, raised)
    except Exception as err:
        write_error(out_dir, rank, err)
        raise


@pytest.mark.slow
def test_an_error_on_one_rank_stops_both_ranks_in_bridges_train(callbacks, tmp_path):
    """Each one-rank error of ``demo --fault`` (the last rank's, in step 1) stops both ranks
    with the plugin's error class within seconds, the faulty rank saying what differed and the
    other naming it: the callback's engine agrees on the model's ranks at each step end, so
    no rank is left in a collective (with NCCL: blocked until the timeout)."""
    from lab.demo.options import DemoOptions
    from lab.demo.ranks import read_results, spawn_and_wait
    from support.rank_errors import EXPECTED, check_every_rank_stopped

    codes = spawn_and_wait(_bridge_fault_rank, 2, (str(BRIDGE_CALLBACKS), str(tmp_path)),
                           timeout_s=180)
    ranks = read_results(str(tmp_path), codes)
    opts = DemoOptions(pp=2, vp=2, dp=1, microbatches=4)
    for fault in sorted(EXPECTED):
        assert all(r[fault] is not None for r in ranks), (fault, ranks)
        stopped = SimpleNamespace(reports={i: r[fault][0] for i, r in enumerate(ranks)},
                                  times={i: r[fault][1] for i, r in enumerate(ranks)})
        check_every_rank_stopped(opts, stopped, fault)
