"""kernel_lab.mlp against torch eager (baseline), torch.compile and Liger-Kernel, forward and backward.

One group per (op, direction, shape, dtype), one row per implementation. Every shape's tensors
are tens to hundreds of MB, several times the L2 (50-60 MiB on H100/H200), so each row measures
HBM traffic. bytes_moved is the minimum the op must move:
- swiglu / geglu forward: read gate and up, write y (3 tensors); backward: read gate, up and
  dy, write dgate and dup (5 tensors).
- silu_and_mul: the same counts over the packed (M, 2N) input.
- bias_gelu forward: read x, write y (+ the bias row); backward: read x and dy, write dx (+ bias
  row and dbias).
Liger-Kernel has swiglu (LigerSiLUMulFunction) and the tanh GeGLU (LigerGELUMulFunction); its
rows are skipped, with the reason, where it is not installed. GeGLU is benchmarked with the
tanh approximation so that every row computes the same function.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kernel_lab import mlp
from kernel_lab.shared import bench, reference

pytestmark = pytest.mark.gpu

# (M tokens, N intermediate): Llama-3-8B at 16k tokens, Qwen2.5-7B at 8k, Llama-2-7B at 4k
SHAPES = [(16384, 14336), (8192, 18944), (4096, 11008)]
DTYPE = torch.bfloat16
IMPLS = ["torch", "torch.compile", "liger", "kernel_lab"]
# Rows whose error is measured against the float64 reference (a slice keeps it cheap).
ERROR_ROWS = 256


def _liger(name: str):
    try:
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as fn
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as fn
    except ImportError as e:
        pytest.skip(f"Liger-Kernel is not installed ({e})")
    return fn.apply


def _eager(op: str):
    return {
        "swiglu": lambda g, u: F.silu(g) * u,
        "geglu": lambda g, u: F.gelu(g, approximate="tanh") * u,
        "silu_and_mul": lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :],
        "bias_gelu": lambda x, b: F.gelu(x + b),
    }[op]


@functools.cache
def _compiled(op: str):
    # one compiled function per op, shared by all shapes; dynamic=True compiles it once for all
    # of them (a pointwise kernel gains nothing from static sizes: Triton still specializes on
    # the alignment of sizes and strides at launch) and keeps the run's compile time bounded
    return torch.compile(_eager(op), dynamic=True)


def _impl_fn(op: str, impl: str):
    if impl == "torch":
        return _eager(op)
    if impl == "torch.compile":
        return _compiled(op)
    if impl == "liger":
        if op not in ("swiglu", "geglu"):
            pytest.skip(f"Liger-Kernel has no {op}")
        return _liger(op)
    return {
        "swiglu": mlp.swiglu,
        "geglu": lambda g, u: mlp.geglu(g, u, "tanh"),
        "silu_and_mul": mlp.silu_and_mul,
        "bias_gelu": mlp.bias_gelu,
    }[op]


def _reference(op: str, inputs, dy, backward: bool):
    """Float64 reference of the first ERROR_ROWS rows (outputs, or input gradients)."""
    sl = [t[:ERROR_ROWS] if t.ndim == 2 else t for t in inputs]
    dy = dy[:ERROR_ROWS]
    if op == "swiglu":
        return reference.swiglu_backward(*sl, dy) if backward else (reference.swiglu(*sl),)
    if op == "geglu":
        return reference.geglu_backward(*sl, dy, "tanh") if backward else (reference.geglu(*sl, "tanh"),)
    if op == "silu_and_mul":
        return (reference.silu_and_mul_backward(*sl, dy),) if backward else (reference.silu_and_mul(*sl),)
    if backward:  # bias_gelu: dbias over ERROR_ROWS rows is not the full one; compare dx only
        return reference.bias_gelu_backward(*sl, dy)[:1]
    return (reference.bias_gelu(*sl),)


def _inputs(op: str, m: int, n: int):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * scale).to(DTYPE)

    if op == "silu_and_mul":
        return [rand(m, 2 * n, scale=2.0)]
    if op == "bias_gelu":
        return [rand(m, n, scale=2.0), rand(n)]
    return [rand(m, n, scale=2.0), rand(m, n)]


def _bytes(op: str, m: int, n: int, backward: bool) -> int:
    tile = m * n * torch.finfo(DTYPE).bits // 8
    row = n * torch.finfo(DTYPE).bits // 8
    if op == "bias_gelu":
        return 3 * tile + 2 * row if backward else 2 * tile + row
    return 5 * tile if backward else 3 * tile


CASES = [
    (op, shape)
    for op in ("swiglu", "geglu", "bias_gelu")
    for shape in SHAPES
] + [("silu_and_mul", SHAPES[0])]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[f"{op}-{m}x{n}" for op, (m, n) in CASES])
def test_mlp(benchmark, case, direction, impl):
    op, (m, n) = case
    benchmark.group = f"{op} {direction} {m}x{n} bf16"
    fn = _impl_fn(op, impl)
    backward = direction == "bwd"
    inputs = _inputs(op, m, n)
    if backward:
        inputs = [t.requires_grad_(True) for t in inputs]
    dy = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=torch.Generator("cuda").manual_seed(1))
    # the reference comes first: Liger's backward overwrites its saved inputs with the gradients
    ref = _reference(op, [t.detach() for t in inputs], dy, backward)
    y = fn(*inputs)
    if backward:
        got = torch.autograd.grad(y, inputs, dy, retain_graph=True)
        got = got[:1] if op == "bias_gelu" else got
    else:
        got = (y,)
    max_error = max(bench.max_error(g[:ERROR_ROWS], r) for g, r in zip(got, ref, strict=True))
    if backward:
        bench.run_cuda(benchmark, lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True), rounds=20)
    else:
        with torch.no_grad():
            bench.run_cuda(benchmark, lambda: fn(*inputs), rounds=20)
    role = {"torch": "baseline", "kernel_lab": "kernel_lab"}.get(impl, "peer")
    bench.annotate(
        benchmark, impl=impl, role=role, bytes_moved=_bytes(op, m, n, backward), max_error=max_error, op=op,
        direction=direction, shape=f"{m}x{n}", dtype=str(DTYPE).removeprefix("torch."),
    )  # fmt: skip
