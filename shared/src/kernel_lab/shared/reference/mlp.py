"""Activation and gated-MLP references (GELU, SiLU, bias+GELU, SwiGLU, GeGLU), forward and backward.

All math runs in `compute_dtype` (float64 by default) and the result stays in it: the caller
decides what to compare against. The kernels' CPU fallback calls these with float32.

Conventions (the same as torch.nn.functional):
- gelu(x) = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))                  approximate="none"
- gelu(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))       approximate="tanh"
- silu(x) = x * sigmoid(x)
- swiglu(gate, up) = silu(gate) * up;   geglu(gate, up) = gelu(gate) * up
- silu_and_mul(x) / gelu_and_mul(x): x is (..., 2 * d), gate = x[..., :d], up = x[..., d:]
  (the packed layout of vLLM and of fused gate_up projections), output (..., d).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "bias_gelu",
    "bias_gelu_backward",
    "gated_mlp",
    "geglu",
    "geglu_backward",
    "gelu",
    "gelu_and_mul",
    "gelu_and_mul_backward",
    "gelu_backward",
    "silu",
    "silu_and_mul",
    "silu_and_mul_backward",
    "silu_backward",
    "swiglu",
    "swiglu_backward",
]

_TANH_COEF = 0.044715
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _check_approximate(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Phi(x) = 0.5 * (1 + erf(x / sqrt(2))), written with erfc: 1 + erf(x) cancels for negative
    x (to 0 below x = -8.3 in float64), 0.5 * erfc(-x / sqrt(2)) keeps its relative accuracy."""
    return 0.5 * torch.erfc(-x / math.sqrt(2.0))


def gelu(
    x: torch.Tensor, approximate: str = "none", *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """GELU, exact (erf) or with the tanh approximation, written out from the formula."""
    _check_approximate(approximate)
    x = x.to(compute_dtype)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_COEF * x**3)))
    return x * _normal_cdf(x)


def gelu_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """dx = dy * gelu'(x).

    exact: gelu'(x) = Phi(x) + x * phi(x), phi the standard normal density;
    tanh:  gelu'(x) = 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 * x^2),
           t = tanh(sqrt(2/pi) * (x + 0.044715 * x^3)).
    """
    _check_approximate(approximate)
    x, dy = x.to(compute_dtype), dy.to(compute_dtype)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_COEF * x**3))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_COEF * x * x)
    else:
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        d = _normal_cdf(x) + x * pdf
    return dy * d


def silu(x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """silu(x) = x * sigmoid(x)."""
    x = x.to(compute_dtype)
    return x * torch.sigmoid(x)


def silu_backward(
    x: torch.Tensor, dy: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """dx = dy * sigmoid(x) * (1 + x * (1 - sigmoid(x)))."""
    x, dy = x.to(compute_dtype), dy.to(compute_dtype)
    s = torch.sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = gelu(x + bias); x: (..., N), bias: (N,). The sum is formed in `compute_dtype`."""
    return gelu(x.to(compute_dtype) + bias.to(compute_dtype), approximate, compute_dtype=compute_dtype)


def bias_gelu_backward(
    x: torch.Tensor,
    bias: torch.Tensor,
    dy: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias): dx = dy * gelu'(x + bias), dbias = dx summed over every leading dim."""
    z = x.to(compute_dtype) + bias.to(compute_dtype)
    dx = gelu_backward(z, dy, approximate, compute_dtype=compute_dtype)
    return dx, dx.reshape(-1, dx.shape[-1]).sum(0)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """y = silu(gate) * up."""
    return silu(gate, compute_dtype=compute_dtype) * up.to(compute_dtype)


def swiglu_backward(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup): dgate = dy * up * silu'(gate), dup = dy * silu(gate)."""
    dy = dy.to(compute_dtype)
    dgate = silu_backward(gate, dy * up.to(compute_dtype), compute_dtype=compute_dtype)
    return dgate, dy * silu(gate, compute_dtype=compute_dtype)


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = gelu(gate) * up."""
    return gelu(gate, approximate, compute_dtype=compute_dtype) * up.to(compute_dtype)


def geglu_backward(
    gate: torch.Tensor,
    up: torch.Tensor,
    dy: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup): dgate = dy * up * gelu'(gate), dup = dy * gelu(gate)."""
    dy = dy.to(compute_dtype)
    dgate = gelu_backward(gate, dy * up.to(compute_dtype), approximate, compute_dtype=compute_dtype)
    return dgate, dy * gelu(gate, approximate, compute_dtype=compute_dtype)


def _split_packed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dim (..., 2 * d), got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def silu_and_mul(x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """y = silu(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d)."""
    return swiglu(*_split_packed(x), compute_dtype=compute_dtype)


def silu_and_mul_backward(
    x: torch.Tensor, dy: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """dx of shape (..., 2 * d): [dgate, dup] of `swiglu_backward`, packed like x."""
    return torch.cat(swiglu_backward(*_split_packed(x), dy, compute_dtype=compute_dtype), dim=-1)


def gelu_and_mul(
    x: torch.Tensor, approximate: str = "none", *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """y = gelu(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d)."""
    return geglu(*_split_packed(x), approximate, compute_dtype=compute_dtype)


def gelu_and_mul_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    approximate: str = "none",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """dx of shape (..., 2 * d): [dgate, dup] of `geglu_backward`, packed like x."""
    return torch.cat(geglu_backward(*_split_packed(x), dy, approximate, compute_dtype=compute_dtype), dim=-1)


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: str = "silu",
    approximate: str = "none",
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), the Llama (activation="silu") / Gemma ("gelu") MLP block.

    x: (..., hidden); gate_weight, up_weight: (intermediate, hidden); down_weight:
    (hidden, intermediate), nn.Linear layout (y = x @ W^T + b).
    """
    if activation not in ("silu", "gelu"):
        raise ValueError(f"activation: expected 'silu' or 'gelu', got {activation!r}")

    def linear(t, w, b):
        y = t @ w.to(compute_dtype).T
        return y if b is None else y + b.to(compute_dtype)

    x = x.to(compute_dtype)
    g, u = linear(x, gate_weight, gate_bias), linear(x, up_weight, up_bias)
    h = (
        swiglu(g, u, compute_dtype=compute_dtype)
        if activation == "silu"
        else geglu(g, u, approximate, compute_dtype=compute_dtype)
    )
    return linear(h, down_weight, down_bias)
