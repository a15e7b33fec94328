"""What each megatron-core version's own classes allow, on the installed version (make test
runs this file on 0.7.0, 0.8.0, 0.9.0, 0.10.0, 0.11.0 and the newer lines): 0.7/0.8's
all-gather belongs to the optimizer (the plugin then holds the optimizer's chain and needs the
optimizer; flags modelling >= 0.9's DDP paths are refused by the demo, with the version); before
0.10 no N and M a multiple of PP (the demo says so, spelled for that version, before any rank
starts)."""

import dataclasses
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

from nemo_fp8_align.errors import UnsupportedSetupError  # noqa: E402
from nemo_fp8_align.integrations import mcore_version  # noqa: E402
from support.configs import has_group_size  # noqa: E402

OPTIMIZER_OWNED = "overlap_param_gather" not in {
    f.name for f in dataclasses.fields(DistributedDataParallelConfig)}


def _demo(*flags):
    return subprocess.run([sys.executable, "-m", "nemo_fp8_align", "demo", *flags],
                          capture_output=True, text=True, timeout=600)


def test_the_gather_owner_is_read_from_this_versions_ddp_config():
    version = mcore_version.installed_version()
    assert mcore_version.optimizer_owns_gather() == OPTIMIZER_OWNED
    assert OPTIMIZER_OWNED == version.startswith(("0.7.", "0.8.")), version


def test_align_fp8_transposes_needs_the_optimizer_only_where_it_owns_the_gather():
    from nemo_fp8_align.integrations.megatron_core import _optimizer_owned

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
def test_a_chunk_without_overlap_param_gather_is_refused_with_the_nemo_20_fix():
    """Found on NeMo 2.0.0 (megatron-core 0.9.0): it sets DDP's overlap_param_gather from
    model.optim.overlap_param_gather but binds the schedule's start_param_sync from
    overlap_param_sync; megatron-core's finish_param_sync then asserted inside the aligner.
    The chunk here is a holder of megatron-core's own DistributedDataParallelConfig (the one
    attribute read), not a DDP instance: a DDP needs process groups."""
    from types import SimpleNamespace

    from nemo_fp8_align.sync.mcore import McoreParamSync

    def chunk(overlap):
        return SimpleNamespace(bucket_groups=[], ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_param_gather=overlap))

    McoreParamSync([chunk(True), chunk(True)])
    with pytest.raises(UnsupportedSetupError, match="model chunk 1: DistributedDataParallelConfig"
                       r".overlap_param_gather=False.*model.optim.overlap_param_gather=true"):
        McoreParamSync([chunk(True), chunk(False)])


def test_nemos_mcore_optimizer_is_refused_where_the_optimizer_owns_the_gather():
    """NeMo's mcore_distributed_optim path holds the DDP chunks' launches; on 0.7/0.8 (NeMo
    2.0.0rc0/rc1's containers, never run with the plugin) it is refused with the version and
    the fixes. The model is a holder of the one flag read (NeMo does not install with them)."""
    from types import SimpleNamespace

    from nemo_fp8_align.integrations.nemo.build import _param_sync

    model = SimpleNamespace(use_mcore_dist_optim=True)
    if not OPTIMIZER_OWNED:
        assert _param_sync(model, []) is not None
        return
    with pytest.raises(UnsupportedSetupError, match=f"megatron-core "
                       f"{mcore_version.installed_version()} with NeMo's mcore_distributed_optim"
                       r".*distributed_fused_adam.*megatron-core >= 0\.9\.0.*policy=off"):
        _param_sync(model, [])
