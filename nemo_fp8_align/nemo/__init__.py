"""Old import paths of 0.1.0 (``nemo_fp8_align.nemo.callback``, ``nemo_fp8_align.nemo.mixin``),
kept so that a NeMo or Hydra config naming the callback's or the mixin's class path still loads.
New code imports from ``nemo_fp8_align`` (or ``nemo_fp8_align.integrations.nemo``)."""
