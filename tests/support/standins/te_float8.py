"""Stand-ins of Transformer Engine's ``Float8Tensor``, one per API generation, and the module
surface ``TEBackend(te_module=..., version=...)`` reads (TE does not import on CPU machines).

Each stand-in follows the attribute protocol of one TE generation as read in TE's public source
(tags v1.6, v1.8, v2.0, v2.10 and main):

* 1.6-1.7: ``_fp8_attrs`` dict behind ``_transpose`` / ``_transpose_invalid`` properties,
  ``transpose_2d(*, cache=False, noop_flag=None)``, ``_reset_caches()``;
* 1.8-1.13: the same storage, ``transpose_2d(*, force_compute=False, fill_cache=False, ...)``;
* 2.0-2.9: instance attributes, ``_create_transpose()``;
* >= 2.10: as 2.0 plus ``tensor.utils.post_all_gather_processing(weights)`` (which rebuilds every
  Float8Tensor it is given unless non-TN GEMMs are supported).

Used by ``tests/test_te_backend.py`` and ``tests/test_observe.py``.
"""

from __future__ import annotations

import types

import torch

from nemo_fp8_align.backends.te import (GEN_1_6, GEN_1_8, GEN_2_0, GEN_2_10, TEBackend,
                                        parse_te_version)

SHAPES = [(48, 80), (33, 7), (1, 1), (16, 1)]


def random_bytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


class Calls:
    def __init__(self):
        self.log = []


class TE16Float8Tensor:
    """TE 1.6-1.7: attributes in ``_fp8_attrs``; ``transpose_2d(cache=...)``."""

    calls = Calls()

    def __init__(self, data):
        self._data = data
        self._fp8_attrs = {"transpose": None, "transpose_invalid": True, "dtype": "E4M3"}

    _transpose = property(lambda s: s._fp8_attrs["transpose"],
                          lambda s, v: s._fp8_attrs.__setitem__("transpose", v))
    _transpose_invalid = property(lambda s: s._fp8_attrs["transpose_invalid"],
                                  lambda s, v: s._fp8_attrs.__setitem__("transpose_invalid", v))

    def _reset_caches(self):
        type(self).calls.log.append(("reset", id(self)))
        self._transpose_invalid = True

    def transpose_2d(self, *, cache=False, noop_flag=None):
        type(self).calls.log.append(("transpose_2d", id(self), dict(cache=cache)))
        if not cache:
            return self._data.t().contiguous()
        if not self._transpose_invalid and noop_flag is None:
            return self._transpose
        if self._transpose is None:
            self._transpose = torch.empty((self._data.shape[1], self._data.shape[0]), dtype=torch.uint8)
        self._transpose.copy_(self._data.t())
        self._transpose_invalid = False
        return self._transpose


class TE18Float8Tensor(TE16Float8Tensor):
    """TE 1.8-1.13: ``transpose_2d(force_compute=..., fill_cache=...)``."""

    calls = Calls()

    def transpose_2d(self, *, force_compute=False, fill_cache=False, noop_flag=None, cache=None):
        type(self).calls.log.append(("transpose_2d", id(self),
                                     dict(force_compute=force_compute, fill_cache=fill_cache)))
        need = force_compute or self._transpose is None or self._transpose_invalid
        if not need:
            return self._transpose
        out = self._transpose
        if out is None:
            out = torch.empty((self._data.shape[1], self._data.shape[0]), dtype=torch.uint8)
        out.copy_(self._data.t())
        if fill_cache:
            self._transpose = out
            self._transpose_invalid = False
        return out


class TE20Float8Tensor:
    """TE 2.x: instance attributes; ``_create_transpose()``."""

    calls = Calls()

    def __init__(self, data, transpose=None):
        self._data = data
        self._transpose = transpose
        self._transpose_invalid = transpose is None

    def _reset_caches(self):
        self._transpose_invalid = True

    def _create_transpose(self):
        type(self).calls.log.append(("create_transpose", id(self)))
        out = self._transpose
        if out is None:
            out = torch.empty((self._data.shape[1], self._data.shape[0]), dtype=torch.uint8)
        out.copy_(self._data.t())
        self._transpose = out
        self._transpose_invalid = False


class TE210Float8Tensor(TE20Float8Tensor):
    calls = Calls()


class _BlockScaled:
    """TE's block-scaled storage as the backend reads it: row-wise data and 2D block scales
    (one per 16x16 block here; TE's are 128x128, padded), a column-wise copy built by
    ``_create_columnwise`` (TE 2.20: byte transpose + scale transpose, for 2D blocks)."""

    def __init__(self, data, block=16):
        self._rowwise_data = data
        rows, cols = -(-data.shape[0] // block), -(-data.shape[1] // block)
        self._rowwise_scale_inv = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        self._columnwise_data = None
        self._columnwise_scale_inv = None
        self._is_2D_scaled = True

    def _create_columnwise(self):
        self._columnwise_data = self._rowwise_data.t().contiguous()
        self._columnwise_scale_inv = self._rowwise_scale_inv.t().contiguous()


class MXFP8Tensor(_BlockScaled):
    pass


class Float8BlockwiseQTensor(_BlockScaled):
    pass


class NVFP4Tensor(_BlockScaled):
    pass


def te_module(cls, version, *, non_tn=False, query_name="is_non_tn_fp8_gemm_supported"):
    # Transformer Engine's API surface: TE does not import without CUDA.
    ns = types.SimpleNamespace(__version__=version, Float8Tensor=cls, MXFP8Tensor=MXFP8Tensor,
                               Float8BlockwiseQTensor=Float8BlockwiseQTensor, NVFP4Tensor=NVFP4Tensor,
                               post_all_gather_processing=None)
    if parse_te_version(version) >= (2, 0):
        setattr(ns, query_name, lambda: non_tn)
    if parse_te_version(version) >= (2, 10):
        ns.pag_calls = []

        def post_all_gather_processing(weights):
            # TE >= 2.10: Float8Tensor -> _create_transpose() unless non-TN GEMMs are supported;
            # MXFP8 -> nothing. It rebuilds even a valid transpose.
            if not isinstance(weights, list):
                weights = [weights]
            ns.pag_calls.append([id(w) for w in weights])
            for w in weights:
                if isinstance(w, cls) and not non_tn:
                    w._create_transpose()
                elif isinstance(w, (Float8BlockwiseQTensor, NVFP4Tensor)):  # on every GPU
                    w._create_columnwise()

        ns.post_all_gather_processing = post_all_gather_processing
    return ns


GENERATIONS = {
    GEN_1_6: (TE16Float8Tensor, "1.7.0+cu12"),
    GEN_1_8: (TE18Float8Tensor, "1.13.0"),
    GEN_2_0: (TE20Float8Tensor, "2.9.0"),
    GEN_2_10: (TE210Float8Tensor, "2.20.2"),
}


def te_setup(gen, **backend_kwargs):
    """(stand-in class, TE module, weights of :data:`SHAPES`, TEBackend) of one generation."""
    cls, version = GENERATIONS[gen]
    cls.calls.log.clear()
    te = te_module(cls, version)
    weights = [cls(random_bytes(s, i)) for i, s in enumerate(SHAPES)]
    backend = TEBackend(te_module=te, version=version, **backend_kwargs)
    return cls, te, weights, backend
