"""The NeMo session's per-step metrics (issue 40): rank 0's ``log_dict`` runs after the gather
on rank 0 alone; a logger failing there must stop every rank with the plugin's error, not leave
the others training on into collectives rank 0 never reaches. Two gloo ranks call
``NeMoSession.log_metrics`` as NeMo's batch end does, rank 0's logger raising."""

import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")

from support.rank_errors import check_every_rank_raised  # noqa: E402


class _Module:
    """What ``log_step_metrics`` reads of a NeMo model: ``log_dict`` (rank 0's fails)."""

    def __init__(self, rank):
        self.rank, self.logged = rank, []

    def log_dict(self, metrics, **kwargs):
        if self.rank == 0:
            raise OSError("injected: the experiment logger's disk is full")
        self.logged.append(metrics)


def _record(step, pp_rank):
    from nemo_fp8_align.core.telemetry import TransposeRecord

    return TransposeRecord(step=step, pp_rank=pp_rank, dp_rank=0, chunk=0, policy="aligned",
                           backend="fake", vmid=-1, slot=0, aligned_slot=0, transposed=1,
                           weights=1, after_all_gather=True, seconds=0.001, t_slot=1.0,
                           t_done=1.001)


def _log_rank(rank, world_size, port, out_dir):
    import torch.distributed as dist

    from nemo_fp8_align.config import AlignConfig
    from nemo_fp8_align.integrations.nemo.build import FP8Weights
    from nemo_fp8_align.integrations.nemo.session import NeMoSession
    from lab.demo.ranks import write_error, write_result

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=20))
    try:
        session = NeMoSession(_Module(rank), AlignConfig(), weights=FP8Weights.REFERENCE)
        detached = []
        session.aligner = SimpleNamespace(records=[_record(1, rank)], _error_group=None,
                                          detach=lambda **kw: detached.append(kw))
        session._stepped = True
        trainer = SimpleNamespace(global_step=1, log_every_n_steps=1,
                                  is_global_zero=rank == 0)
        try:
            session.log_metrics(trainer)
            raised = None
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            raised = (f"rank {rank}: {type(err).__name__}: {err}", time.time())
        write_result(out_dir, rank, {"raised": raised, "detached": detached,
                                     "attached_after": session.aligner is not None})
    except Exception as err:
        write_error(out_dir, rank, err)
        raise
    finally:
        dist.destroy_process_group()


def test_a_logger_failing_on_rank_0_stops_every_rank(tmp_path):
    from lab.demo.ranks import read_results, spawn_and_wait

    codes = spawn_and_wait(_log_rank, 2, (str(tmp_path),), timeout_s=30)
    ranks = read_results(str(tmp_path), codes)
    assert all(r["raised"] is not None for r in ranks), ranks  # rank 1 went on before
    stopped = SimpleNamespace(reports={i: r["raised"][0] for i, r in enumerate(ranks)},
                              times={i: r["raised"][1] for i, r in enumerate(ranks)})
    check_every_rank_raised(stopped, 2, "MetricsError",
                            "log_dict raised OSError: injected: the experiment logger's disk")
    assert "fix the trainer's logger" in ranks[0]["raised"][0]
    # every rank closed its session (a local detach, on the error's way out)
    assert all(r["detached"] == [{"agree": False}] and not r["attached_after"]
               for r in ranks), ranks
