"""GPU times of the slot from CUDA events, resolved at the step end (``core/gpu_spans.py``).

There is no GPU here: ``torch.cuda.Event`` is replaced by a stand-in on a fake GPU clock, so
what is checked is the plumbing (three marks per handled chunk, times into the chunk's record,
the telemetry line written with them at the step end, the logger preferring them), not CUDA."""

import json

import pytest

import nemo_fp8_align.core.gpu_spans as gpu_spans
from nemo_fp8_align.core.gpu_spans import GpuSpans
from nemo_fp8_align.core.telemetry import TelemetryWriter
from nemo_fp8_align.core.metrics import _compact, step_metrics

from support.aligner_rank import make_rank, run_training_step


class FakeEvent:
    gpu_now = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at, self.synced = None, False

    def record(self):
        FakeEvent.gpu_now[0] += 2.0  # the GPU is 2 ms further at each mark
        self.at = FakeEvent.gpu_now[0]

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert self.at is not None and end.at is not None
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(gpu_spans.torch.cuda, "Event", FakeEvent)


def test_records_carry_gpu_wait_and_build_and_the_file_gets_them_at_the_step_end(
        fake_cuda, tmp_path):
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    path = tmp_path / "t.jsonl"
    r.aligner.telemetry = TelemetryWriter(str(path))
    r.aligner._spans = GpuSpans(enabled=True)
    r.aligner.attach()
    run_training_step(r, end=False)
    assert all(rec.gpu_wait_ms is None for rec in r.aligner.records)  # not resolved in the step
    r.aligner.on_step_end()
    recs = r.aligner.records
    assert len(recs) == 2 and all(rec.gpu_wait_ms == 2.0 and rec.gpu_build_ms == 2.0
                                  for rec in recs)
    r.aligner.detach()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["chunk"], x["gpu_wait_ms"], x["gpu_build_ms"]) for x in lines] == \
        [(0, 2.0, 2.0), (1, 2.0, 2.0)]
    metrics = step_metrics([_compact(rec) for rec in recs])
    assert metrics["fp8_align/chunk1/wait_ms"] == 2.0  # the GPU time, not the host's


def test_without_cuda_nothing_is_held_and_records_keep_host_times(tmp_path):
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    path = tmp_path / "t.jsonl"
    r.aligner.telemetry = TelemetryWriter(str(path))
    r.aligner._spans = GpuSpans(enabled=False)
    r.aligner.attach()
    run_training_step(r)
    r.aligner.telemetry.flush()
    assert len(path.read_text().splitlines()) == 2  # written at first use, as before
    assert all(rec.gpu_wait_ms is None for rec in r.aligner.records)
