"""Print the global load/store instruction mix of the Triton transpose kernel (device machine).

Shows whether the compiler vectorised the aligned path (ld.global.v4 / st.global.v4) and the
registers/spills, for a few configs, on one aligned tensor (so the byte branch is not compiled).
"""
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from nemo_fp8_align.kernels import triton_transpose as tt  # noqa: E402

cfgs = [tt.KernelConfig(*c) for c in ((256, 256, 8, 1, 1, 0), (256, 256, 8, 1, 1, 2), (128, 128, 4, 1, 1, 0))]
s = [torch.zeros(256, 512, dtype=torch.uint8, device="cuda")]
o = [torch.zeros(512, 256, dtype=torch.uint8, device="cuda")]
for cfg in cfgs:
    tt.multi_transpose(s, o, cfg)
torch.cuda.synchronize()
kern = tt._multi_transpose_kernel
caches = getattr(kern, "device_caches", None) or getattr(kern, "cache", None)
compiled = []
try:
    for dev_cache in caches.values():
        c = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
        compiled.extend(c.values())
except Exception as exc:  # the cache layout differs between Triton releases
    print("could not walk the Triton cache:", exc)
for ck in compiled:
    ptx = ck.asm.get("ptx", "")
    ops = collections.Counter(re.findall(r"\b((?:ld|st)\.global[.\w]*)", ptx))
    meta = getattr(ck, "metadata", None)
    print("kernel", getattr(meta, "name", "?"), "shared", getattr(meta, "shared", "?"),
          "num_warps", getattr(meta, "num_warps", "?"), "regs", getattr(ck, "n_regs", "?"),
          "spills", getattr(ck, "n_spills", "?"))
    for k, v in sorted(ops.items()):
        print(f"   {k}: {v}")
print("compiled kernels:", len(compiled))
