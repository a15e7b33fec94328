"""Step time of megatron-core's interleaved pipeline with real Transformer Engine FP8 parameters,
``off`` / ``lazy`` / ``aligned`` FP8 transposes, on ONE GPU split into pipeline ranks by CUDA MPS.

Each pipeline rank is a process with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / ranks`` (the
MPS daemon must be running: validation/run_step_time_mps.sh starts it), so the ranks run at the
same time on disjoint shares of the SMs: a pipeline in miniature on real kernels. The model is a
GPT from megatron-core's TE layer spec (``fp8_param=True``: TE ``Float8Tensor`` weights), DDP
with ``overlap_param_gather``, ``align_param_gather`` and ``fp8_param_gather``, the distributed
optimizer, and ``align_fp8_transposes`` with the TE backend. Groups go through
benchmarks/mps_p2p.py (size-1 groups on the device; p2p over CUDA IPC where it works, else
through host memory; both modes' one-way cost is measured first). ``--p2p nccl`` runs the same
job on a GPU per rank instead (no MPS, NCCL groups, megatron-core's own p2p; its one-way cost
measured first): the setup of a cluster node, which the planner models. Never run on GPUs yet
(no machine with several GPUs was lent); its CPU dry run (plain gloo) is in the tests.

One job, one model: after a warm-up, rounds of segments, one segment per (policy, transpose
implementation), in an order rotated every round; the first steps of each segment are
discarded. ``--transposes te,torch`` adds the slow-transpose variant: TE's ``_create_transpose``
replaced, for every policy alike, by the reference backend's generic torch transpose
(``out.copy_(w.t())``, nemo_fp8_align.kernels with Triton off), the stand-in for a stack without
TE's fast transpose. Per step: the step time (CUDA events, max over ranks), every forward_step
and backward_step of the schedule and the optimizer step (busy), the transposes' own GPU time
per chunk; per segment the plugin's telemetry judged by ``record_problems``.
benchmarks/mps_analysis.py turns that into min/median/max, the planner's prediction and the
Markdown report.

  python3 benchmarks/pipeline_step_time_mps.py --pp 2 --vp 2 --microbatches 8 --out DIR
  python3 benchmarks/pipeline_step_time_mps.py --cpu-dry-run --pp 2 --out DIR   # plumbing only
  python3 benchmarks/pipeline_step_time_mps.py --reanalyse RUN.json --ranks DIR --out DIR2
      # a finished run's summary again, from its rank files (rankN.json or .json.gz), with the
      # analysis as it is now; the run's own summary is left as it was
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import mps_analysis  # noqa: E402
import mps_p2p  # noqa: E402
from mps_timing import Marks, instrument  # noqa: E402
from lab.demo.ranks import free_port  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Bench:
    pp: int = 2
    vp: int = 2
    dp: int = 1
    microbatches: int = 8
    hidden: int = 4096
    heads: int = 32
    layers_per_chunk: int = 1
    seq: int = 1024
    micro_batch_size: int = 2
    vocab: int = 1024
    recipe: str = "delayed"
    policies: tuple = ("off", "lazy", "aligned")
    transposes: tuple = ("te",)
    rounds: int = 5
    steps_per_segment: int = 12
    discard: int = 2
    warmup: int = 8
    p2p: str = "auto"  # auto (IPC if every rank can open it) | host | nccl (a GPU per rank)
    time_budget: int = 0  # seconds for the rounds; fewer rounds (>= 2) if the warm-up says so
    gpu_only_steps: int = 0  # per transposes, after the rounds: steps with a GPU backlog (Marks)
    cpu_dry_run: bool = False

    @property
    def ranks(self) -> int:
        return self.pp * self.dp

    def segments(self, round_index: int) -> List[tuple]:
        combos = [(p, t) for t in self.transposes for p in self.policies]
        k = round_index % len(combos)
        return combos[k:] + combos[:k]


def _real_stack():
    """The model pieces of the real-stack harness (same GPT, optimizer, data)."""
    from validation import real_stack_mcore as rs
    return rs


def _opts(b: Bench):
    return _real_stack().Opts(pp=b.pp, vp=b.vp, dp=b.dp, microbatches=b.microbatches,
                              recipe=b.recipe, hidden=b.hidden, layers_per_chunk=b.layers_per_chunk,
                              seq=b.seq, vocab=b.vocab, micro_batch_size=b.micro_batch_size,
                              cpu_dry_run=b.cpu_dry_run)


def _model(b: Bench, pp_rank: int):
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.transformer import TransformerConfig

    rs, o = _real_stack(), _opts(b)
    if b.cpu_dry_run:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec, dtype, extra = get_gpt_layer_local_spec(), torch.float32, {"use_cpu_initialization": True}
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.transformer.enums import AttnBackend
        spec, dtype = get_gpt_layer_with_transformer_engine_spec(), torch.bfloat16
        extra = dict(fp8="hybrid", fp8_recipe=b.recipe, fp8_param=True, bf16=True,
                     attention_backend=AttnBackend.unfused)
    config = TransformerConfig(
        num_layers=b.pp * b.vp * b.layers_per_chunk, hidden_size=b.hidden,
        ffn_hidden_size=4 * b.hidden, num_attention_heads=b.heads, pipeline_model_parallel_size=b.pp,
        virtual_pipeline_model_parallel_size=b.vp, pipeline_dtype=dtype, params_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        batch_p2p_comm=False, **extra)  # what the planner models; gloo needs it too
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True, align_param_gather=True, fp8_param_gather=not b.cpu_dry_run)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                      disable_bucketing=c > 0)
              for c, m in enumerate(rs.gpt_chunks(o, config, spec, pp_rank))]
    config.param_sync_func = [c.start_param_sync for c in chunks]
    config.no_sync_func = [c.no_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks, rs._optimizer(o, chunks)


def _worker(rank: int, b: Bench, port: int, out: str) -> None:
    cuda, shared = not b.cpu_dry_run, b.p2p != "nccl"
    if cuda and shared:  # before the first CUDA call of this process: its MPS share
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // b.ranks)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: Dict[str, Any] = {"rank": rank,
                              "share_percent": 100 // b.ranks if cuda and shared else None}
    try:
        _run(rank, b, cuda, out, result)
    except Exception:
        result["error"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, default=str)


def _run(rank: int, b: Bench, cuda: bool, out: str, result: Dict[str, Any]) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if cuda:  # --p2p nccl: a GPU per rank (a cluster node); else every rank on GPU 0 (MPS)
        torch.cuda.set_device(rank if b.p2p == "nccl" else 0)
    else:
        torch.set_num_threads(1)
        from lab.demo.cpu_redirects import enable_cpu_compat
        enable_cpu_compat()
    dist.init_process_group(_process_group_backend(b, cuda), rank=rank, world_size=b.ranks)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=b.pp,
                                 virtual_pipeline_model_parallel_size=b.vp)
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    result.update(pp_rank=pp_rank, dp_rank=dp_rank, versions=_versions(cuda),
                  backend=str(dist.get_backend()))
    act_bytes = b.seq * b.micro_batch_size * b.hidden * 2
    mps_p2p.settings["slots"] = 2 * b.microbatches * b.vp + 4  # > one step's sends per channel
    result["p2p"] = _p2p_costs(b, cuda, pp_rank, dp_rank, act_bytes)
    rs = _real_stack()
    rs.seed_everything(_opts(b))
    config, chunks, optimizer = _model(b, pp_rank)
    device = "cuda" if cuda else "cpu"
    data = [rs._batches(_opts(b), s, dp_rank, device) for s in range(2)]
    backend, weights_of = _backend(cuda)
    chunk_of = {id(w): c for c, ch in enumerate(chunks) for w in weights_of(ch)}
    result["weights_per_chunk"] = [len(weights_of(ch)) for ch in chunks]
    result["weight_types"] = sorted({type(w).__name__ for ch in chunks for w in weights_of(ch)})
    marks, slow = Marks(cuda), {"on": False}
    instrument(marks, chunk_of, slow)
    fwd_bwd = get_forward_backward_func()

    def step(k: int) -> Dict[str, Any]:
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = marks.now()
        fwd_bwd(forward_step_func=rs._forward_step, data_iterator=[iter(data[k % 2]) for _ in chunks],
                model=chunks, num_microbatches=b.microbatches, seq_length=b.seq,
                micro_batch_size=b.micro_batch_size, forward_only=False)
        opt0 = marks.now()
        optimizer.step()
        end = marks.now()
        if cuda:
            torch.cuda.synchronize()
        row = marks.collect()
        row.update(step=marks.ms(start, end), optimizer=marks.ms(opt0, end))
        return row

    warm = [step(k)["step"] for k in range(b.warmup)]
    rounds = _rounds_that_fit(b, warm)
    result["rounds_run"] = rounds
    segments: List[Dict[str, Any]] = []
    for r in range(rounds):
        for policy, impl in b.segments(r):
            slow["on"] = impl == "torch"
            aligner = _attach(b, policy, chunks, config, backend, weights_of)
            rows = [step(k) for k in range(b.steps_per_segment)]
            records = [dataclasses.asdict(x) for x in aligner.records] if aligner else []
            if aligner:
                aligner.detach()
            segments.append({"round": r, "policy": policy, "transposes": impl, "rows": rows,
                             "problems": _judge(b, policy, records),
                             "records": records if r == 0 else []})
    segments += _gpu_only_segments(b, marks, slow, step)
    result["segments"] = segments
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


#: The GPU backlog queued before each call of a gpu-only segment: longer than any call's host
#: time here (a chunk's backward takes ~4-8 ms of host time); each row's host times show it.
GPU_ONLY_BACKLOG_MS = 15.0


def _gpu_only_segments(b: Bench, marks: Marks, slow: Dict[str, bool], step) -> List[Dict[str, Any]]:
    """Per transposes, ``b.gpu_only_steps`` steps (plugin off: TE's lazy builds) with a GPU
    backlog before every timed call: each call's GPU time without waits for the host."""
    if b.gpu_only_steps <= 0:
        return []
    marks.calibrate_sleep(GPU_ONLY_BACKLOG_MS)
    out = []
    for impl in b.transposes:
        slow["on"] = impl == "torch"
        marks.gpu_only = True
        rows = [step(k) for k in range(b.gpu_only_steps)]
        marks.gpu_only = False
        out.append({"round": -1, "policy": "gpu_only", "transposes": impl, "rows": rows,
                    "problems": [], "records": [], "backlog_ms": GPU_ONLY_BACKLOG_MS})
    return out


def _rounds_that_fit(b: Bench, warm_ms: List[float]) -> int:
    """The rounds to run: ``b.rounds``, or fewer (at least 2) where the last warm-up step says
    they would not fit ``b.time_budget``; the same number on every rank (a MIN all-reduce)."""
    if b.time_budget <= 0 or not warm_ms:
        return b.rounds
    per_round_s = warm_ms[-1] / 1e3 * 1.3 * len(b.segments(0)) * b.steps_per_segment
    fit = torch.tensor([max(2, min(b.rounds, int(b.time_budget / per_round_s)))])
    dist.all_reduce(fit, op=dist.ReduceOp.MIN)
    return int(fit)


def _versions(cuda: bool) -> Dict[str, str]:
    import megatron.core
    v = {"torch": torch.__version__, "megatron_core": megatron.core.__version__}
    if cuda:
        import transformer_engine
        v.update(te=transformer_engine.__version__, gpu=torch.cuda.get_device_name(),
                 mps_share=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""))
    return v


