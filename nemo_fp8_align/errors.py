"""The exceptions nemo_fp8_align raises, in one place, and the run-time messages (each names
what differed and the fix).

Startup: ``ScheduleError`` (a pipeline shape megatron-core would reject),
``SharedEmbeddingBucketError`` (megatron-core 0.12.3's bucket bug under NeMo), ``ConfigLoadError``,
``PlanInputError`` and ``TelemetryError`` (the command line's inputs),
``UnsupportedSetupError`` (a megatron-core setting the plugin cannot align); the config check's
``FP8AlignConfigError`` lives with its ``Violation`` (``nemo_fp8_align.config_check``). Run time:
``StepMismatchError``, ``ScheduleRebindError``, ``TransposeVerifyError``, ``CudaGraphCaptureError``,
and ``StaleFP8Error`` (the reference backend read stale bytes). All are importable from
``nemo_fp8_align``.
"""

from typing import Any, List

__all__ = ["ConfigLoadError", "CudaGraphCaptureError", "PlanInputError",
           "ScheduleError", "ScheduleRebindError", "SharedEmbeddingBucketError", "StaleFP8Error",
           "StepMismatchError", "TelemetryError", "TransposeVerifyError", "UnsupportedSetupError"]


class ScheduleError(ValueError):
    """A pipeline shape megatron-core's interleaved schedule would reject."""


class UnsupportedSetupError(ValueError):
    """A megatron-core setting the plugin cannot align (the table in
    ``nemo_fp8_align/support.py``)."""


class PlanInputError(ValueError):
    """A plan input that does not describe a runnable configuration."""


class SharedEmbeddingBucketError(RuntimeError):
    """megatron-core 0.12.3 put a parameter into two buckets of one gradient buffer."""


class ConfigLoadError(Exception):
    """The config file is missing, unreadable, or Hydra could not compose it."""


class StaleFP8Error(RuntimeError):
    """An FP8 copy or transpose was read that does not match the parameter's current bytes."""


class TelemetryError(ValueError):
    """Telemetry that cannot be read as this project's records."""


class StepMismatchError(RuntimeError):
    """The running step differs from the schedule the aligner planned (raised on every rank)."""


class TransposeVerifyError(RuntimeError):
    """Verify mode found a cached transpose that does not match its weight's bytes."""


class CudaGraphCaptureError(RuntimeError):
    """Aligned transposes fell due inside a CUDA-graph capture (they would replay on old bytes)."""


class MetricsError(RuntimeError):
    """The step's metrics could not be gathered on some rank (raised on every rank)."""


class MegatronLMArgsError(ValueError):
    """Megatron-LM's arguments have settings that stop the plugin from working."""


class ScheduleRebindError(RuntimeError):
    """The config functions the aligner wrapped were replaced after it attached."""


def _shape(s: Any) -> str:
    return f"PP={s.pp}, VP={s.vp}, M={s.microbatches}, N={s.n}"


def _why(s: Any, ran: int) -> str:
    """The likely cause of a step of ``ran`` forwards where the schedule has ``s.total``."""
    if ran % s.vp == 0:
        return (f"as many as M={ran // s.vp} microbatches would run: num_microbatches changed "
                "without the aligner being told (pass num_microbatches as a function, e.g. "
                "megatron-core's get_num_microbatches, to align_fp8_transposes, or keep M fixed)")
    return (f"not a whole number of microbatches (VP={s.vp} forwards each): a model chunk ran a "
            "forward with gradients outside the schedule (e.g. an extra call of a chunk inside "
            "forward_step_func), or one of the schedule's forwards did not reach the chunk")


def step_mismatch(step: int, pp_rank: int, s: Any, ran: int, what: str) -> StepMismatchError:
    """``what`` says what differed (e.g. "ran 9 forwards"); ``ran``: forwards counted."""
    return StepMismatchError(
        f"nemo_fp8_align: training step {step} on pipeline rank {pp_rank} {what}, but its "
        f"schedule ({_shape(s)}) has {s.total} forwards per rank: {_why(s, ran)}.")


def wrong_chunk(step: int, pp_rank: int, s: Any, vmid: int, chunk: int) -> StepMismatchError:
    return StepMismatchError(
        f"nemo_fp8_align: forward {vmid} of step {step} on pipeline rank {pp_rank} ran model "
        f"chunk {chunk}, but the interleaved schedule ({_shape(s)}) runs chunk "
        f"{s.chunk_of(vmid)} there: either an extra (or a missing) chunk forward earlier in "
        "this step on this rank (a chunk called outside the schedule), or a schedule other than "
        "the aligner's (check num_microbatches and microbatch_group_size_per_vp_stage).")


def inside_capture(step: int, vmid: int, due: List[int]) -> CudaGraphCaptureError:
    where = "the start" if vmid < 0 else f"forward {vmid}"
    return CudaGraphCaptureError(
        f"nemo_fp8_align: the aligned transposes of model chunks {due} are due at {where} of "
        f"step {step}, which runs inside a CUDA-graph capture. Capture graphs of layers outside "
        "training steps (not whole steps: megatron-core's cuda_graph_scope=full_iteration), or "
        "set fp8_transpose_align.policy=lazy.")


def rebound(name: str) -> ScheduleRebindError:
    return ScheduleRebindError(
        f"nemo_fp8_align: config.{name} was replaced after the aligner wrapped it, so the "
        "aligner no longer sees the schedule (Megatron-LM's train() binds param_sync_func and "
        "finalize_model_grads_func right before its training loop). In Megatron-LM's or "
        "Megatron-Bridge's loop attach with nemo_fp8_align.integrations.megatron_lm (it hooks "
        "the DDP chunks, so that rebinding is expected); elsewhere call align_fp8_transposes "
        "after those functions are bound, i.e. after 'config.finalize_model_grads_func = "
        "finalize_model_grads'.")


def foreign_param_sync() -> ScheduleRebindError:
    return ScheduleRebindError(
        "nemo_fp8_align: config.param_sync_func holds functions that are not the model chunks' "
        "start_param_sync, so the aligner (attached to the chunks for Megatron-LM's loop) does "
        "not see the schedule's all-gather launches. Bind config.param_sync_func = "
        "[chunk.start_param_sync for chunk in model] (what Megatron-LM's train() does), or leave "
        "it to the training loop.")
