"""What each megatron-core version's own classes allow, on the installed version (make test
runs this file on 0.7.0, 0.8.0, 0.9.0, 0.10.0, 0.11.0 and the newer lines): 0.7/0.8's
all-gather belongs to the optimizer (the plugin then holds the optimizer's chain and needs the
optimizer; flags modelling >= 0.9's DDP paths are refused by the demo, with the version); before
0.10 no N and M a multiple of PP (the demo says so, spelled for that version, before any rank
starts)."""

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

from nemo_fp8_align.errors import UnsupportedSetupError  # noqa: E402
from nemo_fp8_align import mcore_versions as mcore_version  # noqa: E402
from support.configs import has_group_size  # noqa: E402

OPTIMIZER_OWNED = "overlap_param_gather" not in {
    f.name for f in dataclasses.fields(DistributedDataParallelConfig)}


def _demo(*flags):
    from support.demo_runs import demo_cli

    return demo_cli(*flags)


def test_the_gather_owner_is_read_from_this_versions_ddp_config():
    version = mcore_version.installed_version()
    assert mcore_version.optimizer_owns_gather() == OPTIMIZER_OWNED
    assert OPTIMIZER_OWNED == version.startswith(("0.7.", "0.8.")), version


def test_align_fp8_transposes_needs_the_optimizer_only_where_it_owns_the_gather():
    from nemo_fp8_align.assemble import _optimizer_owned

    if not OPTIMIZER_OWNED:
        assert _optimizer_owned(None) is False  # the DDP chunks' all-gather: nothing needed
        return
    with pytest.raises(UnsupportedSetupError, match=f"megatron-core "
                       f"{mcore_version.installed_version()}: the parameter all-gather belongs"):
        _optimizer_owned(None)
    assert _optimizer_owned(object()) is True


def test_transformer_engine_fp8_parameters_are_refused_with_the_version_and_the_fix():
    """The rule reads the parameter's class (TE's Float8Tensor lives in transformer_engine.*),
    which TE is not installed here to build: a tensor class under TE's module name stands in
    for it; a plain parameter (the reference weights' source) passes."""
    import torch

    te_like = type("Float8Tensor", (torch.Tensor,),
                   {"__module__": "transformer_engine.pytorch.float8_tensor"})
    assert mcore_version.fp8_parameter_problem([torch.nn.Parameter(torch.ones(2))]) is None
    problem = mcore_version.fp8_parameter_problem([torch.ones(2).as_subclass(te_like)])
    assert f"megatron-core {mcore_version.installed_version()}: 1 FP8 parameter(s)" in problem
    assert "Float8Tensor" in problem and "megatron-core >= 0.9.0" in problem
    assert "distributed_fused_adam" in problem and "policy=off" in problem


