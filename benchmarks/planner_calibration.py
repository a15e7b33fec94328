"""The calibrated planner against the recorded MPS step-time runs on one H200: for every shape,
``nemo-fp8-align plan --format json`` fed that run's measured per-chunk durations
(``--measured-*-ms``, ``--ranks-share-gpu``) predicts lazy - aligned per step; the measured
saving and its paired per-round spread come from the same run's file. Shapes were split into fit
and held out before the planner was tuned (records/planner-calibration-round1-split.md); only FIT
gave a number (the shared-GPU slowdown), and the table judges the held-out shapes.

    python benchmarks/planner_calibration.py [--out benchmarks/results/planner_calibration.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "pipeline_step_time_mps_h200"
#: decided before tuning (records/planner-calibration-round1-split.md, committed first)
FIT = ("call2_mcore0192_pp4",)
HELD_OUT = ("call2_mcore0161_pp4", "call1_mcore0192_pp4", "call2_mcore0192_pp2",
            "call1_mcore0192_pp2", "call1_mcore0161_pp2")
#: round 2: models and shapes fixed before these were measured
#: (records/planner-calibration-round2.md)
ROUND2_RUNS = ROOT / "benchmarks" / "results" / "pipeline_step_time_mps_round2"
ROUND2 = ("round2_pp4_vp4", "round2_pp2_m16", "round2_pp4_h6144")
MIN_ROUNDS = 3  # rounds 2 and 3: a run with fewer rounds is shown, not judged
#: round 3: PP=4 shapes that fit 80 GB and a noise gate, fixed before measuring
#: (records/planner-calibration-round3.md)
ROUND3_RUNS = ROOT / "benchmarks" / "results" / "pipeline_step_time_mps_round3"
ROUND3 = ("round3_pp4_vp4_h3072", "round3_pp4_h5120", "round3_pp4_m12")
ROUND3_QUIET = 0.05  # each policy's per-round medians within 5% of each other
ROUND3_MIN_JUDGED = 4  # of 6 shapes; fewer judged: round 3 settles nothing
#: round 4: the two-clock planner (R3), fixed before measuring
#: (records/planner-calibration-round4.md);
#: its first two runs are round 3's unmeasured shapes and count for round 3 too
ROUND4_RUNS = ROOT / "benchmarks" / "results" / "pipeline_step_time_mps_round4"
ROUND4 = ("round3_pp4_h5120", "round3_pp4_m12", "round4_pp4_vp4_h2048")
ROUND4_MIN_JUDGED = 4  # of 6 rows
# Round 5 (records/planner-calibration-round5.md): a GPU per pipeline rank, NCCL.
ROUND5_RUNS = ROOT / "benchmarks" / "results" / "pipeline_step_time_round5"
ROUND5 = ("round5_pp4_vp4_h3072", "round5_pp4_h5120", "round5_pp4_m12", "round5_pp4_vp4_h2048")
ROUND5_MIN_JUDGED = 4  # of 8 rows


def shape_argv(bench: Dict[str, Any]) -> List[str]:
    """The MPS benchmark's model as plan's sizes: 1 layer per chunk, FFN 4 x hidden, TP=1,
    DP=1, blocking unbatched p2p (the benchmark's batch_p2p_comm=False, no overlap)."""
    layers = bench["pp"] * bench["vp"] * bench["layers_per_chunk"]
    return ["--layers", str(layers), "--hidden", str(bench["hidden"]), "--heads",
            str(bench["heads"]), "--ffn", str(4 * bench["hidden"]), "--seq", str(bench["seq"]),
            "--tp", "1", "--pp", str(bench["pp"]), "--vp", str(bench["vp"]), "--dp", "1",
            "--micro-batch", str(bench["micro_batch_size"]), "--global-batch",
            str(bench["microbatches"] * bench["micro_batch_size"]),
            "--no-overlap-p2p-comm", "--no-batch-p2p-comm"]


def measured_argv(cfg: Dict[str, Any], pp: int, vp: int) -> List[str]:
    """The run's own per-chunk durations: F, B, T per (rank, chunk) from its lazy segments, the
    host wait from its aligned segments with TE's transpose, p2p from its IPC probe."""
    cells = [cfg["per_rank_costs"][f"r{r}c{c}"] for r in range(pp) for c in range(vp)]
    argv = []
    for flag, key in (("forward", "forward"), ("backward", "backward"),
                      ("transpose", "transpose"), ("host-wait", "first_extra")):
        argv += [f"--measured-{flag}-ms", ",".join(repr(max(0.0, x[key])) for x in cells)]
    return argv + ["--measured-p2p-ms", repr(cfg["saving"]["planner_inputs_ms"]["p2p"])]


def plan_json(argv: List[str]) -> Dict[str, Any]:
    from nemo_fp8_align.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *argv, "--format", "json"])
    if code:
        raise RuntimeError(f"plan {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())


def fit_slowdown() -> float:
    """Aligned / lazy median per-chunk transpose time of the torch transpose in the fit run."""
    data = json.loads((RUNS / f"{FIT[0]}.json").read_text())
    groups = next(c for c in data["configs"] if c["transposes"] == "torch")["groups"]
    return groups["aligned"]["transpose_per_chunk_ms"] / groups["lazy"]["transpose_per_chunk_ms"]


def rows_of(name: str, role: str, slowdown: float, runs: Path = RUNS) -> List[Dict[str, Any]]:
    data = json.loads((runs / f"{name}.json").read_text())
    b, out = data["bench"], []
    for cfg in data["configs"]:
        base = shape_argv(b) + measured_argv(cfg, b["pp"], b["vp"])
        share = ["--ranks-share-gpu", "--shared-gpu-slowdown", repr(slowdown)]
        pred = plan_json(base + share)
        no_slowdown = plan_json(base)["saving_ms"]
        sv, paired = cfg["saving"], cfg["saving"]["paired_per_round_ms"]
        out.append({
            **two_clock_predictions(cfg, b, slowdown),
            "run": name, "role": role, "mcore": data["versions"]["megatron_core"],
            "pp": b["pp"], "vp": b["vp"], "microbatches": b["microbatches"],
            "hidden": b["hidden"],
            "impl": cfg["transposes"], "steps": cfg["groups"]["lazy"]["step"]["n"],
            "rounds": paired["n"], "measured": sv["measured_ms"], "paired": paired,
            "gpu": data["versions"].get("gpu", "?"),
            "predicted": pred["saving_ms"], "step_ms": pred["step_ms"],
            "no_slowdown": no_slowdown, "uniform": sv["predicted_ms"],
            "noise": noise(cfg)})
        row = out[-1]
        row.update({f"inside{k}": _inside(row.get(v), paired) for k, v in (
            ("", "predicted"), ("_no_slowdown", "no_slowdown"), ("_r3", "r3"),
            ("_r3_no_slowdown", "r3_no_slowdown"))})
    return out


def _inside(predicted: Optional[float], paired: Dict[str, float]) -> bool:
    """A prediction lies in [min, max] of the paired per-round differences (None: none made)."""
    return predicted is not None and paired["min"] <= predicted <= paired["max"]


def two_clock_argv(cfg: Dict[str, Any], pp: int, vp: int) -> List[str]:
    """Round 4's R3 inputs, the run's own: per (rank, chunk) GPU times from its gpu-only
    segment, host times from its lazy segments, the host-clock wait at a chunk's first forward
    from its aligned segments with TE's transpose, p2p from its IPC probe."""
    cells = [cfg["two_clock_costs"][f"r{r}c{c}"] for r in range(pp) for c in range(vp)]
    argv = []
    for flag, key in (("forward", "forward_gpu"), ("backward", "backward_gpu"),
                      ("transpose", "transpose_gpu"), ("host-wait", "host_wait"),
                      ("forward-host", "forward_host"), ("backward-host", "backward_host"),
                      ("transpose-host", "transpose_host")):
        argv += [f"--measured-{flag}-ms", ",".join(repr(max(0.0, x[key])) for x in cells)]
    return argv + ["--measured-p2p-ms", repr(cfg["saving"]["planner_inputs_ms"]["p2p"])]


def two_clock_predictions(cfg: Dict[str, Any], b: Dict[str, Any],
                          slowdown: float) -> Dict[str, Any]:
    """R3 (two clocks, the shipped slowdown) and R3' (no slowdown) for a run with a gpu-only
    segment (none where a cell has no GPU time of some kind); ``two_clock_valid``: no cell's
    ``backlog_short`` (round 4's registered summaries pooled it over all cells)."""
    two = cfg.get("two_clock_costs")
    if not two or any(None in v.values() for v in two.values()):
        return {"r3": None, "r3_no_slowdown": None, "two_clock_valid": False}
    base = shape_argv(b) + two_clock_argv(cfg, b["pp"], b["vp"])
    return {"r3": plan_json(base + ["--ranks-share-gpu", "--shared-gpu-slowdown",
                                    repr(slowdown)])["saving_ms"],
            "r3_no_slowdown": plan_json(base)["saving_ms"],
            "two_clock_valid": not any(v["backlog_short"] for v in two.values())}


def noise(cfg: Dict[str, Any]) -> float:
    """How far one transpose's segments wandered: the largest max / min - 1 of any policy's
    per-round medians (round 3's gate; rounds 1-2 show <= 2.4% at PP=4, >= 5.2% at PP=2)."""
    spreads = [max(v) / min(v) - 1 for v in (list(g["per_round"].values())
                                             for g in cfg["groups"].values()) if v]
    return max(spreads, default=float("inf"))


def _f(x: Optional[float], nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


_HEADER = ("| run | role | megatron-core | PP | transposes | steps/policy (rounds) | measured "
           "(medians) | paired per round min / median / max | **predicted** | inside? | without "
           "the slowdown | uniform planner (before) |")
_RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|"


def _row(r: Dict[str, Any]) -> str:
    p = r["paired"]
    return (f"| {r['run']} | {r['role']} | {r['mcore']} | {r['pp']} | {r['impl']} | "
            f"{r['steps']} ({r['rounds']}) | {_f(r['measured'])} | {_f(p['min'])} / "
            f"{_f(p['median'])} / {_f(p['max'])} | **{_f(r['predicted'])}** | "
            f"{'yes' if r['inside'] else '**no**'} | {_f(r['no_slowdown'])} | {_f(r['uniform'])} |")


def markdown(rows: List[Dict[str, Any]], slowdown: float, argv: List[str]) -> str:
    held = [r for r in rows if r["role"] == "held out"]
    inside = sum(r["inside"] for r in held)
    lines = [
        "# The planner calibrated with measured durations vs the recorded MPS runs (H200)", "",
        f"Produced by `{' '.join(['python benchmarks/planner_calibration.py', *argv])}`, from the run "
        "files in `benchmarks/results/pipeline_step_time_mps_h200/` (one H200 split by CUDA MPS, "
        "TE 2.20.2 `Float8Tensor` weights, issue 20). No GPU ran for this file: it re-predicts "
        "recorded runs.", "",
        "## Fit and held-out shapes (decided before tuning)", "",
        f"- **Fit:** {', '.join(FIT)} (both transposes). The one number taken from it: the "
        f"shared-GPU slowdown of aligned transposes (aligned / lazy per-chunk time, torch "
        f"transpose) = **{slowdown:.3f}**, `--shared-gpu-slowdown`'s default. No parameter was "
        "chosen from any run's step times or savings.",
        f"- **Held out:** {', '.join(HELD_OUT)} (both transposes each: 10 shapes).",
        "- Written down in `records/planner-calibration-round1-split.md`, committed before the "
        "calibrated planner existed. Caveat: the host-wait form of the model was introduced by "
        "issue 20's analysis with all 12 shapes in view; the split is about fitted numbers.",
        "- **Inputs per shape**, all measured per-chunk durations of that run, passed as `plan "
        "--measured-forward-ms/--measured-backward-ms/--measured-transpose-ms` (per rank and "
        "chunk, lazy segments), `--measured-host-wait-ms` (first forward's excess, aligned "
        "segments with TE's transpose), `--measured-p2p-ms` (IPC probe) and `--ranks-share-gpu`.",
        "- **Criterion:** the prediction of lazy - aligned lies inside [min, max] of the paired "
        "per-round differences (lazy segment median - aligned segment median, same round).", "",
        "## Prediction vs measured (lazy - aligned per step, ms)", "",
        _HEADER,
        _RULE] + [_row(r) for r in rows]
    errors = [r["predicted"] - r["paired"]["median"] for r in held]
    resolved = [r for r in held if r["paired"]["min"] > 0]
    lines += ["", "## Reading", "",
              f"- **Held-out shapes inside their paired spread: {inside} of {len(held)}.**"
              + ("" if inside == len(held) else " Misses: " + "; ".join(
                  f"{r['run']} {r['impl']} (predicted {_f(r['predicted'], 2)}, spread "
                  f"{_f(r['paired']['min'], 2)} to {_f(r['paired']['max'], 2)})"
                  for r in held if not r["inside"]) + "."),
              f"- Prediction minus paired median over the held-out shapes: median "
              f"{_f(statistics.median(errors), 2)} ms, range {_f(min(errors), 2)} to "
              f"{_f(max(errors), 2)} ms.",
              "- Held-out shapes whose saving is resolved (every round's paired difference > 0): "
              + (", ".join(f"{r['run']} {r['impl']}: predicted {_f(r['predicted'])} vs paired "
                           f"median {_f(r['paired']['median'])} ms ({_f(100 * (r['predicted'] - r['paired']['median']) / r['paired']['median'], 0)}%)"
                           for r in resolved) or "none") + ".",
              "- Where the spread straddles zero (TE's transpose; PP=2) a prediction inside it "
              "says only that the saving is below what these runs resolve; it does not confirm "
              "the model's sign or size there."]
    lines += ["", "## After the verdict (post hoc: nothing below changed the model)", "",
              f"- Without the shared-GPU slowdown (issue 20's '+ host wait' form), "
              f"{sum(r['inside_no_slowdown'] for r in held)}"
              f" of {len(held)} held-out shapes would lie inside. The slowdown is measured (the "
              "aligned transposes do take longer when every rank builds them at once on one "
              "GPU), yet it lowers every PP=4 prediction by about 1 ms, and the resolved "
              "savings were already under-predicted.",
              "- The miss with TE's transpose at PP=4 (call 1: 3 rounds, a narrow spread) has "
              "the model's sign wrong: with the host wait, lazy's 0.28 ms transposes hide in "
              "a 0.4-1.5 ms wait and aligned pays its own, so the model says aligned is slower "
              "by 0.7 ms; every PP=4 TE run measured a positive median saving (0.6, 0.6, 2.7 "
              "ms). A reading the data allow but do not prove: where a rank's aligned slot is "
              "its own first forward of the chunk (rank 0), the aligned transposes can fill "
              "that forward's host wait as the lazy ones do; the model charges them in full.",
              "- That reading was tried on 2026-12-06 (second session) and not adopted: with "
              "the aligned transposes overlapping the host wait where the aligned slot is the "
              "rank's own first forward of the chunk, every PP=4 prediction rose by 3-6 ms, "
              "the fit shape's generic-transpose row left its spread and 7 of 10 held-out "
              "shapes were inside (against 8). The model above is unchanged.",
              "- What is specific to this setup: the host wait exists because the IPC receive "
              "blocks the host (NCCL's does not), and the slowdown because the ranks share one "
              "GPU's memory. On a cluster, leave out `--measured-host-wait-ms` (or measure it) "
              "and `--ranks-share-gpu`."]
    return "\n".join(lines) + "\n"


def mlm_summaries() -> List[Path]:
    """The Megatron-LM-loop step-time summaries (benchmarks/megatron_lm_step_time.py's
    summary.json) under benchmarks/results/megatron_lm*/; the checks' and resume's summaries
    carry no step times and are skipped."""
    base = ROOT / "benchmarks" / "results"
    return sorted(p for p in base.glob("megatron_lm*/**/*summary.json")
                  if p.is_file() and {"chunks", "paired"} <= set(json.loads(p.read_text())))


def mlm_rows(path: Path, slowdown: float) -> List[Dict[str, Any]]:
    """Extra held-out shapes: Megatron-LM's own train() on one GPU split by MPS. Its summary has
    per rank forward per chunk, backward per call (no chunk), transposes per chunk and step (all
    policies pooled) and p2p; no host wait (not measured there: left out). Megatron-LM's p2p
    with interleaving: overlap_p2p_comm on, batch off. A blockwise-FP8 run's "transposes" are
    TE's column-wise builds (the same per-chunk post-all-gather work to the planner); its rows
    say the recipe."""
    data = json.loads(path.read_text())
    sh, chunks = data["shape"], data["chunks"]
    pp, vp, out = sh["pp"], sh["vp"], []
    recipe = sh.get("recipe", "delayed")
    ranks = [chunks[f"pp rank {r}"] for r in range(pp)]
    mode = ranks[0].get("p2p_mode") or "ipc"
    # the ping-pong is timed on the ranks that ran it (ranks 0 and 1)
    p2p = statistics.median(r["p2p_one_way_ms"][mode] for r in ranks
                            if mode in r.get("p2p_one_way_ms", {}))
    bench = {"pp": pp, "vp": vp, "layers_per_chunk": 1, "hidden": sh["hidden"],
             "heads": sh["heads"], "seq": sh["seq"], "micro_batch_size": sh["micro_batch_size"],
             "microbatches": sh["microbatches"]}
    for impl in sh["transposes"]:
        paired = data["paired"].get(f"{impl}: lazy - aligned", {})
        if not paired.get("n"):
            continue
        fwd = [ranks[r]["forward_ms_per_chunk"][str(c)] for r in range(pp) for c in range(vp)]
        bwd = [ranks[r]["backward_ms_per_call"]["median"] for r in range(pp) for _ in range(vp)]
        tr = [ranks[r]["transpose_ms_per_chunk_step"][f"{impl} c{c}"]
              for r in range(pp) for c in range(vp)]
        argv = [x for x in shape_argv(bench) if x != "--no-overlap-p2p-comm"] + [
            "--overlap-p2p-comm", "--measured-forward-ms", ",".join(map(repr, fwd)),
            "--measured-backward-ms", ",".join(map(repr, bwd)),
            "--measured-transpose-ms", ",".join(map(repr, tr)), "--measured-p2p-ms", repr(p2p),
            "--ranks-share-gpu", "--shared-gpu-slowdown", repr(slowdown)]
        pred = plan_json(argv)
        steps = data["step_ms"]
        out.append({
            "run": f"{path.parent.name}/{path.name.split('.')[0]}",
            "role": "held out (Megatron-LM loop)",
            "mcore": data["versions"].get("megatron_core", "?"), "pp": pp,
            "impl": impl if recipe == "delayed" else f"{impl} ({recipe} FP8)",
            "steps": steps[f"{impl} lazy"]["n"], "rounds": paired["n"],
            "gpu": data["versions"].get("gpu", "?"),
            "measured": steps[f"{impl} lazy"]["median"] - steps[f"{impl} aligned"]["median"],
            "paired": paired, "predicted": pred["saving_ms"], "step_ms": pred["step_ms"],
            "no_slowdown": None, "uniform": None,
            "inside": paired["min"] <= pred["saving_ms"] <= paired["max"]})
    return out


def mlmgpu_note(found: List[Path], rows: List[Dict[str, Any]]) -> str:
    head = "\n## Megatron-LM loop on the GPU (held-out rows added after the split)\n\n"
    if not found:
        return (head + "No Megatron-LM-loop step-time summary (`megatron_lm*/**/summary.json`, "
                "benchmarks/megatron_lm_step_time.py) existed when this file was made, so no "
                "extra held-out shape from Megatron-LM's own loop is in the table.\n")
    unresolved = all(r["paired"]["min"] < 0 < r["paired"]["max"] for r in rows)
    verdict = (f"Inside the paired spread: {sum(r['inside'] for r in rows)} of {len(rows)}"
               + ("; every spread there crosses zero, so inside says only that the saving is "
                  "below what the run resolves." if unresolved else "."))
    sources = ", ".join(f"`{p.parent.name}/{p.name}`" for p in found)
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    return (head + f"Rows 'held out (Megatron-LM loop)' come from {sources}: Megatron-LM's own "
            "train() on one GPU split by MPS, never seen before the split. Its summary carries "
            "no host wait (so none is modelled), one backward per rank (not per chunk), "
            "transposes pooled over policies, p2p from the ranks that timed it; Megatron-LM's "
            f"p2p with interleaving is taken as overlap_p2p_comm on. GPU: {gpus} (the "
            f"shared-GPU slowdown is the H200 fit's). {verdict}\n\n"
            + "\n".join([_HEADER, _RULE] + [_row(r) for r in rows]) + "\n")


def _why_failed(data: Dict[str, Any]) -> str:
    """A failed run's own error line (an out-of-memory message without its allocator detail)."""
    text = data.get("failed") or "\n".join(data.get("errors") or []) or "no result"
    line = next((x for x in reversed(text.splitlines()) if "Error" in x), text.splitlines()[-1])
    gpu = re.search(r"GPU \d+ has a total capacity of [\d.]+ GiB", line)
    return line.split(" Tried to allocate")[0].strip() + (f" ({gpu.group(0)})" if gpu else "")


def _found(names: Tuple[str, ...], folders: Tuple[Path, ...]) -> Dict[str, Path]:
    """Each run's file, from the first folder that has it (a run may serve two rounds)."""
    return {n: next(d for d in folders if (d / f"{n}.json").is_file()) for n in names
            if any((d / f"{n}.json").is_file() for d in folders)}


def _attempted(names: Tuple[str, ...], folders: Tuple[Path, ...], role: str,
               slowdown: float) -> Tuple[List[Dict[str, Any]], List[str]]:
    """A pre-registered round's files: its rows (completed runs) and the lines that say which
    runs are not measured yet and which did not complete, with their own error."""
    where = _found(names, folders)
    files = {n: json.loads((d / f"{n}.json").read_text()) for n, d in where.items()}
    failed = {n: _why_failed(data) for n, data in files.items() if not data.get("ok")}
    missing = [n for n in names if n not in files]
    rows = [r for n, data in files.items() if data.get("ok")
            for r in rows_of(n, role, slowdown, where[n])]
    lines = [f"Not measured yet: {', '.join(missing)}." if missing else
             "Every pre-registered run was attempted."]
    if failed:
        lines.append("Did not complete (no row, not judged): " + "; ".join(
            f"{n} ({why})" for n, why in failed.items()) + ".")
    return rows, lines


def round2_note(slowdown: float, runs: Path = ROUND2_RUNS) -> str:
    """Round 2's verdict: R1 (the shipped slowdown) is the primary, R2 (no slowdown) beside it;
    only runs with at least MIN_ROUNDS rounds are judged."""
    head = ("\n## Round 2: shapes measured after the models were fixed "
            "(`records/planner-calibration-round2.md`)\n\n")
    rows, lines = _attempted(ROUND2, (runs,), "round 2", slowdown)
    judged = [r for r in rows if r["rounds"] >= MIN_ROUNDS]
    lines[0] = head + lines[0]
    if rows:
        lines.append(
            f"Judged (>= {MIN_ROUNDS} rounds): {len(judged)} of {len(rows)} shapes. Inside "
            f"the paired spread, R1 (slowdown {slowdown:.3f}, primary): "
            f"{sum(r['inside'] for r in judged)} of {len(judged)}; R2 (no slowdown, the "
            f"'without the slowdown' column): {sum(r['inside_no_slowdown'] for r in judged)} of "
            f"{len(judged)}. GPU: "
            f"{', '.join(sorted({r['gpu'] for r in rows}))}.\n")
        lines += [_HEADER, _RULE] + [_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def _verdict(judged: int, inside: int, minimum: int, total: int, round_no: int, unit: str,
             model: str) -> str:
    """A pre-registered round's verdict: met / not met once ``minimum`` of ``total`` are judged;
    before that nothing, or already out of reach if a judged one is outside."""
    if judged >= minimum:
        return "met" if inside == judged else "not met"
    return (f"fewer than {minimum} of {total} {unit}s judged: round {round_no} settles nothing"
            + (f"; with {judged - inside} judged {unit}(s) outside under {model} it cannot be "
               "met by the runs still to come" if inside < judged else ""))


def _quiet(r: Dict[str, Any]) -> bool:
    """Round 3's gate (rounds 4 and 5 too): enough rounds, each policy's per-round medians close."""
    return r["rounds"] >= MIN_ROUNDS and r["noise"] <= ROUND3_QUIET


def round3_note(slowdown: float, runs: Tuple[Path, ...] = (ROUND3_RUNS, ROUND4_RUNS)) -> str:
    """Round 3's verdict: judged = >= MIN_ROUNDS rounds and quiet (ROUND3_QUIET); done
    when at least ROUND3_MIN_JUDGED shapes are judged and R1 puts every judged one inside."""
    head = ("\n## Round 3: PP=4 shapes that fit 80 GB, with a noise gate, fixed before measuring "
            "(`records/planner-calibration-round3.md`)\n\n")
    rows, lines = _attempted(ROUND3, runs, "round 3", slowdown)
    quiet = [_quiet(r) for r in rows]
    judged = [r for r, q in zip(rows, quiet) if q]
    noisy = [r for r, q in zip(rows, quiet) if not q]
    r1 = sum(r["inside"] for r in judged)
    r2 = sum(r["inside_no_slowdown"] for r in judged)
    verdict = _verdict(len(judged), r1, ROUND3_MIN_JUDGED, 2 * len(ROUND3), 3, "shape", "R1")
    lines[0] = head + lines[0]
    if noisy:
        lines.append(f"Not judged (fewer than {MIN_ROUNDS} rounds, or a policy's per-round "
                     f"medians more than {ROUND3_QUIET:.0%} apart): " + "; ".join(
                         f"{r['run']} {r['impl']} ({r['rounds']} rounds, {r['noise']:.1%})"
                         for r in noisy) + ".")
    lines.append(f"Judged: {len(judged)} of {len(rows)} shapes (the noise of each: "
                 + (", ".join(f"{r['run']} {r['impl']} {r['noise']:.1%}" for r in judged) or "-")
                 + f"). Inside the paired spread, R1 (slowdown {slowdown:.3f}, primary): {r1} of "
                 f"{len(judged)}; R2 (no slowdown): {r2} of {len(judged)}. **Verdict: {verdict}.**"
                 + (f" GPU: {', '.join(sorted({r['gpu'] for r in rows}))}." if rows else "")
                 + "\n")
    if rows:
        lines += [_HEADER, _RULE] + [_row(r) for r in rows]
    return "\n".join(lines) + "\n"


#: The leading columns of rounds 4 and 5's tables: the run, its shape, its noise and spread.
_SHAPE_COLUMNS = ("| run | GPU | PP / VP / M | hidden | transposes | steps/policy (rounds) | "
                  "noise | paired per round min / median / max |")
_HEADER4 = (_SHAPE_COLUMNS + " **R3 (two clocks)** | inside? | R3' (no slowdown) | R1 (one "
            "clock) | GPU times valid |")


def _shape_cells(r: Dict[str, Any]) -> str:
    """A row's cells under ``_SHAPE_COLUMNS``, up to and including the paired spread's ``|``."""
    p = r["paired"]
    return (f"| {r['run']} | {r['gpu']} | {r['pp']} / {r['vp']} / {r['microbatches']} | "
            f"{r['hidden']} | {r['impl']} | {r['steps']} ({r['rounds']}) | {r['noise']:.1%} | "
            f"{_f(p['min'])} / {_f(p['median'])} / {_f(p['max'])} |")


def _row4(r: Dict[str, Any]) -> str:
    inside = "-" if r["r3"] is None else "yes" if r["inside_r3"] else "**no**"
    return (f"{_shape_cells(r)} **{_f(r['r3'])}** | {inside} | {_f(r['r3_no_slowdown'])} | "
            f"{_f(r['predicted'])} | {'yes' if r['two_clock_valid'] else 'no'} |")


def round4_note(slowdown: float, runs: Tuple[Path, ...] = (ROUND4_RUNS,)) -> str:
    """Round 4's verdict: R3 (two clocks) primary; judged = round 3's gate and valid GPU times;
    done when at least ROUND4_MIN_JUDGED rows are judged and R3 puts every judged one inside."""
    head = ("\n## Round 4: the two-clock planner (R3), fixed before measuring "
            "(`records/planner-calibration-round4.md`)\n\n")
    rows, lines = _attempted(ROUND4, runs, "round 4", slowdown)
    ok = [_quiet(r) and r["two_clock_valid"] for r in rows]
    judged = [r for r, q in zip(rows, ok) if q]
    inside = sum(r["inside_r3"] for r in judged)
    verdict = _verdict(len(judged), inside, ROUND4_MIN_JUDGED, 2 * len(ROUND4), 4, "row", "R3")
    lines[0] = head + lines[0]
    shown = [r for r, q in zip(rows, ok) if not q]
    if shown:
        lines.append(f"Not judged (fewer than {MIN_ROUNDS} rounds, per-round medians more than "
                     f"{ROUND3_QUIET:.0%} apart, or no valid gpu-only segment): " + "; ".join(
                         f"{r['run']} {r['impl']}" for r in shown) + ".")
    lines.append(f"Judged: {len(judged)} of {len(rows)} rows. Inside the paired spread, R3 "
                 f"(two clocks, slowdown {slowdown:.3f}, primary): {inside} of {len(judged)}; "
                 f"R3' (no slowdown): "
                 f"{sum(r['inside_r3_no_slowdown'] for r in judged)} of {len(judged)}; R1 (one clock): {sum(r['inside'] for r in judged)} of "
                 f"{len(judged)}. **Verdict: {verdict}.**\n")
    if rows:
        lines += [_HEADER4, "|" + "---|" * 13] + [_row4(r) for r in rows]
    return "\n".join(lines) + "\n"


_HEADER5 = _SHAPE_COLUMNS + " **R2 (primary)** | inside? | uniform planner |"


def _row5(r: Dict[str, Any]) -> str:
    return (f"{_shape_cells(r)} **{_f(r['no_slowdown'])}** | "
            f"{'yes' if r['inside_no_slowdown'] else '**no**'} | {_f(r['uniform'])} |")


def round5_note(slowdown: float, runs: Tuple[Path, ...] = (ROUND5_RUNS,)) -> str:
    """Round 5's verdict: R2 (one clock, no shared-GPU slowdown: the ranks have a GPU each)
    primary; judged = round 3's gate; done when at least ROUND5_MIN_JUDGED rows are judged and
    R2 puts every judged one inside."""
    head = ("\n## Round 5: a GPU per pipeline rank (NCCL), fixed before measuring "
            "(`records/planner-calibration-round5.md`)\n\n")
    rows, lines = _attempted(ROUND5, runs, "round 5", slowdown)
    judged = [r for r in rows if _quiet(r)]
    inside = sum(r["inside_no_slowdown"] for r in judged)
    verdict = _verdict(len(judged), inside, ROUND5_MIN_JUDGED, 2 * len(ROUND5), 5, "row", "R2")
    lines[0] = head + lines[0]
    lines.append(f"Judged (>= {MIN_ROUNDS} rounds, each policy's per-round medians within "
                 f"{ROUND3_QUIET:.0%}): {len(judged)} of {len(rows)} rows. Inside the paired "
                 f"spread, R2 (one clock, the run's own durations, no slowdown): {inside} of "
                 f"{len(judged)}. **Verdict: {verdict}.**\n")
    if rows:
        lines += [_HEADER5, "|" + "---|" * 11] + [_row5(r) for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/planner_calibration.md"))
    args = p.parse_args(argv)
    slowdown = fit_slowdown()
    rows = [row for name in FIT for row in rows_of(name, "fit", slowdown)]
    rows += [row for name in HELD_OUT for row in rows_of(name, "held out", slowdown)]
    found = mlm_summaries()
    mlm = [row for path in found for row in mlm_rows(path, slowdown)]
    text = (markdown(rows, slowdown, [] if argv is None else argv) + mlmgpu_note(found, mlm)
            + round2_note(slowdown) + round3_note(slowdown) + round4_note(slowdown)
            + round5_note(slowdown))
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
