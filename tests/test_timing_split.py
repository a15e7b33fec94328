"""The all-gather wait is timed apart from the transposes' build also where megatron-core builds
them inside ``finish_param_sync`` (>= 0.16 with TE >= 2.10: its post-all-gather processing).

megatron-core's bucket groups post-process only TE Float8Tensor parameters, which do not exist
on the CPU: the groups here are stand-ins with the attributes McoreDDPAdapter uses, on a fake
clock (the all-gather takes 5, the post-processing build 3)."""

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter

from support.aligner_rank import make_rank, run_training_step

GATHER, BUILD = 5.0, 3.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Handle:
    def __init__(self, clock):
        self.clock, self.done = clock, False

    def wait(self):
        if not self.done:
            self.clock.now += GATHER
            self.done = True


class Bucket:
    def __init__(self, params):
        self.params = params


class BucketGroup:
    """finish_param_sync as megatron-core 0.16 has it: wait the handle, then post-process
    (here: the build that TE's post_all_gather_processing would run). Like 0.16's, it has no
    ``_post_param_sync``, so the forced-sync watch reads its ``buckets``."""

    def __init__(self, clock, weights):
        self.clock, self.weights = clock, weights
        self.buckets = [Bucket(list(weights))]
        self.param_gather_dispatched, self.param_gather_handle = False, None

    def start_param_sync(self):
        self.param_gather_dispatched, self.param_gather_handle = True, Handle(self.clock)

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            self.clock.now += BUILD
            for w in self.weights:
                w.valid, w.builds = True, w.builds + 1


def test_records_time_the_wait_apart_from_a_build_inside_finish():
    clock = Clock()
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    groups = [BucketGroup(clock, ws) for ws in r.weights]
    for chunk, group in zip(r.chunks, groups):
        chunk._launch = group.start_param_sync
        chunk.bucket_groups = [group]
    r.aligner = TransposeAligner(r.chunks, schedule=r.schedule, pp_rank=1, dp_rank=0,
                                 adapter=McoreDDPAdapter(r.chunks, r.config),
                                 weights=r.weights, backend=r.aligner.backend,
                                 config=AlignConfig(), clock=clock)
    r.aligner.attach()
    run_training_step(r)
    assert len(r.aligner.records) == 2
    for rec in r.aligner.records:
        assert rec.transposed == 0 and rec.valid == 2  # built by "megatron-core", not by us
        assert rec.t_gathered - rec.t_slot == GATHER  # the wait alone (was wait + build)
        assert rec.t_done - rec.t_gathered == BUILD  # the build (was 0)
