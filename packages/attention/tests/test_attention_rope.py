"""apply_rope against the float64 reference (forward and backward), plus validation."""

import pytest
import torch

from kernel_lab.attention import apply_rope
from kernel_lab.attention import ops as attention_ops
from kernel_lab.shared import reference, testing

FWD_FACTOR, BWD_FACTOR = 2.0, 3.0


def _tables(b, t, r, *, interleaved, device, per_batch=True, seed=0):
    """HF-style cos/sin (B, T, R) from real angles (positions shuffled per batch)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    pos = torch.stack([torch.randperm(4 * t, generator=testing.make_generator(seed + i))[:t] for i in range(b)])
    theta = pos[..., None].double() * inv_freq
    ang = theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1)
    if not per_batch:
        ang = ang[:1]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _baseline(x, cos, sin, dy, **kw):
    """The HF formula in x's dtype (what torch eager computes) and its gradient."""
    xb = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        y = reference.rope(xb, cos.to(x.dtype), sin.to(x.dtype), compute_dtype=x.dtype, **kw)
        (dx,) = torch.autograd.grad(y, xb, dy)
    return y.detach(), dx


def check_rope(q, k, cos, sin, *, layout="bhsd", grad=True, seed=0, **kw):
    to = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k)]
    qo, ko = apply_rope(*leaves, cos, sin, layout=layout, **kw)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    dys = [testing.randn(*t.shape, dtype=t.dtype, device=t.device, seed=seed + i) for i, t in enumerate((q, k))]
    if grad:
        grads = torch.autograd.grad((qo, ko), leaves, dys)
    for i, (x, out) in enumerate(((q, qo), (k, ko))):
        assert_rope_matches_reference(to(x), to(out), cos, sin, to(dys[i]), to(grads[i]) if grad else None, **kw)


def assert_rope_matches_reference(x, out, cos, sin, dy=None, dx=None, **kw):
    """out = rope(x) (and dx, the gradient for the output gradient dy) against the float64
    reference, the budget set by the same formula in x's dtype. All (B, H, T, D) views."""
    ref = reference.rope(x, cos, sin, **kw)
    base, base_dx = _baseline(x, cos, sin, torch.zeros_like(x) if dy is None else dy, **kw)
    testing.assert_close_to_reference(out, ref, base, factor=FWD_FACTOR, name="rope")
    if dx is not None:
        ref_dx = reference.rope_backward(dy, cos, sin, **kw)
        testing.assert_close_to_reference(dx, ref_dx, base_dx, factor=BWD_FACTOR, name="rope grad")


# --- reference tier --------------------------------------------------------------------------


def test_rope_validation_names_the_argument():
    q, k = torch.zeros(1, 4, 6, 16), torch.zeros(1, 2, 6, 16)
    cos = sin = torch.zeros(6, 16)
    with pytest.raises(TypeError, match=r"q\.dtype must be"):
        apply_rope(q.long(), k, cos, sin)
    with pytest.raises(ValueError, match="agree in batch, tokens and head dim"):
        apply_rope(q, k[:, :, :5], cos, sin)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        apply_rope(q, k, cos, sin, rotary_dim=7)
    with pytest.raises(ValueError, match=r"cos/sin must be \(T, R\)"):
        apply_rope(q, k, cos[:5], sin[:5])
    with pytest.raises(ValueError, match="position_ids must be"):
        apply_rope(q, k, cos, sin, position_ids=torch.zeros(2, 6, dtype=torch.long))
    for bad in (6, -1):  # the table has 6 rows
        pos = torch.zeros(1, 6, dtype=torch.long)
        pos[0, 3] = bad
        with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 6\)"):
            apply_rope(q, k, cos, sin, position_ids=pos)
    with pytest.raises(ValueError, match="inplace=True cannot be used"):
        apply_rope(q.requires_grad_(True), k, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="layout must be"):
        apply_rope(q, k, cos, sin, layout="hsd")
    # a truthy non-bool ("no") ran the GPT-J rotation / overwrote the inputs
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        apply_rope(q, k, cos, sin, interleaved="no")
    with pytest.raises(TypeError, match="inplace must be a bool"):
        apply_rope(q.detach(), k, cos, sin, inplace="False")


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reference_backend(monkeypatch, seed, interleaved):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = _tables(2, 5, 8, interleaved=interleaved, device="cpu", seed=seed)
    q = testing.randn(2, 4, 5, 16, seed=seed)
    k = testing.randn(2, 2, 5, 16, seed=seed + 1)
    check_rope(q, k, cos, sin, interleaved=interleaved, seed=seed)


