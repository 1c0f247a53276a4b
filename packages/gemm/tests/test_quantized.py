"""Weight-only int8 / int4 quantization: packing round trip, error bounds, quantized_matmul vs the
dequantized reference, QuantizedLinear and patch_hf."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kernel_lab.gemm import Linear, QuantizedLinear, QuantizedWeight, patch_hf, quantize_weight, quantized_matmul
from kernel_lab.shared import reference, testing

# Factor 2 of the tolerance rule (docs/correctness.md). The baseline is x @ dequantize(w)^T in x's dtype: the kernel
# multiplies the exact integer codes and applies the scale in float32, so it rounds less.
FACTOR = 2.0


def exact_weight(n, k, bits, group_size, symmetric, seed):
    """A weight of the form (code - zero) * scale with power-of-two scales, each group reaching
    both ends of the code range: quantize_weight must reproduce it exactly."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    scales = 2.0 ** torch.randint(-8, -2, (n, groups, 1), generator=gen).float()
    if symmetric:
        qmax = 127 if bits == 8 else 7
        codes = torch.randint(-qmax, qmax + 1, (n, groups, group_size), generator=gen)
        codes[..., 0], codes[..., 1] = qmax, -qmax
        return (codes * scales).reshape(n, k)
    levels = (1 << bits) - 1
    zeros = torch.randint(1, levels, (n, groups, 1), generator=gen)
    codes = torch.randint(0, levels + 1, (n, groups, group_size), generator=gen)
    codes[..., 0], codes[..., 1] = 0, levels
    return ((codes - zeros) * scales).reshape(n, k)


# --- reference tier --------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, None])
def test_quantize_round_trip_is_exact_for_representable_weights(seed, bits, symmetric, group_size):
    w = exact_weight(6, 64, bits, group_size or 64, symmetric, seed)
    qw = quantize_weight(w, bits, group_size, symmetric)
    assert torch.equal(qw.dequantize(), w)
    assert qw.qdata.shape == ((6, 64) if bits == 8 else (6, 32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantization_error_is_within_half_a_step(seed, bits, symmetric):
    """Round-to-nearest: |w - dequant(w)| <= scale / 2, plus, asymmetric only, the zero point
    rounded to an integer (<= 1/2 step). The stored scale is rounded up, so no extreme code is
    pushed past the range and clamped."""
    w = testing.randn(8, 128, dtype=torch.bfloat16, seed=seed)
    qw = quantize_weight(w, bits, 32, symmetric)
    bound = 0.5 + (0.0 if symmetric else 0.5)
    step = qw.scales.double().repeat_interleave(32, dim=1)
    exact = reference.dequantize_weight(qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=32)
    err = (exact - w.double()).abs()
    assert (err <= step * bound).all(), (err / step).max()


@pytest.mark.parametrize(
    "bits,group_size,minimum", [(8, None, 1.99), (8, 128, 1.95), (4, 128, 3.8), (4, None, 3.99)]
)
def test_compression_counts_scales(bits, group_size, minimum):
    qw = quantize_weight(torch.randn(256, 4096, dtype=torch.bfloat16), bits, group_size)
    assert qw.dense_nbytes == 256 * 4096 * 2
    assert minimum <= qw.compression < (2.0 if bits == 8 else 4.0)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(bits=3), ValueError, "bits must be 4 or 8"),
        (dict(group_size=48), ValueError, "multiple of 32"),
        (dict(group_size=64), ValueError, r"must divide K = 96"),
        (dict(group_size=0), ValueError, "multiple of 32"),
    ],
)
def test_quantize_weight_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize_weight(torch.zeros(4, 96), **kwargs)


def test_quantize_int4_needs_even_k_and_float_weight():
    with pytest.raises(ValueError, match="even K"):
        quantize_weight(torch.zeros(4, 33), bits=4, group_size=None)
    with pytest.raises(TypeError, match=r"w\.dtype"):
        quantize_weight(torch.zeros(4, 32, dtype=torch.int8))


