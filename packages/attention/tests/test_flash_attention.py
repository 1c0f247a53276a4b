"""flash_attention / flash_attention_varlen / attention against the float64 reference.

Tolerance (the FlashAttention rule, docs/correctness.md): the output error vs the float64
reference is at most 2x the error of the same computation done naively in the input dtype
(`reference.attention(..., compute_dtype=dtype)`), gradients at most 3x.

Tiers: unmarked tests check validation, the reference backend and registration; `interpret`
tests run the real kernels on small shapes (CPU under TRITON_INTERPRET=1, or CUDA); `gpu`
tests run long sequences, bf16, torch.compile (inductor) and the memory check.
"""

import pytest
import torch

from kernel_lab.attention import attention, attention_backend, flash_attention, flash_attention_varlen
from kernel_lab.attention import ops as attention_ops
from kernel_lab.shared import reference, testing

FWD_FACTOR, BWD_FACTOR = 2.0, 3.0


def _to(t, layout):
    """(B, H, T, D) -> the layout's logical shape (a view for bshd)."""
    return t.transpose(1, 2) if layout == "bshd" else t


def _make(shape_q, shape_kv, dtype, device, seed, layout="bhsd", contiguous=True):
    """q, k, v, do drawn in (B, H, T, D), then laid out as `layout` (bshd: a real (B, T, H, D)
    tensor when contiguous, else a transposed view)."""
    q = testing.randn(*shape_q, dtype=dtype, device=device, seed=seed)
    k = testing.randn(*shape_kv, dtype=dtype, device=device, seed=seed + 1)
    v = testing.randn(*shape_kv, dtype=dtype, device=device, seed=seed + 2)
    do = testing.randn(*shape_q, dtype=dtype, device=device, seed=seed + 3)
    if layout == "bshd":
        q, k, v, do = (t.transpose(1, 2).contiguous() if contiguous else t.transpose(1, 2) for t in (q, k, v, do))
    return q, k, v, do


