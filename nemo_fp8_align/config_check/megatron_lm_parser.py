"""Megatron-LM's command line, read as Megatron-LM reads it.

Where Megatron-LM's own parser is importable (``megatron.training.arguments``: the megatron-core
wheel from 0.19 on, or a Megatron-LM checkout on ``PYTHONPATH``), the flags are read through it:
a parser built as ``megatron.training.arguments.parse_args`` builds its own
(``add_megatron_arguments`` on an ``argparse`` parser without abbreviations), with no
``validate_args`` (:func:`host_validate` runs that apart, where asked). Elsewhere (NeMo's
megatron-core 0.12.3, a login node without megatron-core) the copy is the fallback:
``megatron_lm_flags.txt`` lists every option of Megatron-LM 0.19.2's parser: its spelling, kind,
``nargs``, value type, choices, ``dest`` and the defaults the check reads. It is data generated
from that parser (``python -m nemo_fp8_align.config_check.megatron_lm_args --write-flags`` in an
environment with megatron-core 0.19.2), and ``tests/test_megatron_lm_parser_019.py`` holds it
equal to the live parser. :func:`flag_source` says which one reads the flags. Either way a value
is read with the flag's own ``nargs`` and type, an unknown flag is named (with the flag meant,
where one is close), and a value Megatron-LM's parser rejects is reported as it would be.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from nemo_fp8_align.config_check.megatron_lm_rules import PARSE_PROBLEMS
from nemo_fp8_align.config_check.reader import Violation

__all__ = ["ArgvProblem", "FlagSource", "MEGATRON_LM_VERSION", "SCRIPT_FLAGS", "flag_source",
           "flag_spec", "given_dests", "host_validate", "option_of", "parse_argv",
           "parse_megatron_lm_argv",
           "script_flags_given", "spec_from_parser", "takes_value", "write_flag_table"]

MEGATRON_LM_VERSION = "0.19.2"
SPEC_FILE = Path(__file__).with_name("megatron_lm_flags.txt")

#: Spellings users bring from NeMo or older Megatron-LM that are not Megatron-LM 0.19.2 flags.
#: Flags that Megatron-LM's ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` add to the parser
#: themselves where nvidia-modelopt is installed (their ``extra_args_provider``: ModelOpt's group,
#: ``add_modelopt_args`` in ``megatron/post_training/arguments.py`` at ``core_v0.19.0``, which the
#: wheel does not ship), as Megatron-LM's gpt-oss example and its QAD test pass them: not read,
#: not errors (a fix that dropped them would break those runs: no distillation teacher, another
#: model class); named in a note (:func:`script_flags_given`).
SCRIPT_FLAGS = (
    "--export-model-type", "--export-legacy-megatron", "--export-te-mcore-model",
    "--export-default-te-spec", "--export-force-local-attention", "--export-kv-cache-quant",
    "--export-real-quant-cfg", "--export-quant-cfg", "--export-kd-teacher-load",
    "--export-kd-teacher-model-config", "--export-kd-teacher-ckpt-format", "--export-kd-cfg",
    "--finetune-hf-dataset", "--finetune-data-split", "--qad-train-target",
    "--freeze-base-for-mtp", "--export-qk-l2-norm", "--export-moe-apply-probs-on-input",
    "--export-offline-model", "--modelopt-enabled", "--enable-gpt-oss")

_MEANT = {
    "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stages": "--num-layers-per-virtual-pipeline-stage",
    "--fp8": "--fp8-format hybrid",
    "--fp8-params": "--fp8-param-gather",
}

_TYPES = {"int": int, "float": float, "str": str}


class ArgvProblem(ValueError):
    """Megatron-LM's parser would stop on this command line (argparse's own message)."""


class FlagSource(NamedTuple):
    """What reads the flags: ``kind`` ``"parser"`` (Megatron-LM's own, imported) or
    ``"table"`` (the copied flag table); ``version`` the Megatron-LM (megatron-core) release
    whose flags they are; ``note`` one line for the output; ``host`` the imported module or
    None."""

    kind: str
    version: str
    note: str
    host: Any = None


_HOST = "megatron.training.arguments"


@lru_cache(maxsize=1)
def flag_source() -> FlagSource:
    """Megatron-LM's own parser where ``megatron.training.arguments`` imports and builds one,
    else the copied table (the note says why)."""
    import importlib
    import io
    import contextlib
    import warnings

    try:
        # importing it loads torch and megatron-core and may print or warn (no Apex, ...): the
        # check's output stays its own
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            module = importlib.import_module(_HOST)
        module.add_megatron_arguments  # noqa: B018 - before 0.19 Megatron-LM had no such builder
    except Exception as err:  # noqa: BLE001 - any failure to import is a reason for the copy
        why = (f"{_HOST} is not importable here" if isinstance(err, ImportError)
               else f"{_HOST} did not load ({type(err).__name__}: {err})")
        return FlagSource("table", MEGATRON_LM_VERSION, f"flags read by the copied flag table "
                          f"of Megatron-LM {MEGATRON_LM_VERSION} ({why}; with megatron-core >= "
                          "0.19 or a Megatron-LM checkout on PYTHONPATH its own parser reads "
                          "them)")
    from nemo_fp8_align.mcore_versions import importable_version

    version = importable_version() or "unknown"
    where = Path(getattr(module, "__file__", "") or _HOST).parent.parent
    return FlagSource("parser", version, f"flags read by Megatron-LM's own parser ({_HOST}, "
                      f"megatron-core {version}, {where})", module)


def _host_parser(cls: type = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's parser, built as its ``parse_args`` builds it (no extra_args_provider:
    the GPT pretraining script's own)."""
    import io
    import contextlib
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        parser = flag_source().host.add_megatron_arguments(cls(allow_abbrev=False))
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its options only here
        if callable(action.type) and action.type not in (int, float, str):
            action.type = _rejecting(action.type)
    return parser


def _rejecting(convert: Any) -> Any:
    """``convert`` (one of Megatron-LM's value types) raising only what argparse reports as an
    invalid value: some raise KeyError (an enum's member map), which argparse lets through as
    a traceback; the check names the flag instead."""
    import functools

    @functools.wraps(convert)
    def wrapped(value: str) -> Any:
        try:
            return convert(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            raise
        except Exception as err:  # noqa: BLE001 - any other failure is an invalid value
            raise ValueError(f"{type(err).__name__}: {err}") from err
    return wrapped


def spec_from_parser(parser: argparse.ArgumentParser,
                     read: Optional[Sequence[str]] = ()) -> Dict[str, Dict[str, Any]]:
    """Every option of ``parser``: option string -> dest, kind, nargs, type, choices, and the
    default where its dest is in ``read`` (the dests the check reads; None: every dest)."""
    flags: Dict[str, Dict[str, Any]] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its options only here
        kind = {"_StoreAction": "store", "_StoreTrueAction": "true",
                "_StoreFalseAction": "false", "BooleanOptionalAction": "bool"}.get(
                    type(action).__name__)
        if kind is None:
            continue  # -h / --help
        vtype = "str" if action.type is None else getattr(action.type, "__name__", "other")
        vtype = vtype if vtype in _TYPES else "other"
        for option in action.option_strings:
            flags[option] = {
                "dest": action.dest, "kind": kind, "nargs": None if kind != "store" else
                action.nargs, "type": vtype if kind == "store" else None,
                "choices": (tuple(action.choices) if action.choices is not None
                            and kind == "store" and vtype in _TYPES else None),
                "default": action.default if read is None or action.dest in read else None,
                "negative": kind == "bool" and option.startswith("--no-")}
    return flags


@lru_cache(maxsize=1)
def flag_spec() -> Dict[str, Dict[str, Any]]:
    """Every flag in :func:`spec_from_parser`'s form: read from Megatron-LM's own parser where
    :func:`flag_source` has it, else from the generated table (``megatron_lm_flags.txt``)."""
    if flag_source().kind == "parser":
        return spec_from_parser(_host_parser(), None)
    return table_spec()


@lru_cache(maxsize=1)
def table_spec() -> Dict[str, Dict[str, Any]]:
    """The generated table (``megatron_lm_flags.txt``) in :func:`spec_from_parser`'s form."""
    flags: Dict[str, Dict[str, Any]] = {}
    for line in SPEC_FILE.read_text().splitlines():
        if not line.startswith("--"):
            continue  # the header
        option, kind, nargs, vtype, dest, choices, default = line.split("\t")
        flags[option] = {
            "dest": dest, "kind": kind, "type": None if vtype == "-" else vtype,
            "nargs": None if nargs == "-" else int(nargs) if nargs.isdigit() else nargs,
            "choices": None if choices == "-" else tuple(
                _TYPES.get(vtype, str)(c) for c in choices.split(",")),
            "default": json.loads(default), "negative": kind == "bool"
            and option.startswith("--no-")}
    return flags


def option_of(dest: str) -> Optional[str]:
    """The (first) option string that sets ``dest``."""
    for option, row in flag_spec().items():
        if row["dest"] == dest and not row.get("negative"):
            return option
    return None


def takes_value(option: str) -> bool:
    row = flag_spec().get(option)
    return row is not None and row["kind"] == "store" and row["nargs"] != 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgvProblem(message)


@lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    if flag_source().kind == "parser":
        return _host_parser(_Parser)
    parser = _Parser(add_help=False, allow_abbrev=False)
    seen: Set[Tuple[str, ...]] = set()
    by_action: Dict[Tuple[str, str], List[str]] = {}
    for option, row in flag_spec().items():
        by_action.setdefault((row["dest"], row["kind"] + str(row["nargs"])), []).append(option)
    for (dest, _), options in by_action.items():
        row = flag_spec()[options[0]]
        key = tuple(options)
        if key in seen:
            continue
        seen.add(key)
        default = row["default"]
        if row["kind"] in ("true", "false"):
            parser.add_argument(*options, dest=dest, action=f"store_{row['kind']}",
                                default=(row["kind"] == "false") if default is None else default)
        elif row["kind"] == "bool":
            for option in options:
                parser.add_argument(option, dest=dest, action="store_const", default=default,
                                    const=not flag_spec()[option]["negative"])
        else:
            kwargs: Dict[str, Any] = {"dest": dest, "default": default}
            if row["nargs"] is not None:
                kwargs["nargs"] = row["nargs"]
            if row["type"] in _TYPES:
                kwargs["type"] = _TYPES[row["type"]]
            if row["choices"] is not None:
                kwargs["choices"] = row["choices"]
            parser.add_argument(*options, **kwargs)
    return parser


def given_dests(argv: Sequence[str]) -> Set[str]:
    """The dests the command line sets explicitly."""
    spec = flag_spec()
    return {spec[token.split("=", 1)[0]]["dest"] for token in argv
            if token.startswith("--") and token.split("=", 1)[0] in spec}


def parse_argv(argv: Sequence[str]) -> Tuple[Dict[str, Any], List[Violation]]:
    """(Megatron-LM's arguments as ``vars(args)`` before validation, problems): every flag
    Megatron-LM 0.19.2 does not have, and the first value its parser rejects, as violations
    naming the flag."""
    problems: List[Violation] = []
    remaining = list(argv)
    for _ in range(len(argv) + 1):
        try:
            known, rest = _parser().parse_known_args(remaining)
            args = vars(known)
            break
        except ArgvProblem as err:
            problems.append(_parse_problem(str(err)))
            # Megatron-LM's parser stops here; the check reads on without that flag, so the
            # settings given after it are judged as given (not as Megatron-LM's defaults)
            shorter = _without_flag(remaining, problems[-1].key)
            if shorter == remaining:
                args, rest = {row["dest"]: row["default"] for row in flag_spec().values()}, []
                break
            remaining = shorter
    problems += _unknown(rest, argv)
    args["_is_global_batch_size_explicitly_specified"] = args.get("global_batch_size") is not None
    return args, problems


def parse_megatron_lm_argv(argv: Sequence[str]) -> Dict[str, Any]:
    """Megatron-LM's arguments parsed from a command line as its parser reads them (every
    argument, with its defaults); what its parser would stop on (an unknown flag, a value it
    rejects) is kept under ``PARSE_PROBLEMS`` for
    :func:`~nemo_fp8_align.config_check.megatron_lm_args.megatron_lm_violations`."""
    args, problems = parse_argv(argv)
    args[PARSE_PROBLEMS] = problems
    return args


def _without_flag(argv: List[str], flag: str) -> List[str]:
    """``argv`` without ``flag`` (as ``--flag value ...`` or ``--flag=value``) and the values
    after it up to the next flag."""
    out: List[str] = []
    skipping = False
    for token in argv:
        if token == flag or token.startswith(flag + "="):
            skipping = token == flag
            continue
        if skipping and not token.startswith("--"):
            continue
        skipping = False
        out.append(token)
    return out


def _parse_problem(message: str) -> Violation:
    flag = message.split(":", 1)[0].replace("argument ", "").split("/")[0].strip()
    return Violation(flag or "<arguments>", message, f"an argument list Megatron-LM "
                     f"{flag_source().version}'s parser accepts", f"correct {flag} (Megatron-LM's "
                     f"parser stops here: '{message}')")


_SCHEDULE = "--step-batch-size-schedule"
_ENTRY = re.compile(r"[0-9.]+[KMBT]?:[0-9.]+[KMBT]?", re.I)


def _stray_fix(strays: Sequence[str], argv: Sequence[str]) -> str:
    """How to fix values with no flag: dropped, or, where they are schedule entries right after
    ``--step-batch-size-schedule``'s one value (the entries unquoted), quoted into that value,
    which keeps the batch ramp (dropping them would leave the first entry's batch for good)."""
    drops = "; ".join(f"drop {t}" for t in strays)
    at = next((i for i in range(2, len(argv)) if argv[i] == strays[0]
               and argv[i - 2] == _SCHEDULE), None)
    if at is None or not all(_ENTRY.fullmatch(t) for t in [argv[at - 1], *strays]):
        return drops
    return f"{shlex.join([_SCHEDULE, ' '.join([argv[at - 1], *strays])])}; {drops}"


def _unknown(rest: Sequence[str], argv: Sequence[str] = ()) -> List[Violation]:
    out: List[Violation] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        values = []
        while i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            values.append(rest[i + 1])
            i += 1
        i += 1
        if not token.startswith("-"):
            # one edit per token: the strays after it are read with it, and all must go
            out.append(Violation(token, "a value with no flag before it" + (
                f" (and {' '.join(values)} after it)" if values else ""), "every value after a "
                "flag Megatron-LM has", _stray_fix([token, *values], argv)))
            continue
        name = token.split("=", 1)[0]
        if name in SCRIPT_FLAGS:
            continue
        meant = _MEANT.get(name) or next(iter(difflib.get_close_matches(
            name, list(flag_spec()), n=1, cutoff=0.8)), None)
        hint = f"; did you mean {meant}?" if meant else ""
        shown = " ".join([token, *values])
        # the guess is text only: pasted as a flag with the unknown flag's value, it replaced
        # a setting the user gave (a multimodal script's --dataloader-save PATH became
        # --dataloader-type PATH over its --dataloader-type external) or turned one off
        version = flag_source().version
        out.append(Violation(name, f"{shown} (not a Megatron-LM {version} flag)",
                             f"a flag of Megatron-LM {version}'s parser, which stops "
                             f"on any other ('unrecognized arguments'){hint}",
                             f"drop {name}"))
    return out


def script_flags_given(argv: Sequence[str]) -> List[str]:
    """The :data:`SCRIPT_FLAGS` in ``argv``, in order."""
    return [t.split("=", 1)[0] for t in argv if t.split("=", 1)[0] in SCRIPT_FLAGS]


def write_flag_table(read: Sequence[str], path: Path = SPEC_FILE) -> None:
    """Write ``megatron_lm_flags.txt`` from the installed Megatron-LM's parser, with the
    defaults of the dests in ``read``."""
    from megatron.training.arguments import add_megatron_arguments

    spec = spec_from_parser(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)),
                            read)
    lines = [f"# Megatron-LM {MEGATRON_LM_VERSION}'s command-line options, generated from its "
             "parser by `python -m nemo_fp8_align.config_check.megatron_lm_args --write-flags`; do "
             "not edit. Columns (tab-separated): option, kind, nargs, type, dest, choices, "
             "default (JSON, for the dests the check reads)."]
    for option, row in sorted(spec.items()):
        cols = [option, row["kind"], "-" if row["nargs"] is None else str(row["nargs"]),
                row["type"] or "-", row["dest"],
                "-" if row["choices"] is None else ",".join(map(str, row["choices"])),
                json.dumps(row["default"])]
        lines.append("\t".join(cols))
    path.write_text("\n".join(lines) + "\n")


