"""rms_norm_linear (RMSNorm fused into the GEMM) against the unfused float64 reference."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.gemm import RMSNormLinear, ops, rms_norm_linear
from kernel_lab.shared import reference, testing

# Factor 2 of the tolerance rule (docs/correctness.md); the baseline is the unfused same-precision pair: torch's own
# F.rms_norm in x's dtype (the normalised activations rounded to x's dtype), then F.linear.
FACTOR = 2.0


def unfused_baseline(x, g, w, eps, bias=None):
    return F.linear(F.rms_norm(x, (x.shape[-1],), g.to(x.dtype), eps), w, bias)


def check(x, g, w, eps=1e-6, bias=None):
    out = rms_norm_linear(x, g, w, eps=eps, bias=bias)
    ref = reference.rms_norm_linear(x, g, w, eps, bias)
    assert out.dtype == x.dtype and out.shape == ref.shape
    testing.assert_close_to_reference(out, ref, unfused_baseline(x, g, w, eps, bias), factor=FACTOR,
                                      name="rms_norm_linear")


def test_rms_norm_linear_validation():
    x = torch.zeros(2, 8, dtype=torch.float16)
    g = torch.ones(8, dtype=torch.float16)
    w = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="K mismatch"):
        rms_norm_linear(x, torch.ones(7, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="K mismatch"):
        rms_norm_linear(x, g, torch.zeros(4, 9, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"weight\.dtype must equal"):
        rms_norm_linear(x, g, w.bfloat16())
    for eps in (0.0, 1e-50, 1e300, True):  # 0 / inf as float32 (the kernels' eps); a bool is not an eps
        with pytest.raises(ValueError, match="eps"):
            rms_norm_linear(x, g, w, eps=eps)
    with pytest.raises(TypeError, match=r"x\.dtype"):
        rms_norm_linear(x.float(), g, w)


def test_rms_norm_linear_reference_backend(seed):
    x = testing.randn(3, 24, dtype=torch.bfloat16, seed=seed)
    g = testing.randn(24, dtype=torch.bfloat16, seed=seed + 1)
    w = testing.randn(5, 24, dtype=torch.bfloat16, seed=seed + 2)
    out = rms_norm_linear(x, g, w, backend="reference")
    testing.assert_close_to_reference(out, reference.rms_norm_linear(x, g, w), unfused_baseline(x, g, w, 1e-6),
                                      factor=FACTOR)


@pytest.mark.interpret
# (1, 30): the one-row GEMV; (2, 30): one 32-column tile, which the interpreter's decode plan
# splits over K (two splits, the x^2 program and the reduce); (5, 50): two tiles, no split (x^2
# summed on the tensor cores, SSQ_BY_DOT); (17, 50) and (64, 30): the normalised rows, then the
# decode GEMM (unsplit, split); (70, 50): the prefill path
@pytest.mark.parametrize("m,n", [(1, 30), (2, 30), (5, 50), (17, 50), (64, 30), (70, 50)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rms_norm_linear_matches_unfused_reference(kernel_device, seed, m, n, with_bias):
    x = testing.randn(m, 96, dtype=torch.float16, device=kernel_device, seed=seed, scale=4.0)
    g = testing.randn(96, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    w = testing.randn(n, 96, dtype=torch.float16, device=kernel_device, seed=seed + 2, scale=0.1)
    bias = testing.randn(n, dtype=torch.float16, device=kernel_device, seed=seed + 3) if with_bias else None
    check(x, g, w, 1e-5, bias)


@pytest.mark.interpret
def test_rms_norm_linear_rows_longer_than_one_step(kernel_device, seed, monkeypatch):
    """The normalised-rows launch (M of 17-64) on rows longer than its step: read twice."""
    monkeypatch.setattr(ops, "RMS_NORM_ROWS_MAX_BLOCK_K", 64)
    x = testing.randn(20, 200, dtype=torch.float16, device=kernel_device, seed=seed, scale=4.0)
    x = x[:, 3:].t().contiguous().t()  # column-major, odd K
    g = testing.randn(197, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    w = testing.randn(40, 197, dtype=torch.float16, device=kernel_device, seed=seed + 2, scale=0.1)
    check(x, g, w, 1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_linear_one_row_gemv(kernel_device, seed, dtype):
    """M = 1 runs the GEMV (no tensor cores, so bfloat16 runs under the interpreter too): K
    and N off every block size, a bias."""
    x = testing.randn(1, 100, dtype=dtype, device=kernel_device, seed=seed, scale=4.0)
    g = testing.randn(100, dtype=dtype, device=kernel_device, seed=seed + 1)
    w = testing.randn(37, 100, dtype=dtype, device=kernel_device, seed=seed + 2, scale=0.1)
    check(x, g, w, 1e-5, testing.randn(37, dtype=dtype, device=kernel_device, seed=seed + 3))


@pytest.mark.interpret
@pytest.mark.parametrize("m", [1, 5, 17, 70])  # GEMV, one launch (SSQ_BY_DOT), split-K, prefill
def test_rms_norm_linear_strided_bias(kernel_device, seed, m):
    x = testing.randn(m, 96, dtype=torch.float16, device=kernel_device, seed=seed, scale=4.0)
    g = testing.randn(96, dtype=torch.float16, device=kernel_device, seed=seed + 1)
    w = testing.randn(50, 96, dtype=torch.float16, device=kernel_device, seed=seed + 2, scale=0.1)
    bias = testing.randn(150, dtype=torch.float16, device=kernel_device, seed=seed + 3)[::3]
    check(x, g, w, 1e-5, bias)


@pytest.mark.interpret
@pytest.mark.parametrize("affine", [True, False])
def test_from_modules_follows_torch_rmsnorm_defaults(kernel_device, seed, affine):
    """nn.RMSNorm(eps=None) adds float32's epsilon (1e-6 was 24% off on float16 inputs near
    1e-3); elementwise_affine=False (no weight) scales by 1."""
    x = testing.randn(3, 64, dtype=torch.float16, device=kernel_device, seed=seed, scale=1e-3)
    norm = torch.nn.RMSNorm(64, elementwise_affine=affine).to(kernel_device, torch.float16)
    lin = torch.nn.Linear(64, 32, bias=False).to(kernel_device, torch.float16)
    fused = RMSNormLinear.from_modules(norm, lin)
    assert fused.eps == torch.finfo(torch.float32).eps
    g = norm.weight if affine else torch.ones(64, dtype=torch.float16, device=kernel_device)
    testing.assert_close_to_reference(fused(x), reference.rms_norm_linear(x, g, lin.weight, fused.eps),
                                      lin(norm(x)).detach(), factor=FACTOR)


@pytest.mark.interpret
def test_rms_norm_linear_strided_batched_input_and_module(kernel_device, seed):
    x = testing.strided_rows(testing.randn(2, 3, 40, dtype=torch.float16, device=kernel_device, seed=seed))
    norm = torch.nn.RMSNorm(40, eps=1e-5).to(kernel_device, torch.float16)
    with torch.no_grad():
        norm.weight.copy_(testing.randn(40, dtype=torch.float16, seed=seed + 1))
    lin = torch.nn.Linear(40, 20, bias=False).to(kernel_device, torch.float16)
    fused = RMSNormLinear.from_modules(norm, lin)
    assert fused.eps == 1e-5
    out = fused(x)
    assert out.shape == (2, 3, 20)
    testing.assert_close_to_reference(
        out, reference.rms_norm_linear(x, norm.weight, lin.weight, 1e-5), lin(norm(x)).detach(), factor=FACTOR
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,dtype", [(1, torch.bfloat16), (16, torch.bfloat16), (16, torch.float16), (33, torch.float16),
                (64, torch.bfloat16), (512, torch.bfloat16)],
)  # fmt: skip
def test_rms_norm_linear_llama_shapes(seed, dtype, m):
    n, k = 6144, 4096
    x = testing.randn(m, k, dtype=dtype, device="cuda", seed=seed, scale=3.0)
    g = testing.randn(k, dtype=dtype, device="cuda", seed=seed + 1)
    w = testing.randn(n, k, dtype=dtype, device="cuda", seed=seed + 2, scale=k**-0.5)
    check(x, g, w)


@pytest.mark.gpu
def test_rms_norm_linear_normalised_rows_in_a_cuda_graph(seed):
    """M of 17-64: the rows kernel and the GEMM that reads its rows captured in one graph, twice,
    and replayed on new x: each output against the float64 reference."""
    m, n, k = 48, 6144, 4096
    x = testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=seed, scale=3.0)
    g = testing.randn(k, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + 2, scale=k**-0.5)
    rms_norm_linear(x, g, w)  # tuned before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [rms_norm_linear(x, g, w), rms_norm_linear(x, g, w)]
    for i in range(3):
        x.copy_(testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=seed + 10 + i, scale=3.0))
        graph.replay()
        for out in outs:
            testing.assert_close_to_reference(out, reference.rms_norm_linear(x, g, w), unfused_baseline(x, g, w, 1e-6),
                                              factor=FACTOR, name="rms_norm_linear, graph replay")


@pytest.mark.gpu
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes (and eps) from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_rms_norm_linear_torch_compile_fullgraph(dynamic, seed):
    torch._dynamo.reset()
    fn = torch.compile(lambda x, g, w: rms_norm_linear(x, g, w), fullgraph=True, dynamic=dynamic)
    # new M (decode, then the normalised-rows path, then prefill sized), then new N and K
    for i, (m, n, k) in enumerate([(16, 256, 512), (5, 256, 512), (40, 256, 512), (300, 256, 512), (16, 384, 320)]):
        x = testing.randn(m, k, dtype=torch.bfloat16, device="cuda", seed=seed + i)
        g = testing.randn(k, dtype=torch.bfloat16, device="cuda", seed=seed + i + 1)
        w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + i + 2)
        out = fn(x, g, w)
        if m <= ops.SKINNY_MAX_M:
            # one fixed plan, as in eager (prefill sizes are autotuned, and inductor runs its own
            # autotuning of the kernel's configs: another BLOCK_K may win, another summation order)
            torch.testing.assert_close(out, rms_norm_linear(x, g, w), rtol=0, atol=0)
        testing.assert_close_to_reference(out, reference.rms_norm_linear(x, g, w), unfused_baseline(x, g, w, 1e-6),
                                          factor=FACTOR, name="compiled rms_norm_linear")


@pytest.mark.interpret
def test_backward_through_the_forward_only_op_raises(kernel_device, seed):
    """Forward only: with inputs that require grad the output is tied to them, and a backward
    raises instead of training with this op's contribution silently missing."""
    x = testing.randn(5, 64, dtype=torch.float16, device=kernel_device, seed=seed, requires_grad=True)
    g = testing.randn(64, dtype=torch.float16, device=kernel_device, seed=seed + 1, requires_grad=True)
    w = testing.randn(48, 64, dtype=torch.float16, device=kernel_device, seed=seed + 2, requires_grad=True)
    y = rms_norm_linear(x, g, w)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="rms_norm_linear is forward only"):
        (y.float().sum() + x.float().sum()).backward()
    with torch.no_grad():
        assert not rms_norm_linear(x, g, w).requires_grad


