"""An error found inside a step is held for the step end (one simulated rank; the multi-rank
run is tests/test_no_hang.py)."""

import pytest
import torch

from nemo_fp8_align.core.step_end import combined_error
from nemo_fp8_align.errors import CudaGraphCaptureError, StepMismatchError, TransposeVerifyError

from support.aligner_rank import make_rank, run_training_step


def with_finalize(**kw):
    r = make_rank(pp=2, vp=2, m=2, rank=1, **kw)
    assert r.aligner.attach()
    return r


def finalize(r):
    """megatron-core's finalize_model_grads: chunk 0's finish_grad_sync first."""
    r.chunks[0].finish_grad_sync()


def test_a_wrong_chunk_is_held_for_finalize_and_the_step_finishes_without_the_plugin():
    r = with_finalize()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    r.chunks[1](torch.ones(1))  # forward 0 is chunk 0's: found here, not raised inside the step
    for v in range(1, r.schedule.total):  # the rest of the step: nothing counted or built
        r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    assert r.sync.done == {0}  # chunk 1 left to DDP's own pre-hooks, as with the plugin off
    with pytest.raises(StepMismatchError, match="forward 0 of step 0 on pipeline rank 1 ran "
                                                "model chunk 1.*either an extra"):
        finalize(r)
    # Every rank raises at this same point, after waiting for the gradient collectives in
    # flight on every chunk (finalize_model_grads' own waits), so none is left behind.
    assert [c.grad_syncs for c in r.chunks] == [1, 1]
    r.sync.new_step()
    run_training_step(r)  # the next step is judged alone: passes (its end included)
    assert [(x.step, x.chunk) for x in r.aligner.records][-2:] == [(1, 0), (1, 1)]


def test_a_capture_refusal_is_held_for_finalize(monkeypatch):
    import nemo_fp8_align.core.aligner as aligner_mod

    r = with_finalize()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    monkeypatch.setattr(aligner_mod, "_capturing_cuda_graph", lambda: True)
    for v in range(r.schedule.total):
        r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    with pytest.raises(CudaGraphCaptureError, match=r"chunks \[1\] are due at forward 1"):
        finalize(r)


def test_a_short_step_says_what_differed():
    r = with_finalize()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    for v in range(3):  # 3 of 4 forwards: not a whole number of microbatches
        r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    with pytest.raises(StepMismatchError, match="ran 3 forwards.*not a whole number of "
                                                "microbatches"):
        finalize(r)


def test_without_a_step_end_the_error_is_raised_at_the_next_steps_first_launch():
    """A loop that never calls finalize_model_grads: the next step's first launch (before any
    pipeline communication, the same point on every rank) ends the step instead. Never raised
    inside the schedule, where the peers would block in their receives."""
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    r.chunks[1](torch.ones(1))  # held
    with pytest.raises(StepMismatchError, match="ran model chunk 1"):
        r.config.param_sync_func[0]()
    r.aligner.on_step_end()  # nothing held any more


def test_a_caller_ending_steps_itself_gets_the_error_at_on_step_end():
    """NeMo's path: attached without the model config, on_step_end called after fwd_bwd_step."""
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    for chunk in (0, 1):
        r.sync.launcher(chunk)()
        r.aligner.on_param_sync_launched(chunk)
    r.chunks[1](torch.ones(1))
    with pytest.raises(StepMismatchError, match="ran model chunk 1"):
        r.aligner.on_step_end()
    r.aligner.on_step_end()  # nothing held any more


def test_combined_messages_put_each_ranks_own_first():
    mine = TransposeVerifyError("nemo_fp8_align verify: step 3 ... weight w: bytes differ")
    reports = [None, ("rank 1 (pipeline rank 1)", "TransposeVerifyError", str(mine)),
               ("rank 2 (pipeline rank 0)", "StepMismatchError", "forward 2 ran chunk 0")]
    err = combined_error(mine, "rank 1 (pipeline rank 1)", reports)
    assert type(err) is TransposeVerifyError
    lines = str(err).splitlines()
    assert lines[0] == str(mine)
    assert "on all 3 ranks" in lines[1] and "2 found a problem" in lines[1]
    assert lines[2:] == ["  rank 2 (pipeline rank 0): StepMismatchError: forward 2 ran chunk 0"]
    calm = combined_error(None, "rank 0 (pipeline rank 0)", reports)
    assert type(calm) is TransposeVerifyError  # the first failing rank's class
    assert str(calm).startswith("nemo_fp8_align: rank 0 (pipeline rank 0) found no problem")
    assert len(str(calm).splitlines()) == 3


# --- issue 40: every failure of a step reaches that step's end; what is held at detach.

def test_a_listener_error_is_raised_at_the_same_step_end_the_last_one_included():
    """A step end's listeners (and its telemetry flush) run before its agreement: a failure
    there is raised at that step's end, not held for a next one that the last step never
    has. Every listener runs, whatever the others did."""
    r = with_finalize()
    ran = []

    def failing():
        ran.append("failing")
        raise OSError("listener I/O")
    r.aligner.step_end_listeners += [failing, lambda: ran.append("next")]
    with pytest.raises(OSError, match="listener I/O"):
        run_training_step(r)
    assert ran == ["failing", "next"]
    r.aligner.step_end_listeners.clear()
    r.aligner.detach(agree=True)  # nothing held any more


class _Watch:
    def __init__(self, failures):
        self.failures = failures

    def take_failures(self):
        failures, self.failures = self.failures, []
        return failures


def test_what_is_held_at_detach_raises_with_agree_and_is_logged_without(monkeypatch, caplog):
    """A failure after the last step end (a forced all-gather's rebuild in a final evaluation):
    ``detach(agree=True)``, where every rank detaches at the same point, raises it (on every
    rank: tests/test_no_hang.py); the local ``detach()`` of an exception path only logs it."""
    from nemo_fp8_align.errors import StaleFP8Error

    for agree in (True, False):
        r = with_finalize()
        run_training_step(r)
        watch = _Watch([StaleFP8Error("rebuild failed after the last step")])
        monkeypatch.setattr(type(r.aligner), "forced_syncs", property(lambda self: watch))
        if agree:
            with pytest.raises(StaleFP8Error, match="rebuild failed after the last step"):
                r.aligner.detach(agree=True)
        else:
            r.aligner.detach()
            assert "detached with an error no step end reported" in caplog.text
        assert not r.aligner.attached  # detached either way
        monkeypatch.undo()
