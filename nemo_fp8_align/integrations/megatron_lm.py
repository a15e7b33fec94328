"""The plugin in Megatron-LM's own training loop (``megatron.training.pretrain`` / ``train()``, as
shipped in the megatron-core >= 0.19 wheel), with no edit of the loop: one post-wrap hook::

    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from nemo_fp8_align.integrations import megatron_lm

    model_cfg = gpt_config_from_args(args)
    model_cfg.post_wrap_hooks.append(megatron_lm.post_wrap_hook())
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)

(with a ``model_provider`` instead of a model config, call :func:`attach` on the DDP chunks
wherever the script has them before ``train()``). The hook checks Megatron-LM's arguments with
the startup check's rules (every violation at once, named by flag), then attaches the aligner to
the DDP chunks themselves: ``train()`` binds ``config.param_sync_func = [chunk.start_param_sync
for chunk in model]`` after the hook ran, sets it to None for its first iteration (which then
runs lazily, counted in ``aligner.unlaunched_forwards``) and puts it back, and every binding
finds the plugin's wrappers. With ``log_metrics`` the per-step metrics
(:mod:`~nemo_fp8_align.core.metrics`) go to Megatron-LM's TensorBoard and W&B
writers every ``--log-interval`` iterations.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional, Sequence

from nemo_fp8_align.adapters.groups import pipeline_group
from nemo_fp8_align.assemble import DERIVED, assemble
from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.errors import MegatronLMArgsError

__all__ = ["MegatronLMArgsError", "attach", "check_args", "post_wrap_hook"]


def check_args(args: Any, world_size: Optional[int] = None) -> None:
    """Raise :class:`MegatronLMArgsError` listing every violation in ``args`` (Megatron-LM's
    parsed arguments, ``megatron.training.get_args()``)."""
    from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
    from nemo_fp8_align.mcore_versions import importable_rules

    found = megatron_lm_violations(vars(args), world_size=world_size, mcore=importable_rules())
    if found:
        lines = "\n".join(f"  - {v}" for v in found)
        raise MegatronLMArgsError(
            f"{len(found)} Megatron-LM argument(s) stop the aligned FP8-transpose plugin from "
            f"working:\n{lines}\nApply the fixes above, or do not attach the plugin.")


def attach(model: Sequence[Any], *, backend: Any = None,
           weights_of: Optional[Callable[[Any], List[Any]]] = None,
           align_config: AlignConfig = AlignConfig(), args: Any = None,
           log_metrics: bool = True, step_number: Optional[Callable[[], int]] = None,
           pg_collection: Any = None, error_group: Any = None, optimizer: Any = None) -> Any:
    """Attach the aligner to Megatron-LM's DDP model chunks; returns it.

    Args:
        model: the DDP-wrapped chunks (what ``setup_model_and_optimizer`` returns).
        backend: the FP8 backend (default: Transformer Engine's, built from ``align_config``).
        weights_of: a chunk's FP8 weights (default: the backend's ``weights_of``).
        align_config: policy and telemetry.
        args: Megatron-LM's arguments to check (default ``megatron.training.get_args()``;
            None and no Megatron-LM globals: not checked).
        log_metrics: write the per-step metrics through Megatron-LM's writers.
        step_number: numbers each step's records (default: Megatron-LM's iteration).
        pg_collection: the ``ProcessGroupCollection`` the model was built with (None: the
            chunks' own groups, else ``parallel_state``; :mod:`~.groups`).
        error_group: the ranks that stop together on an error (None: every rank of the model,
            derived from ``pg_collection``).
        optimizer: the optimizer ``setup_model_and_optimizer`` returned; needed only on
            megatron-core 0.7/0.8, whose DistributedOptimizer owns the all-gather (not run with
            a Megatron-LM checkout of that era).
    """
    import torch

    from megatron.core.utils import get_model_config

    args = _megatron_args() if args is None else args

    def startup_check() -> None:  # inside the attach's agreement: one rank failing stops all
        if args is not None and align_config.active:
            check_args(args, torch.distributed.get_world_size()
                       if torch.distributed.is_initialized() else None)
    # Built before the aligner: nothing is attached yet if it fails.
    writer = WriterMetrics(args, group=pipeline_group(model, pg_collection)) \
        if log_metrics else None
    aligner = assemble(
        list(model), num_microbatches=_num_microbatches_getter(), backend=backend,
        weights_of=weights_of, config=get_model_config(model[0]), align_config=align_config,
        pg_collection=pg_collection, optimizer=optimizer,
        error_group=DERIVED if error_group is None else error_group, startup_check=startup_check)
    try:
        if step_number is not None:
            aligner.step_number = step_number
        elif _megatron_args() is not None:  # numbered by Megatron-LM's iteration (resumes go on)
            aligner.step_number = _current_iteration
        if writer is not None and aligner.attached:  # at each step end, before its agreement
            aligner.step_end_listeners.append(partial(writer, aligner))
    except BaseException:
        aligner.detach()  # all or nothing
        raise
    return aligner


def _num_microbatches_getter() -> Callable[[], int]:
    """Megatron-LM's microbatch count: megatron-core's calculator (0.8 on), else Megatron-LM's
    own of the 0.7 era (``megatron.training.global_vars``; megatron-core 0.7 has none)."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
    except ModuleNotFoundError as err:
        if err.name != "megatron.core.num_microbatches_calculator":
            raise
        from megatron.training.global_vars import get_num_microbatches
    return get_num_microbatches


def _current_iteration() -> int:
    return int(_megatron_args().curr_iteration)


def post_wrap_hook(**kwargs: Any) -> Callable[[List[Any]], List[Any]]:
    """A ``ModelConfig.post_wrap_hooks`` entry that calls :func:`attach` with ``kwargs``; the
    aligners it attached are kept on it (``hook.aligners``)."""
    def fp8_align_post_wrap_hook(model: List[Any]) -> List[Any]:
        fp8_align_post_wrap_hook.aligners.append(attach(model, **kwargs))
        return model
    fp8_align_post_wrap_hook.aligners = []  # type: ignore[attr-defined]
    return fp8_align_post_wrap_hook


def _megatron_args() -> Any:
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except (ImportError, AssertionError):  # no Megatron-LM loop, or its globals not set
        return None


class WriterMetrics:
    """A step-end listener: every ``--log-interval`` iterations, gathers the step's records over
    the pipeline group (one ``all_gather_object``, on every pipeline rank at the same point:
    chunk 0's ``finish_grad_sync``) and writes them to Megatron-LM's TensorBoard / W&B writers
    where this rank has them (Megatron-LM creates them on the last rank)."""

    def __init__(self, args: Any, group: Any = None) -> None:
        self.group = group  # the model's pipeline group (None: the default group)
        self.every = max(1, int(getattr(args, "log_interval", 1) or 1))
        self.written: List[dict] = []  # what was written (the last few), for tests and logs
        self._last: Optional[int] = None

    def __call__(self, aligner: Any) -> None:
        from nemo_fp8_align.core.metrics import gather_step_metrics, last_step_records

        # Decided from the aligner's own step (the same on every rank), not from anything that
        # could fail on one rank: every rank of the group then enters the gather.
        if (aligner._step + 1) % self.every or aligner._step == self._last:
            return  # not a logging iteration, or no step ended since the last write
        step, self._last = aligner._step, aligner._step
        metrics = gather_step_metrics(
            lambda: [r for r in last_step_records(aligner.records) if r.step == step],
            group=self.group)  # a failure on one rank reaches every rank through it
        if metrics:
            iteration = _iteration(aligner)
            _write(metrics, iteration)
            self.written = (self.written + [dict(metrics, iteration=iteration)])[-8:]


def _iteration(aligner: Any) -> int:
    """Megatron-LM's iteration number of the step that ends (the one ``training_log`` uses)."""
    args = _megatron_args()
    current = getattr(args, "curr_iteration", None) if args is not None else None
    return current + 1 if isinstance(current, int) else aligner._step + 1


def _write(metrics: dict, iteration: int) -> None:
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return
    tb, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tb is not None:
        for key, value in metrics.items():
            tb.add_scalar(key, value, iteration)
    if wandb is not None:
        wandb.log(metrics, iteration)
