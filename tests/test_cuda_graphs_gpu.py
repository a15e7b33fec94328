"""CUDA graphs and the aligner, on a real GPU: real captures, real replays, real FP8 GEMMs.

Issue 10, item 5. One simulated pipeline rank (PP=2, VP=2, M=2) whose model chunks each hold a
:class:`ReferenceFP8Linear` on the GPU (``torch._scaled_mm`` FP8 GEMMs on sm_89+; the backward
reads the cached transpose). The "all-gather" delivers each step's parameter values in place at
``finish()``, so a transpose taken before it, or one a graph does not see, changes the numbers.

* A capture that reaches a slot where transposes are due raises before any work is enqueued and
  builds nothing; a capture of a forward where nothing is due only advances the count, so the
  rest of the step stays at its slots.
* Layers graphed between steps, as megatron-core's per-layer CUDA graphs are (captured at the end
  of a step, before the optimizer step), replay in later aligned steps with outputs, input
  gradients and weight gradients bit-identical to the same steps run eagerly: the replays read
  the transposes the aligner rebuilt in place. A backend that builds into a new buffer each step
  is caught by the same comparison (the graphs keep reading the old one).
"""

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.telemetry import record_problems
from nemo_fp8_align.backends.reference import ReferenceBackend
from nemo_fp8_align.backends.reference_linear import ReferenceFP8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")]

PP, VP, M, HIDDEN, TOKENS = 2, 2, 2, 64, 32


class Chunk(torch.nn.Module):
    """A model chunk with a DDP chunk's launch and step-end methods (the aligner's hold)."""

    def __init__(self, backend, name):
        super().__init__()
        self.layer = ReferenceFP8Linear(HIDDEN, HIDDEN, backend=backend, name=name)
        self.launch = lambda: None
        self.bucket_groups = []  # what GatheringAdapter's real checks read

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        self.launch()

    def finish_grad_sync(self):
        pass

    def forward(self, x):
        return self.layer(x)


class GatheringSync:
    """The all-gather: ``finish(c)`` writes this step's values (``shards``) into chunk c's
    parameters in place, as the distributed optimizer's all-gather does."""

    def __init__(self, chunks):
        self.chunks, self.shards = chunks, [c.layer.weight.detach().clone() for c in chunks]
        self.launched, self.done = set(), set()

    def launcher(self, chunk):
        return lambda *_: self.launched.add(chunk)

    def finish(self, chunk):
        if chunk not in self.done:
            with torch.no_grad():
                self.chunks[chunk].layer.weight.copy_(self.shards[chunk])
            self.done.add(chunk)
        return True

    def finished(self, chunk):
        return chunk in self.done


class GatheringAdapter(McoreDDPAdapter):
    """megatron-core's adapter (launch wrappers, step end: the real code) finishing through
    :class:`GatheringSync`."""

    def __init__(self, chunks, config, sync):
        super().__init__(chunks, config)
        self.sync = sync

    def wait(self, chunk):
        pass

    def finish(self, chunk):
        return self.sync.finish(chunk)

    def finished(self, chunk):
        return self.sync.finished(chunk)


class NewBufferBackend(ReferenceBackend):
    """A backend that builds every transpose into a fresh buffer (and keeps the old one alive,
    as a cache or an autograd graph might): a captured graph then reads last step's bytes."""

    def __init__(self):
        super().__init__(check_provenance=False)
        self.old = []

    def build_transposes(self, weights):
        for w in weights:
            if not w.transpose_valid:
                self.old.append(w.transpose)
                w.transpose = torch.empty_like(w.transpose)
        return super().build_transposes(weights)


def make_rank(rank, backend=None, seed=0):
    torch.manual_seed(seed)
    backend = backend or ReferenceBackend(check_provenance=False)  # a digest is a host sync
    with torch.device("cuda"):
        chunks = [Chunk(backend, f"chunk{c}.weight") for c in range(VP)]
    sync = GatheringSync(chunks)
    for c, chunk in enumerate(chunks):
        chunk.launch = sync.launcher(c)
    config = SimpleNamespace(param_sync_func=[chunk.start_param_sync for chunk in chunks])
    schedule = InterleavedSchedule(PP, VP, M)
    aligner = TransposeAligner(chunks, schedule=schedule, pp_rank=rank, dp_rank=0,
                               adapter=GatheringAdapter(chunks, config, sync),
                               weights=[[c.layer.fp8_weight] for c in chunks],
                               backend=backend, config=AlignConfig())
    aligner.attach()
    return SimpleNamespace(chunks=chunks, sync=sync, config=config, schedule=schedule,
                           aligner=aligner, rank=rank)


def inputs(step):
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    return [torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
            .requires_grad_() for _ in range(VP * M)]


def forwards(r, xs, upto=None, backward=None):
    """The schedule's launches and forwards of one step on rank r (megatron-core's order);
    ``backward(v, y)``, if given, runs right after forward v (a graphed layer holds one
    microbatch's activations at a time)."""
    s, funcs = r.schedule, r.config.param_sync_func
    for v in range(s.total if upto is None else upto):
        t = v + r.rank
        if t < s.total and s.forward_table[t][0] == 0 and 1 < s.chunk_of(t) + 1 < s.vp:
            funcs[s.chunk_of(t) + 1]()
        y = r.chunks[s.chunk_of(v)](xs[v])
        if backward is not None:
            backward(v, y)


