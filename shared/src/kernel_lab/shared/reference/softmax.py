"""Softmax and log-softmax references, forward and backward.

All math runs in `compute_dtype` (float64 by default) and the result stays in it: the caller
decides what to compare against. The kernels' CPU fallback calls these with float32.
"""

from __future__ import annotations

import torch


def softmax(x: torch.Tensor, dim: int = -1, *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along `dim`.

    A row that is entirely -inf has no finite maximum: its output is 0 (not NaN). This is the
    documented convention of kernel_lab's softmax kernels (torch.softmax returns NaN there). A
    row holding a NaN or +inf gives NaN everywhere, as torch does: only a zero sum (no finite
    entry) is special-cased, since `sum > 0` is False for a NaN sum too and would hide it.
    """
    x = x.to(compute_dtype)
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(x - row_max)
    denom = e.sum(dim=dim, keepdim=True)
    return torch.where(denom == 0, torch.zeros_like(e), e / denom)


def log_softmax(x: torch.Tensor, dim: int = -1, *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """y = x - max(x) - log(sum(exp(x - max(x)))) along `dim`.

    A row that is entirely -inf gives -inf everywhere (log of the all-zero softmax).
    """
    x = x.to(compute_dtype)
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    shifted = x - row_max
    log_denom = torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))
    # (-inf) - (-inf) would be NaN on a fully masked row: keep it -inf.
    return torch.where(torch.isneginf(log_denom), torch.full_like(shifted, float("-inf")), shifted - log_denom)


def softmax_backward(
    y: torch.Tensor, dy: torch.Tensor, dim: int = -1, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) along `dim`, given the softmax output y."""
    y, dy = y.to(compute_dtype), dy.to(compute_dtype)
    return y * (dy - (dy * y).sum(dim=dim, keepdim=True))


def log_softmax_backward(
    y: torch.Tensor, dy: torch.Tensor, dim: int = -1, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """dx = dy - exp(y) * sum(dy) along `dim`, given the log-softmax output y."""
    y, dy = y.to(compute_dtype), dy.to(compute_dtype)
    return dy - torch.exp(y) * dy.sum(dim=dim, keepdim=True)
