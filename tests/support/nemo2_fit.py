"""A NeMo 2 (``nemo.lightning``) ``MegatronStrategy`` fit on the CPU over gloo: tests ONLY.

    python -m torch.distributed.run --nproc-per-node 2 -m support.nemo2_fit OUT_DIR \
        --policy aligned|lazy|off [--steps N] [--fault-rank R --fault-step S]
        [--save-at N] [--resume CKPT] [--val-every N] [--comm-overlap none|default|gather]

A small megatron-core GPT (4 layers, PP=2 x VP=2, 2 ranks) built by a NeMo 2 LightningModule of
the ``llm.GPTModel`` protocol (``configure_model``, ``data_step``, ``forward_step``, the loss
reductions, a ``MegatronOptimizerModule``), trained by ``nl.Trainer`` with ``MegatronStrategy``
(megatron-core DDP, distributed optimizer, ``overlap_param_gather`` and ``align_param_gather``)
and ``FP8TransposeAlignNeMo2``. ``nemo.collections.llm`` itself is not used: its package import
pulls in ``nemo_run`` (and through it leptonai, fastapi, paramiko, ...), which this environment
does not carry. The transformer layers' GEMMs run on reference FP8 weights
(:mod:`support.reference_fp8_layers`); megatron-core's CUDA calls are redirected to the CPU by
:mod:`lab.demo.cpu_redirects`.

Writes ``OUT_DIR/loss.jsonl`` (the last pipeline rank: each step's loss, exact as ``float.hex``),
``OUT_DIR/telemetry.rank{rank}.jsonl`` (the plugin's records), ``OUT_DIR/val.rank{rank}.jsonl``
(after which step each validation batch ran), ``OUT_DIR/ckpt`` (``--save-at``) and
``OUT_DIR/error.rank{rank}.txt`` when the fit raised (then the process exits 3).

CPU-only stand-ins, each with its reason where it is applied: megatron-core's CUDA calls
(:mod:`lab.demo.cpu_redirects`), the model-parallel RNG fork, three torch_dist checkpoint fixes
(:mod:`support.dist_checkpoint`) and NeMo 2's CUDA-only ``_fix_tensors_device`` on load, and
the import of ``MegatronCommOverlapCallback``'s module without ``nemo.collections.llm``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Dict

import torch

SEQ, VOCAB, MICRO, GLOBAL = 16, 128, 1, 4  # M = 4 with one data-parallel rank


def _tiny_gpt_classes() -> Any:
    import lightning.pytorch as pl
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel as MCoreGPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nemo.lightning import io
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction
    from nemo.lightning.pytorch.optim import MegatronOptimizerModule
    from nemo.lightning.pytorch.plugins import MegatronDataSampler

    from support.reference_fp8_layers import with_reference_fp8_linears

    class TinyGPT(pl.LightningModule, io.IOMixin):
        """``llm.GPTModel``'s protocol, for a megatron-core GPT on the local spec with
        reference-FP8 linears."""

        def __init__(self, config: Any, optim: Any = None) -> None:
            super().__init__()
            self.config = config
            # An argument, as llm.GPTModel's: MegatronCommOverlapCallback.setup rewrites the
            # captured one too (trainer.model.__io__.optim.config).
            self.optim = optim or MegatronOptimizerModule(config=OptimizerConfig(
                optimizer="adam", lr=1e-3, use_distributed_optimizer=True, bf16=False,
                fp16=False, params_dtype=torch.float32, clip_grad=1.0))
            self.optim.connect(self)
            self._train_reduction = MaskedTokenLossReduction()
            self._val_reduction = MaskedTokenLossReduction(validation_step=True)

        def configure_model(self) -> None:
            if hasattr(self, "module"):
                return
            spec = with_reference_fp8_linears(get_gpt_layer_local_spec())
            self.module = MCoreGPTModel(
                self.config, transformer_layer_spec=spec, vocab_size=VOCAB,
                max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage())

        def forward(self, input_ids: Any, position_ids: Any, labels: Any = None) -> Any:
            return self.module(input_ids, position_ids, None, labels=labels)

        def data_step(self, dataloader_iter: Any) -> Dict[str, Any]:
            batch = next(dataloader_iter)
            if isinstance(batch, tuple) and len(batch) == 3:  # (batch, idx, dataloader idx)
                batch = batch[0]
            return batch

        def forward_step(self, batch: Dict[str, Any]) -> Any:
            return self(batch["tokens"], batch["position_ids"], labels=batch["labels"])

        def training_step(self, batch: Any, batch_idx: Any = None) -> Any:
            return self.forward_step(batch)

        def validation_step(self, batch: Any, batch_idx: Any = None) -> Any:
            return self.forward_step(batch)

        @property
        def training_loss_reduction(self) -> Any:
            return self._train_reduction

        @property
        def validation_loss_reduction(self) -> Any:
            return self._val_reduction

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> Dict[str, Any]:
            g = torch.Generator().manual_seed(1000 + i)
            ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(SEQ),
                    "position_ids": torch.arange(SEQ)}

    class TinyData(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.data_sampler = MegatronDataSampler(seq_len=SEQ, micro_batch_size=MICRO,
                                                    global_batch_size=GLOBAL)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Tokens(), batch_size=MICRO, num_workers=0)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Tokens(), batch_size=MICRO, num_workers=0)

        # As llm's PreTrainingDataModule: the checkpoint keeps the consumed samples, and a
        # resumed fit's sampler starts after them (the data of the steps not yet run).
        def state_dict(self) -> Dict[str, Any]:
            return {"consumed_samples": int(self.trainer.global_step) * GLOBAL}

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            consumed = int(state_dict["consumed_samples"])
            self.data_sampler.init_consumed_samples = consumed
            self.data_sampler.prev_consumed_samples = consumed
            self.data_sampler.if_first_step = 1

    class TinyConfig(TransformerConfig, io.IOMixin):
        """An io-captured config, as ``llm.GPTConfig`` is: ``MegatronParallel`` builds the
        virtual stages' copies with ``io.reinit``, from the captured arguments updated with the
        strategy's parallel sizes (a plain TransformerConfig's copy would keep PP=1: every
        layer in every copy)."""

    return TinyGPT, TinyData, TinyConfig


def _recorder(out: str, save_at: Any = None) -> Any:
    from lightning.pytorch import Callback
    from megatron.core import parallel_state

    from support.reference_fp8_layers import invalidate_reference_fp8_weights

    class Recorder(Callback):
        """Marks the reference FP8 copies stale after each optimizer step (as TE's are) and
        writes the last pipeline rank's loss."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            from nemo_fp8_align.integrations.nemo2 import nemo2_chunks

            invalidate_reference_fp8_weights(nemo2_chunks(trainer))
            if save_at is not None and int(trainer.global_step) == save_at:
                # Mid-fit, with the plugin attached, as NeMo's ModelCheckpoint saves:
                # MegatronStrategy.save_checkpoint forces every chunk's all-gather first.
                trainer.save_checkpoint(os.path.join(out, "ckpt"))
            if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                return
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            with open(os.path.join(out, "loss.jsonl"), "a") as f:
                f.write(json.dumps({"step": int(trainer.global_step),
                                    "loss": float(loss).hex()}) + "\n")

        def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            # which training step each validation batch ran after (the test reads it)
            with open(os.path.join(out, f"val.rank{trainer.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps({"after_step": int(trainer.global_step)}) + "\n")

    return Recorder()


def _faulty(callback: Any, rank: int, step: int) -> None:
    """Make this rank's transposes fail at training step ``step`` (the plugin's build raises
    inside the schedule, on this rank only)."""
    import torch.distributed as dist

    original = callback.on_train_start

    def on_train_start(trainer: Any, pl_module: Any) -> None:
        original(trainer, pl_module)
        if dist.get_rank() != rank:  # the process group exists from the strategy's setup on
            return
        backend = callback.aligner.backend
        build = backend.build_transposes

        def build_transposes(weights: Any) -> Any:
            if int(trainer.global_step) == step:
                raise RuntimeError(f"injected fault: rank {rank}, step {step}")
            return build(weights)
        backend.build_transposes = build_transposes
    callback.on_train_start = on_train_start


def _cpu_rng_tracker() -> None:
    """megatron-core's attention forks the CUDA RNG tracker's model-parallel state; NeMo 2
    seeds it (``model_parallel_cuda_manual_seed``) only with CUDA devices, so on the CPU no
    state is added and the fork raises. Dropout is 0 and init runs on the CPU here: the fork
    runs unforked when no state was added (as :mod:`support.cpu_nemo` does for NeMo 1.x)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mcore_random

    tracker_cls = mcore_random.CudaRNGStatesTracker
    original = tracker_cls.fork

    @contextlib.contextmanager
    def fork(tracker: Any, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Any:
        if name not in tracker.states_:
            yield
            return
        with original(tracker, name):
            yield

    tracker_cls.fork = fork


def _cpu_dist_checkpoints() -> None:
    """NeMo 2's torch_dist checkpoints with torch 2.13, megatron-core 0.12.3 and torch's Adam
    (no apex/TE): the three fixes of :mod:`support.dist_checkpoint` that concern megatron-core
    (the fourth, NeMo 1.x's checkpoint IO imports, does not apply: NeMo 2 has its own IO)."""
    from support import dist_checkpoint

    def patch(owner: Any, name: str, value: Any) -> None:
        setattr(owner, name, value)

    dist_checkpoint._pass_serialization_format(patch)
    dist_checkpoint._initialise_empty_torch_adam_state_before_load(patch)
    dist_checkpoint._keep_torch_adam_step_out_of_the_state_copy(patch)

    # NeMo 2.3.3's MegatronCheckpointIO.load_checkpoint (nemo/lightning/io/pl.py:302) passes
    # the loaded checkpoint through _fix_tensors_device, which asserts
    # torch.cuda.is_initialized() (pl.py:433) and then only moves CUDA tensors to the current
    # CUDA device: on the CPU there are none, so the CPU's answer is the checkpoint unchanged.
    from nemo.lightning.io import pl as nemo_io_pl

    nemo_io_pl._fix_tensors_device = lambda ckpt: ckpt


def _comm_overlap_callback(**kwargs: Any) -> Any:
    """NeMo 2's own ``MegatronCommOverlapCallback(**kwargs)``, on the CPU.

    Its module imports ``TransformerLayerTPOverlapCfg`` from
    ``nemo.collections.llm.recipes.tp_overlap_configs.userbuffers``
    (megatron_comm_overlap.py:23), and importing anything under ``nemo.collections.llm`` runs
    that package's ``__init__``, which needs ``nemo_run`` (not carried here). The leaf module
    (a few dataclasses, importing only ``nemo.lightning.io``) is loaded from its file under its
    own name, its parent packages as empty namespaces, so the callback's module imports as
    shipped. Its ``setup`` then asks ``torch.cuda.get_device_capability()`` only to choose
    which CUDA_DEVICE_MAX_CONNECTIONS advice to log: the CPU build raises there, so Hopper's
    (9, 0) is answered for that question alone."""
    import importlib.util
    import types

    import nemo

    leaf = "nemo.collections.llm.recipes.tp_overlap_configs.userbuffers"
    if leaf not in sys.modules:
        root = os.path.join(os.path.dirname(nemo.__file__), "collections", "llm")
        for name in ("nemo.collections.llm", "nemo.collections.llm.recipes",
                     "nemo.collections.llm.recipes.tp_overlap_configs"):
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [os.path.join(root, *name.split(".")[3:])]
                sys.modules[name] = package
        spec = importlib.util.spec_from_file_location(
            leaf, os.path.join(root, "recipes", "tp_overlap_configs", "userbuffers.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[leaf] = module
        spec.loader.exec_module(module)
    from nemo.lightning.pytorch.callbacks import megatron_comm_overlap

    callback = megatron_comm_overlap.MegatronCommOverlapCallback(**kwargs)
    check = callback._check_num_cuda_device_max_connections

    def check_on_cpu() -> None:
        original = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
        try:
            check()
        finally:
            torch.cuda.get_device_capability = original

    callback._check_num_cuda_device_max_connections = check_on_cpu
    return callback


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--policy", default="aligned", choices=["aligned", "lazy", "off"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fault-rank", type=int, default=None)
    parser.add_argument("--fault-step", type=int, default=1)
    parser.add_argument("--save-at", type=int, default=None,
                        help="save OUT/ckpt after this global step, mid-fit")
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    parser.add_argument("--val-every", type=int, default=None,
                        help="validate (one batch) every this many training steps")
    parser.add_argument("--comm-overlap", choices=["none", "default", "gather"],
                        default="none", help="add NeMo 2's MegatronCommOverlapCallback: with its "
                        "defaults, or with overlap_param_gather and align_param_gather passed")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vp", type=int, default=2)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))

    from lab.demo.cpu_redirects import enable_cpu_compat

    enable_cpu_compat()
    _cpu_rng_tracker()
    _cpu_dist_checkpoints()
    import nemo.lightning as nl
    from megatron.core.distributed import DistributedDataParallelConfig

    from nemo_fp8_align.backends.reference import ReferenceBackend
    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.integrations.nemo.build import reference_weights_of
    from nemo_fp8_align.integrations.nemo2 import FP8TransposeAlignNeMo2

    TinyGPT, TinyData, TinyConfig = _tiny_gpt_classes()
    config = TinyConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                               ffn_hidden_size=256, params_dtype=torch.float32,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False, apply_rope_fusion=False,
                               masked_softmax_fusion=False, persist_layer_norm=False,
                               use_cpu_initialization=True, init_method_std=0.02)
    strategy = nl.MegatronStrategy(
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vp,
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                          overlap_param_gather=True, overlap_grad_reduce=True,
                                          align_param_gather=True),
        pipeline_dtype=torch.float32, ckpt_async_save=False, ckpt_load_optimizer=True,
        ckpt_save_optimizer=True, ckpt_parallel_load=False, ckpt_parallel_save=False)
    align = FP8TransposeAlignNeMo2(
        align_config=AlignConfig(policy=args.policy,
                                 telemetry_path=os.path.join(args.out,
                                                             "telemetry.rank{rank}.jsonl")),
        backend=ReferenceBackend(), weights_of=reference_weights_of)
    callbacks = [align, _recorder(args.out, args.save_at)]
    if args.comm_overlap != "none":
        gather = dict(overlap_param_gather=True, align_param_gather=True)
        callbacks.append(_comm_overlap_callback(**(gather if args.comm_overlap == "gather"
                                                   else {})))
    trainer = nl.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                         num_nodes=1, max_steps=args.steps, strategy=strategy,
                         plugins=nl.MegatronMixedPrecision(precision="32"),
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, num_sanity_val_steps=0,
                         limit_val_batches=GLOBAL if args.val_every else 0,
                         val_check_interval=args.val_every, log_every_n_steps=1,
                         use_distributed_sampler=False)
    if args.fault_rank is not None:
        _faulty(align, args.fault_rank, args.fault_step)
    model = TinyGPT(config)
    try:
        trainer.fit(model, datamodule=TinyData(), ckpt_path=args.resume)
    except Exception:  # noqa: BLE001 - written for the test to read, then a failing exit
        with open(os.path.join(args.out, f"error.rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        return 3
    from support.run_nemo_cpu import leave_together

    leave_together()
    return 0


if __name__ == "__main__":
    sys.exit(main())
