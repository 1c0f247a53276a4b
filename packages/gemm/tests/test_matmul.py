"""matmul (fp16/bf16 with bias/activation epilogue) and fp8_matmul against the float64 reference,
with the FlashAttention tolerance rule (docs/correctness.md).

Tiers: unmarked tests check validation and the reference backend; `interpret` tests run the
real kernels on small odd shapes (under TRITON_INTERPRET=1 on the CPU: float16 only, the
interpreter's bf16 tl.dot is wrong); `gpu` tests run Llama-3-8B shapes, bf16, fp8, autotuning
and torch.compile.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernel_lab.gemm._kernels as _kernels
import kernel_lab.gemm.ops as ops
from kernel_lab.gemm import fp8_matmul, matmul, quantize_fp8
from kernel_lab.shared import reference, runtime, testing

# Factor 2 of the tolerance rule (docs/correctness.md): the kernel accumulates in float32 like cuBLAS, in another order.
FACTOR = 2.0
TORCH_ACT = {
    None: lambda z: z,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def _skip_bf16_on_interpreter(dtype, device):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong; bf16 runs in the gpu tier")


def baseline_matmul(a, b, bias=None, activation=None, out_dtype=None):
    """Same-precision PyTorch: the product in a's dtype (cuBLAS / CPU BLAS), the epilogue in float32
    then rounded, as an unfused eager pipeline would give at best."""
    y = (a @ b).float()
    if bias is not None:
        y = y + bias.float()
    return TORCH_ACT[activation](y).to(out_dtype or a.dtype)


def make_operands(m, n, k, dtype, device, seed, a_layout="row", b_layout="row"):
    a = testing.randn(m, k, dtype=dtype, device=device, seed=seed)
    b = testing.randn(k, n, dtype=dtype, device=device, seed=seed + 1, scale=k**-0.5)
    if a_layout == "col":
        a = testing.transposed_copy(a)
    if b_layout == "col":  # the nn.Linear case: b = weight.t()
        b = testing.transposed_copy(b)
    return a, b


def check(out, a, b, bias=None, activation=None, out_dtype=None, name="matmul"):
    ref = reference.matmul(a, b, bias, activation)
    base = baseline_matmul(a, b, bias, activation, out_dtype)
    assert out.dtype == (out_dtype or a.dtype) and out.shape == ref.shape
    return testing.assert_close_to_reference(out, ref, base, factor=FACTOR, name=name)


# --- reference tier: validation and the reference backend --------------------------------------


def test_matmul_k_mismatch_raises_value_error():
    with pytest.raises(ValueError, match="K mismatch"):
        matmul(torch.zeros(3, 4, dtype=torch.float16), torch.zeros(5, 2, dtype=torch.float16))


@pytest.mark.parametrize(
    "a_dtype,b_dtype,match",
    [(torch.float32, torch.float32, r"a\.dtype"), (torch.float16, torch.bfloat16, "same dtype"),
     (torch.int8, torch.int8, r"a\.dtype")],
)
def test_matmul_bad_dtypes_raise_type_error(a_dtype, b_dtype, match):
    with pytest.raises(TypeError, match=match):
        matmul(torch.zeros(3, 4, dtype=a_dtype), torch.zeros(4, 2, dtype=b_dtype))


def test_matmul_bad_activation_bias_out_dtype_raise():
    a, b = torch.zeros(3, 4, dtype=torch.float16), torch.zeros(4, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="activation"):
        matmul(a, b, activation="tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\)"):
        matmul(a, b, bias=torch.zeros(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="out_dtype"):
        matmul(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="at least 2 dims"):
        matmul(torch.zeros(4, dtype=torch.float16), b)
    with pytest.raises(ValueError, match="backend"):
        matmul(a, b, backend="cublas")


def test_fp8_matmul_rejects_non_float8_and_bad_scales():
    a8 = torch.zeros(3, 16).to(torch.float8_e4m3fn)
    b8 = torch.zeros(16, 5).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    with pytest.raises(TypeError, match=r"a\.dtype must be one of float8_e4m3fn"):
        fp8_matmul(torch.zeros(3, 16, dtype=torch.bfloat16), b8, one, one)
    with pytest.raises(TypeError, match="scale_a"):
        fp8_matmul(a8, b8, one.half(), one)
    with pytest.raises(ValueError, match=r"scale_b must have one element or shape \(1, 5\)"):
        fp8_matmul(a8, b8, one, torch.ones(5))
    with pytest.raises(ValueError, match="K mismatch"):
        fp8_matmul(a8, b8.t(), one, one)


def test_matmul_reference_backend_matches_reference(seed):
    a, b = make_operands(7, 9, 11, torch.bfloat16, "cpu", seed)
    bias = testing.randn(9, dtype=torch.bfloat16, seed=seed + 2)
    out = matmul(a, b, bias=bias, activation="silu", backend="reference")
    check(out, a, b, bias, "silu")


def test_fp8_matmul_on_cpu_runs_reference_with_rowwise_scales(seed):
    x = testing.randn(6, 32, seed=seed)
    w = testing.randn(10, 32, seed=seed + 1)
    xq, sx = quantize_fp8(x, "row")
    wq, sw = quantize_fp8(w, "row")
    out = fp8_matmul(xq, wq.t(), sx, sw.t(), out_dtype=torch.float32)
    # (On the CPU fp8_matmul *is* reference.fp8_matmul in float32: the check is against x @ w^T.)
    # fp8 quantization error of x @ w^T: each operand within 2^-4 relative (e4m3 has 3 mantissa bits).
    assert (out - x @ w.T).abs().max() < 0.15 * (x.abs() @ w.abs().T).max()


@pytest.mark.parametrize("m,n", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_matmul_empty_output(m, n, granularity):
    """No rows or no columns: an empty result, as matmul gives; the (0, 1) / (1, 0) row-wise scales
    of an empty side failed in a reshape to one element (RuntimeError)."""
    a8, b8 = torch.zeros(m, 16).to(torch.float8_e4m3fn), torch.zeros(16, n).to(torch.float8_e4m3fn)
    sa, sb = (torch.ones(m, 1), torch.ones(1, n)) if granularity == "row" else (torch.ones(1), torch.ones(1))
    out = fp8_matmul(a8, b8, sa, sb, bias=torch.zeros(n), out_dtype=torch.float16)
    assert out.shape == (m, n) and out.dtype == torch.float16


def test_decode_shape_uses_split_k_under_the_interpreter_plan():
    plan = ops._skinny_plan(1, 31, 70, torch.device("cpu"), ops.INTERPRET_BLOCK)
    assert plan.split_k > 1 and plan.k_per_split % ops.INTERPRET_BLOCK == 0
    assert plan.split_k * plan.k_per_split >= 70 > (plan.split_k - 1) * plan.k_per_split


# --- interpret tier: the real kernels on small odd shapes --------------------------------------

# (1, 31, 70): the one-row GEMV with b = w.t() (b_layout "col"), split-K decode otherwise; (2, 31, 70):
# split-K decode; then decode and the prefill path
SMALL_SHAPES = [(1, 31, 70), (2, 31, 70), (17, 40, 45), (127, 50, 45)]


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", SMALL_SHAPES)
@pytest.mark.parametrize("a_layout,b_layout", [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")])
def test_matmul_layouts_match_reference(kernel_device, seed, m, n, k, a_layout, b_layout):
    a, b = make_operands(m, n, k, torch.float16, kernel_device, seed, a_layout, b_layout)
    check(matmul(a, b, backend="triton"), a, b)


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", [(1001, 19, 70), (3, 21, 1003), (1, 19, 1003)])
def test_matmul_thousand_sized_odd_dims_match_reference(kernel_device, seed, m, n, k):
    """About-1000 odd M (many row tiles and a masked last one) and odd K (a long K loop with a masked
    tail step) in the interpret tier: prefill, split-K decode and the one-row GEMV."""
    a, b = make_operands(m, n, k, torch.float16, kernel_device, seed, "row", "col")
    check(matmul(a, b, backend="triton"), a, b)


@pytest.mark.interpret
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
@pytest.mark.parametrize("m", [1, 3, 70])  # the GEMV, decode, prefill
def test_matmul_bias_activation_epilogue_matches_reference(kernel_device, seed, activation, m):
    a, b = make_operands(m, 36, 40, torch.float16, kernel_device, seed, "row", "col")
    a = a * 3  # reach the activations' nonlinear range
    bias = testing.randn(36, dtype=torch.float16, device=kernel_device, seed=seed + 2)
    check(matmul(a, b, bias=bias, activation=activation), a, b, bias, activation)


@pytest.mark.interpret
@pytest.mark.parametrize("m", [1, 3, 70])  # the GEMV, decode, prefill
def test_matmul_strided_bias_is_read_at_its_stride(kernel_device, seed, m):
    """A bias view with a step (every other element of a buffer): the epilogues index bias[n] at
    unit stride, so the launcher copies it; read in place it added the buffer's first N values."""
    a, b = make_operands(m, 36, 40, torch.float16, kernel_device, seed, "row", "col")
    bias = testing.randn(72, dtype=torch.float16, device=kernel_device, seed=seed + 2)[::2]
    assert bias.stride(0) == 2
    check(matmul(a, b, bias=bias), a, b, bias)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_one_row_gemv_strided_row_and_tails(kernel_device, seed, dtype):
    """The one-row GEMV (b = w.t() of an nn.Linear weight; no tensor cores, so bfloat16 runs
    under the interpreter too): N and K off every block size, x a strided row (column stride
    3), bias + SiLU epilogue, float32 output."""
    k, n = 100, 37
    a = testing.randn(k, 3, dtype=dtype, device=kernel_device, seed=seed)[:, 1].unsqueeze(0)
    assert a.stride(1) == 3
    w = testing.randn(n, k, dtype=dtype, device=kernel_device, seed=seed + 1, scale=k**-0.5)
    bias = testing.randn(n, dtype=dtype, device=kernel_device, seed=seed + 2)
    check(matmul(a, w.t(), bias=bias, activation="silu", out_dtype=torch.float32), a, w.t(), bias, "silu",
          torch.float32)