def _baseline(q, k, v, do, *, causal, window, scale=None):
    """The same-precision naive computation (its error sets the budget) and its gradients."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, lse = reference.attention(*leaves, causal=causal, window=window, scale=scale, return_lse=True,
                                       compute_dtype=q.dtype)
        grads = torch.autograd.grad(out, leaves, do)
    return out.detach(), lse.detach(), grads


def check_attention(q, k, v, do, *, causal=False, window=None, layout="bhsd", scale=None, grad=True,
                    backend="triton", fwd_baseline=True):
    """Run flash_attention (forward, lse and backward) and assert the rule for every output.

    fwd_baseline=False: out and lse get the default atol alone (no baseline budget), for a
    backend whose forward is the baseline computation itself (a budget of 2x its own error
    would check nothing)."""
    qb, kb, vb, dob = (_to(t, layout) for t in (q, k, v, do))  # (B, H, T, D) views for the references
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=causal, window=window, scale=scale, return_lse=True,
                               layout=layout, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (qb.shape[0], qb.shape[1], qb.shape[2]) and lse.dtype == torch.float32
    ref, ref_lse = reference.attention(qb, kb, vb, causal=causal, window=window, scale=scale, return_lse=True)
    base, base_lse, base_grads = _baseline(qb, kb, vb, dob, causal=causal, window=window, scale=scale)
    fwd_base, fwd_base_lse = (base, base_lse) if fwd_baseline else (None, None)
    testing.assert_close_to_reference(_to(out, layout), ref, fwd_base, factor=FWD_FACTOR, name="out")
    testing.assert_close_to_reference(lse, ref_lse, fwd_base_lse, factor=FWD_FACTOR, name="lse")
    if not grad:
        return
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = reference.attention_backward(qb, kb, vb, dob, causal=causal, window=window, scale=scale)
    for name, g, leaf, r, b in zip(("dq", "dk", "dv"), grads, leaves, ref_grads, base_grads, strict=True):
        assert g.shape == leaf.shape
        testing.assert_close_to_reference(_to(g, layout), r, b, factor=BWD_FACTOR, name=name)


# --- reference tier: validation, the reference backend, registration ----------------------------


def _qkv(*shape_q, hkv=None, tk=None, dtype=torch.float16):
    b, h, t, d = shape_q
    q = torch.zeros(b, h, t, d, dtype=dtype)
    kv = torch.zeros(b, hkv or h, tk or t, d, dtype=dtype)
    return q, kv, kv.clone()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(dtype=torch.int32), TypeError, "q.dtype must be float16, bfloat16 or float32"),
        (dict(dtype=torch.float64), TypeError, "q.dtype must be"),
        (dict(hkv=3), ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ],
)
def test_bad_dtype_and_heads_raise(kwargs, error, match):
    q, k, v = _qkv(1, 4, 8, 16, **kwargs)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v)


def test_reference_backend_returns_a_contiguous_output_in_the_inputs_layout():
    """As the kernel does: (B, T, H, D) contiguous for bshd (the reference computes in bhsd)."""
    q = testing.randn(2, 5, 4, 16, dtype=torch.float16, seed=1)
    kv = testing.randn(2, 7, 2, 16, dtype=torch.float16, seed=2)
    out = flash_attention(q, kv, kv, layout="bshd", backend="reference")
    assert out.shape == q.shape and out.is_contiguous()


def test_mismatched_arguments_raise_naming_them():
    q, k, v = _qkv(1, 2, 8, 16)
    with pytest.raises(ValueError, match="same head dim"):
        flash_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="same batch size"):
        flash_attention(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        flash_attention(q, k, v, layout="sbhd")
    with pytest.raises(TypeError, match="window must be None or a"):
        flash_attention(q, k, v, window=4)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="scale must be a finite float"):
        flash_attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match=r"\|scale\| must be at most"):  # inf as float32 in the kernels
        flash_attention(q, k, v, scale=3e38)
    with pytest.raises(ValueError, match="same batch size"):  # torch's SDPA would broadcast it
        attention(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="head dim must be in"):
        flash_attention(*(torch.zeros(1, 1, 4, 512, dtype=torch.float16) for _ in range(3)))
    with pytest.raises(TypeError, match=r"k must be a torch\.Tensor"):
        flash_attention(q, None, v)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(1, 2, 8, 16)
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA tensor"):
        flash_attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="backend must be None"):
        flash_attention(q, k, v, backend="cuda")


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_bad_cu_seqlens_raise():
    q = torch.zeros(10, 2, 16, dtype=torch.float16)
    good = _cu([4, 6])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_attention_varlen(q, q, q, good.long(), good, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, be non-decreasing"):
        flash_attention_varlen(q, q, q, good, torch.tensor([0, 11, 10], dtype=torch.int32), 6, 11)
    with pytest.raises(ValueError, match="must start at 0, be non-decreasing and end at 10"):
        flash_attention_varlen(q, q, q, torch.tensor([0, 4, 9], dtype=torch.int32), good, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen 5 for cu_seqlens_q is below the longest sequence 6"):
        flash_attention_varlen(q, q, q, good, good, 5, 6)
    with pytest.raises(ValueError, match="same length"):
        flash_attention_varlen(q, q, q, good, _cu([4, 6, 0]), 6, 6)
    with pytest.raises(ValueError, match="1-D with batch"):
        flash_attention_varlen(q, q, q, good[:1], good, 6, 6)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        flash_attention_varlen(q[None], q, q, good, good, 6, 6)


@pytest.mark.parametrize(("causal", "window", "layout"), [(True, None, "bhsd"), (False, (3, 2), "bshd")])
def test_reference_backend_matches_reference_with_gradients(monkeypatch, seed, causal, window, layout):
    """Without CUDA and without the interpreter the op runs the float32 reference forward and
    its explicit float32 gradient formulas: the "reference" backend (docs/architecture.md).

    The forward IS the float32 naive computation that check_attention uses as its baseline, so
    a baseline budget would check nothing: the forward is asserted bit-equal to that call (what
    the backend does) and against the float64 reference with the default atol alone. The
    gradients (explicit formulas) are checked against autograd through the baseline as usual."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, do = _make((2, 4, 9, 16), (2, 2, 13, 16), torch.float32, "cpu", seed, layout)
    check_attention(q, k, v, do, causal=causal, window=window, layout=layout, backend=None, fwd_baseline=False)
    out, lse = flash_attention(q, k, v, causal=causal, window=window, layout=layout, return_lse=True)
    f32, f32_lse = reference.attention(*(_to(t, layout) for t in (q, k, v)), causal=causal, window=window,
                                       return_lse=True, compute_dtype=torch.float32)
    assert torch.equal(_to(out, layout), f32) and torch.equal(lse, f32_lse)


def test_attention_entry_point_without_triton_uses_sdpa_or_reference(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = _make((1, 4, 6, 16), (1, 2, 11, 16), torch.float32, "cpu", seed)
    assert attention_backend(q, k, causal=True) == "sdpa"
    ref = reference.attention(q, k, v, causal=True)
    base = reference.attention(q, k, v, causal=True, compute_dtype=torch.float32)
    testing.assert_close_to_reference(attention(q, k, v, causal=True), ref, base, factor=FWD_FACTOR,
                                      name="sdpa out")  # bottom-right causal
    q2 = testing.randn(1, 4, 15, 16, seed=seed + 7)
    assert attention_backend(q2, k, causal=True) == "reference"  # Tq > Tk: SDPA cannot express it
    out = attention(q2, k, v, causal=True)
    # The "reference" backend is the float32 naive computation, i.e. the baseline itself: bit-equal
    # to it, and against float64 with the default atol alone (a baseline budget would check nothing).
    assert torch.equal(out, reference.attention(q2, k, v, causal=True, compute_dtype=torch.float32))
    testing.assert_close_to_reference(out, reference.attention(q2, k, v, causal=True), name="reference out")
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))


