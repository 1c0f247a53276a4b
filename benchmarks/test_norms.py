"""kernel_lab.norms against torch eager (baseline), torch.compile and Liger-Kernel, forward and
backward.

One group per (op, direction, shape, dtype), one row per implementation. Every shape is
M x N = 2**26 bf16 elements (128 MiB per tensor, more than twice the L2 of H100/H200), so each
row measures HBM traffic. bytes_moved is the minimum the op must move (the weight, bias and
per-row statistics are a rounding error next to the tiles and are left out):
- rms_norm / layer_norm: forward reads x, writes y (2 tiles); backward reads x and dy, writes
  dx (3 tiles).
- residual_rms_norm: forward reads x and residual, writes y and u (4); backward reads u, dy
  and du, writes one gradient shared by x and residual (4). The eager baseline is the unfused
  pair `u = x + residual; F.rms_norm(u)`.
- rms_norm_gated: forward reads x and gate, writes y (3); backward reads x, gate and dy,
  writes dx and dgate (5).

Directions: `fwd` (no_grad calls), `bwd` (torch.autograd.grad calls back to back) and
`bwd-graph`, the same backward captured once in a CUDA graph and replayed: the GPU time of the
backward without the host's. On the lent H200's host a single op's autograd.grad costs the
engine 60-70 us (measured with a no-op autograd.Function), and with the launchers' own work our
rms_norm / layer_norm backward calls took 145-300 us of host time against 100-220 us of GPU time,
so the `bwd` rows time the host, for every implementation; in a training step that engine cost
is paid once per backward of the whole model, not per op.
Peers: torch.compile of the eager formula (compiled once per shape and direction, static
shapes: its best case), Liger-Kernel's LigerRMSNormFunction / LigerLayerNormFunction /
LigerFusedAddRMSNormFunction (default arguments; rows skipped, with the reason, where Liger is
not installed or lacks the op). Liger has no gated RMSNorm.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kernel_lab import norms
from kernel_lab.shared import bench, reference

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
ELEMENTS = 2**26
EPS = 1e-6
IMPLS = ["torch", "torch.compile", "liger", "kernel_lab"]
# Rows whose error is measured against the float64 reference (a slice keeps it cheap); the
# weight gradient is a sum over all rows and is not part of max_error.
ERROR_ROWS = 128
TILES = {  # (forward, backward) tensors of M x N moved
    "rms_norm": (2, 3),
    "layer_norm": (2, 3),
    "residual_rms_norm": (4, 4),
    "rms_norm_gated": (3, 5),
}
CASES = [
    (op, n)
    for op in ("rms_norm", "layer_norm")
    for n in (2048, 4096, 8192, 16384, 65536)
] + [("residual_rms_norm", n) for n in (4096, 8192)] + [("rms_norm_gated", 4096)]  # fmt: skip


def _rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _residual_rms(x, r, w):
    u = x + r
    return _rms(u, w), u


def _eager(op: str):
    return {
        "rms_norm": _rms,
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
        "residual_rms_norm": _residual_rms,
        "rms_norm_gated": lambda x, z, w: _rms(x, w) * F.silu(z),
    }[op]


@functools.cache
def _compiled(op: str, n: int, direction: str):
    # one compiled function per case: dynamo specialises it to the shape (its best case), and
    # no case evicts another from dynamo's cache
    return torch.compile(_eager(op), dynamic=False)


def _liger(op: str):
    try:
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
        if op == "residual_rms_norm":
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

            return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS)
    except ImportError as e:
        pytest.skip(f"Liger-Kernel is not installed or lacks {op} ({e})")
    pytest.skip(f"Liger-Kernel has no {op}")


def _impl_fn(op: str, n: int, direction: str, impl: str):
    if impl == "torch":
        return _eager(op)
    if impl == "torch.compile":
        return _compiled(op, n, direction)
    if impl == "liger":
        return _liger(op)
    return {
        "rms_norm": lambda x, w: norms.rms_norm(x, w, EPS),
        "layer_norm": lambda x, w, b: norms.layer_norm(x, w, b, EPS),
        "residual_rms_norm": lambda x, r, w: norms.residual_rms_norm(x, r, w, EPS),
        "rms_norm_gated": lambda x, z, w: norms.rms_norm_gated(x, z, w, EPS),
    }[op]


def _inputs(op: str, m: int, n: int):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * scale + shift).to(DTYPE)

    x = rand(m, n, scale=2.0)
    w = rand(n, scale=0.5, shift=1.0)
    if op == "layer_norm":
        return [x, w, rand(n)]
    if op in ("residual_rms_norm", "rms_norm_gated"):
        return [x, rand(m, n, scale=2.0), w]
    return [x, w]


def _reference(op: str, inputs, grads, backward: bool):
    """Float64 reference of the first ERROR_ROWS rows: outputs, or the gradients of the
    row-shaped inputs (x, residual / gate)."""
    sl = [t[:ERROR_ROWS] if t.ndim == 2 else t for t in inputs]
    gs = [g[:ERROR_ROWS] for g in grads]
    if op == "rms_norm":
        return reference.rms_norm_backward(gs[0], *sl, EPS)[:1] if backward else (reference.rms_norm(*sl, EPS),)
    if op == "layer_norm":
        return reference.layer_norm_backward(gs[0], *sl, EPS)[:1] if backward else (reference.layer_norm(*sl, EPS),)
    if op == "residual_rms_norm":
        if backward:
            ds = reference.residual_rms_norm_backward(gs[0], gs[1], *sl, EPS)[0]
            return ds, ds
        return reference.residual_rms_norm(*sl, EPS)
    return reference.rms_norm_gated_backward(gs[0], *sl, EPS)[:2] if backward else (
        reference.rms_norm_gated(*sl, EPS),)


def _graphed_backward(fn, inputs, grads_of):
    """A CUDA graph of one torch.autograd.grad of fn(*leaves) w.r.t. leaves, fresh copies of inputs.

    Leaves, forward and output gradients (grads_of(outs)) are made on the capture stream:
    autograd launches each backward kernel, the leaves' gradient accumulators included, on the
    stream its forward ran on, and one left on the default stream breaks the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = grads_of(outs)
        for _ in range(3):  # warm-up outside the capture: compilation, autotuning, allocator pools
            torch.autograd.grad(outs, leaves, grads, retain_graph=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            torch.autograd.grad(outs, leaves, grads, retain_graph=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # the graph replays kernels reading these tensors: keep them alive as long as the graph
    graph.keep_alive = (leaves, outs, grads)
    return graph


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ["fwd", "bwd", "bwd-graph"])
@pytest.mark.parametrize("case", CASES, ids=[f"{op}-{n}" for op, n in CASES])
def test_norms(benchmark, case, direction, impl):
    op, n = case
    m = ELEMENTS // n
    benchmark.group = f"{op} {direction} {m}x{n} bf16"
    if op == "rms_norm_gated" and impl == "liger":
        pytest.skip("Liger-Kernel has no gated RMSNorm")
    fn = _impl_fn(op, n, "bwd" if direction == "bwd-graph" else direction, impl)
    backward = direction != "fwd"
    inputs = _inputs(op, m, n)
    if backward:
        inputs = [t.requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator("cuda").manual_seed(1)
    grads = [torch.randn(o.shape, device="cuda", dtype=DTYPE, generator=gen) for o in outs]
    # the gradients of the row-shaped inputs: x, and residual / gate
    row_inputs = [t for t in inputs if t.ndim == 2]
    # before any backward: Liger's RMSNorm backward overwrites dy with dx in place
    ref = _reference(op, [t.detach() for t in inputs], grads, backward)
    if backward:
        got = torch.autograd.grad(outs, row_inputs, grads, retain_graph=True)
    else:
        got = outs
    max_error = max(bench.max_error(g[:ERROR_ROWS], r) for g, r in zip(got, ref, strict=True))
    if direction == "bwd-graph":
        try:
            graph = _graphed_backward(fn, inputs, lambda outs: [
                torch.randn(o.shape, device="cuda", dtype=DTYPE, generator=gen) for o in outs])
        except RuntimeError as e:  # reported as the peer's absence, not as a failure of ours
            if impl == "kernel_lab":
                raise
            pytest.skip(f"{impl}'s backward cannot be captured in a CUDA graph: {' '.join(str(e).split())[:200]}")
        bench.run_cuda(benchmark, graph.replay, rounds=20)
    elif backward:
        bench.run_cuda(benchmark, lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True), rounds=20)
    else:
        with torch.no_grad():
            bench.run_cuda(benchmark, lambda: fn(*inputs), rounds=20)
    role = {"torch": "baseline", "kernel_lab": "kernel_lab"}.get(impl, "peer")
    tiles = TILES[op][1 if backward else 0]
    bench.annotate(
        benchmark, impl=impl, role=role, bytes_moved=tiles * m * n * DTYPE.itemsize, max_error=max_error,
        op=op, direction=direction, shape=f"{m}x{n}", dtype="bfloat16",
    )  # fmt: skip