@pytest.mark.interpret
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matmul_batched_strided_rows_and_out_dtype(kernel_device, seed, out_dtype):
    a = testing.strided_rows(testing.randn(2, 3, 5, 40, dtype=torch.float16, device=kernel_device, seed=seed))
    b = testing.randn(40, 24, dtype=torch.float16, device=kernel_device, seed=seed + 1, scale=0.2)
    out = matmul(a, b, out_dtype=out_dtype)
    assert out.shape == (2, 3, 5, 24)
    check(out, a, b, out_dtype=out_dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", [(0, 8, 16), (5, 0, 16), (5, 8, 0)])
def test_matmul_zero_size(kernel_device, seed, m, n, k):
    a = testing.randn(m, k, dtype=torch.float16, device=kernel_device, seed=seed)
    b = testing.randn(k, n, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    bias = testing.randn(n, dtype=torch.float16, device=kernel_device, seed=seed + 2)
    out = matmul(a, b, bias=bias)
    assert out.shape == (m, n) and out.dtype == torch.float16 and out.device == a.device
    if k == 0:  # an empty sum is 0: the output is the bias on every row, exactly
        assert torch.equal(out, bias.expand(m, n))


@pytest.mark.interpret
@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("m", [4, 70])
def test_matmul_backward_matches_reference(kernel_device, seed, activation, m):
    a, b = make_operands(m, 24, 40, torch.float16, kernel_device, seed, "row", "col")
    bias = testing.randn(24, dtype=torch.float16, device=kernel_device, seed=seed + 2)
    dy = testing.randn(m, 24, dtype=torch.float16, device=kernel_device, seed=seed + 3)
    leaves = [t.detach().clone().requires_grad_(True) for t in (a, b, bias)]
    grads = torch.autograd.grad(matmul(leaves[0], leaves[1], bias=leaves[2], activation=activation), leaves, dy)
    refs = reference.matmul_backward(a, b, dy, bias, activation)
    base_leaves = [t.detach().clone().float().requires_grad_(True) for t in (a, b, bias)]
    z = (base_leaves[0].half() @ base_leaves[1].half()).float() + base_leaves[2]
    base = torch.autograd.grad(TORCH_ACT[activation](z), base_leaves, dy.float())
    for name, g, r, bl in zip(("da", "db", "dbias"), grads, refs, base, strict=True):
        # The baseline rounds its float32 gradients to the input dtype, as the kernel's are.
        testing.assert_close_to_reference(g, r, bl.to(g.dtype), factor=FACTOR, name=name)


# --- gpu tier: LLM shapes, bf16, autotune, fp8, torch.compile ----------------------------------

GPU_SHAPES = [(1, 4096, 4096), (16, 14336, 4096), (64, 4096, 14336), (333, 6144, 4096), (4096, 4096, 4096),
              (2048, 14336, 4096)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_matmul_llama_shapes_match_reference(seed, dtype, m, n, k):
    a, b = make_operands(m, n, k, dtype, "cuda", seed, "row", "col")
    check(matmul(a, b), a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [16, 1000])
def test_matmul_gpu_epilogue_and_layouts(seed, dtype, m):
    a, b = make_operands(m, 1000, 1032, dtype, "cuda", seed, "col", "row")
    bias = testing.randn(1000, dtype=dtype, device="cuda", seed=seed + 2)
    check(matmul(a, b, bias=bias, activation="gelu_tanh"), a, b, bias, "gelu_tanh")


@pytest.mark.gpu
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_matmul_torch_compile_fullgraph_forward_and_backward(dynamic, seed):
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, bias: matmul(a, b, bias=bias, activation="silu"), fullgraph=True,
                       dynamic=dynamic)
    # new M (prefill, then a decode-sized M that takes the skinny path), then new N and K
    for i, (m, n, k) in enumerate([(64, 256, 512), (200, 256, 512), (7, 256, 512), (64, 384, 320)]):
        a, b = make_operands(m, n, k, torch.bfloat16, "cuda", seed + i, "row", "col")
        bias = testing.randn(n, dtype=torch.bfloat16, device="cuda", seed=seed + i + 2)
        leaves = [t.detach().clone().requires_grad_(True) for t in (a, b, bias)]
        out = fn(*leaves)
        check(out, a, b, bias, "silu")
        dy = testing.randn(*out.shape, dtype=torch.bfloat16, device="cuda", seed=seed + i + 3)
        grads = torch.autograd.grad(out, leaves, dy)
        refs = reference.matmul_backward(a, b, dy, bias, "silu")
        base_leaves = [t.detach().clone().float().requires_grad_(True) for t in (a, b, bias)]
        z = (base_leaves[0].bfloat16() @ base_leaves[1].bfloat16()).float() + base_leaves[2]
        base = torch.autograd.grad(TORCH_ACT["silu"](z), base_leaves, dy.float())
        for name, g, r, bl in zip(("da", "db", "dbias"), grads, refs, base, strict=True):
            # The baseline rounds its float32 gradients to the input dtype, as the kernel's are.
            testing.assert_close_to_reference(g, r, bl.to(g.dtype), factor=FACTOR, name=f"compiled {name}")


def _fp8_ok():
    return runtime.cuda_available() and runtime.device_info().capability >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 14336, 4096), (1000, 1000, 1024), (4096, 4096, 4096)])
