"""megatron-core 0.16 + Transformer Engine FP8 parameters + the plugin, several ranks on one GPU.

A small GPT from megatron-core's TE layer spec (``fp8_param=True``: the transformer layers'
linear weights are TE ``Float8Tensor``s), PP x DP processes sharing the GPU through the
host-staging backend (lab/host_staging.py), the interleaved schedule (VP
chunks), DDP with ``overlap_param_gather``, ``align_param_gather`` and ``fp8_param_gather``, the
DistributedOptimizer, and ``align_fp8_transposes`` with ``TEBackend``. Every rank trains the
same model from the same seed once per policy (off, aligned, lazy, off again) and records
losses, gradient and parameter digests, the plugin's telemetry and the watch of every
transpose build/reset (validation/real_stack_common.py). The parent judges it all and writes
``summary.json`` and prints PASS/FAIL lines.

Usage (repo root, TE and megatron-core importable):
  python3 validation/real_stack_mcore.py --dp 2 --recipe delayed --out DIR
  python3 validation/real_stack_mcore.py --cpu-dry-run --dp 2 --out DIR   # plumbing only: CPU, no FP8
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from validation import real_stack_common as common  # noqa: E402


@dataclass(frozen=True)
class Opts:
    pp: int = 2
    vp: int = 2
    dp: int = 2
    microbatches: int = 4
    steps: int = 5
    #: megatron-core fp8_recipe: delayed | tensorwise (current scaling) | blockwise (TE
    #: Float8BlockScaling: Float8BlockwiseQTensor weights, 128x128 blocks)
    recipe: str = "delayed"
    hidden: int = 256
    layers_per_chunk: int = 1
    seq: int = 64
    vocab: int = 1024
    micro_batch_size: int = 2
    seed: int = 1234
    cpu_dry_run: bool = False
    bucket_cap_mb: float = 100.0  # Apex DistributedFusedAdam's bucket size (its default)
    verify_every: int = 0  # the plugin's verify mode (TEBackend.transpose_mismatch), 0: off
    #: A forward-only evaluation after every step with DDP's pre-hooks disabled (a forced
    #: synchronous all-gather first), as Megatron-LM's evaluate runs it; run 0 (off) skips it
    #: and is the reference every plugin run must equal bit for bit.
    eval_between_steps: bool = False
    gather_with_optimizer: bool = False  # OptimizerConfig(overlap_param_gather_with_optimizer_step)


def gpt_config(o: Opts, **extra: Any):
    """The TransformerConfig both paths use (TE layer spec, FP8 params) and the layer spec."""
    from megatron.core.transformer import TransformerConfig

    kwargs: Dict[str, Any] = dict(extra)
    if o.cpu_dry_run:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec, dtype = get_gpt_layer_local_spec(), torch.float32
        kwargs.update(use_cpu_initialization=True)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.transformer.enums import AttnBackend
        spec, dtype = get_gpt_layer_with_transformer_engine_spec(), torch.bfloat16
        kwargs.update(fp8="hybrid", fp8_recipe=o.recipe, fp8_param=True, bf16=True,
                      attention_backend=AttnBackend.unfused, deterministic_mode=True)
    config = TransformerConfig(
        num_layers=o.pp * o.vp * o.layers_per_chunk, hidden_size=o.hidden,
        ffn_hidden_size=4 * o.hidden, num_attention_heads=4, pipeline_model_parallel_size=o.pp,
        virtual_pipeline_model_parallel_size=o.vp, pipeline_dtype=dtype, params_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        batch_p2p_comm=False,  # same-peer messages of one batch pair wrongly over gloo
        **kwargs)
    return config, spec


def gpt_chunks(o: Opts, config: Any, spec: Any, pp_rank: int) -> List[torch.nn.Module]:
    """This rank's VP model chunks (GPTModel; on the GPU: bf16, FP8 weights as TE made them)."""
    from megatron.core.models.gpt import GPTModel

    chunks = []
    for c in range(o.vp):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=o.vocab,
                         max_sequence_length=o.seq, pre_process=pp_rank == 0 and c == 0,
                         post_process=pp_rank == o.pp - 1 and c == o.vp - 1,
                         share_embeddings_and_output_weights=False, vp_stage=c)
        if not o.cpu_dry_run:
            _to_gpu_bf16(model)
        chunks.append(model)
    return chunks


