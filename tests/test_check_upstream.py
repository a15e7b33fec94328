"""The startup check's layer-split rules against megatron-core's own code, and the resolvers.

For every case of a grid (num_layers 1..20, PP 2..4, VP none/2/3, uneven first/last stages,
the account_for_* flags), ``tests/upstream_split_verdicts.py`` asks the installed megatron-core
(0.12.3 in this environment, 0.16.1 in .venv-mcore016 when it exists) whether it accepts the
split: its TransformerConfig and its get_num_layers_to_build for every pipeline rank. The check
must reject every case megatron-core rejects; where it rejects a case megatron-core accepts,
the reason must be NeMo 2.3.3's own checks (written out below from its source) or a first/last
stage holding more layers than the model has.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional

import pytest
from omegaconf import OmegaConf

from nemo_fp8_align.nemo.check import find_violations
from nemo_fp8_align.nemo.resolvers import RESOLVERS, upstream_resolvers
from nemo_fp8_align.nemo.rules_parallel import layer_split_error

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "upstream_split_verdicts.py"
PYTHONS = {"0.12.3": Path(sys.executable), "0.16.1": ROOT / ".venv-mcore016" / "bin" / "python"}


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


def check_rejects(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                  last: Optional[int], emb: bool, loss: bool) -> bool:
    """Whether the check's split rules (the layer_split_error function and the two rules on
    the first/last values it leaves to its callers) reject the case."""
    if (first is not None or last is not None) and (emb or loss):
        return True
    if vp and any(x is not None and x % vp for x in (first, last)):
        return True
    return layer_split_error(layers, pp, vp, first, last, emb, loss) is not None


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
    missed: List[Any] = []
    unexplained: List[Any] = []
    for case, accepted, reason in verdicts["cases"]:
        layers, pp, vp, first, last, emb, loss = case
        rejects = check_rejects(*case)
        if not accepted and not rejects:
            missed.append((case, reason))
        over_stage = (first or 0) + (last or 0) >= layers and (first or last)
        if accepted and rejects and not (nemo_rejects(*case) or over_stage):
            unexplained.append(case)
    assert len(verdicts["cases"]) > 2000
    assert missed == [], f"megatron-core {version} rejects, the check accepts: {missed[:5]}"
    assert unexplained == [], f"the check rejects without a reason: {unexplained[:5]}"


def test_nemo_rejects_every_single_account_flag_with_interleaving() -> None:
    # num_layers + 1 = k * PP * VP  =>  (num_layers // PP) % VP = VP - 1: never 0.
    for pp in (2, 3, 4, 8):
        for vp in (2, 3, 4):
            for layers in range(1, 200):
                assert check_rejects(layers, pp, vp, None, None, True, False)
                assert check_rejects(layers, pp, vp, None, None, False, True)


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
