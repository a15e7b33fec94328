"""How megatron-core (0.12.3 and 0.16.1) and NeMo 2.3.3 split the layers over the pipeline, as
pure functions: shared by the layer-split rules and the layout search that proposes their fixes.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["divisors", "layer_split_error"]

_FIRST, _LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"


def layer_split_error(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                      last: Optional[int], emb: bool, loss: bool, nemo: bool = True
                      ) -> Optional[Tuple[str, str]]:
    """(key to blame, why) for the first split rule that fails, or None when NeMo 2.3.3 and
    megatron-core accept the split (``nemo=False``: megatron-core alone, as under Megatron-LM).
    First/last counts not divisible by VP are left to the caller."""
    chunks = vp or 1
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = layers - (first or 0) - (last or 0)
        if middle_stages <= 0:
            return _LAST, (f"null: with pipeline_model_parallel_size (PP) = {pp} and "
                           f"{_FIRST} / {_LAST} both set no middle pipeline stage is left, and NeMo "
                           "2.3.3 divides the remaining layers by the middle stage count "
                           "(ZeroDivisionError)")
        if middle <= 0 or middle % (middle_stages * chunks):
            return "num_layers", (
                f"num_layers - {_FIRST} - {_LAST} = {layers} - {first or 0} - {last or 0} = "
                f"{middle} > 0 and a multiple of the middle stages (PP {pp} - "
                f"{pp - middle_stages}) = {middle_stages}"
                + (f" * virtual_pipeline_model_parallel_size (VP) {vp}" if vp else "")
                + " (megatron-core and NeMo: every middle stage, and every chunk on it, holds "
                "the same number)")
    else:
        total = layers + emb + loss
        counted = " + 1 (embedding)" * emb + " + 1 (loss)" * loss
        if total % pp:
            return "num_layers", (f"num_layers{counted} = {total} divisible by "
                                  f"pipeline_model_parallel_size (PP) = {pp} (megatron-core "
                                  "asserts it)")
        if vp and (total // pp) % vp:
            return "vp", (f"a divisor of the layers per pipeline rank, num_layers{counted} "
                          f"// pipeline_model_parallel_size (PP) = {total} // {pp} = "
                          f"{total // pp} (megatron-core and NeMo: every model chunk holds the "
                          "same number of layers)")
    if nemo and vp and not (emb and loss) and (layers // pp) % vp:
        return "vp", (f"a divisor of num_layers // pipeline_model_parallel_size (PP) = "
                      f"{layers} // {pp} = {layers // pp}: NeMo "
                      "2.3.3 asserts it ('the number of model chunks is the same across all "
                      "pipeline stages') unless both account_for_* flags are set")
    return None


def divisors(n: int) -> List[int]:
    small = [d for d in range(1, min(int(n ** 0.5), 10_000) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
