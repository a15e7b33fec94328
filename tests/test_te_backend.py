"""TEBackend against stand-ins of Transformer Engine's Float8Tensor, one per API generation
(``tests/support/standins/te_float8.py``: TE does not import on CPU machines), injected through
``TEBackend(te_module=..., version=...)``.
"""

from __future__ import annotations

import types

import pytest
import torch

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.backends.protocol import FP8TransposeBackend
from nemo_fp8_align.backends.te import (
    GEN_1_6,
    GEN_1_8,
    GEN_2_0,
    GEN_2_10,
    TEBackend,
    api_generation,
    make_backend,
    load_te_api,
    parse_te_version,
)
from support.standins.te_float8 import (GENERATIONS, SHAPES, MXFP8Tensor, Float8BlockwiseQTensor,
                                        NVFP4Tensor, TE16Float8Tensor, TE20Float8Tensor,
                                        TE210Float8Tensor, Calls, random_bytes, te_module,
                                        te_setup)


def _assert_transposes_exact(backend, weights):
    for i, w in enumerate(weights):
        assert backend.has_valid_transpose(w), f"weight {i}"
        assert torch.equal(w._transpose, w._data.t()), f"weight {i}: transpose bytes differ"


# ----------------------------------------------------------------------------- versions


def test_without_te_construction_raises_importerror_with_hint():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        pass
    else:  # pragma: no cover - CPU machines have no TE
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(ImportError, match="pip install"):
        TEBackend()
    with pytest.raises(ImportError, match="Transformer Engine"):
        load_te_api()


@pytest.mark.parametrize("text,expect", [("2.20.2", (2, 20)), ("2.10.0.dev0+abc", (2, 10)),
                                         ("1.13.0+cu12", (1, 13)), (" 1.6", (1, 6))])
def test_parse_version(text, expect):
    assert parse_te_version(text) == expect


def test_parse_version_rejects_garbage():
    with pytest.raises(ValueError):
        parse_te_version("dev")


@pytest.mark.parametrize("version,gen", [((1, 6), GEN_1_6), ((1, 7), GEN_1_6), ((1, 8), GEN_1_8),
                                         ((1, 13), GEN_1_8), ((2, 0), GEN_2_0), ((2, 9), GEN_2_0),
                                         ((2, 10), GEN_2_10), ((2, 20), GEN_2_10), ((3, 0), GEN_2_10)])
def test_api_generation(version, gen):
    assert api_generation(version) == gen


def test_too_old_te_is_refused():
    with pytest.raises(ValueError, match="older than 1.6"):
        TEBackend(te_module=te_module(TE16Float8Tensor, "1.5.0"), version="1.5.0")


def test_version_without_its_api_is_refused():
    te = te_module(TE20Float8Tensor, "2.10.0")
    te.post_all_gather_processing = None
    with pytest.raises(ValueError, match="post_all_gather_processing"):
        TEBackend(te_module=te)
    with pytest.raises(ValueError, match="transpose_2d"):
        TEBackend(te_module=te_module(TE20Float8Tensor, "1.8.0"))


def test_version_read_from_module_and_name():
    backend = TEBackend(te_module=te_module(TE210Float8Tensor, "2.20.2"))
    assert backend.name == "te-2.20" and backend.generation == GEN_2_10
    assert isinstance(backend, FP8TransposeBackend)


def test_make_backend_honours_the_config():
    te = te_module(TE210Float8Tensor, "2.20.2")
    b = make_backend(AlignConfig(te_kernel_writes_transpose=True, use_triton_kernel=False), te_module=te)
    assert isinstance(b, TEBackend) and b.kernel_writes_transpose and not b.use_triton_kernel


def test_from_config():
    te = te_module(TE210Float8Tensor, "2.20.2")
    b = TEBackend.from_config(AlignConfig(use_triton_kernel=False, te_kernel_writes_transpose=True),
                              te_module=te)
    assert b.kernel_writes_transpose and not b.use_triton_kernel
    assert not TEBackend.from_config(AlignConfig(), te_module=te).kernel_writes_transpose