def _to_gpu_bf16(model: torch.nn.Module) -> None:
    """Move the CPU-made pieces (the learned position embedding is a plain fp32
    ``torch.nn.Embedding``) to the GPU in bf16, leaving TE's FP8 parameters untouched.

    Megatron-LM wraps each chunk in megatron-core's Float16Module instead (``module.bfloat16()``
    plus casts of the first stage's inputs and the last stage's outputs); on the H200 a probe
    (validation/run_real_stack.sh) showed it keeps TE 2.20's Float8Tensor parameters as they are, so
    for the FP8 weights the two are the same. Here the tokens are integers and the loss is
    taken in float32, so the casts are not needed.
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            dtype = torch.bfloat16 if param.dtype == torch.float32 else param.dtype
            if param.device.type != "cuda" or dtype != param.dtype:
                param.data = param.data.to("cuda", dtype)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type != "cuda":
                module._buffers[name] = buf.cuda()


def _build(o: Opts, pp_rank: int):
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    config, spec = gpt_config(o)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True, align_param_gather=True,
        fp8_param_gather=not o.cpu_dry_run, bucket_size=40000)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                      disable_bucketing=c > 0)
              for c, model in enumerate(gpt_chunks(o, config, spec, pp_rank))]
    config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks


def _optimizer(o: Opts, chunks):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                          use_distributed_optimizer=True, bf16=not o.cpu_dry_run,
                          overlap_param_gather_with_optimizer_step=o.gather_with_optimizer,
                          params_dtype=torch.float32 if o.cpu_dry_run else torch.bfloat16)
    return get_megatron_optimizer(cfg, chunks)


def _batches(o: Opts, step: int, dp_rank: int, device: str):
    gen = torch.Generator().manual_seed(o.seed * 7919 + step * 131 + dp_rank)
    out = []
    for _ in range(o.microbatches):
        tokens = torch.randint(0, o.vocab, (o.micro_batch_size, o.seq), generator=gen)
        out.append({"tokens": tokens.to(device), "labels": torch.roll(tokens, -1, 1).to(device),
                    "position_ids": torch.arange(o.seq).expand(o.micro_batch_size, -1).to(device)})
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def seed_everything(o: Opts) -> None:
    """The same initial weights for every policy run."""
    torch.manual_seed(o.seed)
    if not o.cpu_dry_run:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(o.seed)
    else:  # no CUDA RNG to fork on the CPU; dropout is 0 anyway
        import contextlib
        from megatron.core.tensor_parallel import random as mrandom
        mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def reset_fp8_state(o: Opts) -> None:
    """Forget TE's global FP8 state (amax histories) between policy runs."""
    if o.cpu_dry_run:
        return
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    FP8GlobalStateManager.reset()
    torch.cuda.empty_cache()


class GatherWatch:
    """Counts parameter all-gathers dispatched blocking: by ``finish_param_sync`` itself (never
    launched before) or with ``force_sync``. The plugin's path must leave both at 0."""

    def __init__(self) -> None:
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G
        self.cls, self.blocking, self.dispatched, self._inside = G, [], 0, False
        self._start, self._finish = G.start_param_sync, G.finish_param_sync
        watch = self

        def start(group, force_sync=False):
            watch.dispatched += 1
            if force_sync or watch._inside:
                watch.blocking.append({"force_sync": force_sync, "inside_finish": watch._inside})
            return watch._start(group, force_sync=force_sync)

        def finish(group, skip_next_bucket_dispatch=False):
            watch._inside = True
            try:
                return watch._finish(group, skip_next_bucket_dispatch=skip_next_bucket_dispatch)
            finally:
                watch._inside = False

        G.start_param_sync, G.finish_param_sync = start, finish

    def uninstall(self) -> None:
        self.cls.start_param_sync, self.cls.finish_param_sync = self._start, self._finish


def _evaluate(o: Opts, chunks, fwd_bwd, step: int, dp_rank: int, device: str) -> None:
    """Megatron-LM's evaluate with overlapped all-gathers: pre-hooks off (forced all-gather)."""
    for chunk in chunks:
        chunk.disable_forward_pre_hook()
    with torch.no_grad():
        fwd_bwd(forward_step_func=_forward_step,
                data_iterator=[iter(_batches(o, 1000 + step, dp_rank, device)) for _ in chunks],
                model=chunks, num_microbatches=o.microbatches, seq_length=o.seq,
                micro_batch_size=o.micro_batch_size, forward_only=True)
    for chunk in chunks:
        chunk.enable_forward_pre_hook()


