"""One rank of ``demo --loop megatron-lm``: the demo GPT trained by Megatron-LM's own
``pretrain``/``train()`` (megatron-core >= 0.19's ``megatron.training``) on the CPU over gloo,
with the plugin attached the documented way (``ModelConfig.post_wrap_hooks``).

The loop is not edited. What the demo adds sits beside it, as a user's script would: its model
config and dataset, a forward step that records the losses, and a second post-wrap hook (after
the plugin's) that tags each iteration for the independent evidence and digests gradients and
parameters around the optimizer's copy of the new parameters (where, as with Transformer
Engine's FP8 parameters, the FP8 copies become stale). It writes ``rank{N}.json`` in the shape
:func:`lab.demo.launch.alignment_problems` judges.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch

from nemo_fp8_align.config import AlignConfig
from lab.demo.mcore_versions import optimizer_instances
from lab.demo.ranks import write_error, write_result

__all__ = ["megatron_lm_argv", "run_rank"]


def megatron_lm_argv(opts: Any, *, exit_at: Optional[int], save: Optional[str],
                     load: Optional[str]) -> List[str]:
    """Megatron-LM's command line for the demo's shape (CPU, gloo, mock data)."""
    m = opts.model
    argv = [
        "--pipeline-model-parallel-size", str(opts.pp),
        "--num-virtual-stages-per-pipeline-rank", str(opts.vp),
        "--num-layers", str(opts.pp * opts.vp * m.layers_per_chunk),
        "--hidden-size", str(m.hidden_size), "--num-attention-heads", str(m.num_heads),
        "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length),
        "--vocab-size", str(m.vocab_size), "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", str(opts.micro_batch_size),
        "--global-batch-size", str(opts.micro_batch_size * opts.dp * opts.microbatches),
        "--train-iters", str(opts.steps), "--lr", "1e-3", "--min-lr", "1e-3",
        "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "1.0",
        "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
        "--ddp-bucket-size", "20000", "--distributed-backend", "gloo",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--use-cpu-initialization", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
        "--no-persist-layer-norm", "--num-workers", "0", "--eval-iters", "0",
        "--eval-interval", "100000", "--log-interval", "1", "--seed", str(m.seed),
    ]
    if opts.group_size is not None:
        argv += ["--microbatch-group-size-per-virtual-pipeline-stage", str(opts.group_size)]
    if opts.dist_opt_instances > 1:
        argv += ["--num-distributed-optimizer-instances", str(opts.dist_opt_instances)]
    if save:
        # As a user stops a job early: same --train-iters (the LR schedule is checked against
        # it on load), --exit-interval and a checkpoint at that iteration.
        argv += ["--save", save, "--save-interval", str(exit_at), "--exit-interval",
                 str(exit_at), "--ckpt-format", "torch"]
    if load:
        argv += ["--load", load, "--ckpt-format", "torch"]
    # The demo GPT draws no random numbers while training (no dropout); the RNG states the
    # checkpoint would carry are the CPU stand-ins' (cpu_redirects_megatron_lm), not real ones.
    argv += ["--no-save-rng", "--no-load-rng"]
    return argv


class _Dataset(torch.utils.data.Dataset):
    """Random tokens, a fixed function of the global sample index (resumes see the same)."""

    def __init__(self, size: int, opts: Any) -> None:
        self.size, self.model = size, opts.model

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.model.seed * 7919 + i)
        t = torch.randint(0, self.model.vocab_size, (self.model.seq_length + 1,), generator=gen)
        return {"tokens": t[:-1], "labels": t[1:]}


class _Bookkeeping:
    """The demo's own record of each iteration (a post-wrap hook after the plugin's)."""

    def __init__(self, opts: Any, model_cfg: Any) -> None:
        self.opts, self.model_cfg = opts, model_cfg
        self.chunks: List[Any] = []
        self.evidence: Any = None
        self.losses: Dict[int, List[float]] = {}
        self.result: Dict[str, Any] = {"grads": [], "params": [], "builds_per_step": [],
                                       "eval_builds": 0}
        self._built: Optional[List[int]] = None

    def weights(self) -> List[Any]:
        return [w for c in self.chunks for w in c.module.fp8_weights()]

    def __call__(self, model: List[Any]) -> List[Any]:
        from lab.demo.evidence import EvidenceLog

        self.chunks = list(model)
        self.evidence = EvidenceLog([c.module for c in model],
                                    [c.module.fp8_weights() for c in model],
                                    self.model_cfg.backend)
        zero = model[0].zero_grad_buffer

        def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
            self.step_starts()
            return zero(*args, **kwargs)
        model[0].zero_grad_buffer = zero_grad_buffer
        return model

    def step_starts(self) -> None:
        from megatron.training.global_vars import get_args

        self.close_step()
        self.evidence.step = int(get_args().curr_iteration)
        self._built = [w.transposes_built for w in self.weights()]

    def close_step(self) -> None:
        if self._built is not None:
            self.result["builds_per_step"].append(
                [w.transposes_built - b for w, b in zip(self.weights(), self._built)])
            self._built = None

    def optimizer_copies(self, original: Any) -> Any:
        """Wraps DistributedOptimizer._copy_main_params_to_model_params: digests around it,
        and the FP8 copies marked stale (the parameters change under them)."""
        from lab.demo.train import _digest

        def copy_main_params(optimizer: Any) -> Any:
            self.result["grads"].append(_digest([b.grad_data for c in self.chunks
                                                 for b in c.buffers]))
            out = original(optimizer)
            for w in self.weights():
                w.data_changed()
            self.result["params"].append(_digest([b.param_data for c in self.chunks
                                                  for b in c.buffers]))
            return out
        return copy_main_params


def _forward_step(book: Any):
    from megatron.training.global_vars import get_args

    if hasattr(book, "make_forward_step"):  # megatron-core's GPT on the GPU (megatron_lm_gpu)
        return book.make_forward_step()

    def forward_step(data_iterator: Any, model: Any):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["labels"])

        def loss_func(per_token: torch.Tensor):
            loss = per_token.mean()
            book.losses.setdefault(int(get_args().curr_iteration), []).append(float(loss))
            return loss, {"lm loss": loss.detach().clone()}
        return output, loss_func
    return forward_step


def _datasets(opts: Any):
    def provider(num_samples: List[int], vp_stage: Any = None):
        return tuple(_Dataset(max(int(n or 0), 1), opts) for n in num_samples)
    provider.is_distributed = True
    return provider


def _train(opts: Any, phase: Dict[str, Any], telemetry_path: Optional[str]) -> Dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import pretrain
    from megatron.training.argument_utils import (core_transformer_config_from_args,
                                                  pretrain_cfg_container_from_args)
    from megatron.training.arguments import parse_and_validate_args

    from lab.demo.megatron_lm_model import DemoGPTModelConfig
    from nemo_fp8_align.integrations import megatron_lm

    sys.argv = ["pretrain_demo_gpt"] + megatron_lm_argv(opts, **phase)
    args = parse_and_validate_args()
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        1, opts.pp, opts.vp,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    model_cfg = DemoGPTModelConfig(transformer=core_transformer_config_from_args(args),
                                   demo=opts.model, virtual_pipeline_model_parallel_size=opts.vp)
    # The transformer config the schedule reads: gloo pairs batched p2p wrongly (STACK.md).
    model_cfg.transformer.batch_p2p_comm = False
    backend = model_cfg.backend
    hook = megatron_lm.post_wrap_hook(
        backend=backend, weights_of=lambda chunk: chunk.module.fp8_weights(),
        align_config=AlignConfig(policy=opts.policy, telemetry_path=telemetry_path),
        args=_DemoArgs(args))
    book = _Bookkeeping(opts, model_cfg)
    model_cfg.post_wrap_hooks += [hook, book]
    original = DistributedOptimizer._copy_main_params_to_model_params
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    load_sd = DistributedOptimizer.load_state_dict
    DistributedOptimizer.load_state_dict = _own_step_tensors(load_sd)
    DistributedOptimizer._copy_main_params_to_model_params = book.optimizer_copies(original)
    DistributedOptimizer._set_main_param_and_optimizer_states = _load_states(set_states)
    try:
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), _datasets(opts),
                 ModelType.encoder_or_decoder, _forward_step(book))
    except SystemExit as stop:  # --exit-interval: Megatron-LM ends the job after its save
        # (it also calls sys.exit() on some load errors: only the planned stop is a success)
        if phase["exit_at"] is None or stop.code not in (0, None) \
                or len(book.result["params"]) != phase["exit_at"]:
            raise RuntimeError(f"Megatron-LM exited the job after "
                               f"{len(book.result['params'])} optimizer steps (see its log "
                               "above)") from stop
    finally:
        DistributedOptimizer._copy_main_params_to_model_params = original
        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
        DistributedOptimizer.load_state_dict = load_sd
    book.close_step()
    aligner = hook.aligners[0]
    first = int(phase["load"] is not None and opts.resume_at or 0)
    steps = sorted(book.losses)
    result = dict(book.result, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                  dp_rank=parallel_state.get_data_parallel_rank(),
                  losses=[sum(book.losses[s]) / len(book.losses[s]) for s in steps],
                  records=[asdict(r) for r in aligner.records], unlaunched_steps=[first],
                  unlaunched_forwards=aligner.unlaunched_forwards, first_step=first,
                  evidence=book.evidence.as_dict(),
                  metrics=_written(aligner),
                  bucket_groups=[len(c.bucket_groups) for c in book.chunks],
                  optimizer_instances=optimizer_instances(book.chunks))
    book.evidence.close()
    aligner.detach(agree=True)  # every rank, the same point: what is held stops every rank
    return result


def _written(aligner: Any) -> List[dict]:
    """The metrics the plugin handed to Megatron-LM's writers (its step-end listener's log)."""
    return aligner.step_end_listeners[0].func.written if aligner.attached else []


def _load_states(fn: Any) -> Any:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` as the demo needs it on
    megatron-core 0.19.2 without Transformer Engine or apex (two things a GPU run does not meet):

    * the demo trains FP32 parameters, whose main-parameter shards are views of parameters that
      require grad, and the load copies into them with autograd on, which torch refuses (with
      BF16/FP16 parameters the main parameters are separate FP32 tensors): run it under no_grad;
    * the fallback torch Adam keeps a per-parameter ``step`` tensor, which the DP-zero parameter
      state leaves out (megatron-core restores it from the optimizer's state dict instead), and
      the load then looks it up there (KeyError): a state missing from the file is skipped.
    """
    class _SkipMissing(dict):
        def __missing__(self, key: str) -> None:
            return None

    def set_states(optimizer: Any, model_param: Any, tensors: Any) -> Any:
        with torch.no_grad():
            return fn(optimizer, model_param, _SkipMissing(tensors))
    return set_states


