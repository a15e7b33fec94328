"""``nemo-fp8-align report TELEMETRY...``: a real run's telemetry (every rank's files, ``{rank}``
templates expanded), judged by the project's judge
(:func:`~nemo_fp8_align.core.telemetry.record_problems`, each record) and by
:func:`~nemo_fp8_align.core.completeness.completeness_problems` (what should exist and does not,
ranks that disagree), printed per chunk, with ``--plot`` drawn and with ``--baseline`` set
against another run (A/B). Exit status: 1 when an invariant is broken (whatever else went
wrong), else 2 for bad input (one line, before anything is judged) or a picture that could not
be drawn (after the verdict is printed), else 0.

Records written before the ``valid`` count, the timestamps, the schedule shape or the observed
builds existed are read as well (the judges skip what they lack; the columns say so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.cli.report_fields import SIZE_FLAGS, completeness_judged, field_problems
from nemo_fp8_align.cli.report_input import REQUIRED, load_telemetry, plot_path_problem
from nemo_fp8_align.core.completeness import completeness_problems
from nemo_fp8_align.core.telemetry import record_problems
from nemo_fp8_align.errors import TelemetryError

__all__ = ["add_report_parser", "load_telemetry", "format_report", "judge", "run_report",
           "TelemetryError", "REQUIRED"]


def add_report_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "report", help="check and summarise a run's FP8 transpose telemetry (JSON lines from "
        "every rank)", description="Judge a run's FP8 transpose telemetry: every record's "
        "invariants, every record and rank that should exist, the ranks' agreement on each "
        "chunk's aligned slot, and where the builds were observed.")
    p.add_argument("telemetry", nargs="+", metavar="TELEMETRY",
                   help="telemetry files (JSON lines), all ranks of one run; '{rank}' in a path "
                   "stands for every rank's file, e.g. 'out/telemetry.rank{rank}.jsonl'")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write a picture (.png/.svg/.pdf): the slot where each rank built each "
                   "chunk's transposes, per step")
    p.add_argument("--baseline", metavar="TELEMETRY", nargs="+", default=None,
                   help="another run's files (e.g. the lazy run): print an A/B summary")
    for name, what in SIZE_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                       metavar="N", help=f"the run's {what}, for records written without "
                       f"{name} (older telemetry): lets the report judge which records are missing")
    p.set_defaults(func=run_report)


def _with_sizes(records: List[dict], args: argparse.Namespace) -> List[dict]:
    """``records`` with the sizes given by flag filled in where a record lacks them; a size a
    record carries must equal the flag's."""
    given = {k: getattr(args, k, None) for k in SIZE_FLAGS}
    for key, value in given.items():
        if value is not None and value < 1:
            raise TelemetryError(f"--{key.replace('_', '-')} {value}: must be >= 1")
        said = sorted({r[key] for r in records if r.get(key) is not None})
        if value is not None and said and said != [value]:
            raise TelemetryError(f"--{key.replace('_', '-')} {value}, but the records say {key} "
                                 f"{', '.join(map(str, said))}: leave the flag out (the records "
                                 "carry the size) or pass the files of the run it describes")
    if all(v is None for v in given.values()):
        return records
    return [{**r, **{k: v for k, v in given.items() if v is not None and r.get(k) is None}}
            for r in records]


def _verdict(records: List[dict]) -> str:
    observed = any(r.get("obs_built") is not None for r in records)
    text = ("OK: every record passes the invariants (slot per policy, after the all-gather, all "
            "weights" + (", observed builds where the policy puts them" if observed else "")
            + "), each record's fields agree with one another, the ranks agree on each slot, and ")
    why = completeness_judged(records)
    if why is not None:
        return text.replace(", and ", "; ") + why + "."
    if any(r.get("world_size") is None for r in records):
        return text + ("every record is there (one per step/chunk/pipeline rank/data-parallel "
                       "rank; global ranks not judged: records without world_size).")
    return text + "every record is there (every rank, one record per step/chunk/rank)."


def _policy(records: List[dict]) -> str:
    policies = sorted({r["policy"] for r in records})
    if len(policies) != 1:
        raise TelemetryError(f"records of several policies ({', '.join(policies)}): pass the "
                             "files of one run")
    return policies[0]


def _ms(values: List[Optional[float]]) -> str:
    known = [v for v in values if v is not None]
    return f"{1e3 * statistics.median(known):.3f}" if known else "-"


def _timings(recs: List[dict]) -> Tuple[str, str]:
    """Median transposes time and all-gather wait at the slot (ms): from the timestamps when the
    records have them (``t_done - t_gathered``, ``t_gathered - t_slot``), else from ``seconds``
    (all-gather finish + build, no wait). Lazy records carry neither: their transposes run
    inside the chunk's first forward."""
    if all(r.get(k) is not None for r in recs for k in ("t_slot", "t_gathered", "t_done")):
        return (_ms([r["t_done"] - r["t_gathered"] for r in recs]),
                _ms([r["t_gathered"] - r["t_slot"] for r in recs]))
    return _ms([r.get("seconds") for r in recs]), "-"


def judge(records: List[dict]) -> List[str]:
    """Every problem of one run's records: per record, then what is missing or disagrees."""
    return (record_problems(records, policy=_policy(records)) + field_problems(records)
            + completeness_problems(records))


