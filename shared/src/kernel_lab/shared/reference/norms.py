"""Normalization references: RMSNorm, LayerNorm, residual + RMSNorm, gated RMSNorm; forward and
backward.

All math runs in `compute_dtype` (float64 by default) and every result stays in it. Shapes:
x: (..., N); weight, bias: (N,); per-row statistics (rstd, mean): (...,). The backward functions
take the forward *inputs* (not saved statistics) and recompute what they need, so a test can
check them against autograd on the forward functions.
"""

from __future__ import annotations

import torch

__all__ = [
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_stats",
    "residual_rms_norm",
    "residual_rms_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_rstd",
]


def _cast(*tensors: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(dtype) for t in tensors]


def rms_norm_rstd(x: torch.Tensor, eps: float = 1e-6, *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The per-row statistic of `rms_norm`: rstd = 1 / sqrt(mean(x^2) + eps) over the last dim,
    shape x.shape[:-1] (what a kernel saves for the backward)."""
    x = x.to(compute_dtype)
    return torch.rsqrt(x.square().mean(dim=-1) + eps)


def layer_norm_stats(
    x: torch.Tensor, eps: float = 1e-5, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row statistics of `layer_norm`: (mean, rstd) with mean = mean(x) and
    rstd = 1 / sqrt(var(x) + eps) (biased variance) over the last dim, each x.shape[:-1]."""
    x = x.to(compute_dtype)
    mean = x.mean(dim=-1)
    rstd = torch.rsqrt((x - mean[..., None]).square().mean(dim=-1) + eps)
    return mean, rstd


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_rstd` in x's dtype, keepdim."""
    return rms_norm_rstd(x, eps, compute_dtype=x.dtype)[..., None]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dim (no affine if weight is
    None). offset=1.0 is the Gemma convention (weights stored as w - 1)."""
    x, weight = _cast(x, weight, dtype=compute_dtype)
    y = x * _rstd(x, eps)
    return y if weight is None else y * (offset + weight)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) of `rms_norm`. With xhat = x * rstd and g = dy * (offset + weight):
    dx = rstd * (g - xhat * mean(g * xhat)), dweight = sum over rows of dy * xhat (None when
    weight is None)."""
    dy, x, weight = _cast(dy, x, weight, dtype=compute_dtype)
    rstd = _rstd(x, eps)
    xhat = x * rstd
    g = dy if weight is None else dy * (offset + weight)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dw = None if weight is None else (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim (biased variance,
    as torch.nn.functional.layer_norm); weight / bias may be None."""
    x, weight, bias = _cast(x, weight, bias, dtype=compute_dtype)
    mean, rstd = layer_norm_stats(x, eps, compute_dtype=compute_dtype)
    y = (x - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) of `layer_norm`. With xhat = (x - mean) * rstd and g = dy * weight:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight = sum dy * xhat; dbias = sum dy."""
    dy, x, weight = _cast(dy, x, weight, dtype=compute_dtype)
    n = x.shape[-1]
    mean, rstd = (stat[..., None] for stat in layer_norm_stats(x, eps, compute_dtype=compute_dtype))
    xhat = (x - mean) * rstd
    g = dy if weight is None else dy * weight
    dx = rstd * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dw = None if weight is None else (dy * xhat).reshape(-1, n).sum(0)
    db = None if bias is None else dy.reshape(-1, n).sum(0)
    return dx, dw, db


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, u) with u = x + residual and y = rms_norm(u, weight, eps, offset=offset): the fused
    "add then normalize" of a pre-norm transformer block (flash-attn / vLLM convention)."""
    x, residual = _cast(x, residual, dtype=compute_dtype)
    u = x + residual
    return rms_norm(u, weight, eps, offset=offset, compute_dtype=compute_dtype), u


def residual_rms_norm_backward(
    dy: torch.Tensor,
    du: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d(x + residual), dweight) of `residual_rms_norm`, given the gradients dy of y and du of
    the returned sum u (None: u was not used). The gradient of x and of residual are both the
    returned first element: the rms_norm backward at u, plus du."""
    x, residual = _cast(x, residual, dtype=compute_dtype)
    du_norm, dw = rms_norm_backward(dy, x + residual, weight, eps, offset=offset, compute_dtype=compute_dtype)
    if du is not None:
        du_norm = du_norm + du.to(compute_dtype)
    return du_norm, dw


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = rms_norm(x, weight, eps) * silu(gate), silu(z) = z * sigmoid(z): the gated RMSNorm of
    Mamba-2 / Qwen3-Next (norm before gate)."""
    x, gate = _cast(x, gate, dtype=compute_dtype)
    return rms_norm(x, weight, eps, compute_dtype=compute_dtype) * torch.nn.functional.silu(gate)


def rms_norm_gated_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dgate, dweight) of `rms_norm_gated`. With n = rms_norm(x, weight) and s = sigmoid(gate):
    dgate = dy * n * s * (1 + gate * (1 - s)); dx, dweight = rms_norm_backward(dy * gate * s)."""
    dy, x, gate = _cast(dy, x, gate, dtype=compute_dtype)
    s = torch.sigmoid(gate)
    n = rms_norm(x, weight, eps, compute_dtype=compute_dtype)
    dgate = dy * n * s * (1 + gate * (1 - s))
    dx, dw = rms_norm_backward(dy * gate * s, x, weight, eps, compute_dtype=compute_dtype)
    return dx, dgate, dw
