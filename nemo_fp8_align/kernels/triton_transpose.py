"""Triton multi-tensor transpose of 2-D 1-byte (FP8 / uint8) tensors: one launch per tensor list.

``multi_transpose(sources, outputs)`` writes ``outputs[i] = sources[i].t()`` for every ``i`` with a
single kernel launch, into buffers the caller owns (e.g. ``Float8Tensor._transpose``). It is what
:func:`nemo_fp8_align.kernels.transpose.multi_transpose_` calls on CUDA; call that entry point
rather than this module (it validates the pairs first).

How one launch covers many tensors:

* Every tensor is cut into ``BLOCK_M x BLOCK_N`` tiles of the *source*. A flat tile table maps the
  program id to ``(tensor index, tile index inside the tensor)``; a small per-tensor table holds
  ``(M, N, tiles along N, mode, M/16, N/16)``. Both depend only on the list of shapes (and on
  which tensors are aligned), so they are built on the host once per distinct list and cached.
* Addresses travel as an int64 tensor of offsets from a 16-byte aligned base that is a kernel
  argument (the cached per-tensor table itself). For aligned tensors the offsets and ``M``, ``N``
  are stored in units of 16 bytes and multiplied back in the kernel, which is how the compiler
  learns the alignment and emits 16-byte loads and stores (a pointer loaded from memory, or a
  ``tl.multiple_of`` hint on a value both branches share, gives 1-byte accesses or wrong masks).
  The launch data are cached by the exact buffers, so a training loop that transposes the same
  weight buffers every step performs no host-to-device copy after the first step.
* Aligned tensors (``M`` and ``N`` multiples of 16, dense, 16-byte aligned: all real weight
  shapes) move 32-bit words ("packed" mode): a program loads four source rows ``4i+r`` as words,
  regroups each 4x4 byte block in registers with shifts and masks, and stores whole words of four
  output rows through ``tl.trans``, so only words cross threads. Other tensors (odd shapes, 1xN,
  Nx1, unaligned or row-strided views) take a byte path in the same launch; that branch is
  compiled only into launches that have such a tensor (with it, the packed path lost about 5
  points of bandwidth to registers and shared memory). Either way the result is bit-exact: bytes are
  only moved, never converted.
* Its bandwidth against the device copy ceiling, torch's generic transpose and Transformer
  Engine's own transpose: benchmarks/results/transpose_h200.md (benchmarks/bench_transpose.py).

Import-guarded: :func:`available` is ``False`` when Triton or CUDA is missing, and nothing here
touches Triton until a kernel is needed.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align.kernels.tile_plan import MODE_ALIGNED as _MODE_ALIGNED
from nemo_fp8_align.kernels.tile_plan import MODE_BYTES as _MODE_BYTES
from nemo_fp8_align.kernels.tile_plan import addr_cache as _addr_cache
from nemo_fp8_align.kernels.tile_plan import clear_cache
from nemo_fp8_align.kernels.tile_plan import lru_get as _lru_get
from nemo_fp8_align.kernels.tile_plan import lru_put as _lru_put
from nemo_fp8_align.kernels.tile_plan import plan as _plan

__all__ = [
    "available",
    "unavailable_reason",
    "multi_transpose",
    "transpose_one",
    "KernelConfig",
    "DEFAULT_CONFIG",
    "clear_cache",
]

try:  # Triton is optional: CPU machines and CI have none.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as _exc:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORT_ERROR = _exc


def unavailable_reason() -> Optional[str]:
    """``None`` when the kernel can run here, else why not (for logs and test skips)."""
    if triton is None:
        return f"triton is not importable ({_TRITON_IMPORT_ERROR!r})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def available() -> bool:
    """Whether :func:`multi_transpose` can run (Triton importable and a CUDA device present)."""
    return unavailable_reason() is None


class KernelConfig(Tuple[int, int, int, int, int, int]):
    """``(block_m, block_n, num_warps, packed, split, persistent)``.

    ``block_m x block_n`` is the tile of the source one program owns; ``num_warps`` the warps per
    program; ``packed`` how aligned tensors (M, N multiples of 16, 16-byte aligned) are moved:
    ``0`` bytes, ``1`` (or ``True``) 32-bit words with one layout change per output word column,
    ``2`` 32-bit words with a single layout change per tile; ``split`` cuts the tile into that
    many row slices processed one after another (less register pressure for big tiles);
    ``persistent`` > 0 launches that many programs per multiprocessor, each looping over tiles
    (0: one program per tile). Unaligned tensors always take the byte path.
    """

    def __new__(cls, block_m: int = 64, block_n: int = 64, num_warps: int = 4, packed: int = 1,
                split: int = 1, persistent: int = 0):
        for v, name in ((block_m, "block_m"), (block_n, "block_n"), (split, "split")):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two")
        if block_m < 16 or block_n < 16:
            raise ValueError(f"block {block_m}x{block_n}: must be a power of two >= 16 each way")
        if block_m // split < 16:
            raise ValueError(f"split={split}: block_m/split must stay >= 16")
        if int(packed) not in (0, 1, 2):
            raise ValueError(f"packed={packed!r}: must be 0, 1 or 2")
        if persistent < 0:
            raise ValueError(f"persistent={persistent}: must be >= 0")
        return super().__new__(cls, (int(block_m), int(block_n), int(num_warps), int(packed),
                                     int(split), int(persistent)))

    block_m = property(lambda self: self[0])
    block_n = property(lambda self: self[1])
    num_warps = property(lambda self: self[2])
    packed = property(lambda self: self[3])
    split = property(lambda self: self[4])
    persistent = property(lambda self: self[5])


#: The fastest tile configuration of benchmarks/bench_transpose.py's sweep on Hopper
#: (benchmarks/results/transpose_h200.md).
DEFAULT_CONFIG = KernelConfig(256, 128, 8, 1, 1, 0)

# ---------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _bytes_tile(src, dst, m, n, s_row, tm, tn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Byte path: any shape, any alignment; source rows may be strided (s_row), columns dense.
        rm = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        x = tl.load(src + rm[:, None] * s_row + rn[None, :],
                    mask=(rm[:, None] < m) & (rn[None, :] < n))
        tl.store(dst + rn[:, None] * m + rm[None, :], tl.trans(x),
                 mask=(rn[:, None] < n) & (rm[None, :] < m))

    @triton.jit
    def _packed_tile(src, dst, m, n, tm, tn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     JOINED: tl.constexpr):
        # Packed path (m % 16 == n % 16 == 0, 16-byte aligned, source dense): 32-bit words.
        # w_r[i, w] = source word (row 4i+r, bytes 4w..4w+3). Output row 4w+c, word i holds the
        # source bytes (4i..4i+3, column 4w+c): its byte r is byte c of w_r[i, w]. Each thread
        # regroups its own 4x4 byte blocks in registers; only whole words cross threads.
        BM4: tl.constexpr = BLOCK_M // 4
        BN4: tl.constexpr = BLOCK_N // 4
        m4 = m // 4
        n4 = n // 4
        src32 = src.to(tl.pointer_type(tl.uint32), bitcast=True)
        dst32 = dst.to(tl.pointer_type(tl.uint32), bitcast=True)
        i = (tm * BM4 + tl.arange(0, BM4)).to(tl.int64)
        w = (tn * BN4 + tl.arange(0, BN4)).to(tl.int64)
        ld_mask = (i[:, None] < m4) & (w[None, :] < n4)
        row0 = src32 + (4 * i[:, None]) * n4 + w[None, :]
        w0 = tl.load(row0, mask=ld_mask, other=0)
        w1 = tl.load(row0 + n4, mask=ld_mask, other=0)
        w2 = tl.load(row0 + 2 * n4, mask=ld_mask, other=0)
        w3 = tl.load(row0 + 3 * n4, mask=ld_mask, other=0)
        st_mask = (w[:, None] < n4) & (i[None, :] < m4)
        out0 = dst32 + (4 * w[:, None]) * m4 + i[None, :]
        lo = 0xFF
        o0 = (w0 & lo) | ((w1 & lo) << 8) | ((w2 & lo) << 16) | (w3 << 24)
        o1 = ((w0 >> 8) & lo) | (w1 & 0xFF00) | ((w2 & 0xFF00) << 8) | ((w3 >> 8) << 24)
        o2 = ((w0 >> 16) & lo) | ((w1 >> 8) & 0xFF00) | (w2 & 0xFF0000) | ((w3 >> 16) << 24)
        o3 = (w0 >> 24) | ((w1 >> 16) & 0xFF00) | ((w2 >> 8) & 0xFF0000) | (w3 & 0xFF000000)
        if JOINED:
            # One layout change for the whole tile: o[i, 4w + c] = o_c[i, w].
            o = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [i, w, c_lo, c_hi]
            o = tl.reshape(tl.permute(o, (0, 1, 3, 2)), (BM4, BLOCK_N))
            on = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            tl.store(dst32 + on[:, None] * m4 + i[None, :], tl.trans(o),
                     mask=(on[:, None] < n) & (i[None, :] < m4))
        else:
            tl.store(out0, tl.trans(o0), mask=st_mask)
            tl.store(out0 + m4, tl.trans(o1), mask=st_mask)
            tl.store(out0 + 2 * m4, tl.trans(o2), mask=st_mask)
            tl.store(out0 + 3 * m4, tl.trans(o3), mask=st_mask)

    @triton.jit
    def _aligned_tile(meta_ptr, base_ptr, t, src_off, dst_off, tm, tn, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, PACKED: tl.constexpr, SPLIT: tl.constexpr):
        # Multiplying by 16 is what carries the alignment facts (a hint on a shared value would
        # leak into the byte branch).
        m = tl.load(meta_ptr + 6 * t + 4) * 16
        n = tl.load(meta_ptr + 6 * t + 5) * 16
        src = base_ptr + src_off * 16
        dst = base_ptr + dst_off * 16
        SUB_M: tl.constexpr = BLOCK_M // SPLIT
        for a in tl.static_range(SPLIT):
            if PACKED > 0:
                _packed_tile(src, dst, m, n, tm * SPLIT + a, tn, SUB_M, BLOCK_N, PACKED == 2)
            else:
                _bytes_tile(src, dst, m, n, n, tm * SPLIT + a, tn, SUB_M, BLOCK_N)

    @triton.jit
    def _one_tile(p, table_ptr, meta_ptr, addr_ptr, base_ptr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PACKED: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_BYTES: tl.constexpr):
        t = tl.load(table_ptr + 2 * p)
        tile = tl.load(table_ptr + 2 * p + 1)
        tiles_n = tl.load(meta_ptr + 6 * t + 2)
        tm = tile // tiles_n
        tn = tile % tiles_n
        src_off = tl.load(addr_ptr + 3 * t)
        dst_off = tl.load(addr_ptr + 3 * t + 1)
        if HAS_BYTES:
            mode = tl.load(meta_ptr + 6 * t + 3)
            if mode == 1:
                _aligned_tile(meta_ptr, base_ptr, t, src_off, dst_off, tm, tn,
                              BLOCK_M, BLOCK_N, PACKED, SPLIT)
            else:
                m = tl.load(meta_ptr + 6 * t)
                n = tl.load(meta_ptr + 6 * t + 1)
                s_row = tl.load(addr_ptr + 3 * t + 2)
                _bytes_tile(base_ptr + src_off, base_ptr + dst_off, m, n, s_row, tm, tn,
                            BLOCK_M, BLOCK_N)
        else:  # every tensor of this launch is aligned: the byte branch is not even compiled
            _aligned_tile(meta_ptr, base_ptr, t, src_off, dst_off, tm, tn,
                          BLOCK_M, BLOCK_N, PACKED, SPLIT)

    @triton.jit
    def _multi_transpose_kernel(table_ptr, meta_ptr, addr_ptr, base_ptr, n_tiles,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
                                SPLIT: tl.constexpr, HAS_BYTES: tl.constexpr, PERSISTENT: tl.constexpr):
        # table[p] = (tensor t, tile inside t); meta[t] = (m, n, tiles_n, mode, m/16, n/16);
        # addr[t] = (source offset, output offset, source row stride) relative to base_ptr, a
        # 16-byte aligned kernel argument: in units of 16 bytes for aligned tensors (mode 1), so
        # that the compiler can prove 16-byte alignment and vectorise, else in bytes.
        if PERSISTENT:
            for p in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _one_tile(p, table_ptr, meta_ptr, addr_ptr, base_ptr,
                          BLOCK_M, BLOCK_N, PACKED, SPLIT, HAS_BYTES)
        else:
            _one_tile(tl.program_id(0), table_ptr, meta_ptr, addr_ptr, base_ptr,
                      BLOCK_M, BLOCK_N, PACKED, SPLIT, HAS_BYTES)


def _aligned(src: torch.Tensor, out: torch.Tensor) -> bool:
    m, n = src.shape
    return (
        m % 16 == 0
        and n % 16 == 0
        and src.stride(1) == 1
        and src.stride(0) == n
        and src.data_ptr() % 16 == 0
        and out.data_ptr() % 16 == 0
    )


def _prepare(sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], cfg: KernelConfig):
    """Everything a launch needs: (table, meta, addresses, base, tiles, device, keep-alive)."""
    device = sources[0].device
    srcs: List[torch.Tensor] = []
    copied = False
    for s in sources:
        if s.device != device:
            raise ValueError(f"multi_transpose: tensors on {s.device} and {device} in one call")
        if s.stride(1) != 1 and s.shape[1] > 1:
            s = s.contiguous()  # the byte path reads strided rows but needs dense columns
            copied = True
        srcs.append(s)
    modes = tuple(
        (int(s.shape[0]), int(s.shape[1]), _MODE_ALIGNED if _aligned(s, o) else _MODE_BYTES)
        for s, o in zip(srcs, outputs)
    )
    table, meta, n_tiles = _plan(modes, cfg.block_m, cfg.block_n, device)
    base = meta.view(torch.uint8)  # a fresh allocation: 16-byte aligned, same address space
    b = base.data_ptr()
    addr: List[int] = []
    for s, o, (_, _, mode) in zip(srcs, outputs, modes):
        so, oo = s.data_ptr() - b, o.data_ptr() - b
        if mode == _MODE_ALIGNED:
            so, oo = so // 16, oo // 16  # exact: both addresses are 16-byte aligned
        addr += [so, oo, int(s.stride(0))]
    addr_t = torch.tensor(addr, dtype=torch.int64).to(device)
    has_bytes = any(mode == _MODE_BYTES for _, _, mode in modes)
    return (table, meta, addr_t, base, n_tiles, device, srcs if copied else None, has_bytes)


def _launch_key(sources, outputs, cfg):
    return (cfg,
            tuple((s.data_ptr(), s.shape[0], s.shape[1], s.stride(0), s.stride(1), s.device)
                  for s in sources),
            tuple(o.data_ptr() for o in outputs))


def multi_transpose(sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                    config: Optional[KernelConfig] = None) -> None:
    """``outputs[i].copy_(sources[i].t())`` for all ``i`` in one kernel launch.

    Expects pairs already checked by
    :func:`nemo_fp8_align.kernels.transpose.check_transpose_pairs` (2-D, 1-byte, same device,
    contiguous outputs of the transposed shape). Raises ``RuntimeError`` when unavailable.
    Launch data are cached by the exact buffers (addresses, shapes, strides), so repeating a
    call on the same weights costs one kernel launch and no host-to-device copy.
    """
    if triton is None or not torch.cuda.is_available():
        raise RuntimeError(f"Triton multi-tensor transpose unavailable: {unavailable_reason()}")
    if not sources:
        return
    cfg = config or DEFAULT_CONFIG
    key = _launch_key(sources, outputs, cfg)
    prep = _lru_get(_addr_cache, key)
    if prep is None:
        prep = _prepare(sources, outputs, cfg)
        if prep[6] is None:  # launches that needed a temporary contiguous copy are not cached
            _lru_put(_addr_cache, key, prep)
    table, meta, addr_t, base, n_tiles, device, _keep, has_bytes = prep
    if n_tiles == 0:
        return
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        ctx = torch.cuda.device(device)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        _run(table, meta, addr_t, base, n_tiles, has_bytes, cfg, _sm_count(device))


_SM_COUNT = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _run(table, meta, addr_t, base, n_tiles, has_bytes, cfg: "KernelConfig", sms: int) -> None:
    grid = n_tiles if cfg.persistent == 0 else min(n_tiles, cfg.persistent * sms)
    _multi_transpose_kernel[(grid,)](
        table, meta, addr_t, base, n_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PACKED=cfg.packed, SPLIT=cfg.split,
        HAS_BYTES=has_bytes, PERSISTENT=cfg.persistent > 0, num_warps=cfg.num_warps)


def transpose_one(source: torch.Tensor, output: torch.Tensor, config: Optional[KernelConfig] = None) -> None:
    """The same kernel for a single tensor (one launch per tensor): the benchmark's per-tensor row."""
    multi_transpose([source], [output], config)