def _shape(records: List[dict]) -> str:
    r = records[-1]
    if r.get("pp_size") is None or r.get("microbatches") is None:
        return ("not recorded (older records): aligned slots judged from the "
                "ranks' agreement only")
    return (f"PP={r['pp_size']} VP={r['vp_size']} DP={r.get('dp_size') or '?'} "
            f"M={r['microbatches']} N={r.get('group_size') or 'legacy'}, world size "
            f"{r.get('world_size') or '?'}")


def _slots(per_rank: Dict[int, List[dict]], key: str) -> str:
    return " ".join(f"r{k}:{sorted({r[key] for r in v if r.get(key) is not None}) or '-'}"
                    for k, v in sorted(per_rank.items()))


def _columns(table: List[List[str]]) -> List[str]:
    """The rows with each column as wide as its widest cell (four pipeline ranks' timings overran
    fixed widths and ran into the next column); the last column is not padded."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]


def format_report(records: List[dict]) -> Tuple[str, List[str]]:
    """The per-chunk table and the judges' problems."""
    policy, problems = _policy(records), judge(records)
    pp = sorted({r["pp_rank"] for r in records})
    dp = sorted({r["dp_rank"] for r in records})
    steps = sorted({r["step"] for r in records})
    head = (f"{len(records)} records: steps {steps[0]}-{steps[-1]}, pipeline ranks "
            f"{','.join(map(str, pp))}, data-parallel ranks {','.join(map(str, dp))}, policy {policy}"
            f"\nschedule: {_shape(records)}")
    kinds = sorted({r.get("kind") or "transpose" for r in records})
    if kinds != ["transpose"]:  # per-tensor FP8 (and records older than the field) say nothing
        head += (f"\npost-all-gather work: {', '.join(kinds)} (the transposes columns count "
                 "the weights post-processed)")
    observed = any(r.get("obs_slot") is not None for r in records)
    table = [["chunk", "aligned", "slot per pp rank (all steps)"]
             + (["observed slot"] if observed else [])
             + ["transposes ms", "all-gather wait ms", "valid/weights"]]
    by_chunk: Dict[int, List[dict]] = defaultdict(list)
    for r in records:
        by_chunk[r["chunk"]].append(r)
    for chunk, recs in sorted(by_chunk.items()):
        per_rank: Dict[int, List[dict]] = defaultdict(list)
        for r in recs:
            per_rank[r["pp_rank"]].append(r)
        times = [(k, _timings(v)) for k, v in sorted(per_rank.items())]
        built = sorted({f"{r['valid'] if r.get('valid', -1) >= 0 else r['transposed']}/{r['weights']}"
                        for r in recs})
        table.append([str(chunk), str(sorted({r["aligned_slot"] for r in recs})),
                      _slots(per_rank, "slot")]
                     + ([_slots(per_rank, "obs_slot")] if observed else [])
                     + [" ".join(f"r{k}:{t}" for k, (t, _) in times),
                        " ".join(f"r{k}:{w}" for k, (_, w) in times), " ".join(built)])
    rows = [head, ""] + _columns(table)
    if policy == "lazy":
        rows.append("(lazy: the transposes run inside each rank's first forward of the chunk; "
                    "their time is not separated)")
    elif not any("t_slot" in r for r in records):
        rows.append("(records without t_slot/t_gathered/t_done timestamps: the transposes column is "
                    "the aligner's all-gather finish + build, the wait is unknown)")
    if not observed:
        why = ("no FP8 weight in them, so no build to observe" if not any(r.get("weights")
               for r in records) else "observation off, or telemetry of an older version")
        rows.append(f"(no observed builds in these records ({why}): "
                    "placement judged from the aligner's own slot only)")
    return "\n".join(rows) + "\n", problems


def _plot(records: List[dict], path: str) -> Optional[str]:
    from nemo_fp8_align.cli.report_plot import plot_slots

    try:
        plot_slots(records, path)
    except (ImportError, OSError, ValueError) as err:
        return str(err)
    return None


def _inputs(args: argparse.Namespace) -> Tuple[List[dict], Optional[List[dict]]]:
    problem = plot_path_problem(args.plot)
    if problem:
        raise TelemetryError(problem)
    records = _with_sizes(load_telemetry(args.telemetry), args)
    _policy(records)
    baseline = load_telemetry(args.baseline) if args.baseline else None
    if baseline is not None:
        _policy(baseline)
    return records, baseline


def run_report(args: argparse.Namespace) -> int:
    try:
        records, baseline = _inputs(args)
    except TelemetryError as err:
        print(f"nemo-fp8-align report: error: {err}", file=sys.stderr)
        return 2
    text, problems = format_report(records)
    print(text, end="")
    if baseline is not None:
        from nemo_fp8_align.cli.report_ab import ab_summary

        summary, base_problems = ab_summary(records, baseline, judge)
        print("\n" + summary, end="")
        problems = problems + [f"baseline: {p}" for p in base_problems]
    plot_error = _plot(records, args.plot) if args.plot else None
    if args.plot and plot_error is None:
        print(f"wrote {args.plot}")
    for problem in problems:  # the verdict is the result: stdout, as OK is
        print(f"FAILED: {problem}")
    if plot_error is not None:  # after the verdict, never instead of it
        print(f"nemo-fp8-align report: --plot {args.plot}: {plot_error}", file=sys.stderr)
    if not problems:
        print(_verdict(records))
    if problems:
        return 1
    return 2 if plot_error is not None else 0
