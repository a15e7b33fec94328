"""``plan`` describes real models: sizes from a launcher config (the check's reader), MoE and CP
in the costs, the defaults it used named, the p2p modes modelled and stated, and the Gantt."""

from pathlib import Path

import pytest

from nemo_fp8_align.cli import main
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner.costs import GPUS, MODELS, Layout, chunk_costs
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.simulate import Costs, simulate

LAUNCHER = Path(__file__).parent / "data" / "upstream" / "launcher"


def _plan(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bare_preset_names_its_defaults(capsys):
    code, out, _ = _plan(capsys, "--model", "gpt3-175b")
    assert code == 0
    assert "defaults used (not given): TP8 PP8 VP2 DP1 CP1 EP1 --micro-batch 1" in out
    assert ("p2p: overlap_p2p_comm=True batch_p2p_comm=False (Megatron-LM's default with "
            "interleaving") in out
    code, out, _ = _plan(capsys, "--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--vp", "2",
                         "--dp", "1", "--cp", "1", "--ep", "1", "--micro-batch", "1",
                         "--no-overlap-p2p-comm", "--batch-p2p-comm")
    assert "defaults used" not in out and "Megatron-LM's default" not in out


def test_sizes_from_a_launcher_config(capsys):
    code, out, _ = _plan(capsys, LAUNCHER / "llama_llama2_70b.yaml")
    assert code == 0
    assert out.startswith(f"{LAUNCHER / 'llama_llama2_70b.yaml'}: 80 layers, hidden 8192, seq 4096; "
                          "TP=4 PP=4 VP=5 DP=64 CP=1")
    code, out, _ = _plan(capsys, LAUNCHER / "llama_llama2_70b.yaml",
                         "model.pipeline_model_parallel_size=8", "--vp", "2")
    assert "TP=4 PP=8 VP=2 DP=32" in out  # an override, a flag, and DP re-derived


def test_moe_from_a_launcher_config(capsys):
    code, out, _ = _plan(capsys, LAUNCHER / "mixtral_mixtral_8x7b.yaml")
    assert code == 0 and "MoE 8 experts top-2 EP=8 ETP=1" in out


def test_moe_weights_and_compute():
    dense = MODELS["llama2-70b"]
    from dataclasses import replace

    moe = replace(dense, experts=8, topk=2)
    layout = Layout(tp=8, pp=4, vp=5, dp=8, micro_batch=1, global_batch=64, ep=4, etp=1)
    c_dense, i_dense = chunk_costs(dense, Layout(8, 4, 5, 8, 1, 64), GPUS["h200"])
    c_moe, i_moe = chunk_costs(moe, layout, GPUS["h200"])
    mlp, attn = dense.mlp_weights(), dense.attention_weights()
    assert i_moe["weight_bytes"] == pytest.approx(4 * (attn / 8 + 2 * mlp / 1))  # 2 local experts
    assert c_moe.forward > c_dense.forward  # top-2: two MLPs per token


def test_context_parallel_splits_the_sequence_not_the_weights():
    model = MODELS["llama3-70b"]
    one, info1 = chunk_costs(model, Layout(8, 4, 5, 2, 1, 64), GPUS["h200"])
    two, info2 = chunk_costs(model, Layout(8, 4, 5, 2, 1, 64, cp=2), GPUS["h200"])
    assert info1["weight_bytes"] == info2["weight_bytes"] and two.transpose == one.transpose
    assert two.forward < 0.6 * one.forward and two.p2p == pytest.approx(one.p2p / 2)


def test_overlap_p2p_waits_only_for_receives():
    s = InterleavedSchedule(4, 2, 8)
    costs = Costs(forward=1.0, backward=2.0, p2p=0.5)
    blocking = simulate(s, Placement.NONE, costs)
    overlap = simulate(s, Placement.NONE, costs, overlap_p2p=True)
    assert overlap.step_time <= blocking.step_time
    assert sum(i.end - i.start for i in overlap.of_kind("p2p_wait")) < \
        sum(i.end - i.start for i in blocking.of_kind("p2p_wait"))


def test_lazy_transposes_wait_for_the_receive_under_overlap():
    """megatron-core waits for the receive before the forward step, so a lazy transpose inside
    the forward cannot hide in the receive's wait."""
    s = InterleavedSchedule(4, 2, 8)
    costs = Costs(forward=1.0, backward=2.0, transpose=0.3, p2p=0.5)
    tl = simulate(s, Placement.LAZY, costs, overlap_p2p=True)
    for t in tl.of_kind("transpose", rank=1):
        waits = [w for w in tl.of_kind("p2p_wait", rank=1) if w.start < t.start]
        assert not waits or max(w.end for w in waits) <= t.start + 1e-12


def test_gantt_zoom_saving_and_legend(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    texts, legends = [], []
    real_suptitle, real_legend = matplotlib.figure.Figure.suptitle, matplotlib.figure.Figure.legend
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **k: texts.append(t) or real_suptitle(self, t, **k))
    monkeypatch.setattr(matplotlib.figure.Figure, "legend", lambda self, *a, **k: legends.append(
        [h.get_label() for h in k["handles"]]) or real_legend(self, *a, **k))
    path = tmp_path / "p.png"
    code, out, _ = _plan(capsys, "--model", "gpt3-175b", "--plot", path)
    assert code == 0 and path.stat().st_size > 20000
    assert texts[0].startswith("aligned saves 10.997 ms per step")
    assert "side-stream slowdown" not in legends[0] and "FP8 transposes" in legends[0]