def _backend(cuda: bool):
    if not cuda:
        from nemo_fp8_align.backends.reference import ReferenceBackend
        return ReferenceBackend(), (lambda chunk: [])
    from nemo_fp8_align.backends.te import TEBackend
    backend = TEBackend()
    return backend, backend.weights_of


def _attach(b: Bench, policy: str, chunks, config, backend, weights_of):
    if policy == "off":
        return None
    from nemo_fp8_align.config import AlignConfig, Policy
    from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes
    return align_fp8_transposes(chunks, num_microbatches=b.microbatches, backend=backend,
                                weights_of=weights_of, config=config,
                                align_config=AlignConfig(policy=Policy(policy)))


def _judge(b: Bench, policy: str, records: List[Dict[str, Any]]) -> List[str]:
    if policy == "off" or b.cpu_dry_run:
        return []
    from nemo_fp8_align.core.telemetry import record_problems
    problems = record_problems(records, policy=policy)
    want = b.steps_per_segment * b.vp
    if len(records) != want:
        problems.append(f"{len(records)} plugin records, expected {want}")
    return problems[:20]


def _process_group_backend(b: Bench, cuda: bool) -> str:
    """NCCL with a GPU per rank; the MPS groups (mps_p2p) where ranks share one GPU; plain gloo
    for the CPU dry run of ``--p2p nccl`` (megatron-core's own p2p, no MPS groups)."""
    if b.p2p == "nccl":
        return "nccl" if cuda else "gloo"
    return mps_p2p.enable_mps_backend()


