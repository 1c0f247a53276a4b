"""The GEMM references against independent float64 PyTorch math and autograd."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn

TORCH_ACTIVATIONS = {
    None: lambda z: z,
    "gelu": lambda z: F.gelu(z),
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_reference_matches_torch_float64(seed, activation, with_bias):
    a = randn(2, 7, 13, dtype=torch.float64, seed=seed)
    b = randn(13, 5, dtype=torch.float64, seed=seed + 1)
    bias = randn(5, dtype=torch.float64, seed=seed + 2) if with_bias else None
    expected = TORCH_ACTIVATIONS[activation](F.linear(a, b.T, bias))
    torch.testing.assert_close(reference.matmul(a, b, bias, activation), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
def test_matmul_backward_reference_matches_autograd(seed, activation):
    a = randn(3, 4, 9, dtype=torch.float64, seed=seed, requires_grad=True)
    b = randn(9, 6, dtype=torch.float64, seed=seed + 1, requires_grad=True)
    bias = randn(6, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    dy = randn(3, 4, 6, dtype=torch.float64, seed=seed + 3)
    y = TORCH_ACTIVATIONS[activation](a @ b + bias)
    expected = torch.autograd.grad(y, (a, b, bias), dy)
    got = reference.matmul_backward(a.detach(), b.detach(), dy, bias.detach(), activation)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_matmul_reference_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        reference.matmul(torch.ones(2, 2), torch.ones(2, 2), activation="tanh")


@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_matmul_reference_applies_scales(seed, rowwise):
    a = randn(6, 16, dtype=torch.float64, seed=seed)
    b = randn(16, 10, dtype=torch.float64, seed=seed + 1)
    if rowwise:
        sa = torch.rand(6, 1, dtype=torch.float32, generator=torch.Generator().manual_seed(seed)) + 0.5
        sb = torch.rand(1, 10, dtype=torch.float32, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    else:
        sa, sb = torch.tensor(0.25), torch.tensor(3.0)
    bias = randn(10, dtype=torch.float64, seed=seed + 2)
    expected = torch.einsum("mk,kn->mn", a, b) * sa.double() * sb.double() + bias
    torch.testing.assert_close(reference.fp8_matmul(a, b, sa, sb, bias), expected, rtol=1e-12, atol=1e-12)


def test_unpack_int4_low_nibble_first():
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert reference.unpack_int4(packed).tolist() == [[1, 2, 0, 15]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_zeros", [False, True])
def test_dequantize_weight_matches_elementwise_formula(bits, with_zeros):
    gen = torch.Generator().manual_seed(bits + 10 * with_zeros)
    n, k, gs = 3, 8, 4
    hi = 16 if bits == 4 else (256 if with_zeros else 128)
    lo = 0 if (bits == 4 or with_zeros) else -127
    codes = torch.randint(lo, hi, (n, k), generator=gen)
    scales = torch.rand(n, k // gs, generator=gen, dtype=torch.float64) + 0.1
    zeros = torch.randint(0, hi, (n, k // gs), generator=gen).to(torch.uint8) if with_zeros else None
    if bits == 4:
        qdata = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    else:
        qdata = codes.to(torch.uint8 if with_zeros else torch.int8)
    w = reference.dequantize_weight(qdata, scales, zeros, bits=bits, group_size=gs)
    for i in range(n):
        for j in range(k):
            z = int(zeros[i, j // gs]) if with_zeros else (8 if bits == 4 else 0)
            assert w[i, j].item() == (int(codes[i, j]) - z) * scales[i, j // gs].item()
    x = randn(5, k, dtype=torch.float64, seed=1)
    torch.testing.assert_close(
        reference.quantized_matmul(x, qdata, scales, zeros, bits=bits, group_size=gs), x @ w.T, rtol=1e-12, atol=0
    )


def test_rms_norm_linear_reference_matches_unfused_float64(seed):
    x = randn(2, 5, 24, dtype=torch.float64, seed=seed, scale=3.0)
    g = randn(24, dtype=torch.float64, seed=seed + 1)
    w = randn(7, 24, dtype=torch.float64, seed=seed + 2)
    bias = randn(7, dtype=torch.float64, seed=seed + 3)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    torch.testing.assert_close(
        reference.rms_norm_linear(x, g, w, 1e-5, bias), F.linear(h, w, bias), rtol=1e-12, atol=1e-12
    )


def test_gemm_reference_compute_dtype_is_honoured():
    a = randn(3, 8, dtype=torch.bfloat16, seed=0)
    b = randn(8, 4, dtype=torch.bfloat16, seed=1)
    assert reference.matmul(a, b).dtype == torch.float64
    assert reference.matmul(a, b, compute_dtype=torch.float32).dtype == torch.float32
