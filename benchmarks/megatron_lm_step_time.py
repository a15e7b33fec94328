"""Step time of Megatron-LM's own ``train()`` (megatron-core 0.19.2 wheel) on ONE GPU split into
pipeline ranks by CUDA MPS, with Transformer Engine FP8 weights, ``off`` / ``lazy`` / ``aligned``
FP8 transposes, each with TE's transpose and with a generic (slow) one.

One Megatron-LM job (``demo --loop megatron-lm --device cuda``'s rank code,
lab/demo/megatron_lm_gpu.py, with megatron-core's GPT from ``gpt_config_from_args``):
after a warm-up, rounds of segments, one segment per (policy, transposes), in an order rotated
every round; a segment's first ``--discard`` iterations are not timed. The switch happens at an
iteration's start (chunk 0's ``zero_grad_buffer``, where train_step begins): the previous
segment's aligner is detached and ``megatron_lm.attach`` attaches the next one (``off``: none),
as a job restarted with another policy would, without restarting. The generic transpose is the
MPS benchmark's (benchmarks/mps_timing.py ``instrument``: TE's ``_create_transpose`` replaced, for
every policy alike, by the plugin's torch transpose, ``nemo_fp8_align.kernels.multi_transpose_``
with Triton off). Groups: benchmarks/mps_p2p.py (one-rank groups on the device, p2p over CUDA IPC
where every rank can open it).

Per iteration: the wall time between iteration starts (each rank synchronises its device and
meets the others at a barrier there, outside the timed span: the max over ranks is the step),
every forward_step (per model chunk) and backward_step of the schedule and every transpose build
(per chunk) in CUDA-event ms, and once the one-way p2p time of an activation (ping-pong).

``--fp8-recipe blockwise``: TE ``Float8BlockScaling`` (``Float8BlockwiseQTensor`` weights, 2D
128x128 blocks) instead of delayed scaling; a weight's post-all-gather work is then its
column-wise copy (TE's ``_create_columnwise``, built by megatron-core's own post-processing;
timed as the "transposes"), so only TE's own build runs (``--transposes te``).

  python3 benchmarks/megatron_lm_step_time.py --pp 4 --out DIR --results benchmarks/results/X.md
  python3 benchmarks/megatron_lm_step_time.py --pp 4 --fp8-recipe blockwise --transposes te --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from lab.demo.ranks import free_port  # noqa: E402


@dataclass(frozen=True)
class Shape:
    pp: int = 4
    vp: int = 2
    microbatches: int = 8
    hidden: int = 4096
    heads: int = 32
    seq: int = 1024
    micro_batch_size: int = 2
    rounds: int = 5
    steps_per_segment: int = 12
    discard: int = 2
    warmup: int = 6
    time_budget: int = 0  # seconds for the rounds; fewer rounds (>= 2) if the warm-up says so
    transposes: tuple = ("te", "torch")
    policies: tuple = ("off", "lazy", "aligned")
    recipe: str = "delayed"  # Megatron-LM's --fp8-recipe: delayed | blockwise

    def segments(self, r: int) -> List[tuple]:
        combos = [(p, t) for t in self.transposes for p in self.policies]
        k = r % len(combos)
        return combos[k:] + combos[:k]

    def plan(self, rounds: Optional[int] = None) -> List[tuple]:
        """(policy, transposes, round, index in segment) of every iteration after the warm-up."""
        return [(p, t, r, i) for r in range(self.rounds if rounds is None else rounds)
                for p, t in self.segments(r) for i in range(self.steps_per_segment)]


class Switcher:
    """At each iteration's start: time the last one, switch segment where the plan says."""

    def __init__(self, s: Shape, marks: Any, slow: Dict[str, bool], order: List[int]) -> None:
        self.s, self.marks, self.slow, self.order = s, marks, slow, order
        self.rows: List[Dict[str, Any]] = []
        self.aligner: Any = None
        self.records: Dict[str, List[dict]] = {}
        self.segment: Optional[tuple] = None
        self._t: Optional[float] = None
        self._current: Optional[tuple] = None
        self._warm: List[float] = []
        self.rounds = s.rounds

    def __call__(self, step: int, chunks: List[Any]) -> None:
        torch.cuda.synchronize()
        torch.distributed.barrier()
        now = time.perf_counter()
        got = self.marks.collect()
        if self._t is not None and self._current is not None:
            row = {"step": step - 1, "ms": (now - self._t) * 1e3, "order": list(self.order)}
            row.update(got)
            row.update(zip(("policy", "transposes", "round", "index"), self._current))
            self.rows.append(row)
        elif self._t is not None:
            self._warm.append((now - self._t) * 1e3)
        self.order.clear()
        k = step - self.s.warmup
        if k == 0:
            self._fit_rounds()
        plan = self.s.plan(self.rounds)
        self._current = plan[k] if 0 <= k < len(plan) else None
        segment = None if self._current is None else self._current[:3]
        if segment != self.segment:
            self._switch(segment, chunks)
        self._t = time.perf_counter()

    def _fit_rounds(self) -> None:
        """``rounds``, or fewer (at least 2) where the warm-up says they would not fit the time
        budget (the same on every rank); Megatron-LM then ends the job after the last one
        (``args.exit_interval``, read by train() after every iteration)."""
        from megatron.training.global_vars import get_args

        if self.s.time_budget > 0 and self._warm:
            per_round_s = (statistics.median(self._warm[-3:]) / 1e3 * 1.2
                           * len(self.s.segments(0)) * self.s.steps_per_segment)
            fit = torch.tensor([max(2, min(self.s.rounds, int(self.s.time_budget / per_round_s)))],
                               device="cuda")
            torch.distributed.all_reduce(fit, op=torch.distributed.ReduceOp.MIN)
            self.rounds = int(fit.item())
        get_args().exit_interval = self.s.warmup + len(self.s.plan(self.rounds)) + 1

    def _switch(self, segment: Optional[tuple], chunks: List[Any]) -> None:
        from nemo_fp8_align.config import AlignConfig, Policy
        from nemo_fp8_align.integrations import megatron_lm

        if self.aligner is not None:
            key = "/".join(map(str, self.segment))
            self.records[key] = [dict(vars(r)) for r in self.aligner.records]
            self.aligner.detach()
            self.aligner = None
        self.segment = segment
        if segment is None:
            return
        policy, impl, _ = segment
        self.slow["on"] = impl == "torch"
        if policy != "off":
            self.aligner = megatron_lm.attach(chunks, align_config=AlignConfig(
                policy=Policy(policy)), log_metrics=False)


