"""OptimizerConfig(overlap_param_gather_with_optimizer_step=True) on megatron-core's real
optimizer, DDP and interleaved schedule (gloo): chunk 0's all-gather is dispatched by the
optimizer step (get_megatron_optimizer marks chunk 0's DDP instance), and after a step the
optimizer skips for inf gradients nothing dispatched it."""

import pytest

pytest.importorskip("megatron.core")

from support.demo_runs import demo  # noqa: E402

from lab.demo.launch import alignment_problems, differences  # noqa: E402

pytestmark = pytest.mark.slow


def test_aligned_exactly_once_at_slot_0_and_bit_identical_with_a_skipped_step():
    """Three steps, step 1 skipped for inf gradients: step 0 (before any optimizer step) and
    step 2 (after the skipped one) find chunk 0 undispatched, as megatron-core does at first
    use; chunk 0's transposes stay at slot 0 on every rank, every chunk is built once per step,
    and losses, gradients and parameters equal the plugin-off run's."""
    aligned = demo(2, 2, 2, 4, "aligned", steps=3, gather_with_optimizer=True, skip_step_at=1)
    off = demo(2, 2, 2, 4, "off", steps=3, gather_with_optimizer=True, skip_step_at=1)
    for rank in aligned.ranks + off.ranks:
        assert rank["gather_by_optimizer"] == [True, False]  # set by get_megatron_optimizer
        assert rank["skipped_steps"] == [1]
        assert all(b == 1 for step in rank["builds_per_step"] for b in step)
    assert alignment_problems(aligned) == []
    assert differences(aligned, off) == []
    chunk0 = [r for r in aligned.records if r["chunk"] == 0]
    assert len(chunk0) == 3 * 4 and {r["slot"] for r in chunk0} == {0}
    assert all(r["after_all_gather"] for r in aligned.records)


def test_cli_demo_runs_the_mode():
    from support.demo_runs import demo_cli

    proc = demo_cli("--dp", "2", "--microbatches", "2", "--steps", "2",
                    "--overlap-param-gather-with-optimizer-step")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK:" in proc.stdout and "aligned slot 0; built at slots r0:0 r1:0" in proc.stdout
