"""``python -m lab.demo``: the CPU demo's flags, their validation, and the run.

The demo is the lab's, not the plugin's: it trains on CPU through redirects that patch torch,
injects faults and judges the run with its own evidence, so it runs from a checkout (the
repository root on ``sys.path``) and the wheel does not ship it.

Every flag is checked before any process starts: a bad value ends in one line naming the flag,
the value and the fix (exit status 2), never a traceback and never a run whose result is
thrown away (a telemetry path that cannot be written is found before training, not after).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

from nemo_fp8_align.config import Policy
from nemo_fp8_align.cli.common import missing_dependency

__all__ = ["EXIT_BAD_INPUT", "INTERRUPTED", "LIMITS", "PROG", "TERMINATED", "Terminated",
           "build_parser", "demo_input_problem", "main", "telemetry_path_problem"]

EXIT_BAD_INPUT = 2
#: The command as a user types it, for usage and error lines.
PROG = "python -m lab.demo"
#: (import name, distribution name, extra) the demo needs beyond the package itself.
DEMO_NEEDS = (("torch", "torch", "mcore"), ("megatron.core", "megatron-core", "mcore"))
LOOPS = ("schedule", "megatron-lm")
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")


#: Exit statuses of a run ended by Ctrl-C or SIGTERM (128 + the signal, as a shell reports it).
INTERRUPTED, TERMINATED = 130, 143


class Terminated(BaseException):
    """SIGTERM reached the demo: raised where it was, so that the launcher stops its ranks and
    the run's temporary folder is removed on the way out."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the demo's flags, run it, and return its exit status (0 OK, 1 a check failed or
    the records could not be written, 2 a bad flag, 130 Ctrl-C, 143 SIGTERM: one line each, the
    ranks stopped and the temporary folder removed)."""
    args = build_parser().parse_args(argv)
    from nemo_fp8_align.cli.common import closed_pipes_discarded

    try:
        with closed_pipes_discarded(), _sigterm_raises():  # `| head -1`: no traceback
            return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return TERMINATED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="train a small GPT on CPU/gloo with "
                                "megatron-core's interleaved schedule and report where FP8 "
                                "transposes ran")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (>= 2, default 2)")
    p.add_argument("--vp", type=int, default=2,
                   help="model chunks per pipeline rank (>= 2, default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (>= 1, default 1)")
    p.add_argument("--dist-opt-instances", type=int, default=1, metavar="N",
                   help="distributed-optimizer instances the --dp ranks split into (megatron-"
                   "core >= 0.10's num_distributed_optimizer_instances, Megatron-LM's "
                   "--num-distributed-optimizer-instances; N divides --dp; default 1)")
    p.add_argument("--microbatches", type=int, default=4,
                   help="microbatches per step, M (>= PP, default 4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="microbatch_group_size_per_vp_stage N (PP <= N <= M; default: PP)")
    p.add_argument("--steps", type=int, default=3, help="training steps (>= 1, default 3)")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.ALIGNED.value)
    p.add_argument("--telemetry", metavar="PATH", default=None,
                   help="write one JSON line per (step, pp_rank, dp_rank, chunk) here")
    p.add_argument("--fault", metavar="NAME", default=None,
                   help="inject a named fault (lab/demo/faults/) in every rank, e.g. "
                   "mismatch_on_one_rank: the last rank runs an extra chunk forward in step "
                   "1; the demo then exits 1 with every rank's message")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="process-group timeout (default: torch's 30 minutes)")
    p.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="OptimizerConfig(overlap_param_gather_with_optimizer_step=True): the "
                   "optimizer step dispatches chunk 0's all-gather")
    p.add_argument("--eval-between-steps", action="store_true",
                   help="a forward-only evaluation after every step, as Megatron-LM's evaluate "
                   "runs it: DDP pre-hooks disabled, a forced synchronous all-gather first")
    p.add_argument("--manual-post-processing", action="store_true",
                   help="FP8 weights that keep a stale transpose flagged valid until megatron-"
                   "core's post-all-gather processing, as TE's do (megatron-core >= 0.16)")
    p.add_argument("--recipe", choices=RECIPES, default=RECIPES[0],
                   help="the quantized-weight recipe the reference weights stand in for: "
                   "delayed / tensorwise (per-tensor FP8, the plugin's transposes; default), "
                   "blockwise (2D block scales: column-wise copy; megatron-core >= 0.16), "
                   "mxfp8 (grad-buffer reuse: re-quantized from the gathered BF16; >= 0.19 "
                   "here), nvfp4 (packed FP4: 2D transpose; >= 0.17), each done by "
                   "megatron-core's own post-processing")
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0],
                   help="'schedule': the demo's own loop around megatron-core's schedule "
                        "(default); 'megatron-lm': Megatron-LM's own pretrain/train() "
                        "(megatron-core >= 0.19), the plugin attached by a post-wrap hook")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="with --loop megatron-lm: 'cuda' runs it on the GPU with Transformer "
                   "Engine FP8 weights, every rank sharing GPU 0 (start CUDA MPS to run them "
                   "side by side; docs/megatron-lm.md)")
    p.add_argument("--resume-at", type=int, default=None, metavar="K",
                   help="save a checkpoint after K steps and resume from it in a new run")
    p.set_defaults(func=run_demo_command)
    return p


def demo_input_problem(args: argparse.Namespace) -> Optional[str]:
    """One line naming the first bad flag, its value and the fix; None when all are valid.

    The microbatch rules are megatron-core's interleaved schedule's: M >= PP, PP <= N <= M,
    and M mod N either 0 or at least PP.
    """
    pp, vp, dp, m, n, steps = (args.pp, args.vp, args.dp, args.microbatches, args.group_size,
                               args.steps)
    problem = _size_problem(args)
    if problem is not None:
        return problem
    if pp < 2:
        return f"--pp {pp}: the interleaved schedule needs at least 2 pipeline ranks; pass --pp 2"
    if vp < 2:
        return (f"--vp {vp}: interleaving needs at least 2 model chunks per pipeline rank; "
                "pass --vp 2")
    if dp < 1:
        return f"--dp {dp}: the data-parallel size must be at least 1; pass --dp 1"
    problem = _instances_problem(dp, getattr(args, "dist_opt_instances", 1))
    if problem is not None:
        return problem
    if steps < 1:
        return (f"--steps {steps}: nothing would be trained or checked; pass --steps 1 or "
                "more (default 3)")
    if m < pp:
        return (f"--microbatches {m}: the interleaved schedule needs at least --pp = {pp} "
                f"microbatches per step; pass --microbatches {pp}")
    legacy = legacy_schedule_problem(args)
    if legacy is not None:
        return legacy
    group = pp if n is None else n
    if not pp <= group <= m:
        return (f"--group-size {n}: megatron-core needs --pp <= N <= --microbatches, here "
                f"{pp} <= N <= {m}; pass --group-size {pp}, or leave it out (N = --pp)")
    if 0 < m % group < pp:
        fixed = m - m % group + (group if group == pp else pp)
        return (f"--microbatches {m}: {m} mod N = {m % group} (N = "
                f"{'--group-size' if n is not None else '--pp'} = {group}) is between 0 and "
                f"--pp = {pp}, which megatron-core rejects; pass --microbatches {fixed}")
    fault = getattr(args, "fault", None)
    if fault is not None:
        from lab.demo import faults  # imports torch: only once a fault is asked for

        names, in_megatron_lm = sorted(faults.ALL), faults.IN_MEGATRON_LM
        if fault not in names:
            return f"--fault {fault}: not a known fault; pass one of " + ", ".join(names)
        if getattr(args, "loop", None) == "megatron-lm" and fault not in in_megatron_lm:
            # The engine faults are judged by the demo loop's own evidence (its GEMM checks);
            # Megatron-LM's loop takes the errors a rank meets on its own (the no-hang proof).
            return (f"--fault {fault}: runs in the demo's own loop only (pass --loop schedule); "
                    "in Megatron-LM's loop pass one of " + ", ".join(sorted(in_megatron_lm)))
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout > 0:
        return f"--timeout {timeout}: must be a number of seconds > 0; pass e.g. --timeout 60"
    problem = _device_problem(args)
    if problem is not None:
        return problem
    k = getattr(args, "resume_at", None)
    if k is not None and not 1 <= k < steps:
        return (f"--resume-at {k}: the checkpoint is saved after step K and the run resumes "
                f"from it, so 1 <= K < --steps = {steps}; pass --resume-at 1"
                if steps > 1 else f"--resume-at {k}: needs --steps 2 or more")
    if getattr(args, "manual_post_processing", False) and not _mcore_post_processes():
        return ("--manual-post-processing: the installed megatron-core has no FP8 post-all-gather "
                "processing to model (megatron-core >= 0.16 has); leave the flag out")
    return recipe_problem(args) or telemetry_path_problem(args.telemetry)


#: The largest value of each size flag the CPU demo takes (flag, attribute, limit, example):
#: every rank is a process on this machine and every microbatch a CPU forward and backward, so
#: a larger value is a typo (``--microbatches 100000000000000000000`` overflowed inside the
#: ranks after they had started).
LIMITS = (("--pp", "pp", 16, 2), ("--vp", "vp", 16, 2), ("--dp", "dp", 16, 1),
          ("--microbatches", "microbatches", 4096, 4), ("--group-size", "group_size", 4096, 2),
          ("--steps", "steps", 10000, 3), ("--dist-opt-instances", "dist_opt_instances", 16, 1),
          ("--resume-at", "resume_at", 10000, 1))
#: The most processes (--pp x --dp) the demo starts.
MAX_RANKS = 32
#: The longest --timeout, in seconds (a day; torch's own default is 30 minutes).
MAX_TIMEOUT_S = 86400.0


def _size_problem(args: argparse.Namespace) -> Optional[str]:
    """A size flag beyond what the CPU demo can run (checked first: no later rule, and no rank,
    ever sees an absurd number)."""
    for flag, name, limit, example in LIMITS:
        value = getattr(args, name, None)
        if value is not None and value > limit:
            return (f"{flag} {value}: the CPU demo takes at most {limit}; pass a small value, "
                    f"e.g. {flag} {example}")
    ranks = args.pp * args.dp
    if ranks > MAX_RANKS:
        return (f"--pp {args.pp} --dp {args.dp}: {ranks} processes, the CPU demo starts at most "
                f"{MAX_RANKS} (--pp x --dp); pass e.g. --pp 2 --dp 2")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and timeout > MAX_TIMEOUT_S:  # inf too (nan: the rule below)
        return (f"--timeout {timeout}: at most {MAX_TIMEOUT_S:.0f} seconds (a day); pass e.g. "
                "--timeout 600, or leave it out (torch's 30 minutes)")
    return None


def _instances_problem(dp: int, n: int) -> Optional[str]:
    """megatron-core's own rule (initialize_model_parallel asserts it): the data-parallel
    ranks split evenly into the optimizer instances."""
    if n < 1:
        return (f"--dist-opt-instances {n}: at least one optimizer instance; pass "
                "--dist-opt-instances 1")
    if dp % n:
        return (f"--dist-opt-instances {n}: megatron-core splits the --dp {dp} data-parallel "
                f"ranks evenly into the instances, and {n} does not divide {dp}; pass --dp "
                f"{dp + n - dp % n}, or --dist-opt-instances 1")
    return None


def recipe_problem(args: argparse.Namespace) -> Optional[str]:
    """Why ``--recipe`` cannot run here (None when it can): the plugin's own refusal of the
    recipe on this megatron-core, and the flags that model another post-processing."""
    recipe = getattr(args, "recipe", RECIPES[0])
    if recipe in ("delayed", "tensorwise"):
        return None
    if getattr(args, "manual_post_processing", False):
        return (f"--recipe {recipe} --manual-post-processing: the block-scaled recipes are "
                "always post-processed by megatron-core; leave --manual-post-processing out")
    if getattr(args, "loop", LOOPS[0]) != LOOPS[0]:
        return f"--recipe {recipe}: runs in the demo's own loop only; pass --loop schedule"
    try:
        from nemo_fp8_align.support import mcore_features, recipe_refusals
        from nemo_fp8_align.support import RECIPE_KIND
        refused = recipe_refusals([RECIPE_KIND[recipe]], mcore_features())
        from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:
        return None  # the missing dependency is reported on its own
    if refused:
        return f"--recipe {recipe}: {refused[0]}"
    if recipe == "mxfp8" and not hasattr(pgb, "copy_tensor_to_quantized_param"):
        return ("--recipe mxfp8: the demo hands megatron-core's re-quantization to its reference "
                "weights through copy_tensor_to_quantized_param (megatron-core >= 0.19; 0.18 "
                "copies with the TE tensor's own copy_); run it on 0.19")
    return None


def _device_problem(args: argparse.Namespace) -> Optional[str]:
    """Why ``--device cuda`` cannot run as asked (None when it can, or when not asked)."""
    if getattr(args, "device", "cpu") != "cuda":
        return None
    if getattr(args, "loop", None) != "megatron-lm":
        return ("--device cuda: runs Megatron-LM's loop only; pass --loop megatron-lm, or leave "
                "--device out")
    import torch

    if not torch.cuda.is_available():
        return "--device cuda: no CUDA device is visible here; leave --device out (CPU)"
    return None


def _mcore_post_processes() -> bool:
    try:
        from megatron.core.distributed import param_and_grad_buffer
    except ImportError:
        return True  # the missing dependency is reported on its own
    return hasattr(param_and_grad_buffer, "post_all_gather_processing")


def version_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the installed megatron-core cannot run the demo as asked (None: it can). On 0.7/0.8
    the optimizer owns the all-gather: the flags that model >= 0.9's DDP all-gather paths
    (the optimizer-step dispatch, DDP's forced all-gather, post-processing, checkpoints) are
    refused, named with the version."""
    from nemo_fp8_align.cli.common import _importable

    if not _importable("megatron.core"):
        return None  # the missing dependency is reported on its own
    from nemo_fp8_align import mcore_versions as mcore_version

    instances = getattr(args, "dist_opt_instances", 1)
    if instances > 1 and not mcore_version.has_optimizer_instances():
        return (f"--dist-opt-instances {instances}: megatron-core "
                f"{mcore_version.installed_version()} (before 0.10) has one distributed-"
                "optimizer instance only; leave the flag out, or use megatron-core >= 0.10")
    if not mcore_version.optimizer_owns_gather():
        return None
    flags = [flag for flag, on in (
        ("--overlap-param-gather-with-optimizer-step",
         getattr(args, "overlap_param_gather_with_optimizer_step", False)),
        ("--eval-between-steps", getattr(args, "eval_between_steps", False)),
        ("--resume-at", getattr(args, "resume_at", None) is not None),
        ("--loop megatron-lm", getattr(args, "loop", LOOPS[0]) != LOOPS[0])) if on]
    if not flags:
        return None
    return (f"{flags[0]}: megatron-core {mcore_version.installed_version()} (before 0.9) has no "
            "such path: its all-gather is the DistributedOptimizer's chain, which the demo runs "
            "with the plain step only; leave the flag out, or use megatron-core >= 0.9")


