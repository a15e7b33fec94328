"""The startup check's rules, one small function per rule, grouped by what they read: the
pipeline layout (``parallel``), the batch and microbatch arithmetic (``batch``), FP8 and the
optimizer (``fp8``)."""
