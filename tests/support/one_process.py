"""Running multi-rank code in one test process (shared by the tests that need it)."""

import contextlib
import os

import torch.distributed as dist


@contextlib.contextmanager
def gloo_world():
    """A 1-process gloo world with the demo's CPU shims; parallel_state is the caller's (it is
    destroyed on the way out if the caller initialised it)."""
    from megatron.core import parallel_state

    from lab.demo.cpu_redirects import enable_cpu_compat
    from lab.demo.ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    compat = enable_cpu_compat()
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        compat.undo()
        dist.destroy_process_group()


def agree_alone(monkeypatch):
    """With torch.distributed faked as initialised but no process group, the step-end /
    startup agreement raises this rank's own error, as it does with one rank (the agreement
    itself runs on several processes in the multi-rank tests)."""
    import nemo_fp8_align.core.step_end as step_end

    def agree(own, **kw):
        if own is not None:
            raise own
    monkeypatch.setattr(step_end, "agree", agree)