def test_fp8_matmul_matches_reference_and_scaled_mm(seed, granularity, m, n, k):
    if not _fp8_ok():
        pytest.skip("float8 needs compute capability >= 8.9")
    x = testing.randn(m, k, device="cuda", seed=seed)
    w = testing.randn(n, k, device="cuda", seed=seed + 1, scale=k**-0.5)
    xq, sx = quantize_fp8(x, granularity)
    wq, sw = quantize_fp8(w, granularity)
    sw = sw.t() if granularity == "row" else sw
    bias = testing.randn(n, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
    out = fp8_matmul(xq, wq.t(), sx, sw, bias=bias)
    ref = reference.fp8_matmul(xq, wq.t(), sx, sw, bias)
    if m % 16 or n % 16 or k % 16:
        # torch._scaled_mm needs multiples of 16: the same-precision baseline is then the float32
        # product of the same float8 values, scaled, rounded once to bf16
        base = ((xq.float() * sx.reshape(-1, 1)) @ (wq.float().t() * sw.reshape(1, -1)) + bias.float()).bfloat16()
    else:
        # _scaled_mm wants both scales row-wise ((M, 1) and (1, N)) or both scalars; the bias is
        # added outside (it takes none with row-wise scales)
        row = granularity == "row"
        sa_mm, sb_mm = (sx.reshape(-1, 1), sw.reshape(1, -1)) if row else (sx.reshape(()), sw.reshape(()))
        base = (torch._scaled_mm(xq, wq.t(), sa_mm, sb_mm, out_dtype=torch.bfloat16).float() + bias.float()).bfloat16()
    testing.assert_close_to_reference(out, ref, base, factor=FACTOR, name="fp8_matmul")


@pytest.mark.gpu
def test_fp8_matmul_torch_compile_fullgraph(seed):
    if not _fp8_ok():
        pytest.skip("float8 needs compute capability >= 8.9")
    xq, sx = quantize_fp8(testing.randn(32, 512, device="cuda", seed=seed))
    wq, sw = quantize_fp8(testing.randn(256, 512, device="cuda", seed=seed + 1))
    out = torch.compile(fp8_matmul, fullgraph=True)(xq, wq.t(), sx, sw)
    torch.testing.assert_close(out, fp8_matmul(xq, wq.t(), sx, sw), rtol=0, atol=0)
    # and against the reference, with the baseline of test_fp8_matmul_matches_reference_and_scaled_mm
    # (the float32 product of the same float8 values, scaled, rounded once to bf16)
    base = ((xq.float() * sx.reshape(-1, 1)) @ (wq.float().t() * sw.reshape(1, -1))).bfloat16()
    testing.assert_close_to_reference(out, reference.fp8_matmul(xq, wq.t(), sx, sw), base, factor=FACTOR,
                                      name="compiled fp8_matmul")


@pytest.mark.interpret
@pytest.mark.parametrize("m,n,k", [(70, 48, 40), (33, 40, 64)])
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_tma_persistent_kernel_matches_reference(kernel_device, seed, m, n, k, b_layout):
    """The Hopper TMA path, called directly (matmul() takes it only on capability 9 GPUs)."""
    if ops.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    if kernel_device == "cuda" and runtime.device_info().capability[0] != 9:
        pytest.skip("TMA kernel is built for Hopper")
    a, b = make_operands(m, n, k, torch.float16, kernel_device, seed, "row", b_layout)
    bias = testing.randn(n, dtype=torch.float16, device=kernel_device, seed=seed + 2)
    c = testing.poisoned(m, n, dtype=torch.float16, device=kernel_device)
    common = dict(HAS_BIAS=True, HAS_SCALE=False, ACTIVATION="silu")
    ops._matmul_tma(a, b, c, bias, c, c, 0, 0, common)
    check(c, a, b, bias, "silu")


def test_registered_ops_pass_opcheck(seed, monkeypatch, kernel_device):
    """Schema, fake-tensor, autograd-registration and AOT-dispatch checks of the torch.library
    ops. Fake-tensor tracing cannot run the interpreter (it reads real data): on the CPU this
    checks the registration around the reference backend; on CUDA, around the Triton kernels."""
    from kernel_lab.gemm import quantize_weight

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dt = torch.float16 if kernel_device == "cpu" else torch.bfloat16
    a = testing.randn(5, 32, dtype=dt, device=kernel_device, seed=seed, requires_grad=True)
    b = testing.randn(32, 24, dtype=dt, device=kernel_device, seed=seed + 1, requires_grad=True)
    bias = testing.randn(24, dtype=dt, device=kernel_device, seed=seed + 2, requires_grad=True)
    torch.library.opcheck(torch.ops.kernel_lab.gemm_matmul.default, (a, b, bias, "gelu", dt))
    b_col = b.detach().t().contiguous().t()  # column-major b
    torch.library.opcheck(torch.ops.kernel_lab.gemm_matmul.default, (a, b_col, None, "none", torch.float32))
    x = a.detach()
    qw = quantize_weight(testing.randn(24, 32, dtype=dt, device=kernel_device, seed=seed + 3), 4, 32, symmetric=False)
    torch.library.opcheck(
        torch.ops.kernel_lab.gemm_quantized_matmul.default,
        (x, qw.qdata, qw.scales, qw.zeros, bias.detach(), qw.bits, qw.group_size),
    )
    g = testing.randn(32, dtype=dt, device=kernel_device, seed=seed + 4)
    w = testing.randn(24, 32, dtype=dt, device=kernel_device, seed=seed + 5)
    torch.library.opcheck(torch.ops.kernel_lab.gemm_rms_norm_linear.default, (x, g, w, None, 1e-6))
    x20 = testing.randn(20, 32, dtype=dt, device=kernel_device, seed=seed + 6)  # the normalised-rows path
    torch.library.opcheck(torch.ops.kernel_lab.gemm_rms_norm_linear.default, (x20, g, w, bias.detach(), 1e-6))
    if kernel_device == "cuda" and runtime.device_info().capability >= (8, 9):
        xq, sx = quantize_fp8(x.float(), "row")
        wq, sw = quantize_fp8(w.float(), "row")
        # Not test_schema: its SchemaCheckMode compares the inputs before and after the call with
        # a multiply that has no float8 CUDA kernel (torch 2.11: "mul_cuda" not implemented for
        # 'Float8_e4m3fn'), whatever the op does.
        torch.library.opcheck(
            torch.ops.kernel_lab.gemm_fp8_matmul.default, (xq, wq.t(), sx, sw.t().contiguous(), None, torch.bfloat16),
            test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.interpret
def test_double_backward_raises_instead_of_dropping_second_order_terms(kernel_device, seed):
    a, b = make_operands(16, 32, 48, torch.float16, kernel_device, seed, "row", "col")
    leaves = [t.detach().clone().requires_grad_(True) for t in (a, b)]
    testing.assert_double_backward_raises(lambda a, b: matmul(a, b, activation="silu"), *leaves)


# Operand offsets (elements) of the launch-plan tests below: 16-byte aligned, not, aligned again,
# not again. A call records its plan only once its specialisation is compiled (the first call of
# one compiles it), so each variant has to come back after an aligned call has recorded its plan:
# a key that left the alignment out would then name two calls that launch differently.
PLAN_TEST_OFFSETS = (0, 1, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(1, 96), (16, 96), (64, 96), (16, 2048)])
def test_decode_calls_differing_in_what_a_launch_specialises_on_get_their_own_plans(seed, m, n):
    """Eager decode launches are planned (runtime.DirectLauncher.planned, keys with
    ops._tensor_key): calls of one shape whose operands differ in 16-byte alignment, bias and
    activation follow one another under KERNEL_LAB_CHECK_PLANS (conftest.py), where a key naming
    two calls that launch differently raises, and each result matches the reference. M = 1 is the
    GEMV; N = 96 leaves most SMs idle, so M = 16 and 64 split K (the reduce kernel's launches are
    planned too); N = 2048 at M = 16 does not split."""
    k = 4096
    a_buf = testing.randn(m * k + 8, dtype=torch.bfloat16, device="cuda", seed=seed)
    w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + 1, scale=k**-0.5)
    bias_buf = testing.randn(n + 1, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
    for offset in PLAN_TEST_OFFSETS:
        a = a_buf[offset:offset + m * k].view(m, k)
        for bias in (None, bias_buf[:n], bias_buf[1:]):
            for activation in (None, "gelu"):
                check(matmul(a, w.t(), bias=bias, activation=activation), a, w.t(), bias, activation)


def _stand_in_device(monkeypatch, capability, hip):
    """ops sees a 132-SM device of `capability` (a ROCm build where hip is a version string)."""
    info = runtime.DeviceInfo(name="stand-in", capability=capability, sm_count=132, l2_bytes=50 << 20,
                              total_memory_bytes=80 << 30)
    monkeypatch.setattr(ops.runtime, "device_info", lambda index=None: info)
    monkeypatch.setattr(ops.runtime, "sm_count", lambda device: info.sm_count)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize("capability,hip", [((9, 0), None), ((10, 0), None), ((8, 9), None), ((9, 4), "6.2")])
def test_decode_launches_are_dependent_launches_where_measured_faster(request, monkeypatch, capability, hip):
    """ops._pdl's choices (see ops.DECODE_PDL): NVIDIA Hopper and newer only, never traced nor
    interpreted; 1 for the GEMV / rows kernel (no tile) and for one wave of programs that fills
    at least PDL_FULL_WAVE of the SMs one program an SM, 2 for a wave that leaves more SMs idle
    or whose float8 tiles may share an SM, and for more programs than SMs in 64-row tiles; none
    for more of smaller tiles. A stand-in device of 132 SMs with 228 KB of shared memory each."""
    _stand_in_device(monkeypatch, capability, hip)
    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=228 << 10)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    ops._alone_on_an_sm.cache_clear()
    request.addfinalizer(ops._alone_on_an_sm.cache_clear)  # (its answers are the stand-in's)
    dev = torch.device("cuda", 0)
    on = capability >= (9, 0) and hip is None
    bf16, fp8 = 2, 1
    expected = {
        (None, 0): 1,  # GEMV, rows kernel
        ((64, 32, bf16), 132): 1, ((16, 32, bf16), 128): 1, ((32, 32, bf16), 119): 1,
        ((32, 32, bf16), 118): 2, ((64, 64, bf16), 96): 2, ((16, 32, bf16), 1): 2,
        ((16, 32, fp8), 128): 2, ((64, 64, fp8), 128): 1,
        ((64, 64, bf16), 224): 2, ((32, 64, bf16), 133): 0, ((16, 64, fp8), 224): 0,
    }
    for (tile, programs), pdl in expected.items():
        assert ops._pdl(dev, False, False, tile, programs) == (pdl if on else 0), (tile, programs)
    assert ops._pdl(dev, False, True, (64, 32, bf16), 1) == 0  # traced
    assert ops._pdl(dev, True, False, (64, 32, bf16), 1) == 0  # interpreted
    monkeypatch.setattr(ops, "DECODE_PDL", False)  # KERNEL_LAB_GEMM_PDL=0
    assert ops._pdl(dev, False, False) == 0