# ----------------------------------------------------------------------------- building


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_build_then_nothing_to_rebuild(gen):
    cls, te, weights, backend = te_setup(gen)
    assert not any(backend.has_valid_transpose(w) for w in weights)
    assert backend.build_transposes(weights) == len(weights)
    _assert_transposes_exact(backend, weights)
    assert backend.build_transposes(weights) == 0  # no second transpose
    assert backend.transposes_built == len(weights)
    # Invalidate (the optimizer wrote new bytes), rebuild.
    for i, w in enumerate(weights):
        w._data.copy_(random_bytes(tuple(w._data.shape), 100 + i))
        w._reset_caches()
    assert not any(backend.has_valid_transpose(w) for w in weights)
    assert backend.build_transposes(weights) == len(weights)
    _assert_transposes_exact(backend, weights)


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_uses_the_versions_api(gen):
    cls, te, weights, backend = te_setup(gen)
    weights[1]._reset_caches()
    backend.build_transposes(weights)
    log = cls.calls.log
    ids = [id(w) for w in weights]
    if gen == GEN_1_6:
        assert [e for e in log if e[0] == "transpose_2d"] == [("transpose_2d", i, {"cache": True}) for i in ids]
        # each build is preceded by a reset of that weight
        for i in ids:
            k = log.index(("transpose_2d", i, {"cache": True}))
            assert log[k - 1] == ("reset", i)
    elif gen == GEN_1_8:
        assert [e for e in log if e[0] == "transpose_2d"] == [
            ("transpose_2d", i, {"force_compute": True, "fill_cache": True}) for i in ids]
    elif gen == GEN_2_0:
        assert log == [("create_transpose", i) for i in ids]
    else:
        assert te.pag_calls == [ids]  # one call for the whole chunk
        assert log == [("create_transpose", i) for i in ids]


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_only_stale_weights_are_built_and_counted(gen):
    cls, te, weights, backend = te_setup(gen)
    assert backend.build_transposes(weights) == len(weights)
    cls.calls.log.clear()
    weights[2]._reset_caches()
    cls.calls.log.clear()
    assert backend.build_transposes(weights) == 1
    built = {e[1] for e in cls.calls.log if e[0] in ("transpose_2d", "create_transpose")}
    assert built == {id(weights[2])}
    if gen == GEN_2_10:
        assert te.pag_calls[-1] == [id(weights[2])]


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_after_tes_own_build_backend_builds_nothing(gen):
    cls, te, weights, backend = te_setup(gen)
    if gen == GEN_2_10:
        te.post_all_gather_processing(weights)  # what megatron-core 0.16's finish_param_sync runs
    elif gen == GEN_2_0:
        for w in weights:
            w._create_transpose()
    elif gen == GEN_1_8:
        for w in weights:
            w.transpose_2d(force_compute=True, fill_cache=True)
    else:
        for w in weights:
            w.transpose_2d(cache=True)
    assert backend.build_transposes(weights) == 0
    assert backend.transposes_built == 0


def test_duplicates_are_built_once():
    cls, te, weights, backend = te_setup(GEN_2_10)
    assert backend.build_transposes(weights + weights[:2]) == len(weights)
    assert te.pag_calls == [[id(w) for w in weights]]


def test_broken_build_is_reported():
    class Broken(TE20Float8Tensor):
        def _create_transpose(self):
            pass  # forgets to build

    backend = TEBackend(te_module=te_module(Broken, "2.5.0"))
    with pytest.raises(RuntimeError, match="still invalid"):
        backend.build_transposes([Broken(random_bytes((4, 4), 0))])


# ----------------------------------------------------------------------------- no-ops and skips