def test_rms_norm_linear_from_modules_rejects_offset_norms_and_keeps_eps_zero():
    """A norm scaling by offset + weight (Gemma style) cannot be fused as a plain weight: a clear
    error, not a result off by the offset. eps = 0 is kept as given, not replaced by 1e-6."""
    lin = torch.nn.Linear(16, 4, bias=False)
    offset_norm = torch.nn.RMSNorm(16)
    offset_norm.offset = 1.0  # as kernel_lab.norms.RMSNorm(16, offset=1.0) carries it
    with pytest.raises(ValueError, match="offset \\+ weight"):
        RMSNormLinear.from_modules(offset_norm, lin)
    GemmaRMSNorm = type("GemmaRMSNorm", (torch.nn.RMSNorm,), {})
    with pytest.raises(ValueError, match="offset \\+ weight"):
        RMSNormLinear.from_modules(GemmaRMSNorm(16), lin)
    assert RMSNormLinear.from_modules(torch.nn.RMSNorm(16, eps=0.0), lin).eps == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(1, 96), (16, 2048), (64, 96)])
def test_decode_calls_differing_in_alignment_and_bias_get_their_own_plans(seed, m, n):
    """The decode launches (the GEMV at M = 1, the one-launch kernel at M = 16 where K is not
    split, the split kernel and its reduce at M = 64) are planned: calls of one shape whose x,
    norm weight and bias differ in 16-byte alignment, one at a time, follow one another under
    KERNEL_LAB_CHECK_PLANS (conftest.py) and each result matches the reference. Each misaligned
    variant comes back after an aligned call has recorded its plan (see
    test_matmul.PLAN_TEST_OFFSETS)."""
    k = 4096
    x_buf = testing.randn(m * k + 8, dtype=torch.bfloat16, device="cuda", seed=seed)
    g_buf = testing.randn(k + 8, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    w = testing.randn(n, k, dtype=torch.bfloat16, device="cuda", seed=seed + 2, scale=k**-0.5)
    bias_buf = testing.randn(n + 1, dtype=torch.bfloat16, device="cuda", seed=seed + 3)
    for x_offset, g_offset in ((0, 0), (1, 0), (0, 1), (8, 8), (1, 0), (0, 1)):
        x = x_buf[x_offset:x_offset + m * k].view(m, k)
        g = g_buf[g_offset:g_offset + k]
        for bias in (None, bias_buf[:n], bias_buf[1:]):
            check(x, g, w, bias=bias)
