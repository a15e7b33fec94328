"""``nemo-fp8-align report TELEMETRY...``: a real run's telemetry (every rank's files, ``{rank}``
templates expanded), judged by the project's judge
(:func:`~nemo_fp8_align.core.telemetry.record_problems`, each record), by the cross-check of each
record's fields against one another (:func:`field_problems`) and by
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
import glob
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from nemo_fp8_align.cli.common import one_line_usage_errors, plot_path_problem
from nemo_fp8_align.core.completeness import completeness_problems, observed_all, unseen_steps
from nemo_fp8_align.core.observe import first_steps, schedule_of, valid_from_the_start
from nemo_fp8_align.core.schedule import ScheduleError
from nemo_fp8_align.core.telemetry import record_problems
from nemo_fp8_align.errors import TelemetryError
from nemo_fp8_align.planner import gantt

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
                   "stands for every rank's file, e.g. 'out/telemetry.rank{rank}.jsonl'; '-' "
                   "reads standard input (cat telemetry.rank*.jsonl | nemo-fp8-align report -)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write a picture (.png/.svg/.pdf): the slot where each rank built each "
                   "chunk's transposes, per step")
    p.add_argument("--baseline", metavar="TELEMETRY", nargs="+", default=None,
                   help="another run's files (e.g. the lazy run): print an A/B summary")
    for name, what in SIZE_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                       metavar="N", help=f"the run's {what}, for records written without "
                       f"{name} (older telemetry): lets the report judge which records are missing")

    one_line_usage_errors(p)
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
    """The OK line: what the judges checked, then what no record can show (named "not
    observed", never implied by "every record is there")."""
    observed = observed_all(records) is True
    text = ("OK: every record passes the invariants (slot per policy, after the all-gather, all "
            "weights" + (", observed builds where the policy puts them" if observed else "")
            + "), each record's fields agree with one another, the ranks agree on each slot, and ")
    steps = sorted({r["step"] for r in records})
    span = _spans(steps)
    why = completeness_judged(records)
    if why is not None:
        text = text.replace(", and ", "; ") + why + "."
    elif any(r.get("world_size") is None for r in records):
        text += (f"every record of {span} is there (one per step/chunk/pipeline rank/"
                 "data-parallel rank; global ranks not judged: records without world_size).")
    else:
        text += f"every record of {span} is there (every rank, one record per step/chunk/rank)."
    return text + " " + _not_observed(records, steps, observed)


def _spans(steps: List[int]) -> str:
    """``steps 0-2``, or ``steps 0-1, 3-4`` around steps no rank recorded."""
    runs: List[List[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    text = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
    return f"step {text}" if len(steps) == 1 else f"steps {text}"


def _not_observed(records: List[dict], steps: List[int], observed: bool) -> str:
    """What the records cannot show: the steps outside them (the writer does not say how many a
    run had), steps between two processes' records, the microbatches (stated, never observed)
    and, without ``obs_*`` fields, where the builds ran."""
    unseen = [f"any step after step {steps[-1]}" + (f" or before step {steps[0]}" if steps[0] > 0
                                                       else "")
              + " (the records do not say how many steps the run had)"]
    between = unseen_steps(records)
    if between:
        unseen.append(", ".join(f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
                                for lo, hi in between)
                      + " (no record on any rank, between one process's steps and the next's: "
                      "a step after a checkpoint load runs without launches)")
    ms = sorted({r["microbatches"] for r in records if r.get("microbatches") is not None})
    if ms:
        unseen.append(f"the microbatches (M={ms[-1]} as the records state it; no record observes "
                      "the microbatches themselves)")
    first = first_steps(records)
    fresh = sorted({r["step"] for r in records
                    if valid_from_the_start(r, r["step"] == first[r.get("run", "")])})
    if fresh:
        unseen.append(_spans(fresh) + " as built (each run's first step found every transpose "
                      "valid, as fresh or just loaded FP8 weights carry them: nothing to build)")
    if not observed and any(r.get("weights") for r in records):
        unseen.append("where the transposes were built (records without obs_* fields: "
                      "observation off, or an older version; the placement rests on the "
                      "aligner's own slot)")
    return "Not observed: " + "; ".join(unseen) + "."


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
    return (f"PP={r['pp_size']} VP={r.get('vp_size') or '?'} DP={r.get('dp_size') or '?'} "
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
        built = sorted({f"{_valid(r)}/{r['weights']}" for r in recs})
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


def _valid(r: Mapping[str, Any]) -> int:
    """The valid count, or the built count for records without one (``valid`` absent, null or
    -1)."""
    valid = r.get("valid")
    return valid if valid is not None and valid >= 0 else r["transposed"]


def _plot(records: List[dict], path: str) -> Optional[str]:
    try:
        plot_slots(records, path)
    except (ImportError, OSError, ValueError) as err:
        return str(err)
    return None


def _inputs(args: argparse.Namespace) -> Tuple[List[dict], Optional[List[dict]]]:
    problem = plot_path_problem(args.plot)
    if problem:
        raise TelemetryError(problem)
    if STDIN in args.telemetry and STDIN in (args.baseline or ()):
        raise TelemetryError("- (standard input) given for both TELEMETRY and --baseline: it "
                             "can be read once; give one of the two runs as files")
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
        summary, base_problems = ab_summary(records, baseline)
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


# ---------------------------------------------------------------------------------------------
# Inputs: the telemetry paths ({rank} templates expanded), every record checked field by
# field, and the --plot path; each problem is one TelemetryError line


REQUIRED = ("step", "pp_rank", "dp_rank", "chunk", "policy", "vmid", "slot", "aligned_slot",
            "transposed", "weights", "after_all_gather", "seconds")
_INTS = {"step": 0, "pp_rank": 0, "dp_rank": 0, "chunk": 0, "vmid": -1, "slot": 0,
         "aligned_slot": 0, "transposed": 0, "weights": 0}
_OPTIONAL_INTS = {"valid": -1, "rank": -1, "pp_size": 1, "vp_size": 1, "microbatches": 1,
                  "group_size": 1, "dp_size": 1, "world_size": 1, "obs_built": 0, "obs_slot": 0}
_TIMES = ("seconds", "t_launch", "t_slot", "t_gathered", "t_done", "t_first_use")


def expand_paths(paths: Sequence[str]) -> List[str]:
    """``{rank}`` in a path stands for every rank's file: each existing file with a number in
    its place, in rank order."""
    out: List[str] = []
    for path in paths:
        if "{rank}" not in path:
            out.append(path)
            continue
        pattern = re.compile(re.escape(path).replace(re.escape("{rank}"), r"(\d+)") + "$")
        found = []
        for candidate in glob.glob(glob.escape(path).replace(glob.escape("{rank}"), "*")):
            match = pattern.match(candidate)
            if match:
                found.append((int(match.group(1)), candidate))
        if not found:
            raise TelemetryError(f"{path}: no file matches (with {{rank}} a number); pass the "
                                 "directory's telemetry files, e.g. telemetry.rank{rank}.jsonl")
        out.extend(c for _, c in sorted(found))
    return out


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int_problem(key: str, value: Any, least: int, optional: bool) -> Optional[str]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"field {key!r} is {json.dumps(value)} ({_kind(value)}), expected an integer"
    if value < least:
        return f"field {key!r} is {value}, expected an integer >= {least}"
    return None


def record_problem(record: Any) -> Optional[str]:
    """Why ``record`` is not a transpose record (None when it is one)."""
    if not isinstance(record, dict):
        return f"a JSON {_kind(record)}, not an object"
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    for key, least in _INTS.items():
        why = _int_problem(key, record[key], least, optional=False)
        if why:
            return why
    for key, least in _OPTIONAL_INTS.items():
        why = _int_problem(key, record.get(key), least, optional=True)
        if why:
            return why
    if record["policy"] not in ("aligned", "lazy"):
        return f"field 'policy' is {json.dumps(record['policy'])}, expected \"aligned\" or \"lazy\""
    for key in ("run", "backend", "kind"):  # keys of sets and labels: text (or null)
        if record.get(key) is not None and not isinstance(record[key], str):
            return (f"field {key!r} is {json.dumps(record[key])} ({_kind(record[key])}), "
                    "expected a string")
    for key in ("after_all_gather", "legacy_order"):
        if key in record and not isinstance(record[key], bool):
            return f"field {key!r} is {json.dumps(record[key])} ({_kind(record[key])}), expected true or false"
    for key in _TIMES:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return f"field {key!r} is {json.dumps(value)} ({_kind(value)}), expected a number or null"
    at = record.get("obs_at")
    if at is not None and not (isinstance(at, list) and all(
            isinstance(p, list) and len(p) == 2 and _int_problem("", p[0], 0, False) is None
            and isinstance(p[1], bool) for p in at)):
        return f"field 'obs_at' is {json.dumps(at)}, expected a list of [forwards, inside] pairs"
    return None


#: Forward passes per rank per step (M x VP) beyond which a record is not judged: the schedule
#: model lists every one (a real step has a few thousand; 10**12 would never end).
MAX_FORWARDS = 1_000_000


def schedule_problem(record: Mapping[str, Any]) -> Optional[str]:
    """Why the schedule shape ``record`` states is one the schedule model cannot judge it
    against (None when it can, or the record states none)."""
    vp, m = record.get("vp_size"), record.get("microbatches")
    if vp is not None and m is not None and vp * m > MAX_FORWARDS:
        return (f"microbatches {m} x vp_size {vp} = {m * vp} forwards per rank per step, more "
                f"than the {MAX_FORWARDS} the report models (a real step has a few thousand): "
                "corrupt or altered records; pass the files a run wrote")
    try:
        schedule_of(record)
    except ScheduleError as err:
        shape = ", ".join(f"{k} {record.get(k)}" for k in ("pp_size", "vp_size", "microbatches",
                                                           "group_size"))
        return (f"its schedule ({shape}) is not one megatron-core's interleaved schedule runs, "
                f"so nothing to judge it against: {err}; pass the files of a run with the "
                "plugin on (records of another kind, or altered)")
    return None


#: The path that stands for standard input (``cat t.rank*.jsonl | nemo-fp8-align report -``).
STDIN = "-"


def _read_stdin() -> List[str]:
    stream = sys.stdin
    if stream is None or stream.isatty():
        raise TelemetryError("-: reads the telemetry (JSON lines) from standard input, but it is "
                             "a terminal; pipe the files in (cat telemetry.rank*.jsonl | "
                             "nemo-fp8-align report -) or give the files' paths")
    raw = getattr(stream, "buffer", None)
    try:
        text = raw.read().decode("utf-8") if raw is not None else stream.read()
    except UnicodeDecodeError as err:
        raise TelemetryError(f"-: standard input is not UTF-8 text (byte {err.start}): not "
                             "telemetry (JSON lines)") from None
    except OSError as err:
        raise TelemetryError(f"-: cannot read standard input ({err}); give the files' "
                             "paths") from None
    return text.splitlines(keepends=True)


def _read_lines(path: str) -> List[str]:
    if path == STDIN:
        return _read_stdin()
    if os.path.isdir(path):
        raise TelemetryError(f"{path}: is a directory; pass its telemetry files, e.g. "
                             f"{os.path.join(path, 'telemetry.rank{rank}.jsonl')}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except UnicodeDecodeError as err:
        raise TelemetryError(f"{path}: not UTF-8 text (byte {err.start}): not a telemetry file "
                             "(JSON lines)") from None
    except OSError as err:
        raise TelemetryError(f"{path}: cannot read ({err.strerror})") from None


def _refuse_repeats(files: Sequence[str]) -> None:
    """One file given twice (a path and a ``{rank}`` template or glob that also matches it)
    would read every record twice, which the report's checks call broken invariants."""
    seen: Dict[str, str] = {}
    for path in files:
        key = STDIN if path == STDIN else os.path.realpath(path)
        if key in seen:
            raise TelemetryError(f"{path}: given twice (also as {seen[key]}); pass each "
                                 "telemetry file once")
        seen[key] = path


def load_telemetry(paths: Sequence[str]) -> List[dict]:
    """Every record of ``paths`` (``{rank}`` expanded); raises TelemetryError naming the file,
    the line and the field at fault."""
    records: List[dict] = []
    files = expand_paths(paths)
    _refuse_repeats(files)
    for path in files:
        name = "stdin" if path == STDIN else path
        for number, line in enumerate(_read_lines(path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TelemetryError(f"{name}:{number}: not JSON ({err.msg})") from None
            why = record_problem(record)
            if why:
                raise TelemetryError(f"{name}:{number}: not a transpose record, {why} (is this "
                                     "nemo_fp8_align telemetry?)")
            why = schedule_problem(record)
            if why:
                raise TelemetryError(f"{name}:{number}: {_where(record)}: {why}")
            records.append(record)
    if not records:
        raise TelemetryError(f"no records in {', '.join(files)}")
    records.sort(key=lambda r: (r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]))
    return records


# ---------------------------------------------------------------------------------------------
# Each record's fields against one another: what a record says in two places must agree, or the
# table would show one field while the judges read the other (an ``obs_slot`` that disagrees with
# ``obs_at`` was shown in the table, and passed).
#
# The relations are the ones docs/telemetry.md defines: ``slot`` is ``vmid + pp_rank`` (0 for
# ``vmid`` -1); ``obs_at`` holds the distinct positions ``[k, inside]`` of the ``obs_built``
# builds (none without builds, at most one per build); ``obs_slot`` is the slot of the first
# position (``k + pp_rank``; a build before the rank's first forward gets the aligned slot when it
# lies in ``[0, pp_rank]``, else ``pp_rank``), null without builds; with the schedule shape, a
# position lies within the rank's ``M x VP`` forwards of the step.


_OBSERVED = ("obs_built", "obs_at", "obs_slot")
#: record field -> what it counts; given on the command line for records that lack it.
SIZE_FLAGS = {"pp_size": "pipeline-parallel size", "vp_size": "model chunks per pipeline rank",
              "dp_size": "data-parallel size"}


def observed_slot(position: Sequence[Any], pp_rank: int, aligned_slot: int) -> int:
    """The schedule slot of an observed build position ``[k, inside]``."""
    k, inside = position
    return k + pp_rank if (k or inside) else min(aligned_slot, pp_rank)


def _where(r: Mapping[str, Any]) -> str:
    return f"step {r['step']} chunk {r['chunk']} pp rank {r['pp_rank']} dp rank {r['dp_rank']}"


def _slot_problem(r: Mapping[str, Any]) -> Optional[str]:
    want = 0 if r["vmid"] == -1 else r["vmid"] + r["pp_rank"]
    if r["slot"] != want:
        return (f"slot {r['slot']} disagrees with vmid {r['vmid']} (slot is vmid + pp_rank = "
                f"{want}, 0 for vmid -1)")
    return None


def _observed_problems(r: Mapping[str, Any]) -> List[str]:
    if all(r.get(k) is None for k in _OBSERVED):
        return []  # not observed (telemetry off, or an older version)
    built, at, slot = r.get("obs_built"), r.get("obs_at"), r.get("obs_slot")
    if built is None or at is None:
        given = ", ".join(k for k in _OBSERVED if r.get(k) is not None)
        return [f"{given} without {' and '.join(k for k in ('obs_built', 'obs_at') if r.get(k) is None)}"
                " (the observed fields are written together)"]
    positions = [tuple(p) for p in at]
    out = []
    if len(set(positions)) != len(positions):
        out.append(f"obs_at {json.dumps(at)} repeats a position (it holds distinct positions)")
    if len(set(positions)) > built:
        out.append(f"obs_at has {len(set(positions))} positions but obs_built is {built} "
                   "(each position is at least one build)")
    if built and not positions:
        out.append(f"obs_built {built} with no position in obs_at")
    if positions:
        want = observed_slot(min(positions), r["pp_rank"], r["aligned_slot"])
        if slot != want:
            out.append(f"obs_slot {slot} disagrees with obs_at {json.dumps(at)}: its first "
                       f"position {json.dumps(list(min(positions)))} is slot {want}")
    elif slot is not None:
        out.append(f"obs_slot {slot} with no observed build (obs_at is empty)")
    forwards = (r.get("microbatches") or 0) * (r.get("vp_size") or 0)
    if forwards:
        beyond = [list(p) for p in positions if p[0] > forwards or (p[1] and p[0] >= forwards)]
        if beyond:
            out.append(f"obs_at {json.dumps(beyond)} beyond the rank's {forwards} forwards of the step "
                       f"(M={r['microbatches']} x VP={r['vp_size']})")
    return out


def field_problems(records: Sequence[Mapping[str, Any]]) -> List[str]:
    """Every record whose fields contradict one another, one sentence each."""
    out = []
    for r in records:
        found = [p for p in (_slot_problem(r),) if p] + _observed_problems(r)
        out += [f"{_where(r)}: {p}" for p in found]
    return out


def completeness_judged(records: List[dict]) -> Optional[str]:
    """None when every record carries the sizes that say which records should exist; else why
    completeness cannot be judged and what to pass."""
    lacking = [k for k in SIZE_FLAGS if any(r.get(k) is None for r in records)]
    if not lacking:
        return None
    flags = " ".join(f"--{k.replace('_', '-')} N" for k in lacking)
    return (f"completeness not judged: records without {'/'.join(lacking)} (older telemetry) "
            "cannot tell a rank whose file is missing from one that does not exist; pass every "
            f"rank's file and the run's sizes ({flags}) to judge it")


# ---------------------------------------------------------------------------------------------
# --baseline: two runs of one configuration side by side, e.g. ``aligned`` (A) against ``lazy``
# (B): per chunk, how far apart the pipeline ranks had its transposes (slot skew, observed where
# recorded), the all-gather wait at the slot and the slot-to-valid time (medians), and the
# transposes built per step; then each run's verdict.


def _median_ms(values: List[float]) -> Optional[float]:
    return 1e3 * statistics.median(values) if values else None


def chunk_figures(records: List[dict]) -> Dict[int, Dict[str, Optional[float]]]:
    """Per chunk: ``skew`` (largest slot spread over the pipeline ranks in any step and
    data-parallel rank), ``wait_ms``, ``valid_ms`` (medians) and ``built`` (per step)."""
    by_chunk: Dict[int, List[dict]] = defaultdict(list)
    for r in records:
        by_chunk[r["chunk"]].append(r)
    out: Dict[int, Dict[str, Optional[float]]] = {}
    for chunk, recs in sorted(by_chunk.items()):
        spread: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        for r in recs:
            spread[(r["step"], r["dp_rank"])].append(shown_slot(r))
        steps = len({r["step"] for r in recs})
        out[chunk] = {
            "skew": float(max(max(v) - min(v) for v in spread.values())),
            "wait_ms": _median_ms([r["t_gathered"] - r["t_slot"] for r in recs
                                   if r.get("t_gathered") is not None and r.get("t_slot") is not None]),
            "valid_ms": _median_ms([r["t_done"] - r["t_slot"] for r in recs
                                    if r.get("t_done") is not None and r.get("t_slot") is not None]),
            "built": sum(r["transposed"] if r.get("obs_built") is None else r["obs_built"]
                         for r in recs) / max(steps, 1),
        }
    return out


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict_b(b: List[dict], problems: List[str]) -> str:
    if problems:
        return f"{len(problems)} problems"
    return "OK" if completeness_judged(b) is None else "OK, completeness not judged (no sizes)"


def _source(a: List[dict], b: List[dict]) -> str:
    """Which slot the skew column is from, per run."""
    seen = ["observed" if any(r.get("obs_slot") is not None for r in run) else "reported"
            for run in (a, b)]
    return (f"{seen[0]} slots" if seen[0] == seen[1]
            else f"A's {seen[0]}, B's {seen[1]} slots")


def _skew_note(name: str, policy: str, figures: Dict[int, Dict[str, Optional[float]]]) -> str:
    """What the run's skews say: the same slot on every rank, or how far apart, on which chunks."""
    skewed = {c: int(f["skew"] or 0) for c, f in figures.items() if f["skew"]}
    if not skewed:
        return f"{name} ({policy}): 0 on every chunk, every pipeline rank at the same slot"
    chunks = ", ".join(map(str, sorted(skewed)))
    most = max(skewed.values())
    return (f"{name} ({policy}): pipeline ranks up to {most} slot{'s' if most != 1 else ''} "
            f"apart on chunk{'s' if len(skewed) > 1 else ''} {chunks}")


def ab_summary(a: List[dict], b: List[dict]) -> Tuple[str, List[str]]:
    """The A/B table and B's problems (A's are judged by the caller)."""
    fa, fb = chunk_figures(a), chunk_figures(b)
    pa, pb = a[0]["policy"], b[0]["policy"]
    rows = [f"A/B: A = this run (policy {pa}, {len(a)} records), B = baseline (policy {pb}, "
            f"{len(b)} records)",
            f"{'chunk':<6}{'slot skew A/B':>16}{'all-gather wait ms A/B':>26}"
            f"{'slot->valid ms A/B':>24}{'built per step A/B':>22}"]
    for chunk in sorted(set(fa) | set(fb)):
        x, y = fa.get(chunk, {}), fb.get(chunk, {})
        pair = lambda k, d: f"{_cell(x.get(k), d)} / {_cell(y.get(k), d)}"  # noqa: E731
        rows.append(f"{chunk:<6}{pair('skew', 0):>16}{pair('wait_ms', 3):>26}"
                    f"{pair('valid_ms', 3):>24}{pair('built', 0):>22}")
    problems_b = judge(b)
    rows.append(f"(slot skew: largest minus smallest slot over the pipeline ranks, "
                f"{_source(a, b)}; {_skew_note('A', pa, fa)}; {_skew_note('B', pb, fb)}; "
                f"B's verdict: {_verdict_b(b, problems_b)})")
    if pa == pb:
        rows.append(f"(both runs are {pa}: an A/B of placement compares aligned with lazy)")
    return "\n".join(rows) + "\n", problems_b


# ---------------------------------------------------------------------------------------------
# --plot: where each rank built each chunk's transposes, per step (matplotlib)


def shown_slot(r: dict) -> int:
    """The observed slot where the record has one, else the slot the aligner reports."""
    return r["obs_slot"] if r.get("obs_slot") is not None else r["slot"]


def plot_slots(records: List[dict], path: str) -> None:
    """One panel per chunk: the slot at which each pipeline rank built it, per step."""
    # matplotlib is optional: imported only to draw (through the module, so that a test can
    # stand for a machine without it by replacing gantt.require_matplotlib)
    plt = gantt.require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    chunks = sorted({r["chunk"] for r in records})
    ranks = sorted({r["pp_rank"] for r in records})
    fig, axes = plt.subplots(1, len(chunks), figsize=(4.5 * len(chunks), 3.6), squeeze=False,
                             sharey=True)
    colours = plt.get_cmap("tab10")
    for ax, chunk in zip(axes[0], chunks):
        recs = [r for r in records if r["chunk"] == chunk]
        for aligned in sorted({r["aligned_slot"] for r in recs}):
            ax.axhline(aligned, color="black", linestyle="--", linewidth=1)
        for i, rank in enumerate(ranks):
            mine = [r for r in recs if r["pp_rank"] == rank and r["dp_rank"] == min(
                x["dp_rank"] for x in recs)]
            offset = (i - (len(ranks) - 1) / 2) * 0.08  # side by side where slots coincide
            ax.scatter([r["step"] + offset for r in mine], [shown_slot(r) for r in mine],
                       color=colours(i), label=f"pp rank {rank}", s=36,
                       marker="o" if all(r["after_all_gather"] for r in mine) else "x")
        ax.set_title(f"chunk {chunk} (dashed: aligned slot)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_xticks(sorted({r["step"] for r in recs}))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max(shown_slot(r) for r in records)
    axes[0, 0].set_ylim(-0.6, top + 0.6)
    axes[0, 0].set_ylabel("schedule slot of the transposes")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(ranks), fontsize=8, frameon=False)
    seen = "observed" if any(r.get("obs_slot") is not None for r in records) else "reported"
    fig.suptitle(f"where each rank built each chunk's FP8 transposes ({seen}; policy "
                 f"{records[0]['policy']}; x: before the all-gather finished)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
