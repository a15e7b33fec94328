"""Faults for the NeMo smoke run's spawned ranks (validation/smoke_nemo.sh), test use only.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry holding one; the
smoke script puts this directory on ``PYTHONPATH`` for the runs that need it, so every rank
torchrun spawns applies the faults named in ``NEMO_FP8_ALIGN_SMOKE_FAULTS`` (comma-separated)
before NeMo starts. Nothing in the package imports this file.

* ``deferred_all_gather``: a slow network taken to its limit. megatron-core's asynchronous
  parameter all-gather delivers its bytes only when someone waits for it (the collective runs
  at the wait, in the same order on every data-parallel rank), so any FP8 copy taken before the
  wait is deterministically built from last step's bytes. A correct plugin is unaffected.
* ``no_wait``: the plugin's wait for a chunk's all-gather returns at once and claims it is
  complete (the fault the plugin-on/off loss comparison must catch).
* ``unchecked``: the reference FP8 GEMMs skip their provenance check (StaleFP8Error), so a
  stale FP8 copy is computed with and only the losses can show it.
* ``verify_fails_on_one_rank``: the demo's one-rank error (a flipped transpose byte under
  verification, on the last rank, in step 1): every rank must stop with the plugin's error.
"""

import os


def _deferred_all_gather():
    from lab.demo.faults import inject

    inject("deferred_all_gather")  # the demo's slow network (a harmless variation there)


def _no_wait():
    from lab.demo.faults import inject

    inject("no_wait")  # the same fault the demo's mutation tests use


def _unchecked():
    from nemo_fp8_align.backends.reference import ReferenceFP8Weight

    ReferenceFP8Weight.check_provenance = lambda self, use: None


def _verify_fails_on_one_rank():
    from lab.demo.faults import inject

    inject("verify_fails_on_one_rank")  # the one-rank error of the demo's no-hang tests


_FAULTS = {"deferred_all_gather": _deferred_all_gather, "no_wait": _no_wait,
           "unchecked": _unchecked, "verify_fails_on_one_rank": _verify_fails_on_one_rank}

for _name in filter(None, os.environ.get("NEMO_FP8_ALIGN_SMOKE_FAULTS", "").split(",")):
    if _name not in _FAULTS:
        raise SystemExit(f"NEMO_FP8_ALIGN_SMOKE_FAULTS: unknown fault {_name!r}; choose from "
                         + ", ".join(sorted(_FAULTS)))
    _FAULTS[_name]()
