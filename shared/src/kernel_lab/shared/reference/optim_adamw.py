"""AdamW reference: one update of one parameter tensor, as torch.optim.AdamW defines it.

The math (decoupled weight decay, Loshchilov & Hutter; bias correction as in torch):

    g      = -grad if maximize else grad
    p      = p * (1 - lr * weight_decay)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    v_max  = max(v_max, v)                          (amsgrad only; v_max replaces v below)
    denom  = sqrt(v) / sqrt(1 - beta2 ** step) + eps
    p      = p - lr / (1 - beta1 ** step) * m / denom

`step` is the 1-based number of this update (torch increments its step count before using it).
The function is pure: it returns new tensors in `compute_dtype` and leaves its inputs alone, so
a test can run it beside the kernel on the same inputs.
"""

from __future__ import annotations

import torch


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int | float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One AdamW update; returns (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None).

    All tensors have the same shape; the results are in `compute_dtype`. With `amsgrad`,
    `max_exp_avg_sq` (the running maximum of `exp_avg_sq`) is required.
    """
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("max_exp_avg_sq: required when amsgrad=True")
    p, g = param.to(compute_dtype), grad.to(compute_dtype)
    m, v = exp_avg.to(compute_dtype), exp_avg_sq.to(compute_dtype)
    if maximize:
        g = -g
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    v_max = None
    if amsgrad:
        v_max = torch.maximum(max_exp_avg_sq.to(compute_dtype), v)
        denom = v_max.sqrt() / bias_correction2_sqrt + eps
    else:
        denom = v.sqrt() / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    return p, m, v, v_max
