"""``report``'s inputs: the telemetry paths (``{rank}`` templates expanded), every record checked
field by field, and the ``--plot`` path; each problem is one :class:`TelemetryError` line."""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence

from nemo_fp8_align.errors import TelemetryError

__all__ = ["REQUIRED", "expand_paths", "load_telemetry", "plot_path_problem", "record_problem"]

REQUIRED = ("step", "pp_rank", "dp_rank", "chunk", "policy", "vmid", "slot", "aligned_slot",
            "transposed", "weights", "after_all_gather", "seconds")
_INTS = {"step": 0, "pp_rank": 0, "dp_rank": 0, "chunk": 0, "vmid": -1, "slot": 0,
         "aligned_slot": 0, "transposed": 0, "weights": 0}
_OPTIONAL_INTS = {"valid": -1, "rank": -1, "pp_size": 1, "vp_size": 1, "microbatches": 1,
                  "group_size": 1, "dp_size": 1, "world_size": 1, "obs_built": 0, "obs_slot": 0}
_TIMES = ("seconds", "t_launch", "t_slot", "t_gathered", "t_done", "t_first_use")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


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


def _read_lines(path: str) -> List[str]:
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
        key = os.path.realpath(path)
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
        for number, line in enumerate(_read_lines(path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TelemetryError(f"{path}:{number}: not JSON ({err.msg})") from None
            why = record_problem(record)
            if why:
                raise TelemetryError(f"{path}:{number}: not a transpose record, {why} (is this "
                                     "nemo_fp8_align telemetry?)")
            records.append(record)
    if not records:
        raise TelemetryError(f"no records in {', '.join(files)}")
    records.sort(key=lambda r: (r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]))
    return records


def plot_path_problem(path: Optional[str], flag: str = "--plot") -> Optional[str]:
    """Why a picture cannot be written to ``path`` (None when it can), before any work."""
    if path is None:
        return None
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        return f"{flag} {path}: is a directory; pass a file name, e.g. {os.path.join(path, 'plot.png')}"
    if not path.lower().endswith(PLOT_SUFFIXES):
        return (f"{flag} {path}: not a picture file name; end it with "
                f"{' / '.join(PLOT_SUFFIXES)}, e.g. {os.path.splitext(path)[0]}.png")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory {parent} does not exist; create it (mkdir -p) first"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path}: not writable; pass a path you can write"
    return None