def test_quantized_matmul_validation():
    qw = quantize_weight(torch.randn(8, 64), 8, 32)
    with pytest.raises(ValueError, match="K mismatch"):
        quantized_matmul(torch.zeros(2, 32, dtype=torch.float16), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        quantized_matmul(torch.zeros(2, 64, dtype=torch.float16), torch.zeros(8, 64))
    with pytest.raises(TypeError, match=r"x\.dtype"):
        quantized_matmul(torch.zeros(2, 64), qw)


def test_quantized_matmul_reference_backend(seed):
    x = testing.randn(3, 64, dtype=torch.bfloat16, seed=seed)
    qw = quantize_weight(testing.randn(8, 64, seed=seed + 1), 4, 32, symmetric=False)
    out = quantized_matmul(x, qw, backend="reference")
    ref = reference.quantized_matmul(x, qw.qdata, qw.scales, qw.zeros, bits=4, group_size=32)
    testing.assert_close_to_reference(out, ref, x @ qw.dequantize().to(x.dtype).T, factor=FACTOR)


# --- interpret tier ----------------------------------------------------------------------------


def check_quantized(x, qw, bias=None, out=None, name=None):
    """quantized_matmul(x, qw) + bias (or `out`, computed otherwise from the same operands)
    against the float64 reference, with the tolerance rule."""
    if out is None:
        out = quantized_matmul(x, qw, bias=bias, backend="triton")
    ref = reference.quantized_matmul(
        x, qw.qdata, qw.scales, qw.zeros, bits=qw.bits, group_size=qw.group_size, bias=bias
    )
    base = x @ qw.dequantize().to(x.dtype).T
    if bias is not None:
        base = base + bias
    assert out.dtype == x.dtype
    testing.assert_close_to_reference(out, ref, base, factor=FACTOR, name=name or f"int{qw.bits} matmul")


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 3, 70])
def test_quantized_matmul_strided_bias(kernel_device, seed, bits, m):
    """A bias view with a step is read at its stride (the launcher copies it to unit stride)."""
    x = testing.randn(m, 96, dtype=torch.float16, device=kernel_device, seed=seed)
    qw = quantize_weight(testing.randn(40, 96, seed=seed + 1, scale=0.1), bits, None if bits == 8 else 32)
    qw = QuantizedWeight(qw.qdata.to(kernel_device), qw.scales.to(kernel_device), None, qw.bits, qw.group_size,
                         qw.shape, qw.dtype)
    check_quantized(x, qw, testing.randn(80, dtype=torch.float16, device=kernel_device, seed=seed + 2)[::2])


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("m", [1, 3, 70])  # one row (the GEMVs: int8 per channel, int4 group 32), decode, prefill
def test_quantized_matmul_matches_dequantized_reference(kernel_device, seed, bits, symmetric, group_size, m):
    x = testing.randn(m, 96, dtype=torch.float16, device=kernel_device, seed=seed)
    w = testing.randn(40, 96, seed=seed + 1, scale=0.1)
    qw = quantize_weight(w, bits, group_size, symmetric)
    qw = QuantizedWeight(
        qw.qdata.to(kernel_device), qw.scales.to(kernel_device),
        None if qw.zeros is None else qw.zeros.to(kernel_device), qw.bits, qw.group_size, qw.shape, qw.dtype,
    )
    bias = testing.randn(40, dtype=torch.float16, device=kernel_device, seed=seed + 2) if m < 70 else None
    check_quantized(x, qw, bias)


# (m, n, k) of the decode kernel's interpret cases, each run with the interpreter's 4 stand-in SMs
# and with 64 (more slices and K splits): test_decode_cases_cover_the_plan checks what they reach.
DECODE_SHAPES = [(2, 16, 512), (16, 40, 96), (64, 24, 160), (3, 48, 384), (5, 300, 64), (4, 20, 70), (24, 40, 256)]
DECODE_FORMATS = [(8, None, True), (8, 32, False), (4, 32, True), (4, None, False)]  # bits, group_size, symmetric


def _decode_plans():
    from kernel_lab.gemm import ops

    for (m, n, k), (bits, group_size, _), sms in itertools.product(DECODE_SHAPES, DECODE_FORMATS, (4, 64)):
        if group_size is None or k % group_size == 0:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ops.runtime, "sm_count", lambda device, sms=sms: sms)
                plan = ops._weight_only_plan(m, n, k, bits, group_size or k, torch.device("cpu"))
            yield (m, n, k), bits, group_size, plan


def test_decode_cases_cover_the_plan():
    """The interpret cases below reach every branch of the decode kernel: several slices, a K
    split (reduce launch), slices that end past K and empty ones, slices of several steps with the
    group changing between them, a K tail, M below and at BLOCK_M, BLOCK_M of 16, 32 and 64 (int4
    splits x into even and odd columns up to 32 rows and joins the nibbles at 64)."""
    plans = list(_decode_plans())
    assert any(p.split_k > 1 for *_, p in plans)
    assert any(p.slices > 1 and p.slices * p.slice_len * p.split_k - k >= p.slice_len for (_, _, k), _, _, p in plans)
    assert any(p.slice_len > p.block_k and g is not None and g <= p.block_k for _, _, g, p in plans)
    assert any(k % p.block_k for (_, _, k), *_, p in plans)
    assert {m < p.block_m for (m, _, _), *_, p in plans} == {True, False}
    assert {p.block_m for *_, p in plans} == {16, 32, 64}


@pytest.mark.interpret
@pytest.mark.parametrize("sms", [4, 64])
@pytest.mark.parametrize("bits,group_size,symmetric", DECODE_FORMATS)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in DECODE_SHAPES])
def test_weight_only_decode_slices_and_splits(kernel_device, seed, monkeypatch, sms, bits, group_size, symmetric,
                                              shape):
    """The decode kernel cuts each program's K range into slices, one a warp, summed after the
    loop, and K across programs where the slices leave SMs idle (a reduce launch): slices that
    end past K, empty ones, group-wise and per-channel scales, zero points, bias."""
    from kernel_lab.gemm import ops

    m, n, k = shape
    if group_size is not None and k % group_size:
        pytest.skip("group_size must divide K")
    monkeypatch.setattr(ops.runtime, "sm_count", lambda device: sms)
    x = testing.randn(m, k, dtype=torch.float16, device=kernel_device, seed=seed)
    w = testing.randn(n, k, dtype=torch.float16, device=kernel_device, seed=seed + 1, scale=k**-0.5)
    qw = quantize_weight(w, bits, group_size, symmetric)
    check_quantized(x, qw, testing.randn(n, dtype=torch.float16, device=kernel_device, seed=seed + 2))


