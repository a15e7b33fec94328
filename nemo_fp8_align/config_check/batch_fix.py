"""What a microbatch fix changes when no parallel layout fits: first the micro batch, then the
global batch (the nearest that fits), never the model.

A smaller ``micro_batch_size`` keeps the global batch, so the training recipe (samples per
optimizer step) stays what the user chose; it only splits the step into more, smaller
microbatches. A larger one is not offered: it needs more activation memory, which the check
cannot judge. Only where no smaller micro batch fits does the global batch change, to the count
of microbatches nearest the one given (either way: 2001 samples become 2000, not 2016), and the
message names both values. Pure arithmetic over the microbatch rule's verdict
(:func:`~.rules.batch.schedule_fits`); only the command line's fix search (:mod:`.fix_search`)
runs it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Tuple, Union

from nemo_fp8_align.config_check.rules.batch import schedule_fits

__all__ = ["micro_batch_fix", "nearest_batch", "nearest_microbatches"]


def _span(pp: int, n: Optional[int]) -> int:
    """How far to look each way: valid counts recur every group of max(N, PP)."""
    return 2 * max(pp, n or pp) + 2


def nearest_microbatches(pp: int, vp: Optional[int], m: Union[Fraction, float],
                         n: Optional[int],
                         legacy: bool = False) -> Optional[int]:
    """The microbatch count nearest ``m`` (the batch's own count, whole or not) that the
    schedule accepts; a tie goes up (no samples dropped). None: none near (an N below PP)."""
    low, high = math.floor(m), max(math.ceil(m), 1)
    down = next((k for k in range(low, max(low - _span(pp, n), 0), -1)
                 if schedule_fits(pp, vp, k, n, legacy)), None)
    up = next((k for k in range(high, high + _span(pp, n))
               if schedule_fits(pp, vp, k, n, legacy)), None)
    found = [k for k in (down, up) if k is not None]
    return min(found, key=lambda k: (abs(k - m), -k)) if found else None


def micro_batch_fix(pp: int, vp: Optional[int], dp: int, mbs: int, gbs: int,
                    n: Optional[int], legacy: bool = False) -> Optional[int]:
    """The largest micro batch below ``mbs`` that divides the global batch over DP into a
    microbatch count the schedule accepts (None: no smaller one does)."""
    for smaller in range(mbs - 1, 0, -1):
        if gbs % (smaller * dp) == 0 and schedule_fits(pp, vp, gbs // (smaller * dp), n, legacy):
            return smaller
    return None


def nearest_batch(pp: int, vp: Optional[int], dp: int, mbs: int, gbs: int,
                  n: Optional[int], legacy: bool = False) -> Tuple[int, int]:
    """(micro batch, global batch) with the global batch nearest ``gbs`` that fits, over
    ``mbs`` and the 8 micro batches below it (a smaller micro batch makes the batch's steps
    finer: 800 instead of 3200 for 256 on DP 400); on a tie the larger micro batch."""
    best: Optional[Tuple[int, int]] = None
    for micro in range(mbs, max(mbs - 9, 0), -1):
        per = micro * dp
        exact = Fraction(gbs, per)  # a float loses the units of a batch above 2**53
        count = (nearest_microbatches(pp, vp, exact, n, legacy) if pp >= 2
                 else max(round(exact), 1))
        if count is None:
            continue
        if best is None or abs(count * per - gbs) < abs(best[1] - gbs):
            best = (micro, count * per)
    return best if best is not None else (mbs, max(round(Fraction(gbs, mbs * dp)), 1) * mbs * dp)
