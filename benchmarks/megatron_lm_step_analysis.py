"""Turns benchmarks/megatron_lm_step_time.py's per-rank rows into the summary (step time per
policy and transposes: min/median/max over timed iterations, the paired per-round differences,
per-chunk forward/backward/transpose durations, p2p) and its Markdown report."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Dict, List, Optional

PAIRS = (("lazy", "aligned"), ("off", "aligned"), ("off", "lazy"))


def _stats(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": round(min(xs), 3), "median": round(statistics.median(xs), 3),
            "max": round(max(xs), 3)}


def _steps(shape: Dict[str, Any], ranks: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per timed iteration: its segment and the max over ranks of its wall time."""
    by_step: Dict[int, List[Dict[str, Any]]] = defaultdict(list)
    for r in ranks:
        for row in r.get("rows", []):
            by_step[row["step"]].append(row)
    out = []
    for step, rows in sorted(by_step.items()):
        if len(rows) != len(ranks) or rows[0]["index"] < shape["discard"]:
            continue
        out.append({k: rows[0][k] for k in ("policy", "transposes", "round")}
                   | {"step": step, "ms": max(x["ms"] for x in rows)})
    return out


def _paired(shape: Dict[str, Any], steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    med: Dict[tuple, float] = {}
    groups: Dict[tuple, List[float]] = defaultdict(list)
    for s in steps:
        groups[(s["transposes"], s["round"], s["policy"])].append(s["ms"])
    for key, xs in groups.items():
        med[key] = statistics.median(xs)
    out: Dict[str, Any] = {}
    for impl in shape["transposes"]:
        for a, b in PAIRS:
            diffs = [med[(impl, r, a)] - med[(impl, r, b)] for r in range(shape["rounds"])
                     if (impl, r, a) in med and (impl, r, b) in med]
            out[f"{impl}: {a} - {b}"] = {"per_round_ms": [round(d, 3) for d in diffs],
                                         **_stats(diffs)}
    return out


def _chunks(shape: Dict[str, Any], ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per rank: forward per chunk, backward per call, transposes per chunk and step (TE's and
    the generic one), from the timed iterations; p2p one-way (ping-pong)."""
    out: Dict[str, Any] = {}
    for r in ranks:
        fwd: Dict[int, List[float]] = defaultdict(list)
        bwd: List[float] = []
        tr: Dict[tuple, List[float]] = defaultdict(list)
        for row in r.get("rows", []):
            if row["index"] < shape["discard"]:
                continue
            if row["transposes"] == "te" and len(row.get("forward", [])) == len(row["order"]):
                for c, ms in zip(row["order"], row["forward"]):
                    fwd[c].append(ms)
                bwd += row.get("backward", [])
            for c in range(shape["vp"]):
                xs = row.get(f"transpose_c{c}")
                if xs:
                    tr[(row["transposes"], c)].append(sum(xs))
        p2p = r.get("p2p", {})
        out[f"pp rank {r.get('pp_rank')}"] = {
            "forward_ms_per_chunk": {c: _stats(v)["median"] for c, v in sorted(fwd.items())},
            "backward_ms_per_call": _stats(bwd),
            "transpose_ms_per_chunk_step": {f"{i} c{c}": _stats(v)["median"]
                                            for (i, c), v in sorted(tr.items())},
            "p2p_one_way_ms": {m: p2p[m]["median_ms"] for m in ("host", "ipc") if m in p2p},
            "p2p_mode": p2p.get("mode")}
    return out


def _problems(shape: Dict[str, Any], ranks: List[Dict[str, Any]]) -> List[str]:
    from nemo_fp8_align.core.telemetry import record_problems

    problems = []
    for r in ranks:
        if "error" in r:
            problems.append(f"rank {r['rank']}: {r['error'][-600:]}")
        for key, records in r.get("records", {}).items():
            policy = key.split("/")[0]
            found = record_problems(records, policy=policy, observed_builds=False)
            want = shape["steps_per_segment"] * shape["vp"]
            if len(records) != want:
                found.append(f"{len(records)} plugin records, expected {want}")
            problems += [f"rank {r['rank']} segment {key}: {p}" for p in found[:3]]
    return problems


def analyse(shape: Dict[str, Any], ranks: List[Dict[str, Any]], failed: Optional[str],
            wall_s: float) -> Dict[str, Any]:
    steps = _steps(shape, ranks)
    per: Dict[str, Any] = {}
    for impl in shape["transposes"]:
        for p in shape["policies"]:
            per[f"{impl} {p}"] = _stats([s["ms"] for s in steps
                                         if s["transposes"] == impl and s["policy"] == p])
    problems = _problems(shape, ranks) + ([f"ranks failed: {failed}"] if failed else [])
    if len(ranks) != shape["pp"]:
        problems.append(f"{len(ranks)} of {shape['pp']} rank files")
    return {"shape": shape, "versions": next((r.get("versions") for r in ranks
                                              if r.get("versions")), {}),
            "step_ms": per, "paired": _paired(shape, steps), "chunks": _chunks(shape, ranks),
            "problems": problems[:30], "ok": not problems, "wall_s": round(wall_s, 1),
            "rounds_run": next((r.get("rounds_run") for r in ranks if r.get("rounds_run")), None),
            "weight_types": sorted({t for r in ranks for t in r.get("weight_types", [])})}


def markdown(summary: Dict[str, Any]) -> str:
    s, v = summary["shape"], summary["versions"]
    lines = [f"# Megatron-LM train() step time on one GPU (CUDA MPS), PP={s['pp']} VP={s['vp']}",
             "", f"Written by benchmarks/megatron_lm_step_time.py. {v.get('gpu')}, torch "
             f"{v.get('torch')}, TE {v.get('te')}, megatron-core {v.get('megatron_core')}, "
             f"MPS share per rank {v.get('mps_share')}%. hidden {s['hidden']}, heads "
             f"{s['heads']}, seq {s['seq']}, FP8 recipe {s.get('recipe', 'delayed')} "
             f"(weights {', '.join(summary.get('weight_types') or ['?'])}), micro-batch "
             f"{s['micro_batch_size']}, M="
             f"{s['microbatches']}, 1 layer per chunk; {summary.get('rounds_run')} rounds x "
             f"{s['steps_per_segment']} iterations per segment, first {s['discard']} not timed. "
             f"Wall {summary['wall_s']} s.", "",
             "| transposes, policy | timed iterations | min ms | median ms | max ms |",
             "|---|---|---|---|---|"]
    for key, st in summary["step_ms"].items():
        if st.get("n"):
            lines.append(f"| {key} | {st['n']} | {st['min']} | {st['median']} | {st['max']} |")
    lines += ["", "Paired per round (difference of the rounds' medians; spread = min..max over "
              "rounds):", "", "| pair | median ms | min ms | max ms | per round |",
              "|---|---|---|---|---|"]
    for key, st in summary["paired"].items():
        if st.get("n"):
            lines.append(f"| {key} | {st['median']} | {st['min']} | {st['max']} | "
                         f"{st['per_round_ms']} |")
    lines += ["", "Per rank (timed iterations, medians): forward per chunk, backward per call, "
              "transposes per chunk and iteration, p2p one-way:", "", "```"]
    for rank, c in summary["chunks"].items():
        lines.append(f"{rank}: {c}")
    lines += ["```", "", "Problems: " + ("none" if summary["ok"] else "; ".join(
        summary["problems"][:10]))]
    return "\n".join(lines) + "\n"
