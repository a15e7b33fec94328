"""A ``torch.distributed`` backend for several ranks sharing ONE GPU: gloo, with tensors staged
through host memory. Test harness only.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), and gloo
handed CUDA tensors aborts the process. This backend is a ``dist.ProcessGroup`` written in
Python and registered with ``dist.Backend.register_backend``, so every caller that goes
through ``torch.distributed`` (megatron-core's DDP and pipeline communication, Apex's
distributed optimizer, Transformer Engine's amax reductions) reaches it unchanged, even
callers that bound ``torch.distributed`` functions at import time.

Each operation copies its inputs to host memory, starts the gloo operation asynchronously and
returns a work whose ``wait()`` waits for gloo and copies the results back into the caller's
tensors (CUDA or CPU). Point-to-point works stay asynchronous too: ``batch_isend_irecv``
posts every send before the receives, so a send that completed inside the call would deadlock.
Data movers (gathers, broadcasts, point-to-point) move raw bytes, so any dtype works (FP8
included); reductions run in float32 for 16-bit floats.

It activates only through :func:`enable_host_staging` and refuses on a machine with more than
one GPU, where NCCL is the right backend and this one would only hide a configuration error.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["BACKEND_NAME", "HostStagingProcessGroup", "enable_host_staging"]

BACKEND_NAME = "host_staging"

_REGISTERED = False


def _refuse_several_gpus() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count > 1:
        raise RuntimeError(
            f"host_staging: this machine has {count} GPUs. The host-staging backend exists only "
            "for several ranks sharing one GPU in tests; with one GPU per rank use "
            "init_process_group('nccl').")


def enable_host_staging() -> str:
    """Register the backend (idempotent) and return its name for ``init_process_group``.

    Raises RuntimeError on a machine with more than one GPU.
    """
    global _REGISTERED
    _refuse_several_gpus()
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        _REGISTERED = True
    return BACKEND_NAME


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> "HostStagingProcessGroup":
    _refuse_several_gpus()
    return HostStagingProcessGroup(store, rank, size, timeout)


# ---------------------------------------------------------------------- staging helpers
def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t``'s bytes (1-D uint8)."""
    return t.detach().contiguous().to("cpu", copy=True).reshape(-1).view(torch.uint8)


def _copy_bytes_back(dst: torch.Tensor, host: torch.Tensor) -> None:
    dst.copy_(host.view(dst.dtype).reshape(dst.shape))


def _host_values(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t`` for a reduction (16-bit floats widened to float32)."""
    host = t.detach().contiguous().to("cpu", copy=True)
    return host.float() if host.dtype in (torch.float16, torch.bfloat16) else host


def _gloo_op(op: Any) -> tuple:
    """(op gloo runs, divide by the group size afterwards): gloo has no AVG."""
    avg = getattr(dist.ReduceOp, "AVG", None)
    return (dist.ReduceOp.SUM, True) if avg is not None and op == avg else (op, False)


class _StagedWork(dist.Work):
    """Waits for the gloo works, then runs ``finish`` (the copy back) exactly once."""

    def __init__(self, works: Sequence[Any], finish: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait()
            if self._finish is not None:
                # Receive buffers may be leaves that require grad (megatron-core's pipeline
                # receives are): the copy back is data movement, not an autograd operation.
                with torch.no_grad():
                    self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


class HostStagingProcessGroup(dist.ProcessGroup):
    """gloo behind a ``ProcessGroup`` that accepts CUDA tensors (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._coalesced: Optional[List[_StagedWork]] = None

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"HostStagingProcessGroup(rank={self._rank}, size={self._size})"

    def _issue(self, works: Sequence[Any], finish: Optional[Callable[[], None]] = None) -> _StagedWork:
        work = _StagedWork(works, finish)
        if self._coalesced is not None:
            # Inside torch's _coalescing_manager with a device, the caller may drop the works
            # of the ops and keep only the one _end_coalescing returns.
            self._coalesced.append(work)
        return work

    # -------------------------------------------------------------- coalescing
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> _StagedWork:
        works, self._coalesced = self._coalesced or [], None
        return _StagedWork([], lambda: [w.wait() for w in works])

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    # -------------------------------------------------------------- reductions
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        op, divide = _gloo_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        hosts = [_host_values(t) for t in tensors]
        o = dist.AllreduceOptions()
        o.reduceOp = op
        work = self._gloo.allreduce(hosts, o)

        def finish() -> None:
            for t, h in zip(tensors, hosts):
                t.copy_(h / self._size if divide else h)
        return self._issue([work], finish)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        works = [self.allreduce([t], opts) for t in tensors]
        return self._issue([], lambda: [w.wait() for w in works])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> _StagedWork:
        # An all-reduce of the whole input, keeping this rank's slice: gloo's reduce-scatter
        # support differs between torch versions, this works in all of them.
        op, divide = _gloo_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        host = _host_values(input).reshape(self._size, -1)
        o = dist.AllreduceOptions()
        o.reduceOp = op
        work = self._gloo.allreduce([host], o)

        def finish() -> None:
            part = host[self._rank]
            output.copy_((part / self._size if divide else part).reshape(output.shape))
        return self._issue([work], finish)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts: Any = None) -> _StagedWork:
        works = [self.reduce_scatter_single(out, torch.cat([t.reshape(-1) for t in ins]), opts)
                 for out, ins in zip(outputs, inputs)]
        return self._issue([], lambda: [w.wait() for w in works])

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._issue([], lambda: [w.wait() for w in works])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -------------------------------------------------------------- data movers (bytes)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> _StagedWork:
        host_in = _host_bytes(input)
        host_out = torch.empty(host_in.numel() * self._size, dtype=torch.uint8)
        work = self._gloo.allgather([list(host_out.chunk(self._size))], [host_in])
        return self._issue([work], lambda: _copy_bytes_back(output, host_out))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor],
                                    inputs: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._issue([], lambda: [w.wait() for w in works])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> _StagedWork:
        host_in = [_host_bytes(t) for t in inputs]
        host_out = [[torch.empty_like(h) for _ in outs] for h, outs in zip(host_in, outputs)]
        work = self._gloo.allgather(host_out, host_in)

        def finish() -> None:
            for outs, hosts in zip(outputs, host_out):
                for t, h in zip(outs, hosts):
                    _copy_bytes_back(t, h)
        return self._issue([work], finish)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> _StagedWork:
        hosts = [_host_bytes(t) for t in tensors]
        o = dist.BroadcastOptions()
        o.rootRank = opts.rootRank if opts is not None else 0
        o.rootTensor = opts.rootTensor if opts is not None else 0
        work = self._gloo.broadcast(hosts, o)
        return self._issue([work], lambda: [_copy_bytes_back(t, h) for t, h in zip(tensors, hosts)])

    def barrier(self, opts: Any = None) -> _StagedWork:
        return self._issue([self._gloo.barrier()])

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> _StagedWork:
        hosts = [_host_bytes(t) for t in tensors]
        work = self._gloo.send(hosts, dst, tag)
        return self._issue([work], lambda: hosts.clear())  # keep the buffers alive until then

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> _StagedWork:
        hosts = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for t in tensors]
        work = self._gloo.recv(hosts, src, tag)
        return self._issue([work], lambda: [_copy_bytes_back(t, h) for t, h in zip(tensors, hosts)])
