"""The ranks of the demo's jobs: start them all, wait for every one, read back each rank's
result or its own error.

The ranks are forked from one server process that imported torch and megatron-core once
(:data:`PRELOAD`), not spawned to import them each: on 2 cores, four ranks importing them at once
took most of a short demo's time, and a test session or ``demo --resume-at`` pays it once. Each
rank still starts with the caller's environment and working directory, as a spawned one would.

Each rank writes ``rank{N}.json`` (its result) or ``rank{N}.error`` (its own error, with when it
raised) into the job's folder. The launcher waits for every rank instead of stopping at the first
failure, as ``torch.multiprocessing``'s join does: a rank that only lost its connection to a
failed peer often exits first, and the failed rank's own message would be lost with the others'.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.multiprocessing as mp

__all__ = ["DemoRankError", "WAIT_BEYOND_TIMEOUT_S", "free_port", "read_results",
           "spawn_and_wait", "write_error", "write_result"]

#: Seconds the launcher waits for the ranks beyond their process groups' timeout.
WAIT_BEYOND_TIMEOUT_S = 120.0
#: The process groups' timeout where the job sets none (torch's default for gloo).
DEFAULT_PG_TIMEOUT_S = 1800.0
#: Imported by the fork server before it forks any rank (a module that does not import is
#: skipped there and imported by the ranks that need it).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.distributed",
           "megatron.core.optimizer", "megatron.core.pipeline_parallel",
           "lab.demo.train"]


class DemoRankError(RuntimeError):
    """One or more demo ranks failed; the message holds each failed rank's own error (its first
    line), one per line; ``reports`` maps each failed rank to its whole text, ``times`` to when
    it raised (``time.time()``), ``tracebacks`` to its traceback."""

    reports: Dict[int, str] = {}
    times: Dict[int, float] = {}
    tracebacks: Dict[int, str] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.error")


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.json")


def write_result(out_dir: str, rank: int, result: Dict[str, Any]) -> None:
    with open(_result_path(out_dir, rank), "w", encoding="utf-8") as f:
        json.dump(result, f)


def write_error(out_dir: str, rank: int, err: BaseException) -> None:
    """This rank's own error (call it inside the ``except``: the traceback is the current one)."""
    with open(_error_path(out_dir, rank), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "type": type(err).__name__, "message": str(err),
                   "time": time.time(), "traceback": traceback.format_exc()}, f)


def spawn_and_wait(target: Callable[..., None], world_size: int, args: Sequence[Any],
                   timeout_s: Optional[float], start_method: str = "forkserver",
                   ) -> List[Optional[int]]:
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` new processes and wait
    for all of them, at most ``timeout_s`` (the process groups' timeout) plus
    :data:`WAIT_BEYOND_TIMEOUT_S`; returns each rank's exit code (None: still running at the
    deadline, then killed). ``start_method="spawn"`` for ranks that use CUDA: with Transformer
    Engine installed, the fork server's preloaded megatron-core initialises CUDA, which a forked
    child cannot use."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    port, env, cwd = free_port(), dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_as_called, args=(env, cwd, target, rank, world_size, port, *args))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + (timeout_s or DEFAULT_PG_TIMEOUT_S) + WAIT_BEYOND_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
    finally:  # also on Ctrl-C or SIGTERM in the launcher: no rank outlives it
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join()
    return codes


def _as_called(env: Dict[str, str], cwd: str, target: Callable[..., None], *args: Any) -> None:
    """A forked rank: the environment and working directory of the ``spawn_and_wait`` call (the
    fork server's are those of its start), then the target. Ctrl-C is the launcher's: a
    terminal sends it to every process of the job, and each rank would print a
    KeyboardInterrupt traceback; the launcher stops the ranks itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def read_results(out_dir: str, codes: List[Optional[int]]) -> List[Dict[str, Any]]:
    """Each rank's result, in rank order; raises :class:`DemoRankError` with every failed rank's
    own error if any rank failed (a non-zero exit code, or an error file left by a rank that
    went on to exit cleanly)."""
    if any(code != 0 or os.path.exists(_error_path(out_dir, rank))
           for rank, code in enumerate(codes)):
        raise _rank_errors(out_dir, codes)
    results = []
    for rank in range(len(codes)):
        with open(_result_path(out_dir, rank), encoding="utf-8") as f:
            results.append(json.load(f))
    return results


def _rank_errors(out_dir: str, codes: List[Optional[int]]) -> DemoRankError:
    """One line per rank that failed, its own error first; every rank's full text in
    ``.reports``, when it raised (``time.time()``) in ``.times`` and its traceback in
    ``.tracebacks``, keyed by rank."""
    reports: Dict[int, str] = {}
    times: Dict[int, float] = {}
    tracebacks: Dict[int, str] = {}
    for rank, code in enumerate(codes):
        path = _error_path(out_dir, rank)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                e = json.load(f)
            reports[rank] = f"rank {rank}: {e['type']}: {e['message']}"
            times[rank], tracebacks[rank] = e["time"], e["traceback"]
        elif code != 0:
            reports[rank] = (f"rank {rank}: " + ("still running at the deadline, killed"
                                                  if code is None else f"exited with code {code}"))
    err = DemoRankError("\n".join(text.splitlines()[0] for text in reports.values()))
    err.reports, err.times, err.tracebacks = reports, times, tracebacks
    return err