def _own_step_tensors(fn: Any) -> Any:
    """megatron-core 0.19.2's load into the fallback torch Adam (no TE or apex) gives every
    parameter the same ``step`` tensor, which torch's Adam then increments once per parameter
    per step: the bias correction after a resume would be wrong. Each gets its own copy."""
    def load_state_dict(optimizer: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(optimizer, state_dict, *args, **kwargs)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for state in inner.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
        return out
    return load_state_dict


class _DemoArgs:
    """Megatron-LM's args as the plugin's startup check sees them in the demo: the demo's
    reference FP8 weights stand in for Transformer Engine's (there is none on the CPU), so the
    FP8 settings the check asks for are reported as set; every other argument is the real one."""

    def __init__(self, args: Any) -> None:
        self.__dict__.update(vars(args))
        self.__dict__.update(fp8="hybrid", fp8_param_gather=True,
                             transformer_impl="transformer_engine")


def run_rank(rank: int, world_size: int, port: int, opts: Any, out_dir: str,
             phase: Dict[str, Any], telemetry: bool) -> None:
    """Entry point of one spawned rank; writes ``rank{N}.json`` (or ``rank{N}.error``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from lab.demo.cpu_redirects_megatron_lm import enable_megatron_lm_cpu_compat
    from lab.demo.train import _quiet_cpu_warnings

    _quiet_cpu_warnings()
    compat = enable_megatron_lm_cpu_compat()
    try:
        path = os.path.join(out_dir, "telemetry.rank{rank}.jsonl") if telemetry else None
        result = _train(opts, phase, path)
        result["rank"] = rank
        write_result(out_dir, rank, result)
    except Exception as err:
        write_error(out_dir, rank, err)  # for the launcher to report with the other ranks'
        raise
    finally:
        compat.undo()