@pytest.mark.parametrize("query_name", ["is_non_tn_fp8_gemm_supported", "non_tn_fp8_gemm_supported"])
def test_non_tn_gpus_need_no_transpose(query_name):
    version = "2.20.2" if query_name.startswith("is_") else "2.1.0"
    cls = TE210Float8Tensor if version == "2.20.2" else TE20Float8Tensor
    te = te_module(cls, version, non_tn=True, query_name=query_name)
    backend = TEBackend(te_module=te)
    needed, reason = backend.transpose_needed()
    assert not needed and "non-TN" in reason and "no-op" in reason
    weights = [cls(random_bytes(s, i)) for i, s in enumerate(SHAPES)]
    assert backend.build_transposes(weights) == 0
    assert not any(backend.has_valid_transpose(w) for w in weights)


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_hopper_needs_transpose(gen):
    _, _, _, backend = te_setup(gen)
    needed, reason = backend.transpose_needed()
    assert needed and "TN" in reason


def test_block_scaled_weights_go_to_tes_post_processing_never_to_a_byte_transpose():
    """Blockwise and NVFP4 weights' column-wise copies are TE's work (its
    post_all_gather_processing); MXFP8's is megatron-core's re-quantization (nothing built
    here); plain tensors are skipped with the reason. Seen failing with the blockwise weights
    sent to the byte-transpose path (their ``_classify`` reason came back)."""
    cls, te, weights, backend = te_setup(GEN_2_10)
    mx, bw, fp4 = (MXFP8Tensor(random_bytes((32, 48), 1)),
                   Float8BlockwiseQTensor(random_bytes((32, 48), 2)),
                   NVFP4Tensor(random_bytes((32, 48), 3)))
    others = [mx, bw, fp4, torch.zeros(4, 4)]
    assert [backend.kind_of(w) for w in others[:3]] == ["requantize", "columnwise",
                                                       "nvfp4-transpose"]
    assert backend.build_transposes(others + weights) == len(weights) + 2
    assert [id(bw), id(fp4)] in te.pag_calls  # TE's own function, not the plugin's kernel
    assert not any(id(mx) in call for call in te.pag_calls)
    assert mx._columnwise_data is None and not backend.has_valid_transpose(mx)
    assert backend.has_valid_transpose(bw) and backend.has_valid_transpose(fp4)
    assert backend.transpose_mismatch(bw) is None
    bw._rowwise_data[0, 1] ^= 1  # new row-wise bytes, column-wise copy not rebuilt: stale
    assert "column-wise bytes differ" in backend.transpose_mismatch(bw)
    bw._create_columnwise()
    bw._rowwise_scale_inv[0, 1] += 1
    assert "block scales differ" in backend.transpose_mismatch(bw)
    reasons = list(backend.skipped)
    assert any("Tensor is not a Transformer Engine Float8Tensor" in r for r in reasons)
    assert not any("blockwise" in r or "NVFP4" in r for r in reasons)


def test_block_scaled_weights_keep_the_engine_on_where_fp8_needs_no_transpose():
    """Datacenter Blackwell: per-tensor FP8 needs no transpose, a blockwise weight still needs
    its column-wise copy after every all-gather."""
    te = te_module(TE210Float8Tensor, "2.20.2", non_tn=True)
    backend = TEBackend(te_module=te)
    assert not backend.transpose_needed()[0]

    class Chunk(torch.nn.Module):
        def parameters(self):
            return iter([Float8BlockwiseQTensor(random_bytes((32, 32), 4))])
    assert len(backend.weights_of(Chunk())) == 1
    needed, reason = backend.transpose_needed()
    assert needed and "column-wise copy" in reason


def test_columnwise_only_float8_is_skipped():
    cls, te, _, backend = te_setup(GEN_2_10)
    w = cls(None, transpose=random_bytes((8, 4), 0))
    assert backend.build_transposes([w]) == 0
    assert any("column-wise only" in r for r in backend.skipped)


# ----------------------------------------------------------------------------- no hooks fire


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_has_valid_transpose_fires_no_attribute_hook(gen):
    """Apex's distributed Adam patches the parameter class's __getattribute__ so that the first
    attribute access copies gathered bytes and resets the caches; asking must not trigger it."""
    base, version = GENERATIONS[gen]
    fired = []

    class Hooked(base):
        calls = Calls()

        def __getattribute__(self, name):
            if not name.startswith("__"):
                fired.append(name)
            return super().__getattribute__(name)

    backend = TEBackend(te_module=te_module(Hooked, version))
    w = Hooked(random_bytes((8, 12), 0))
    fired.clear()
    assert backend.has_valid_transpose(w) is False
    assert fired == []
    backend.build_transposes([w])  # building may go through the hook: it calls TE's methods
    fired.clear()
    assert backend.has_valid_transpose(w) is True
    assert fired == []