def _rank(rank: int, world: int, port: int, s: Shape, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    result: Dict[str, Any] = {"rank": rank}
    try:
        _run(rank, world, s, result)
    except Exception:
        result["error"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, default=str)


def _run(rank: int, world: int, s: Shape, result: Dict[str, Any]) -> None:
    import mps_p2p
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules
    from mps_timing import Marks, instrument

    from nemo_fp8_align.config import Policy
    from lab.demo.megatron_lm_gpu import GpuBook, init_gpu_groups, train_gpu
    from lab.demo.model import DemoModelConfig
    from lab.demo.options import DemoOptions

    init_gpu_groups(rank, world, "mps_ipc")
    ps.initialize_model_parallel(1, s.pp, s.vp)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    peer = ps.get_pipeline_model_parallel_next_rank() if pp_rank == 0 else \
        ps.get_pipeline_model_parallel_prev_rank()
    mps_p2p.settings["slots"] = 4 * s.microbatches * s.vp + 8  # > one iteration's sends
    result["p2p"] = mps_p2p.measure_modes(pp_rank in (0, 1), peer,
                                          s.seq * s.micro_batch_size * s.hidden * 2, True)
    marks, slow, chunk_of, order = Marks(True), {"on": False}, {}, []
    instrument(marks, chunk_of, slow)  # forward/backward/transpose timing, the slow transpose
    timed_forward = schedules.forward_step
    ddp_index: Dict[int, int] = {}

    def forward_step(*args: Any, **kwargs: Any) -> Any:  # which chunk each forward ran
        order.append(ddp_index.get(id(args[2] if len(args) > 2 else kwargs.get("model")), -1))
        return timed_forward(*args, **kwargs)
    schedules.forward_step = forward_step
    switcher = Switcher(s, marks, slow, order)

    def index_chunks(chunks: List[Any], weights: List[List[Any]]) -> None:
        for c, (chunk, ws) in enumerate(zip(chunks, weights)):
            ddp_index[id(chunk)] = c
            chunk_of.update({id(w): c for w in ws})
    book = GpuBook(checks=False, on_step=switcher, on_model=index_chunks)
    steps = s.warmup + len(s.plan()) + 1
    opts = DemoOptions(pp=s.pp, vp=s.vp, microbatches=s.microbatches, steps=steps, device="cuda",
                       policy=Policy.OFF, micro_batch_size=s.micro_batch_size, recipe=s.recipe,
                       model=DemoModelConfig(hidden_size=s.hidden, num_heads=s.heads,
                                             seq_length=s.seq, vocab_size=1024))
    train_gpu(opts, dict(exit_at=None, save=None, load=None), book, attach_plugin=False,
              log_interval=100000, early_exit_ok=True)
    result.update(pp_rank=pp_rank, rows=switcher.rows, rounds_run=switcher.rounds, records=switcher.records,
                  versions=_versions(), weights_per_chunk=_count(chunk_of, s.vp),
                  weight_types=sorted({type(w).__name__ for ws in book.weights for w in ws}))


def _count(chunk_of: Dict[int, int], vp: int) -> List[int]:
    return [sum(1 for c in chunk_of.values() if c == i) for i in range(vp)]


def _versions() -> Dict[str, str]:
    import megatron.core
    import transformer_engine
    return {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
            "te": transformer_engine.__version__, "gpu": torch.cuda.get_device_name(0),
            "mps_share": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Shape()
    for name in ("pp", "vp", "microbatches", "hidden", "heads", "seq", "micro_batch_size",
                 "rounds", "steps_per_segment", "discard", "warmup", "time_budget"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--transposes", default="te,torch")
    ap.add_argument("--fp8-recipe", dest="recipe", default="delayed",
                    choices=["delayed", "blockwise"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="also write the Markdown report here")
    a = ap.parse_args(argv)
    kw = {k: v for k, v in vars(a).items() if k in Shape.__dataclass_fields__}
    s = Shape(**dict(kw, transposes=tuple(a.transposes.split(","))))
    if s.recipe == "blockwise" and s.transposes != ("te",):
        # A block-scaled weight's column-wise copy is TE's own (with its scales): the generic
        # byte transpose stands in for per-tensor FP8 only.
        raise SystemExit(f"--fp8-recipe blockwise --transposes {a.transposes}: blockwise runs "
                         "TE's own column-wise build only; pass --transposes te")
    os.makedirs(a.out, exist_ok=True)
    import torch.multiprocessing as mp
    t0, failed = time.time(), None
    try:
        mp.start_processes(_rank, args=(s.pp, free_port(), s, a.out), nprocs=s.pp, join=True,
                           start_method="spawn")
    except Exception as exc:  # the ranks' files say more
        failed = str(exc)[-3000:]
    from megatron_lm_step_analysis import analyse, markdown
    ranks = []
    for r in range(s.pp):
        path = os.path.join(a.out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                ranks.append(json.load(f))
    summary = analyse(asdict(s), ranks, failed, time.time() - t0)
    with open(os.path.join(a.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    text = markdown(summary)
    for path in filter(None, [os.path.join(a.out, "megatron_lm_step_time.md"), a.results]):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
