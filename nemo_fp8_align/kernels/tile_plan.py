"""Host-side tables of the multi-tensor transpose: which tile of which tensor each program runs.

Built once per distinct list of (shape, mode) and cached on the device (LRU), so a training loop
that transposes the same weight set every step copies nothing host-to-device after step one.
Pure torch: importable without Triton.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Tuple

import torch

__all__ = ["MODE_ALIGNED", "MODE_BYTES", "addr_cache", "clear_cache", "lru_get", "lru_put", "plan"]


MODE_BYTES = 0  # any shape / alignment / row stride
MODE_ALIGNED = 1  # M, N multiples of 16, dense, both buffers 16-byte aligned
_CACHE_MAX = 64
_lock = threading.Lock()
_plan_cache: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor, int]]" = OrderedDict()
addr_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def clear_cache() -> None:
    """Drop the cached tile tables and address tensors (tests; freeing device memory)."""
    with _lock:
        _plan_cache.clear()
        addr_cache.clear()


def lru_get(cache: OrderedDict, key):
    with _lock:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
        return hit


def lru_put(cache: OrderedDict, key, value) -> None:
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_MAX:
            cache.popitem(last=False)


def plan(shapes_modes: Tuple[Tuple[int, int, int], ...], block_m: int, block_n: int,
          device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(tile table int32 [tiles, 2], meta int64 [tensors, 4], number of tiles) for one shape list."""
    key = (shapes_modes, block_m, block_n, device)
    hit = lru_get(_plan_cache, key)
    if hit is not None:
        return hit
    meta: List[List[int]] = []
    tile_tensor: List[torch.Tensor] = []
    tile_local: List[torch.Tensor] = []
    for t, (m, n, mode) in enumerate(shapes_modes):
        tiles_m = -(-m // block_m)
        tiles_n = -(-n // block_n)
        count = tiles_m * tiles_n
        meta.append([m, n, tiles_n, mode, m // 16, n // 16])
        if count == 0:
            continue
        tile_tensor.append(torch.full((count,), t, dtype=torch.int32))
        tile_local.append(torch.arange(count, dtype=torch.int32))
    if tile_tensor:
        table = torch.stack([torch.cat(tile_tensor), torch.cat(tile_local)], dim=1).contiguous()
    else:
        table = torch.zeros((0, 2), dtype=torch.int32)
    n_tiles = int(table.shape[0])
    if n_tiles >= 2**31:
        raise ValueError(f"multi_transpose: {n_tiles} tiles exceed one launch's grid")
    value = (table.to(device), torch.tensor(meta, dtype=torch.int64).to(device), n_tiles)
    lru_put(_plan_cache, key, value)
    return value
