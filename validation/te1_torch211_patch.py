"""Let an installed Transformer Engine 1.13 import under torch >= 2.9 (validation/run_te1_gpu.sh,
TE1_PATCH=1; nothing of the plugin uses this). torch 2.11 no longer has ``torch.onnx._type_utils``
(and the other TorchScript-ONNX internals TE 1.13's ONNX export registers at import), so
``import transformer_engine.pytorch`` stops in ``softmax.py``. Only the ONNX export path uses
them: this makes those two imports optional and leaves everything else as TE ships it.

    python3 validation/te1_torch211_patch.py SITE   # SITE holds transformer_engine/
"""

import re
import sys
from pathlib import Path


def patch(site: Path) -> list:
    done = []
    softmax = site / "transformer_engine/pytorch/softmax.py"
    text = softmax.read_text()
    if "# torch >= 2.9" in text:
        return done  # patched before
    line = "from torch.onnx import _type_utils\n"
    if line in text:
        softmax.write_text(text.replace(line, "try:\n    " + line + "except ImportError:  # torch >= 2.9: ONNX export only\n"
                                       "    _type_utils = None\n", 1))
        done.append("softmax.py: torch.onnx._type_utils optional")
    text = softmax.read_text()
    line = "from transformer_engine.pytorch.te_onnx_extensions import compute_in_fp32\n"
    if line in text:  # used by softmax's ONNX symbolics only
        softmax.write_text(text.replace(line, "try:\n    " + line + "except ImportError:  # torch >= 2.9\n"
                                       "    compute_in_fp32 = None\n", 1))
        done.append("softmax.py: te_onnx_extensions.compute_in_fp32 optional")
    init = site / "transformer_engine/pytorch/__init__.py"
    text = init.read_text()
    block = re.search(r"^from transformer_engine\.pytorch\.te_onnx_extensions import \((?:.|\n)*?^\)\n",
                      text, re.M)
    if block:
        body = "".join("    " + ln + "\n" for ln in block.group(0).splitlines())
        init.write_text(text.replace(block.group(0), "try:  # torch >= 2.9 lacks its ONNX internals\n"
                                     + body + "except ImportError:\n    pass\n", 1))
        done.append("__init__.py: te_onnx_extensions optional")
    return done


if __name__ == "__main__":
    for what in patch(Path(sys.argv[1])) or ["nothing to patch"]:
        print("patched", what)
