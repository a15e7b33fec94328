"""The callback in Lightning 2.4's checkpoints: an inert one adds nothing, and checkpoints move
between runs with and without the plugin. Real Trainers (CPU, a BoringModel, 2 steps)."""

import warnings

import pytest

pytest.importorskip("lightning")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from nemo_fp8_align.integrations.nemo.callback import (  # noqa: E402
    FP8TransposeAlignment, callbacks_factory)

MISSING = "callbacks used to create the checkpoint need to be provided"


def trainer(plugin, steps, tmp_path, counted=(0, 0)):
    """A Trainer with the entry-point callback (``plugin``; Lightning adds it from the installed
    entry point, or we do) or without it; ``counted``: the steps and transposes it holds."""
    t = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path))
    rest = [cb for cb in t.callbacks if not isinstance(cb, FP8TransposeAlignment)]
    mine = [cb for cb in t.callbacks if isinstance(cb, FP8TransposeAlignment)] or callbacks_factory()
    t.callbacks = rest + (mine if plugin else [])
    if plugin:
        mine[0].steps, mine[0].transposes = counted
    return t, (mine[0] if plugin else None)


def fit_and_save(plugin, tmp_path, counted=(0, 0)):
    import torch

    t, cb = trainer(plugin, 2, tmp_path, counted)
    t.fit(BoringModel())
    path = tmp_path / "a.ckpt"
    t.save_checkpoint(str(path))
    return path, torch.load(str(path), weights_only=False), cb


def resume(plugin, path, tmp_path):
    t, cb = trainer(plugin, 3, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(BoringModel(), ckpt_path=str(path))
    assert t.global_step == 3  # resumed from step 2 and trained one more
    return [str(w.message) for w in caught], cb


def test_an_inert_entry_point_callback_adds_nothing_and_its_checkpoint_loads_without_it(tmp_path):
    path, ckpt, cb = fit_and_save(True, tmp_path)  # a BoringModel has no NeMo config: inert
    assert cb is not None and cb._session is None  # no session: inert
    assert not any("FP8TransposeAlignment" in key for key in ckpt.get("callbacks", {}))
    warned, _ = resume(False, path, tmp_path)
    assert not any(MISSING in w for w in warned)


def test_a_checkpoint_with_plugin_state_loads_where_the_plugin_is_absent_and_back(tmp_path):
    path, ckpt, cb = fit_and_save(True, tmp_path, counted=(3, 12))  # a callback that aligned
    assert ckpt["callbacks"][cb.state_key] == {"steps": 3, "transposes": 12}
    warned, _ = resume(False, path, tmp_path)  # absent: loads; Lightning names the callback
    assert any(MISSING in w and "FP8TransposeAlignment" in w for w in warned)
    _, again = resume(True, path, tmp_path)
    assert (again.steps, again.transposes) == (3, 12)  # present: its state restored


def test_a_checkpoint_without_plugin_state_loads_where_the_plugin_is(tmp_path):
    path, _, _ = fit_and_save(False, tmp_path)
    warned, fresh = resume(True, path, tmp_path)
    assert not any(MISSING in w for w in warned)
    assert (fresh.steps, fresh.transposes) == (0, 0)