def _run_policy(o: Opts, policy: str, out_dir: str, rank: int, run_index: int) -> Dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from nemo_fp8_align.config import AlignConfig, Policy
    from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes
    from nemo_fp8_align.core.telemetry import record_problems

    device = "cpu" if o.cpu_dry_run else "cuda"
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    seed_everything(o)
    config, chunks = _build(o, pp_rank)
    optimizer = _optimizer(o, chunks)
    if o.cpu_dry_run:
        from nemo_fp8_align.backends.reference import ReferenceBackend
        backend, weights_of = ReferenceBackend(), (lambda chunk: [])
    else:
        from nemo_fp8_align.backends.te import TEBackend
        backend = TEBackend()
        weights_of = backend.weights_of
    weights = [list(weights_of(c)) for c in chunks]
    telemetry = os.path.join(out_dir, f"telemetry.run{run_index}.rank{{rank}}.jsonl")
    # Installed before the plugin: its build observer (backends/te_watch.py) sets the method on
    # Float8Tensor itself, which would otherwise bypass this watch's wrapper on TE's base class.
    watch = common.TransposeWatch() if not o.cpu_dry_run else None
    if watch is not None:
        for c, ws in enumerate(weights):
            watch.watch(c, ws, prefix="")
        watch.install()
    aligner = align_fp8_transposes(
        chunks, num_microbatches=o.microbatches, backend=backend, weights_of=weights_of,
        config=config, align_config=AlignConfig(policy=Policy(policy), telemetry_path=telemetry,
                                                verify_every_n_steps=o.verify_every))
    probe = common.FirstUseProbe(chunks, weights, backend)
    gathers = GatherWatch()
    fwd_bwd = get_forward_backward_func()
    evaluate = o.eval_between_steps and run_index > 0
    result: Dict[str, Any] = {"policy": policy, "pp_rank": pp_rank, "dp_rank": dp_rank,
                              "evaluated": evaluate,
                              "weights": [len(w) for w in weights],
                              "weight_types": sorted({type(w).__name__ for ws in weights for w in ws}),
                              "losses": [], "grads": [], "params": [], "step_seconds": []}
    try:
        for step in range(o.steps):
            data = _batches(o, step, dp_rank, device)
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            probe.start_step(step)
            if watch is not None:
                watch.step, watch.phase = step, "fwd_bwd"
            t0 = time.monotonic()
            out = fwd_bwd(forward_step_func=_forward_step, data_iterator=[iter(data) for _ in chunks],
                          model=chunks, num_microbatches=o.microbatches, seq_length=o.seq,
                          micro_batch_size=o.micro_batch_size, forward_only=False)
            if watch is not None:
                watch.phase = "optimizer"
            result["grads"].append(common.digest([b.grad_data for c in chunks for b in c.buffers]))
            optimizer.step()
            if not o.cpu_dry_run:
                torch.cuda.synchronize()
            result["step_seconds"].append(round(time.monotonic() - t0, 4))
            result["params"].append(common.digest([b.param_data for c in chunks for b in c.buffers]))
            if out:
                result["losses"].append(float(torch.stack([x["lm loss"] for x in out]).mean()))
            if evaluate:
                if watch is not None:
                    watch.phase = "eval"
                _evaluate(o, chunks, fwd_bwd, step, dp_rank, device)
            if watch is not None:
                watch.phase = "idle"
    finally:
        aligner.detach()
        probe.remove()
        gathers.uninstall()
        if watch is not None:
            watch.uninstall()
    records = [asdict(r) for r in aligner.records]
    result["records"] = records
    result["blocking_all_gathers"] = gathers.blocking
    result["all_gathers_dispatched"] = gathers.dispatched
    result["backend"] = backend.describe() if hasattr(backend, "describe") else backend.name
    result["forced_sync_rebuilds"] = (None if aligner.forced_syncs is None
                                      else aligner.forced_syncs.rebuilt)
    problems: List[str] = []
    if policy != "off" and not o.cpu_dry_run:
        # With evaluations, chunk 0's builds run at the forced all-gather between steps (the
        # plugin's on < 0.18, megatron-core's on >= 0.18): the in-step observed count is 0.
        problems += record_problems(records, policy=policy, observed_builds=not evaluate)
        n_records = len(records)
        if n_records != o.steps * o.vp:
            problems.append(f"{n_records} plugin records, expected {o.steps * o.vp}")
        if policy == "aligned" and torch.cuda.is_available():
            problems += common.gpu_time_problems(records)
    if watch is not None:
        problems += common.weight_problems(policy, o.steps, watch, probe, records,
                                           [len(w) for w in weights], evaluated=evaluate)
        result["events"] = watch.events
    # Evaluation's forced ones are its own; with the optimizer dispatching chunk 0, megatron-core
    # (off, and lazy, which only observes) dispatches that chunk's first all-gather inside finish_param_sync at first use.
    blocking = [b for b in gathers.blocking if not (evaluate and b["force_sync"])
                and not (policy in ("off", "lazy") and o.gather_with_optimizer)]
    if blocking:
        problems.append(f"{len(blocking)} blocking parameter all-gathers: {blocking[:3]}")
    result["first_use_valid"] = {str(s): v for s, v in probe.valid.items()}
    result["problems"] = problems
    del optimizer, chunks, aligner
    reset_fp8_state(o)
    return result


