"""nemo_fp8_align.core.observe: builds placed by hooks of their own (not the aligner's counter),
through the backend's build call or, for Transformer Engine, TE's own build entry, whoever calls
it (the plugin, megatron-core's post-all-gather processing, a module at first use)."""

import json
from pathlib import Path

import pytest
import torch

from support.standins.te_float8 import GENERATIONS, te_setup

from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight
from nemo_fp8_align.core.observe import BuildObserver
from nemo_fp8_align.core.metrics import step_metrics

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_te_builds_are_seen_whoever_calls_them(gen):
    cls, te, weights, backend = te_setup(gen)
    name = "_create_transpose" if gen.startswith("2.") else "transpose_2d"
    original = cls.__dict__.get(name)
    seen = []
    undo = backend.watch_builds(seen.append)
    assert backend.build_transposes(weights[:2]) == 2  # the plugin's call
    assert seen == weights[:2]
    if te.post_all_gather_processing is not None:  # megatron-core's call, not through us
        te.post_all_gather_processing([weights[2]])
        assert seen[-1] is weights[2]
    undo()
    assert cls.__dict__.get(name) is original
    for w in weights:
        w._transpose_invalid = True
        if "_fp8_attrs" in vars(w):
            w._fp8_attrs["transpose_invalid"] = True
    count = len(seen)
    backend.build_transposes(weights)
    assert len(seen) == count  # undone: nothing reported any more


def test_te_kernel_path_builds_are_seen():
    _, _, weights, backend = te_setup("2.10", kernel_writes_transpose=True, use_triton_kernel=False)
    seen = []
    undo = backend.watch_builds(seen.append)
    assert backend.build_transposes(weights) == len(weights)
    assert seen == weights
    undo()
    assert "_build_with_kernel" not in vars(backend)


class _Chunk(torch.nn.Module):
    """A chunk whose forward builds its FP8 weight's transpose at first use (lazy)."""

    def __init__(self, backend):
        super().__init__()
        self.param = torch.nn.Parameter(torch.randn(4, 4))
        self.fp8 = ReferenceFP8Weight(self.param, name="w")
        self.backend = backend

    def forward(self, x):
        self.backend.build_transposes([self.fp8])
        return x @ self.param


def test_builds_are_placed_between_or_inside_forwards():
    backend = ReferenceBackend(use_triton_kernel=False)
    chunks = [_Chunk(backend), _Chunk(backend)]
    obs = BuildObserver(chunks, [[c.fp8] for c in chunks], backend)
    obs.open_step()
    backend.build_transposes([chunks[0].fp8])  # before any forward (aligned chunk 0)
    x = torch.randn(2, 4)
    chunks[0](x)  # already valid: no build
    chunks[0](x)
    chunks[1](x)  # built inside forward 2 (lazy, first use)
    assert obs.fields(0, pp_rank=1, aligned_slot=0) == {"obs_built": 1, "obs_at": [[0, False]],
                                                       "obs_slot": 0}
    assert obs.fields(1, pp_rank=1, aligned_slot=2) == {"obs_built": 1, "obs_at": [[2, True]],
                                                       "obs_slot": 3}
    with torch.no_grad():  # forward-only passes are not counted
        chunks[1](x)
    assert obs.ended == 3
    obs.close()
    assert "build_transposes" not in vars(backend)
    obs.open_step()  # closed: hooks gone
    chunks[0](x)
    assert obs.started == 0


def test_a_build_before_the_first_forward_bounds_the_slot_to_the_rank():
    backend = ReferenceBackend(use_triton_kernel=False)
    chunks = [_Chunk(backend), _Chunk(backend)]
    obs = BuildObserver(chunks, [[c.fp8] for c in chunks], backend)
    obs.open_step()
    backend.build_transposes([chunks[1].fp8])
    # on pp rank 3, before forward 0 is somewhere in slots 0..3: the aligned slot 2 fits
    assert obs.fields(1, pp_rank=3, aligned_slot=2)["obs_slot"] == 2
    assert obs.fields(1, pp_rank=1, aligned_slot=2)["obs_slot"] == 1  # it cannot be slot 2
    obs.close()


def test_logger_slot_skew_uses_the_observed_slot():
    rows = [json.loads(line) for line in
            (DATA / "telemetry_observed_pp2_vp2_dp2_slot_shift_unreported.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["step"] == 2 and r["dp_rank"] == 0]
    assert {r["slot"] for r in last if r["chunk"] == 1} == {2}  # the plan: no skew to see
    m = step_metrics(last)
    assert m["fp8_align/chunk1/slot_skew"] == 1.0 and m["fp8_align/chunk0/slot_skew"] == 0.0
