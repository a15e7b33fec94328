"""Startup-check rules on the model NeMo builds: megatron-core's GPT model, attention heads against
TP, the shared-embedding bucket bug of megatron-core 0.12.3, CUDA graphs, and the plugin block
the entry-point callback needs. One function per rule, ``rule(ctx) -> None``; and the gate
that names a config of another model (T5, BERT, NeMo's Mamba, RETRO, Griffin) alone
(:func:`other_model_refused`).
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED, Violation
from nemo_fp8_align.config_check.rules.fp8 import APEX_OPTIM, MCORE_OPTIM
from nemo_fp8_align.config_check.rules.split import divisors
from nemo_fp8_align.config_check.structured import BLOCK_KEY

__all__ = ["BERT_WHY", "ENCODER_DECODER_WHY", "GRIFFIN_WHY", "MAMBA_WHY", "RETRO_WHY",
           "other_model_refused",
           "rule_attention_heads", "rule_cuda_graph", "rule_mcore_gpt", "rule_plugin_block",
           "rule_shared_embedding_bucket"]

#: Why an encoder-decoder (T5, BART, UL2) model is refused, in both modes.
ENCODER_DECODER_WHY = ("a GPT (decoder-only) model: the plugin drives megatron-core's GPT model "
                       "and its interleaved pipeline schedule; an encoder-decoder model (T5, "
                       "BART) is not supported by this plugin")
#: ...a NeMo (megatron-core 0.12.3) Mamba hybrid model: no VP there, which the plugin needs.
MAMBA_WHY = ("megatron-core's GPT model: the plugin needs VP >= 2, and megatron-core 0.12.3's "
             "MambaStack asserts 'The Mamba hybrid model does not currently support "
             "virtual/interleaved pipeline parallelism'; not supported by this plugin in NeMo "
             "mode (Megatron-LM mode reads hybrid layer patterns on megatron-core 0.19)")
#: ...a BERT model: NeMo's MegatronBertModel, not the MegatronGPTModel the plugin wires into.
BERT_WHY = ("a GPT model: the plugin wires into NeMo's MegatronGPTModel (its training step "
            "and megatron-core's GPT model chunks); a BERT model (MegatronBertModel) is not "
            "supported by this plugin")

#: ...a RETRO model: NeMo's MegatronRetroModel builds megatron-core's RETRO decoder.
RETRO_WHY = ("megatron-core's GPT model with a pipeline: megatron-core's RETRO decoder "
             "(get_retro_decoder_block_spec) asserts 'retro does not currently support "
             "pipeline parallelism' and the same of virtual pipeline parallelism, and the "
             "plugin needs PP >= 2 and VP >= 2; a RETRO model is not supported by this plugin")
#: ...a Griffin model: NeMo's MegatronGriffinModel builds its GriffinModel with no stage ends.
GRIFFIN_WHY = ("megatron-core's GPT model with a pipeline: NeMo's MegatronGriffinModel builds "
               "its GriffinModel without pre_process / post_process, so every pipeline stage "
               "would build the embedding and the output layer and no pipeline can run, and "
               "the plugin needs PP >= 2; a Griffin model is not supported by this plugin")

#: megatron-core 0.12.3 pads bucket ends to a multiple of lcm(DP, 128) values.
_BUCKET_PAD = 128


def rule_plugin_block(ctx: CheckContext) -> None:
    """Without ``model.fp8_transpose_align`` the package's entry-point callback (the stock
    training script, the launcher) stays inert: the plugin would not run. Only where the caller
    asks (the command line, unless ``--mixin``): a model with the mixin runs without it."""
    if ctx.require_block and ctx.model.get(BLOCK_KEY) is ABSENT:
        ctx.model.add(BLOCK_KEY, ABSENT, "the plugin block: without it the entry-point callback "
                      "stays inert and the plugin does not run (a model class with "
                      "FP8TransposeAlignMixin runs without it: pass --mixin)",
                      fix=f"+{ctx.model.prefix}{BLOCK_KEY}.policy=aligned")


def _other_model(ctx: CheckContext) -> Optional[Tuple[List[str], str, str]]:
    """(the keys that show it, what model it is, why it is refused) for a NeMo config of a
    model other than megatron-core's GPT model; None for a GPT config (Megatron-LM's arguments:
    megatron_lm_refusals.encoder_decoder; a hybrid pattern is read there, on megatron-core 0.19)."""
    if not ctx.nemo:
        return None
    node = ctx.model.node
    blocks = [k for k in ("encoder", "decoder") if isinstance(node.get(k), Mapping)]
    if blocks or "mcore_t5" in node:
        # NeMo's Megatron T5 / BART / UL2 (MegatronLMEncoderDecoderModel)
        return blocks or ["mcore_t5"], "an encoder-decoder model", ENCODER_DECODER_WHY
    mamba = [k for k in ("hybrid_override_pattern", "mamba_ssm_ngroups") if k in node]
    if mamba:
        # NeMo's MegatronMambaModel builds megatron-core's MambaModel
        return mamba, "a Mamba hybrid model", MAMBA_WHY
    if "bert_binary_head" in node or "mcore_bert" in node:
        return (["bert_binary_head" if "bert_binary_head" in node else "mcore_bert"],
                "a BERT model", BERT_WHY)
    if isinstance(node.get("retro"), Mapping):
        # NeMo's MegatronRetroModel reads cfg.retro (retro_project_dir, the encoder's layers)
        return ["retro"], "a RETRO model", RETRO_WHY
    griffin = [k for k in ("logits_soft_cap", "activations_checkpoint_recurrent") if k in node]
    if griffin:
        # keys only MegatronGriffinModel reads among NeMo's configs (Mamba's recurrent
        # checkpointing key is told above, by its pattern)
        return griffin, "a Griffin model", GRIFFIN_WHY
    return None


def other_model_refused(ctx: CheckContext) -> bool:
    """A NeMo config of a model the plugin does not drive (T5 / BART, BERT, Mamba, RETRO,
    Griffin) is named
    once, and no other rule runs: their fixes (``mcore_gpt`` for ``mcore_t5``, a
    ``model.num_layers`` T5 does not read, a VP that megatron-core's MambaStack asserts
    against) would rewrite it into a broken GPT config. True when refused."""
    found = _other_model(ctx)
    if found is None:
        return False
    keys, what, why = found
    keys = [ctx.model.prefix + k for k in keys]
    # found is said in words (not a value shown as a string): the keys are the evidence
    ctx.model.violations.append(Violation(
        keys[0], f"{what} (" + " and ".join(keys) + ")", why,
        "none: train without the plugin (turn it off)"))
    return True


def rule_mcore_gpt(ctx: CheckContext) -> None:
    """NeMo 2.3.3 builds megatron-core's GPTModel only with ``mcore_gpt`` (default False when
    absent); the plugin hooks megatron-core's model chunks and DDP."""
    ctx.model.require_true("mcore_gpt", "the plugin drives megatron-core's GPT model; NeMo "
                           "2.3.3 reads cfg.get('mcore_gpt', False) and otherwise builds its "
                           "legacy model")


