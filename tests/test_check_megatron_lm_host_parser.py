"""``check --megatron-lm`` reads the flags through Megatron-LM's own parser where
``megatron.training.arguments`` is importable (megatron-core >= 0.19: .venv-mcore019), and
through the copied flag table of Megatron-LM 0.19.2 only where it is not (.venv: NeMo's
megatron-core 0.12.3); the output says which. Where the parser is importable, Megatron-LM's own
``validate_args`` runs on the parsed list (on the CPU, world size from ``--world-size``) and its
verdict is reported beside the plugin's. The tests where the parser is importable are in
tests/test_megatron_lm_parser_019.py (run on .venv-mcore019); this file holds the fallback."""

from __future__ import annotations

import importlib.util

import pytest

from support.check_json import VALIDATED_ARGV, check_cli, check_json

FULL = VALIDATED_ARGV


def _host_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.training.arguments") is not None
    except ModuleNotFoundError:
        return False


HOST = _host_importable()
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