def test_weight_only_decode_plan_on_132_sms(monkeypatch):
    """The decode plan at the Llama-3-8B projections on an H100 (132 SMs), host only: the slice
    counts, step lengths and pipeline depths of the sweeps quoted in ops.py (WEIGHT_ONLY_*), no
    split across programs."""
    from kernel_lab.gemm import ops

    monkeypatch.setattr(ops.runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(ops.runtime, "device_info", lambda index=None: SimpleNamespace(capability=(9, 0)))
    cuda = torch.device("cuda")
    projections = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]
    swept = {  # (bits, m): (block_k, slices per projection, stages per projection)
        (8, 16): (256, [2, 1, 1, 2], [4, 4, 3, 4]), (4, 16): (128, [4, 4, 2, 4], [3, 3, 3, 3]),
        (8, 32): (128, [4, 2, 1, 4], [3, 3, 3, 3]), (4, 32): (128, [4, 4, 1, 4], [3, 3, 3, 3]),
        (8, 64): (128, [2, 1, 1, 2], [3, 3, 3, 3]), (4, 64): (128, [2, 1, 1, 2], [3, 3, 3, 3]),
    }
    for (bits, m), (block_k, slices, stages) in swept.items():
        for (n, k), s, st in zip(projections, slices, stages, strict=True):
            plan = ops._weight_only_plan(m, n, k, bits, k if bits == 8 else 128, cuda)
            got = (plan.block_m, plan.block_k, plan.slices, plan.split_k, plan.num_stages)
            assert got == (m, block_k, s, 1, st), (bits, m, n, k, plan)
            assert plan.slice_len * plan.slices >= k and plan.slice_len % plan.block_k == 0
    # 96 rows: eight slices and a split, with 3 stages where 4 would pass the shared memory
    plan = ops._weight_only_plan(16, 96, 4096, 8, 4096, cuda)
    assert (plan.slices, plan.split_k, plan.num_stages) == (8, 2, 3)


@pytest.mark.interpret
@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_tails_and_strided_row(kernel_device, seed, bits, group_size, symmetric, dtype):
    """The one-row weight-only kernels (int8 per channel, int4 group-wise; no tensor cores, so
    bfloat16 runs under the interpreter too): N off every block size, K not a whole number of
    the int4 kernel's steps, x a strided row (column stride 3)."""
    k = 100 if bits == 8 else 320
    x = testing.randn(k, 3, dtype=dtype, device=kernel_device, seed=seed)[:, 1].unsqueeze(0)
    assert x.stride(1) == 3
    w = testing.randn(37, k, seed=seed + 1, scale=0.1)
    qw = quantize_weight(w, bits, group_size, symmetric)
    qw = QuantizedWeight(
        qw.qdata.to(kernel_device), qw.scales.to(dtype).to(kernel_device),
        None if qw.zeros is None else qw.zeros.to(kernel_device), bits, qw.group_size, qw.shape, dtype,
    )
    check_quantized(x, qw, testing.randn(37, dtype=dtype, device=kernel_device, seed=seed + 2))


@pytest.mark.interpret
def test_quantized_linear_module_and_strided_batched_input(kernel_device, seed):
    lin = nn.Linear(64, 24).to(kernel_device, torch.float16)
    q = QuantizedLinear.from_linear(lin, bits=4, group_size=32)
    x = testing.strided_rows(testing.randn(2, 5, 64, dtype=torch.float16, device=kernel_device, seed=seed))
    out = q(x)
    assert out.shape == (2, 5, 24)
    check_quantized(x.reshape(10, 64), q.qweight, lin.bias.detach())
    assert "bits=4" in repr(q) and q.compression > 3


@pytest.mark.interpret
@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32)])
def test_decode_reads_a_column_major_x_in_place(kernel_device, seed, bits, group_size):
    """The decode kernel's x tiles follow x's column stride: a column-major x (a transposed
    view) gives the result of its contiguous copy."""
    x = testing.randn(96, 3, dtype=torch.float16, device=kernel_device, seed=seed).t()
    w = testing.randn(40, 96, dtype=torch.float16, device=kernel_device, seed=seed + 1, scale=0.1)
    qw = quantize_weight(w, bits, group_size)
    assert x.stride() == (1, 3)
    assert torch.equal(quantized_matmul(x, qw), quantized_matmul(x.contiguous(), qw))
    check_quantized(x, qw)


