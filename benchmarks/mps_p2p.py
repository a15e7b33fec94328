"""Process groups for several pipeline ranks sharing ONE GPU (CUDA MPS), made cheap enough to
time a pipeline: the host-staging backend (``lab/host_staging.py``) with

* groups of one rank done on the device, without host staging (a data-parallel size of 1:
  megatron-core still all-gathers parameters and reduce-scatters gradients over that group;
  through host memory that would copy every parameter and gradient twice per step);
* point-to-point over CUDA IPC when it works: the sender copies the tensor into a slot of a
  ring buffer it owns (opened by the receiver through an IPC handle), records an inter-process
  CUDA event and sends the slot number over gloo (16 bytes); the receiver waits for the
  number, makes its stream wait for the event and copies the slot into its tensor. Nothing
  goes through host memory but the slot number. A slot is reused only ``slots`` sends later;
  the benchmark synchronises every rank between steps and sizes the ring to at least one
  step's sends per channel, so a slot is never overwritten before it is read.

``probe_ipc()`` decides the p2p mode once for all ranks (every rank must open a buffer of
another process); where it fails, p2p stays host-staged. ``pingpong()`` measures the one-way
cost of either mode. Benchmark harness only; never for training.
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from lab.host_staging import HostStagingProcessGroup, _StagedWork

__all__ = ["BACKEND_NAME", "enable_mps_backend", "measure_modes", "probe_ipc", "pingpong",
           "settings"]

BACKEND_NAME = "mps_fast"
#: p2p mode ("ipc" | "host"), ring slots per channel; set before the first send.
settings: Dict[str, Any] = {"p2p": "host", "slots": 64}
_REGISTERED = False


def enable_mps_backend() -> str:
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        _REGISTERED = True
    return BACKEND_NAME


def _create(store: Any, rank: int, size: int, timeout: Any) -> "MpsProcessGroup":
    return MpsProcessGroup(store, rank, size, timeout)


def _done() -> _StagedWork:
    return _StagedWork([])


class _Ring:
    """A sender's ring of slots for one peer: one device buffer, one IPC event per slot."""

    def __init__(self, nbytes: int, slots: int, device: torch.device) -> None:
        self.cap = (nbytes + 511) // 512 * 512
        self.buf = torch.empty(self.cap * slots, dtype=torch.uint8, device=device)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self.next = 0

    def handles(self) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor
        return pickle.dumps((reduce_tensor(self.buf), [e.ipc_handle() for e in self.events],
                             self.cap))


class _RemoteRing:
    def __init__(self, blob: bytes, device: torch.device) -> None:
        (rebuild, args), handles, self.cap = pickle.loads(blob)
        self.buf = rebuild(*args)
        self.events = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


