"""The lab: what exists to produce evidence about the plugin, not to run it in a training job.

``lab.demo`` trains a small GPT on CPU through redirects that patch torch, injects named faults
and judges each run with its own evidence (``python -m lab.demo``, ``make demo``). It runs from a
checkout of the repository and imports the installed ``nemo_fp8_align``; the package never
imports from here, and the wheel does not ship it (tests/test_layout.py holds both).
"""
