"""Stand-in for the parameter-bucket state machine of Apex's ``DistributedFusedAdam``.

Apex cannot be installed here, so ``nemo_fp8_align.adapters.apex`` is tested against this
model of the behaviour its code relies on, written from Apex's public source (not copied):

* each bucket has a status: SHARDED (not launched) -> SYNCING (all-gather in flight) -> READY;
* ``_try_start_bucket_param_sync(params)`` launches the SHARDED buckets of ``params`` (with no
  ``params``: the first SHARDED bucket, and only if nothing is SYNCING);
  ``_start_bucket_param_sync`` first finishes every all-gather in flight;
* ``_finish_bucket_param_sync()`` waits for all in-flight all-gathers: SYNCING -> READY;
* ``_param_copy(params)`` copies gathered values into the parameters; on a bucket that is not
  READY it first starts and finishes it (a blocking all-gather); a fully copied bucket is freed;
  like NeMo's FP8 override, every copied parameter's transpose cache is reset;
* the pre-forward "hook": the first attribute access of a parameter whose
  ``_pre_forward_hook_is_enabled`` is set clears the flag and runs ``_param_copy`` on it, then
  tries to launch the next bucket;
* ``step()`` with overlapped param sync leaves every bucket SHARDED with the new values as its
  shard, launches the first bucket and arms every parameter's hook.

Communication is simulated in one process: ``events`` records every all-gather launch
(``"all_gather"``), wait (``"wait"``) and blocking all-gather (``"blocking_all_gather"``).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["FakeFP8Param", "FakeFP8Backend", "StandInDistributedFusedAdam"]

_SPECIAL = {"_pre_forward_hook_is_enabled", "_pre_forward_hook", "__class__", "__dict__",
            "__getattribute__", "__setattr__", "__hash__", "__eq__", "__init__", "__repr__"}


class FakeFP8Param:
    """A parameter with Apex's hooked attribute access and a TE-like transpose cache."""

    def __init__(self, shape: Tuple[int, int], name: str) -> None:
        self._pre_forward_hook_is_enabled = False
        self._pre_forward_hook = None
        self.name = name
        self.data = torch.zeros(shape)
        self.transpose_cache: Optional[torch.Tensor] = None
        self.cache_resets = 0

    def __getattribute__(self, name: str) -> Any:
        if name not in _SPECIAL and object.__getattribute__(self, "_pre_forward_hook_is_enabled"):
            object.__setattr__(self, "_pre_forward_hook_is_enabled", False)
            object.__getattribute__(self, "_pre_forward_hook")()
        return object.__getattribute__(self, name)

    def _reset_caches(self) -> None:
        # Reached through the hooked __getattribute__, as NeMo's param._reset_caches() is: an
        # armed hook fires here (a nested second copy).
        self.transpose_cache = None
        self.cache_resets += 1

    def __repr__(self) -> str:
        return f"FakeFP8Param({object.__getattribute__(self, 'name')})"


class FakeFP8Backend:
    """FP8TransposeBackend for :class:`FakeFP8Param`. Like a batched transpose kernel handed the
    FP8 data buffers, it reads them directly: it never fires an armed Apex hook itself."""

    name = "fake-te"

    def transpose_needed(self):
        return True, "stand-in FP8 weights keep a transpose"

    def has_valid_transpose(self, p: FakeFP8Param) -> bool:
        return object.__getattribute__(p, "transpose_cache") is not None

    def build_transposes(self, weights: Iterable[FakeFP8Param]) -> int:
        built = 0
        for p in weights:
            if not self.has_valid_transpose(p):
                data = object.__getattribute__(p, "data")
                object.__setattr__(p, "transpose_cache", data.t().contiguous())
                built += 1
        return built


class ParameterStatus(enum.Enum):
    SHARDED = enum.auto()
    SYNCING = enum.auto()
    READY = enum.auto()


@dataclass
class Fragment:
    bucket_id: int
    param: FakeFP8Param


class ParameterBucket:
    def __init__(self, shard: Dict[int, torch.Tensor]) -> None:
        self.status = ParameterStatus.SHARDED
        self.params_shard: Optional[Dict[int, torch.Tensor]] = shard
        self.params_bucket: Optional[Dict[int, torch.Tensor]] = None
        self.params_updated: set = set()


