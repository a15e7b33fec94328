"""One rank of ``demo --loop megatron-lm --device cuda``: Megatron-LM's own ``pretrain``/``train()``
(megatron-core >= 0.19's ``megatron.training``) on a GPU, with megatron-core's GPT built by
Megatron-LM's own model config (``gpt_config_from_args``: the Transformer Engine layer spec, TE
``Float8Tensor`` weights from ``--fp8-param-gather``), and the plugin attached as README.md says:
``model_cfg.post_wrap_hooks.append(megatron_lm.post_wrap_hook())`` (no arguments under the
default ``aligned`` policy; ``lazy`` and ``off`` pass only their ``AlignConfig``).

Several ranks share the one GPU (CUDA MPS splits its SMs between the rank processes): NCCL
refuses two ranks of one communicator on one GPU, so the ranks' groups are made before
``pretrain`` on a backend that works there, from a source checkout: ``host_staging``
(lab/host_staging.py: gloo with CUDA tensors staged through host memory) or ``mps_ipc``
(benchmarks/mps_p2p.py: the same, with one-rank groups on the device and point-to-point over CUDA
IPC). Megatron-LM finds torch.distributed and the model-parallel groups initialised and uses
them; nothing of its loop is edited.

What the demo adds beside the loop, as a user's script would: the dataset, a forward step for
megatron-core's GPT, and a post-wrap hook after the plugin's (:class:`GpuBook`) that watches
Transformer Engine's own transpose builds (lab/transpose_watch.py's ``TransposeWatch``
on ``_create_transpose``), each chunk's first forward, every forward of the schedule (to place
each build among this rank's forwards: its observed slot), and digests of the gradients and
parameters around the distributed optimizer's copy of the new parameters.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["GROUPS", "GpuBook", "gpu_argv", "init_gpu_groups", "run_gpu_rank", "train_gpu"]

#: The process-group backends for ranks sharing one GPU: name -> (module, setup function).
GROUPS = {"host_staging": ("lab.host_staging", "enable_host_staging"),
          "mps_ipc": ("mps_p2p", "enable_mps_backend")}

#: Flags of the CPU command line that a GPU run replaces (flag -> number of values it takes).
_CPU_ONLY = {"--transformer-impl": 1, "--use-cpu-initialization": 0, "--no-save-rng": 0,
             "--no-load-rng": 0, "--distributed-backend": 1, "--eval-iters": 1,
             "--eval-interval": 1, "--log-interval": 1}


def checkout_root() -> str:
    """The checkout this lab sits in (its validation/ and benchmarks/ are beside lab/)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_argv(cpu_argv: List[str], *, eval_interval: int, log_interval: int,
             recipe: str = "delayed") -> List[str]:
    """The demo's Megatron-LM command line for a GPU: Transformer Engine layers, FP8 (hybrid,
    ``recipe``: delayed scaling by default, or blockwise for TE ``Float8BlockwiseQTensor``
    weights) with FP8 parameters gathered, BF16, the distributed optimizer with overlapped and
    aligned parameter all-gathers (the CPU line already has those), and an evaluation every
    ``eval_interval`` iterations (0: none)."""
    if recipe not in ("delayed", "tensorwise", "blockwise"):
        raise ValueError(f"recipe={recipe!r}: Megatron-LM on the GPU runs delayed, tensorwise or "
                         "blockwise here (MXFP8 and NVFP4 need Blackwell); pick one of those")
    out, i = [], 0
    while i < len(cpu_argv):
        n = _CPU_ONLY.get(cpu_argv[i])
        if n is None:
            out.append(cpu_argv[i])
            i += 1
        else:
            i += 1 + n
    out += ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
            "--fp8-recipe", recipe, "--fp8-param-gather", "--bf16",
            "--attention-backend", "unfused", "--distributed-backend", "nccl",
            "--log-interval", str(log_interval)]
    if eval_interval:
        out += ["--eval-interval", str(eval_interval), "--eval-iters", "1"]
    else:
        out += ["--eval-interval", "1000000", "--eval-iters", "0"]
    return out


