"""The engine, free of any training framework: the interleaved schedule and its alignment rule
(``schedule``), the per-step state machine that finishes each chunk's all-gather and builds its
FP8 transposes at the aligned slot, and which aligner holds which chunk (``aligner``), what it
needs from a distributed optimizer (``adapter``; the implementations are in
:mod:`nemo_fp8_align.adapters`), the step-end agreement (``step_end``), and the telemetry
records with the judge that checks them (``telemetry``)."""