def test_varlen_reference_backend_matches_reference(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lens = [3, 0, 5]
    q = testing.randn(8, 2, 16, seed=seed)
    out = flash_attention_varlen(q, q, q, _cu(lens), _cu(lens), 5, 5, causal=True)
    # The CPU fallback is the float32 varlen reference, i.e. the same-precision baseline itself:
    # bit-equal to it, and against float64 with the default atol alone (no vacuous baseline budget).
    f32 = reference.attention_varlen(q, q, q, _cu(lens), _cu(lens), causal=True, compute_dtype=torch.float32)
    assert torch.equal(out, f32)
    testing.assert_close_to_reference(out, reference.attention_varlen(q, q, q, _cu(lens), _cu(lens), causal=True),
                                      name="varlen out")


def test_registered_ops_pass_opcheck(seed, monkeypatch, kernel_device):
    # Fake-tensor tracing cannot run the interpreter (it reads real data): on the CPU this checks
    # the registration around the reference backend; on CUDA, around the Triton kernel.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, do = _make((1, 2, 9, 16), (1, 1, 12, 16), torch.float32, kernel_device, seed)
    for t in (q, k, v):
        t.requires_grad_(True)
    args = (q, k, v, 0.25, 1 << 30, 0, "bhsd")
    torch.library.opcheck(torch.ops.kernel_lab.attention_fwd.default, args)
    out, lse = torch.ops.kernel_lab.attention_fwd(*args)
    bwd_args = (do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None, 0.25, 1 << 30, 0, "bhsd")
    torch.library.opcheck(torch.ops.kernel_lab.attention_bwd.default, bwd_args)
    cos = testing.randn(9, 16, device=kernel_device, seed=seed)
    torch.library.opcheck(torch.ops.kernel_lab.rope.default,
                          (q, k[:, :, :9], cos, cos.flip(0), None, False, 16, "bhsd", False))
    if kernel_device != "cuda":
        # The varlen reference (the CPU fallback) reads cu_seqlens on the host, which tracing
        # cannot do: the varlen ops are traceable on the Triton backend only.
        return
    cu = _cu([4, 0, 5]).to(kernel_device)
    qv, kv, vv, dov = (t[0].transpose(0, 1)[:9].contiguous() for t in (q, k, v, do))
    vargs = (qv, kv, vv, cu, cu, 5, 5, 0.25, 1 << 30, 0)
    torch.library.opcheck(torch.ops.kernel_lab.attention_varlen_fwd.default, vargs)
    out_v, lse_v = torch.ops.kernel_lab.attention_varlen_fwd(*vargs)
    vbwd = (dov, qv.detach(), kv.detach(), vv.detach(), out_v.detach(), lse_v.detach(), None, cu, cu, 5, 5, 0.25,
            1 << 30, 0)
    torch.library.opcheck(torch.ops.kernel_lab.attention_varlen_bwd.default, vbwd)


# --- interpret tier: the real kernels on small shapes ---------------------------------------------

# (B, Hq, Hkv, Tq, Tk, D, causal, window, layout, dtype): odd lengths (masked tails), decode
# (Tq = 1), causal with Tq < Tk and Tq > Tk (fully masked rows), GQA and MQA, every head dim,
# both layouts, sliding windows, float16 and float32 (bf16 tl.dot is wrong in the interpreter:
# bf16 runs in the gpu tier).
CASES = [
    (1, 2, 2, 1, 67, 64, False, None, "bhsd", torch.float16),
    (2, 4, 2, 37, 80, 32, True, None, "bhsd", torch.float16),
    (1, 3, 1, 80, 29, 32, True, None, "bshd", torch.float16),
    (1, 2, 2, 45, 45, 96, True, None, "bshd", torch.float16),
    (1, 2, 1, 33, 47, 128, False, None, "bhsd", torch.float16),
    (1, 4, 2, 64, 64, 64, True, None, "bhsd", torch.float32),
    (1, 2, 2, 50, 70, 32, False, (7, 3), "bhsd", torch.float16),
    (1, 2, 1, 61, 61, 64, True, (16, -1), "bshd", torch.float16),
    # window sides past any length (int32-max: they used to overflow the kernels' index math)
    (1, 2, 1, 20, 37, 32, False, (2**31 - 1, 2**31 - 1), "bhsd", torch.float16),
    (1, 2, 2, 29, 29, 32, False, (-1, 2**31 - 1), "bshd", torch.float16),
    (1, 2, 2, 29, 29, 32, True, (2**31 - 1, -1), "bhsd", torch.float16),
]


@pytest.mark.interpret
@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "window", "layout", "dtype"), CASES)
def test_flash_attention_forward_backward_match_reference(b, hq, hkv, tq, tk, d, causal, window, layout, dtype,
                                                          kernel_device, seed):
    q, k, v, do = _make((b, hq, tq, d), (b, hkv, tk, d), dtype, kernel_device, seed, layout)
    check_attention(q, k, v, do, causal=causal, window=window, layout=layout)


