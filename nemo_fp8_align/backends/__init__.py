"""FP8 weight backends: the protocol the aligner builds transposes through (``protocol``),
Transformer Engine's ``Float8Tensor`` per TE version (``te``), and a plain-torch reference FP8
weight with its linear layer (``reference``, ``reference_linear``) for CPU runs and tests."""
