"""The activation / gated-MLP references against torch.nn.functional (float64) and autograd."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn

APPROX = ["none", "tanh"]


def _grads(fn, inputs, dy):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*inputs), inputs, dy)


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_reference_matches_torch_float64(seed, approximate):
    x = randn(7, 33, dtype=torch.float64, seed=seed, scale=3.0)
    torch.testing.assert_close(
        reference.gelu(x, approximate), F.gelu(x, approximate=approximate), rtol=1e-13, atol=1e-15
    )


def test_exact_gelu_reference_keeps_relative_accuracy_down_the_left_tail():
    """Phi from erfc: x * Phi(x) is the tail integral itself, where 1 + erf(x / sqrt(2)) would
    cancel to 0 in float64 below x = -8.3. Checked against the asymptotic series
    Phi(x) = phi(x) / |x| * (1 - 1/x^2 + 3/x^4 - 15/x^6 + ...), exact to 1e-9 at |x| >= 20."""
    x = torch.tensor([-20.0, -30.0, -37.0], dtype=torch.float64)
    pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
    series = pdf / x.abs() * (1 - x**-2 + 3 * x**-4 - 15 * x**-6 + 105 * x**-8)
    torch.testing.assert_close(reference.gelu(x), x * series, rtol=1e-9, atol=0.0)


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_backward_reference_matches_autograd(seed, approximate):
    x = randn(5, 29, dtype=torch.float64, seed=seed, scale=3.0)
    dy = randn(5, 29, dtype=torch.float64, seed=seed + 1)
    (expected,) = _grads(lambda t: F.gelu(t, approximate=approximate), [x], dy)
    torch.testing.assert_close(reference.gelu_backward(x, dy, approximate), expected, rtol=1e-12, atol=1e-14)


def test_silu_reference_and_backward_match_torch(seed):
    x = randn(6, 31, dtype=torch.float64, seed=seed, scale=4.0)
    dy = randn(6, 31, dtype=torch.float64, seed=seed + 1)
    torch.testing.assert_close(reference.silu(x), F.silu(x), rtol=1e-13, atol=1e-15)
    (expected,) = _grads(F.silu, [x], dy)
    torch.testing.assert_close(reference.silu_backward(x, dy), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("approximate", APPROX)
def test_bias_gelu_reference_and_backward_match_autograd(seed, approximate):
    x = randn(2, 5, 23, dtype=torch.float64, seed=seed, scale=2.0)
    b = randn(23, dtype=torch.float64, seed=seed + 1)
    dy = randn(2, 5, 23, dtype=torch.float64, seed=seed + 2)

    def fn(x, b):
        return F.gelu(x + b, approximate=approximate)

    torch.testing.assert_close(reference.bias_gelu(x, b, approximate), fn(x, b), rtol=1e-13, atol=1e-15)
    dx, db = reference.bias_gelu_backward(x, b, dy, approximate)
    ex, eb = _grads(fn, [x, b], dy)
    torch.testing.assert_close(dx, ex, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(db, eb, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("act", ["silu", "gelu-none", "gelu-tanh"])
def test_gated_references_and_backward_match_autograd(seed, act):
    g = randn(3, 4, 37, dtype=torch.float64, seed=seed, scale=3.0)
    u = randn(3, 4, 37, dtype=torch.float64, seed=seed + 1)
    dy = randn(3, 4, 37, dtype=torch.float64, seed=seed + 2)
    if act == "silu":

        def fn(g, u):
            return F.silu(g) * u

        fwd, bwd = reference.swiglu, reference.swiglu_backward
        packed_fwd, packed_bwd = reference.silu_and_mul, reference.silu_and_mul_backward
        kw = {}
    else:
        approximate = act.split("-")[1]

        def fn(g, u):
            return F.gelu(g, approximate=approximate) * u

        fwd, bwd = reference.geglu, reference.geglu_backward
        packed_fwd, packed_bwd = reference.gelu_and_mul, reference.gelu_and_mul_backward
        kw = {"approximate": approximate}
    expected = fn(g, u)
    eg, eu = _grads(fn, [g, u], dy)
    torch.testing.assert_close(fwd(g, u, **kw), expected, rtol=1e-13, atol=1e-15)
    dg, du = bwd(g, u, dy, **kw)
    torch.testing.assert_close(dg, eg, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(du, eu, rtol=1e-12, atol=1e-14)
    # packed layout: x = [gate | up] along the last dim, dx packed the same way
    x = torch.cat([g, u], dim=-1)
    torch.testing.assert_close(packed_fwd(x, **kw), expected, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(packed_bwd(x, dy, **kw), torch.cat([eg, eu], dim=-1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_mlp_reference_matches_functional_block(seed, activation):
    x = randn(2, 3, 16, dtype=torch.float64, seed=seed)
    wg = randn(24, 16, dtype=torch.float64, seed=seed + 1, scale=0.25)
    wu = randn(24, 16, dtype=torch.float64, seed=seed + 2, scale=0.25)
    wd = randn(16, 24, dtype=torch.float64, seed=seed + 3, scale=0.2)
    bg, bu, bd = (randn(n, dtype=torch.float64, seed=seed + 4 + i) for i, n in enumerate((24, 24, 16)))
    act = F.silu if activation == "silu" else F.gelu
    expected = F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)
    out = reference.gated_mlp(x, wg, wu, wd, activation, gate_bias=bg, up_bias=bu, down_bias=bd)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-13)


def test_mlp_references_reject_bad_arguments():
    x = randn(2, 6, dtype=torch.float64, seed=0)
    with pytest.raises(ValueError, match="approximate"):
        reference.gelu(x, "fast")
    with pytest.raises(ValueError, match="even last dim"):
        reference.silu_and_mul(randn(2, 5, seed=0))
    with pytest.raises(ValueError, match="activation"):
        reference.gated_mlp(x, x, x, x, "relu")


def test_mlp_reference_compute_dtype_is_honoured():
    g = randn(3, 8, dtype=torch.bfloat16, seed=0)
    assert reference.swiglu(g, g).dtype == torch.float64
    assert reference.geglu(g, g, compute_dtype=torch.float32).dtype == torch.float32
    assert reference.bias_gelu_backward(g, g[0], g, compute_dtype=torch.float32)[1].dtype == torch.float32
