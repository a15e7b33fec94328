"""The synthetic sleep costs the CPU idle benchmark puts on a pipeline run, and a tiny run of
the benchmark itself (the real engine on gloo)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lab.demo.sleep_model import SleepCosts, attach_sleep_costs
from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight

ROOT = Path(__file__).resolve().parents[1]


class _Chunk(torch.nn.Module):
    def __init__(self, n_weights):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.w = [ReferenceFP8Weight(torch.nn.Parameter(torch.randn(2, 2))) for _ in range(n_weights)]

    def fp8_weights(self):
        return self.w

    def forward(self, x):
        return self.lin(x)


def _run(sizes=(4, 5)):
    # The benchmark's run: its DDP chunks' .module is all attach_sleep_costs reads (a real DDP
    # needs a process group; test_tiny_benchmark_run below runs the real one on gloo).
    chunks = [SimpleNamespace(module=_Chunk(n)) for n in sizes]
    run = SimpleNamespace(chunks=chunks, backend=ReferenceBackend(),
                          weights=[w for c in chunks for w in c.module.fp8_weights()])
    run.forward_backward = lambda step: None
    return run


def test_forward_backward_and_transposes_sleep_their_cost():
    slept = []
    run = _run()
    handles = attach_sleep_costs(run, SleepCosts(0.01, 0.02, 0.004), sleep=slept.append,
                                 clock=lambda: 0.0)
    x = torch.randn(3, 2, requires_grad=True)
    run.chunks[0].module(x).sum().backward()
    assert slept == [0.01, 0.02]
    slept.clear()
    # Lazy (one weight at a time, 5-weight chunk) and aligned (all 4 at once): delta per chunk.
    for w in run.chunks[1].module.fp8_weights():
        run.backend.build_transposes([w])
    run.backend.build_transposes(run.chunks[0].module.fp8_weights())
    assert slept[:5] == pytest.approx([0.0008] * 5) and slept[5] == pytest.approx(0.004)
    slept.clear()
    run.backend.build_transposes(run.chunks[0].module.fp8_weights())  # already valid: free
    assert slept == [0.0]
    handles.remove()
    handles.remove()  # idempotent
    assert "build_transposes" not in vars(run.backend)
    run.chunks[0].module(x)
    assert slept == [0.0]


def test_real_build_time_counts_towards_delta():
    ticks = iter([0.0, 0.003])  # the real build took 3 ms of the 4 ms target
    slept = []
    run = _run((4,))
    attach_sleep_costs(run, SleepCosts(0.0, 0.0, 0.004), sleep=slept.append, clock=lambda: next(ticks))
    run.backend.build_transposes(run.chunks[0].module.fp8_weights())
    assert slept == [pytest.approx(0.001)]


def test_prebuild_builds_everything_before_the_step():
    run = _run()
    seen = []
    run.forward_backward = lambda step: seen.append(all(w.transpose_valid for w in run.weights))
    handles = attach_sleep_costs(run, SleepCosts(0.0, 0.0, 0.0), prebuild=True, sleep=lambda s: None)
    run.forward_backward(0)
    assert seen == [True]
    handles.remove()
    for w in run.weights:
        w.invalidate()
    run.forward_backward(1)  # the original again: nothing prebuilt
    assert seen == [True, False]


def test_negative_cost_is_refused():
    with pytest.raises(ValueError, match="SleepCosts.transpose=-1"):
        SleepCosts(0.01, 0.02, -1)


@pytest.mark.slow
def test_idle_benchmark_tiny_run(tmp_path):
    pytest.importorskip("megatron.core")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "pipeline_idle_cpu.py"),
         "--pp", "2", "--shapes", "2:2", "--deltas", "0.5", "--forward-ms", "5",
         "--backward-ms", "10", "--steps", "2", "--rounds", "1", "--out", str(tmp_path),
         "--name", "tiny"], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "tiny.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "| run" not in line
            and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["off", "none", "lazy", "aligned"]
    assert all(r.rstrip().endswith("| OK |") for r in rows), report
    assert "aligned saves" in report and (tmp_path / "tiny.raw.json").exists()
