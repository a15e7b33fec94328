"""One simulated pipeline rank for the aligner's tests: a fake backend, a recording all-gather,
model chunks that build their transposes lazily at first use, and a driver that runs one step
the way megatron-core's interleaved schedule does. Used by ``tests/test_aligner.py``,
``test_step_end.py``, ``test_timing_split.py`` and ``test_gpu_spans.py``."""

from types import SimpleNamespace

import torch
from support.configs import model_config

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter


class FakeWeight:
    def __init__(self):
        self.valid = False
        self.builds = 0


class FakeBackend:
    name = "fake"

    def __init__(self, needed=True):
        self.needed = needed

    def transpose_needed(self):
        return self.needed, "fake backend says so"

    def has_valid_transpose(self, w):
        return w.valid

    def build_transposes(self, weights):
        stale = [w for w in weights if not w.valid]
        for w in stale:
            w.valid, w.builds = True, w.builds + 1
        return len(stale)


class FakeSync:
    """Records launches and finishes; refuses to finish a chunk that was never launched."""

    def __init__(self):
        self.log, self.launched, self.done = [], set(), set()
        self.report_finished = True

    def launcher(self, chunk):
        def launch(*_):
            self.launched.add(chunk)
            self.log.append(("launch", chunk))
        return launch

    def finish(self, chunk):
        if chunk not in self.launched:
            raise AssertionError(f"finish({chunk}) before its launch")
        self.done.add(chunk)
        self.log.append(("finish", chunk))
        return self.report_finished

    def finished(self, chunk):
        return chunk in self.done

    def new_step(self):
        self.launched.clear()
        self.done.clear()


class FakeAdapter(McoreDDPAdapter):
    """megatron-core's adapter over the stand-in chunks: its launch wrappers, list rebinding,
    step end and checks are the real code; finishing a chunk is :class:`FakeSync`'s (the
    stand-ins have no bucket groups)."""

    def __init__(self, chunks, config, sync):
        super().__init__(chunks, config)
        self.sync = sync

    def finish(self, chunk):
        return self.sync.finish(chunk)

    def finished(self, chunk):
        return self.sync.finished(chunk)


class Chunk(torch.nn.Module):
    """Builds its weights' transposes lazily at first use, as TE and the reference linear do;
    launches its all-gather and ends the step the way a megatron-core DDP chunk's
    ``start_param_sync`` / ``finish_grad_sync`` do (a stand-in: a real DDP chunk needs a
    process group and buckets; tests/test_engine_mcore.py runs those)."""

    def __init__(self, weights, backend, launch=None):
        super().__init__()
        self.weights, self.backend, self._launch = weights, backend, launch
        self.grad_syncs = 0
        self.bucket_groups = []  # what FakeAdapter's real checks and wait() read

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        self._launch()

    def finish_grad_sync(self):
        self.grad_syncs += 1

    def forward(self, x):
        if torch.is_grad_enabled():
            self.backend.build_transposes(self.weights)
        return x


def make_rank(pp=4, vp=3, m=8, rank=1, policy=Policy.ALIGNED, n_weights=2, needed=True):
    schedule = InterleavedSchedule(pp, vp, m)
    backend, sync = FakeBackend(needed), FakeSync()
    weights = [[FakeWeight() for _ in range(n_weights)] for _ in range(vp)]
    chunks = [Chunk(w, backend, sync.launcher(c)) for c, w in enumerate(weights)]
    config = model_config(pp, vp, param_sync_func=[c.start_param_sync for c in chunks])
    def new_adapter():
        return FakeAdapter(chunks, config, sync)

    aligner = TransposeAligner(chunks, schedule=schedule, pp_rank=rank, dp_rank=0,
                               adapter=new_adapter(), weights=weights, backend=backend,
                               config=AlignConfig(policy=policy))
    # The test's own bundle of one rank's objects, not a megatron-core one.
    return SimpleNamespace(schedule=schedule, sync=sync, weights=weights, chunks=chunks,
                           config=config, aligner=aligner, rank=rank, new_adapter=new_adapter)


def end_step(r):
    """megatron-core's finalize_model_grads: chunk 0's finish_grad_sync first, on every rank."""
    r.chunks[0].finish_grad_sync()


def run_training_step(r, end=True):
    """Drive one rank the way megatron-core's interleaved schedule does (``end``: and its
    finalize_model_grads)."""
    s, funcs = r.schedule, r.config.param_sync_func
    funcs[0]()
    funcs[1]()
    for v in range(s.total):
        t = v + r.rank
        if t < s.total and s.forward_table[t][0] == 0 and 1 < s.chunk_of(t) + 1 < s.vp:
            funcs[s.chunk_of(t) + 1]()
        r.chunks[s.chunk_of(v)](torch.ones(1))
    if end:
        end_step(r)
    for ws in r.weights:  # the optimizer step: next step's all-gather brings new values
        for w in ws:
            w.valid = False
    r.sync.new_step()
