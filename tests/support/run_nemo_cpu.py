"""Run an unmodified NeMo training script on the CPU: CI's smoke run and tests ONLY.

    torchrun --nproc-per-node 4 -m support.run_nemo_cpu SCRIPT [Hydra overrides]

Switches on :func:`support.cpu_nemo.enable_nemo_cpu_compat` in this process (it
refuses on a machine with a GPU), then runs ``SCRIPT`` as ``__main__`` with the remaining
arguments, as ``python SCRIPT ...`` would. It is how the smoke run drives NeMo's stock
``megatron_gpt_pretraining.py`` flow, which cannot be edited to call the compat layer itself;
the plugin reaches that flow only through its Lightning entry point, as on a cluster.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

__all__ = ["leave_together", "main"]

USAGE = "usage: python -m support.run_nemo_cpu SCRIPT [Hydra overrides...]"


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].endswith(".py"):
        raise SystemExit(f"{USAGE}\n(got {args[:1] or 'no SCRIPT'}: SCRIPT must be a .py file)")
    script = os.path.abspath(args[0])
    if not os.path.isfile(script):
        raise SystemExit(f"{USAGE}\n(SCRIPT {args[0]!r} does not exist)")
    from support.cpu_nemo import enable_nemo_cpu_compat

    enable_nemo_cpu_compat()
    sys.argv = [script] + args[1:]
    runpy.run_path(script, run_name="__main__")
    leave_together()


def leave_together() -> None:
    """Tear the process group down on every rank at one point. Exiting with gloo's connections
    still open can let a rank that finishes first close them under a peer whose gloo threads are
    still reading: an uncaught C++ error there then aborts the peer (CI once saw a rank end with
    SIGABRT, its cause not in the log's tail; this teardown is the cheap guard, not a proven fix).
    The project's example script calls it too on the CPU (a resume run once ended with one rank's
    "terminate called without an active exception" after its last step)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
