"""What the check's held-out upstream tests (tests/test_check_held_out_*.py) share: the upstream inputs kept as
test data, the plugin's settings as each mode spells them, the call (Megatron-LM lists judged as
megatron-core 0.19.2, their era), and the row check every trial makes: the printed line, pasted,
passes and changes none of the settings the row keeps."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from support.check_json import check_json

UP = Path(__file__).resolve().parents[1] / "data" / "upstream"
#: NeMo: the plugin on, and with the FP8 settings it needs (the launcher YAMLs ship FP8 off)
ON = ["+model.fp8_transpose_align.policy=aligned"]
FP8 = ON + ["model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True",
            "+model.optim.align_param_gather=True"]
#: Megatron-LM: FP8 weights, and with the optimizer settings ("+FP8")
FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-param-gather"]
PLUGIN = FP8_FLAGS + ["--use-distributed-optimizer", "--overlap-param-gather",
                      "--overlap-grad-reduce"]

run = functools.partial(check_json, megatron_lm_version="0.19.2")  # 0.19-era lists


def args_of(name: str) -> List[str]:
    """A Megatron-LM argument list kept one argument a line (tests/data/upstream/megatron_lm)."""
    return [a for a in (UP / "megatron_lm" / f"{name}.args").read_text().split("\n") if a]


def megatron_lm(world: int, argv: List[str]) -> Tuple[int, dict]:
    return run(["--megatron-lm", "--world-size", str(world), "--", *argv])


def launcher(name: str) -> str:
    return str(UP / "launcher" / f"{name}.yaml")


def assert_megatron_lm_line(world: int, argv: List[str], line: Optional[str],
                            kept: Iterable[str], same_world: bool = False) -> None:
    """``line`` None: the list passes as it is. Otherwise the printed line is ``line``, passes
    the check's own re-check, names none of ``kept`` (nor another world size with
    ``same_world``), and its whole argument list passes again."""
    status, payload = megatron_lm(world, argv)
    if line is None:
        assert status == 0, payload
        return
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == line, payload["fix_text"]
    if same_world:
        assert payload["fix_world_size"] in (None, world), payload["fix_text"]
    for flag in kept:
        assert flag not in payload["fix_overrides"], payload["fix_text"]
    assert megatron_lm(world, payload["fixed_argv"])[0] == 0


def assert_nemo_line(config: str, overrides: List[str], line: Sequence[str],
                     kept: Iterable[str] = ()) -> None:
    """``line`` empty: the config passes as it is. Otherwise the printed overrides are ``line``,
    pass the check's own re-check, touch none of the ``kept`` keys, and pass again pasted."""
    status, payload = run([config, *overrides])
    if not line:
        assert status == 0, payload
        return
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_overrides"] == line, payload["fix_overrides"]
    for key in kept:
        assert not any(key in o for o in line), line
    assert run([config, *overrides, *line])[0] == 0


def bridge_args(name: str) -> List[str]:
    """A Megatron-Bridge recipe written as Megatron-LM flags, one argument a line
    (tests/data/upstream/megatron_bridge; the recipe and the model each follows are named in
    tests/data/upstream/README.md)."""
    return [a for a in (UP / "megatron_bridge" / f"{name}.args").read_text().split("\n") if a]
