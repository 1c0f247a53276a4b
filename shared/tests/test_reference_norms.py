"""The norm references against independent float64 PyTorch math (torch.nn.functional) and
their backward functions against autograd."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn

F64 = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_reference_matches_torch_rms_norm(seed, affine):
    x = randn(3, 5, 37, dtype=torch.float64, seed=seed, scale=3.0)
    w = randn(37, dtype=torch.float64, seed=seed + 1) if affine else None
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), F.rms_norm(x, (37,), w, 1e-6), **F64)


def test_rms_norm_reference_offset_is_gemma_convention(seed):
    x = randn(4, 29, dtype=torch.float64, seed=seed)
    w = randn(29, dtype=torch.float64, seed=seed + 1)
    expected = F.rms_norm(x, (29,), None, 1e-6) * (1.0 + w)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6, offset=1.0), expected, **F64)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_reference_matches_torch_layer_norm(seed, affine):
    x = randn(6, 53, dtype=torch.float64, seed=seed, scale=2.0) + 5.0
    w = randn(53, dtype=torch.float64, seed=seed + 1) if affine else None
    b = randn(53, dtype=torch.float64, seed=seed + 2) if affine else None
    torch.testing.assert_close(reference.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (53,), w, b, 1e-5), **F64)


def test_norm_statistics_references_match_torch_var_mean(seed):
    x = randn(3, 4, 41, dtype=torch.float64, seed=seed, scale=2.0) + 3.0
    var, mean = torch.var_mean(x, dim=-1, correction=0)
    ref_mean, ref_rstd = reference.layer_norm_stats(x, 1e-5)
    torch.testing.assert_close(ref_mean, mean, **F64)
    torch.testing.assert_close(ref_rstd, (var + 1e-5).rsqrt(), **F64)
    torch.testing.assert_close(reference.rms_norm_rstd(x, 1e-6), (x.square().mean(-1) + 1e-6).rsqrt(), **F64)


def test_residual_rms_norm_reference_returns_sum_and_its_norm(seed):
    x = randn(2, 7, 40, dtype=torch.float64, seed=seed)
    r = randn(2, 7, 40, dtype=torch.float64, seed=seed + 1)
    w = randn(40, dtype=torch.float64, seed=seed + 2)
    y, u = reference.residual_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(u, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, F.rms_norm(x + r, (40,), w, 1e-6), **F64)


def test_rms_norm_gated_reference_is_norm_times_silu_gate(seed):
    x = randn(5, 33, dtype=torch.float64, seed=seed)
    z = randn(5, 33, dtype=torch.float64, seed=seed + 1, scale=3.0)
    w = randn(33, dtype=torch.float64, seed=seed + 2)
    expected = F.rms_norm(x, (33,), w, 1e-6) * z * torch.sigmoid(z)
    torch.testing.assert_close(reference.rms_norm_gated(x, z, w, 1e-6), expected, **F64)


def _grads(fn, inputs, dy):
    """Autograd gradients of sum(fn(*inputs) * dy) w.r.t. the inputs that require grad."""
    out = fn(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(out, leaves, dy)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_backward_reference_matches_autograd(seed, affine, offset):
    x = randn(3, 4, 31, dtype=torch.float64, seed=seed, requires_grad=True)
    w = randn(31, dtype=torch.float64, seed=seed + 1, requires_grad=True) if affine else None
    dy = randn(3, 4, 31, dtype=torch.float64, seed=seed + 2)

    def forward(x, w):
        y = F.rms_norm(x, (31,), None, 1e-6)
        return y if w is None else y * (offset + w)

    expected = _grads(forward, (x, w), dy)
    w_in = None if w is None else w.detach()
    dx, dw = reference.rms_norm_backward(dy, x.detach(), w_in, 1e-6, offset=offset)
    torch.testing.assert_close(dx, expected[0], **F64)
    if affine:
        torch.testing.assert_close(dw, expected[1], **F64)
    else:
        assert dw is None


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_reference_matches_autograd(seed, affine):
    x = randn(5, 27, dtype=torch.float64, seed=seed, requires_grad=True)
    w = randn(27, dtype=torch.float64, seed=seed + 1, requires_grad=True) if affine else None
    b = randn(27, dtype=torch.float64, seed=seed + 2, requires_grad=True) if affine else None
    dy = randn(5, 27, dtype=torch.float64, seed=seed + 3)
    expected = _grads(lambda x, w, b: F.layer_norm(x, (27,), w, b, 1e-5), (x, w, b), dy)
    dx, dw, db = reference.layer_norm_backward(
        dy, x.detach(), None if w is None else w.detach(), None if b is None else b.detach(), 1e-5
    )
    torch.testing.assert_close(dx, expected[0], **F64)
    if affine:
        torch.testing.assert_close(dw, expected[1], **F64)
        torch.testing.assert_close(db, expected[2], **F64)
    else:
        assert dw is None and db is None


@pytest.mark.parametrize("use_u", [True, False])
def test_residual_rms_norm_backward_reference_matches_autograd(seed, use_u):
    x = randn(6, 24, dtype=torch.float64, seed=seed, requires_grad=True)
    r = randn(6, 24, dtype=torch.float64, seed=seed + 1, requires_grad=True)
    w = randn(24, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    dy = randn(6, 24, dtype=torch.float64, seed=seed + 3)
    du = randn(6, 24, dtype=torch.float64, seed=seed + 4) if use_u else None
    u = x + r
    y = F.rms_norm(u, (24,), w, 1e-6)
    outs, grads = ([y, u], [dy, du]) if use_u else ([y], [dy])
    gx, gr, gw = torch.autograd.grad(outs, (x, r, w), grads)
    dsum, dw = reference.residual_rms_norm_backward(dy, du, x.detach(), r.detach(), w.detach(), 1e-6)
    torch.testing.assert_close(dsum, gx, **F64)
    torch.testing.assert_close(dsum, gr, **F64)
    torch.testing.assert_close(dw, gw, **F64)


def test_rms_norm_gated_backward_reference_matches_autograd(seed):
    x = randn(4, 35, dtype=torch.float64, seed=seed, requires_grad=True)
    z = randn(4, 35, dtype=torch.float64, seed=seed + 1, scale=3.0, requires_grad=True)
    w = randn(35, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    dy = randn(4, 35, dtype=torch.float64, seed=seed + 3)
    expected = _grads(lambda x, z, w: F.rms_norm(x, (35,), w, 1e-6) * F.silu(z), (x, z, w), dy)
    got = reference.rms_norm_gated_backward(dy, x.detach(), z.detach(), w.detach(), 1e-6)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **F64)


def test_norm_references_honour_compute_dtype():
    x = randn(3, 8, dtype=torch.bfloat16, seed=0)
    w = randn(8, dtype=torch.float32, seed=1)
    assert reference.rms_norm(x, w).dtype == torch.float64
    assert reference.layer_norm(x, w, None, compute_dtype=torch.float32).dtype == torch.float32
    assert reference.rms_norm_gated(x, x, w, compute_dtype=torch.float32).dtype == torch.float32
    y, u = reference.residual_rms_norm(x, x, None, compute_dtype=torch.float32)
    assert y.dtype == u.dtype == torch.float32
