"""Shared checks of the norms tests: run an op forward and backward, then assert the tolerance
rule (kernel_lab.shared.testing) against the float64 reference, with a same-precision PyTorch
eager computation as the baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_lab.norms import layer_norm, residual_rms_norm, rms_norm, rms_norm_gated
from kernel_lab.shared import reference, testing

# Factor 2 of the tolerance rule (docs/correctness.md) on the forward. The backward's row reductions (mean(g * xhat))
# and the dweight sum over rows accumulate in a different order than PyTorch's, and their
# cancellation error grows with the row length and row count; factor 3 covers that
# (docs/correctness.md).
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
OPS = ("rms_norm", "residual_rms_norm", "rms_norm_gated", "layer_norm")


def make_inputs(op: str, shape, dtype, device, seed, *, weight_dtype="same", affine=True, scale=2.0, shift=0.0):
    """The op's tensor inputs (x, plus residual / gate / weight / bias) as a dict, fresh and seeded."""
    n = shape[-1]
    wdt = dtype if weight_dtype == "same" else weight_dtype
    x = testing.randn(*shape, dtype=dtype, device=device, seed=seed, scale=scale) + shift
    inputs = {"x": x}
    if op == "residual_rms_norm":
        inputs["residual"] = testing.randn(*shape, dtype=dtype, device=device, seed=seed + 1)
    if op == "rms_norm_gated":
        inputs["gate"] = testing.randn(*shape, dtype=dtype, device=device, seed=seed + 1, scale=3.0)
    inputs["weight"] = testing.randn(n, dtype=wdt, device=device, seed=seed + 2) * 0.5 + 1 if affine else None
    if op == "layer_norm":
        inputs["bias"] = testing.randn(n, dtype=wdt, device=device, seed=seed + 3) if affine else None
    return inputs


def call(op: str, inputs: dict, eps: float, offset: float, **kw):
    """Our op; returns the tuple of its outputs (y,) or (y, u)."""
    if op == "rms_norm":
        return (rms_norm(inputs["x"], inputs["weight"], eps, offset=offset, **kw),)
    if op == "residual_rms_norm":
        return residual_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], eps, offset=offset, **kw)
    if op == "rms_norm_gated":
        return (rms_norm_gated(inputs["x"], inputs["gate"], inputs["weight"], eps, **kw),)
    return (layer_norm(inputs["x"], inputs["weight"], inputs["bias"], eps, **kw),)


def baseline(op: str, inputs: dict, eps: float, offset: float):
    """What a user writes in eager PyTorch at the inputs' precision (weights cast to x's dtype)."""
    x = inputs["x"]
    n = x.shape[-1]
    w = inputs["weight"]
    w = None if w is None else w.to(x.dtype)

    def rms(t):
        y = F.rms_norm(t, (n,), None, eps)
        return y if w is None else y * (offset + w)

    if op == "rms_norm":
        return (rms(x),)
    if op == "residual_rms_norm":
        u = x + inputs["residual"]
        return rms(u), u
    if op == "rms_norm_gated":
        return (rms(x) * F.silu(inputs["gate"]),)
    b = inputs["bias"]
    return (F.layer_norm(x, (n,), w, None if b is None else b.to(x.dtype), eps),)


def ref_forward(op: str, inputs: dict, eps: float, offset: float):
    d = {k: None if v is None else v.detach() for k, v in inputs.items()}
    if op == "rms_norm":
        return (reference.rms_norm(d["x"], d["weight"], eps, offset=offset),)
    if op == "residual_rms_norm":
        return reference.residual_rms_norm(d["x"], d["residual"], d["weight"], eps, offset=offset)
    if op == "rms_norm_gated":
        return (reference.rms_norm_gated(d["x"], d["gate"], d["weight"], eps),)
    return (reference.layer_norm(d["x"], d["weight"], d["bias"], eps),)