# The forward with TMA descriptors (Hopper) runs under the interpreter too, with _hopper forced
# (its lse then feeds the backward): decode, GQA, Tq > Tk with MQA, a head dim below its block
# (96 of 128), both layouts, a window, all with masked tails (the descriptors zero-fill past T, D).
TMA_CASES = [CASES[i] for i in (0, 1, 2, 3, 6, 7)]


@pytest.mark.interpret
@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "window", "layout", "dtype"), TMA_CASES)
def test_tma_forward_matches_reference(b, hq, hkv, tq, tk, d, causal, window, layout, dtype, kernel_device, seed,
                                     monkeypatch):
    monkeypatch.setattr(attention_ops, "_hopper", lambda device: True)
    monkeypatch.setattr(attention_ops, "TMA_MIN_WORK", 0)
    _forget_recipes(monkeypatch)
    q, k, v, do = _make((b, hq, tq, d), (b, hkv, tk, d), dtype, kernel_device, seed, layout)
    assert attention_ops._use_tma(q, k, v, layout)
    check_attention(q, k, v, do, causal=causal, window=window, layout=layout)


def _forget_recipes(monkeypatch):
    """The launchers remember per shape what they launch (TMA or not, tiles), and so do the
    kernels' direct launchers (their launch plans are keyed by the same shapes): a test that
    changes that policy starts from empty recipe caches and fresh direct launchers."""
    monkeypatch.setattr(attention_ops, "_FWD_RECIPES", {})
    monkeypatch.setattr(attention_ops, "_BWD_RECIPES", {})
    testing.fresh_launch_plans(monkeypatch)


@pytest.mark.interpret
def test_recipes_are_reused_across_windows_and_scales(kernel_device, seed, monkeypatch):
    """One shape called with different windows and scales (both signs): the launchers work the
    launch out once per shape and key mask (forward) or shape (backward), pass the window
    bounds and the scale per call, and every call is still right."""
    _forget_recipes(monkeypatch)
    q, k, v, do = _make((1, 2, 45, 32), (1, 2, 45, 32), torch.float16, kernel_device, seed)
    for causal, window, scale in ((True, None, None), (False, (5, 2), 0.2), (False, None, -0.3), (False, None, None)):
        check_attention(q, k, v, do, causal=causal, window=window, scale=scale)
    assert len(attention_ops._FWD_RECIPES) == 2  # keys bounded by a mask or not
    assert len(attention_ops._BWD_RECIPES) == 1


@pytest.mark.interpret
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_scale(scale, tma, kernel_device, seed, monkeypatch):
    """The kernel takes row maxima before scaling, which needs scale >= 0: a negative scale runs
    as (-q) k^T |scale|; a zero scale gives uniform weights over the allowed keys (causal)."""
    monkeypatch.setattr(attention_ops, "_hopper", lambda device: tma)
    monkeypatch.setattr(attention_ops, "TMA_MIN_WORK", 0)
    _forget_recipes(monkeypatch)
    q, k, v, do = _make((1, 2, 37, 32), (1, 2, 37, 32), torch.float16, kernel_device, seed)
    check_attention(q, k, v, do, scale=scale, causal=True)


@pytest.mark.interpret
def test_odd_lengths_113_by_203_causal(kernel_device, seed):
    q, k, v, do = _make((1, 1, 113, 32), (1, 1, 203, 32), torch.float16, kernel_device, seed)
    check_attention(q, k, v, do, causal=True)


@pytest.mark.interpret
def test_single_query_against_257_keys_forward(kernel_device, seed):
    q, k, v, do = _make((1, 2, 1, 64), (1, 2, 257, 64), torch.float16, kernel_device, seed)
    check_attention(q, k, v, do, causal=True, grad=False)


@pytest.mark.interpret
def test_custom_scale_and_large_logits(kernel_device, seed):
    """Scores of +-40: exp overflows without the running max; scale != 1/sqrt(D)."""
    q, k, v, do = _make((1, 2, 40, 32), (1, 2, 40, 32), torch.float16, kernel_device, seed)
    check_attention(q * 4, k * 4, v, do, scale=0.45, causal=False)


