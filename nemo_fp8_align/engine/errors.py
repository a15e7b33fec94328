"""Errors the aligned FP8-transpose engine raises at run time."""

__all__ = ["StepMismatchError", "TransposeVerifyError"]


class StepMismatchError(RuntimeError):
    """The running step differs from the schedule the aligner planned (raised on every rank)."""


class TransposeVerifyError(RuntimeError):
    """Verify mode found a cached transpose that does not match its weight's bytes."""
