"""The judges of the real-stack harness (validation/real_stack_common.py), on synthetic evidence: what
the H200 runs report as PASS must be able to fail."""


from validation import real_stack_common as common  # noqa: E402


def _evidence(build_times, valid_at_first_use=(True, True), step=0):
    watch = common.TransposeWatch()
    watch.events = [{"kind": "build", "weight": f"c0w{i}", "chunk": 0, "step": step,
                     "phase": "fwd_bwd", "t": t} for i, t in build_times]
    probe = common.FirstUseProbe(chunks=[], weights=[], backend=None)  # no chunk hooked
    probe.valid[step][0] = list(valid_at_first_use)
    records = [{"step": step, "chunk": 0, "t_slot": 10.0, "t_done": 11.0}]
    return watch, probe, records


def _problems(policy, build_times, **kw):
    watch, probe, records = _evidence(build_times, **kw)
    return common.weight_problems(policy, 1, watch, probe, records, [2])


def test_each_weight_built_once_inside_the_slot_window_passes():
    assert _problems("aligned", [(0, 10.2), (1, 10.4)]) == []


def test_a_weight_built_twice_fails():
    assert any("exactly once" in p for p in _problems("lazy", [(0, 10.2), (0, 12.0), (1, 10.4)]))


def test_a_weight_left_unbuilt_fails():
    assert any("exactly once" in p for p in _problems("aligned", [(0, 10.2)]))


def test_a_build_outside_the_plugins_slot_window_fails():
    assert any("outside the plugin's slot" in p for p in _problems("aligned", [(0, 10.2), (1, 12.5)]))


def test_an_invalid_transpose_at_first_use_fails():
    problems = _problems("aligned", [(0, 10.2), (1, 10.4)], valid_at_first_use=(True, False))
    assert any("valid at first use" in p for p in problems)


def test_a_reset_after_the_build_fails():
    watch, probe, records = _evidence([(0, 10.2), (1, 10.4)])
    watch.events.append({"kind": "reset", "weight": "c0w0", "chunk": 0, "step": 0,
                         "phase": "fwd_bwd", "t": 10.9})
    problems = common.weight_problems("lazy", 1, watch, probe, records, [2])
    assert any("resets after the build" in p for p in problems)


def test_policies_must_match_bit_for_bit():
    run = {"policy": "off", "losses": [1.0], "grads": ["a"], "params": ["b"]}
    assert common.compare_policies([run, dict(run, policy="aligned")]) == []
    assert common.compare_policies([run, dict(run, policy="lazy", grads=["c"])]) != []


def test_transpose_buffer_moves_counts_builds_at_a_new_address():
    build = {"kind": "build", "chunk": 0, "step": 0, "phase": "fwd_bwd", "t": 0.0}
    events = [dict(build, weight="w0", ptr=100), dict(build, weight="w0", ptr=100),
              dict(build, weight="w1", ptr=200), dict(build, weight="w1", ptr=300),
              dict(build, kind="reset", weight="w1", ptr=None)]
    assert common.transpose_buffer_moves(events) == {"w0": 0, "w1": 1}


def test_gpu_times_must_be_there_with_a_build_that_took_time():
    good = {"step": 0, "chunk": 1, "rank": 0, "gpu_wait_ms": 0.0, "gpu_build_ms": 0.02}
    assert common.gpu_time_problems([good]) == []
    for bad in ({"gpu_wait_ms": None}, {"gpu_build_ms": 0.0}, {"gpu_wait_ms": -1.0}):
        assert common.gpu_time_problems([dict(good, **bad)]), bad
