"""swiglu / geglu / silu_and_mul / gelu_and_mul: forward and backward against the references.

Every check uses the tolerance rule of docs/correctness.md: the kernel's max error against the
float64 reference may be at most `factor` times that of the same-precision PyTorch eager
computation (F.silu(gate) * up, autograd for gradients), plus a small floor.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab import mlp
from kernel_lab.mlp import ops
from kernel_lab.shared import reference
from kernel_lab.shared.testing import assert_close_to_reference, poisoned, randn, strided_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# name -> (activation of the launchers, approximate of F.gelu / the reference)
ACTS = {"silu": ("silu", "none"), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu_tanh", "tanh")}


def _eager(gate, up, act):
    """The same-precision PyTorch baseline (what a user writes without kernel_lab)."""
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate=ACTS[act][1]) * up


def _ref_fwd(gate, up, act):
    if act == "silu":
        return reference.swiglu(gate, up)
    return reference.geglu(gate, up, ACTS[act][1])


def _ref_bwd(gate, up, dy, act):
    if act == "silu":
        return reference.swiglu_backward(gate, up, dy)
    return reference.geglu_backward(gate, up, dy, ACTS[act][1])


def _public(layout, act):
    """The public op under test, called as (gate, up) for separate layouts, (x,) for packed."""
    approximate = ACTS[act][1]
    if layout == "packed":
        return (lambda x: mlp.silu_and_mul(x)) if act == "silu" else (lambda x: mlp.gelu_and_mul(x, approximate))
    return (lambda g, u: mlp.swiglu(g, u)) if act == "silu" else (lambda g, u: mlp.geglu(g, u, approximate))


def _check_fwd_bwd(gate, up, layout, act, dtype, seed):
    """Run the public op forward and backward and check outputs and gradients."""
    dy = randn(*gate.shape, dtype=dtype, device=gate.device, seed=seed + 7)
    if layout == "packed":
        x = torch.cat([gate, up], dim=-1).requires_grad_(True)
        y = _public(layout, act)(x)
        (dx,) = torch.autograd.grad(y, (x,), dy)
        dgate, dup = dx[..., : gate.shape[-1]], dx[..., gate.shape[-1] :]
    else:
        if layout == "strided":
            gate, up = strided_rows(gate, pad=5), strided_rows(up, pad=3)
        elif layout == "halves":  # views into one packed tensor: up starts d elements in
            gate, up = ops._split(torch.cat([gate, up], dim=-1))
        gate, up = gate.requires_grad_(True), up.requires_grad_(True)
        y = _public(layout, act)(gate, up)
        dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    gate, up = gate.detach(), up.detach()
    bg, bu = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    base_y = _eager(bg, bu, act)
    base_dg, base_du = torch.autograd.grad(base_y, (bg, bu), dy)
    assert y.shape == gate.shape and y.dtype == dtype
    assert_close_to_reference(y, _ref_fwd(gate, up, act), base_y, name="y")
    ref_dg, ref_du = _ref_bwd(gate, up, dy, act)
    assert_close_to_reference(dgate, ref_dg, base_dg, name="dgate")
    assert_close_to_reference(dup, ref_du, base_du, name="dup")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout", ["contiguous", "strided", "halves", "packed"])
# (3, 1500): flat, two FLAT_BLOCK tiles; row-structured, two column blocks
@pytest.mark.parametrize("shape", [(3, 7, 33), (3, 1500)], ids=["odd", "several-blocks"])
def test_gated_forward_backward_match_reference(kernel_device, seed, dtype, act, layout, shape):
    gate = randn(*shape, dtype=dtype, device=kernel_device, seed=seed, scale=3.0)
    up = randn(*shape, dtype=dtype, device=kernel_device, seed=seed + 1)
    _check_fwd_bwd(gate, up, layout, act, dtype, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("act", list(ACTS))
def test_gated_single_element_and_many_row_blocks(kernel_device, seed, act):
    for shape in [(1,), (300, 5)]:  # one element; rows spanning several BLOCK_M tiles
        gate = randn(*shape, dtype=torch.float32, device=kernel_device, seed=seed, scale=3.0)
        up = randn(*shape, dtype=torch.float32, device=kernel_device, seed=seed + 1)
        _check_fwd_bwd(gate, up, "contiguous", act, torch.float32, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("act", list(ACTS))
def test_gated_kernels_write_every_element_of_poisoned_outputs(kernel_device, seed, act):
    """The launchers fill NaN-poisoned buffers completely (masked tails, row tails)."""
    m, n = 19, 1030  # neither a multiple of BLOCK_M nor of BLOCK_N
    g = randn(m, n, device=kernel_device, seed=seed, scale=3.0)
    u = randn(m, n, device=kernel_device, seed=seed + 1)
    dy = randn(m, n, device=kernel_device, seed=seed + 2)
    out = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    ops._launch_gated_fwd(g, u, out, act)
    assert_close_to_reference(out, _ref_fwd(g, u, act), _eager(g, u, act), name="y")
    dg = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    du = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    ops._launch_gated_bwd(g, u, dy, dg, du, act)
    ref_dg, ref_du = _ref_bwd(g, u, dy, act)
    assert_close_to_reference(dg, ref_dg, name="dgate", atol=1e-5 * float(ref_dg.abs().max()))
    assert_close_to_reference(du, ref_du, name="dup", atol=1e-5 * float(ref_du.abs().max()))


@pytest.mark.interpret
def test_gated_zero_size_inputs_give_empty_outputs_and_grads(kernel_device):
    for shape in [(0, 8), (4, 0)]:
        g = torch.empty(shape, device=kernel_device, requires_grad=True)
        u = torch.empty(shape, device=kernel_device, requires_grad=True)
        y = mlp.swiglu(g, u)
        assert y.shape == shape
        dg, du = torch.autograd.grad(y, (g, u), torch.empty(shape, device=kernel_device))
        assert dg.shape == shape and du.shape == shape
    x = torch.empty(3, 0, device=kernel_device)
    assert mlp.silu_and_mul(x).shape == (3, 0)


@pytest.mark.interpret
def test_packed_gradient_of_expanded_dy_matches_reference(kernel_device, seed):
    """y.sum().backward() hands the backward a stride-0 dy; the op must not misread it."""
    x = randn(6, 2 * 45, device=kernel_device, seed=seed, scale=2.0, requires_grad=True)
    mlp.gelu_and_mul(x, "tanh").sum().backward()
    dy = torch.ones(6, 45, dtype=torch.float64, device=kernel_device)
    ref = reference.gelu_and_mul_backward(x.detach(), dy, "tanh")
    assert_close_to_reference(x.grad, ref, name="dx", atol=1e-5 * float(ref.abs().max()))


@pytest.mark.interpret
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_launch_recipes_are_reused_across_calls(kernel_device, seed, act, monkeypatch):
    """Calls of one shape and layout with new values reuse the launchers' recipes (worked out
    once per launch-plan key: shape, strides, dtypes and 16-byte alignments) and stay right; a
    new alignment of the same shape gets its own recipe."""
    monkeypatch.setattr(ops, "_RECIPES", {})
    shape, dtype = (2, 3, 45), torch.float16  # the up half of a packed row starts 90 bytes in
    counts = []
    for call in range(2):
        gate = randn(*shape, dtype=dtype, device=kernel_device, seed=seed + 10 * call, scale=3.0)
        up = randn(*shape, dtype=dtype, device=kernel_device, seed=seed + 10 * call + 1)
        for layout in ("contiguous", "halves", "packed"):  # (detached: the check marks its inputs requires_grad)
            _check_fwd_bwd(gate.detach(), up.detach(), layout, act, dtype, seed + 10 * call)
        # a stride-0 dy, copied on every call
        x = torch.cat([gate, up], dim=-1).requires_grad_(True)
        _public("packed", act)(x).sum().backward()
        bg, bu = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        base = torch.autograd.grad(_eager(bg, bu, act).sum(), (bg, bu))
        ref = _ref_bwd(gate, up, torch.ones(shape, dtype=torch.float64, device=kernel_device), act)
        assert_close_to_reference(x.grad, torch.cat(ref, dim=-1), torch.cat(base, dim=-1), name="dx, stride-0 dy")
        counts.append(len(ops._RECIPES))
    # forward and backward of the contiguous and halves layouts (the packed forward reads the same
    # halves), the packed backward (its outputs are halves), and that backward with a stride-0 dy
    assert counts == [6, 6]
    offset = randn(gate.numel() + 1, dtype=dtype, device=kernel_device, seed=seed + 3)[1:].view(shape)
    _check_fwd_bwd(offset, up, "contiguous", act, dtype, seed)
    assert len(ops._RECIPES) == 8  # gate 2 bytes off 16-byte alignment: its own forward and backward


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
def test_gated_llm_sizes_match_reference(seed, dtype, act, layout):
    # Llama-3-8B MLP width at 1024 tokens: 15 M elements, thousands of tiles
    shape = (2, 512, 14336)
    gate = randn(*shape, dtype=dtype, device="cuda", seed=seed, scale=3.0)
    up = randn(*shape, dtype=dtype, device="cuda", seed=seed + 1)
    _check_fwd_bwd(gate, up, layout, act, dtype, seed)
