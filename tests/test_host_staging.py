"""The host-staging process-group backend (lab/host_staging.py) on the CPU:
two gloo processes, CPU tensors staged through host copies exactly as CUDA tensors are on the
one-GPU test machine; and its refusal on a machine with several GPUs."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lab.demo.ranks import free_port

from lab import host_staging


def test_refuses_on_a_machine_with_several_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(host_staging, "_REGISTERED", False)
    registered = []
    monkeypatch.setattr(dist.Backend, "register_backend", lambda *a, **k: registered.append(a))
    with pytest.raises(RuntimeError, match="2 GPUs.*init_process_group\\('nccl'\\)"):
        host_staging.enable_host_staging()
    assert registered == [] and host_staging._REGISTERED is False


def test_group_creation_refuses_on_several_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    built = []
    monkeypatch.setattr(host_staging, "HostStagingProcessGroup", lambda *a: built.append(a))
    with pytest.raises(RuntimeError, match="4 GPUs"):
        host_staging._create(None, 0, 1, None)
    assert built == []


def _check_collectives(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(host_staging.enable_host_staging(), rank=rank, world_size=2)
    assert dist.get_backend() == host_staging.BACKEND_NAME
    other = 1 - rank
    # all_reduce: sync and async (the result lands only at wait), AVG (gloo has none), bf16
    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 6.0]
    t = torch.tensor([float(rank)])
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    assert t.item() == 1.0
    t = torch.tensor([2.0 + 2 * rank])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.item() == 3.0
    t = torch.full((3,), 1.5, dtype=torch.bfloat16)
    dist.all_reduce(t)
    assert t.dtype == torch.bfloat16 and t.tolist() == [3.0] * 3
    # all_gather_into_tensor of raw bytes (FP8), sync and async, into a non-flat output
    inp = torch.full((4,), rank + 1, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = torch.zeros(8, dtype=torch.float8_e4m3fn)
    work = dist.all_gather_into_tensor(out, inp, async_op=True)
    work.wait()
    assert out.view(torch.uint8).tolist() == [1] * 4 + [2] * 4
    out2 = torch.zeros(2, 3)
    dist.all_gather_into_tensor(out2, torch.arange(3.0) + 10 * rank)
    assert out2.tolist() == [[0, 1, 2], [10, 11, 12]]
    gathered = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    assert [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
    # reduce_scatter_tensor: this rank's slice of the sum
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(4.0) * (rank + 1))
    assert out.tolist() == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
    # broadcast and barrier
    t = torch.tensor([7.0 if rank == 1 else 0.0])
    dist.broadcast(t, src=1)
    assert t.item() == 7.0
    dist.barrier()
    # point-to-point: both ranks post their send before their receive (batch_isend_irecv)
    send = torch.full((3,), float(rank + 5))
    recv = torch.zeros(3, requires_grad=True)  # as megatron-core's pipeline receives are
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, other),
                                    dist.P2POp(dist.irecv, recv, other)])
    for w in works:
        w.wait()
    assert recv.tolist() == [float(other + 5)] * 3 and recv.requires_grad
    # coalescing as megatron-core (no device) and Apex (device; the ops' works are dropped)
    outs = [torch.zeros(2), torch.zeros(4)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.tensor([float(rank)]), async_op=True)
        dist.all_gather_into_tensor(outs[1], torch.tensor([1.0, 2.0]) + rank, async_op=True)
    cm.wait()
    assert outs[0].tolist() == [0.0, 1.0] and outs[1].tolist() == [1.0, 2.0, 2.0, 3.0]
    out = torch.zeros(2)
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_gather_into_tensor(out, torch.tensor([rank + 0.5]), async_op=True)
    cm.wait()
    assert out.tolist() == [0.5, 1.5]
    t = torch.tensor([float(rank)])
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.broadcast(t, src=0, async_op=True)  # not a fast-path op: runs, its work dropped
    cm.wait()
    assert t.item() == 0.0
    # a sub-group is served by the same backend
    sub = dist.new_group([rank])
    t = torch.tensor([4.0])
    dist.all_reduce(t, group=sub)
    assert t.item() == 4.0
    dist.destroy_process_group()


@pytest.mark.slow
def test_collectives_point_to_point_and_coalescing_on_two_ranks():
    mp.start_processes(_check_collectives, args=(free_port(),), nprocs=2, start_method="spawn")
