"""A small GPT-like model cut into pipeline chunks, its linears computing through FP8 weights.

Each chunk is one virtual pipeline stage: ``layers_per_chunk`` pre-norm transformer blocks
(causal attention + GELU MLP), the token/position embedding on the first stage and the final
norm, LM head and loss on the last. Activations are ``[seq, batch, hidden]``, as megatron-core's
pipeline communication expects. Every block linear is a
:class:`~nemo_fp8_align.backends.reference_linear.ReferenceFP8Linear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight
from nemo_fp8_align.backends.reference_blocks import REFERENCE_WEIGHTS
from nemo_fp8_align.backends.reference_linear import ReferenceFP8Linear

__all__ = ["DemoModelConfig", "GPTChunk"]


@dataclass(frozen=True)
class DemoModelConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_heads: int = 4
    seq_length: int = 16
    layers_per_chunk: int = 1
    seed: int = 1234
    #: ``demo --recipe``: which reference weight the linears use
    #: (:data:`~nemo_fp8_align.backends.reference_blocks.REFERENCE_WEIGHTS`).
    recipe: str = "delayed"


class _Block(torch.nn.Module):
    def __init__(self, cfg: DemoModelConfig, backend: ReferenceBackend, name: str) -> None:
        super().__init__()
        h, w = cfg.hidden_size, REFERENCE_WEIGHTS[cfg.recipe]
        self.num_heads = cfg.num_heads
        self.norm1 = torch.nn.LayerNorm(h)
        self.qkv = ReferenceFP8Linear(h, 3 * h, backend=backend, name=f"{name}.qkv", weight_cls=w)
        self.proj = ReferenceFP8Linear(h, h, backend=backend, name=f"{name}.proj",
                                       init_std=0.02 / math.sqrt(2), weight_cls=w)
        self.norm2 = torch.nn.LayerNorm(h)
        self.fc1 = ReferenceFP8Linear(h, 4 * h, backend=backend, name=f"{name}.fc1", weight_cls=w)
        self.fc2 = ReferenceFP8Linear(4 * h, h, backend=backend, name=f"{name}.fc2",
                                      init_std=0.02 / math.sqrt(2), weight_cls=w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        # [s, b, h] -> [b, heads, s, head_dim]
        q, k, v = (t.reshape(s, b, self.num_heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPTChunk(torch.nn.Module):
    """One virtual pipeline stage of the demo GPT.

    ``config`` is megatron-core's ``TransformerConfig``: the schedule and DDP read it from the
    model. ``share_embeddings_and_output_weights`` is False (untied head), which
    megatron-core's gradient finalisation looks up on the model; ``model_type`` is read by the
    schedule.
    """

    share_embeddings_and_output_weights = False

    @property
    def model_type(self) -> Any:
        from megatron.core.enums import ModelType  # only the schedule asks; keeps torch-only use

        return ModelType.encoder_or_decoder

    @model_type.setter
    def model_type(self, value: Any) -> None:
        pass  # Megatron-LM's get_model sets it on every chunk; the demo GPT has the one type

    def __init__(self, cfg: DemoModelConfig, *, config: Any, stage: int, vp_stage: int,
                 pre_process: bool, post_process: bool, backend: ReferenceBackend) -> None:
        super().__init__()
        self.config = config
        self.vp_stage = vp_stage  # megatron-core 0.16's schedule checks it against its own
        self.pre_process, self.post_process = pre_process, post_process
        # Seed per virtual stage: the same weights whatever PP x VP cut produced this stage.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 1000 * stage)
            if pre_process:
                self.embedding = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
                self.position = torch.nn.Embedding(cfg.seq_length, cfg.hidden_size)
            self.layers = torch.nn.ModuleList(
                _Block(cfg, backend, f"stage{stage}.layer{i}") for i in range(cfg.layers_per_chunk))
            if post_process:
                self.final_norm = torch.nn.LayerNorm(cfg.hidden_size)
                self.head = ReferenceFP8Linear(cfg.hidden_size, cfg.vocab_size, backend=backend,
                                               name=f"stage{stage}.head",
                                               weight_cls=REFERENCE_WEIGHTS[cfg.recipe])
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Called by megatron-core's schedule with the activation received from upstream."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Any:
        """What Megatron-LM's checkpointing saves (``--ckpt-format torch``): the state dict."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def fp8_weights(self) -> List[ReferenceFP8Weight]:
        return [m.fp8_weight for m in self.modules() if isinstance(m, ReferenceFP8Linear)]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.pre_process:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = (self.embedding(tokens) + self.position(positions)).transpose(0, 1).contiguous()
        else:
            x = self.input_tensor
        for layer in self.layers:
            x = layer(x)
        if not self.post_process:
            return x.contiguous()  # sent as is to the next stage
        logits = self.head(self.final_norm(x))  # [s, b, vocab]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               labels.transpose(0, 1).reshape(-1), reduction="none")
        return loss.reshape(labels.shape[1], labels.shape[0]).transpose(0, 1)  # [b, s]