@pytest.mark.skipif(not OPTIMIZER_OWNED, reason="megatron-core >= 0.9 has these paths")
@pytest.mark.parametrize("flags,named", [
    (("--eval-between-steps",), "--eval-between-steps"),
    (("--overlap-param-gather-with-optimizer-step",), "--overlap-param-gather-with-optimizer-"),
    (("--steps", "2", "--resume-at", "1"), "--resume-at"),
])
def test_demo_refuses_paths_this_version_lacks_before_any_rank_starts(flags, named):
    pp = "4" if mcore_version.installed_version().startswith("0.7.") else "2"
    proc = _demo("--pp", pp, "--vp", "2", "--microbatches", "4", *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{named}" in proc.stderr
    assert f"megatron-core {mcore_version.installed_version()} (before 0.9)" in proc.stderr
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr


def _pp():
    """0.7.0 refuses interleaving with PP 2 (its own check): the rows below use PP 4 there."""
    return 4 if mcore_version.installed_version().startswith("0.7.") else 2


@pytest.mark.skipif(has_group_size(), reason="megatron-core >= 0.10 has N: its own rules "
                    "(test_demo_cli's bad-input rows)")
@pytest.mark.parametrize("flags,want", [
    (("--microbatches", "5"), "--microbatches 5: 5 microbatches with PP {pp}: megatron-core {v} "
                              "(before 0.10) needs the number of microbatches to be a multiple "
                              "of the pipeline size with interleaving; use {fixed}"),
    (("--microbatches", "6", "--group-size", "3"), "--group-size 3: megatron-core {v} (before "
                                                   "0.10) has no microbatch_group_size_per_vp"),
])
def test_demo_spells_the_pre_010_rules_for_this_version(flags, want):
    pp = _pp()
    proc = _demo("--pp", str(pp), "--vp", "2", *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    fixed = 5 - 5 % pp + pp
    assert want.format(v=mcore_version.installed_version(), pp=pp, fixed=fixed) in proc.stderr


def test_demo_spells_070s_pipeline_size_rule_where_this_version_has_it():
    v = mcore_version.installed_version()
    if not v.startswith("0.7."):
        assert mcore_version.interleaved_pp_problem(2) is None
        return
    assert mcore_version.interleaved_pp_problem(3) is None
    proc = _demo("--pp", "2", "--vp", "2", "--microbatches", "4", "--steps", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"--pp 2: megatron-core {v} refuses the interleaved schedule with PP 2 "
            "(\"pipeline-model-parallel size should be greater than 2") in proc.stderr
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr


@pytest.mark.skipif(OPTIMIZER_OWNED, reason="no overlap_param_gather in this version's "
                    "DistributedDataParallelConfig (refused above)")
def test_a_chunk_without_overlap_param_gather_is_refused_with_the_nemo_20_fix(monkeypatch):
    """Found on NeMo 2.0.0 (megatron-core 0.9.0): it sets DDP's overlap_param_gather from
    model.optim.overlap_param_gather but binds the schedule's start_param_sync from
    overlap_param_sync; megatron-core's finish_param_sync then asserted inside the aligner.
    Real DDP chunks (a 1-process gloo world); chunk 1 is given the DistributedDataParallelConfig
    NeMo 2.0.0 built, with overlap_param_gather off."""
    from support.ddp_chunks import ddp_chunks

    from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter

    with ddp_chunks(monkeypatch) as (chunks, _config, _backend):
        McoreDDPAdapter(chunks)
        chunks[1].ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                             overlap_param_gather=False)
        with pytest.raises(UnsupportedSetupError, match="model chunk 1: DistributedDataParallel"
                           r"Config.overlap_param_gather=False.*model.optim.overlap_param_gather"
                           "=true"):
            McoreDDPAdapter(chunks)


def test_nemos_mcore_optimizer_is_refused_where_the_optimizer_owns_the_gather():
    """NeMo's mcore_distributed_optim path holds the DDP chunks' launches; on 0.7/0.8 (NeMo
    2.0.0rc0/rc1's containers, never run with the plugin) it is refused with the version and
    the fixes. The model is a holder of the one flag read (NeMo does not install with them)."""
    from types import SimpleNamespace

    from nemo_fp8_align.integrations.nemo.build import refuse_owned_gather

    model = SimpleNamespace(use_mcore_dist_optim=True)
    if not OPTIMIZER_OWNED:
        refuse_owned_gather(model)  # nothing refused
        return
    with pytest.raises(UnsupportedSetupError, match=f"megatron-core "
                       f"{mcore_version.installed_version()} with NeMo's mcore_distributed_optim"
                       r".*distributed_fused_adam.*megatron-core >= 0\.9\.0.*policy=off"):
        refuse_owned_gather(model)


# --- check --megatron-core: the version table and the check's verdicts against this version's
# --- own code (its classes, its schedule's and initialize_model_parallel's validation)


def test_the_checks_version_table_is_this_versions_classes():
    """rules_for (what ``check --megatron-core X.Y`` uses, no import) gives what the installed
    classes say (what the demo and the engine use), and the version check reads without an
    import is this one."""
    version = mcore_version.installed_version()
    assert mcore_version.installed_rules() == mcore_version.rules_for(version)
    assert mcore_version.parse_version(mcore_version.importable_version()) == \
        mcore_version.parse_version(version)


def _check_says(pp, vp, m, n=None):
    """The violations of conf/megatron_gpt_fp8_align.yaml at PP ``pp``, VP ``vp``, DP 1 and M
    ``m`` (N ``n``), checked against the installed version."""
    from pathlib import Path

    pytest.importorskip("hydra")  # the check composes the YAML (not in .venv-mcore016/019)
    from nemo_fp8_align.cli.check_load import load_source
    from nemo_fp8_align.config_check.check import find_violations

    overrides = [f"trainer.devices={pp}", f"model.pipeline_model_parallel_size={pp}",
                 f"model.virtual_pipeline_model_parallel_size={vp}",
                 f"model.num_layers={pp * vp}", f"model.global_batch_size={m}"]
    if n is not None:
        overrides.append(f"+model.microbatch_group_size_per_vp_stage={n}")
    conf = Path(__file__).resolve().parents[1] / "conf" / "megatron_gpt_fp8_align.yaml"
    _, cfg = load_source(conf, overrides)
    return find_violations(cfg, mcore=mcore_version.installed_rules())


def _shapes():
    rows = [(4, 2, m, None) for m in (4, 6, 8)] + [(2, 2, m, None) for m in (2, 3, 4, 5)]
    if has_group_size():
        rows += [(2, 2, 5, 5), (2, 2, 5, 3), (2, 2, 7, 3)]
    return rows


@pytest.mark.parametrize("shape", _shapes(), ids=str)
def test_check_accepts_exactly_the_shapes_this_versions_own_code_accepts(monkeypatch, shape):
    """A shape the check calls OK passes this version's initialize_model_parallel and its
    interleaved schedule's own validation (run up to the schedule's start); one it refuses
    is refused by one of them, and the check names that rule for this version."""
    from support.real_schedule import model_parallel_error, schedule_error

    pp, vp, m, n = shape
    found = _check_says(pp, vp, m, n)
    real = model_parallel_error(monkeypatch, pp, vp) or schedule_error(monkeypatch, pp, vp, m, n)
    assert (found == []) == (real is None), (found, real)
    if real is None:
        return
    text = " ".join(v.expected for v in found)
    version = mcore_version.installed_version()
    if "greater than 2" in real:
        assert f"megatron-core {version} refuses the interleaved schedule with PP {pp}" in text
    elif not has_group_size():
        assert f"megatron-core {version}: num_microbatches={m} is not a multiple of " \
               f"pipeline_model_parallel_size={pp}" in text
    else:
        assert "microbatch_group_size_per_vp_stage" in text


def test_check_takes_this_version_by_default():
    """No --megatron-core: the check applies the version Python would import (read without an
    import), and says which; on 0.7.0 the example config's PP 2 with interleaving is refused."""
    import argparse
    import io
    import json
    from pathlib import Path

    from nemo_fp8_align.cli.check import add_check_parser

    pytest.importorskip("hydra")  # the check composes the YAML (not in .venv-mcore016/019)
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    conf = Path(__file__).resolve().parents[1] / "conf" / "megatron_gpt_fp8_align.yaml"
    args = parser.parse_args(["check", str(conf), "--format", "json"])
    out = io.StringIO()
    status = args.func(args, out=out, err=io.StringIO())
    payload = json.loads(out.getvalue())
    version = mcore_version.importable_version()
    assert f"checked against megatron-core {version} (the installed one; --megatron-core X.Y " \
           "for another)" in payload["notes"], payload
    refused = mcore_version.installed_rules().interleaved_pp_rule(2) is not None
    assert status == (2 if refused else 0), payload
    assert refused == version.startswith("0.7."), version


def test_nemos_startup_check_judges_by_this_version():
    """At model construction (NeMo's startup check) the config is judged by the megatron-core
    NeMo runs on, as ``check`` does: on 0.7.0 the example config's PP 2 with interleaving is a
    violation named for 0.7.0; elsewhere the config passes."""
    from pathlib import Path

    pytest.importorskip("hydra")
    from nemo_fp8_align.cli.check_load import load_source
    from nemo_fp8_align.config_check.check import FP8AlignConfigError
    from nemo_fp8_align.integrations.nemo.build import startup_check

    conf = Path(__file__).resolve().parents[1] / "conf" / "megatron_gpt_fp8_align.yaml"
    _, cfg = load_source(conf, [])
    version = mcore_version.installed_version()
    if not version.startswith("0.7."):
        assert startup_check(cfg).active
        return
    with pytest.raises(FP8AlignConfigError, match=f"megatron-core {version} refuses the "
                       "interleaved schedule with PP 2"):
        startup_check(cfg)
