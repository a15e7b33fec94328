"""NeMo 2.3.3 ``MegatronGPTModel`` on the CPU over gloo: for tests and the CPU smoke run ONLY.

NeMo's 1.x GPT path assumes NVIDIA's GPU stack (apex, Transformer Engine, CUDA) in places that
have nothing to do with what this project checks (which schedule slot builds which transposes).
:func:`enable_nemo_cpu_compat` patches exactly those places, each with the reason next to it,
on top of megatron-core's own CPU redirections (:mod:`lab.demo.cpu_redirects`). It refuses
to run where CUDA is available: on a GPU nothing here may change behaviour. Nothing in the
plugin imports this module; the example calls it only for ``trainer.accelerator=cpu``.

Verified with nemo_toolkit 2.3.3, megatron-core 0.12.3, lightning 2.4.0, torch 2.13 (CPU build).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["enable_nemo_cpu_compat", "NemoCpuCompat"]

_ACTIVE: Optional["NemoCpuCompat"] = None


class _NoApexClass:
    """Stands in for an apex class in an ``isinstance`` check: nothing is an instance of it."""


class NemoCpuCompat:
    """Handle of the active NeMo patches; :meth:`undo` restores them (idempotent)."""

    def __init__(self, *, reference_fp8: bool = True, check_provenance: bool = True) -> None:
        #: The local layer spec's linears compute through reference FP8 weights
        #: (:mod:`support.reference_fp8_layers`), standing in for TE's FP8 Linear.
        self.reference_fp8 = reference_fp8
        #: Their GEMMs check that the FP8 copy they read was built from the current bytes.
        self.check_provenance = check_provenance
        self._patches: List[Tuple[Any, str, Any]] = []
        self._env_set: List[str] = []
        self._mcore_compat: Any = None

    # ------------------------------------------------------------------ helpers
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name, None)))
        setattr(owner, name, value)

    def _patch_init_with_flag(self, cls: Any, module: Any, flag: str) -> None:
        """Run ``cls.__init__`` with ``module.<flag>`` set True, restoring it afterwards: an
        availability check in a constructor, skipped for that constructor only."""
        original_init = cls.__init__

        def init_with_flag(obj: Any, *args: Any, **kwargs: Any) -> None:
            saved = getattr(module, flag)
            setattr(module, flag, True)
            try:
                original_init(obj, *args, **kwargs)
            finally:
                setattr(module, flag, saved)

        self._patch(cls, "__init__", init_with_flag)

    @staticmethod
    def _module(name: str) -> Any:
        return importlib.import_module(name)

    # ------------------------------------------------------------------ the patches
    def apply(self) -> "NemoCpuCompat":
        # Why: NeMo reads NVIDIA_PYTORCH_VERSION (set in NGC containers) and calls re.fullmatch
        # on it unguarded; outside a container it is unset and MegatronBaseModel.__init__ raises
        # TypeError. Any value that is not "YY.MM" takes NeMo's "dev container" branch.
        if "NVIDIA_PYTORCH_VERSION" not in os.environ:
            os.environ["NVIDIA_PYTORCH_VERSION"] = "cpu"
            self._env_set.append("NVIDIA_PYTORCH_VERSION")

        # Why: megatron-core's CUDA-only calls (current_device, synchronize, .cuda(), device=
        # "cuda" literals, Tensor.type() strings): the shared CPU redirections. They also turn
        # NeMo's own hard-coded ``.cuda()`` calls (loss tensors in fwd_bwd_step, batches in
        # get_batch) into no-ops.
        from lab.demo.cpu_redirects import enable_cpu_compat

        self._mcore_compat = enable_cpu_compat()

        self._patch_apex_checks()
        self._patch_bert_model_list()
        self._patch_layer_spec()
        self._patch_cuda_streams_and_rng()
        self._patch_null_tokenizer()
        if self.reference_fp8:
            self._patch_optimizer_step_invalidates_fp8()
        return self

    def _patch_apex_checks(self) -> None:
        nlp_overrides = self._module("nemo.collections.nlp.parts.nlp_overrides")
        # Why: NLPDDPStrategy.__init__ raises ImportError when apex is missing, although the
        # mcore_distributed_optim path never calls apex. Pretend apex is there for that one
        # check only (HAVE_APEX guards real apex calls elsewhere in the module).
        self._patch_init_with_flag(nlp_overrides.NLPDDPStrategy, nlp_overrides, "HAVE_APEX")
        # Why: the same module imports apex's MegatronDistributedFusedAdam and, after it,
        # McoreDistributedOptimizer (which needs no apex) in one try block, so without apex
        # neither name exists and a checkpoint save or load (optimizer_sharded_state_dict's
        # isinstance checks) raises NameError. Bind the megatron-core one; nothing is an
        # instance of the apex one.
        if getattr(nlp_overrides, "McoreDistributedOptimizer", None) is None:  # None: undone
            from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

            self._patch(nlp_overrides, "McoreDistributedOptimizer", McoreDistributedOptimizer)
            self._patch(nlp_overrides, "MegatronDistributedFusedAdam", _NoApexClass)

        # Why: NeMo's distributed checkpoints (the smoke run's save/resume pair) fail three ways
        # in this environment (no tensorstore, no apex/TE, torch 2.13 with megatron-core
        # 0.12.3); each fix and its reason: support.dist_checkpoint.
        from support.dist_checkpoint import patch_dist_checkpointing

        patch_dist_checkpointing(self._patch)

        # Why: build_model() tags every parameter with apex's
        # set_defaults_if_not_set_tensor_model_parallel_attributes, imported from apex only;
        # megatron-core ships the same-named helper.
        build_model = self._module("nemo.collections.nlp.modules.common.megatron.build_model")
        if not getattr(build_model, "HAVE_APEX", True):
            from megatron.core.tensor_parallel import layers as mcore_layers

            self._patch(build_model, "set_defaults_if_not_set_tensor_model_parallel_attributes",
                        mcore_layers.set_defaults_if_not_set_tensor_model_parallel_attributes)

        # Why: megatron.utils' weight-decay grouping uses apex's listify_model and isinstance
        # checks against apex's fused layer norms; without apex those names are undefined.
        utils = self._module("nemo.collections.nlp.modules.common.megatron.utils")
        if not getattr(utils, "HAVE_APEX", True):
            self._patch(utils, "listify_model", lambda m: list(m) if isinstance(m, list) else [m])
            for name in ("FusedLayerNorm", "FastLayerNorm", "MixedFusedRMSNorm"):
                self._patch(utils, name, _NoApexClass)

    def _patch_bert_model_list(self) -> None:
        # Why: NLPModel.__init__ lists NeMo's pretrained BERT models by importing
        # megatron_bert_model, whose bert_spec.py (2.3.3) imports Transformer Engine and, when
        # that fails, assigns the undefined name ApexGuardDefaults: NameError for every NLP
        # model without TE. A GPT pretraining config names no pretrained BERT model, so the
        # list only needs to be empty.
        nlp_model = self._module("nemo.collections.nlp.models.nlp_model")
        try:
            nlp_model.get_megatron_pretrained_bert_models()
        except NameError:
            self._patch(nlp_model, "get_megatron_pretrained_bert_models", lambda: [])

    def _patch_layer_spec(self) -> None:
        gpt = self._module("nemo.collections.nlp.models.language_modeling.megatron_gpt_model")
        original_get_specs = gpt.get_specs

        # Why: get_specs() builds every spec of its table eagerly, including the Transformer
        # Engine ones, which fail without TE even when the local spec is asked for. With
        # transformer_engine=False and the default spec name, return megatron-core's local
        # (torch) layer spec directly; anything else goes to NeMo unchanged.
        def get_specs(spec_name: str, transformer_config: Any = None, use_te: bool = True,
                      hyena_cfg: Any = None, fp8: bool = False) -> Any:
            if spec_name == "" and not use_te:
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

                num_experts = getattr(transformer_config, "num_moe_experts", None)
                grouped = getattr(transformer_config, "moe_grouped_gemm", False)
                spec = get_gpt_layer_local_spec(num_experts, grouped)
                if self.reference_fp8:
                    # No TE FP8 Linear on the CPU: its stand-in, so the transformer layers'
                    # GEMMs read FP8 weights and their cached transposes.
                    spec = self._reference_fp8_spec(spec)
                return spec
            return original_get_specs(spec_name, transformer_config, use_te, hyena_cfg, fp8)

        self._patch(gpt, "get_specs", get_specs)

    def _reference_fp8_spec(self, spec: Any) -> Any:
        from support.reference_fp8_layers import with_reference_fp8_linears

        return with_reference_fp8_linears(spec, check_provenance=self.check_provenance)

    def _patch_optimizer_step_invalidates_fp8(self) -> None:
        from support.reference_fp8_layers import invalidate_reference_fp8_weights

        base = self._module("nemo.collections.nlp.models.language_modeling.megatron_base_model")
        original_step = base.MegatronBaseModel.optimizer_step

        # Why: the training loop owns the FP8 caches' validity, as with TE (whose FP8 weights
        # are rewritten after the optimizer step and their transposes dropped). After the step
        # the reference FP8 copies are stale whether or not the plugin is attached; the next
        # build (the plugin's slot, or first use) recasts them from the all-gathered bytes.
        def optimizer_step(model: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_step(model, *args, **kwargs)
            chunks = model.model if isinstance(model.model, list) else [model.model]
            invalidate_reference_fp8_weights(chunks)
            return out

        self._patch(base.MegatronBaseModel, "optimizer_step", optimizer_step)

    def _patch_null_tokenizer(self) -> None:
        base = self._module("nemo.collections.nlp.models.language_modeling.megatron_base_model")
        original_build = base.MegatronBaseModel._build_tokenizer

        # Why: mock data needs only synthetic ids, which NeMo's NullTokenizer provides, but
        # NeMo 2.3.3's _build_tokenizer cannot build it (get_nmt_tokenizer never gets a
        # vocab_size). Build it from model.tokenizer.vocab_size; other libraries go to NeMo.
        def build_tokenizer(model: Any) -> None:
            if model._cfg.tokenizer.library != "null":
                return original_build(model)
            try:
                from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
            except ModuleNotFoundError:  # NeMo < 2.3 (2.0-2.2 are smoke-run by hand)
                NullTokenizer = _SyntheticIds
            model.tokenizer = NullTokenizer(model._cfg.tokenizer.vocab_size)
            return None

        self._patch(base.MegatronBaseModel, "_build_tokenizer", build_tokenizer)

    def _patch_cuda_streams_and_rng(self) -> None:
        base = self._module("nemo.collections.nlp.models.language_modeling.megatron_base_model")

        # Why: setup_transformer_engine_cp_groups() creates a torch.cuda.Stream() for TE's
        # context parallelism whenever mcore_gpt is set, even with no TE module to receive it.
        # There is no CUDA stream on the CPU and no TE module: skip it.
        self._patch(base.MegatronBaseModel, "setup_transformer_engine_cp_groups",
                    lambda model: None)

        # Why: megatron-core's CUDA RNG tracker forks the CUDA RNG state (torch.cuda.get/
        # set_rng_state) around dropout and weight init in tensor-parallel regions. On the CPU
        # there is no CUDA generator; fork the CPU generator instead, and run unforked when no
        # state was added (NeMo's seeding skips the tracker without CUDA devices). Dropout is 0
        # in the smoke config and init runs under use_cpu_initialization, so no number depends
        # on it.
        from megatron.core.tensor_parallel import random as mcore_random

        tracker_cls = mcore_random.CudaRNGStatesTracker

        def add(tracker: Any, name: str, seed: int) -> None:
            tracker.states_[name] = torch.Generator().manual_seed(seed).get_state()
            tracker.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(tracker: Any, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in tracker.states_:
                # NeMo seeds the tracker only when torch.cuda.device_count() > 0: on the CPU
                # no state was ever added, and there is nothing to fork from.
                yield
                return
            saved = torch.get_rng_state()
            torch.set_rng_state(tracker.states_[name])
            try:
                yield
            finally:
                tracker.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

        self._patch(tracker_cls, "add", add)
        self._patch(tracker_cls, "fork", fork)

    # ------------------------------------------------------------------ undo
    def undo(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        for name in self._env_set:
            os.environ.pop(name, None)
        self._env_set.clear()
        if self._mcore_compat is not None:
            self._mcore_compat.undo()
            self._mcore_compat = None
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None


def enable_nemo_cpu_compat(*, reference_fp8: bool = True,
                           check_provenance: bool = True) -> NemoCpuCompat:
    """Patch NeMo 2.3.3's GPT path to run on the CPU in this process (idempotent).

    ``reference_fp8``: the transformer layers' linears compute through reference FP8 weights
    (:mod:`support.reference_fp8_layers`), invalidated after each optimizer step;
    ``check_provenance``: their GEMMs raise on an FP8 copy built from other bytes than the
    current ones. Refuses on a machine with CUDA. Returns the handle; ``undo()`` restores
    everything.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        raise RuntimeError(
            "support.cpu_nemo patches NeMo for CPU-only tests and the CPU smoke run "
            "and refuses to run on a machine with a GPU: drop trainer.accelerator=cpu there.")
    if _ACTIVE is None:
        _ACTIVE = NemoCpuCompat(reference_fp8=reference_fp8,
                                check_provenance=check_provenance).apply()
    return _ACTIVE


class _SyntheticIds:
    """Mock data's tokenizer where NeMo has no NullTokenizer (before 2.3): synthetic ids only,
    ``vocab_size`` ids plus one end-of-document id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size) + 1
        self.eod = self.eos_id = int(vocab_size)
        self.pad_id = self.bos_id = -1
        # megatron-core's datasets describe their tokenizer by this (json in their cache key).
        self.unique_identifiers = {"class": "_SyntheticIds", "vocab_size": self.vocab_size}