def test_quantized_linear_builds_its_weight_once_per_set_of_buffers(seed, monkeypatch):
    """forward reuses one checked QuantizedWeight (no per-call rebuild) until something it was
    built from changes: a buffer or format field assigned, a device move (which must not keep
    the old tensors alive), a buffer's shape or dtype changed in place; non-contiguous buffers,
    which need copies, are not held."""
    import weakref

    from kernel_lab.gemm import modules

    builds = []
    monkeypatch.setattr(modules, "QuantizedWeight", lambda *a: builds.append(1) or QuantizedWeight(*a))
    torch.manual_seed(seed)
    q = QuantizedLinear.from_linear(nn.Linear(64, 24).half(), bits=4, group_size=32, symmetric=False)
    x = testing.randn(3, 64, dtype=torch.float16, seed=seed)
    first = q(x)
    check_quantized(x, q.qweight, q.bias.detach(), out=first, name="QuantizedLinear, first call")
    assert torch.equal(q(x), first) and len(builds) == 1 and q.qweight.qdata is q.qdata

    q.load_state_dict(q.state_dict())  # in place, same tensors: the weight is rebuilt (and rechecked) once
    q(x), q(x)
    assert len(builds) == 2
    q.scales = q.scales * 2  # an assigned buffer: the next call uses it
    doubled = QuantizedWeight(q.qdata, q.scales, q.zeros, 4, 32, (24, 64), torch.float16)
    check_quantized(x, doubled, q.bias.detach(), out=q(x), name="QuantizedLinear after a scales assignment")
    assert len(builds) == 3
    del doubled

    old = weakref.ref(q.qdata)
    q.to(torch.device("meta"))
    assert old() is None, "a device move left the old codes alive"
    assert q.qweight.qdata.device.type == "meta" and len(builds) == 4

    q.group_size = 48  # a format field: rechecked
    with pytest.raises(ValueError, match="group_size must divide K"):
        _ = q.qweight
    q.group_size = 32
    assert q.qweight is q.qweight
    q.scales.data = torch.zeros(24, 3, dtype=torch.float16, device="meta")  # another shape, in place: refused
    with pytest.raises(ValueError, match="scales must be floating point of shape"):
        _ = q.qweight

    q = QuantizedLinear.from_linear(nn.Linear(64, 24).half(), bits=8, group_size=None)
    q.qdata = q.qdata.t().contiguous().t()  # non-contiguous codes: copied by every build, not held
    n = len(builds)
    q(x), q(x)
    assert len(builds) == n + 2


@pytest.mark.interpret
def test_patch_hf_replaces_linears(kernel_device, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(kernel_device, torch.float16)
    model.lm_head = nn.Linear(16, 8).to(kernel_device, torch.float16)
    x = testing.randn(3, 64, dtype=torch.float16, device=kernel_device, seed=seed)
    w0, b0, w2, b2 = (t.detach().clone() for t in (model[0].weight, model[0].bias, model[2].weight, model[2].bias))
    expected = model[2](model[1](model[0](x))).detach()  # the unpatched fp16 model: the baseline
    assert patch_hf(model) == 2
    assert isinstance(model[0], Linear) and isinstance(model[2], Linear) and type(model.lm_head) is nn.Linear
    out = model[2](model[1](model[0](x)))
    # The float64 reference of the whole stack, from the weights saved before patching.
    ref = reference.matmul(reference.matmul(x, w0.t(), b0, "relu"), w2.t(), b2)
    testing.assert_close_to_reference(out, ref, expected, factor=FACTOR, name="patched model")
    assert patch_hf(model, bits=8) == 0  # Linear subclasses are not replaced twice


def test_patch_hf_replaces_a_shared_linear_once_under_every_name():
    """A Linear under two parents, or under two names of one parent (q and k tied), becomes one
    replacement everywhere: one set of quantized codes, the same result through every name."""
    lin = nn.Linear(64, 32).to(torch.float16)
    inner = nn.Module()
    inner.q = inner.k = lin
    model = nn.ModuleList([nn.Sequential(lin), inner])
    assert patch_hf(model, bits=8, group_size=32) == 1
    assert isinstance(inner.q, QuantizedLinear) and inner.q is inner.k is model[0][0]


def test_patch_hf_keeps_hooks_and_leaves_accelerate_wrapped_layers_alone():
    """A forward hook registered on a replaced layer fires on its replacement (kernel_lab.shared.hf);
    a layer whose forward accelerate wrapped (`_hf_hook`: device_map / offload) is not replaced."""
    hooked, wrapped = nn.Linear(64, 32).to(torch.float16), nn.Linear(64, 32).to(torch.float16)
    calls = []
    hooked.register_forward_hook(lambda m, args, out: calls.append(m))
    wrapped._hf_hook = object()
    model = nn.ModuleList([hooked, wrapped])
    assert patch_hf(model, bits=8, group_size=32) == 1
    assert isinstance(model[0], QuantizedLinear) and model[1] is wrapped
    assert model[0]._forward_hooks is hooked._forward_hooks and not calls
    model[0](testing.randn(3, 64, dtype=torch.float16, seed=0))
    assert calls == [model[0]]


@pytest.mark.interpret
@pytest.mark.parametrize("fuse_gate_up", [False, True])
@pytest.mark.parametrize("bits", [None, 8])
def test_patch_hf_after_mlp_patch_hf_replaces_the_gated_mlp_projections(kernel_device, seed, bits, fuse_gate_up):
    """kernel_lab.mlp's GatedMLP (what mlp.patch_hf swaps in) holds nn.Linear projections under
    the Hugging Face names (gate_proj / up_proj / down_proj, or one packed gate_up_proj): patch_hf
    replaces them there, same names and keys, and the module's output keeps the tolerance rule
    against the float64 gated MLP of the weights it uses (the other order: mlp's tests)."""
    mlp = pytest.importorskip("kernel_lab.mlp", reason="kernel_lab.mlp is not installed")
    torch.manual_seed(seed)
    model = nn.ModuleDict({"mlp": mlp.SwiGLUMLP(64, 96, fuse_gate_up=fuse_gate_up)}).to(kernel_device, torch.float16)
    names = [name for name, _ in model.mlp.named_children()]
    assert patch_hf(model, bits=bits, group_size=32) == len(names)
    cls = Linear if bits is None else QuantizedLinear
    assert [name for name, _ in model.mlp.named_children()] == names
    assert all(isinstance(m, cls) for m in model.mlp.children())
    weights = {n: m.weight if bits is None else m.qweight.dequantize() for n, m in model.mlp.named_children()}
    w_gate, w_up = weights["gate_up_proj"].chunk(2) if fuse_gate_up else (weights["gate_proj"], weights["up_proj"])
    x = testing.randn(3, 5, 64, dtype=torch.float16, device=kernel_device, seed=seed)
    with torch.no_grad():
        out = model.mlp(x)
        baseline = nn.functional.linear(nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t()), weights["down_proj"])
    ref = reference.gated_mlp(x, w_gate, w_up, weights["down_proj"], "silu")
    testing.assert_close_to_reference(out, ref, baseline, factor=FACTOR, name="patched GatedMLP")


