"""The demo launchers' rank handling (``demo/ranks.py``), shared by the demo, its Megatron-LM
loop and the explicit-groups test: every rank is waited for, and each failed rank's own error
is reported, whatever order the ranks exit in."""

import os
import sys
import time

import pytest

from lab.demo.ranks import read_results, spawn_and_wait, write_error, write_result
from lab.demo.ranks import DemoRankError


def _rank(rank, world_size, port, out_dir, plan):
    """What ``plan[rank]`` says: "ok", "raise" (after the others have exited), "error-exit-0"
    (an error file, then a clean exit) or "exit-3" (no file at all)."""
    what = plan[rank]
    if what == "ok":
        write_result(out_dir, rank, {"rank": rank, "world_size": world_size, "port": port})
    elif what == "raise":
        time.sleep(1.0)  # the last to exit: a join that stops at the first exit would miss it
        try:
            raise ValueError(f"rank {rank}'s own problem")
        except ValueError as err:
            write_error(out_dir, rank, err)
            sys.exit(1)
    elif what == "error-exit-0":
        try:
            raise KeyError("kept, then a clean exit")
        except KeyError as err:
            write_error(out_dir, rank, err)
    elif what == "exit-3":
        os._exit(3)
    elif what == "abort":
        os.abort()  # a native crash: SIGABRT, as glibc's heap check ends a corrupted process


def _run(tmp_path, plan):
    codes = spawn_and_wait(_rank, len(plan), (str(tmp_path), plan), timeout_s=60.0)
    return codes, read_results(str(tmp_path), codes)


def test_every_rank_s_result_in_rank_order(tmp_path):
    codes, results = _run(tmp_path, ["ok", "ok", "ok"])
    assert codes == [0, 0, 0]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3} and len({r["port"] for r in results}) == 1


def test_each_failed_rank_reports_its_own_error_whatever_exits_first(tmp_path):
    with pytest.raises(DemoRankError) as info:
        _run(tmp_path, ["ok", "exit-3", "raise", "error-exit-0"])
    err = info.value
    assert sorted(err.reports) == [1, 2, 3]
    assert err.reports[1] == "rank 1: exited with code 3"
    assert err.reports[2] == "rank 2: ValueError: rank 2's own problem"
    assert err.reports[3].startswith("rank 3: KeyError:")  # failed, though it exited with 0
    assert "ValueError" in err.tracebacks[2] and sorted(err.times) == [2, 3]
    assert str(err).splitlines() == [err.reports[1], err.reports[2], err.reports[3]]


def test_a_rank_that_kept_its_error_and_exited_cleanly_is_reported(tmp_path):
    # The explicit-groups test's ranks do this: exit code 0 everywhere, one error file.
    with pytest.raises(DemoRankError) as info:
        _run(tmp_path, ["ok", "error-exit-0"])
    assert sorted(info.value.reports) == [1]


def _where(rank, world_size, port, out_dir):
    write_result(out_dir, rank, {"env": os.environ.get("NEMO_FP8_ALIGN_TEST_VAR"),
                                 "cwd": os.getcwd(), "preloaded": "megatron.core" in sys.modules})


def test_ranks_start_in_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """The ranks are forked from a server started at the first call; each still sees the
    environment and working directory of its own call, as a spawned rank would (a variable set
    after the server started included), with megatron-core already imported there."""
    spawn_and_wait(_where, 1, (str(tmp_path),), timeout_s=60.0)  # the server is up
    monkeypatch.setenv("NEMO_FP8_ALIGN_TEST_VAR", "set after the server started")
    monkeypatch.chdir(tmp_path)
    codes = spawn_and_wait(_where, 2, (str(tmp_path),), timeout_s=60.0)
    for result in read_results(str(tmp_path), codes):
        assert result["env"] == "set after the server started"
        assert result["cwd"] == str(tmp_path)
        assert result["preloaded"] == (pytest.importorskip("megatron.core") is not None)


def _rerun_patterns(config):
    import re

    return [re.compile(p) for p in config.getini("only_rerun")]


def _would_rerun(config, exc):
    """pytest-rerunfailures' own test: ``"<type>: <message>"`` against each pattern."""
    return any(p.search(f"{type(exc).__name__}: {exc}") for p in _rerun_patterns(config))


def test_only_a_native_crash_earns_a_rerun(tmp_path, pytestconfig):
    """pyproject's rerun filter: a rank that crashed in native code (here SIGABRT) is rerun once;
    a Python error, a non-zero exit, a rank killed at the deadline and a failed assertion are
    not."""
    pytest.importorskip("pytest_rerunfailures")
    assert pytestconfig.getini("reruns") == "1"
    with pytest.raises(DemoRankError) as crashed:
        _run(tmp_path / "a", ["ok", "abort"])
    assert "rank 1: exited with code -6" in str(crashed.value)
    assert _would_rerun(pytestconfig, crashed.value)
    for plan in (["ok", "raise"], ["exit-3", "ok"]):
        with pytest.raises(DemoRankError) as failed:
            _run(tmp_path / plan[0], plan)
        assert not _would_rerun(pytestconfig, failed.value), str(failed.value)
    hung = DemoRankError("rank 0: still running at the deadline, killed")
    torchrun_crash = AssertionError("exitcode  : -11 (pid: 9450)  (SIGSEGV)")
    assert not _would_rerun(pytestconfig, hung)
    assert _would_rerun(pytestconfig, torchrun_crash)
    assert not _would_rerun(pytestconfig, AssertionError("losses differ; exitcode  : 1"))
    assert not _would_rerun(pytestconfig, AssertionError("exited with code -9"))  # SIGKILL
