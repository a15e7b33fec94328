"""The startup check's layer-split rules against megatron-core's own code, and the resolvers.

For every case of a grid (num_layers 1..20, PP 2..4, VP none/2/3, uneven first/last stages,
the account_for_* flags), ``tests/upstream_split_verdicts.py`` asks the installed megatron-core
(0.12.3 in this environment, 0.16.1 in .venv-mcore016 when it exists) whether it accepts the
split: its TransformerConfig and its get_num_layers_to_build for every pipeline rank. The
startup check itself (:func:`find_violations`, every rule, on a generated model config per
case, all 2168 cases: about 25 s of CPU on one core, the layout search for each fix included, computed once for both versions) must
reject every case megatron-core rejects; where it rejects a case megatron-core accepts, the
reason must be NeMo 2.3.3's own checks (written out below from its source) or a first/last
stage holding more layers than the model has.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from omegaconf import OmegaConf

from nemo_fp8_align.config_check.check import find_violations
from nemo_fp8_align.config_check.resolvers import RESOLVERS, upstream_resolvers
from nemo_fp8_align.config_check.rules.parallel import layer_split_error

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "upstream_split_verdicts.py"
PYTHONS = {"0.12.3": Path(sys.executable), "0.16.1": ROOT / ".venv-mcore016" / "bin" / "python"}
Case = Tuple[int, int, Optional[int], Optional[int], Optional[int], bool, bool]


def nemo_rejects(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                 last: Optional[int], emb: bool, loss: bool) -> bool:
    """NeMo 2.3.3's own split checks: MegatronBaseModel asserts (num_layers // PP) % VP == 0
    unless both account_for_* flags are set; build_transformer_config takes the remaining layers
    modulo the middle stage count (ZeroDivisionError when none is left)."""
    if emb and loss:
        return False
    if vp and (layers // pp) % vp:
        return True
    stages = pp - (first is not None) - (last is not None)
    return stages <= 0 or (layers - (first or 0) - (last or 0)) % stages != 0


VP_KEY = "model.virtual_pipeline_model_parallel_size"
#: The keys the layer-split rules blame.
SPLIT_KEYS = {"model.num_layers", VP_KEY, "model.num_layers_in_first_pipeline_stage",
              "model.num_layers_in_last_pipeline_stage",
              "model.account_for_embedding_in_pipeline_split",
              "model.account_for_loss_in_pipeline_split"}


def case_config(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                last: Optional[int], emb: bool, loss: bool) -> Dict[str, Any]:
    """A model node the plugin accepts in every other respect (O2, TE FP8 params, Apex
    distributed Adam with overlapped syncs), with the case's split settings. No ``trainer:``,
    so the world-size and microbatch rules, which do not depend on the split, do not run."""
    model: Dict[str, Any] = {
        "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vp,
        "num_layers": layers, "micro_batch_size": 1, "global_batch_size": 4 * pp,
        "megatron_amp_O2": True, "mcore_gpt": True, "transformer_engine": True, "fp8": True, "fp8_hybrid": True,
        "fp8_params": True, "optim": {"name": "distributed_fused_adam",
                                      "overlap_param_sync": True, "overlap_grad_sync": True}}
    for key, value in (("num_layers_in_first_pipeline_stage", first),
                       ("num_layers_in_last_pipeline_stage", last)):
        if value is not None:
            model[key] = value
    for key, flag in (("account_for_embedding_in_pipeline_split", emb),
                      ("account_for_loss_in_pipeline_split", loss)):
        if flag:
            model[key] = True
    return model


@functools.lru_cache(maxsize=None)
def check_rejects(case: Case) -> bool:
    """Whether the real startup check (:func:`find_violations`, every rule) rejects the case's
    layer split. With VP null the plugin's own VP >= 2 violation is set aside (it is not a
    split decision; the split rules never blame a null VP); any violation left must be on a
    layer-split key, so a generated config that is wrong elsewhere fails the test."""
    vp = case[2]
    violations = [v for v in find_violations(case_config(*case))
                  if not (vp is None and v.key == VP_KEY and v.found == "null")]
    elsewhere = [str(v) for v in violations if v.key not in SPLIT_KEYS]
    assert elsewhere == [], f"case {case}: violations outside the layer split: {elsewhere}"
    return bool(violations)


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_layer_split_rules_agree_with_megatron_core(version: str) -> None:
    python = PYTHONS[version]
    if not python.exists():
        pytest.skip(f"no environment with megatron-core {version} ({python})")
    run = subprocess.run([str(python), str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    verdicts = json.loads(run.stdout)
    assert verdicts["version"] == version
    assert len(verdicts["cases"]) == 2168  # the number docs/configuration.md states
    missed: List[Any] = []
    unexplained: List[Any] = []
    cases = verdicts["cases"]
    for case, accepted, reason in cases:
        layers, pp, vp, first, last, emb, loss = case
        rejects = check_rejects(tuple(case))
        if not accepted and not rejects:
            missed.append((case, reason))
        over_stage = (first or 0) + (last or 0) >= layers and (first or last)
        if accepted and rejects and not (nemo_rejects(*case) or over_stage):
            unexplained.append(case)
    assert sum(not accepted for _, accepted, _ in cases) > len(cases) // 4  # both verdicts
    assert missed == [], f"megatron-core {version} rejects, the check accepts: {missed[:5]}"
    assert unexplained == [], f"the check rejects without a reason: {unexplained[:5]}"


def test_nemo_rejects_every_single_account_flag_with_interleaving() -> None:
    # num_layers + 1 = k * PP * VP  =>  (num_layers // PP) % VP = VP - 1: never 0. The split
    # function the rule runs, over many layer counts; the whole check on a few.
    for pp in (2, 3, 4, 8):
        for vp in (2, 3, 4):
            for layers in range(1, 200):
                assert layer_split_error(layers, pp, vp, None, None, True, False) is not None
                assert layer_split_error(layers, pp, vp, None, None, False, True) is not None
            for layers in (pp * vp - 1, 2 * pp * vp - 1, 2 * pp * vp):
                assert check_rejects((layers, pp, vp, None, None, True, False))
                assert check_rejects((layers, pp, vp, None, None, False, True))


# --- resolvers --------------------------------------------------------------------------------

@pytest.fixture(autouse=False)
def no_upstream_resolvers():
    """Run as in a process that never imported NeMo: earlier tests in the same pytest process
    (the callback and mixin tests) import it, and NeMo registers some of these resolvers at
    import. They are taken out for the test and put back after (OmegaConf has no public getter,
    hence its private registry)."""
    from omegaconf.basecontainer import BaseContainer

    saved = {n: BaseContainer._resolvers.pop(n) for n in RESOLVERS
             if n in BaseContainer._resolvers}
    yield
    for name in RESOLVERS:
        BaseContainer._resolvers.pop(name, None)
    BaseContainer._resolvers.update(saved)


def test_resolvers_are_registered_while_reading_and_removed_after(no_upstream_resolvers) -> None:
    names = [n for n in RESOLVERS if not OmegaConf.has_resolver(n)]
    assert names == list(RESOLVERS)
    with upstream_resolvers() as added:
        assert added == names
        assert OmegaConf.create({"x": "${divide_ceil:7, 2}"}).x == 4
        assert OmegaConf.create({"x": "${divide_floor:7, 2}"}).x == 3
        assert OmegaConf.create({"x": "${multiply:4, 3}"}).x == 12
        assert OmegaConf.create({"x": "${sum:4, -1}"}).x == 3
    assert not any(OmegaConf.has_resolver(n) for n in names)


def test_a_resolver_registered_by_the_user_is_neither_replaced_nor_removed(
        no_upstream_resolvers) -> None:
    def mine(x: Any, y: Any) -> Any:
        return 18  # not 4 * 4: shows whose resolver the check used

    OmegaConf.register_new_resolver("multiply", mine)
    try:
        cfg = OmegaConf.create({"pipeline_model_parallel_size": 4,
                                "virtual_pipeline_model_parallel_size": 2,
                                "num_layers": "${multiply:4, 4}"})
        layers = [v for v in find_violations(cfg) if v.key == "model.num_layers"]
        assert [v.found for v in layers] == ["18"]  # 18 layers do not split over PP 4
        assert OmegaConf.has_resolver("multiply")
        assert cfg.num_layers == 18
    finally:
        OmegaConf.clear_resolver("multiply")
