"""``check --megatron-lm`` reads the flags through Megatron-LM's own parser where
``megatron.training.arguments`` is importable (megatron-core >= 0.19: .venv-mcore019), and
through the copied flag table of Megatron-LM 0.19.2 only where it is not (.venv: NeMo's
megatron-core 0.12.3); the output says which. Where the parser is importable, Megatron-LM's own
``validate_args`` runs on the parsed list (on the CPU, world size from ``--world-size``) and its
verdict is reported beside the plugin's."""

from __future__ import annotations

import importlib.util

import pytest

from nemo_fp8_align.config_check import megatron_lm_parser
from nemo_fp8_align.config_check.megatron_lm_args import (megatron_lm_violations,
                                                          parse_megatron_lm_argv)
from support.check_json import check_cli, check_json

#: A list Megatron-LM's validate_args accepts (4 processes: PP 2, DP 2, M 8), the plugin too.
FULL = ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer "
        "--overlap-param-gather --overlap-grad-reduce --micro-batch-size 1 "
        "--global-batch-size 16 --bf16 --seq-length 128 --max-position-embeddings 128 "
        "--lr 1e-4 --hidden-size 64 --num-attention-heads 4 --train-iters 10 "
        "--tokenizer-type NullTokenizer --vocab-size 128 --mock-data").split()


def _host_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.training.arguments") is not None
    except ModuleNotFoundError:
        return False


HOST = _host_importable()
needs_host = pytest.mark.skipif(not HOST, reason="needs megatron.training (.venv-mcore019)")
needs_no_host = pytest.mark.skipif(HOST, reason="megatron.training is importable here")


def _payload(world, argv):
    return check_json(["--megatron-lm", "--world-size", str(world), "--", *argv])


@needs_no_host
def test_without_megatron_training_the_copied_table_reads_the_flags_and_says_so():
    status, payload = _payload(4, FULL)
    assert status == 0, payload
    assert payload["flags_read_by"] == "table" and payload["flags_version"] == "0.19.2"
    assert payload["megatron_lm_validate_args"] is None  # no validate_args to run here
    assert any(n.startswith("flags read by the copied flag table of Megatron-LM 0.19.2 "
                            "(megatron.training.arguments is not importable here")
               for n in payload["notes"]), payload["notes"]
    status, out, _ = check_cli("--megatron-lm", "--world-size", "4", "--", *FULL)
    assert "note: flags read by the copied flag table" in out, out
    assert "validate_args" not in out


@needs_host
def test_megatron_lms_own_parser_reads_the_flags_and_says_so(monkeypatch):
    """The table is not read where the parser is: emptied, the flags are still known."""
    source = megatron_lm_parser.flag_source()
    assert source.kind == "parser" and source.version.startswith("0.19"), source
    status, payload = _payload(4, FULL)
    assert status == 0, payload
    assert payload["flags_read_by"] == "parser", payload
    assert any(n.startswith("flags read by Megatron-LM's own parser "
                            "(megatron.training.arguments") for n in payload["notes"])
    monkeypatch.setattr(megatron_lm_parser, "table_spec", lambda: {})
    assert megatron_lm_violations(parse_megatron_lm_argv(FULL), world_size=4) == []


@needs_host
def test_the_copy_is_the_fallback_where_the_parser_does_not_import(monkeypatch):
    """The same list read by the copy (megatron.training made unimportable): the same verdict,
    and the output says the copy read it."""
    import sys

    megatron_lm_parser.flag_source.cache_clear()
    megatron_lm_parser.flag_spec.cache_clear()
    megatron_lm_parser._parser.cache_clear()
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)  # ImportError
    try:
        status, payload = _payload(4, FULL)
        assert status == 0 and payload["flags_read_by"] == "table", payload
        assert payload["megatron_lm_validate_args"] is None
    finally:
        monkeypatch.undo()
        megatron_lm_parser.flag_source.cache_clear()
        megatron_lm_parser.flag_spec.cache_clear()
        megatron_lm_parser._parser.cache_clear()


@needs_host
def test_megatron_lms_validate_args_runs_on_the_cpu_and_its_verdict_is_reported():
    status, payload = _payload(4, FULL)
    assert payload["megatron_lm_validate_args"] == "OK", payload
    assert "Megatron-LM's validate_args: OK" in payload["notes"]
    # 9 layers over PP 2: its own assertion, beside the plugin's violations
    argv = [a if a != "8" else "9" for a in FULL]
    status, payload = _payload(4, argv)
    assert status == 2
    verdict = payload["megatron_lm_validate_args"]
    assert verdict.startswith("AssertionError: number of layers of the model must be "
                              "divisible pipeline model parallel size"), verdict
    status, out, _ = check_cli("--megatron-lm", "--world-size", "4", "--", *argv)
    assert "note: Megatron-LM's validate_args: AssertionError: number of layers" in out, out
    # 3 processes: TP * PP * CP = 2 does not divide them (its own world-size assertion)
    status, payload = _payload(3, FULL)
    assert payload["megatron_lm_validate_args"].startswith("AssertionError"), payload