# --- gpu tier ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 128), (4, 128)])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 14336, 4096), (300, 4096, 4096)])
def test_quantized_matmul_llama_shapes(seed, bits, group_size, m, n, k):
    x = testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=seed)
    w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + 1, scale=k**-0.5)
    check_quantized(x, quantize_weight(w, bits, group_size))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size,symmetric", [(8, None, True), (8, 64, False), (4, 128, True),
                                                       (4, 32, False)])
def test_prefill_tiles_with_tails(seed, dtype, bits, group_size, symmetric):
    """The prefill kernel (M > 64; it computes c^T = dequant(q) @ x^T) in the launcher's GPU tiles
    (QUANT_PREFILL_TILES) with partial tiles in M and N, a bias and zero points, in both 16-bit
    dtypes (the interpreter runs its tensor-core products in float16 and float32 only)."""
    m, n, k = 200, 328, 1024
    x = testing.randn(m, k, dtype=dtype, device="cuda", seed=seed)
    w = testing.randn(n, k, dtype=dtype, device="cuda", seed=seed + 1, scale=k**-0.5)
    check_quantized(x, quantize_weight(w, bits, group_size, symmetric),
                    testing.randn(n, dtype=dtype, device="cuda", seed=seed + 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [2, 17, 32, 64])
def test_int4_decode_ptx_dequantization(seed, dtype, symmetric, m):
    """The int4 decode kernel's PTX nibble conversion (the interpreter runs Triton's form) in
    both of its loops: x split into even and odd columns (up to 32 rows), the nibbles joined
    into column order (64 rows); every nibble value (1 to 15 symmetric, stored offset by 8; 0 to
    15 with zero points)."""
    n, k = 272, 2048
    w = testing.randn(n, k, dtype=dtype, device="cuda", seed=seed + 1, scale=k**-0.5)
    qw = quantize_weight(w, 4, 128, symmetric)
    nibbles = set(torch.cat([qw.qdata & 15, qw.qdata >> 4]).unique().tolist())
    assert nibbles == set(range(1 if symmetric else 0, 16))
    check_quantized(testing.randn(m, k, dtype=dtype, device="cuda", seed=seed), qw,
                    testing.randn(n, dtype=dtype, device="cuda", seed=seed + 2))


@pytest.mark.gpu
def test_quantized_matmul_torch_compile_fullgraph(seed):
    x = testing.randn(8, 512, dtype=torch.bfloat16, device="cuda", seed=seed)
    qw = quantize_weight(testing.randn(256, 512, dtype=torch.bfloat16, device="cuda", seed=seed + 1), 4, 128)
    out = torch.compile(lambda x: quantized_matmul(x, qw), fullgraph=True)(x)
    torch.testing.assert_close(out, quantized_matmul(x, qw), rtol=0, atol=0)
    ref = reference.quantized_matmul(x, qw.qdata, qw.scales, qw.zeros, bits=qw.bits, group_size=qw.group_size)
    testing.assert_close_to_reference(out, ref, x @ qw.dequantize().to(x.dtype).T, factor=FACTOR,
                                      name="compiled int4 matmul")


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 128)])
def test_compile_sees_only_the_output_written_by_the_decode_kernel(bits, group_size):
    """torch.compile works out which tensors a user Triton kernel writes by building it with the
    scalar arguments as constants; where that build fails it assumes every input is written,
    clones each one (the weight too, on every call) and, with the output also passed in an unused
    pointer's place, returned an unwritten clone (a tl.multiple_of on a scalar argument did that:
    wrong results under torch.compile). Its analysis must name the output alone."""
    from torch._higher_order_ops import triton_kernel_wrap

    from kernel_lab.gemm import _kernels, ops

    m, n, k = 8, 256, 512
    x = testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=0)
    qw = quantize_weight(testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=1), bits, group_size)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    plan = ops._weight_only_plan(m, n, k, bits, qw.group_size, x.device)
    args = dict(
        x_ptr=x, q_ptr=qw.qdata, scales_ptr=qw.scales, zeros_ptr=c, c_ptr=c, bias_ptr=c, M=m, N=n, K=k,
        stride_xm=k, stride_xk=1, stride_qn=qw.qdata.stride(0), stride_qk=1, stride_sn=qw.scales.stride(0),
        stride_sg=qw.scales.stride(1), stride_cm=n, stride_cn=1, stride_cs=0,
        SLICE_STEPS=plan.slice_len // plan.block_k, GROUP_SIZE=0 if qw.group_size == k else qw.group_size,
        BITS=bits, HAS_ZEROS=False,
        PER_CHANNEL=qw.group_size == k, HAS_BIAS=False, WRITE_PARTIAL=False, USE_PRMT=True, SLICES=plan.slices,
        K_TAIL=False, MASK_M=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=plan.block_k,
    )
    if hasattr(triton_kernel_wrap, "identify_mutated_tensors"):  # torch 2.11
        written = triton_kernel_wrap.identify_mutated_tensors(_kernels._weight_only_decode_kernel, args, {})
    else:  # later torch
        accessed = triton_kernel_wrap.identify_accessed_tensors(_kernels._weight_only_decode_kernel, args, {})
        written = [dep.name for dep in accessed.read_writes.writes]
    assert sorted(written) == ["c_ptr"]


