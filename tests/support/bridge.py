"""megatron-bridge 0.6.2's ``megatron/bridge/training/callbacks.py`` (standard library only),
which ``make test`` unpacks from the wheel into .bridge-wheel/ and the tests load by path: Bridge's
package does not import on a CPU machine (its ``__init__`` needs transformers and Transformer
Engine)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BRIDGE_VERSION = "0.6.2"
#: megatron-bridge's callbacks module as the Makefile unpacks it from the wheel.
BRIDGE_CALLBACKS = (Path(__file__).resolve().parents[2] / ".bridge-wheel" / "megatron" / "bridge"
                    / "training" / "callbacks.py")


def load_bridge_callbacks(path=BRIDGE_CALLBACKS):
    """The module, imported from its file (skips the test where ``make`` has not fetched it)."""
    if not Path(path).exists():
        pytest.skip(f"{path} is absent: `make test` (or `make .bridge-wheel/.installed`) "
                    f"downloads megatron-bridge {BRIDGE_VERSION}'s wheel and unpacks it")
    name = "megatron_bridge_training_callbacks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks its own module up while being built
        spec.loader.exec_module(module)
    return sys.modules[name]