def rule_attention_heads(ctx: CheckContext) -> None:
    """megatron-core's TransformerConfig raises unless TP divides num_attention_heads and
    num_query_groups (null: the head count). The fix is the nearest TP dividing both that still
    divides the world size with PP * CP (heads and groups are the model's)."""
    tp = ctx.tp()
    heads = ctx.model.get("num_attention_heads")
    groups = ctx.model.get("num_query_groups")
    if tp is None or not (type(heads) is int and heads >= 1):
        return
    groups = heads if groups is ABSENT or groups is None else groups
    if not (type(groups) is int and groups >= 1) or (heads % tp == 0 and groups % tp == 0):
        return
    key, count = (("num_attention_heads", heads) if heads % tp else ("num_query_groups", groups))
    fix = _tensor_parallel_fix(ctx, heads, groups)
    why = (f"tensor_model_parallel_size (TP) = {tp} to divide {key} = {count} (megatron-core "
           f"raises '{key} ({count}) must be a multiple of tensor_model_parallel_size ({tp})')")
    if fix is None:
        why += "; no TP divides both the heads and the query groups and fits the world size"
    ctx.model.add("tensor_model_parallel_size", tp, why, fix if fix is not None else 1)


def _tensor_parallel_fix(ctx: CheckContext, heads: int, groups: int) -> Optional[int]:
    tp, world, pp, cp = ctx.tp(), ctx.world(), ctx.pp(), ctx.cp()
    fits: List[int] = [d for d in divisors(groups) if heads % d == 0]
    if world is not None and pp is not None and cp is not None:
        fits = [d for d in fits if world % (d * pp * cp) == 0]
    return min(fits, key=lambda d: (abs(d - tp), -d)) if fits else None