def _p2p_costs(b: Bench, cuda: bool, pp_rank: int, dp_rank: int, nbytes: int) -> Dict[str, Any]:
    """The p2p modes' one-way cost at the activation size, between pipeline ranks 0 and 1."""
    if not cuda:
        mode = "nccl" if b.p2p == "nccl" else "host"
        return {"mode": mode, "probe": {"p2p": mode, "errors": ["CPU dry run"]}}
    from megatron.core import parallel_state as ps
    peer = ps.get_pipeline_model_parallel_next_rank() if pp_rank == 0 else \
        ps.get_pipeline_model_parallel_prev_rank()
    mine = dp_rank == 0 and pp_rank in (0, 1)
    if b.p2p == "nccl":
        timed = {"nccl": {**mps_p2p.pingpong(peer, nbytes), "mode": "nccl"}} if mine else {}
        dist.barrier()
        return {"mode": "nccl", "probe": {"p2p": "nccl", "errors": []}, **timed}
    return mps_p2p.measure_modes(mine, peer, nbytes, try_ipc=b.p2p == "auto")


def parse(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Bench()
    for name in ("pp", "vp", "dp", "microbatches", "hidden", "heads", "layers_per_chunk", "seq",
                 "micro_batch_size", "vocab", "rounds", "steps_per_segment", "discard", "warmup",
                 "time_budget", "gpu_only_steps"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--recipe", default=d.recipe, choices=["delayed", "tensorwise"])
    ap.add_argument("--policies", default=",".join(d.policies))
    ap.add_argument("--transposes", default="te", help="te | torch | te,torch (slow variant)")
    ap.add_argument("--p2p", default="auto", choices=["auto", "host", "nccl"],
                    help="auto/host: ranks share GPU 0 under MPS; nccl: a GPU per rank")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--name", default="pipeline_step_time_mps")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="also write the Markdown report here")
    ap.add_argument("--reanalyse", default=None, help="a finished run's summary JSON (no run)")
    ap.add_argument("--ranks", default=None, help="with --reanalyse: the run's rank files")
    return ap.parse_args(argv)


def bench_of(a: argparse.Namespace) -> Bench:
    fields = {f.name for f in dataclasses.fields(Bench)}
    kw = {k: v for k, v in vars(a).items() if k in fields}
    kw["policies"] = tuple(a.policies.split(","))
    kw["transposes"] = tuple(a.transposes.split(","))
    bad = [p for p in kw["policies"] if p not in ("off", "lazy", "aligned")] + \
          [t for t in kw["transposes"] if t not in ("te", "torch")]
    if bad or kw["discard"] >= kw["steps_per_segment"]:
        raise SystemExit(f"bad --policies/--transposes {bad} or --discard >= --steps-per-segment")
    b = Bench(**kw)
    if b.p2p == "nccl" and not b.cpu_dry_run and torch.cuda.device_count() < b.ranks:
        raise SystemExit(f"--p2p nccl needs a GPU per rank: {b.ranks} ranks (--pp {b.pp} x --dp "
                         f"{b.dp}), {torch.cuda.device_count()} GPUs visible; use --p2p auto to "
                         "share one GPU under MPS")
    return b


def _load(path: str) -> Dict[str, Any]:
    import gzip
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def reanalyse(a: argparse.Namespace) -> int:
    """``--reanalyse RUN.json --ranks DIR``: the run's summary again from its rank files."""
    if not a.ranks:
        raise SystemExit("--reanalyse needs --ranks DIR (the run's rankN.json or rankN.json.gz)")
    old = _load(a.reanalyse)
    b = Bench(**{k: tuple(v) if isinstance(v, list) else v for k, v in old["bench"].items()})
    ranks = []
    for r in range(b.ranks):
        found = [p for p in (os.path.join(a.ranks, f"rank{r}.json{z}") for z in ("", ".gz"))
                 if os.path.exists(p)]
        if not found:
            raise SystemExit(f"--ranks {a.ranks}: no rank{r}.json or rank{r}.json.gz")
        ranks.append(_load(found[0]))
    return _write(a, mps_analysis.analyse(b, ranks, old["failed"], old["wall_s"], old["argv"]))


def _write(a: argparse.Namespace, summary: Dict[str, Any]) -> int:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    text = mps_analysis.markdown(summary)
    for path in filter(None, [os.path.join(a.out, f"{a.name}.md"), a.results]):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0 if summary["ok"] else 1


def main(argv: List[str]) -> int:
    a = parse(argv)
    if a.reanalyse:
        return reanalyse(a)
    b = bench_of(a)
    os.makedirs(a.out, exist_ok=True)
    import torch.multiprocessing as mp
    t0 = time.time()
    port = free_port()
    failed = None
    try:
        mp.start_processes(_worker, args=(b, port, a.out), nprocs=b.ranks, join=True,
                           start_method="spawn")
    except Exception as exc:  # the ranks' files say more
        failed = str(exc)[-3000:]
    ranks = []
    for r in range(b.ranks):
        path = os.path.join(a.out, f"rank{r}.json")
        if os.path.exists(path):
            ranks.append(_load(path))
    return _write(a, mps_analysis.analyse(b, ranks, failed, time.time() - t0, argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