@pytest.mark.interpret
def test_backward_through_the_forward_only_op_raises(kernel_device, seed):
    """Forward only: a backward through it raises instead of silently dropping its gradient."""
    w = testing.randn(48, 64, dtype=torch.float16, device=kernel_device, seed=seed)
    qw = quantize_weight(w, 8, 32, True)
    x = testing.randn(5, 64, dtype=torch.float16, device=kernel_device, seed=seed + 1, requires_grad=True)
    y = quantized_matmul(x, qw)
    with pytest.raises(RuntimeError, match="quantized_matmul is forward only"):
        (y.float().sum() + x.float().sum()).backward()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"group_size": 48}, "group_size must divide K = 96"),
        ({"group_size": 40}, "group_size must divide K = 96"),
        ({"scales": "drop_group"}, r"scales must be floating point of shape \(8, 3\)"),
        ({"qdata": "as_uint8"}, r"qdata must be torch.int8 of shape \(8, 96\)"),
        ({"zeros": "wrong_shape"}, "zeros must be None or uint8 of shape"),
        ({"shape": (8, 95)}, "group_size must divide K = 95"),
        ({"shape": (8, 96, 1)}, r"shape must be \(N, K\)"),
        ({"dtype": torch.int8}, "dtype .* must be float16, bfloat16 or float32"),
    ],
)
def test_quantized_weight_fields_are_checked(change, match):
    """A QuantizedWeight built by hand (or from a state dict) is checked as quantize_weight's
    own are: the kernels index codes, scales and zero points by these fields."""
    qw = quantize_weight(testing.randn(8, 96, seed=0), 8, 32, symmetric="zeros" not in change)
    fields = dict(qdata=qw.qdata, scales=qw.scales, zeros=qw.zeros, bits=qw.bits, group_size=qw.group_size,
                  shape=qw.shape, dtype=qw.dtype)
    value = next(iter(change.values()))
    if value == "drop_group":
        value = qw.scales[:, :2]
    elif value == "as_uint8":
        value = qw.qdata.view(torch.uint8)
    elif value == "wrong_shape":
        value = torch.zeros(8, 2, dtype=torch.uint8)
    fields[next(iter(change))] = value
    with pytest.raises(ValueError, match=match):
        QuantizedWeight(**fields)