class StandInDistributedFusedAdam:
    """One bucket per entry of ``buckets`` (lists of parameters), in bucket-id order."""

    ParameterStatus = ParameterStatus

    def __init__(self, buckets: List[List[FakeFP8Param]], *, overlap_param_sync: bool = True):
        self.overlap_param_sync = overlap_param_sync
        self.bucket_params = [list(b) for b in buckets]
        self.state: Dict[Any, Dict[str, Any]] = collections.defaultdict(dict)
        for bucket_id, params in enumerate(self.bucket_params):
            for p in params:
                self.state[p]["fragments"] = [Fragment(bucket_id, p)]
                object.__setattr__(p, "_pre_forward_hook", self._make_hook(p))
        self._params_buckets: "collections.OrderedDict[int, ParameterBucket]" = (
            collections.OrderedDict())
        self.events: List[Tuple[str, Tuple[int, ...]]] = []

    # -- what step() leaves behind
    def step(self, new_values: Dict[int, torch.Tensor], *, launch_first: bool = True) -> None:
        """New values keyed by ``id(param)``; buckets SHARDED, first launched, hooks armed."""
        self._params_buckets.clear()
        for bucket_id, params in enumerate(self.bucket_params):
            self._params_buckets[bucket_id] = ParameterBucket(
                {id(p): new_values[id(p)] for p in params})
        if self.overlap_param_sync:
            if launch_first:
                self._try_start_bucket_param_sync()
            for params in self.bucket_params:
                for p in params:
                    object.__setattr__(p, "_pre_forward_hook_is_enabled", True)
        else:
            for params in self.bucket_params:
                self._param_copy(params)

    # -- Apex's bucket API, as the adapter uses it
    def _try_start_bucket_param_sync(self, params: Optional[Iterable[Any]] = None) -> None:
        if params is None:
            if any(b.status == ParameterStatus.SYNCING for b in self._params_buckets.values()):
                return
            first = [i for i, b in self._params_buckets.items()
                     if b.status == ParameterStatus.SHARDED][:1]
            ids = set(first)
        else:
            ids = {f.bucket_id for p in params for f in self.state[p]["fragments"]}
        buckets = [i for i in sorted(ids) if i in self._params_buckets
                   and self._params_buckets[i].status == ParameterStatus.SHARDED]
        if buckets:
            self._start_bucket_param_sync(buckets)

    def _start_bucket_param_sync(self, bucket_ids: List[int]) -> None:
        self._finish_bucket_param_sync()
        for i in bucket_ids:
            self._params_buckets[i].status = ParameterStatus.SYNCING
        self.events.append(("all_gather", tuple(bucket_ids)))

    def _finish_bucket_param_sync(self) -> None:
        done = []
        for i, bucket in self._params_buckets.items():
            if bucket.status == ParameterStatus.SYNCING:
                bucket.params_bucket, bucket.params_shard = bucket.params_shard, None
                bucket.status = ParameterStatus.READY
                done.append(i)
        if done:
            self.events.append(("wait", tuple(done)))

    def _param_copy(self, params: Any) -> None:
        params = [params] if isinstance(params, FakeFP8Param) else list(params)
        fragments = [f for p in params for f in self.state[p].get("fragments", ())
                     if f.bucket_id in self._params_buckets]
        if not fragments:
            return
        ids = sorted({f.bucket_id for f in fragments})
        if any(self._params_buckets[i].status != ParameterStatus.READY for i in ids):
            self.events.append(("blocking_all_gather", tuple(ids)))
            self._start_bucket_param_sync(
                [i for i in ids if self._params_buckets[i].status == ParameterStatus.SHARDED])
            self._finish_bucket_param_sync()
        for f in fragments:
            bucket = self._params_buckets[f.bucket_id]
            object.__getattribute__(f.param, "data").copy_(bucket.params_bucket[id(f.param)])
            object.__getattribute__(f.param, "_reset_caches")()
            bucket.params_updated.add(id(f.param))
            if len(bucket.params_updated) == len(self.bucket_params[f.bucket_id]):
                del self._params_buckets[f.bucket_id]

    def _make_hook(self, param: FakeFP8Param):
        def pre_forward_hook() -> None:
            self._param_copy(param)
            if self.overlap_param_sync:
                self._try_start_bucket_param_sync()
        return pre_forward_hook


class FakeTEFloat8Param(FakeFP8Param):
    """A :class:`FakeFP8Param` with Transformer Engine 2.x's ``Float8Tensor`` attribute names
    (``_data``, ``_transpose``, ``_transpose_invalid``, ``_create_transpose``), so that the real
    :class:`~nemo_fp8_align.backends.te.TEBackend` (given a fake TE API) can build its
    transposes. ``_data`` is the same tensor the optimizer copies into."""

    def __init__(self, shape: Tuple[int, int], name: str) -> None:
        super().__init__(shape, name)
        object.__setattr__(self, "_data", object.__getattribute__(self, "data"))
        object.__setattr__(self, "_transpose", None)
        object.__setattr__(self, "_transpose_invalid", True)

    def _create_transpose(self) -> None:
        self._transpose = self._data.t().contiguous()  # attribute reads: an armed hook fires
        self._transpose_invalid = False

    def _reset_caches(self) -> None:
        self._transpose_invalid = True
        super()._reset_caches()
