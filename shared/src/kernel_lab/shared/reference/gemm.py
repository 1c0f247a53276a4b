"""GEMM references: matmul with a bias/activation epilogue (and its backward), scaled FP8
matmul, weight-only quantized matmul (int8 / packed int4) and RMSNorm fused into a linear.

All math runs in `compute_dtype` (float64 by default) and every result stays in it. Layouts:
a / x: (..., M, K) activations; b: (K, N); `weight`: (N, K), the nn.Linear layout, so a linear
layer is `x @ weight.T`. The activation and RMSNorm formulas are imported from
`reference.mlp` and `reference.norms`: one copy of each formula in the project.

Weight-only quantized format (what `kernel_lab.gemm.quantize_weight` produces):
- `qdata`: bits=8: (N, K) int8 (symmetric) or uint8 (with zero points); bits=4: (N, K // 2)
  uint8, two codes per byte along K: code of column 2j in the low nibble, 2j + 1 in the high.
- `scales`: (N, K // group_size) floating point; group g covers columns [g*gs, (g+1)*gs).
- `zeros`: (N, K // group_size) uint8 zero points, or None: then the zero point is 0 for int8
  and 8 for int4 (symmetric int4 codes are stored offset by 8 in [1, 15]).
- dequantized weight: w[n, k] = (code[n, k] - zero[n, g]) * scale[n, g], g = k // group_size.
"""

from __future__ import annotations

import torch

from .mlp import gelu, gelu_backward, silu, silu_backward
from .norms import rms_norm

__all__ = [
    "ACTIVATIONS",
    "dequantize_weight",
    "epilogue_activation",
    "epilogue_activation_backward",
    "fp8_matmul",
    "matmul",
    "matmul_backward",
    "quantized_matmul",
    "rms_norm_linear",
    "unpack_int4",
]

# Epilogue activations of kernel_lab.gemm.matmul (None or "none": identity).
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


def _check_activation(activation: str | None) -> str:
    activation = "none" if activation is None else activation
    if activation != "none" and activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")
    return activation


def epilogue_activation(
    x: torch.Tensor, activation: str | None, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """act(x) for act in {None, "gelu" (erf), "gelu_tanh", "silu", "relu"}."""
    activation = _check_activation(activation)
    x = x.to(compute_dtype)
    if activation == "gelu":
        return gelu(x, "none", compute_dtype=compute_dtype)
    if activation == "gelu_tanh":
        return gelu(x, "tanh", compute_dtype=compute_dtype)
    if activation == "silu":
        return silu(x, compute_dtype=compute_dtype)
    if activation == "relu":
        return torch.clamp_min(x, 0)
    return x


def epilogue_activation_backward(
    x: torch.Tensor, dy: torch.Tensor, activation: str | None, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """dx = dy * act'(x), x the pre-activation (relu'(0) = 0, as torch)."""
    activation = _check_activation(activation)
    if activation == "gelu":
        return gelu_backward(x, dy, "none", compute_dtype=compute_dtype)
    if activation == "gelu_tanh":
        return gelu_backward(x, dy, "tanh", compute_dtype=compute_dtype)
    if activation == "silu":
        return silu_backward(x, dy, compute_dtype=compute_dtype)
    dy = dy.to(compute_dtype)
    if activation == "relu":
        return torch.where(x.to(compute_dtype) > 0, dy, torch.zeros_like(dy))
    return dy


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = act(a @ b + bias); a: (..., M, K), b: (K, N), bias: (N,) or None -> (..., M, N)."""
    y = a.to(compute_dtype) @ b.to(compute_dtype)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return epilogue_activation(y, activation, compute_dtype=compute_dtype)


def matmul_backward(
    a: torch.Tensor,
    b: torch.Tensor,
    dy: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(da, db, dbias) of `matmul`: with dz = dy * act'(a @ b + bias),
    da = dz @ b^T, db = sum over batch of a^T @ dz, dbias = dz summed over every leading dim."""
    a, b = a.to(compute_dtype), b.to(compute_dtype)
    z = a @ b
    if bias is not None:
        z = z + bias.to(compute_dtype)
    dz = epilogue_activation_backward(z, dy, activation, compute_dtype=compute_dtype)
    da = dz @ b.T
    db = a.reshape(-1, a.shape[-1]).T @ dz.reshape(-1, dz.shape[-1])
    dbias = None if bias is None else dz.reshape(-1, dz.shape[-1]).sum(0)
    return da, db, dbias


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = (a * scale_a) @ (b * scale_b) + bias, the torch._scaled_mm convention.

    a: (M, K), b: (K, N) (float8 values, read exactly); scale_a: a one-element tensor
    (per-tensor) or (M, 1) (per-row / per-token); scale_b: one element or (1, N) (per-column /
    per-output-channel). Scales are dequantization factors (original ~= fp8 value * scale).
    """
    sa = scale_a.to(compute_dtype).reshape(-1, 1) if scale_a.numel() > 1 else scale_a.to(compute_dtype).reshape(())
    sb = scale_b.to(compute_dtype).reshape(1, -1) if scale_b.numel() > 1 else scale_b.to(compute_dtype).reshape(())
    y = (a.to(compute_dtype) * sa) @ (b.to(compute_dtype) * sb)
    return y if bias is None else y + bias.to(compute_dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) int64 codes in [0, 15]: low nibble first along K."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1)


def dequantize_weight(
    qdata: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The (N, K) weight a quantized weight stands for (format in the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    codes = unpack_int4(qdata) if bits == 4 else qdata.to(torch.int64)
    if zeros is None:
        zeros_full = torch.full_like(codes, 8 if bits == 4 else 0)
    else:
        zeros_full = zeros.to(torch.int64).repeat_interleave(group_size, dim=1)
    scales_full = scales.to(compute_dtype).repeat_interleave(group_size, dim=1)
    return (codes - zeros_full).to(compute_dtype) * scales_full


def quantized_matmul(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = x @ dequantize_weight(...)^T + bias; x: (..., K) -> (..., N)."""
    w = dequantize_weight(qdata, scales, zeros, bits=bits, group_size=group_size, compute_dtype=compute_dtype)
    y = x.to(compute_dtype) @ w.T
    return y if bias is None else y + bias.to(compute_dtype)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = rms_norm(x, norm_weight, eps) @ weight^T + bias; x: (..., K), norm_weight: (K,),
    weight: (N, K) (nn.Linear layout), bias: (N,) or None -> (..., N)."""
    h = rms_norm(x, norm_weight, eps, compute_dtype=compute_dtype)
    y = h @ weight.to(compute_dtype).T
    return y if bias is None else y + bias.to(compute_dtype)
