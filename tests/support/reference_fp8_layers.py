"""megatron-core's local linear layers with their GEMMs on reference FP8 weights: CPU ONLY.

Transformer Engine does not import on the CPU, so the CPU smoke run and tests have no TE
``Float8Tensor`` weights. These layers stand in for TE's FP8 ``Linear`` on megatron-core's local
(torch) layer spec: each keeps a :class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` of its
high-precision DDP parameter, and its GEMM goes through
:mod:`nemo_fp8_align.backends.reference_linear`'s autograd function: the forward reads the stored FP8
``data``, the backward data gradient reads the cached FP8 ``transpose`` (the TN layout Hopper
needs), the weight gradient goes to the high-precision parameter. So a transpose built at the
wrong time, from the wrong bytes, or not at all changes the gradients and the loss (and, with
provenance checks on, raises :class:`~nemo_fp8_align.backends.reference.StaleFP8Error`).

Cache life cycle, as with TE's FP8 weights: the first training forward of a step builds the
copy and its transpose if nobody did (lazy, at first use); the plugin's ``aligned`` policy builds
them earlier, at the chunk's slot; the training loop marks them stale after every optimizer step
(:func:`invalidate_reference_fp8_weights`, which :mod:`support.cpu_nemo` calls after
NeMo's ``optimizer_step``), whether the plugin is attached or not.

Only tensor-parallel size 1 without sequence parallelism or fused weight-gradient accumulation
(the CPU smoke configuration); anything else is refused with the setting named.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight
from nemo_fp8_align.backends.reference_linear import _FP8LinearFn

__all__ = ["ReferenceFP8ColumnParallelLinear", "ReferenceFP8RowParallelLinear",
           "invalidate_reference_fp8_weights", "with_reference_fp8_linears"]


class _ReferenceFP8GEMM:
    """The GEMM of a megatron-core parallel linear, through the layer's FP8 weight.

    megatron-core 0.12's ``ColumnParallelLinear.forward`` / ``RowParallelLinear.forward`` assign
    ``self._forward_impl`` on every call (the frozen-weight or the async-all-reduce GEMM) and then
    call it with keywords. A property whose setter ignores that assignment keeps megatron-core's
    bias, tensor-parallel regions and return convention and replaces the GEMM alone.
    """

    fp8_weight: ReferenceFP8Weight
    fp8_backend: ReferenceBackend

    def _init_fp8(self, check_provenance: bool) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(
                f"{type(self).__name__} stands in for Transformer Engine's FP8 Linear in CPU tests "
                "and the CPU smoke run only, and refuses to build on a machine with a GPU: use "
                "Transformer Engine there (model.transformer_engine=True, model.fp8=True).")
        if self.weight is None:  # type: ignore[attr-defined]
            raise ValueError(f"{type(self).__name__}: skip_weight_param_allocation=True is not "
                             "supported (the FP8 copy needs the layer's own weight)")
        self.fp8_weight = ReferenceFP8Weight(self.weight, name=type(self).__name__)  # type: ignore[attr-defined]
        # The layer builds lazily through its own backend; the plugin's backend builds the same
        # weight objects at the aligned slot (the state lives on the weight).
        self.fp8_backend = ReferenceBackend(use_triton_kernel=False,
                                            check_provenance=check_provenance)

    @property
    def _forward_impl(self) -> Any:
        return self._fp8_gemm

    @_forward_impl.setter
    def _forward_impl(self, value: Any) -> None:
        pass  # megatron-core's choice of GEMM is replaced by _fp8_gemm (see the class docstring)

    def _fp8_gemm(self, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - mcore's name
                  bias: Optional[torch.Tensor], gradient_accumulation_fusion: bool,
                  sequence_parallel: bool, allreduce_dgrad: bool = False,
                  grad_output_buffer: Any = None, wgrad_deferral_limit: Any = None,
                  async_grad_allreduce: bool = False) -> torch.Tensor:
        # async_grad_allreduce: megatron-core < 0.10's name for allreduce_dgrad (NeMo 2.0).
        unsupported = {"gradient_accumulation_fusion": gradient_accumulation_fusion,
                       "sequence_parallel": sequence_parallel,
                       "tensor_model_parallel_size > 1 (allreduce_dgrad)":
                           allreduce_dgrad or async_grad_allreduce,
                       "defer_embedding_wgrad_compute": grad_output_buffer is not None}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"{type(self).__name__} (reference FP8 GEMM, CPU runs only) does not "
                             f"support {', '.join(bad)}: set model.gradient_accumulation_fusion="
                             "False, model.sequence_parallel=False, "
                             "model.tensor_model_parallel_size=1")
        if weight is not self.weight:  # type: ignore[attr-defined]
            raise ValueError(f"{type(self).__name__}: a weight passed to forward() has no FP8 copy")
        fp8 = self.fp8_weight
        if torch.is_grad_enabled() and not fp8.transpose_valid:
            self.fp8_backend.build_transposes([fp8])  # lazy: at first use, as TE does
        elif not fp8.data_valid:
            fp8.quantize()  # a forward-only pass needs no transpose
        out = _FP8LinearFn.apply(input, weight, fp8, self.fp8_backend.check_provenance)
        return out + bias if bias is not None else out


class ReferenceFP8ColumnParallelLinear(_ReferenceFP8GEMM, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM reads a reference FP8 weight."""

    def __init__(self, *args: Any, check_provenance: bool = True, **kwargs: Any) -> None:
        ColumnParallelLinear.__init__(self, *args, **kwargs)
        self._init_fp8(check_provenance)


class ReferenceFP8RowParallelLinear(_ReferenceFP8GEMM, RowParallelLinear):
    """``RowParallelLinear`` whose GEMM reads a reference FP8 weight."""

    def __init__(self, *args: Any, check_provenance: bool = True, **kwargs: Any) -> None:
        RowParallelLinear.__init__(self, *args, **kwargs)
        self._init_fp8(check_provenance)


def with_reference_fp8_linears(spec: Any, *, check_provenance: bool = True) -> Any:
    """A copy of a megatron-core layer spec whose ``ColumnParallelLinear`` and
    ``RowParallelLinear`` entries are the reference-FP8 subclasses (where TE's FP8 linears sit in
    the TE spec: the transformer layers' GEMMs; embeddings and the output layer stay).
    ``check_provenance=False`` (fault-injection runs only) lets a stale FP8 copy through, to
    show that the loss comparison alone catches it."""
    for plain, fp8 in ((ColumnParallelLinear, ReferenceFP8ColumnParallelLinear),
                       (RowParallelLinear, ReferenceFP8RowParallelLinear)):
        if spec is plain:
            return ModuleSpec(module=fp8, params={"check_provenance": check_provenance})
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_reference_fp8_linears(
            spec.submodules, check_provenance=check_provenance))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{
            f.name: with_reference_fp8_linears(getattr(spec, f.name),
                                               check_provenance=check_provenance)
            for f in dataclasses.fields(spec) if f.init})
    return spec


def invalidate_reference_fp8_weights(modules: Iterable[torch.nn.Module]) -> int:
    """Mark every reference FP8 copy in ``modules`` stale (the optimizer changed the weights);
    returns how many."""
    from nemo_fp8_align.integrations.nemo.build import reference_weights_of

    weights = [w for module in modules for w in reference_weights_of(module)]
    for weight in weights:
        weight.invalidate()
    return len(weights)
