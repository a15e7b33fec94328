"""From the ranks' files of benchmarks/pipeline_step_time_mps.py to numbers and a report: step
time min/median/max per (policy, transposes), each rank's busy and idle time, the transposes'
own GPU time, the telemetry's verdict, and the planner (nemo_fp8_align.planner) fed
the measured per-chunk forward, backward, transpose and p2p durations: its lazy-minus-aligned
saving against the measured one."""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

__all__ = ["analyse", "markdown", "predict", "predict_per_rank", "per_rank_costs"]


def _stats(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _planner():
    from nemo_fp8_align.core.schedule import InterleavedSchedule
    from nemo_fp8_align.planner import Costs, Placement, simulate
    return InterleavedSchedule, Costs, Placement, simulate


def predict(pp: int, vp: int, m: int, forward_ms: float, backward_ms: float, transpose_ms: float,
            p2p_ms: float) -> Dict[str, float]:
    """The planner's step time (ms, schedule only: no optimizer step) per placement."""
    InterleavedSchedule, Costs, Placement, simulate = _planner()
    sched = InterleavedSchedule(pp, vp, m)
    costs = Costs(forward=forward_ms / 1e3, backward=backward_ms / 1e3,
                  transpose=transpose_ms / 1e3, p2p=p2p_ms / 1e3)
    return {p.value: simulate(sched, p, costs).step_time * 1e3
            for p in (Placement.NONE, Placement.LAZY, Placement.ALIGNED)}


def per_rank_costs(b: Any, ranks: List[Dict[str, Any]], policy: str, impl: str,
                   discard: int, prefix: str = "",
                   backlog_ms: float = float("inf")) -> Dict[tuple, Dict[str, float]]:
    """Per (pp rank, chunk), medians in ms: forward, backward, the chunk's transposes, and the
    first forward's extra (its duration minus the chunk's median forward minus the transposes
    built inside it): host-side work at a chunk's first use in a step (DDP's and TE's hooks,
    the FP8 scale update) during which this rank's GPU stream waits for the host.
    ``prefix="host_"``: the same from the calls' host times instead of their event spans.
    ``backlog_ms`` (gpu-only segments): a call whose host time reached it is left out, since its
    span may hold waits for the host; ``dropped`` is the share of a cell's calls left out."""
    InterleavedSchedule = _planner()[0]
    sched = InterleavedSchedule(b.pp, b.vp, b.microbatches)
    chunk_of = [sched.forward_table[v][1] for v in range(sched.total)]
    first = {c: chunk_of.index(c) for c in range(b.vp)}
    out = {}
    for r in ranks:
        acc = {c: {"forward": [], "backward": [], "transpose": [], "first_extra": []}
               for c in range(b.vp)}
        calls = {c: [0, 0] for c in range(b.vp)}  # (left out, all) per chunk
        for seg in r["segments"]:
            if seg["policy"] != policy or seg["transposes"] != impl:
                continue
            for row in _timed(seg, discard):
                fwd, bwd = (_fitting(row, prefix + k, backlog_ms) for k in ("forward", "backward"))
                if len(fwd) != sched.total or len(bwd) != sched.total:
                    continue
                for c in range(b.vp):
                    mine = [d for v, d in enumerate(fwd) if chunk_of[v] == c]
                    theirs = [d for k, d in enumerate(bwd) if b.vp - 1 - chunk_of[k] == c]
                    trans = _fitting(row, f"{prefix}transpose_c{c}", backlog_ms)
                    calls[c][0] += (mine + theirs + trans).count(None)
                    calls[c][1] += len(mine + theirs + trans)
                    a = acc[c]
                    a["forward"] += [d for d in mine if d is not None]
                    a["backward"] += [d for d in theirs if d is not None]
                    if None not in trans:
                        a["transpose"].append(sum(trans))
                    inside = sum(trans) if policy != "aligned" and None not in trans else 0.0
                    fitted = [d for d in mine if d is not None]
                    if fwd[first[c]] is not None and fitted:
                        a["first_extra"].append(fwd[first[c]] - inside - statistics.median(fitted))
        for c, a in acc.items():
            if a["forward"]:
                cell = {k: statistics.median(v) if v else None for k, v in a.items()}
                if backlog_ms != float("inf"):
                    cell["dropped"] = calls[c][0] / max(calls[c][1], 1)
                out[(r["pp_rank"], c)] = cell
    return out


def _fitting(row: Dict[str, Any], label: str, backlog_ms: float) -> List[Optional[float]]:
    """``row[label]`` with None for each call whose host time (``host_<label>``) reached the
    backlog; the host times themselves (``label`` starting "host_") are never left out."""
    spans = row.get(label, [])
    if label.startswith("host_") or backlog_ms == float("inf"):
        return list(spans)
    return [d if h < backlog_ms else None
            for d, h in zip(spans, row.get("host_" + label, [float("inf")] * len(spans)))]


def two_clock_costs(b: Any, ranks: List[Dict[str, Any]], impl: str,
                    discard: int) -> Dict[tuple, Dict[str, Any]]:
    """Per (pp rank, chunk), ms: each call's host time (lazy segments; the host wait from
    aligned segments with TE's transpose, as ``per_rank_costs``) and its GPU time (the
    gpu-only segment, every step, from the calls whose host time stayed inside the backlog);
    empty without a gpu-only segment. ``gpu_calls_dropped``: the share of the cell's calls
    left out; ``backlog_short``: some kind of call (forward, backward, transpose) had none
    inside the backlog, so the cell has no GPU time for it (None)."""
    backlog = min((s.get("backlog_ms", 0.0) for r in ranks for s in r["segments"]
                   if s["policy"] == "gpu_only"), default=0.0)
    gpu = per_rank_costs(b, ranks, "gpu_only", impl, 0, backlog_ms=backlog)
    if not gpu:
        return {}
    host = per_rank_costs(b, ranks, "lazy", impl, discard, prefix="host_")
    wait = per_rank_costs(b, ranks, "aligned", "te" if "te" in b.transposes else impl, discard,
                          prefix="host_")
    kinds = ("forward", "backward", "transpose")
    return {k: {"forward_host": host[k]["forward"], "backward_host": host[k]["backward"],
                "transpose_host": host[k]["transpose"],
                "host_wait": max(0.0, wait.get(k, {}).get("first_extra", 0.0)),
                "forward_gpu": g["forward"], "backward_gpu": g["backward"],
                "transpose_gpu": g["transpose"], "gpu_calls_dropped": g["dropped"],
                "backlog_short": any(g[x] is None for x in kinds)}
            for k, g in gpu.items() if k in host}


def predict_per_rank(b: Any, costs: Dict[tuple, Dict[str, float]], p2p_ms: float,
                     host_overlap: bool, shared_gpu_slowdown: float = 1.0) -> Dict[str, float]:
    """The planner's step time (ms) with each rank's and chunk's own durations instead of one
    set for all. ``host_overlap``: each chunk's first forward also carries its measured host
    wait (``first_extra``, read from aligned segments), which lazily built transposes fill (the
    planner's ``host_wait``: see nemo_fp8_align.planner.simulate). ``shared_gpu_slowdown``: the
    aligned transposes' contention on the one GPU (the planner's ``--ranks-share-gpu``)."""
    InterleavedSchedule, Costs, Placement, simulate = _planner()
    from nemo_fp8_align.planner.measured import measured_costs

    keys = [(r, c) for r in range(b.pp) for c in range(b.vp)]
    measured = {name: [costs[k][name] for k in keys] for name in ("forward", "backward",
                                                                   "transpose")}
    measured["host_wait"] = [max(0.0, costs[k]["first_extra"]) if host_overlap else 0.0
                             for k in keys]
    table = measured_costs(Costs(forward=1e-3, backward=2e-3), b.pp, b.vp, measured,
                           p2p_ms=p2p_ms, shared_gpu_slowdown=shared_gpu_slowdown)
    sched = InterleavedSchedule(b.pp, b.vp, b.microbatches)
    return {p.value: simulate(sched, p, table).step_time * 1e3
            for p in (Placement.NONE, Placement.LAZY, Placement.ALIGNED)}


def _timed(seg: Dict[str, Any], discard: int) -> List[Dict[str, Any]]:
    return seg["rows"][discard:]


def _group(ranks: List[Dict[str, Any]], policy: str, impl: str, discard: int) -> Dict[str, Any]:
    """Every timed step of (policy, impl), all rounds; per step the slowest rank's time."""
    n_seg = len(ranks[0]["segments"])
    steps, schedule, per_round, per_rank = [], [], {}, {r["rank"]: {"busy": [], "idle": [], "transposes": [],
                                                        "forward": [], "backward": [],
                                                        "optimizer": []} for r in ranks}
    problems: List[str] = []
    for s in range(n_seg):
        segs = [r["segments"][s] for r in ranks]
        if segs[0]["policy"] != policy or segs[0]["transposes"] != impl:
            continue
        for r, seg in zip(ranks, segs):
            problems += [f"rank {r['rank']} round {seg['round']}: {p}" for p in seg["problems"]]
        rows = [_timed(seg, discard) for seg in segs]
        seg_steps = [max(rr[k]["step"] for rr in rows) for k in range(len(rows[0]))]
        steps += seg_steps
        schedule += [max(rr[k]["step"] - rr[k]["optimizer"] for rr in rows)
                     for k in range(len(rows[0]))]
        per_round[segs[0]["round"]] = statistics.median(seg_steps)
        for r, rr in zip(ranks, rows):
            d = per_rank[r["rank"]]
            for row in rr:
                trans = sum(v for k, vs in row.items() if k.startswith("transpose_") for v in vs)
                busy = sum(row.get("forward", [])) + sum(row.get("backward", [])) + row["optimizer"]
                d["busy"].append(busy)
                d["idle"].append(row["step"] - busy)
                d["transposes"].append(trans)
                d["forward"] += row.get("forward", [])
                d["backward"] += row.get("backward", [])
                d["optimizer"].append(row["optimizer"])
    return {"policy": policy, "transposes": impl, "step": _stats(steps),
            "schedule": _stats(schedule), "per_round": per_round,
            "problems": problems,
            "ranks": {k: {n: (statistics.median(v) if v else None) for n, v in d.items()}
                      for k, d in per_rank.items()},
            "transpose_per_chunk_ms": _per_chunk(ranks, policy, impl, discard)}


def _per_chunk(ranks, policy, impl, discard) -> Optional[float]:
    """Median over steps of one chunk's transposes on one rank, averaged over ranks and chunks."""
    vals = []
    for r in ranks:
        for seg in r["segments"]:
            if seg["policy"] != policy or seg["transposes"] != impl:
                continue
            for row in _timed(seg, discard):
                vals += [sum(vs) for k, vs in row.items() if k.startswith("transpose_c")]
    return statistics.median(vals) if vals else None


def analyse(b: Any, ranks: List[Dict[str, Any]], failed: Optional[str], wall_s: float,
            argv: List[str]) -> Dict[str, Any]:
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if r.get("error")]
    out: Dict[str, Any] = {"bench": {k: getattr(b, k) for k in b.__dataclass_fields__},
                           "argv": argv, "wall_s": round(wall_s, 1), "failed": failed,
                           "errors": errors, "date": datetime.now(timezone.utc).isoformat(
                               timespec="seconds"), "configs": []}
    good = len(ranks) == b.ranks and not errors and all("segments" in r for r in ranks)
    out["ok"] = good
    if not good:
        return out
    r0 = next(r for r in ranks if r["rank"] == 0)
    out["versions"], out["p2p"] = r0["versions"], r0["p2p"]
    out["shares"] = [r["share_percent"] for r in ranks]
    out["rounds_run"] = r0.get("rounds_run")
    out["weight_types"] = sorted({t for r in ranks for t in r["weight_types"]})
    out["weights_per_chunk"] = r0["weights_per_chunk"]
    mode = r0["p2p"].get("mode", "host")
    p2p_ms = r0["p2p"].get(mode, {}).get("median_ms", 0.0)
    for impl in b.transposes:
        groups = {p: _group(ranks, p, impl, b.discard) for p in b.policies}
        cfg: Dict[str, Any] = {"transposes": impl, "groups": groups}
        if "off" in groups:
            base = groups["off"]["step"]["median"]
            for g in groups.values():
                g["ratio_vs_off"] = g["step"]["median"] / base
        if {"lazy", "aligned"} <= set(groups):
            lazy, aligned = groups["lazy"], groups["aligned"]
            paired = [lazy["per_round"][k] - aligned["per_round"][k]
                      for k in sorted(lazy["per_round"]) if k in aligned["per_round"]]
            fwd = statistics.mean(v["forward"] for g in groups.values() for v in g["ranks"].values())
            bwd = statistics.mean(v["backward"] for g in groups.values() for v in g["ranks"].values())
            delta = lazy["transpose_per_chunk_ms"] or 0.0
            pred = predict(b.pp, b.vp, b.microbatches, fwd, bwd, delta, p2p_ms)
            opt = statistics.median(max(v["optimizer"] for v in g["ranks"].values())
                                    for g in groups.values())
            measured = lazy["step"]["median"] - aligned["step"]["median"]
            predicted = pred["lazy"] - pred["aligned"]
            cfg["saving"] = {
                "measured_ms": measured, "paired_per_round_ms": _stats(paired),
                "predicted_ms": predicted,
                "error_pct": 100 * (predicted - measured) / measured if measured else None,
                "planner_inputs_ms": {"forward": fwd, "backward": bwd, "transpose": delta,
                                      "p2p": p2p_ms, "p2p_mode": mode, "allgather": 0.0},
                "predicted_step_ms": {k: v + opt for k, v in pred.items()},
                "optimizer_ms": opt,
                "lazy_adds_predicted_ms": pred["lazy"] - pred["none"],
                "share_removed_predicted": predicted / (pred["lazy"] - pred["none"])
                if pred["lazy"] > pred["none"] else None,
                "share_removed_measured": measured / (pred["lazy"] - pred["none"])
                if pred["lazy"] > pred["none"] else None}
            lazy_costs = per_rank_costs(b, ranks, "lazy", impl, b.discard)
            # The host wait at a chunk's first forward, read where no transposes hide it:
            # aligned segments (their transposes run before that forward) with TE's transpose.
            host = per_rank_costs(b, ranks, "aligned", "te" if "te" in b.transposes else impl,
                                  b.discard)
            for k, v in lazy_costs.items():
                v["first_extra"] = host.get(k, {}).get("first_extra", 0.0)
            two = two_clock_costs(b, ranks, impl, b.discard)
            if two:
                cfg["two_clock_costs"] = {f"r{k[0]}c{k[1]}": v for k, v in two.items()}
            if not b.cpu_dry_run and len(lazy_costs) == b.pp * b.vp:
                cfg["per_rank_costs"] = {f"r{k[0]}c{k[1]}": v for k, v in lazy_costs.items()}
                for label, overlap in (("per_rank", False), ("per_rank_host_overlap", True)):
                    pr = predict_per_rank(b, lazy_costs, p2p_ms, overlap)
                    cfg["saving"][label] = {
                        "step_ms": pr, "predicted_ms": pr["lazy"] - pr["aligned"],
                        "error_pct": 100 * (pr["lazy"] - pr["aligned"] - measured) / measured
                        if measured else None}
        out["configs"].append(cfg)
    out["observed"] = _observed(ranks)
    out["ok"] = not any(g["problems"] for c in out["configs"] for g in c["groups"].values())
    return out