@pytest.mark.interpret
def test_attention_entry_point_runs_the_kernel(kernel_device, seed):
    q, k, v, do = _make((1, 4, 19, 32), (1, 2, 26, 32), torch.float16, kernel_device, seed)
    assert attention_backend(q, k) == ("triton" if kernel_device == "cuda" else "triton-interpret")
    out = attention(q, k, v, causal=True)
    base, _, _ = _baseline(q, k, v, do, causal=True, window=None)
    testing.assert_close_to_reference(out, reference.attention(q, k, v, causal=True), base, factor=FWD_FACTOR)


@pytest.mark.interpret
def test_strided_views_are_read_in_place(kernel_device, seed):
    """q/k/v as slices of one packed (B, T, 3, H, D) projection, the rest NaN: a kernel that
    ignores the strides reads NaN and fails."""
    b, t, h, d = 1, 30, 2, 32
    packed = torch.full((b, t, 3, h, d + 8), float("nan"), dtype=torch.float16, device=kernel_device)
    for i in range(3):
        packed[:, :, i, :, :d] = testing.randn(b, t, h, d, dtype=torch.float16, device=kernel_device, seed=seed + i)
    q, k, v = (packed[:, :, i, :, :d] for i in range(3))  # bshd views, unit stride along D only
    do = testing.randn(b, t, h, d, dtype=torch.float16, device=kernel_device, seed=seed + 5)
    check_attention(q, k, v, do, causal=True, layout="bshd")


@pytest.mark.interpret
def test_zero_size_inputs(kernel_device):
    f16 = dict(dtype=torch.float16, device=kernel_device)
    # No keys: every row sees nothing, output 0 and lse -inf; no query: empty output.
    q = torch.randn(1, 2, 5, 32, **f16, requires_grad=True)
    kv = torch.zeros(1, 2, 0, 32, **f16, requires_grad=True)
    out, lse = flash_attention(q, kv, kv, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.equal(dq, torch.zeros_like(dq))
    empty = flash_attention(torch.zeros(1, 2, 0, 32, **f16), q.detach(), q.detach())
    assert empty.shape == (1, 2, 0, 32)
    assert flash_attention(*(torch.zeros(0, 2, 4, 32, **f16) for _ in range(3))).shape == (0, 2, 4, 32)


@pytest.mark.interpret
def test_lse_gradient_flows(kernel_device, seed):
    """A loss on the logsumexp (as in ring attention / cross-chunk merging) gets its gradient."""
    q, k, v, _ = _make((1, 2, 20, 32), (1, 1, 27, 32), torch.float32, kernel_device, seed)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=True, return_lse=True, backend="triton")
    grads = torch.autograd.grad((out.sum() + lse.sum()), leaves)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ro, rl = reference.attention(*ref_leaves, causal=True, return_lse=True)
    ref_grads = torch.autograd.grad(ro.sum() + rl.sum(), ref_leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        testing.assert_close_to_reference(g, r, atol=2e-5)


@pytest.mark.interpret
def test_varlen_matches_reference_with_empty_and_single_token_sequences(kernel_device, seed):
    lens_q, lens_k = [3, 0, 1, 40, 17], [5, 0, 1, 33, 17]
    cu_q, cu_k = _cu(lens_q).to(kernel_device), _cu(lens_k).to(kernel_device)
    q = testing.randn(sum(lens_q), 4, 32, dtype=torch.float16, device=kernel_device, seed=seed)
    k = testing.randn(sum(lens_k), 2, 32, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    v = testing.randn(sum(lens_k), 2, 32, dtype=torch.float16, device=kernel_device, seed=seed + 2)
    do = testing.randn(sum(lens_q), 4, 32, dtype=torch.float16, device=kernel_device, seed=seed + 3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
                                      backend="triton")
    assert lse.shape == (4, sum(lens_q))
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    base_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    base, base_lse = reference.attention_varlen(*base_leaves, cu_q, cu_k, causal=True, return_lse=True,
                                                compute_dtype=torch.float16)
    testing.assert_close_to_reference(out, ref, base, factor=FWD_FACTOR, name="out")
    testing.assert_close_to_reference(lse, ref_lse, base_lse, factor=FWD_FACTOR, name="lse")
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference.attention_varlen(*ref_leaves, cu_q, cu_k, causal=True), ref_leaves,
                                    do.double())
    base_grads = torch.autograd.grad(base, base_leaves, do)
    for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, strict=True):
        testing.assert_close_to_reference(g, r, bg, factor=BWD_FACTOR, name=name)


