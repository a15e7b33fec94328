"""Transformer Engine's API as the TE backend uses it: versions, API generations, the import.

Which transpose API each TE version has is tabled in :mod:`nemo_fp8_align.backends.te`.
"""

from __future__ import annotations

import re
import types
from typing import Tuple

__all__ = ["load_te_api", "parse_te_version", "api_generation", "GEN_1_6", "GEN_1_8", "GEN_2_0",
           "GEN_2_10", "TE_INSTALL_HINT", "NEVER_TRANSPOSE", "BUILD_CALLS", "BUILD_METHOD",
           "FP8_ATTRS", "FP8_ATTR_KEYS", "FLOAT8_MODULES", "NON_TN_QUERIES", "POST_ALL_GATHER"]

TE_INSTALL_HINT = (
    "Install Transformer Engine with PyTorch support, e.g. `pip install --no-build-isolation "
    "transformer_engine[pytorch]` (TE >= 1.6, a CUDA machine), or use the plain-torch "
    "nemo_fp8_align.backends.reference.ReferenceBackend."
)

#: API generations.
GEN_1_6 = "1.6"  # _reset_caches() + transpose_2d(cache=True)
GEN_1_8 = "1.8"  # transpose_2d(force_compute=True, fill_cache=True)
GEN_2_0 = "2.0"  # _create_transpose()
GEN_2_10 = "2.10"  # tensor.utils.post_all_gather_processing(weights)

# The backend's calls into TE, per API generation, as data: the backend (te.py, te_watch.py) makes
# exactly these calls, and tests/test_te_api_source.py checks every entry against each released TE
# version's own Python source (1.9 - 1.13, 2.1, 2.9, 2.10, 2.20), so a wrong name cannot pass on the
# test stand-ins alone.

#: Per generation, the ``Float8Tensor`` methods called on each stale weight to build its transpose,
#: in order, with their keyword arguments (GEN_2_10 calls :data:`POST_ALL_GATHER` once instead).
BUILD_CALLS = {
    GEN_1_6: (("_reset_caches", {}), ("transpose_2d", {"cache": True})),
    GEN_1_8: (("transpose_2d", {"force_compute": True, "fill_cache": True}),),
    GEN_2_0: (("_create_transpose", {}),),
    GEN_2_10: (),
}
#: The ``Float8Tensor`` method every TE build of a transpose goes through (te_watch observes it).
BUILD_METHOD = {GEN_1_6: "transpose_2d", GEN_1_8: "transpose_2d", GEN_2_0: "_create_transpose",
                GEN_2_10: "_create_transpose"}
#: TE 1.x keeps the transpose cache in this dict of the weight, behind properties:
#: property -> key (read without the class's ``__getattribute__``; the flag is reset there).
FP8_ATTRS = "_fp8_attrs"
FP8_ATTR_KEYS = {"_transpose": "transpose", "_transpose_invalid": "transpose_invalid"}
#: Modules that define or re-export ``Float8Tensor``: the first that has it wins.
FLOAT8_MODULES = ("transformer_engine.pytorch.tensor.float8_tensor",
                  "transformer_engine.pytorch.float8_tensor")
#: TE's non-TN FP8 GEMM query under its two names (2.3 on, 2.0 - 2.2); TE 1.x has neither.
NON_TN_QUERIES = (("transformer_engine.pytorch.utils", "is_non_tn_fp8_gemm_supported"),
                  ("transformer_engine.pytorch.utils", "non_tn_fp8_gemm_supported"))
#: TE >= 2.10's post-all-gather processing (one call for a chunk's weights).
POST_ALL_GATHER = ("transformer_engine.pytorch.tensor.utils", "post_all_gather_processing")

# Class names of TE tensors that must never be byte-transposed, with why.
NEVER_TRANSPOSE = (
    ("MXFP8", "MXFP8 tensor: its block scales run along rows, so a byte transpose would pair "
              "bytes with the wrong scales; TE keeps its own column-wise copy"),
    ("Blockwise", "blockwise-FP8 tensor: its block scales run along one axis, so a byte transpose "
                  "would be wrong; TE builds its column-wise data itself"),
    ("NVFP4", "NVFP4 tensor: 4-bit data with block scales, not byte-transposable"),
)


def parse_te_version(version: str) -> Tuple[int, int]:
    """``"2.20.2"``, ``"2.10.0.dev0+abc"``, ``"1.13.0+cu12"`` -> ``(major, minor)``."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if not m:
        raise ValueError(f"cannot read a Transformer Engine version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def api_generation(version: Tuple[int, int]) -> str:
    """Which transpose API a TE version has; ``ValueError`` below 1.6."""
    if version >= (2, 10):
        return GEN_2_10
    if version >= (2, 0):
        return GEN_2_0
    if version >= (1, 8):
        return GEN_1_8
    if version >= (1, 6):
        return GEN_1_6
    raise ValueError(
        f"Transformer Engine {version[0]}.{version[1]} is older than 1.6, whose Float8Tensor has no "
        "transpose cache this plugin can drive; upgrade TE (>= 1.6)."
    )


def load_te_api() -> types.SimpleNamespace:
    """Import the installed Transformer Engine and return its API surface as used here.

    The namespace has ``__version__``, ``Float8Tensor``, ``is_non_tn_fp8_gemm_supported`` (or
    ``None``), ``post_all_gather_processing`` (or ``None``) and the classes ``MXFP8Tensor``,
    ``Float8BlockwiseQTensor``, ``NVFP4Tensor`` where they exist, and ``tensor_utils`` (TE's
    ``tensor.utils`` module, whose batched NVFP4 transpose the build watch observes). Test
    stand-ins provide the same attributes. Raises ``ImportError`` with an install hint when TE cannot be imported.
    """
    import importlib

    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # TE raises more than ImportError when CUDA libraries are missing
        raise ImportError(f"Transformer Engine is not importable here ({exc!r}). {TE_INSTALL_HINT}") from exc
    version = getattr(te, "__version__", None)
    if version is None:
        from importlib import metadata

        version = metadata.version("transformer_engine")

    def _opt(module: str, name: str):
        try:
            return getattr(importlib.import_module(module), name, None)
        except Exception:
            return None

    float8 = next((c for c in (_opt(m, "Float8Tensor") for m in FLOAT8_MODULES) if c), None)
    if float8 is None:
        raise ImportError(f"Transformer Engine {version}: no Float8Tensor class found. {TE_INSTALL_HINT}")
    non_tn = next((f for f in (_opt(m, n) for m, n in NON_TN_QUERIES) if f), None)
    return types.SimpleNamespace(
        __version__=str(version),
        Float8Tensor=float8,
        is_non_tn_fp8_gemm_supported=non_tn,
        post_all_gather_processing=_opt(*POST_ALL_GATHER),
        MXFP8Tensor=_opt("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Tensor"),
        Float8BlockwiseQTensor=_opt("transformer_engine.pytorch.tensor.float8_blockwise_tensor",
                                    "Float8BlockwiseQTensor"),
        NVFP4Tensor=_opt("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Tensor"),
        tensor_utils=_module("transformer_engine.pytorch.tensor.utils"),
    )


def _module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:
        return None