def _rank_main(rank: int, world_size: int, port: int, o: Opts, out_dir: str,
               runner: Any = None) -> None:
    from megatron.core import parallel_state

    if not o.cpu_dry_run:
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    common.init_rank(rank, world_size, port, "cpu" if o.cpu_dry_run else "cuda")
    compat = None
    if o.cpu_dry_run:
        from lab.demo.cpu_redirects import enable_cpu_compat
        compat = enable_cpu_compat()
    runs = []
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=o.pp,
            virtual_pipeline_model_parallel_size=o.vp)
        for i, policy in enumerate(common.POLICY_RUNS):
            runs.append((runner or _run_policy)(o, policy, out_dir, rank, i))
    except Exception:  # written out so the parent reports it with the rank
        runs.append({"policy": "error", "traceback": traceback.format_exc()})
        raise
    finally:
        common.write_json(os.path.join(out_dir, f"rank{rank}.json"), runs)
        if compat is not None:
            compat.undo()
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def judge(o: Opts, out_dir: str) -> Dict[str, Any]:
    """Read every rank's runs; return the summary with one PASS/FAIL per check."""
    checks: List[Dict[str, Any]] = []

    def check(name: str, problems: List[str]) -> None:
        checks.append({"check": name, "ok": not problems, "problems": problems[:10]})

    ranks = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json"))):
        with open(path, encoding="utf-8") as f:
            ranks[os.path.basename(path)] = json.load(f)
    errors = [r["traceback"] for runs in ranks.values() for r in runs if r["policy"] == "error"]
    check("every rank ran every policy", errors + ([] if len(ranks) == o.pp * o.dp else
                                                   [f"{len(ranks)} rank files"]))
    for name, runs in ranks.items():
        good = [r for r in runs if r["policy"] != "error"]
        for i, r in enumerate(good):
            if o.eval_between_steps and i == 3:  # megatron-core alone, evaluating: reported below
                print(f"INFO {name} run 3 (plugin off, evaluating): {r['problems'][:2]}")
                continue
            check(f"{name} policy {r['policy']}: plugin telemetry + weights", r["problems"])
        if len(good) == len(common.POLICY_RUNS) and o.eval_between_steps:
            # Run 0: plugin off, no evaluation. Runs 1-2 (aligned, lazy) evaluate after every
            # step and must equal it; run 3 (off, evaluating) is megatron-core alone.
            check(f"{name}: aligned and lazy with evaluations equal the plugin off without",
                  common.compare_policies(good[:3]))
            alone = common.compare_policies([good[0], good[3]])
            print(f"INFO {name}: megatron-core alone (plugin off) with evaluations "
                  + ("equals the run without" if not alone else f"differs: {alone[:2]}")
                  + f"; plugin's rebuilds after forced all-gathers: "
                  f"{[r.get('forced_sync_rebuilds') for r in good]}")
        elif len(good) == len(common.POLICY_RUNS):
            check(f"{name}: losses, grads, params bit-identical across policies",
                  common.compare_policies(good))
    if not o.cpu_dry_run:
        types = sorted({t for runs in ranks.values() for r in runs for t in r.get("weight_types", [])})
        want = "Float8BlockwiseQTensor" if o.recipe == "blockwise" else "Float8Tensor"
        check(f"TE weights are {want}", [] if types == [want] else [f"types {types}"])
        kinds = sorted({rec.get("kind") for runs in ranks.values() for r in runs
                        for rec in r.get("records", [])})
        want_kind = "columnwise" if o.recipe == "blockwise" else "transpose"
        check(f"records say kind {want_kind}", [] if kinds in ([], [want_kind]) else
              [f"kinds {kinds}"])
    summary = {"opts": asdict(o), "checks": checks,
               "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks)}
    first = next(iter(ranks.values()), [])
    summary["losses"] = {r["policy"]: r["losses"] for r in
                         (runs for runs in ranks.values()) for r in r if r.get("losses")}
    summary["example_records"] = [
        {k: rec.get(k) for k in ("step", "chunk", "pp_rank", "dp_rank", "policy", "kind", "slot",
                             "aligned_slot", "transposed", "valid", "weights", "after_all_gather")}
        for runs in ranks.values() for r in runs if r["policy"] in ("aligned", "lazy")
        for rec in r.get("records", []) if rec["step"] == 1]
    del first
    moves = {f"{name} run{i} {r['policy']}": common.transpose_buffer_moves(r.get("events", []))
             for name, runs in ranks.items() for i, r in enumerate(runs)}
    summary["transpose_buffer_moves"] = {k: sum(v.values()) for k, v in moves.items()}
    summary["weights_with_build_addresses"] = sum(len(v) for v in moves.values())
    return summary


def main(runner: Any = None, description: str = __doc__) -> int:
    """``runner``: a module-level ``(opts, policy, out_dir, rank, run_index) -> result`` run in
    every rank (picklable: the ranks are spawned); None runs the megatron-core path."""
    ap = argparse.ArgumentParser(description=description.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise"])
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--verify-every", type=int, default=0,
                    help="the plugin's verify_every_n_steps (0: off)")
    ap.add_argument("--bucket-cap-mb", type=float, default=100.0,
                    help="Apex runner: DistributedFusedAdam bucket_cap_mb (small: every data-"
                         "parallel rank's shard holds real parameters)")
    ap.add_argument("--eval-between-steps", action="store_true",
                    help="evaluate after every step with a forced all-gather (run 0 does not)")
    ap.add_argument("--gather-with-optimizer", action="store_true",
                    help="OptimizerConfig(overlap_param_gather_with_optimizer_step=True)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    o = Opts(pp=a.pp, vp=a.vp, dp=a.dp, steps=a.steps, microbatches=a.microbatches,
             recipe=a.recipe, cpu_dry_run=a.cpu_dry_run, bucket_cap_mb=a.bucket_cap_mb,
             verify_every=a.verify_every or (1 if a.eval_between_steps else 0),
             eval_between_steps=a.eval_between_steps, gather_with_optimizer=a.gather_with_optimizer)
    os.makedirs(a.out, exist_ok=True)
    import torch.multiprocessing as mp
    t0 = time.time()
    try:
        mp.start_processes(_rank_main, args=(o.pp * o.dp, common.free_port(), o, a.out, runner),
                           nprocs=o.pp * o.dp, join=True, start_method="spawn")
    except Exception as exc:  # judged below from what the ranks wrote
        print(f"ranks failed: {str(exc)[-3000:]}")
    summary = judge(o, a.out)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    common.write_json(os.path.join(a.out, "summary.json"), summary)
    for c in summary["checks"]:
        print(f"[{'PASS' if c['ok'] else 'FAIL'}] {c['check']}"
              + ("" if c["ok"] else " -- " + " | ".join(c["problems"][:3])[:1500]))
    print(f"losses per policy run: {summary['losses']}")
    print(f"transpose buffer moves (builds at another address than the weight's first), per "
          f"rank and run: {summary['transpose_buffer_moves']}")
    print(f"SUMMARY: {summary['passed']} passed, {summary['failed']} failed, {summary['wall_seconds']} s")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