def ref_backward(op: str, inputs: dict, grads, eps: float, offset: float) -> dict:
    """Reference gradients of every tensor input, by name."""
    d = {k: None if v is None else v.detach() for k, v in inputs.items()}
    if op == "rms_norm":
        dx, dw = reference.rms_norm_backward(grads[0], d["x"], d["weight"], eps, offset=offset)
        return {"x": dx, "weight": dw}
    if op == "residual_rms_norm":
        ds, dw = reference.residual_rms_norm_backward(grads[0], grads[1], d["x"], d["residual"], d["weight"],
                                                      eps, offset=offset)
        return {"x": ds, "residual": ds, "weight": dw}
    if op == "rms_norm_gated":
        dx, dz, dw = reference.rms_norm_gated_backward(grads[0], d["x"], d["gate"], d["weight"], eps)
        return {"x": dx, "gate": dz, "weight": dw}
    dx, dw, db = reference.layer_norm_backward(grads[0], d["x"], d["weight"], d["bias"], eps)
    return {"x": dx, "weight": dw, "bias": db}


def check_op(op: str, inputs: dict, *, eps: float = 1e-6, offset: float = 0.0, seed: int = 0,
             grad: bool = True, use_u: bool = True, fn=call, grad_mask: torch.Tensor | None = None, **kw) -> None:
    """Forward (and backward) of `op` on `inputs` against the reference, the tolerance rule.

    fn: what computes our outputs, called like `call` (e.g. a torch.compile'd wrapper of it).
    grad_mask: multiplies the random incoming gradients (zeros in it: gradients of exactly 0)."""
    # detach, not clone: a clone of strided rows is contiguous, and the layout is what some tests test
    leaves = {k: v.detach().requires_grad_(grad) for k, v in inputs.items() if v is not None}
    ours_in = {k: leaves.get(k) for k in inputs}
    outs = fn(op, ours_in, eps, offset, **kw)
    refs = ref_forward(op, inputs, eps, offset)
    base_in = {k: None if v is None else v.detach().clone().requires_grad_(grad) for k, v in inputs.items()}
    bases = baseline(op, base_in, eps, offset)
    x = inputs["x"]
    for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True)):
        assert o.dtype == x.dtype and o.shape == x.shape
        testing.assert_close_to_reference(o, r, b, factor=FWD_FACTOR, name=f"{op} forward output {i}")
    if not grad:
        return
    grads = [testing.randn(*x.shape, dtype=x.dtype, device=x.device, seed=seed + 10 + i) for i in range(len(outs))]
    if grad_mask is not None:
        grads = [g * grad_mask for g in grads]
    if op == "residual_rms_norm" and not use_u:
        outs, bases, grads = outs[:1], bases[:1], grads[:1]
    names = [k for k in inputs if inputs[k] is not None]
    got = torch.autograd.grad(outs, [leaves[k] for k in names], grads)
    base_got = torch.autograd.grad(bases, [base_in[k] for k in names], grads)
    expected = ref_backward(op, inputs, grads + [None] * (2 - len(grads)), eps, offset)
    for k, g, bg in zip(names, got, base_got, strict=True):
        assert g.dtype == inputs[k].dtype and g.shape == inputs[k].shape, k
        atol = None
        if op == "layer_norm" and k == "x" and x.shape[-1] == 1:
            # One column: dx = rstd * (g - mean(g)) is exactly 0, the difference of two terms of size
            # rstd * |dy * w| = |dy * w| / sqrt(eps) (~300x the inputs). On the GPU the kernel's fp32
            # mean is one rounding away from g; allow one rounding of that size (docs/correctness.md).
            w = inputs["weight"]
            gw = grads[0].double() * (w.double() if w is not None else 1.0)
            atol = torch.finfo(x.dtype).eps * float(gw.abs().max()) / eps**0.5
        testing.assert_close_to_reference(g, expected[k], bg, factor=BWD_FACTOR, atol=atol, name=f"{op} d{k}")
