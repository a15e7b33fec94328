"""Edges of ``python -m lab.demo`` a user reaches (issue 40): a full disk under ``--telemetry``,
Ctrl-C and SIGTERM while the ranks train. Each ends in one line and its exit status, with no
traceback, no temporary folder and no rank left behind. (Absurd sizes such as ``--microbatches
100000000000000000000``: tests/test_bad_inputs.py's battery, exit 2 before any rank starts.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("megatron.core")

from support.demo_runs import ROOT  # noqa: E402

pytestmark = pytest.mark.slow


def _session(sid):
    """The processes of session ``sid`` still alive (the demo, its fork server, its ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # after the name: state ppid pgrp session
            pids.append(int(entry))
    return pids


def _interrupted_demo(tmp_path, send):
    """Start the demo in its own session, wait until its ranks train, ``send(proc)``; returns
    (exit status, stderr, processes left, temporary folders left)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lab.demo", "--steps", "500", "--timeout",
                             "60"], cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_session(proc.pid)) < 4 or not any(tmp.iterdir()):  # demo, server, 2 ranks
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(3.0)  # the ranks are in their process group, training
    send(proc)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 15  # the fork server leaves once the demo is gone
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc.returncode, err, _session(proc.pid), list(tmp.iterdir())


def _quiet(err, line):
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == line, err
    assert err.count(line) == 1, err


def test_ctrl_c_ends_the_demo_in_one_line_with_130(tmp_path):
    """A terminal's Ctrl-C reaches every process of the job: it printed 7 KeyboardInterrupt
    tracebacks from the worker processes. Now the ranks leave it to the launcher, which stops
    them: one line, exit 130, nothing left."""
    code, err, left, folders = _interrupted_demo(
        tmp_path, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert left == [] and folders == [], (left, folders, err[-2000:])
    assert code == 130, err
    _quiet(err, "python -m lab.demo: interrupted")


def test_sigterm_removes_the_temporary_folder_and_every_rank(tmp_path):
    """SIGTERM to the demo alone (``kill PID``) left its temporary folder and an orphaned rank
    until the process group's timeout. Now the launcher kills its ranks and the folder goes."""
    code, err, left, folders = _interrupted_demo(tmp_path, lambda proc: proc.terminate())
    assert left == [] and folders == [], (left, folders, err[-2000:])
    assert code == 143, err
    _quiet(err, "python -m lab.demo: terminated")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a full disk)")
def test_telemetry_on_a_full_disk_is_one_line():
    """The records are written after the run, where a full disk ended in an OSError traceback."""
    from support.demo_runs import demo_cli

    out = demo_cli("--steps", "1", "--telemetry", "/dev/full", timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "python -m lab.demo: error: --telemetry /dev/full: could not write the run's records "
        "(No space left on device); free space there or pass another path"), out.stderr