@pytest.mark.parametrize("dtype,programs_per_sm", [(torch.bfloat16, 1), (torch.float8_e4m3fn, 1), (torch.bfloat16, 2)])
def test_skinny_configs_of_one_wave_fill_more_than_half_an_sm(monkeypatch, dtype, programs_per_sm):
    """_kernels._one_program_per_sm: for a grid of one wave the skinny GEMM's autotuner only tries
    configs whose pipeline (num_stages - 1 staged a and b tiles) takes more than half an SM's
    shared memory, so that no SM holds two of its programs. Every 16-bit tile shape the launcher
    makes has such a config; float8 tiles of at most 32 x 64 do not (half the bytes) and keep
    every config, as does a grid of more programs than SMs. A stand-in device of 132 SMs with
    228 KB of shared memory each."""
    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=228 << 10)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    configs = _kernels.SKINNY_CONFIGS + _kernels.SKINNY_DEEP_CONFIGS
    a = torch.empty(1, dtype=dtype)
    for block_m in (16, 32, 64):
        for block_n in (32, 64):
            n = 132 * block_n * programs_per_sm  # one wave of programs, or two
            args = dict(a_ptr=a, M=block_m, N=n, K=4096, K_PER_SPLIT=4096)
            kept = _kernels._one_program_per_sm(configs, args, BLOCK_M=block_m, BLOCK_N=block_n)
            small_fp8 = a.element_size() == 1 and block_m + block_n < 96
            if programs_per_sm > 1 or small_fp8:
                assert kept == configs, (block_m, block_n)
                continue
            assert kept and len(kept) < len(configs), (block_m, block_n)
            for c in kept:
                smem = (c.num_stages - 1) * (block_m + block_n) * c.kwargs["BLOCK_K"] * a.element_size()
                assert 2 * smem > props.shared_memory_per_multiprocessor, (block_m, block_n, c)
    # a size that torch.compile traces as a symbol (not an int): nothing is pruned
    args = dict(a_ptr=a, M=object(), N=4096, K=4096, K_PER_SPLIT=4096)
    assert _kernels._one_program_per_sm(configs, args, BLOCK_M=16, BLOCK_N=32) == configs


