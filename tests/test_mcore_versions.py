"""What each megatron-core version's own classes allow, on the installed version (make test
runs this file on 0.7.0, 0.8.0, 0.9.0, 0.10.0, 0.11.0 and the newer lines): 0.7/0.8's
all-gather belongs to the optimizer (refused, by the demo and align_fp8_transposes, with the
version and the fix); before 0.10 no N and M a multiple of PP (the demo says so, spelled for
that version, before any rank starts)."""

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


def test_gather_problem_read_from_this_versions_ddp_config():
    problem = mcore_version.gather_problem()
    if not OPTIMIZER_OWNED:
        assert problem is None
        return
    version = mcore_version.installed_version()
    assert version.startswith(("0.7.", "0.8.")), version
    assert f"megatron-core {version}" in problem and "overlap_param_gather" in problem
    assert "megatron-core >= 0.9.0" in problem and "policy=off" in problem


def test_align_fp8_transposes_refuses_an_optimizer_owned_gather():
    from nemo_fp8_align.integrations.megatron_core import _refuse_optimizer_owned_gather

    if not OPTIMIZER_OWNED:
        _refuse_optimizer_owned_gather()  # nothing to refuse
        return
    with pytest.raises(UnsupportedSetupError, match="megatron-core >= 0.9.0"):
        _refuse_optimizer_owned_gather()


@pytest.mark.skipif(not OPTIMIZER_OWNED, reason="megatron-core >= 0.9: the demo runs "
                    "(test_engine_mcore, test_faults)")
def test_demo_refuses_before_any_rank_starts():
    proc = _demo("--pp", "2", "--vp", "2", "--dp", "2", "--microbatches", "4", "--steps", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"megatron-core {mcore_version.installed_version()}" in proc.stderr
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr


@pytest.mark.skipif(has_group_size(), reason="megatron-core >= 0.10 has N: its own rules "
                    "(test_demo_cli's bad-input rows)")
@pytest.mark.parametrize("flags,want", [
    (("--microbatches", "5"), "--microbatches 5: 5 microbatches with PP 2: megatron-core {v} "
                              "(before 0.10) needs the number of microbatches to be a multiple "
                              "of the pipeline size with interleaving; use 6"),
    (("--microbatches", "6", "--group-size", "3"), "--group-size 3: megatron-core {v} (before "
                                                   "0.10) has no microbatch_group_size_per_vp"),
])
def test_demo_spells_the_pre_010_rules_for_this_version(flags, want):
    proc = _demo("--pp", "2", "--vp", "2", *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert want.format(v=mcore_version.installed_version()) in proc.stderr


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