def train_step(r, step):
    """One step: outputs, input gradients and accumulated weight gradients, all copied out
    right away (a replay overwrites a graph's static outputs and gradients)."""
    xs, outs, dxs = inputs(step), [], []
    grads = [torch.zeros_like(c.layer.weight) for c in r.chunks]

    def backward(v, y):
        outs.append(y.detach().clone())
        y.float().square().mean().backward()
        dxs.append(xs[v].grad.clone())
        chunk = r.chunks[r.schedule.chunk_of(v)]
        grads[r.schedule.chunk_of(v)] += chunk.layer.weight.grad
        chunk.layer.weight.grad = None

    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    forwards(r, xs, backward=backward)
    r.aligner.on_step_end()
    return outs, dxs, grads


def optimizer_step(r, grads):
    """New values go to the shards; the parameters get them from the next step's all-gather."""
    with torch.no_grad():
        for shard, c, g in zip(r.sync.shards, r.chunks, grads):
            shard.sub_(0.5 * g)
            c.layer.fp8_weight.invalidate()
    r.sync.launched, r.sync.done = set(), set()


def graph_layers(r):
    """megatron-core's per-layer graphs: captured after the step's backwards, before the
    optimizer step, while every transpose is valid (so no transpose is captured)."""
    sample = [torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)]
    for c in r.chunks:
        assert c.layer.fp8_weight.transpose_valid
        torch.cuda.make_graphed_callables(c.layer, tuple(sample))


def run(rank, *, graphed, backend=None, steps=3):
    r = make_rank(rank, backend)
    results = []
    for step in range(steps):
        results.append(train_step(r, step))
        if graphed and step == 0:
            graph_layers(r)
        optimizer_step(r, results[-1][2])
    torch.cuda.synchronize()
    return r, results


def identical(a, b):
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for xs, ys in zip(ra, rb)
               for x, y in zip(xs, ys))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_capture_reaching_a_due_slot_refuses_and_builds_nothing(rank):
    r = make_rank(rank)
    xs = inputs(0)
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    due = r.schedule.trigger_vmid(rank, 1)  # chunk 1's aligned slot, in this rank's forwards
    forwards(r, xs, upto=due)
    graph = torch.cuda.CUDAGraph()
    static_x = xs[due].detach().clone()
    with pytest.raises(RuntimeError, match=r"chunks \[1\] are due at forward .*CUDA-graph"):
        with torch.cuda.graph(graph):
            r.chunks[r.schedule.chunk_of(due)](static_x)
    assert not torch.cuda.is_current_stream_capturing()
    w = r.chunks[1].layer.fp8_weight
    assert w.transposes_built == 0 and not w.transpose_valid and 1 not in r.sync.done
    assert r.aligner._vmid is None  # the step is aborted: the next one starts clean


def test_a_capture_where_nothing_is_due_only_counts():
    r = make_rank(rank=0)
    xs = inputs(0)
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    forwards(r, xs, upto=1)  # forward 0 (chunk 0, built at the step's start) also warms cuBLAS
    w0 = r.chunks[0].layer.fp8_weight
    before = (w0.transposes_built, w0.transpose.clone(), len(r.aligner.records))
    graph, static_x = torch.cuda.CUDAGraph(), xs[1].detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as before any capture
        r.chunks[0].layer(static_x)  # the layer itself carries no hooks: not counted
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):  # forward 1: chunk 0 again, nothing due
        static_y = r.chunks[0](static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, r.chunks[0].layer(xs[1]).detach())  # the graph computed it
    assert w0.transposes_built == before[0] and torch.equal(w0.transpose, before[1])
    assert len(r.aligner.records) == before[2] and r.aligner._vmid == 2
    outs = [r.chunks[r.schedule.chunk_of(v)](xs[v]) for v in range(2, r.schedule.total)]
    torch.stack([y.float().sum() for y in outs]).sum().backward()
    r.aligner.on_step_end()  # exactly the planned number of forwards: no StepMismatchError
    assert record_problems([asdict(x) for x in r.aligner.records]) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_graphed_layers_replay_the_aligned_transposes_bit_for_bit(rank):
    eager_rank, eager = run(rank, graphed=False)
    graphed_rank, graphed = run(rank, graphed=True)
    assert identical(eager, graphed)
    assert not identical(eager[:1], [eager[1]])  # the steps really differ (new weights)
    for r in (eager_rank, graphed_rank):
        assert record_problems([asdict(x) for x in r.aligner.records]) == []
        assert [c.layer.fp8_weight.transposes_built for c in r.chunks] == [3, 3]


def test_a_backend_building_into_new_buffers_is_caught_under_graphs():
    _, eager = run(1, graphed=False)
    _, fresh_buffers = run(1, graphed=True, backend=NewBufferBackend())
    assert identical(eager[:1], fresh_buffers[:1])  # step 0 ran eagerly
    assert not identical(eager[1:], fresh_buffers[1:])  # the replays read last step's transposes