@pytest.mark.parametrize("capability,hip,tma", [((9, 0), None, True), ((8, 0), None, False), ((10, 0), None, False),
                                             ((9, 4), "6.2", False)])
def test_tma_path_only_on_nvidia_hopper(monkeypatch, capability, hip, tma):
    """The TMA persistent prefill kernel (ops._use_tma) is Hopper's: not Ampere or Blackwell, and
    not a ROCm GPU whose capability reads 9.x. A stand-in device, row-major operands."""
    _stand_in_device(monkeypatch, capability, hip)
    monkeypatch.setattr(ops, "USE_TMA", True)
    a, b, c = torch.zeros(256, 128), torch.zeros(128, 64), torch.zeros(256, 64)
    assert ops._use_tma(a, b, c) == tma


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(16, 4096), (24, 4096), (24, 6144), (64, 6144)])
def test_one_wave_decode_gemm_settles_on_one_program_per_sm(seed, m, n):
    """The skinny GEMM's autotuner, on the GPU, picks for a grid of one wave a config whose
    pipeline takes more than half an SM's shared memory (_kernels._one_program_per_sm): the
    shapes where a 96 KB config once won the tuning (M = 24, 4096 x 4096) and others. The
    result is checked against the reference too."""
    k = 4096
    a = testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=seed)
    w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + 1, scale=k**-0.5)
    check(matmul(a, w.t()), a, w.t(), None, None)
    plan = ops._skinny_plan(m, n, k, a.device, ops.SKINNY_K_ALIGN)
    tiles, splits = plan.grid(m, n)
    assert tiles * splits <= runtime.sm_count(a.device)
    key = (ops._m_bucket(m), n, k, plan.k_per_split, plan.block_n, False)  # (..., HAS_SCALE), then dtypes
    picked = [cfg for tuned_key, cfg in _kernels._matmul_kernel_skinny.cache.items()
              if tuned_key[:6] == key and "torch.bfloat16" in tuned_key]
    assert len(picked) == 1, _kernels._matmul_kernel_skinny.cache
    smem = _kernels._skinny_shared_bytes(picked[0], plan.block_m, plan.block_n, a.element_size())
    assert 2 * smem > torch.cuda.get_device_properties(a.device).shared_memory_per_multiprocessor, picked[0]


@pytest.mark.gpu
def test_matmul_runs_on_the_operands_gpu_not_the_current_one(seed):
    """A model spread over GPUs (device_map="auto") calls with tensors on a non-current GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    a, b = make_operands(300, 256, 512, torch.bfloat16, "cuda:1", seed, "row", "col")
    bias = testing.randn(256, dtype=torch.bfloat16, device="cuda:1", seed=seed + 2)
    with torch.cuda.device(0):
        out = matmul(a, b, bias=bias, activation="silu")
    check(out, a, b, bias, "silu")


def test_quantize_fp8_tiny_and_empty_inputs():
    """The largest |x| maps to 448 however small it is (a floor on amax flushed 1e-20 to zeros);
    an empty x has no amax to scale by."""
    x = torch.tensor([[1e-20, -5e-21, 0.0]])
    q, scale = quantize_fp8(x)
    assert float(q.float().abs().max()) == 448.0 and torch.isfinite(scale).all()
    q, scale = quantize_fp8(torch.zeros(2, 3), "row")
    assert (q.float() == 0).all() and (scale > 0).all()
    with pytest.raises(ValueError, match="x is empty"):
        quantize_fp8(torch.zeros(0, 4))
