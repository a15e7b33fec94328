"""Placeholder until the Triton multi-tensor kernel lands (issue 4): reports unavailable."""


def available() -> bool:
    return False


def multi_transpose(sources, outputs) -> None:  # pragma: no cover - never called while unavailable
    raise RuntimeError("the Triton multi-tensor transpose is not built yet")
