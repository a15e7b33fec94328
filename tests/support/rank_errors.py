"""What every rank must report when the plugin finds an error on one rank only (the faults of
``lab.demo.faults.RANK_ERRORS``), on either loop: shared by tests/test_no_hang.py
(the demo's loop) and tests/test_megatron_lm_loop.py (Megatron-LM's ``train()``)."""

#: fault -> (error class every rank raises, what the faulty rank's own message says)
EXPECTED = {
    "mismatch_on_one_rank": ("StepMismatchError", "ran model chunk 0, but the interleaved "
                             "schedule (PP={pp}, VP=2, M=4, N={pp}) runs chunk 1 there: either "
                             "an extra"),
    "extra_forward_on_one_rank": ("StepMismatchError", "ran a forward beyond its 8th (model "
                                  "chunk 1), but its schedule"),
    "capture_on_one_rank": ("CudaGraphCaptureError", "model chunks [1] are due at forward 1 of "
                            "step 1, which runs inside a CUDA-graph capture"),
    "verify_fails_on_one_rank": ("TransposeVerifyError", "step 1, pipeline rank {last_pp}, model "
                                 "chunk 1, FP8 weight stage"),
}


def check_every_rank_raised(err, world_size, cls, text):
    """Every rank of the world raised the plugin's ``cls`` (not gloo's error), each report
    naming ``text`` (the faulty rank's own message, or the others quoting it), all within
    seconds of each other: a failure outside a step's body (at attach, in a listener, between
    steps) reached every rank."""
    reports, times = err.reports, err.times
    assert sorted(reports) == list(range(world_size)), reports
    for rank, report in reports.items():
        assert report.startswith(f"rank {rank}: {cls}: nemo_fp8_align"), report
        assert text in report, report
    assert max(times.values()) - min(times.values()) < 10.0, times


def check_every_rank_stopped(opts, err, fault):
    """Every rank raised the fault's plugin error class (not gloo's), the faulty (last) rank
    with what differed there, the others naming it; all within seconds of each other, far from
    the process groups' timeout that a rank waiting on a lone peer would hit."""
    reports, times = err.reports, err.times
    cls, own = EXPECTED[fault]
    own = own.format(pp=opts.pp, last_pp=opts.pp - 1)
    faulty = opts.world_size - 1
    assert sorted(reports) == list(range(opts.world_size)), reports  # every rank raised
    for rank, text in reports.items():
        assert text.startswith(f"rank {rank}: {cls}: nemo_fp8_align"), text
        first = text.splitlines()[0]
        if rank == faulty:
            assert own in first, first
            assert "this rank only" in text
        else:
            assert f"rank {rank} (pipeline rank" in first and "no problem of its own" in first
            assert f"rank {faulty} (pipeline rank {opts.pp - 1}" in text and own in text
    assert max(times.values()) - min(times.values()) < 10.0, times
