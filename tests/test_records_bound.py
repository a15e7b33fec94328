"""TransposeAligner.records stays bounded over a long run (the telemetry file keeps every record)."""

import torch

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core import aligner as aligner_module
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.backends.reference import ReferenceBackend


def test_records_keep_the_newest_and_stay_bounded(monkeypatch):
    monkeypatch.setattr(aligner_module, "RECORDS_KEPT", 5)
    aligner = TransposeAligner(
        [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)], schedule=InterleavedSchedule(2, 2, 4, None),
        pp_rank=0, dp_rank=0, adapter=None, weights=[[], []], backend=ReferenceBackend(),
        config=AlignConfig())
    for step in range(100):
        aligner._step = step
        aligner._emit(0, vmid=-1, transposed=0, after_all_gather=True, seconds=None)
        assert len(aligner.records) < 10
    assert [r.step for r in aligner.records][-5:] == [95, 96, 97, 98, 99]