@pytest.mark.interpret
@pytest.mark.parametrize("bits,symmetric", [(4, True), (8, False)])
@pytest.mark.parametrize("m", [1, 3])  # the GEMV and the tiled kernel
def test_quantized_weight_from_strided_tensors_gives_the_contiguous_result(kernel_device, seed, bits, symmetric, m):
    """Codes, scales and zero points given as column-major views (e.g. loaded transposed) are
    read by value: QuantizedWeight lays them out as the kernels index them."""
    qw = quantize_weight(testing.randn(24, 64, seed=seed, scale=0.1).to(torch.float16), bits, 32, symmetric)
    qw = QuantizedWeight(qw.qdata.to(kernel_device), qw.scales.to(kernel_device),
                         None if qw.zeros is None else qw.zeros.to(kernel_device), bits, 32, qw.shape, qw.dtype)
    def column_major(t):
        return None if t is None else t.t().contiguous().t()
    strided = QuantizedWeight(column_major(qw.qdata), column_major(qw.scales), column_major(qw.zeros), bits, 32,
                              qw.shape, qw.dtype)
    x = testing.randn(m, 64, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    assert torch.equal(quantized_matmul(x, strided), quantized_matmul(x, qw))
    check_quantized(x, strided)  # and against the dequantized reference


def test_column_major_x_past_int32_k_offsets_is_read_as_rows():
    """The prefill kernels of quantized_matmul and rms_norm_linear form column x column-stride
    offsets in int32: a column-major x whose offsets could reach 2**31 is copied to rows first;
    smaller strided x is read in place. Shapes only (meta tensors)."""
    from kernel_lab.gemm import ops

    wide = torch.empty(8192, 300000, device="meta").t()  # (300000, 8192), column stride 300000
    assert ops._rows_for_int32_k_offsets(wide).stride() == (8192, 1)
    small = torch.empty(64, 1000).t()
    assert ops._rows_for_int32_k_offsets(small) is small


@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_float16_weights_keep_their_codes(seed, bits):
    """float16 groups whose max|w| (1e-4) is far below float16's smallest normal times the code
    range: the scales go subnormal (rounded up) instead of being clamped at 6.1e-5, which left
    such a group the codes 0..2 at int8."""
    w = (testing.randn(8, 128, seed=seed) * 1e-4).to(torch.float16)
    qw = quantize_weight(w, bits, 32, True)
    qmax = 127 if bits == 8 else 7
    amax = w.float().reshape(8, 4, 32).abs().amax(-1)
    assert (qw.scales.float() >= amax / qmax).all()
    exact = reference.dequantize_weight(qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=32)
    err = (exact - w.double()).abs()
    assert (err <= qw.scales.double().repeat_interleave(32, dim=1) / 2).all()
    assert err.max() <= 0.6 * w.double().abs().max() / qmax


def test_quantize_weight_edge_values():
    """A NaN / inf weight and a non-int bits are refused; a float16 group near 65504 dequantizes
    finite (its scale is rounded up, so code x scale may pass 65504 by less than a step); an empty
    weight reports a compression of 1."""
    w = torch.ones(4, 64, dtype=torch.float16)
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_weight(w)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_weight(torch.ones(4, 64, dtype=torch.float16), bits=8.0)
    big = torch.full((2, 64), 65504.0, dtype=torch.float16)
    for bits in (8, 4):
        deq = quantize_weight(big, bits, 32).dequantize()
        assert torch.isfinite(deq).all() and (deq.float() - big.float()).abs().max() <= 65504 / 127
    empty = quantize_weight(torch.zeros(0, 64, dtype=torch.float16), group_size=None)
    assert empty.compression == 1.0 and "compression=1.00x" in repr(QuantizedLinear(empty))


def test_patch_hf_checks_its_arguments_before_replacing_anything():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(96, 64)).half()
    for kwargs in (dict(bits=8, group_size=48), dict(bits=3)):
        with pytest.raises(ValueError, match="patch_hf"):
            patch_hf(model, **kwargs)
        assert all(type(m) is nn.Linear for m in model)


def test_patch_hf_replaces_nothing_when_a_layer_cannot_be_quantized():
    """Every replacement is built before any is put in: an int4 layer with an odd K (or a NaN
    weight) raised from quantize_weight after the layers before it had been replaced."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 63), nn.Linear(63, 8)).half()
    with pytest.raises(ValueError, match="needs an even K"):
        patch_hf(model, bits=4, skip=())
    assert all(type(m) is nn.Linear for m in model)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).half()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        patch_hf(model, bits=8, skip=())
    assert all(type(m) is nn.Linear for m in model)


def test_patch_hf_rejects_a_string_skip():
    """skip="lm_head" is a tuple of its characters to `in`: every layer whose name holds one of
    them (e.g. any "layers.N.self_attn.q_proj") was skipped without a word."""
    model = nn.Sequential(nn.Linear(64, 64)).half()
    with pytest.raises(TypeError, match="skip must be a tuple of names"):
        patch_hf(model, skip="lm_head")
    assert type(model[0]) is nn.Linear


@pytest.mark.interpret
def test_linear_takes_a_vector_as_nn_linear_does(kernel_device, seed):
    lin = nn.Linear(64, 24).to(kernel_device, torch.float16)
    x = testing.randn(64, dtype=torch.float16, device=kernel_device, seed=seed)
    out = Linear.from_linear(lin)(x)
    assert out.shape == (24,)
    torch.testing.assert_close(out, Linear.from_linear(lin)(x[None])[0], rtol=0, atol=0)
    # and the float64 reference, the budget set by nn.Linear in float16 (what it replaces)
    testing.assert_close_to_reference(out, reference.matmul(x[None], lin.weight.t(), lin.bias)[0], lin(x))


def test_patch_hf_keeps_eval_mode():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).half().eval()
    assert patch_hf(model, bits=8, group_size=32) == 2
    assert all(not m.training for m in model)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, 128])
def test_weight_without_columns_quantizes_and_gives_the_bias(seed, bits, symmetric, group_size):
    """K = 0 (an nn.Linear(0, N), legal in torch): no codes; per channel one scale per row, that
    of an all-zero row (the ZeroDivisionError of K // group_size at group_size = K = 0 is gone),
    group-wise no scales; quantized_matmul gives the bias (zeros without one), as the reference."""
    w = torch.zeros(5, 0, dtype=torch.float16)
    qw = quantize_weight(w, bits, group_size, symmetric)
    assert qw.qdata.shape == (5, 0) and qw.shape == (5, 0) and qw.dequantize().shape == (5, 0)
    if group_size is None:
        zero_rows = quantize_weight(torch.zeros(5, 32, dtype=torch.float16), bits, None, symmetric)
        assert qw.group_size == 0 and torch.equal(qw.scales, zero_rows.scales)
        assert (qw.zeros is None) == symmetric and (symmetric or torch.equal(qw.zeros, zero_rows.zeros))
    else:
        assert qw.scales.shape == (5, 0)
    assert qw.compression == 1.0
    x = testing.randn(3, 0, dtype=torch.float16, seed=seed)
    bias = testing.randn(5, dtype=torch.float16, seed=seed + 1)
    ref = reference.quantized_matmul(x, qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=qw.group_size, bias=bias)
    out = quantized_matmul(x, qw, bias=bias)
    assert torch.equal(out, ref.to(torch.float16)) and torch.equal(out, bias.expand(3, 5))
    assert torch.equal(quantized_matmul(x, qw), torch.zeros(3, 5, dtype=torch.float16))
    lin = nn.Linear(0, 5).half()
    q = QuantizedLinear.from_linear(lin, bits, group_size, symmetric)
    assert torch.equal(q(x), lin.bias.detach().expand(3, 5)) and "in_features=0" in repr(q)
    # rebuilt from its fields (a state dict): the same checks accept it
    assert QuantizedWeight(qw.qdata, qw.scales, qw.zeros, bits, qw.group_size, (5, 0), qw.dtype).shape == (5, 0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantization_near_the_float32_range(seed, bits, group_size, dtype, symmetric):
    """Asymmetric groups spanning more than float32's max (max - min overflowed to inf: inf
    scales, NaN weights): the range is taken in float64, so the scales are finite and every weight
    is within a step of its value (the documented bound); and no (code - zero) x scale passes
    float32's max (symmetric int8 at 3.4028235e38: the rounded-up scale x 127 did, inf in float32)."""
    big = torch.finfo(dtype).max
    w = testing.randn(4, 64, seed=seed).clamp(-1, 1) * 1e37
    w[0, ::2], w[0, 1::2] = big, -big  # the whole range: 2 x max
    w[1, :32], w[1, 32:] = 3e38, -1.7e38
    w[2, 5], w[2, 40] = -3e38, 1.7e38
    w = w.to(dtype)
    assert torch.isfinite(w).all()
    qw = quantize_weight(w, bits, group_size, symmetric)
    assert torch.isfinite(qw.scales).all()
    g = group_size or 64
    step = qw.scales.double().repeat_interleave(g, dim=1)
    exact = reference.dequantize_weight(qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=g)
    err = (exact - w.double()).abs()
    assert (err <= step).all(), (err / step).max()  # half a step for the code, half for the zero point or the edge
    assert (exact.abs() <= torch.finfo(torch.float32).max).all()
    deq = qw.dequantize()
    assert deq.dtype == dtype and torch.isfinite(deq).all()
    assert ((deq.double() - w.double()).abs() <= step).all()


