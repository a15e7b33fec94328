"""Real Transformer Engine FP8 parameters under a CUDA graph: does a graph captured once read the
transposes the plugin's TE backend rebuilds each step? (run on a CUDA machine; issue 10, item 5)

A TE ``Linear`` whose weight is a ``Float8Tensor`` (``fp8_model_init``, current scaling) is
graphed with TE's ``make_graphed_callables`` once, while its transpose is valid (as megatron-core
captures per-layer graphs at the end of a step). Then, for three steps, the weight receives new
values the way megatron-core's FP8 all-gather delivers them (new ``_data`` bytes, the cache
flagged invalid, the old transpose bytes still in the buffer), and one of:

* ``backend``: the plugin's ``TEBackend.build_transposes`` (what the aligner calls at the slot);
* ``nothing``: no rebuild before the replay;

runs before the graphed forward/backward. Each is compared with an eager twin layer holding the
same bytes (TE builds its transpose lazily there). Also checked per step: the transpose's address
(a graph replays a fixed one) and its bytes against ``_data`` transposed.

Then verify mode's check on real TE (``TEBackend.transpose_mismatch``): a fresh transpose passes;
one corrupted byte, and new ``_data`` bytes written with the cache still flagged valid (what a
forced synchronous all-gather without post-processing leaves), are both reported.

Usage: python validation/te_cuda_graph_probe.py [--verify-only]   (prints [PASS]/[FAIL]/[INFO] lines)
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

FAILED = []


def report(kind, name, detail=""):
    if kind == "FAIL":
        FAILED.append(name)
    print(f"[{kind}] {name}" + (f" -- {detail}" if detail else ""), flush=True)


def graph_kwargs(te, fp8_recipe):
    """TE renamed make_graphed_callables' FP8 arguments over 2.x: pass whichever it takes."""
    params = inspect.signature(te.make_graphed_callables).parameters
    if "fp8_enabled" in params:
        return {"fp8_enabled": True, "fp8_recipe": fp8_recipe}
    return {"enabled": True, "recipe": fp8_recipe}


def deliver(weight, values, stale_t):
    """megatron-core's FP8 all-gather: new FP8 bytes, transpose flagged invalid, old bytes left."""
    with torch.no_grad():
        weight.quantize_(values)
    weight._reset_caches()
    if weight._transpose is not None:
        weight._transpose.copy_(stale_t)


def verify_checks(backend, layer) -> None:
    """TEBackend.transpose_mismatch against real Float8Tensor bytes."""
    w = layer.weight
    w._reset_caches()
    backend.build_transposes([w])
    fresh = backend.transpose_mismatch(w)
    report("PASS" if fresh is None else "FAIL", "verify: a fresh transpose passes", str(fresh))
    saved = w._transpose.clone()
    w._transpose.view(torch.uint8)[0, 0] ^= 1
    flipped = backend.transpose_mismatch(w)
    report("PASS" if flipped else "FAIL", "verify: one flipped transpose byte is reported",
           str(flipped))
    w._transpose.copy_(saved)
    with torch.no_grad():  # new bytes as a raw FP8 all-gather writes them; flag left valid
        w._data.copy_(torch.roll(w._data, 1, dims=0))
    stale = backend.transpose_mismatch(w)
    report("PASS" if stale and backend.has_valid_transpose(w) else "FAIL",
           "verify: new _data under a transpose still flagged valid is reported", str(stale))


def main() -> int:
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    from nemo_fp8_align.backends.te import TEBackend

    print(f"torch {torch.__version__}, TE {transformer_engine.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    print("make_graphed_callables", inspect.signature(te.make_graphed_callables))
    model_init = getattr(te, "fp8_model_init", None) or te.quantized_model_init
    fp8_recipe = te_recipe.Float8CurrentScaling()
    backend = TEBackend()
    hidden, tokens = 512, 256

    def make():
        torch.manual_seed(0)
        with model_init(enabled=True, recipe=fp8_recipe):
            return te.Linear(hidden, hidden, bias=False, params_dtype=torch.bfloat16,
                             device="cuda")

    def fwd_bwd(layer, x):
        x = x.detach().clone().requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            y = layer(x)
        y.float().square().mean().backward()
        out = (y.detach().clone(), x.grad.clone(), layer.weight.grad.clone())
        layer.weight.grad = None
        return out

    try:
        verify_checks(backend, make())
    except Exception as exc:
        traceback.print_exc()
        report("FAIL", "verify checks raised", repr(exc)[:400])
    for mode in (() if "--verify-only" in sys.argv else ("backend", "nothing")):
        try:
            graphed, eager = make(), make()
            w, we = graphed.weight, eager.weight
            report("INFO", f"{mode}: weight type", type(w).__name__)
            fwd_bwd(graphed, torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16))
            report("INFO", f"{mode}: transpose valid before capture",
                   str(backend.has_valid_transpose(w)))
            sample = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True)
            te.make_graphed_callables(graphed, (sample,), **graph_kwargs(te, fp8_recipe))
            first_ptr = w._transpose.data_ptr() if w._transpose is not None else None
            g = torch.Generator(device="cuda").manual_seed(7)
            for step in range(1, 4):
                values = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16,
                                     generator=g) * 0.02
                stale = w._transpose.clone()
                deliver(w, values, stale)
                deliver(we, values, we._transpose.clone() if we._transpose is not None else None)
                same_bytes = torch.equal(w._data, we._data)
                if mode == "backend":
                    built = backend.build_transposes([w])
                    exact = torch.equal(w._transpose.view(torch.uint8),
                                        w._data.view(torch.uint8).t())
                    report("PASS" if built == 1 and exact else "FAIL",
                           f"backend step {step}: rebuilt the transpose, == _data.t()",
                           f"built {built}, exact {exact}")
                ptr = w._transpose.data_ptr()
                report("INFO", f"{mode} step {step}: transpose address",
                       "unchanged" if ptr == first_ptr else f"MOVED {first_ptr:#x} -> {ptr:#x}")
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
                got, want = fwd_bwd(graphed, x), fwd_bwd(eager, x)
                eq = [torch.equal(a, b) for a, b in zip(got, want)]
                diff = (got[1].float() - want[1].float()).abs().max().item()
                kind = "PASS" if all(eq) else ("FAIL" if mode == "backend" else "INFO")
                report(kind, f"{mode} step {step}: graph replay == eager twin "
                       "(output, dgrad, wgrad)", f"{eq}, same FP8 bytes {same_bytes}, "
                       f"max|dgrad diff| {diff:.3e}")
        except Exception as exc:  # report and go on to the next mode
            traceback.print_exc()
            report("FAIL", f"{mode}: probe raised", repr(exc)[:400])
    print(f"SUMMARY: {len(FAILED)} failed: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
