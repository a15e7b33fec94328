"""The plain-torch FP8 weight: cast/scale, transpose cache, and the GEMMs that read them."""

import pytest
import torch

from nemo_fp8_align.backends.reference import FP8_E4M3_MAX, ReferenceBackend, ReferenceFP8Weight
from nemo_fp8_align.backends.reference_linear import ReferenceFP8Linear


def test_quantize_and_transpose_bytes():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, 5))
    w = ReferenceFP8Weight(p, name="w")
    backend = ReferenceBackend()
    assert backend.build_transposes([w]) == 1
    assert torch.equal(w.transpose.view(torch.uint8), w.data.view(torch.uint8).t())
    assert w.data.float().abs().max().item() == pytest.approx(FP8_E4M3_MAX)
    # dequantised weight close to the source (e4m3 has a 3-bit mantissa)
    assert torch.allclose(w.dequantized(), p.detach(), rtol=0.07, atol=1e-3)
    assert backend.build_transposes([w]) == 0  # still valid: no second transpose
    assert w.transposes_built == 1


def test_invalidate_then_rebuild_sees_new_values():
    p = torch.nn.Parameter(torch.ones(4, 3))
    w = ReferenceFP8Weight(p)
    backend = ReferenceBackend()
    backend.build_transposes([w])
    with torch.no_grad():
        p.mul_(-2)
    w.invalidate()
    assert not backend.has_valid_transpose(w)
    backend.build_transposes([w])
    assert torch.all(w.dequantized_transpose() == -2)
    assert w.transposes_built == 2


def test_linear_forward_builds_lazily_and_backward_uses_transpose():
    torch.manual_seed(0)
    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(), name="lin")
    x = torch.randn(3, 6, requires_grad=True)
    y = lin(x)
    assert lin.fp8_weight.transposes_built == 1
    w = lin.fp8_weight.dequantized()
    assert torch.allclose(y, x @ w.t())
    y.sum().backward()
    assert torch.allclose(x.grad, torch.ones(3, 4) @ w)
    assert torch.allclose(lin.weight.grad, torch.ones(3, 4).t() @ x.detach())


def test_no_transpose_without_grad():
    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend())
    with torch.no_grad():
        lin(torch.randn(2, 6))
    assert lin.fp8_weight.transposes_built == 0 and lin.fp8_weight.data_valid


def test_stale_transpose_in_backward_is_an_error():
    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(), name="lin")
    y = lin(torch.randn(2, 6, requires_grad=True))
    lin.fp8_weight.invalidate()  # something reset the cache between forward and backward
    with pytest.raises(RuntimeError, match="transpose cache used while stale"):
        y.sum().backward()


def test_non_2d_source_rejected():
    with pytest.raises(ValueError, match="must be 2-D"):
        ReferenceFP8Weight(torch.nn.Parameter(torch.ones(3)), name="b")


def test_transpose_of_bytes_the_all_gather_replaced_is_an_error():
    """The parameter receives new bytes after the transpose was built (as when the transpose is
    taken before the all-gather finished): the backward GEMM refuses to read it."""
    from nemo_fp8_align.backends.reference import StaleFP8Error

    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(), name="lin")
    lin.backend.build_transposes([lin.fp8_weight])  # "at the slot", from the old bytes
    with torch.no_grad():
        lin.weight.add_(0.5)  # the all-gather delivers this step's values afterwards
    with pytest.raises(StaleFP8Error, match="FP8 data read by the forward"):
        lin(torch.randn(2, 6, requires_grad=True))
    y = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(), name="lin2")
    out = y(torch.randn(2, 6, requires_grad=True))
    with torch.no_grad():
        y.weight.mul_(2.0)  # bytes change between forward and backward
    with pytest.raises(StaleFP8Error, match="transpose read by the backward"):
        out.sum().backward()


def test_provenance_check_can_be_turned_off_for_timing():
    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(check_provenance=False))
    lin.backend.build_transposes([lin.fp8_weight])
    with torch.no_grad():
        lin.weight.add_(0.5)
    lin(torch.randn(2, 6, requires_grad=True)).sum().backward()  # stale, but not checked


def test_verify_mode_reference_backend_compares_bytes_and_provenance():
    backend = ReferenceBackend()
    lin = ReferenceFP8Linear(6, 4, backend=backend, name="lin")
    w = lin.fp8_weight
    assert backend.transpose_mismatch(w) == "transpose cache invalid"
    backend.build_transposes([w])
    assert backend.transpose_mismatch(w) is None
    w.transpose.view(torch.uint8)[0, 0] ^= 1
    assert "differ" in backend.transpose_mismatch(w)
    backend.build_transposes([w])  # still marked valid: nothing rebuilt
    w.transpose_valid = False
    backend.build_transposes([w])
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert "not the current ones" in backend.transpose_mismatch(w)


def test_bytes_delivered_during_the_cast_do_not_vouch_for_the_copy(monkeypatch):
    """An asynchronous all-gather may write the parameter while its FP8 copy is being cast:
    the copy's provenance is the bytes it was cast from, so the GEMM still refuses it."""
    from nemo_fp8_align.backends.reference import StaleFP8Error

    lin = ReferenceFP8Linear(6, 4, backend=ReferenceBackend(), name="lin")
    cast = ReferenceFP8Weight._cast

    def cast_then_deliver(self, src):
        cast(self, src)
        with torch.no_grad():
            self.source.add_(0.5)  # the all-gather lands between the cast and the digest

    monkeypatch.setattr(ReferenceFP8Weight, "_cast", cast_then_deliver)
    lin.backend.build_transposes([lin.fp8_weight])
    monkeypatch.setattr(ReferenceFP8Weight, "_cast", cast)
    with pytest.raises(StaleFP8Error, match="FP8 data read by the forward"):
        lin(torch.randn(2, 6, requires_grad=True))