def init_gpu_groups(rank: int, world_size: int, groups: str) -> Dict[str, Any]:
    """torch.distributed on ``groups`` (see :data:`GROUPS`) for a rank sharing GPU 0."""
    if groups not in GROUPS:
        raise ValueError(f"groups={groups!r}: choose one of {sorted(GROUPS)}")
    root = checkout_root()
    for path in (root, os.path.join(root, "benchmarks")):
        if path not in sys.path:
            sys.path.insert(0, path)
    module_name, setup = GROUPS[groups]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RuntimeError(
            f"demo --device cuda: the process groups for ranks sharing one GPU ({module_name}) "
            f"come from the checkout's validation/ and benchmarks/, not found under {root}; run "
            "python -m lab.demo from a full checkout") from err
    os.environ["LOCAL_RANK"] = "0"  # every rank's device is the one GPU
    torch.cuda.set_device(0)
    torch.distributed.init_process_group(getattr(module, setup)(), rank=rank,
                                         world_size=world_size)
    info: Dict[str, Any] = {"groups": groups}
    if groups == "mps_ipc":
        info.update(module.probe_ipc())  # "ipc", or "host" where IPC fails
    return info


def no_dataset_helpers() -> Callable[[], None]:
    """Megatron-LM compiles its C++ dataset index helpers at start (rank 0, ``make``); the demo
    brings its own dataset and needs none: that compile is skipped. Returns the undo."""
    from megatron.core.datasets import utils

    original = utils.compile_helpers
    utils.compile_helpers = lambda: None
    return lambda: setattr(utils, "compile_helpers", original)


