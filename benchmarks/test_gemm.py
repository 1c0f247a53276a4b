"""kernel_lab.gemm against cuBLAS (torch.matmul, the baseline), torch.compile, torch._scaled_mm
and the unfused RMSNorm + matmul pair.

Groups (one per shape and dtype, one row per implementation):
- prefill: M in {4096, 16384} x the Llama-3-8B projections (N x K = 4096x4096, 6144x4096,
  14336x4096, 4096x14336; square 4096 is the first of them), plus square 8192; bf16 and fp16. Rows: torch (cuBLAS),
  kernel_lab. One extra group adds a bias + tanh-GELU epilogue, with torch.compile as a peer.
- decode: M in {1, 16, 64} x the four projections (bf16; fp16 at M = 16). At M <= 16 the
  group also has the weight-only rows kernel_lab-int8 (per channel) and kernel_lab-int4 (group
  128), against the same cuBLAS bf16 baseline. Weights are rotated through enough copies to
  exceed 3x the L2, so every call streams its weight from HBM; bytes_moved counts the weight
  (codes and scales for the quantized rows), x and the output. Decode and rms_norm_linear rows
  replay one CUDA graph holding one call per weight copy (every implementation alike, as serving
  engines replay a decode step's layers), so neither host launch overhead nor the graph
  launch of a single short kernel is what they measure; pytest-benchmark's time is per replay,
  extra_info["calls_per_round"] the calls in it (bytes and FLOPs count them all; the report
  shows ms per call), extra_info["timing"] says "cuda-graph" (or "eager" where capture failed).
- weight-only prefill: M = 4096 x the four projections, bf16 x; rows kernel_lab-int8 (per
  channel) and kernel_lab-int4 (group 128) against cuBLAS bf16 on the dense weight (baseline).
- fp8: per-tensor scaled (row-wise for one group), torch._scaled_mm as the baseline; the
  decode-shaped group (M = 16) is timed as the decode groups are (weight copies, CUDA graphs).
- rms_norm_linear: M in {1, 16, 32, 64}, N x K = 6144 x 4096 (Llama-3-8B's fused QKV), bf16; rows:
  the unfused torch pair (baseline), torch.compile of the pair, kernel_lab's fused kernel.

Errors: max |out - float64 reference| over the first ERROR_ROWS rows.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_lab import gemm
from kernel_lab.gemm.ops import matmul_fwd
from kernel_lab.shared import bench, reference, runtime

pytestmark = pytest.mark.gpu

PROJECTIONS = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]  # (N, K) of Llama-3-8B
# square 4096 is M4096-N4096-K4096 below
PREFILL = [(m, n, k) for m in (4096, 16384) for n, k in PROJECTIONS] + [(8192, 8192, 8192)]
DECODE = [(m, n, k) for m in (1, 16, 64) for n, k in PROJECTIONS]
ERROR_ROWS = 256
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def _copies(nbytes: int) -> int:
    """Buffers to rotate through so that the working set is at least 3x the L2."""
    l2 = runtime.device_info().l2_bytes or 50 << 20
    return max(1, min(64, math.ceil(3 * l2 / max(nbytes, 1))))


def _max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return bench.max_error(out[:ERROR_ROWS], ref)


def _graph_replays(op, weights):
    """A callable replaying one CUDA graph that runs op(w) once per weight copy: decode is timed
    as serving engines run it (a step's layers back to back from one graph), without host launch
    overhead, for every implementation alike. With one graph per call, the graph launch itself
    (about 12-15 us per replay on the lent H200 host) hid every kernel shorter than that. Falls
    back to eager calls, one weight copy per call (and says so), when capture fails.
    Returns (callable, timing mode, calls per callable)."""
    for w in weights:  # warm-up outside capture: autotuning, compilation, cuBLAS workspaces
        op(w)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                op(w)
    except Exception:  # any capture failure means: time it eagerly
        torch.cuda.synchronize()
        cycle = itertools.cycle(weights)
        return (lambda: op(next(cycle))), "eager", 1
    return graph.replay, "cuda-graph", len(weights)


def _best_config(kernel_name: str) -> str:
    """The autotuner's last pick for a kernel_lab row (recorded with the figure)."""
    kernel = getattr(gemm._kernels, kernel_name, None)
    return str(getattr(kernel, "best_config", None))


def _role(impl: str) -> str:
    return "baseline" if impl == "torch" else ("kernel_lab" if impl.startswith("kernel_lab") else "peer")


# --- prefill -----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "kernel_lab", "kernel_lab-notma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", PREFILL, ids=[f"M{m}-N{n}-K{k}" for m, n, k in PREFILL])
def test_gemm_prefill(benchmark, shape, dtype, impl):
    """kernel_lab: the public op (the TMA persistent kernel on Hopper); kernel_lab-notma: the
    pointer-load kernel that runs elsewhere, through its launcher."""
    m, n, k = shape
    benchmark.group = f"gemm prefill M{m} N{n} K{k} {DTYPE_NAMES[dtype]}"
    x = _rand(m, k, dtype=dtype, seed=m + k)
    w = _rand(n, k, dtype=dtype, seed=n + k, scale=k**-0.5)  # nn.Linear layout, b = w.t()
    fn = {
        "torch": lambda: x @ w.t(),
        "kernel_lab": lambda: gemm.matmul(x, w.t()),
        "kernel_lab-notma": lambda: matmul_fwd(x, w.t(), None, "none", dtype, allow_tma=False),
    }[impl]
    err = _max_error(fn(), reference.matmul(x[:ERROR_ROWS], w.t()))
    bench.run_cuda(benchmark, fn, rounds=10)
    bench.annotate(
        benchmark, impl=impl, role=_role(impl), bytes_moved=(m * k + n * k + m * n) * 2,
        flops=bench.matmul_flops(m, n, k), max_error=err, shape=f"{m}x{n}x{k}", dtype=DTYPE_NAMES[dtype],
        tma=impl == "kernel_lab" and gemm.ops.USE_TMA,
        config=_best_config("_matmul_tma_kernel" if impl == "kernel_lab" and gemm.ops.USE_TMA
                            else "_matmul_kernel_prefill") if impl != "torch" else None,
    )


@pytest.mark.parametrize("impl", ["torch", "torch.compile", "kernel_lab"])
def test_gemm_prefill_epilogue(benchmark, impl):
    m, n, k = 4096, 14336, 4096
    benchmark.group = f"gemm+bias+gelu_tanh prefill M{m} N{n} K{k} bf16"
    x = _rand(m, k, dtype=torch.bfloat16, seed=1)
    w = _rand(n, k, dtype=torch.bfloat16, seed=2, scale=k**-0.5)
    bias = _rand(n, dtype=torch.bfloat16, seed=3)

    def eager():
        return F.gelu(F.linear(x, w, bias), approximate="tanh")

    fn = {
        "torch": eager,
        "torch.compile": torch.compile(eager, dynamic=False),
        "kernel_lab": lambda: gemm.matmul(x, w.t(), bias=bias, activation="gelu_tanh"),
    }[impl]
    err = _max_error(fn(), reference.matmul(x[:ERROR_ROWS], w.t(), bias, "gelu_tanh"))
    bench.run_cuda(benchmark, fn, rounds=10)
    bench.annotate(
        benchmark, impl=impl, role=_role(impl), bytes_moved=(m * k + n * k + m * n + n) * 2,
        flops=bench.matmul_flops(m, n, k), max_error=err, shape=f"{m}x{n}x{k}", dtype="bf16",
    )


# --- weight-only prefill -------------------------------------------------------------------------

WEIGHT_ONLY_PREFILL = [(4096, n, k) for n, k in PROJECTIONS]


@pytest.mark.parametrize("impl", ["torch", "kernel_lab-int8", "kernel_lab-int4"])
@pytest.mark.parametrize("shape", WEIGHT_ONLY_PREFILL, ids=[f"M{m}-N{n}-K{k}" for m, n, k in WEIGHT_ONLY_PREFILL])
def test_gemm_weight_only_prefill(benchmark, shape, impl):
    """quantized_matmul at prefill sizes (int8 per channel, int4 group 128, codes dequantized in
    the K loop) against cuBLAS bf16 on the dense weight; bytes count the weight as stored."""
    m, n, k = shape
    benchmark.group = f"gemm weight-only prefill M{m} N{n} K{k} bf16"
    x = _rand(m, k, dtype=torch.bfloat16, seed=m + k)
    w = _rand(n, k, dtype=torch.bfloat16, seed=n + k, scale=k**-0.5)
    if impl == "torch":
        fn, weight_bytes = (lambda: x @ w.t()), w.numel() * 2
        ref = reference.matmul(x[:ERROR_ROWS], w.t())
    else:
        bits, group = (8, None) if impl.endswith("int8") else (4, 128)
        qw = gemm.quantize_weight(w, bits, group)
        fn, weight_bytes = (lambda: gemm.quantized_matmul(x, qw)), qw.nbytes
        ref = reference.quantized_matmul(x[:ERROR_ROWS], qw.qdata, qw.scales, qw.zeros, bits=bits,
                                         group_size=qw.group_size)
    err = _max_error(fn(), ref)
    bench.run_cuda(benchmark, fn, rounds=10)
    bench.annotate(
        benchmark, impl=impl, role=_role(impl), bytes_moved=weight_bytes + (m * k + m * n) * 2,
        flops=bench.matmul_flops(m, n, k), max_error=err, shape=f"{m}x{n}x{k}", dtype="bf16",
    )


# --- decode: bf16 / fp16 and weight-only int8 / int4 -------------------------------------------

DECODE_CASES = [(s, torch.bfloat16) for s in DECODE] + [(s, torch.float16) for s in DECODE if s[0] == 16]
DECODE_IMPLS = ["torch", "kernel_lab", "kernel_lab-int8", "kernel_lab-int4"]


@pytest.mark.parametrize("impl", DECODE_IMPLS)
@pytest.mark.parametrize(
    "case", DECODE_CASES, ids=[f"M{m}-N{n}-K{k}-{DTYPE_NAMES[d]}" for (m, n, k), d in DECODE_CASES]
)
def test_gemm_decode(benchmark, case, impl):
    (m, n, k), dtype = case
    if impl.endswith(("int8", "int4")) and (m > 16 or dtype != torch.bfloat16):
        pytest.skip("weight-only rows are benchmarked at M in {1, 16}, bf16")
    benchmark.group = f"gemm decode M{m} N{n} K{k} {DTYPE_NAMES[dtype]}"
    x = _rand(m, k, dtype=dtype, seed=m + k)
    w0 = _rand(n, k, dtype=dtype, seed=n + k, scale=k**-0.5)
    # Every row of the group replays as many calls: enough copies of the group's smallest weight
    # (int4 codes) to exceed 3x the L2, so no row's working set fits in it.
    copies = _copies(n * k // 2)
    if impl in ("torch", "kernel_lab"):
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        weight_bytes = w0.numel() * 2
        ref = reference.matmul(x[:ERROR_ROWS], w0.t())
        op = (lambda w: x @ w.t()) if impl == "torch" else (lambda w: gemm.matmul(x, w.t()))
    else:
        bits, group = (8, None) if impl.endswith("int8") else (4, 128)
        qw = gemm.quantize_weight(w0, bits, group)
        weight_bytes = qw.nbytes
        weights = [qw] + [
            gemm.QuantizedWeight(qw.qdata.clone(), qw.scales.clone(), qw.zeros, bits, qw.group_size, qw.shape, qw.dtype)
            for _ in range(copies - 1)
        ]
        ref = reference.quantized_matmul(x, qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=qw.group_size)

        def op(w):
            return gemm.quantized_matmul(x, w)

    err = _max_error(op(weights[0]), ref)
    fn, timing, calls = _graph_replays(op, weights)
    bench.run_cuda(benchmark, fn)
    bench.annotate(
        benchmark, impl=impl, role=_role(impl), bytes_moved=(weight_bytes + (m * k + m * n) * 2) * calls,
        flops=bench.matmul_flops(m, n, k) * calls, max_error=err, shape=f"{m}x{n}x{k}", dtype=DTYPE_NAMES[dtype],
        timing=timing, calls_per_round=calls,
        config=_best_config("_matmul_kernel_skinny") if impl == "kernel_lab" else None,
    )


# --- fp8 -----------------------------------------------------------------------------------------

FP8_CASES = [(8192, 8192, 8192, "tensor"), (4096, 14336, 4096, "tensor"), (4096, 14336, 4096, "row"),
             (16, 14336, 4096, "tensor")]  # fmt: skip


@pytest.mark.parametrize("impl", ["torch", "kernel_lab", "kernel_lab-notma"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"M{m}-N{n}-K{k}-{g}" for m, n, k, g in FP8_CASES])
def test_gemm_fp8(benchmark, case, impl):
    m, n, k, granularity = case
    if runtime.device_info().capability < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    benchmark.group = f"gemm fp8 {granularity}-scaled M{m} N{n} K{k} -> bf16"
    xq, sx = gemm.quantize_fp8(_rand(m, k, dtype=torch.bfloat16, seed=5), granularity)
    wq, sw = gemm.quantize_fp8(_rand(n, k, dtype=torch.bfloat16, seed=6, scale=k**-0.5), granularity)
    sw = sw.t().contiguous() if granularity == "row" else sw
    if impl == "torch":
        sa_mm = sx if granularity == "row" else sx.reshape(())
        sb_mm = sw if granularity == "row" else sw.reshape(())

        def op(w):
            return torch._scaled_mm(xq, w.t(), sa_mm, sb_mm, out_dtype=torch.bfloat16)
    elif impl == "kernel_lab":

        def op(w):
            return gemm.fp8_matmul(xq, w.t(), sx, sw)
    else:
        sx2 = sx.reshape(-1, 1) if sx.numel() > 1 else sx.reshape(1)
        sw2 = sw.reshape(1, -1) if sw.numel() > 1 else sw.reshape(1)

        def op(w):
            return matmul_fwd(xq, w.t(), None, "none", torch.bfloat16, sx2, sw2, allow_tma=False)

    ref = reference.fp8_matmul(xq[:ERROR_ROWS], wq.t(), sx[:ERROR_ROWS] if granularity == "row" else sx, sw)
    err = _max_error(op(wq), ref)
    if m <= gemm.ops.SKINNY_MAX_M:  # a decode shape: timed as the decode groups are (see the module docstring)
        fn, timing, calls = _graph_replays(op, [wq] + [wq.clone() for _ in range(_copies(wq.numel()) - 1)])
    else:
        fn, timing, calls = (lambda: op(wq)), "eager", 1
    bench.run_cuda(benchmark, fn, rounds=10)
    bench.annotate(
        benchmark, impl="torch._scaled_mm" if impl == "torch" else impl, role=_role(impl),
        bytes_moved=(m * k + n * k + m * n * 2) * calls, flops=bench.matmul_flops(m, n, k) * calls, max_error=err,
        shape=f"{m}x{n}x{k}", dtype="fp8e4m3", timing=timing, calls_per_round=calls,
    )


# --- rms_norm_linear -----------------------------------------------------------------------------

RNL_M = [1, 16, 32, 64]


@pytest.mark.parametrize("impl", ["torch", "torch.compile", "kernel_lab"])
@pytest.mark.parametrize("m", RNL_M)
def test_rms_norm_linear(benchmark, m, impl):
    n, k, eps = 6144, 4096, 1e-5
    benchmark.group = f"rms_norm_linear M{m} N{n} K{k} bf16"
    x = _rand(m, k, dtype=torch.bfloat16, seed=7, scale=3.0)
    g = _rand(k, dtype=torch.bfloat16, seed=8)
    w0 = _rand(n, k, dtype=torch.bfloat16, seed=9, scale=k**-0.5)
    weights = [w0] + [w0.clone() for _ in range(_copies(w0.numel() * 2) - 1)]

    def unfused(x, g, w):
        return F.linear(F.rms_norm(x, (k,), g, eps), w)

    op = {
        "torch": unfused,
        "torch.compile": torch.compile(unfused, dynamic=False),
        "kernel_lab": lambda x, g, w: gemm.rms_norm_linear(x, g, w, eps=eps),
    }[impl]
    err = _max_error(op(x, g, w0), reference.rms_norm_linear(x, g, w0, eps))
    fn, timing, calls = _graph_replays(lambda w: op(x, g, w), weights)
    bench.run_cuda(benchmark, fn)
    bench.annotate(
        benchmark, impl=impl, role=_role(impl), bytes_moved=(n * k + m * k + k + m * n) * 2 * calls,
        flops=bench.matmul_flops(m, n, k) * calls, max_error=err, shape=f"{m}x{n}x{k}", dtype="bf16",
        timing=timing, calls_per_round=calls,
    )