CASTS = {
    "float": lambda m, device: m.float(),
    "half": lambda m, device: m.half(),
    "bfloat16": lambda m, device: m.bfloat16(),
    "double": lambda m, device: m.double(),
    "to_float32": lambda m, device: m.to(torch.float32),
    "to_device_bfloat16": lambda m, device: m.to(device, torch.bfloat16),
}


@pytest.mark.interpret
@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)])
def test_quantized_linear_keeps_its_tensors_dtypes_under_module_casts(kernel_device, seed, cast, bits, symmetric):
    """model.float() / .half() / .bfloat16() / .double() / .to(dtype) on a model holding a
    QuantizedLinear leave its codes, scales, zero points and bias as they are (a device move
    still applies): the scales are part of the quantized format, and a cast re-rounded them
    (float16 -> bfloat16: other weights than the codes were computed for) or made the layer
    unusable (float64 scales and bias, which quantized_matmul refuses)."""
    torch.manual_seed(seed)
    lin = nn.Linear(64, 24).half()
    with torch.no_grad():
        lin.weight.mul_(1 + torch.rand(24, 1).half() * 3)  # scales with mantissa bits bfloat16 lacks
    model = nn.Sequential(QuantizedLinear.from_linear(lin, bits, 32, symmetric))
    qw, bias = model[0].qweight, model[0].bias.detach().clone()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    model = CASTS[cast](model, kernel_device)
    for name, t in model.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t.cpu(), before[name]), name
    if cast == "to_device_bfloat16":  # the device part of .to(device, dtype) applies
        assert all(t.device.type == kernel_device for t in model.state_dict().values())
    model.to(kernel_device)
    qw = QuantizedWeight(*(None if t is None else t.to(kernel_device) for t in (qw.qdata, qw.scales, qw.zeros)),
                         bits, 32, qw.shape, qw.dtype)
    x = testing.randn(3, 64, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    check_quantized(x, qw, bias.to(kernel_device), out=model(x), name=f"QuantizedLinear after {cast}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 128), (4, 128)])
@pytest.mark.parametrize("m", [1, 16])
def test_decode_calls_differing_in_alignment_and_bias_get_their_own_plans(seed, bits, group_size, m):
    """The weight-only decode launches (the GEMVs at M = 1, the dequantizing kernel otherwise) are
    planned: calls of one shape whose x and bias differ in 16-byte alignment follow one another
    under KERNEL_LAB_CHECK_PLANS (conftest.py) and each result matches the reference."""
    n, k = 96, 4096
    qw = quantize_weight(testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed, scale=0.05), bits,
                         group_size)
    x_buf = testing.randn(m * k + 8, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    bias_buf = testing.randn(n + 1, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
    for offset in (0, 1, 8, 1):  # see test_matmul.PLAN_TEST_OFFSETS
        x = x_buf[offset:offset + m * k].view(m, k)
        for bias in (None, bias_buf[:n], bias_buf[1:]):
            check_quantized(x, qw, bias)
