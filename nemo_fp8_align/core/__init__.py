"""The engine, free of any training framework: the interleaved schedule and its alignment rule
(``schedule``), the per-step state machine that finishes each chunk's all-gather and builds its
FP8 transposes at the aligned slot (``aligner``), which aligner holds which chunk (``claims``),
the one hold on the schedule every loop goes through (``hold``; its megatron-core and Apex
implementations are in ``sync/``), the step-end agreement (``step_end``), the process-wide class
patches (``class_patch``), and the telemetry records with the judge that checks them
(``telemetry``)."""
