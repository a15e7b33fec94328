"""Ask the installed megatron-core which pipeline layer splits it accepts; print them as JSON.

Run by tests/test_check_upstream.py with the Python of each environment (megatron-core 0.12.3
in .venv, 0.16.1 in .venv-mcore016): for every case of a grid it builds megatron-core's own
``TransformerConfig`` (whose ``__post_init__`` checks the split options) and calls its own
``get_num_layers_to_build`` for every pipeline rank (which asserts the even split), with the
pipeline sizes answered by stubs of ``parallel_state`` (no process group is needed).
Imports only torch and megatron-core, so it runs in either environment.
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from typing import Any, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.transformer import transformer_block
from megatron.core.transformer.transformer_config import TransformerConfig

Case = Tuple[int, int, Optional[int], Optional[int], Optional[int], bool, bool]


def grid() -> List[Case]:
    """Every split option alone and first/last together; their combination with the
    account_for_* flags (always rejected) on a few cases only."""
    shapes = list(itertools.product(range(1, 21), (2, 3, 4), (None, 2, 3)))
    uneven = [(n, pp, vp, f, l, False, False) for n, pp, vp in shapes
              for f, l in itertools.product((None, 2, 3), (None, 2, 3))]
    account = [(n, pp, vp, None, None, e, l) for n, pp, vp in shapes
               for e, l in ((False, True), (True, False), (True, True))]
    mixed = [(8, 4, vp, f, l, e, lo) for vp in (None, 2) for f, l in ((2, None), (None, 2))
             for e, lo in ((True, False), (False, True))]
    return uneven + account + mixed


def verdict(case: Case) -> Tuple[bool, str]:
    layers, pp, vp, first, last, emb, loss = case
    try:
        config = TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
            pipeline_dtype=torch.float32)
        for rank in range(pp):
            _stub_pipeline(pp, vp, rank)
            try:
                transformer_block.get_num_layers_to_build(config, vp_stage=0, pp_rank=rank)
            except TypeError:  # 0.12.3: (config) only
                transformer_block.get_num_layers_to_build(config)
    except (ValueError, AssertionError, ZeroDivisionError) as err:
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def _stub_pipeline(pp: int, vp: Optional[int], rank: int) -> None:
    stubs: Any = {
        "get_pipeline_model_parallel_world_size": lambda *a, **k: pp,
        "get_pipeline_model_parallel_rank": lambda *a, **k: rank,
        "is_pipeline_first_stage": lambda *a, **k: rank == 0,
        "is_pipeline_last_stage": lambda *a, **k: rank == pp - 1,
        "get_virtual_pipeline_model_parallel_world_size": lambda *a, **k: vp,
        "get_virtual_pipeline_model_parallel_rank": lambda *a, **k: 0,
    }
    for name, stub in stubs.items():
        setattr(parallel_state, name, stub)


def main() -> None:
    warnings.simplefilter("ignore")
    import megatron.core

    out = {"version": getattr(megatron.core, "__version__", "?"),
           "cases": [[list(case), *verdict(case)] for case in grid()]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
