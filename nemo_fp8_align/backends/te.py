"""FP8 transpose backend for Transformer Engine ``Float8Tensor`` parameters.

Builds the transpose cache that Hopper-class GPUs need for the backward data-gradient GEMM (TN
layout only), through the installed TE version's API (checked against TE's source, v1.6 - main):

================  ==============================================================================
TE                how one weight's transpose is built
================  ==============================================================================
1.6 - 1.7         ``w._reset_caches()`` then ``w.transpose_2d(cache=True)``
1.8 - 1.13        ``w.transpose_2d(force_compute=True, fill_cache=True)``
2.0 - 2.9         ``w._create_transpose()``
>= 2.10           ``transformer_engine.pytorch.tensor.utils.post_all_gather_processing(weights)``
================  ==============================================================================

In every version a weight's transpose is valid when ``w._transpose is not None and not
w._transpose_invalid`` (TE 1.x keeps both in the ``w._fp8_attrs`` dict behind properties).
:meth:`TEBackend.has_valid_transpose` reads them without calling the tensor class's
``__getattribute__`` (Apex's distributed optimizer patches it so that the first attribute access
of a parameter copies the gathered bytes and resets the caches), so asking never builds or
invalidates anything.

Only weights whose transpose is missing or invalid are built, and the return value counts only
transposes that were actually built: after megatron-core's (or TE's) own post-all-gather
processing the count is 0, which makes a second transpose visible in telemetry.

``transpose_needed()`` is ``(False, reason)`` where TE says FP8 GEMMs accept non-TN layouts
(``is_non_tn_fp8_gemm_supported()`` from TE 2.3, ``non_tn_fp8_gemm_supported()`` in 2.0 - 2.2:
datacenter Blackwell and newer); TE 1.x always transposes. MXFP8, blockwise-FP8 and NVFP4
tensors are never byte-transposed by this backend: their scales run along one axis, so their
column-wise copy is TE's or megatron-core's work (:mod:`nemo_fp8_align.backends.te_blocks`,
kinds in :mod:`nemo_fp8_align.support`); the backend lists them, reads whether the
copy is present and, where one is missing, asks TE's own ``post_all_gather_processing``.

Optional, off by default (``te_kernel_writes_transpose``): our multi-tensor kernel writes a
chunk's transposes into the ``_transpose`` buffers in one launch (bit-exact against TE's own
transpose: validation/te_real_run.py checks it). Without CUDA, TE does not import: tests pass
an object with TE's attribute surface as ``te_module`` and a ``version`` (:func:`load_te_api`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align.backends.te_api import (BUILD_CALLS, FP8_ATTR_KEYS, FP8_ATTRS, GEN_1_6,
                                             GEN_1_8, GEN_2_0, GEN_2_10, NEVER_TRANSPOSE,
                                             TE_INSTALL_HINT, api_generation, load_te_api,
                                             parse_te_version)
from nemo_fp8_align.backends import te_blocks
from nemo_fp8_align.support import TRANSPOSE
from nemo_fp8_align.kernels import multi_transpose_

__all__ = ["TEBackend", "make_backend", "load_te_api", "parse_te_version", "api_generation",
           "GEN_1_6", "GEN_1_8", "GEN_2_0", "GEN_2_10", "TE_INSTALL_HINT"]

logger = logging.getLogger(__name__)

_MISSING = object()


def make_backend(config: Any, **kwargs: Any) -> "TEBackend":
    """The backend an :class:`~nemo_fp8_align.config.AlignConfig` asks for (``use_triton_kernel``,
    ``te_kernel_writes_transpose``); ``kwargs`` go to :class:`TEBackend` (e.g. ``te_module``)."""
    return TEBackend.from_config(config, **kwargs)


class TEBackend:
    """:class:`~nemo_fp8_align.backends.protocol.FP8TransposeBackend` for TE ``Float8Tensor`` weights.

    Args:
        te_module: TE's API surface (see :func:`load_te_api`); ``None`` imports the installed TE.
        version: TE version string; ``None`` reads ``te_module.__version__``.
        use_triton_kernel: let :func:`~nemo_fp8_align.kernels.multi_transpose_` use the Triton
            kernel (only matters with ``kernel_writes_transpose``).
        kernel_writes_transpose: write the transposes with our multi-tensor kernel into the
            weights' ``_transpose`` buffers instead of calling TE's API (config
            ``te_kernel_writes_transpose``; off by default).
    """

    def __init__(self, *, te_module: Any = None, version: Optional[str] = None,
                 use_triton_kernel: bool = True, kernel_writes_transpose: bool = False) -> None:
        self.api = te_module if te_module is not None else load_te_api()
        if version is None:
            version = getattr(self.api, "__version__", None)
            if version is None:
                raise ValueError("TEBackend: pass version= with a te_module that has no __version__")
        self.version_string = str(version)
        self.version = parse_te_version(self.version_string)
        self.generation = api_generation(self.version)
        self.name = f"te-{self.version[0]}.{self.version[1]}"
        self.use_triton_kernel = use_triton_kernel
        self.kernel_writes_transpose = kernel_writes_transpose
        self.float8_cls = getattr(self.api, "Float8Tensor", None)
        if self.float8_cls is None:
            raise ValueError(f"TEBackend: the TE API given has no Float8Tensor ({self.name})")
        self._check_api()
        #: Why weights were skipped, counted over the backend's life: reason -> count.
        self.skipped: Counter = Counter()
        #: Transposes this backend built over its life (telemetry, tests).
        self.transposes_built = 0
        self._needed: Optional[Tuple[bool, str]] = None
        self._blocks_listed = False

    # ------------------------------------------------------------------ construction helpers

    def _check_api(self) -> None:
        need = tuple(dict.fromkeys(name for name, _ in BUILD_CALLS[self.generation]))
        missing = [m for m in need if not hasattr(self.float8_cls, m)]
        if self.generation == GEN_2_10 and getattr(self.api, "post_all_gather_processing", None) is None:
            missing.append("transformer_engine.pytorch.tensor.utils.post_all_gather_processing")
        if missing:
            raise ValueError(
                f"TEBackend: Transformer Engine {self.version_string} should provide "
                f"{', '.join(missing)} (API generation {self.generation}) but does not; the "
                "installed TE and its reported version disagree."
            )

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> "TEBackend":
        """Build from an :class:`~nemo_fp8_align.config.AlignConfig`."""
        return cls(use_triton_kernel=config.use_triton_kernel,
                   kernel_writes_transpose=config.te_kernel_writes_transpose, **kwargs)

    # ------------------------------------------------------------------ attribute access

    def _peek(self, w: Any, name: str, default: Any = _MISSING) -> Any:
        """Read ``w.<name>`` without the class's ``__getattribute__`` (no Apex hook fires)."""
        try:
            d = object.__getattribute__(w, "__dict__")
        except AttributeError:
            d = {}
        if self.generation in (GEN_1_6, GEN_1_8):
            attrs = d.get(FP8_ATTRS)
            key = FP8_ATTR_KEYS.get(name)
            if isinstance(attrs, dict) and key is not None and key in attrs:
                return attrs[key]
        if name in d:
            return d[name]
        try:
            return object.__getattribute__(w, name)
        except AttributeError:
            if default is _MISSING:
                raise
            return default

    def _classify(self, w: Any) -> Optional[str]:
        """``None`` when this backend builds ``w``'s transpose, else why it is skipped.

        Uses ``type(w)`` only: ``isinstance`` falls back to reading ``w.__class__`` through the
        class's ``__getattribute__`` when the type does not match, which fires an armed Apex hook.
        """
        wtype = type(w)
        if issubclass(wtype, self.float8_cls):
            if self._peek(w, "_data", None) is None:
                return "Float8Tensor without row-wise data (column-wise only): nothing to transpose"
            return None
        for attr, (needle, why) in zip(("MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor"),
                                       NEVER_TRANSPOSE):
            cls = getattr(self.api, attr, None)
            if (cls is not None and issubclass(wtype, cls)) or needle.lower() in wtype.__name__.lower():
                return why
        return f"{wtype.__name__} is not a Transformer Engine Float8Tensor"

    def weights_of(self, module: Any) -> List[Any]:
        """The quantized parameters of ``module`` (e.g. one model chunk), in order:
        ``Float8Tensor`` and TE's block-scaled ones (blockwise FP8, MXFP8, NVFP4).

        By ``type()`` only, for the same reason as :meth:`_classify`.
        """
        out = [p for p in module.parameters() if issubclass(type(p), self.float8_cls)
               or te_blocks.block_kind(self.api, p) is not None]
        # Block-scaled weights need their column-wise copy on every GPU (datacenter Blackwell
        # too, where per-tensor FP8 needs no transpose): listing one keeps the engine active.
        self._blocks_listed |= any(te_blocks.block_kind(self.api, p) is not None for p in out)
        return out

    def kind_of(self, weight: Any) -> str:
        """The weight's post-all-gather work (:mod:`~nemo_fp8_align.support`)."""
        return te_blocks.block_kind(self.api, weight) or TRANSPOSE

    # ------------------------------------------------------------------ protocol

    def transpose_needed(self) -> Tuple[bool, str]:
        needed = self._per_tensor_needed()
        if not needed[0] and self._blocks_listed:
            return True, ("block-scaled weights (blockwise FP8 / MXFP8 / NVFP4) get their "
                          "column-wise copy after every all-gather on every GPU")
        return needed

    def _per_tensor_needed(self) -> Tuple[bool, str]:
        if self._needed is None:
            self._needed = self._compute_needed()
        return self._needed

    def _compute_needed(self) -> Tuple[bool, str]:
        if self.generation in (GEN_1_6, GEN_1_8):
            return True, (f"TE {self.version_string}: FP8 GEMMs take the TN layout only, the "
                          "backward data-gradient GEMM reads a cached FP8 transpose")
        query: Optional[Callable[[], bool]] = getattr(self.api, "is_non_tn_fp8_gemm_supported", None)
        if query is None:
            query = getattr(self.api, "non_tn_fp8_gemm_supported", None)
        if query is None:
            return True, (f"TE {self.version_string} has no non-TN FP8 GEMM query; assuming TN-only "
                          "FP8 GEMMs (the backward GEMM needs a transpose)")
        if query():
            return False, (f"TE {self.version_string} reports non-TN FP8 GEMM support on this GPU "
                           "(datacenter Blackwell or newer): the backward GEMM reads the weight as "
                           "stored, there is no transpose to align; the plugin is a no-op")
        return True, (f"TE {self.version_string}: this GPU's FP8 GEMMs take the TN layout only "
                      "(Hopper / Ada / consumer Blackwell), the backward GEMM needs a transpose")

    def has_valid_transpose(self, weight: Any) -> bool:
        if te_blocks.block_kind(self.api, weight) is not None:
            return te_blocks.columnwise_present(self._peek, weight)
        t = self._peek(weight, "_transpose", None)
        if t is None:
            return False
        return not bool(self._peek(weight, "_transpose_invalid", True))

    def transpose_mismatch(self, weight: Any) -> Optional[str]:
        """Verify mode: ``_transpose`` against ``_data`` transposed, byte for byte (a
        block-scaled weight: :func:`~nemo_fp8_align.backends.te_blocks.columnwise_mismatch`)."""
        kind = te_blocks.block_kind(self.api, weight)
        if kind is not None:
            return te_blocks.columnwise_mismatch(self._peek, weight, kind)
        if not self.has_valid_transpose(weight):
            return "transpose cache invalid"
        data, t = self._peek(weight, "_data"), self._peek(weight, "_transpose")
        data = data.reshape(-1, data.shape[-1]) if data.dim() != 2 else data
        if tuple(t.shape) != (data.shape[1], data.shape[0]):
            return f"transpose shape {tuple(t.shape)} for data {tuple(data.shape)}"
        if not torch.equal(t.view(torch.uint8), data.view(torch.uint8).t()):
            return "transpose bytes differ from the FP8 data transposed"
        return None

    def build_transposes(self, weights: Sequence[Any]) -> int:
        """Build the transposes that are missing or invalid; return how many were built.

        Expects the chunk's bytes in place (all-gather finished; with Apex's distributed Adam the
        pre-forward copy done and its hook disarmed, which ``ApexAdapter`` does): validity is
        read without firing attribute hooks, while the build itself calls TE's methods (or, on the
        kernel path, reads ``_data`` / ``_transpose``) through ordinary attribute access.
        """
        needed, _reason = self._per_tensor_needed()
        stale: List[Any] = []
        blocks: List[Any] = []
        seen = set()
        for w in weights:
            if id(w) in seen:
                continue
            seen.add(id(w))
            if te_blocks.block_kind(self.api, w) is not None:
                if not self.has_valid_transpose(w):
                    blocks.append(w)  # TE's work, never a byte transpose of ours
                continue
            why = self._classify(w) if needed else "no FP8 transpose needed on this GPU"
            if why is not None:
                if self.skipped[why] == 0:
                    logger.info("nemo_fp8_align TE backend: skipping %s", why)
                self.skipped[why] += 1
                continue
            if not self.has_valid_transpose(w):
                stale.append(w)
        built_blocks = self._build_blocks(blocks)
        if not stale:
            return built_blocks
        if self.kernel_writes_transpose:
            self._build_with_kernel(stale)
        else:
            self._build_with_te(stale)
        built = sum(1 for w in stale if self.has_valid_transpose(w))
        if built != len(stale):
            raise RuntimeError(
                f"TEBackend ({self.name}): {len(stale) - built} of {len(stale)} transposes are still "
                "invalid after the build; the installed TE does not behave as its version says."
            )
        self.transposes_built += built
        return built + built_blocks

    def _build_blocks(self, blocks: List[Any]) -> int:
        """Hand block-scaled weights whose column-wise copy is missing to TE."""
        if not blocks:
            return 0
        te_blocks.build_columnwise(self.api, blocks, [self.kind_of(w) for w in blocks])
        built = sum(1 for w in blocks if self.has_valid_transpose(w))
        self.transposes_built += built
        return built

    def rebuild_transposes(self, weights: Sequence[Any]) -> int:
        """Build every weight's transpose from its current ``_data``, flagged valid or not (TE
        keeps a transpose flagged valid across a new cast under megatron-core's
        ``manual_post_all_gather_processing=True``): each is marked invalid, then built. A
        block-scaled weight's column-wise copy is rebuilt by TE's ``post_all_gather_processing``
        (MXFP8's requantization is megatron-core's: not rebuilt here)."""
        blocks = [w for w in weights if te_blocks.block_kind(self.api, w) is not None]
        rebuilt = te_blocks.build_columnwise(self.api, blocks, [self.kind_of(w) for w in blocks])
        weights = [w for w in weights if te_blocks.block_kind(self.api, w) is None]
        for w in weights:
            if self._classify(w) is not None:
                continue
            attrs = self._peek(w, FP8_ATTRS, None) if self.generation in (GEN_1_6, GEN_1_8) else None
            if isinstance(attrs, dict):  # TE 1.x keeps the flag in _fp8_attrs
                attrs[FP8_ATTR_KEYS["_transpose_invalid"]] = True
            else:
                object.__setattr__(w, "_transpose_invalid", True)
        return rebuilt + self.build_transposes(weights)

    # ------------------------------------------------------------------ builders

    def _build_with_te(self, stale: List[Any]) -> None:
        if self.generation == GEN_2_10:
            # One call for the chunk; TE builds each Float8Tensor's transpose (_create_transpose).
            self.api.post_all_gather_processing(list(stale))
            return
        for w in stale:  # e.g. TE 1.8 - 1.13: w.transpose_2d(force_compute=True, fill_cache=True)
            for name, kwargs in BUILD_CALLS[self.generation]:
                getattr(w, name)(**kwargs)

    def _build_with_kernel(self, stale: List[Any]) -> None:
        """Our multi-tensor kernel writes every transpose of the chunk in one launch."""
        sources: List[torch.Tensor] = []
        outputs: List[torch.Tensor] = []
        for w in stale:
            data = w._data
            if data.dim() != 2:
                data = data.reshape(-1, data.shape[-1])
            if not data.is_contiguous():
                data = data.contiguous()
            data = data.view(torch.uint8) if data.dtype != torch.uint8 else data
            rows, cols = data.shape
            out = w._transpose
            if (out is None or tuple(out.shape) != (cols, rows) or out.dtype != torch.uint8
                    or out.device != data.device or not out.is_contiguous()):
                out = torch.empty((cols, rows), dtype=torch.uint8, device=data.device)
            sources.append(data)
            outputs.append(out)
        multi_transpose_(sources, outputs, use_triton=self.use_triton_kernel)
        for w, out in zip(stale, outputs):
            w._transpose = out
            w._transpose_invalid = False

    def watch_builds(self, on_built: Callable[[Any], None]) -> Callable[[], None]:
        """Report every transpose TE builds, also those the plugin does not ask for."""
        from nemo_fp8_align.backends.te_watch import watch_te_builds
        return watch_te_builds(self, on_built)

    def describe(self) -> Dict[str, Any]:
        """Name, API generation, whether transposes are needed (and why), skip counts."""
        needed, reason = self.transpose_needed()
        return {"name": self.name, "te_version": self.version_string, "generation": self.generation,
                "transpose_needed": needed, "reason": reason,
                "kernel_writes_transpose": self.kernel_writes_transpose,
                "transposes_built": self.transposes_built, "skipped": dict(self.skipped)}
