"""From a model, a parallel layout and a GPU to the per-chunk durations the timeline needs.

Defaults are calibrated from this project's own H200 measurements (``benchmarks/results/``)
where one exists, and say "assumed" where none does:

* compute: 470 TFLOP/s achieved over forward+backward, the rate of the reference FP8 chunk
  (2 layers, hidden 4096, seq 2048, micro-batch 2: 10.1 TFLOP in 21.6 ms,
  ``chunk_transpose_cost_h200.md``); the FP8 GEMMs alone reach 1.2-1.45 PFLOP/s;
* transposes: 3.46 TB/s (read + write), Transformer Engine 2.20.2's own transpose on the H200;
* overlap penalty: 1.31, from the H200 probe (453 MB of GPT-3-175B TP8 weights beside FP8
  forward GEMMs at 2048 tokens: sequential 1738 us, side stream 1842 us, transposes 339 us:
  (1842 - (1738 - 339)) / 339);
* data-parallel all-gather and pipeline p2p: 40 GB/s per GPU, *assumed* (a 400 Gb/s NIC);
* blockwise columnwise copies on the H200: 3.19 TB/s (TE 2.20.2, 2026-12-05); the H100, B200 and GB200
  rates are the H200's scaled by datasheet peaks, *assumed* (each profile says so).

Context parallelism (CP) splits each sequence over CP ranks: compute, attention and activations
per GPU shrink by CP, the weights do not; the distributed optimizer shards (and all-gathers) the
dense weights over DP x CP ranks. Mixture of experts: each GPU holds experts / EP experts, each
split over expert TP (ETP); their FP8 weights are transposed like the dense ones and
all-gathered over the expert data-parallel group, TP x CP x DP / (EP x ETP) ranks; routing is
assumed balanced (each token's top-k experts cost top-k dense MLPs, spread like the dense layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from nemo_fp8_align.errors import PlanInputError
from nemo_fp8_align.planner.post_processing import PostProcessing, post_processing
from nemo_fp8_align.planner.timeline import Costs

__all__ = ["ModelShape", "GpuProfile", "Layout", "MODELS", "GPUS", "chunk_costs", "PlanInputError",
           "OVERLAP_PENALTY_H200"]

OVERLAP_PENALTY_H200 = (1842.0 - (1738.0 - 339.0)) / 339.0
PER_TENSOR_TRANSPOSE = post_processing("delayed", "h200", True)[0]


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated_mlp: bool
    seq: int
    experts: int = 0  #: MoE experts per layer (0: a dense MLP)
    topk: int = 2  #: experts each token is routed to
    moe_ffn: Optional[int] = None  #: an expert's MLP hidden size (default: ffn)

    def attention_weights(self) -> int:
        head_dim = self.hidden // self.heads
        return self.hidden * (self.hidden + 2 * self.kv_heads * head_dim) + self.hidden ** 2

    def mlp_weights(self) -> int:
        """One MLP's (one expert's) weights."""
        ffn = self.moe_ffn if self.experts and self.moe_ffn else self.ffn
        return (3 if self.gated_mlp else 2) * self.hidden * ffn


#: Public architecture numbers (GPT-3 paper; Llama 2 / Llama 3 model cards).
MODELS: Dict[str, ModelShape] = {
    "gpt3-175b": ModelShape(96, 12288, 96, 96, 49152, False, 2048),
    "llama2-70b": ModelShape(80, 8192, 64, 8, 28672, True, 4096),
    "llama3-70b": ModelShape(80, 8192, 64, 8, 28672, True, 8192),
    "llama3-405b": ModelShape(126, 16384, 128, 8, 53248, True, 8192),
}


@dataclass(frozen=True)
class GpuProfile:
    name: str
    tflops: float  #: achieved forward+backward model TFLOP/s
    transpose_tbps: float  #: per-tensor FP8 transpose, (read + write) TB/s
    needs_transpose: Tuple[bool, str]  #: whether per-tensor FP8 GEMMs need the TN layout, why
    source: str  #: where tflops and transpose_tbps come from
    #: other post-all-gather kinds (support.py): kind -> (read + write TB/s, where it comes from)
    rates: Tuple[Tuple[str, float, str], ...] = ()

    def rate(self, kind: str) -> Tuple[float, str]:
        """(TB/s, source) of a post-all-gather kind on this GPU."""
        if kind == "transpose":
            return self.transpose_tbps, self.source
        return next(((tbps, src) for k, tbps, src in self.rates if k == kind), (0.0, "-"))


_HOPPER = (True, "Hopper FP8 GEMMs take only the TN layout: the backward dgrad GEMM needs a "
                 "transposed copy of every FP8 weight")
_BLACKWELL = (False, "datacenter Blackwell (sm_100) FP8 GEMMs accept non-TN layouts: no "
                     "transpose is built")
#: H200, TE 2.20.2 (2026-12-05): 303 MB of blockwise weights' columnwise copies in 0.190 ms.
_COLUMNWISE_H200 = 303e6 * (2 + 8 / 16384) / 0.190e-3 / 1e12
#: Vendor datasheet figures (dense FP8 TFLOP/s, HBM TB/s) used to scale the H200 measurements.
_PEAK = {"h100": (1979.0, 3.35), "h200": (1979.0, 4.8), "b200": (4500.0, 8.0),
         "gb200": (5000.0, 8.0)}


def _scaled(gpu: str) -> GpuProfile:
    """A GPU not measured here: the H200's achieved compute and memory rates, scaled by the
    datasheet peaks (assumed)."""
    flops, hbm = _PEAK[gpu][0] / _PEAK["h200"][0], _PEAK[gpu][1] / _PEAK["h200"][1]
    why = (f"assumed: the H200's measured rates scaled by {gpu.upper()}/H200 datasheet peaks "
           f"(HBM {_PEAK[gpu][1]:g}/4.8 TB/s, dense FP8 {_PEAK[gpu][0]:g}/1979 TFLOP/s); not "
           "measured")
    rates = (("columnwise", _COLUMNWISE_H200 * hbm, why),)
    if gpu in ("b200", "gb200"):  # MXFP8 / NVFP4 kernels: assumed at TE's transpose's fraction
        rates += (("requantize", 3.46 * hbm, why), ("nvfp4-transpose", 3.46 * hbm, why))
    return GpuProfile(gpu, 470.0 * flops, 3.46 * hbm if gpu == "h100" else 0.0,
                      _HOPPER if gpu == "h100" else _BLACKWELL, why, rates)


GPUS: Dict[str, GpuProfile] = {
    "h200": GpuProfile("h200", 470.0, 3.46, _HOPPER, "measured on one H200 by this project",
                       (("columnwise", _COLUMNWISE_H200, "measured on one H200 by this project "
                         "(TE 2.20.2 blockwise columnwise copies: 303 MB in 0.190 ms)"),)),
    "h100": _scaled("h100"),
    "b200": _scaled("b200"),
    "gb200": _scaled("gb200"),
}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch: int
    global_batch: int
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  #: expert tensor parallel size (megatron-core's default: TP)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def expert_dp(self) -> int:
        """Ranks an expert's weights are sharded over: TP x CP x DP / (EP x ETP)."""
        ranks, per = self.tp * self.cp * self.dp, self.ep * self.expert_tp
        if ranks % per:
            raise PlanInputError(
                f"--ep {self.ep} x --expert-tp {self.expert_tp} = {per} does not divide TP x CP x "
                f"DP = {ranks} (megatron-core carves the expert groups out of these ranks)")
        return ranks // per

    def microbatches(self) -> int:
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            raise PlanInputError(
                f"--global-batch {self.global_batch} is not a multiple of micro-batch x DP = "
                f"{self.micro_batch} x {self.dp} = {per_step} (set a global batch that is)")
        return self.global_batch // per_step

    def layers_per_chunk(self, model: ModelShape) -> int:
        stages = self.pp * self.vp
        if model.layers % stages:
            raise PlanInputError(
                f"--vp {self.vp}: {model.layers} layers are not divisible by PP x VP = {self.pp} x "
                f"{self.vp} = {stages} (choose PP and VP whose product divides the layer count)")
        return model.layers // stages