class MpsProcessGroup(HostStagingProcessGroup):
    """Host staging, but size-1 groups stay on the device and p2p may go over CUDA IPC."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(store, rank, size, timeout)
        self._store = store
        self._rings: Dict[int, _Ring] = {}
        self._remote: Dict[int, _RemoteRing] = {}

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # ------------------------------------------------------------ groups of one rank
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        return self._issue([]) if self._size == 1 else super().allreduce(tensors, opts)

    def all_gather_single(self, output, input, opts=None) -> _StagedWork:
        if self._size != 1:
            return super().all_gather_single(output, input, opts)
        if output.data_ptr() != input.data_ptr():
            output.view(-1).view(torch.uint8).copy_(input.reshape(-1).view(torch.uint8))
        return self._issue([])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None) -> _StagedWork:
        if self._size != 1:
            return super().reduce_scatter_single(output, input, opts)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.reshape(output.shape))
        return self._issue([])

    _reduce_scatter_base = reduce_scatter_single

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        return self._issue([]) if self._size == 1 else super().broadcast(tensors, opts)

    def barrier(self, opts: Any = None) -> _StagedWork:
        return self._issue([]) if self._size == 1 else super().barrier(opts)

    # ------------------------------------------------------------ point-to-point
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> _StagedWork:
        if settings["p2p"] != "ipc" or not all(t.is_cuda for t in tensors):
            return super().send(tensors, dst, tag)
        (t,) = tensors
        nbytes = t.numel() * t.element_size()
        ring = self._rings.get(dst)
        if ring is None:
            ring = self._rings[dst] = _Ring(nbytes, settings["slots"], t.device)
            self._store.set(f"ipc_ring/{self._rank}->{dst}", ring.handles())
        if nbytes > ring.cap:
            raise RuntimeError(f"mps_fast: a {nbytes}-byte message to rank {dst} does not fit "
                               f"the {ring.cap}-byte slots sized by the first message")
        slot = ring.next
        ring.next = (slot + 1) % len(ring.events)
        view = ring.buf[slot * ring.cap: slot * ring.cap + nbytes]
        view.view(t.dtype).view(t.shape).copy_(t.detach())
        ring.events[slot].record()
        control = torch.tensor([slot, nbytes], dtype=torch.int64)
        return self._issue([self._gloo.send([control], dst, tag)], lambda: control)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> _StagedWork:
        if settings["p2p"] != "ipc" or not all(t.is_cuda for t in tensors):
            return super().recv(tensors, src, tag)
        (t,) = tensors
        control = torch.empty(2, dtype=torch.int64)
        work = self._gloo.recv([control], src, tag)

        def finish() -> None:
            remote = self._remote.get(src)
            if remote is None:
                blob = self._store.get(f"ipc_ring/{src}->{self._rank}")
                remote = self._remote[src] = _RemoteRing(blob, t.device)
            slot, nbytes = (int(x) for x in control)
            torch.cuda.current_stream().wait_event(remote.events[slot])
            view = remote.buf[slot * remote.cap: slot * remote.cap + nbytes]
            t.copy_(view.view(t.dtype).view(t.shape))
        return self._issue([work], finish)


def probe_ipc() -> Dict[str, Any]:
    """Every rank opens rank 0's buffer through CUDA IPC and reads it; sets settings["p2p"]
    to "ipc" if all could, else "host". Collective over the default group."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    error: Optional[str] = None
    keep = None
    try:
        if rank == 0:
            keep = torch.arange(256, dtype=torch.float32, device="cuda")
            from torch.multiprocessing.reductions import reduce_tensor
            store.set("ipc_probe", pickle.dumps(reduce_tensor(keep)))
        dist.barrier()
        if rank != 0:
            rebuild, args = pickle.loads(store.get("ipc_probe"))
            seen = rebuild(*args)
            if float(seen.sum()) != 255 * 128:
                error = f"read {float(seen.sum())} through IPC, expected {255 * 128}"
            del seen
    except Exception as exc:  # noqa: BLE001 - reported, then host staging is used
        error = f"{type(exc).__name__}: {exc}"
    errors: List[Optional[str]] = [None] * world
    dist.all_gather_object(errors, error)
    dist.barrier()
    del keep
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    settings["p2p"] = "host" if bad else "ipc"
    return {"p2p": settings["p2p"], "errors": bad}


def pingpong(peer: int, nbytes: int, iters: int = 30, warmup: int = 5) -> Dict[str, float]:
    """One-way time (ms) of an ``nbytes`` send to ``peer`` and back, in the current p2p mode,
    host clock around device-synchronised round trips (both ranks call it, lower rank first)."""
    x = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    first = dist.get_rank() < peer
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if first:
            dist.send(x, peer)
            dist.recv(y, peer)
        else:
            dist.recv(y, peer)
            dist.send(y, peer)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3 / 2)
    return {"mode": settings["p2p"], "bytes": nbytes, "min_ms": min(times),
            "median_ms": statistics.median(times), "max_ms": max(times)}


def measure_modes(mine: bool, peer: int, nbytes: int, try_ipc: bool) -> Dict[str, Any]:
    """Collective: host-staged p2p timed (by the ranks with ``mine``, against ``peer``), then the
    IPC probe, then IPC p2p timed if every rank could open IPC memory; leaves the mode set."""
    out: Dict[str, Any] = {}
    settings["p2p"] = "host"
    if mine:
        out["host"] = pingpong(peer, nbytes)
    dist.barrier()
    probe = probe_ipc() if try_ipc else {"p2p": "host", "errors": ["--p2p host"]}
    out["probe"] = probe
    if probe["p2p"] == "ipc":
        if mine:
            out["ipc"] = pingpong(peer, nbytes)
        dist.barrier()
    out["mode"] = settings["p2p"]
    return out