def rule_shared_embedding_bucket(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 with its distributed optimizer gives the tied embedding (PP > 1) a
    bucket of its own, but pads the bucket before it to lcm(DP, 128) only when the running
    offset is not a multiple of DP, without moving the weight's start: with an offset that is a
    multiple of DP but not of lcm(DP, 128) the weight lies in two buckets. With DP == 1 the
    plugin hides the flag while the buffers are built; with DP > 1 it raises
    SharedEmbeddingBucketError at build. Offsets stay multiples of 128 when the hidden and FFN
    sizes are (and never matter when DP is a multiple of 128)."""
    if ctx.model.get("optim.name") != MCORE_OPTIM:
        return  # Apex's distributed Adam does not use megatron-core's buckets
    tied = ctx.model.get("share_embeddings_and_output_weights")
    pp, dp = ctx.pp(), ctx.data_parallel()
    if tied is False or tied is UNRESOLVED or pp is None or pp < 2 or dp is None or dp == 1:
        return
    if dp % _BUCKET_PAD == 0:
        return
    sizes = {key: ctx.model.get(key) for key in ("hidden_size", "ffn_hidden_size")}
    odd = {k: v for k, v in sizes.items() if type(v) is int and v % _BUCKET_PAD}
    if not odd:
        return
    named = ", ".join(f"{k} = {v}" for k, v in odd.items())
    why = (f"hidden_size and ffn_hidden_size multiples of 128 with tied embeddings "
           f"(share_embeddings_and_output_weights), PP = {pp}, DP = {dp} and "
           f"optim.name={MCORE_OPTIM}: found {named}, and megatron-core 0.12.3 can then place "
           "the shared embedding in two buckets (the plugin raises SharedEmbeddingBucketError "
           "at build). No layout change avoids it (a DP of 1 or a multiple of 128 would change "
           "the node count)")
    experts = (ctx.ep() or 1) > 1
    recipe = ctx.model.get("fp8_recipe")
    if not experts and recipe != "tensorwise":
        ctx.model.add("optim.name", MCORE_OPTIM, f"{why}; the fix uses Apex's distributed Adam "
                      "(no megatron-core buckets) instead", APEX_OPTIM)
        return
    ctx.model.add("share_embeddings_and_output_weights", tied, f"{why}; the fix unties the "
                  "output layer from the embedding, which changes the model (vocab * hidden "
                  "more parameters)", False)


def rule_cuda_graph(ctx: CheckContext) -> None:
    """``enable_cuda_graph``: NeMo 2.3.3 asserts use_te_rng_tracker; megatron-core 0.12.3 raises
    with activation recomputation or CPU offloading. (Per-layer graphs keep the chunks' hooks
    outside the graphs; NeMo's own graph machinery was not run with the plugin: the command line
    says so on its OK line.)"""
    if ctx.model.get("enable_cuda_graph") is not True:
        return
    ctx.model.require_true("use_te_rng_tracker", "NeMo 2.3.3 asserts it with enable_cuda_graph "
                           "('Transformer engine's RNG tracker is required for cudagraphs')")
    recompute = ctx.model.get("activations_checkpoint_granularity")
    if recompute not in (ABSENT, None, UNRESOLVED):
        ctx.model.add("activations_checkpoint_granularity", recompute, "null with "
                      "enable_cuda_graph (megatron-core raises 'CUDA graphs not supported with "
                      "activation recomputation')", None)
    if ctx.model.get("cpu_offloading") is True:
        ctx.model.add("cpu_offloading", True, "False with enable_cuda_graph (megatron-core "
                      "raises 'CUDA graphs not supported with CPU offloading')", False)