def test_int64_token_offsets_are_chosen_past_2_to_the_31():
    """OFFSETS_64 (token offsets in int64) exactly where a row offset times a token stride can
    reach 2**31: a 1M-token Llama-3-8B prefill in (B, T, H, D), not 128k tokens; (B, H, T, D)
    only past 16M tokens. Shapes only (meta tensors, nothing allocated)."""
    from kernel_lab.attention import ops

    def bshd(t, h):
        return torch.empty(1, t, h, 128, device="meta")

    assert ops._offsets_64("bshd", bshd(1 << 20, 32))
    assert not ops._offsets_64("bshd", bshd(1 << 17, 32), bshd(1 << 17, 8))
    assert not ops._offsets_64("bhsd", torch.empty(1, 32, 1 << 20, 128, device="meta"))
    assert ops._offsets_64("varlen", torch.empty(1 << 20, 32, 128, device="meta"))
    assert ops._offsets_64("bshd", bshd(1 << 17, 8), bshd(1 << 19, 32))  # any tensor decides


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_int64_token_offsets_give_the_same_results(layout, kernel_device, seed, monkeypatch):
    """The kernels with OFFSETS_64 forced on small shapes: the int64 path computes what the int32
    one does (forward, lse and gradients bit for bit)."""
    ops = attention_ops
    q, k, v, do = _make((1, 4, 45, 32), (1, 2, 37, 32), torch.float16, kernel_device, seed, layout)
    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = flash_attention(*leaves, causal=True, layout=layout, return_lse=True, backend="triton")
        return (out, lse, *torch.autograd.grad(out, leaves, do))
    want = run()
    monkeypatch.setattr(ops, "_offsets_64", lambda layout, *tensors: True)
    _forget_recipes(monkeypatch)  # the cached recipes and plans were worked out with the flag off
    got = run()
    assert [r[0].keywords["OFFSETS_64"] for r in ops._FWD_RECIPES.values()] == [True]
    assert [(r[0].keywords["OFFSETS_64"], r[2].keywords["OFFSETS_64"]) for r in ops._BWD_RECIPES.values()] == [
        (True, True)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    check_attention(q, k, v, do, causal=True, layout=layout)  # the int64 path against the reference


@pytest.mark.interpret
def test_varlen_strided_cu_seqlens_give_the_contiguous_result(kernel_device, seed):
    """cu_seqlens as a strided view (a column of a (B + 1, 2) table) are read by value, not as if
    contiguous."""
    lens = [3, 0, 7, 7]
    cu = _cu(lens).to(kernel_device)
    strided = torch.stack([cu, cu * 0], dim=1)[:, 0]
    assert strided.stride(0) == 2
    q, k, v = (testing.randn(sum(lens), 2, 32, dtype=torch.float16, device=kernel_device, seed=seed + i)
               for i in range(3))
    out = flash_attention_varlen(q, k, v, strided, strided, 7, 7, backend="triton")
    assert torch.equal(out, flash_attention_varlen(q, k, v, cu, cu, 7, 7, backend="triton"))
    base = reference.attention_varlen(q, k, v, cu, cu, compute_dtype=torch.float16)
    testing.assert_close_to_reference(out, reference.attention_varlen(q, k, v, cu, cu), base, factor=FWD_FACTOR)


@pytest.mark.interpret
def test_varlen_window_forward_backward_match_reference(kernel_device, seed):
    lens = [30, 1, 45]
    cu = _cu(lens).to(kernel_device)
    q, k, v = (testing.randn(sum(lens), 2, 64, dtype=torch.float16, device=kernel_device, seed=seed + i)
               for i in range(3))
    do = testing.randn(sum(lens), 2, 64, dtype=torch.float16, device=kernel_device, seed=seed + 5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu, cu, 45, 45, window=(6, 2), backend="triton")
    ref = reference.attention_varlen(q, k, v, cu, cu, window=(6, 2))
    base_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    base = reference.attention_varlen(*base_leaves, cu, cu, window=(6, 2), compute_dtype=torch.float16)
    testing.assert_close_to_reference(out, ref, base.detach(), factor=FWD_FACTOR)
    grads = torch.autograd.grad(out, leaves, do)
    base_grads = torch.autograd.grad(base, base_leaves, do)
    ref_grads = reference.attention_varlen_backward(q, k, v, do, cu, cu, window=(6, 2))
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, strict=True):
        testing.assert_close_to_reference(g, r, b, factor=BWD_FACTOR, name=name)


