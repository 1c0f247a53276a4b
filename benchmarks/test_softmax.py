"""Softmax benchmarks (GPU): kernel_lab vs torch eager, torch.compile and Liger-Kernel.

Groups are (direction, dtype, M x N). Inputs are 256 MiB (128M elements of 2 bytes), four
times the largest L2 (H200: 60 MiB), so every row measures HBM and not cache. The floor is
bytes / copy bandwidth: forward reads x and writes y (2 x 256 MiB); backward reads y and dy
and writes dx (3 x 256 MiB).

`softmax-dispatch` groups time a tiny input, where the cost is launch and Python dispatch:
kernel_lab's eager path against the same kernel called through the registered custom op.
"""

from __future__ import annotations

import pytest
import torch

from kernel_lab.shared import bench, reference

softmax_mod = pytest.importorskip("kernel_lab.softmax")

pytestmark = pytest.mark.gpu

ELEMENTS = 1 << 27
COLS = [1024, 4096, 8192, 32768, 131072]
IMPLS = ["torch", "torch.compile", "liger", "kernel_lab"]


def _liger_softmax():
    try:
        from liger_kernel.transformers.functional import liger_softmax
    except ImportError:
        pytest.skip("liger-kernel is not installed")
    return liger_softmax


def _impl(name: str):
    if name == "torch":
        return lambda x: torch.softmax(x, -1)
    if name == "torch.compile":
        torch._dynamo.reset()
        return torch.compile(lambda x: torch.softmax(x, -1), dynamic=False)
    if name == "liger":
        return _liger_softmax()
    return lambda x: softmax_mod.softmax(x, -1)


def _first_call(impl: str, fn, x: torch.Tensor) -> torch.Tensor:
    """Call fn(x) once; a peer that refuses the shape is skipped with its own message."""
    try:
        return fn(x)
    except RuntimeError as e:
        if impl == "liger":
            pytest.skip(f"liger-kernel refuses this shape: {e}")
        raise


def _max_error(y: torch.Tensor, x: torch.Tensor) -> float:
    """Max abs error against the float64 reference on the first rows (enough to catch a bug)."""
    rows = max(1, min(x.shape[0], (1 << 22) // x.shape[1]))
    ref = reference.softmax(x[:rows])
    return bench.max_error(y[:rows], ref)


def _role(impl: str) -> str:
    return {"torch": "baseline", "kernel_lab": "kernel_lab"}.get(impl, "peer")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_cols", COLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softmax_forward(benchmark, impl, n_cols, dtype):
    n_rows = ELEMENTS // n_cols
    benchmark.group = f"softmax-fwd {str(dtype)[6:]} {n_rows}x{n_cols}"
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype) * 4
    _time_forward(benchmark, impl, x)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_rows, n_cols", [(4, 1 << 20), (32, 131072)])
def test_softmax_forward_few_long_rows(benchmark, impl, n_rows, n_cols):
    """Too few rows to fill the GPU with one program per row: the split path."""
    benchmark.group = f"softmax-fwd bfloat16 {n_rows}x{n_cols} (few rows)"
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16) * 4
    _time_forward(benchmark, impl, x)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_cols", COLS)
def test_softmax_backward(benchmark, impl, n_cols):
    n_rows = ELEMENTS // n_cols
    benchmark.group = f"softmax-bwd bfloat16 {n_rows}x{n_cols}"
    _time_backward(benchmark, impl, n_rows, n_cols)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("n_rows, n_cols", [(131072, 1000), (4096, 50264), (4096, 50257)])
def test_softmax_ragged_rows(benchmark, impl, direction, n_rows, n_cols):
    """Row lengths that are not multiples of 16: 1000 and 50264 (8 mod 16: 16-byte vectors of
    bf16 still fit, kernel_lab.shared.vector_hints), 50257 (GPT-2's vocabulary: odd, no row but
    the first is 16-byte aligned)."""
    benchmark.group = f"softmax-{direction} bfloat16 {n_rows}x{n_cols} (ragged)"
    if direction == "bwd":
        _time_backward(benchmark, impl, n_rows, n_cols)
        return
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16) * 4
    _time_forward(benchmark, impl, x)


def _time_forward(benchmark, impl: str, x: torch.Tensor) -> None:
    """Time impl's softmax of x over its last dim."""
    fn = _impl(impl)
    y = _first_call(impl, fn, x)
    bench.run_cuda(benchmark, lambda: fn(x))
    bench.annotate(benchmark, impl=impl, role=_role(impl), bytes_moved=bench.bytes_of(x, y),
                   max_error=_max_error(y, x))


def _time_backward(benchmark, impl: str, n_rows: int, n_cols: int) -> None:
    """Time torch.autograd.grad of impl's softmax of a bf16 (n_rows, n_cols) input."""
    x = (torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_(True)
    dy = torch.randn_like(x)
    y = _first_call(impl, _impl(impl), x)
    bench.run_cuda(benchmark, lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    rows = max(1, (1 << 22) // n_cols)
    ref = reference.softmax_backward(reference.softmax(x[:rows].detach()), dy[:rows])
    bench.annotate(benchmark, impl=impl, role=_role(impl), bytes_moved=bench.bytes_of(y, dy, dx),
                   max_error=bench.max_error(dx[:rows], ref))


@pytest.mark.parametrize("path", ["torch", "kernel_lab eager", "kernel_lab custom op"])
def test_softmax_dispatch_overhead(benchmark, path):
    """A 8 x 128 float32 input: the time is launch + Python/dispatcher overhead, not the kernel."""
    benchmark.group = "softmax-dispatch float32 8x128 (tiny)"
    x = torch.randn(8, 128, device="cuda")
    fns = {
        "torch": lambda: torch.softmax(x, -1),
        "kernel_lab eager": lambda: softmax_mod.softmax(x, -1),
        "kernel_lab custom op": lambda: torch.ops.kernel_lab.softmax_fwd(x, 1, False),
    }
    bench.run_cuda(benchmark, fns[path], min_round_seconds=1e-3)
    role = {"torch": "baseline", "kernel_lab eager": "kernel_lab"}.get(path, "peer")
    bench.annotate(benchmark, impl=path, role=role)
