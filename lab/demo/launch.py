"""Spawns the demo's ranks, gathers their results and checks the alignment invariants."""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from nemo_fp8_align.config import Policy
from lab.demo.evidence import evidence_problems
from lab.demo.ranks import DemoRankError, read_results, spawn_and_wait
from lab.demo.train import DemoOptions, run_rank
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.telemetry import record_problems

__all__ = ["DemoRankError", "DemoResult", "DemoTelemetryError", "run_demo", "alignment_problems",
           "differences", "format_report"]


@dataclass
class DemoResult:
    options: DemoOptions
    ranks: List[Dict[str, Any]]  # one per global rank, as written by run_rank
    records: List[Dict[str, Any]]  # telemetry of every rank, sorted by (step, chunk, pp, dp)

    def losses(self) -> List[float]:
        """Per-step mean loss, from the last pipeline stage of data-parallel rank 0."""
        last = [r for r in self.ranks if r["pp_rank"] == self.options.pp - 1 and r["dp_rank"] == 0]
        return last[0]["losses"]


def _rank_main(rank: int, world_size: int, port: int, opts: DemoOptions, out_dir: str) -> None:
    if opts.fault is not None:
        from lab.demo.faults import inject

        inject(opts.fault)  # this process only, for its whole life
    try:
        run_rank(rank, world_size, port, opts, out_dir, True)
    except Exception:  # run_rank left its error in out_dir: exit 1 without a traceback
        sys.exit(1)


def run_demo(opts: DemoOptions, telemetry_path: Optional[str] = None) -> DemoResult:
    """Run the demo in ``opts.world_size`` spawned processes; raises :class:`DemoRankError`
    (each failed rank's own error) if any rank fails.

    The schedule shape is validated first, so a bad shape fails here with the reason instead of
    inside every rank.
    """
    InterleavedSchedule(opts.pp, opts.vp, opts.microbatches, opts.group_size)
    with tempfile.TemporaryDirectory(prefix="nemo_fp8_align_demo_") as out_dir:
        codes = spawn_and_wait(_rank_main, opts.world_size, (opts, out_dir), opts.pg_timeout_s)
        ranks = read_results(out_dir, codes)
    return demo_result(opts, ranks, telemetry_path)


def demo_result(opts: DemoOptions, ranks: List[Dict[str, Any]],
                telemetry_path: Optional[str]) -> DemoResult:
    """The ranks' results with every rank's telemetry records, written to ``telemetry_path``."""
    records = sorted((rec for r in ranks for rec in r.get("records", [])),
                     key=lambda x: (x["step"], x["chunk"], x["pp_rank"], x["dp_rank"]))
    if telemetry_path:
        try:
            with open(telemetry_path, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(rec, sort_keys=True) + "\n")
        except OSError as err:  # a full disk, a lost mount: found only now
            raise DemoTelemetryError(
                f"--telemetry {telemetry_path}: could not write the run's records "
                f"({err.strerror or err}); free space there or pass another path") from err
    return DemoResult(opts, ranks, records)


class DemoTelemetryError(OSError):
    """The run's records could not be written to ``--telemetry`` (one line: the path, why, the
    fix)."""


def alignment_problems(result: DemoResult) -> List[str]:
    """Every violated invariant of the run, as sentences (empty when all hold).

    With ``manual_post_processing`` megatron-core builds the transposes (as it does TE's), after
    each all-gather it waits for and, on >= 0.18 or through the plugin's watch, after forced
    ones (so also between steps): build counts and places are then megatron-core's, not the
    plugin's; what must hold is that no GEMM read a stale copy (the provenance check raises)
    and the records' slots. The same holds for ``demo --recipe blockwise|mxfp8|nvfp4`` with
    evaluations between steps."""
    opts, problems = result.options, []
    # Block-scaled recipes are post-processed by megatron-core too; only with evaluations does
    # that also happen between steps (after their forced all-gathers), outside any step's count.
    manual = opts.manual_post_processing or (
        opts.recipe not in ("delayed", "tensorwise") and opts.eval_after_each_step)
    for r in ([] if manual else result.ranks):
        for step, builds in enumerate(r["builds_per_step"]):
            if any(b != 1 for b in builds):
                problems.append(f"rank {r['rank']} step {step}: transposes per FP8 weight "
                                f"{sorted(set(builds))}, expected exactly 1")
        if r["eval_builds"]:
            problems.append(f"rank {r['rank']}: forward-only passes built {r['eval_builds']} transposes")
        # Plugin off builds at first use, as lazy observes.
        problems.extend(f"rank {r['rank']}: {p}" for p in evidence_problems(
            r["evidence"], pp_rank=r["pp_rank"], lazy_steps=r["unlaunched_steps"],
            policy="aligned" if opts.policy is Policy.ALIGNED else "lazy"))
    if opts.policy is Policy.OFF:
        return problems
    launched = opts.steps - len(result.ranks[0]["unlaunched_steps"])
    expected = launched * opts.world_size * opts.vp
    if len(result.records) != expected:
        problems.append(f"{len(result.records)} telemetry records, expected {expected}")
    problems.extend(record_problems(result.records, policy=opts.policy.value,
                                    observed_builds=not manual))
    return problems


def differences(result: DemoResult, reference: DemoResult) -> List[str]:
    """Where ``result`` is not bit-identical to ``reference`` (same shape, another policy):
    per-step losses, and every rank's gradient and parameter buffer digests."""
    out = []
    if result.losses() != reference.losses():
        out.append(f"losses {result.losses()} != {reference.losses()}")
    for mine, theirs in zip(result.ranks, reference.ranks):
        for key in ("grads", "params"):
            steps = [i for i, (a, b) in enumerate(zip(mine[key], theirs[key])) if a != b]
            if steps or len(mine[key]) != len(theirs[key]):
                out.append(f"rank {mine['rank']}: {key} differ at steps {steps}")
    return out


def format_report(result: DemoResult) -> str:
    """A table of the last step with records: per chunk, the slot each pipeline rank built at.
    (A step without all-gather launches has none: Megatron-LM's first iteration of a job, so the
    only step of a job resumed one step before the end; its transposes are built at first use.)"""
    opts = result.options
    lines = [f"nemo_fp8_align demo: PP={opts.pp} VP={opts.vp} DP={opts.dp} M={opts.microbatches} "
             f"steps={opts.steps} policy={opts.policy.value}",
             "losses per step: " + ", ".join(f"{x:.6f}" for x in result.losses())]
    shown = max((r["step"] for r in result.records if r["dp_rank"] == 0),
                default=opts.steps - 1)
    if shown != opts.steps - 1:
        lines.append(f"  (step {shown}, the last with all-gather launches: the steps after it ran "
                     "without, their transposes built at first use)")
    last = [r for r in result.records if r["step"] == shown and r["dp_rank"] == 0]
    for chunk in range(opts.vp):
        rows = [r for r in last if r["chunk"] == chunk]
        slots = " ".join(f"r{r['pp_rank']}:{r['slot']}" for r in rows)
        built = sum(r["transposed"] for r in rows)
        kind = rows[0].get("kind", "transpose") if rows else "transpose"
        done = (f"{built} transposes" if kind == "transpose" else
                f"{sum(r['valid'] for r in rows)} weights post-processed ({kind}, by "
                "megatron-core's post-processing)")
        lines.append(f"  chunk {chunk}: aligned slot {rows[0]['aligned_slot'] if rows else '-'}; "
                     f"built at slots {slots}; {done} (all pp ranks, dp rank 0)")
    return "\n".join(lines)