def _check_compiled_matches_eager(device, seed, compile_backend, dynamic=None):
    fn = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True), fullgraph=True,
                       backend=compile_backend, dynamic=dynamic)
    # a new sequence length, then a new batch and head count (dynamic=None, torch.compile's
    # default, makes a dim symbolic once it changes; dynamic=True from the first call)
    for i, (b, h, t) in enumerate([(1, 2, 24), (1, 2, 37), (2, 4, 37)]):
        q, k, v, do = _make((b, h, t, 32), (b, h // 2, t, 32), torch.float16, device, seed + i)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, do)
        # Against the reference with the usual budget (not bit-equality with eager: inductor may
        # lay out its buffers differently).
        ref = reference.attention(q, k, v, causal=True)
        base, _, base_grads = _baseline(q, k, v, do, causal=True, window=None)
        testing.assert_close_to_reference(out, ref, base, factor=FWD_FACTOR, name="compiled out")
        ref_grads = reference.attention_backward(q, k, v, do, causal=True)
        for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, strict=True):
            testing.assert_close_to_reference(g, r, bg, factor=BWD_FACTOR, name=f"compiled {name}")


def test_compile_fullgraph_reference_backend_has_no_graph_break(monkeypatch, seed):
    """The registration under torch.compile(fullgraph=True) on the CPU: fake-tensor tracing
    cannot run the interpreter, so this goes through the reference backend (aot_eager)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    _check_compiled_matches_eager("cpu", seed, "aot_eager")


# --- gpu tier: long sequences, bf16, compile, memory --------------------------------------------

GPU_CASES = [
    (2, 16, 4, 1023, 1024, 128, True, None, "bhsd", torch.bfloat16),
    (2, 8, 8, 1024, 1023, 64, False, None, "bshd", torch.float16),
    (1, 8, 2, 2048, 2048, 128, True, (256, -1), "bshd", torch.bfloat16),
    (1, 4, 4, 1, 4097, 128, True, None, "bhsd", torch.bfloat16),
    (1, 4, 1, 777, 1500, 96, True, None, "bhsd", torch.bfloat16),
    (1, 4, 2, 300, 301, 256, True, None, "bhsd", torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "window", "layout", "dtype"), GPU_CASES)
def test_gpu_large_shapes_match_reference(b, hq, hkv, tq, tk, d, causal, window, layout, dtype, seed):
    q, k, v, do = _make((b, hq, tq, d), (b, hkv, tk, d), dtype, "cuda", seed, layout)
    check_attention(q, k, v, do, causal=causal, window=window, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_gpu_compile_fullgraph_inductor_matches_eager(dynamic, seed):
    torch._dynamo.reset()
    _check_compiled_matches_eager("cuda", seed, "inductor", dynamic)


@pytest.mark.gpu
def test_gpu_varlen_large_matches_reference(seed):
    lens = [1, 0, 700, 1500, 33]
    cu = _cu(lens).cuda()
    q = testing.randn(sum(lens), 8, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
    k = testing.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    v = testing.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
    do = testing.randn(sum(lens), 8, 128, dtype=torch.bfloat16, device="cuda", seed=seed + 3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True)
    grads = torch.autograd.grad(out, leaves, do)
    base_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    base = reference.attention_varlen(*base_leaves, cu, cu, causal=True, compute_dtype=torch.bfloat16)
    base_grads = torch.autograd.grad(base, base_leaves, do)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference.attention_varlen(*ref_leaves, cu, cu, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    testing.assert_close_to_reference(out, ref.detach(), base.detach(), factor=FWD_FACTOR)
    for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, strict=True):
        testing.assert_close_to_reference(g, r, bg, factor=BWD_FACTOR, name=name)


@pytest.mark.gpu
def test_gpu_peak_memory_grows_linearly_in_t():
    """No (T, T) buffer: doubling T (forward + backward) at most doubles the peak memory above
    the inputs (a materialised score matrix would quadruple it)."""

    def peak(t):
        q, k, v, do = _make((1, 8, t, 64), (1, 8, t, 64), torch.bfloat16, "cuda", 0)
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attention(*leaves, causal=True)
        torch.autograd.grad(out, leaves, do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p1, p2 = peak(4096), peak(8192)
    assert p2 <= 2.2 * p1, f"peak extra memory {p1} B at T=4096, {p2} B at T=8192: not linear"


@pytest.mark.gpu
def test_gpu_64bit_offsets_past_2_pow_31_elements():
    """B*H*T*D > 2**31: batch offsets must be computed in 64 bits (the last batch is checked)."""
    b, t, d = (1 << 31) // (256 * 128) + 1, 256, 128
    q = torch.randn(b, 1, t, d, dtype=torch.bfloat16, device="cuda")
    out = flash_attention(q, q, q, causal=True)
    last = q[-1:].float()
    ref = reference.attention(last, last, last, causal=True, compute_dtype=torch.float32)
    base = reference.attention(q[-1:], q[-1:], q[-1:], causal=True, compute_dtype=torch.bfloat16)
    testing.assert_close_to_reference(out[-1:], ref, base, factor=FWD_FACTOR)


@pytest.mark.gpu
def test_gpu_eager_calls_do_not_dispatch_the_wrap_triton_hop(monkeypatch):
    """Eager calls launch the kernels directly: the wrap_triton higher-order op adds CPU time to
    every launch, more than a 1k-token attention takes on the GPU."""
    tkw = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    calls = []
    hopifier = getattr(tkw, "tracing_triton_hopifier_singleton", None)
    if hopifier is None:
        pytest.skip("this torch has no tracing_triton_hopifier_singleton to observe")
    original = hopifier.call_triton_kernel
    monkeypatch.setattr(hopifier, "call_triton_kernel", lambda *a, **k: calls.append(1) or original(*a, **k))
    q, k, v, do = _make((1, 2, 64, 64), (1, 2, 64, 64), torch.bfloat16, "cuda", 0)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True)
    torch.autograd.grad(out, leaves, do)
    with torch.no_grad():
        flash_attention(q, k, v)
    assert calls == []


@pytest.mark.interpret
def test_double_backward_raises_instead_of_dropping_second_order_terms(kernel_device, seed):
    q, k, v, _ = _make((1, 2, 8, 16), (1, 1, 8, 16), torch.float16, kernel_device, seed)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    testing.assert_double_backward_raises(lambda q, k, v: flash_attention(q, k, v, causal=True), *leaves)


@pytest.mark.gpu
def test_gpu_runs_on_the_inputs_gpu_not_the_current_one(seed):
    """A model spread over GPUs (device_map="auto") calls with tensors on a non-current GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, do = _make((1, 4, 128, 64), (1, 2, 128, 64), torch.bfloat16, "cuda:1", seed)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with torch.cuda.device(0):
        out = flash_attention(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, do)
    base, _, base_grads = _baseline(q, k, v, do, causal=True, window=None)
    testing.assert_close_to_reference(out, reference.attention(q, k, v, causal=True), base, factor=FWD_FACTOR)
    ref_grads = reference.attention_backward(q, k, v, do, causal=True)
    for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, strict=True):
        testing.assert_close_to_reference(g, r, bg, factor=BWD_FACTOR, name=name)