def _observed(ranks: List[Dict[str, Any]]) -> Dict[str, str]:
    """The ``report`` command's table for round 0's lazy and aligned records (all ranks)."""
    from nemo_fp8_align.cli.report import format_report
    out = {}
    for policy in ("lazy", "aligned"):
        recs = [x for r in ranks for seg in r["segments"] if seg["policy"] == policy
                and seg["transposes"] == "te" for x in seg["records"]]
        if recs:
            text, problems = format_report(recs)
            out[policy] = text + (f"FAILED: {len(problems)} problems\n" if problems else "OK\n")
    return out


def _f(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(s: Dict[str, Any]) -> str:
    b = s["bench"]
    lines = [f"# Pipeline step time on one GPU split by CUDA MPS ({s['date']})", "",
             f"Command: `python3 benchmarks/pipeline_step_time_mps.py {' '.join(s['argv'])}`", ""]
    if not s.get("versions"):
        lines += ["**The run did not complete.**", "", "```", str(s.get("failed")),
                  *[e[-2500:] for e in s["errors"]], "```"]
        return "\n".join(lines) + "\n"
    v, p = s["versions"], s["p2p"]
    lines += [f"- PP={b['pp']} VP={b['vp']} DP={b['dp']}, M={b['microbatches']} microbatches, "
              f"hidden {b['hidden']}, {b['heads']} heads, {b['layers_per_chunk']} layer(s) per "
              f"chunk, sequence {b['seq']}, micro-batch {b['micro_batch_size']}, FP8 recipe "
              f"{b['recipe']}; weights {', '.join(s['weight_types'])}, "
              f"{s['weights_per_chunk']} per chunk",
              f"- {v.get('gpu')}; torch {v['torch']}, Transformer Engine {v.get('te')}, "
              f"megatron-core {v['megatron_core']}; MPS shares (active thread %) per rank: "
              f"{s['shares']}",
              f"- {s.get('rounds_run')} rounds (of {b['rounds']} asked) x {len(b['policies']) * len(b['transposes'])} segments of "
              f"{b['steps_per_segment']} steps (first {b['discard']} of each discarded), order "
              f"rotated each round, after {b['warmup']} warm-up steps; wall {s['wall_s']} s"]
    for mode in ("host", "ipc"):
        if mode in p:
            q = p[mode]
            lines.append(f"- p2p {mode}: one-way {q['bytes'] / 2**20:.1f} MiB in "
                         f"{_f(q['min_ms'], 3)} / {_f(q['median_ms'], 3)} / {_f(q['max_ms'], 3)} "
                         "ms (min/median/max)")
    lines.append(f"- p2p mode used: **{p.get('mode')}** (IPC probe: "
                 f"{p.get('probe', {}).get('errors') or 'ok'})")
    for cfg in s["configs"]:
        impl = "TE's transpose" if cfg["transposes"] == "te" else \
            "slow variant: generic torch transpose"
        lines += ["", f"## Transposes: {impl}", "", "Step: forward/backward schedule plus "
                  "optimizer step, slowest rank, CUDA events; schedule only: without the "
                  "optimizer step (which includes a host-staged grad-norm all-reduce, so a wait "
                  "for the other ranks: counted as busy here).", "",
                  "| policy | steps | min ms | median ms | max ms | vs off | schedule only "
                  "(min/median/max) | transposes ms/step per rank | busy / idle ms per rank "
                  "(median) | telemetry |", "|---|---|---|---|---|---|---|---|---|---|"]
        for g in cfg["groups"].values():
            st, rk = g["step"], g["ranks"]
            lines.append(
                f"| {g['policy']} | {st['n']} | {_f(st.get('min'))} | {_f(st.get('median'))} | "
                f"{_f(st.get('max'))} | {_f(g.get('ratio_vs_off'), 4)} | "
                + "/".join(_f(g["schedule"].get(k), 1) for k in ("min", "median", "max")) + " | "
                + " ".join(_f(rk[r]["transposes"]) for r in sorted(rk)) + " | "
                + " ".join(f"{_f(rk[r]['busy'], 1)}/{_f(rk[r]['idle'], 1)}" for r in sorted(rk))
                + f" | {'OK' if not g['problems'] else str(len(g['problems'])) + ' problems'} |")
        sv = cfg.get("saving")
        if sv:
            pi, ps = sv["planner_inputs_ms"], sv["paired_per_round_ms"]
            lines += ["", f"- lazy - aligned, measured (medians): **{_f(sv['measured_ms'], 3)} ms**;"
                      f" per round (paired segment medians) min/median/max {_f(ps.get('min'), 3)} /"
                      f" {_f(ps.get('median'), 3)} / {_f(ps.get('max'), 3)} ms",
                      f"- planner, fed forward {_f(pi['forward'], 3)} ms, backward "
                      f"{_f(pi['backward'], 3)} ms, transposes {_f(pi['transpose'], 3)} ms per "
                      f"chunk, p2p {_f(pi['p2p'], 3)} ms ({pi['p2p_mode']}): lazy - aligned "
                      f"**{_f(sv['predicted_ms'], 3)} ms** (error vs measured "
                      f"{_f(sv['error_pct'], 0)}%)",
                      "- planner step times + measured optimizer step "
                      f"({_f(sv['optimizer_ms'])} ms): " + ", ".join(
                          f"{k} {_f(x)} ms" for k, x in sv["predicted_step_ms"].items()),
                      *[f"- planner with each rank's and chunk's own durations"
                        + (" and the first forwards' host wait (lazy transposes fill it)"
                           if k == "per_rank_host_overlap" else "")
                        + f": lazy - aligned **{_f(sv[k]['predicted_ms'], 3)} ms** (error "
                        f"{_f(sv[k]['error_pct'], 0)}%); steps " + ", ".join(
                            f"{n} {_f(x)}" for n, x in sv[k]["step_ms"].items())
                        for k in ("per_rank", "per_rank_host_overlap") if k in sv],
                      f"- lazy transposes add {_f(sv['lazy_adds_predicted_ms'], 3)} ms (planner, vs "
                      f"none); aligned removes {_f(100 * (sv['share_removed_predicted'] or 0), 0)}%"
                      f" of it (planner), {_f(100 * (sv['share_removed_measured'] or 0), 0)}% "
                      f"(measured saving / planner's lazy extra); (PP-1)/PP = "
                      f"{100 * (b['pp'] - 1) / b['pp']:.0f}%"]
        if cfg.get("per_rank_costs"):
            lines += ["", "Per rank and chunk (medians, ms; F, B, T from lazy segments, the first "
                      "forward's extra from aligned segments with TE's transpose): " + "; ".join(
                f"{k} F {_f(v['forward'])} B {_f(v['backward'])} T {_f(v['transpose'])} "
                f"first-forward extra {_f(v['first_extra'])}"
                for k, v in cfg["per_rank_costs"].items())]
        if cfg.get("two_clock_costs"):
            lines += ["", "Host and GPU time per call (medians, ms; host: lazy segments, host "
                      "wait from aligned segments with TE's transpose; GPU: the gpu-only segment, "
                      "a GPU backlog before each call, calls whose host time passed it left "
                      "out): " + "; ".join(
                f"{k} F {_f(v['forward_host'])}/{_f(v['forward_gpu'])} B "
                f"{_f(v['backward_host'])}/{_f(v['backward_gpu'])} T "
                f"{_f(v['transpose_host'])}/{_f(v['transpose_gpu'])} wait {_f(v['host_wait'])}"
                + (f" ({100 * v['gpu_calls_dropped']:.0f}% of gpu-only calls past the backlog)"
                   if v.get("gpu_calls_dropped") else "")
                + (" (backlog short)" if v["backlog_short"] else "")
                for k, v in cfg["two_clock_costs"].items())]
        probs = [x for g in cfg["groups"].values() for x in g["problems"]]
        if probs:
            lines += ["", "Telemetry problems (first 10):", ""] + [f"- {x}" for x in probs[:10]]
    for policy, text in s.get("observed", {}).items():
        lines += ["", f"Observed placement (`report`'s table, round 0, {policy}):", "", "```",
                  text.rstrip(), "```"]
    return "\n".join(lines) + "\n"