def legacy_schedule_problem(args: argparse.Namespace) -> Optional[str]:
    """megatron-core < 0.10's own schedule rules (no N; M a multiple of PP), spelled for the
    installed version; None where they hold, or megatron-core is newer or not installed (the
    missing dependency is reported on its own)."""
    from nemo_fp8_align.cli.common import _importable

    if not _importable("megatron.core"):
        return None
    from nemo_fp8_align import mcore_versions as mcore_version

    if mcore_version.has_group_size():
        return None
    if args.group_size is not None:
        return (f"--group-size {args.group_size}: megatron-core "
                f"{mcore_version.installed_version()} (before 0.10) has no "
                "microbatch_group_size_per_vp_stage; its interleaved schedule runs forwards in "
                "groups of PP: leave --group-size out")
    pp_rule = mcore_version.interleaved_pp_problem(args.pp)
    if pp_rule is not None:
        return f"--pp {args.pp}: {pp_rule}"
    multiple = mcore_version.pp_multiple_problem(args.pp, args.microbatches)
    return None if multiple is None else f"--microbatches {args.microbatches}: {multiple}"


def loop_problem(loop: str) -> Optional[str]:
    """Why ``--loop megatron-lm`` cannot run here (None when it can)."""
    if loop != "megatron-lm":
        return None
    from nemo_fp8_align.cli.common import _importable

    if not _importable("megatron.training.models"):
        return ("--loop megatron-lm: Megatron-LM's training loop (megatron.training with its "
                "model builders) is not installed; it ships in the megatron-core >= 0.19 wheel "
                "(Python >= 3.12): pip install 'megatron-core>=0.19' omegaconf")
    return None


