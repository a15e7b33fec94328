"""Tests of the FP8 transpose kernels.

CPU: the torch fallback of ``multi_transpose_`` is byte-exact, validation errors name the
offending pair, and the Triton module reports itself unavailable cleanly.
GPU (``-m gpu``, skipped with the reason without CUDA/Triton): the Triton multi-tensor kernel is
bit-exact against ``w.t()`` for many shapes (tile multiples, odd, tiny 1x1 / 1xN / Nx1, strided
and unaligned views) and for float8_e4m3fn, float8_e5m2 and uint8.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8_align.kernels import multi_transpose_
from nemo_fp8_align.kernels import triton_transpose as tt
from nemo_fp8_align.kernels.transpose import check_transpose_pairs

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]
SHAPES = [
    (1, 1), (1, 7), (7, 1), (1, 4096), (4096, 1), (2, 3), (15, 17), (16, 16), (33, 65),
    (64, 64), (63, 64), (64, 65), (100, 36), (128, 48), (48, 128), (127, 129), (128, 128),
    (130, 200), (256, 80), (513, 1025), (1280, 1024),
]


def _random_bytes(shape, dtype, device="cpu", gen=None):
    u8 = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
    return u8.view(dtype)


def _outputs_for(sources):
    return [torch.empty((s.shape[1], s.shape[0]), dtype=s.dtype, device=s.device) for s in sources]


def _assert_bit_exact(sources, outputs):
    for i, (s, o) in enumerate(zip(sources, outputs)):
        expect = s.view(torch.uint8).t().cpu()
        got = o.view(torch.uint8).cpu()
        assert torch.equal(got, expect), f"pair {i}: shape {tuple(s.shape)} dtype {s.dtype} differs"


# ------------------------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_byte_exact(dtype):
    g = torch.Generator().manual_seed(0)
    sources = [_random_bytes(s, dtype, gen=g) for s in SHAPES]
    outputs = _outputs_for(sources)
    multi_transpose_(sources, outputs)  # CPU: torch fallback even with use_triton=True
    _assert_bit_exact(sources, outputs)


def test_torch_path_strided_source_and_no_triton_flag():
    g = torch.Generator().manual_seed(1)
    base = _random_bytes((40, 80), torch.float8_e4m3fn, gen=g)
    sources = [base[:, 8:40], base[3:, :], base.t()]
    outputs = _outputs_for(sources)
    multi_transpose_(sources, outputs, use_triton=False)
    _assert_bit_exact(sources, outputs)


def test_empty_list_is_a_noop():
    multi_transpose_([], [])


def _err(sources, outputs):
    with pytest.raises(ValueError) as info:
        multi_transpose_(sources, outputs)
    return str(info.value)


def test_validation_names_the_pair():
    ok_s = torch.zeros(4, 8, dtype=torch.uint8)
    ok_o = torch.zeros(8, 4, dtype=torch.uint8)
    assert "2 sources but 1 outputs" in _err([ok_s, ok_s], [ok_o])
    assert "source 1" in _err([ok_s, torch.zeros(2, 2, 2, dtype=torch.uint8)], [ok_o, ok_o])
    msg = _err([ok_s, torch.zeros(4, 8, dtype=torch.bfloat16)], [ok_o, ok_o])
    assert "source 1" in msg and "bfloat16" in msg
    msg = _err([ok_s, ok_s], [ok_o, torch.zeros(8, 4, dtype=torch.float8_e4m3fn)])
    assert "output 1" in msg
    msg = _err([ok_s, ok_s], [ok_o, torch.zeros(4, 8, dtype=torch.uint8)])
    assert "output 1" in msg and "8x4" in msg
    msg = _err([ok_s, ok_s], [ok_o, torch.zeros(4, 8, dtype=torch.uint8).t()])
    assert "output 1" in msg and "contiguous=False" in msg
    check_transpose_pairs([ok_s], [ok_o])  # and a good pair passes


def test_triton_module_reports_unavailable_cleanly():
    if tt.available():
        pytest.skip("Triton and CUDA are both present here")
    reason = tt.unavailable_reason()
    assert reason and ("triton" in reason or "CUDA" in reason)
    with pytest.raises(RuntimeError, match="unavailable"):
        tt.multi_transpose([torch.zeros(2, 2, dtype=torch.uint8)], [torch.zeros(2, 2, dtype=torch.uint8)])


def test_kernel_config_validates():
    assert tt.DEFAULT_CONFIG.block_m >= 16
    cfg = tt.KernelConfig(128, 64, 8, False)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.packed, cfg.split, cfg.persistent) == (
        128, 64, 8, 0, 1, 0)
    assert tt.KernelConfig(64, 64, 4, True).packed == 1
    with pytest.raises(ValueError, match="power of two"):
        tt.KernelConfig(48, 64)
    with pytest.raises(ValueError, match="packed"):
        tt.KernelConfig(64, 64, 4, 3)
    with pytest.raises(ValueError, match="split"):
        tt.KernelConfig(32, 64, 4, 1, 4)
    with pytest.raises(ValueError, match="persistent"):
        tt.KernelConfig(64, 64, 4, 1, 1, -1)


# ------------------------------------------------------------------------------------ GPU path

_GPU_SKIP = None if tt.available() else f"Triton kernel not runnable here: {tt.unavailable_reason()}"
gpu = pytest.mark.gpu
needs_triton_gpu = pytest.mark.skipif(_GPU_SKIP is not None, reason=_GPU_SKIP or "")


@gpu
@needs_triton_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [None, (64, 64, 4, 0), (128, 64, 8, 1), (64, 128, 8, 2),
                                    (32, 16, 4, 1), (256, 256, 8, 2), (16, 32, 1, 2), (256, 256, 8, 1, 4),
                                    (128, 128, 4, 0, 2), (64, 64, 4, 1, 1, 1),
                                    (256, 256, 8, 1, 1, 2)], ids=str)
def test_triton_multi_bit_exact(dtype, config):
    g = torch.Generator().manual_seed(2)
    sources = [_random_bytes(s, dtype, "cuda", g) for s in SHAPES]
    outputs = _outputs_for(sources)
    tt.multi_transpose(sources, outputs, tt.KernelConfig(*config) if config else None)
    torch.cuda.synchronize()
    _assert_bit_exact(sources, outputs)


@gpu
@needs_triton_gpu
def test_triton_through_entry_point_and_cache_reuse():
    g = torch.Generator().manual_seed(3)
    tt.clear_cache()
    for _ in range(3):  # same shapes, new buffers each time: cached plan, fresh addresses
        sources = [_random_bytes(s, torch.float8_e4m3fn, "cuda", g) for s in SHAPES]
        outputs = _outputs_for(sources)
        multi_transpose_(sources, outputs)
        torch.cuda.synchronize()
        _assert_bit_exact(sources, outputs)
    for _ in range(2):  # same buffers, new bytes: cached addresses must still be right
        for s in sources:
            s.view(torch.uint8).random_(0, 256, generator=None)
        multi_transpose_(sources, outputs)
        torch.cuda.synchronize()
        _assert_bit_exact(sources, outputs)


@gpu
@needs_triton_gpu
def test_triton_strided_and_unaligned_views():
    g = torch.Generator().manual_seed(4)
    base = _random_bytes((300, 520), torch.float8_e5m2, "cuda", g)
    flat = _random_bytes((1 + 64 * 48,), torch.uint8, "cuda", g)
    sources = [
        base[:, 8:264],            # strided rows, aligned start
        base[1:, 3:70],            # strided rows, unaligned start
        base.t(),                  # non-contiguous columns: copied to contiguous first
        flat[1:].view(64, 48),     # dense but 1-byte-misaligned
        base[5:6, :],              # 1 x N view
        base[:, 7:8],              # N x 1 view
    ]
    outputs = _outputs_for(sources)
    out_flat = torch.empty(1 + 48 * 64, dtype=torch.uint8, device="cuda")
    outputs[3] = out_flat[1:].view(48, 64)  # misaligned output too
    tt.multi_transpose(sources, outputs)
    torch.cuda.synchronize()
    _assert_bit_exact(sources, outputs)


@gpu
@needs_triton_gpu
@pytest.mark.parametrize("config", [None, (256, 256, 8, 1, 1, 2), (64, 128, 4, 0, 1, 1)], ids=str)
def test_triton_all_aligned_list(config):
    """Only aligned tensors: the kernel is compiled without its byte branch."""
    g = torch.Generator().manual_seed(7)
    shapes = [(1280, 1024), (1024, 3584), (16, 16), (48, 4096), (4096, 32)]
    sources = [_random_bytes(s, torch.float8_e4m3fn, "cuda", g) for s in shapes]
    outputs = _outputs_for(sources)
    tt.multi_transpose(sources, outputs, tt.KernelConfig(*config) if config else None)
    torch.cuda.synchronize()
    _assert_bit_exact(sources, outputs)


@gpu
@needs_triton_gpu
def test_triton_gpt3_shapes_one_launch():
    g = torch.Generator().manual_seed(5)
    shapes = [(4608, 12288), (12288, 1536), (6144, 12288), (12288, 6144)]
    sources = [_random_bytes(s, torch.float8_e4m3fn, "cuda", g) for s in shapes]
    outputs = _outputs_for(sources)
    multi_transpose_(sources, outputs)
    torch.cuda.synchronize()
    for i, (s, o) in enumerate(zip(sources, outputs)):
        assert torch.equal(o.view(torch.uint8), s.view(torch.uint8).t()), f"pair {i}"


@gpu
@needs_triton_gpu
@pytest.mark.parametrize("config", [None, (64, 64, 4, 0), (128, 32, 4, 1), (64, 64, 4, 2),
                                    (256, 256, 8, 1, 2), (128, 128, 4, 1, 1, 3)], ids=str)
def test_triton_writes_nothing_outside_its_outputs(config):
    """Outputs carved from one buffer with canary bytes between them: no stray writes."""
    g = torch.Generator().manual_seed(6)
    guard = 512
    sizes = [m * n for m, n in SHAPES]
    buf = torch.full((guard + sum(sz + guard for sz in sizes),), 0xAB, dtype=torch.uint8, device="cuda")
    sources, outputs, pos = [], [], guard
    for (m, n), sz in zip(SHAPES, sizes):
        sources.append(_random_bytes((m, n), torch.uint8, "cuda", g))
        outputs.append(buf[pos:pos + sz].view(n, m))
        pos += sz + guard
    tt.multi_transpose(sources, outputs, tt.KernelConfig(*config) if config else None)
    torch.cuda.synchronize()
    _assert_bit_exact(sources, outputs)
    mask = torch.ones_like(buf, dtype=torch.bool)
    pos = guard
    for sz in sizes:
        mask[pos:pos + sz] = False
        pos += sz + guard
    stray = (buf[mask] != 0xAB).nonzero().flatten()
    assert stray.numel() == 0, f"{stray.numel()} canary bytes overwritten"


def test_mixed_devices_rejected_before_any_work():
    from nemo_fp8_align.kernels.transpose import check_transpose_pairs

    a = torch.zeros(2, 3, dtype=torch.uint8)
    b = torch.zeros(2, 3, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="source 1 is on meta"):
        check_transpose_pairs([a, b], [torch.zeros(3, 2, dtype=torch.uint8),
                                       torch.zeros(3, 2, dtype=torch.uint8, device="meta")])
