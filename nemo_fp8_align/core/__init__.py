"""The engine, free of any training framework: the interleaved schedule and its alignment rule
(``schedule``), the per-step state machine that finishes each chunk's all-gather and builds its
FP8 transposes at the aligned slot (``aligner``), which aligner holds which chunk (``claims``),
the wrapping of ``config.param_sync_func`` / ``finalize_model_grads_func`` with an undo
(``config_wrap``), and the telemetry records with the judge that checks them (``telemetry``)."""