def chunk_costs(model: ModelShape, layout: Layout, gpu: GpuProfile, *,
                tflops: Optional[float] = None, transpose_tbps: Optional[float] = None,
                allgather_gbps: float = 40.0, p2p_gbps: float = 40.0,
                overlap_penalty: float = OVERLAP_PENALTY_H200,
                work: PostProcessing = PER_TENSOR_TRANSPOSE) -> Tuple[Costs, Dict[str, float]]:
    """Per-chunk durations on one GPU, and the figures they came from; ``work``: the recipe's
    post-all-gather processing (:mod:`nemo_fp8_align.planner.post_processing`), a transpose by default."""
    for name, value in (("--tp", layout.tp), ("--pp", layout.pp), ("--vp", layout.vp),
                        ("--dp", layout.dp), ("--cp", layout.cp), ("--ep", layout.ep),
                        ("--micro-batch", layout.micro_batch)):
        if value < 1:
            raise PlanInputError(f"{name} {value}: must be >= 1")
    if model.hidden % layout.tp or model.hidden % model.heads:
        raise PlanInputError(f"hidden size {model.hidden} must be divisible by --tp {layout.tp} "
                             f"and by the head count {model.heads}")
    for name, value in (("--tflops", tflops), ("--transpose-tbps", transpose_tbps),
                        ("--allgather-gbps", allgather_gbps), ("--p2p-gbps", p2p_gbps),
                        ("--overlap-penalty", overlap_penalty)):
        if value is not None and value <= 0:
            raise PlanInputError(f"{name} {value}: must be > 0")
    rate = (tflops if tflops is not None else gpu.tflops) * 1e12
    known, rate_source = gpu.rate(work.kind)
    if transpose_tbps is None and known <= 0:
        raise PlanInputError(f"--gpu {gpu.name}: no {work.kind} rate is known for it; pass "
                             "--transpose-tbps (read + write TB/s of that work)")
    tbps = (transpose_tbps if transpose_tbps is not None else known) * 1e12
    layers = layout.layers_per_chunk(model)
    dense = model.attention_weights() + (0 if model.experts else model.mlp_weights())
    experts = 0.0
    if model.experts:
        if model.experts % layout.ep:
            raise PlanInputError(f"--experts {model.experts} is not divisible by --ep {layout.ep}"
                                 " (each expert-parallel rank holds experts / EP experts)")
        experts = model.experts // layout.ep * model.mlp_weights() / layout.expert_tp
    weights = layers * (dense / layout.tp + experts)  # weight elements (FP8: one byte each)
    tokens = layout.micro_batch * model.seq / layout.cp
    # Forward FLOPs: 2 per weight per token (top-k expert MLPs for MoE), plus causal attention
    # (QK^T and AV, half the square), each sequence split over CP ranks.
    active = model.attention_weights() + model.mlp_weights() * (model.topk if model.experts else 1)
    fwd_flops = layers * (2 * tokens * active + 2 * layout.micro_batch * model.seq ** 2
                          * model.hidden / layout.cp) / layout.tp
    forward = fwd_flops / rate  # the rate holds over forward + backward (backward = 2 forwards)
    transpose = work.bytes_per_weight * weights / tbps
    dp_ranks = layout.dp * layout.cp
    gathered = layers * (dense / layout.tp * (dp_ranks - 1) / dp_ranks)
    if model.experts:
        edp = layout.expert_dp()
        gathered += layers * experts * (edp - 1) / edp
    activation = tokens * model.hidden * 2 / layout.tp  # bf16, sequence parallel
    gathered *= work.gathered_bytes_per_weight
    costs = Costs(forward=forward, backward=2 * forward, transpose=transpose,
                  allgather=gathered / (allgather_gbps * 1e9), p2p=activation / (p2p_gbps * 1e9),
                  overlap_penalty=overlap_penalty)
    return costs, {"layers_per_chunk": layers, "weight_bytes": weights,
                   "fwd_tflop": fwd_flops / 1e12, "tflops": rate / 1e12, "transpose_tbps": tbps / 1e12,
                   "rate_source": "given" if transpose_tbps is not None else rate_source}