# --- interpret tier ---------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("interleaved", "layout", "rotary_dim", "dtype", "per_batch"),
    [(False, "bhsd", None, torch.float16, True), (True, "bshd", None, torch.float32, False),
     (False, "bshd", 16, torch.float16, True), (True, "bhsd", 24, torch.float16, True)],
)
def test_rope_matches_reference(interleaved, layout, rotary_dim, dtype, per_batch, kernel_device, seed, monkeypatch):
    b, t, d = 2, 9, 48  # head dim 48: a masked tail in the 64-wide block
    # One program per SM of 3: the 9 heads (6 of q, 3 of k) of each of the 2 position tiles go
    # in 2 groups of 5, so the second program holds q's last head and k's three (q's and k's
    # heads meet inside one program's loop) and is one head short (the loop's bound check).
    monkeypatch.setattr(attention_ops, "ROPE_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(attention_ops.runtime, "sm_count", lambda device: 3)
    assert attention_ops._rope_heads_per_program(b * 9, 9, torch.device(kernel_device)) == 5
    r = rotary_dim or d
    cos, sin = _tables(b, t, r, interleaved=interleaved, device=kernel_device, per_batch=per_batch, seed=seed)
    q = testing.randn(b, 6, t, d, dtype=dtype, device=kernel_device, seed=seed)
    k = testing.randn(b, 3, t, d, dtype=dtype, device=kernel_device, seed=seed + 1)
    if layout == "bshd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    check_rope(q, k, cos, sin, layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, seed=seed)


@pytest.mark.interpret
def test_rope_position_ids_table_and_strided_views(kernel_device, seed):
    b, t, d, h = 2, 7, 32, 4
    table_cos, table_sin = _tables(1, 50, d, interleaved=False, device=kernel_device, seed=seed)
    table_cos, table_sin = table_cos[0], table_sin[0]  # (50, D) table
    pos = torch.randint(0, 50, (b, t), generator=testing.make_generator(seed)).to(kernel_device)
    # q and k as bhsd views of one (B, T, 2H, D) projection: non-contiguous heads and tokens.
    qk = testing.randn(b, t, 2 * h, d, dtype=torch.float16, device=kernel_device, seed=seed)
    q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
    check_rope(q, k, table_cos, table_sin, position_ids=pos, seed=seed)


@pytest.mark.interpret
def test_rope_inplace_overwrites_inputs(kernel_device, seed):
    # Partial rotary (16 of 32 dims): the untouched tail must survive the in-place update.
    cos, sin = _tables(1, 6, 16, interleaved=False, device=kernel_device, seed=seed)
    q = testing.randn(1, 4, 6, 32, dtype=torch.float16, device=kernel_device, seed=seed)
    k = testing.randn(1, 1, 6, 32, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    q0, k0 = q.clone(), k.clone()
    expected = apply_rope(q, k, cos, sin)
    qo, ko = apply_rope(q, k, cos, sin, inplace=True)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    for x0, out in ((q0, qo), (k0, ko)):
        assert_rope_matches_reference(x0, out, cos, sin)
        assert torch.equal(out[..., 16:], x0[..., 16:]), "in-place RoPE changed a dim past rotary_dim"
    # In place and out of place run the same kernel: the same bits.
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_rope_inplace_refuses_tensors_whose_elements_share_memory():
    """An expanded view (head stride 0) would be rotated once per alias in place."""
    cos, sin = _tables(1, 6, 16, interleaved=False, device="cpu", seed=0)
    q = testing.randn(1, 4, 6, 16, dtype=torch.float16, seed=1)
    k = testing.randn(1, 1, 6, 16, dtype=torch.float16, seed=2).expand(1, 4, 6, 16)
    with pytest.raises(ValueError, match="inplace=True on k whose elements share memory"):
        apply_rope(q, k, cos, sin, inplace=True)


def test_rope_inplace_refuses_q_and_k_sharing_memory():
    """k is q (or a head slice of it): the shared elements were rotated twice in place."""
    cos, sin = _tables(1, 6, 16, interleaved=False, device="cpu", seed=0)
    q = testing.randn(1, 4, 6, 16, dtype=torch.float16, seed=1)
    for k in (q, q[:, :1]):
        with pytest.raises(ValueError, match="inplace=True on q and k that share memory"):
            apply_rope(q, k, cos, sin, inplace=True)
    # disjoint views of one buffer (q and k of a packed projection) stay allowed
    qk = testing.randn(1, 6, 8, 16, dtype=torch.float16, seed=2)
    before = qk.clone()
    expected = apply_rope(qk[:, :, :4], qk[:, :, 4:], cos, sin, layout="bshd")
    apply_rope(qk[:, :, :4], qk[:, :, 4:], cos, sin, layout="bshd", inplace=True)
    assert torch.equal(qk[:, :, :4], expected[0]) and torch.equal(qk[:, :, 4:], expected[1])
    for heads in (slice(0, 4), slice(4, 8)):  # and both against the float64 reference ((B, H, T, D) views)
        assert_rope_matches_reference(before[:, :, heads].transpose(1, 2), qk[:, :, heads].transpose(1, 2), cos, sin)


def test_rope_inplace_compiles_fullgraph(monkeypatch):
    """The eager-only memory checks stay out of tracing (dynamo cannot trace
    torch._debug_has_internal_overlap: fullgraph failed with "torch.* op returned non-Tensor")."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # fake-tensor tracing cannot run the interpreter
    torch._dynamo.reset()
    cos, sin = _tables(1, 6, 16, interleaved=False, device="cpu", seed=0)
    q = testing.randn(1, 4, 6, 16, seed=1)
    k = testing.randn(1, 2, 6, 16, seed=2)
    expected = apply_rope(q, k, cos, sin)
    fn = torch.compile(lambda q, k: apply_rope(q, k, cos, sin, inplace=True), fullgraph=True, backend="eager")
    fn(q, k)
    torch.testing.assert_close(q, expected[0])
    torch.testing.assert_close(k, expected[1])


# --- gpu tier ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rope_llama_shape(dtype, seed):
    b, t, d = 2, 2048, 128
    cos, sin = _tables(b, t, d, interleaved=False, device="cuda", seed=seed)
    q = testing.randn(b, 32, t, d, dtype=dtype, device="cuda", seed=seed)
    k = testing.randn(b, 8, t, d, dtype=dtype, device="cuda", seed=seed + 1)
    check_rope(q, k, cos.to(dtype), sin.to(dtype), seed=seed)


@pytest.mark.gpu
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_gpu_rope_compile_fullgraph(dynamic, seed):
    torch._dynamo.reset()
    cos, sin = _tables(1, 100, 64, interleaved=False, device="cuda", seed=seed)
    fn = torch.compile(lambda q, k, c, s: apply_rope(q, k, c, s), fullgraph=True, dynamic=dynamic)
    # new sequence lengths (the tables sliced to them), then a new batch and head count
    for i, (b, h, t) in enumerate([(1, 8, 64), (1, 8, 100), (3, 4, 77)]):
        c, s = cos[:, :t], sin[:, :t]
        q = testing.randn(b, h, t, 64, dtype=torch.bfloat16, device="cuda", seed=seed + i, requires_grad=True)
        k = testing.randn(b, 2, t, 64, dtype=torch.bfloat16, device="cuda", seed=seed + 10 + i, requires_grad=True)
        qo, ko = fn(q, k, c, s)
        eq, ek = apply_rope(q, k, c, s)
        torch.testing.assert_close(qo, eq, rtol=0, atol=0)
        torch.testing.assert_close(ko, ek, rtol=0, atol=0)
        dys = [testing.randn(*x.shape, dtype=x.dtype, device="cuda", seed=seed + 20 + 2 * i + j)
               for j, x in enumerate((q, k))]
        g = torch.autograd.grad((qo, ko), (q, k), dys)
        ge = torch.autograd.grad((eq, ek), (q, k), dys)
        for a, e in zip(g, ge, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        # Bitwise equal to eager, and both against the float64 reference (forward and backward).
        for x, out, dy, dx in zip((q, k), (qo, ko), dys, g, strict=True):
            assert_rope_matches_reference(x.detach(), out, c, s, dy, dx)


@pytest.mark.interpret
def test_double_backward_raises_instead_of_dropping_second_order_terms(kernel_device, seed):
    cos, sin = _tables(1, 8, 16, interleaved=False, device=kernel_device, seed=seed)
    q = testing.randn(1, 2, 8, 16, device=kernel_device, seed=seed, requires_grad=True)
    k = testing.randn(1, 1, 8, 16, device=kernel_device, seed=seed + 1, requires_grad=True)
    testing.assert_double_backward_raises(lambda q, k: apply_rope(q, k, cos, sin), q, k)