def test_backward_autotuners_per_length_bucket_and_row_class(monkeypatch):
    """The launch policy on CUDA, without launching: the backward gets one autotuner per sequence
    length bucket (the best tiles change with T) and row class, the forward one for short and one
    for long sequences, each with and without a key mask; float32 rows wider than 256 B take the
    small backward tiles (the large ones overflow Hopper's shared memory, see
    test_attention_compile_sm90), 16-bit D <= 64 its own."""
    monkeypatch.setenv(attention_ops.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(attention_ops, "_TUNED", {})
    cuda = torch.device("cuda")

    def tuner(kind, rows, head_dim=128, itemsize=2, masked=False):
        kernel = attention_ops._attn_bwd_dq_kernel if kind == "dq" else attention_ops._attn_fwd_kernel
        tuned, meta = attention_ops._kernel_and_meta(kernel, kind, head_dim, cuda, itemsize=itemsize, rows=rows,
                                                     masked=masked)
        assert meta == {}
        return tuned

    assert tuner("dq", 1000) is tuner("dq", 1024) is tuner("dq", 1)
    assert tuner("dq", 1025) is tuner("dq", 4096) is not tuner("dq", 1024)
    assert tuner("dq", 4097) is tuner("dq", 131072) is not tuner("dq", 4096)
    assert tuner("fwd", 1) is tuner("fwd", 1024) is not tuner("fwd", 1025)
    assert tuner("fwd", 4096) is tuner("fwd", 131072) is not tuner("fwd", 4096, masked=True)
    assert tuner("fwd", 1024, masked=True) not in (tuner("fwd", 1024), tuner("fwd", 4096, masked=True))
    short_tile = attention_ops._configs("fwd", "medium", short=True)[0].kwargs
    assert short_tile["BLOCK_M"] < attention_ops._configs("fwd", "medium")[0].kwargs["BLOCK_M"]
    assert "group" in tuner("dq", 1024).keys and "group" not in tuner("fwd", 1024).keys
    def first_tile(kind, head_dim, itemsize):
        return attention_ops._configs(kind, attention_ops._row_class(kind, head_dim, itemsize))[0].kwargs

    assert first_tile("dkdv", 128, 4)["BLOCK_N"] < first_tile("dkdv", 128, 2)["BLOCK_N"]  # float32: small tiles
    assert attention_ops._row_class("dkdv", 64, 2) == "narrow" != attention_ops._row_class("dkdv", 64, 4)
    assert attention_ops._row_class("fwd", 64, 2) == "medium"  # the forward has no narrow tiles
    assert tuner("dq", 1024, head_dim=64) is not tuner("dq", 1024)  # other candidates, other tuner