def test_classifying_other_tensors_fires_no_attribute_hook():
    """isinstance() would read __class__ through a patched __getattribute__ on a mismatch."""
    fired = []

    class HookedMX(MXFP8Tensor):
        def __getattribute__(self, name):
            fired.append(name)
            return super().__getattribute__(name)

    _, _, weights, backend = te_setup(GEN_2_10)
    mx = HookedMX(random_bytes((16, 16), 0))
    fired.clear()
    assert backend.build_transposes([mx] + weights) == len(weights)
    assert fired == []


# ----------------------------------------------------------------------------- kernel path


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_kernel_writes_transpose(gen):
    cls, te, weights, backend = te_setup(gen, kernel_writes_transpose=True, use_triton_kernel=False)
    # One weight already has a (stale) buffer of the right shape: it must be reused in place.
    weights[0]._transpose = torch.zeros((SHAPES[0][1], SHAPES[0][0]), dtype=torch.uint8)
    weights[0]._transpose_invalid = True
    ptr0 = weights[0]._transpose.data_ptr()
    assert backend.build_transposes(weights) == len(weights)
    _assert_transposes_exact(backend, weights)
    assert weights[0]._transpose.data_ptr() == ptr0
    assert [e for e in cls.calls.log if e[0] in ("transpose_2d", "create_transpose")] == []
    if gen == GEN_2_10:
        assert te.pag_calls == []
    assert backend.build_transposes(weights) == 0
    if gen in (GEN_1_6, GEN_1_8):  # TE 1.x keeps the cache in _fp8_attrs
        assert weights[1]._fp8_attrs["transpose_invalid"] is False


def test_kernel_path_matches_te_path_bytes():
    cls, te, weights, backend = te_setup(GEN_2_10)
    backend.build_transposes(weights)
    expect = [w._transpose.clone() for w in weights]
    for w in weights:
        w._reset_caches()
    kb = TEBackend(te_module=te, kernel_writes_transpose=True, use_triton_kernel=False)
    assert kb.build_transposes(weights) == len(weights)
    for e, w in zip(expect, weights):
        assert torch.equal(e, w._transpose)


def test_describe():
    _, _, weights, backend = te_setup(GEN_2_10)
    backend.build_transposes(weights)
    d = backend.describe()
    assert d["name"] == "te-2.20" and d["transpose_needed"] and d["transposes_built"] == len(weights)


def test_weights_of_picks_quantized_parameters_only():
    cls, _, weights, backend = te_setup(GEN_2_10)
    mx = MXFP8Tensor.__new__(MXFP8Tensor)
    # A chunk's parameters(): the TE stand-ins are plain objects, which a torch Module refuses.
    chunk = types.SimpleNamespace(parameters=lambda: iter([weights[0], torch.zeros(2), mx,
                                                           weights[1]]))
    assert backend.weights_of(chunk) == [weights[0], mx, weights[1]]


def test_the_build_watch_sees_tes_columnwise_builds_whoever_calls_them():
    """megatron-core's post-processing calls TE's post_all_gather_processing, which calls
    _create_columnwise: the watch reports each such build (the observed slot of a blockwise
    chunk). Seen failing with the column-wise watch left out of watch_te_builds."""
    _, te, _, backend = te_setup(GEN_2_10)
    bw = Float8BlockwiseQTensor(random_bytes((32, 48), 5))
    seen = []
    undo = backend.watch_builds(seen.append)
    try:
        te.post_all_gather_processing([bw])  # as megatron-core calls it, not the plugin
    finally:
        undo()
    assert seen == [bw]
    te.post_all_gather_processing([bw])
    assert seen == [bw]  # undone: no longer observed