def telemetry_path_problem(path: Optional[str]) -> Optional[str]:
    """Why ``--telemetry PATH`` cannot be written (None when it can): checked before the run."""
    if path is None:
        return None
    if path == "" or path.endswith(os.sep):
        return f"--telemetry {path!r}: not a file name; pass a file path, e.g. telemetry.jsonl"
    if os.path.isdir(path):
        return (f"--telemetry {path}: is a directory; pass a file inside it, e.g. "
                f"{os.path.join(path, 'telemetry.jsonl')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return (f"--telemetry {path}: the directory {parent} does not exist; create it "
                "(mkdir -p) or pass a path in an existing directory")
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        return f"--telemetry {path}: {target} is not writable; pass a path you can write"
    return None


def run_demo_command(args: argparse.Namespace) -> int:
    problem = (demo_input_problem(args) or missing_dependency("demo", DEMO_NEEDS)
               or loop_problem(getattr(args, "loop", LOOPS[0])) or version_problem(args))
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from lab.demo.launch import DemoTelemetryError, alignment_problems, format_report, run_demo
    from lab.demo.train import DemoOptions
    from lab.demo.ranks import DemoRankError

    opts = DemoOptions(pp=args.pp, vp=args.vp, dp=args.dp, microbatches=args.microbatches,
                       group_size=args.group_size, steps=args.steps, policy=Policy(args.policy),
                       fault=args.fault, pg_timeout_s=args.timeout,
                       overlap_param_gather_with_optimizer_step=(
                           args.overlap_param_gather_with_optimizer_step),
                       resume_at=args.resume_at, eval_after_each_step=args.eval_between_steps,
                       eval_forced_sync=args.eval_between_steps,
                       manual_post_processing=args.manual_post_processing, recipe=args.recipe,
                       device=getattr(args, "device", "cpu"),
                       dist_opt_instances=args.dist_opt_instances,
                       eval_interval=2 if args.eval_between_steps else 0)
    try:
        if args.loop == "megatron-lm":
            from lab.demo.launch_megatron_lm import run_megatron_lm_demo

            result = run_megatron_lm_demo(opts, args.telemetry)
        else:
            result = run_demo(opts, args.telemetry)
    except DemoRankError as err:
        for text in err.reports.values():
            print(f"FAILED: {text}", file=sys.stderr)
        return 1
    except DemoTelemetryError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    if opts.device == "cuda":
        return _gpu_report(opts, result)
    print(format_report(result))
    problems = alignment_problems(result)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if not problems and opts.policy is Policy.OFF:
        print("OK: every FP8 weight was transposed once per step (plugin off: no telemetry).")
    elif not problems and (opts.manual_post_processing or (
            opts.recipe not in ("delayed", "tensorwise") and opts.eval_after_each_step)):
        print("OK: no GEMM read a stale FP8 copy (megatron-core built the transposes); every "
              "chunk's all-gather finished at the same slot on every pipeline rank.")
    elif not problems:
        print("OK: every chunk's transposes ran once per step per weight, after its all-gather, "
              + ("at the same slot on every pipeline rank." if opts.policy is Policy.ALIGNED
                 else "at each rank's first use (lazy)."))
    return 1 if problems else 0


def _gpu_report(opts: Any, result: Any) -> int:
    """``--device cuda``: the checks of demo/megatron_lm_gpu_judge.py, one line each way."""
    from lab.demo.megatron_lm_gpu_judge import gpu_problems

    losses = result.ranks[-1]["losses"]
    print(f"Megatron-LM train() on {opts.world_size} ranks sharing one GPU "
          f"({result.ranks[0]['process_groups']}), policy {opts.policy.value}: losses "
          + ", ".join(f"{x:.6f}" for x in losses))
    problems = gpu_problems(opts, result.ranks)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("OK: Transformer Engine built every FP8 weight's transpose once per step, at the "
              + ("same slot on every pipeline rank." if opts.policy is Policy.ALIGNED
                 else "chunk's first use."))
    return 1 if problems else 0
