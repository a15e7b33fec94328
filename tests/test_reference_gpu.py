"""The reference FP8 linear's real FP8 GEMMs (torch._scaled_mm) on a CUDA GPU with FP8 cores."""

import pytest
import torch

from nemo_fp8_align.backends.reference import ReferenceBackend
from nemo_fp8_align.backends.reference_linear import ReferenceFP8Linear

pytestmark = pytest.mark.gpu

_REASON = "needs a CUDA GPU with FP8 tensor cores (sm_89+)"
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason=_REASON)


@needs_fp8_gpu
def test_scaled_mm_linear_matches_dequantized_reference():
    torch.manual_seed(0)
    with torch.device("cuda"):
        lin = ReferenceFP8Linear(256, 512, backend=ReferenceBackend(), name="lin")
        x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    w = lin.fp8_weight.dequantized()
    ref = x.float() @ w.t()
    assert (y.float() - ref).abs().max() / ref.abs().max() < 0.08  # e4m3 activations
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_dx = dy.float() @ w
    assert (x.grad.float() - ref_dx).abs().max() / ref_dx.abs().max() < 0.15  # e5m2 grads
    assert lin.fp8_weight.transposes_built == 1


@needs_fp8_gpu
def test_hopper_rejects_the_untransposed_weight_in_dgrad():
    # Why the transpose exists: the data-gradient GEMM cannot read W [out, in] row-major.
    dy = torch.randn(64, 512, device="cuda").to(torch.float8_e5m2)
    w = torch.randn(512, 256, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("datacenter Blackwell accepts non-TN FP8 GEMMs")
    with pytest.raises(RuntimeError):
        torch._scaled_mm(dy, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


@needs_fp8_gpu
def test_stale_transpose_is_an_error_on_gpu():
    with torch.device("cuda"):
        lin = ReferenceFP8Linear(64, 64, backend=ReferenceBackend(), name="lin")
        y = lin(torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True))
    lin.fp8_weight.invalidate()
    with pytest.raises(RuntimeError, match="transpose cache used while stale"):
        y.sum().backward()