def gpt_forward_step(book: "GpuBook") -> Callable[[Any, Any], Any]:
    """Megatron-LM's forward step for megatron-core's GPT on the demo's dataset."""
    from megatron.training.global_vars import get_args

    def forward_step(data_iterator: Any, model: Any):
        batch = next(data_iterator)
        tokens = batch["tokens"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(per_token: torch.Tensor):
            loss = per_token.float().mean()
            if torch.is_grad_enabled():
                # A copy: the schedule divides the returned loss by M in place.
                book.losses.setdefault(int(get_args().curr_iteration), []).append(
                    loss.detach().clone())
            return loss, {"lm loss": loss.detach().clone()}
        return output, loss_func
    return forward_step


class GpuBook:
    """The demo's record of each iteration on the GPU (a post-wrap hook after the plugin's).

    ``checks``: watch TE's builds, first uses and forwards, digest gradients and parameters
    (off for timing). ``on_step``: called at each iteration's start with the iteration number
    and the chunks (the step-time benchmark switches policies and starts its clock there);
    ``on_model``: called once with the chunks and their FP8 weights."""


    def __init__(self, *, opts: Any = None, checks: bool = True,
                 on_step: Optional[Callable[[int, List[Any]], None]] = None,
                 on_model: Optional[Callable[[List[Any], List[List[Any]]], None]] = None) -> None:
        self.opts, self.checks, self.on_step, self.on_model = opts, checks, on_step, on_model
        self.chunks: List[Any] = []
        self.weights: List[List[Any]] = []
        self.losses: Dict[int, List[torch.Tensor]] = {}
        self.result: Dict[str, Any] = {"grads": [], "params": [], "forwards": []}
        self.step = -1
        self.watch: Any = None
        self.probe: Any = None
        self._undo: List[Callable[[], None]] = []
        if checks:
            from lab.transpose_watch import TransposeWatch

            # On the class before the plugin attaches (see real_stack_mcore's note).
            self.watch = TransposeWatch().install()
            self._undo.append(self.watch.uninstall)
            self._time_forwards()

    def __call__(self, model: List[Any]) -> List[Any]:
        from nemo_fp8_align.backends.te import TEBackend

        self.chunks = list(model)
        backend = TEBackend()
        self.weights = [list(backend.weights_of(c)) for c in model]
        if self.on_model is not None:
            self.on_model(self.chunks, self.weights)
        if self.checks:
            from lab.transpose_watch import FirstUseProbe

            for c, ws in enumerate(self.weights):
                self.watch.watch(c, ws, prefix="")
            self.probe = FirstUseProbe(self.chunks, self.weights, backend)
            self._undo.append(self.probe.remove)
        zero = model[0].zero_grad_buffer

        def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
            self.step_starts()
            return zero(*args, **kwargs)
        model[0].zero_grad_buffer = zero_grad_buffer
        return model

    def make_forward_step(self) -> Callable[[Any, Any], Any]:
        """The forward step the demo hands to ``pretrain`` (megatron_lm_loop's asks for it)."""
        return gpt_forward_step(self)

    def step_starts(self) -> None:
        from megatron.training.global_vars import get_args

        self.step = int(get_args().curr_iteration)
        if self.on_step is not None:
            self.on_step(self.step, self.chunks)
        if self.checks:
            self.watch.step, self.watch.phase = self.step, "fwd_bwd"
            self.probe.start_step(self.step)

    def _time_forwards(self) -> None:
        """Host times of every training forward of the schedule (module global, looked up at
        each call): a build's place among this rank's forwards is its observed slot."""
        from megatron.core.pipeline_parallel import schedules

        original, book = schedules.forward_step, self

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            out = original(*args, **kwargs)
            if torch.is_grad_enabled():
                book.result["forwards"].append([book.step, t0, time.monotonic()])
            return out
        schedules.forward_step = forward_step
        self._undo.append(lambda: setattr(schedules, "forward_step", original))

    def optimizer_copies(self, original: Any) -> Any:
        """Wraps DistributedOptimizer._copy_main_params_to_model_params: digests around it;
        what TE builds after it, until the next iteration, is the forced all-gathers' of an
        evaluation or a checkpoint save (phase "eval")."""
        from lab.demo.train import _digest

        def copy_main_params(optimizer: Any) -> Any:
            if self.checks:
                self.result["grads"].append(_digest([b.grad_data for c in self.chunks
                                                     for b in c.buffers]))
                self.watch.phase = "optimizer"
            out = original(optimizer)
            if self.checks:
                self.result["params"].append(_digest([b.param_data for c in self.chunks
                                                      for b in c.buffers]))
                self.watch.phase = "eval"
            return out
        return copy_main_params

    def mean_losses(self) -> List[float]:
        return [float(torch.stack(self.losses[s]).mean()) for s in sorted(self.losses)]

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def plugin_hook(policy: Any) -> Any:
    """The plugin's post-wrap hook as README.md writes it: no arguments under the default policy
    (aligned); the other policies pass only their ``AlignConfig``."""
    from nemo_fp8_align.config import AlignConfig, Policy
    from nemo_fp8_align.integrations import megatron_lm

    if Policy(policy) is AlignConfig().policy:
        return megatron_lm.post_wrap_hook()
    return megatron_lm.post_wrap_hook(align_config=AlignConfig(policy=Policy(policy)))


def train_gpu(opts: Any, phase: Dict[str, Any], book: GpuBook, *, attach_plugin: bool = True,
              eval_interval: int = 0, log_interval: int = 1,
              early_exit_ok: bool = False) -> Dict[str, Any]:
    """Megatron-LM's ``pretrain`` on the GPU for this rank (groups already made); returns what
    the rank saw. ``attach_plugin=False``: the caller attaches it itself (the benchmark, which
    also ends the job early by setting ``args.exit_interval``: ``early_exit_ok``)."""
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training import pretrain
    from megatron.training.argument_utils import (gpt_config_from_args,
                                                  pretrain_cfg_container_from_args)
    from megatron.training.arguments import parse_and_validate_args

    from lab.demo.megatron_lm_loop import _datasets, megatron_lm_argv

    sys.argv = ["pretrain_demo_gpt"] + gpu_argv(megatron_lm_argv(opts, **phase),
                                                eval_interval=eval_interval,
                                                log_interval=log_interval, recipe=opts.recipe)
    args = parse_and_validate_args()
    if phase["load"]:
        # TE 2.20 refuses to unpickle delayed-scaling FP8 metadata from a checkpoint unless told
        # the file is trusted; this one was written by the demo's own first job moments ago.
        os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            1, opts.pp, opts.vp,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    model_cfg = gpt_config_from_args(args)
    # As on the CPU: the demo's groups pair batched p2p wrongly (gloo underneath); and
    # bit-identical runs across policies need TE's deterministic algorithms.
    model_cfg.transformer.batch_p2p_comm = False
    model_cfg.transformer.deterministic_mode = True
    hook = plugin_hook(opts.policy) if attach_plugin else None
    model_cfg.post_wrap_hooks += ([hook] if hook is not None else []) + [book]
    original = DistributedOptimizer._copy_main_params_to_model_params
    DistributedOptimizer._copy_main_params_to_model_params = book.optimizer_copies(original)
    undo_helpers = no_dataset_helpers()
    from lab.demo.megatron_lm_loop import _forward_step
    try:
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), _datasets(opts),
                 ModelType.encoder_or_decoder, _forward_step(book))
    except SystemExit as stop:  # --exit-interval: Megatron-LM ends the job after its save
        planned = early_exit_ok or (phase["exit_at"] is not None
                                    and len(book.result["params"]) == phase["exit_at"])
        if stop.code not in (0, None) or not planned:
            raise RuntimeError(f"Megatron-LM exited the job after "
                               f"{len(book.result['params'])} optimizer steps (see its log "
                               "above)") from stop
    finally:
        DistributedOptimizer._copy_main_params_to_model_params = original
        undo_helpers()
    torch.cuda.synchronize()
    aligner = hook.aligners[0] if hook is not None and hook.aligners else None
    records = [] if aligner is None else [dict(vars(r)) for r in aligner.records]
    result = dict(book.result, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                  dp_rank=parallel_state.get_data_parallel_rank(), losses=book.mean_losses(),
                  records=records, first_step=int(phase["load"] is not None and opts.resume_at
                                                   or 0),
                  weights=[len(w) for w in book.weights],
                  weight_types=sorted({type(w).__name__ for ws in book.weights for w in ws}),
                  events=book.watch.events if book.watch is not None else [],
                  first_use_valid={str(s): {str(c): v for c, v in cs.items()}
                                   for s, cs in (book.probe.valid.items()
                                                 if book.probe is not None else [])},
                  unlaunched_forwards=0 if aligner is None else aligner.unlaunched_forwards)
    try:
        if aligner is not None:  # every rank, the same point: what is held stops every rank
            aligner.detach(agree=True)
    finally:
        book.close()
    return result


def run_gpu_rank(rank: int, world_size: int, port: int, opts: Any, out_dir: str,
                 phase: Dict[str, Any]) -> None:
    """Entry point of one spawned rank of ``demo --loop megatron-lm --device cuda``; writes
    ``rank{N}.json`` (or ``rank{N}.error``). Every rank shares GPU 0."""
    from lab.demo.ranks import write_error, write_result

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        groups = init_gpu_groups(rank, world_size, opts.gpu_groups)
        result = train_gpu(opts, phase, GpuBook(opts=opts), eval_interval=opts.eval_interval)
        result.update(rank=rank, process_groups=groups)
        write_result(out_dir, rank, result)
    except Exception as err:
        write_error(out_dir, rank, err)  # for the launcher to report with the other ranks'
        raise