#: What the CPU lacks, in the errors validate_args raises where it asks the GPU (the grouped
#: GEMM's compute capability, the device architecture with TP or CP > 1).
_NO_GPU = ("CUDA", "cuda", "NVIDIA driver", "no GPU", "device")


def host_validate(argv: Sequence[str], world: Optional[int]) -> Optional[str]:
    """Megatron-LM's own ``validate_args`` on ``argv`` parsed by its own parser, with
    ``world`` processes (rank 0), as one line: ``"OK"``, its first error, or why it did not
    run (``"not run: ..."``: no world size, or a check that asks the GPU this machine lacks).
    None where Megatron-LM's parser is not importable (the copied table reads the flags)."""
    source = flag_source()
    if source.kind != "parser":
        return None
    if world is None:
        return "not run (the world size is unknown: pass --world-size)"
    import contextlib
    import io
    import warnings

    try:
        args = _host_parser(_Parser).parse_args(list(argv))
    except ArgvProblem as err:
        return f"its parser stops: {err}"
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    args.rank, args.world_size = 0, world
    try:
        # it prints its argument table and warns on rank 0: the check's output stays its own
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            source.host.validate_args(args, {})
    except (KeyboardInterrupt, MemoryError):
        raise
    except BaseException as err:  # noqa: BLE001 - its verdict is whatever it raises (or exits)
        text = " ".join(str(err).split()) or type(err).__name__
        if not isinstance(err, AssertionError) and any(w in text for w in _NO_GPU):
            return f"not run on this machine (it asks the GPU: {type(err).__name__}: {text})"
        return f"{type(err).__name__}: {text}"
    return "OK"
