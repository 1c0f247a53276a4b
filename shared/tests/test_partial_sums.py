"""partial_sums: column sums of float32 partials, cast to the gradient's dtype, by a second launch
(sum_partials) or by the last program of the kernel that writes them (sum_if_last, workspace)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # (after the importorskip, as is partial_sums, which needs triton)
import triton.language as tl

from kernel_lab.shared import partial_sums


@pytest.mark.interpret
@pytest.mark.parametrize("n_rows, n_cols", [(1, 1), (33, 65), (70, 200), (5, 4096), (300, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_partials_matches_float64_sums(kernel_device, seed, n_rows, n_cols, dtype):
    """Rows past one BLOCK_M step and columns past one BLOCK_N block, both with masked tails, in
    column blocks of 64 down to the narrowest (8 at 300 x 20: fewer blocks than SMs even then).
    The kernel sums in float32, so the budget is float32's rounding over n_rows terms, plus half
    an ulp of the cast to dtype."""
    gen = torch.Generator(kernel_device).manual_seed(seed)
    partials = torch.randn((n_rows, n_cols), device=kernel_device, generator=gen)
    out = partial_sums.sum_partials(partials, dtype)
    assert out.shape == (n_cols,) and out.dtype == dtype and out.device == partials.device
    exact = partials.double().sum(0)
    float32_sum_error = n_rows * torch.finfo(torch.float32).eps * partials.double().abs().sum(0)
    budget = float32_sum_error + exact.abs() * torch.finfo(dtype).eps
    assert (out.double() - exact).abs().le(budget).all(), f"{(out.double() - exact).abs().max()} > budget"


@pytest.mark.interpret
def test_sum_partials_of_no_rows_is_zero(kernel_device):
    got = partial_sums.sum_partials(torch.empty((0, 7), device=kernel_device), torch.bfloat16)
    assert torch.equal(got, torch.zeros(7, dtype=torch.bfloat16, device=kernel_device))


@pytest.mark.interpret
@pytest.mark.parametrize("n_slabs, n_rows, n_cols", [(2, 33, 65), (3, 1, 200), (2, 0, 9)])
def test_sum_partials_sums_each_slab(kernel_device, seed, n_slabs, n_rows, n_cols):
    """(n_slabs, n_rows, n_cols) partials in one launch: each slab's column sums against float64
    (the budget of test_sum_partials_matches_float64_sums), and equal bit for bit to the 2-D call
    on that slab alone (the same kernel and tiles)."""
    gen = torch.Generator(kernel_device).manual_seed(seed)
    partials = torch.randn((n_slabs, n_rows, n_cols), device=kernel_device, generator=gen)
    out = partial_sums.sum_partials(partials, torch.bfloat16)
    assert out.shape == (n_slabs, n_cols) and out.dtype == torch.bfloat16
    exact = partials.double().sum(1)
    budget = (n_rows * torch.finfo(torch.float32).eps * partials.double().abs().sum(1)
              + exact.abs() * torch.finfo(torch.bfloat16).eps)
    assert (out.double() - exact).abs().le(budget).all(), f"{(out.double() - exact).abs().max()} > budget"
    for slab in range(n_slabs):
        assert torch.equal(out[slab], partial_sums.sum_partials(partials[slab].contiguous(), torch.bfloat16))


def test_sum_partials_rejects_bad_partials():
    for bad in (torch.zeros((2, 2), dtype=torch.float16), torch.zeros((2, 4))[:, ::2], torch.zeros((1, 1, 2, 2)),
                torch.zeros(4), torch.zeros((2, 2, 4))[:, :, ::2]):
        with pytest.raises(ValueError, match="contiguous 2-D or 3-D float32"):
            partial_sums.sum_partials(bad, torch.float32)


@pytest.mark.gpu
def test_sum_partials_large_on_gpu(seed):
    """A norm backward's size: 528 programs x 8192 columns."""
    gen = torch.Generator("cuda").manual_seed(seed)
    partials = torch.randn((528, 8192), device="cuda", generator=gen)
    exact = partials.double().sum(0)
    torch.testing.assert_close(partial_sums.sum_partials(partials, torch.float32).double(), exact, rtol=1e-5, atol=1e-4)
    # bf16: the float32 sum's own rounding may move the cast by one bf16 ulp (2**-8 relative)
    torch.testing.assert_close(partial_sums.sum_partials(partials, torch.bfloat16).double(),
                               exact.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-2)


@triton.jit
def _write_then_sum_kernel(src_ptr, partial_ptr, out_ptr, arrivals_ptr, n_parts, n_cols,
                           BLOCK_N: tl.constexpr, SUM_ROWS: tl.constexpr):
    """Program (i, j) stores row i of src's column block j as its partial row, then sum_if_last
    (one counter per column block), as a backward kernel's epilogue does."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(0).to(tl.int64) * n_cols
    tl.store(partial_ptr + row + cols, tl.load(src_ptr + row + cols, mask=cols < n_cols), mask=cols < n_cols)
    partial_sums.sum_if_last(partial_ptr, out_ptr, arrivals_ptr + tl.program_id(1), n_parts, n_cols, cols, SUM_ROWS)


def _fused_sums(src: torch.Tensor, dtype: torch.dtype, block_n: int = 64, sum_rows: int = 4):
    """(column sums of src by _write_then_sum_kernel, the arrival counters after the launch)."""
    n_parts, n_cols = src.shape
    groups = triton.cdiv(n_cols, block_n)
    partials, arrivals = partial_sums.workspace(src.device, n_parts, n_cols, groups)
    out = torch.empty(n_cols, dtype=dtype, device=src.device)
    _write_then_sum_kernel[(n_parts, groups)](src, partials, out, arrivals, n_parts, n_cols, BLOCK_N=block_n,
                                              SUM_ROWS=sum_rows)
    return out, arrivals


@pytest.mark.interpret
@pytest.mark.parametrize("n_parts, n_cols", [(1, 1), (7, 65), (33, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_if_last_matches_float64_sums_and_rearms_its_counters(kernel_device, seed, n_parts, n_cols, dtype):
    """Parts not a multiple of SUM_ROWS, columns with a masked tail block; the budget as for
    sum_partials. The counters are back at zero after the launch, ready for the next."""
    gen = torch.Generator(kernel_device).manual_seed(seed)
    src = torch.randn((n_parts, n_cols), device=kernel_device, generator=gen)
    out, arrivals = _fused_sums(src, dtype)
    exact = src.double().sum(0)
    budget = n_parts * torch.finfo(torch.float32).eps * src.double().abs().sum(0) + exact.abs() * torch.finfo(dtype).eps
    assert (out.double() - exact).abs().le(budget).all(), f"{(out.double() - exact).abs().max()} > budget"
    assert not arrivals.any()


@pytest.mark.gpu
def test_workspace_is_kept_per_stream_and_reused(seed):
    """Consecutive launches on one stream share the workspace (and get equal, deterministic
    sums); another stream gets its own; a graph capture gets fresh buffers and its replays
    give the eager result."""
    partial_sums.release_workspaces()
    gen = torch.Generator("cuda").manual_seed(seed)
    src = torch.randn((300, 5000), device="cuda", generator=gen)
    first, arrivals = _fused_sums(src, torch.float32)
    again, arrivals_again = _fused_sums(src, torch.float32)
    assert arrivals_again.data_ptr() == arrivals.data_ptr() and not arrivals.any()
    assert torch.equal(first, again)
    torch.testing.assert_close(first.double(), src.double().sum(0), rtol=1e-5, atol=1e-4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side, side_arrivals = _fused_sums(src, torch.float32)
    torch.cuda.current_stream().wait_stream(side)
    assert side_arrivals.data_ptr() != arrivals.data_ptr() and torch.equal(on_side, first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, graph_arrivals = _fused_sums(src, torch.float32)
    assert graph_arrivals.data_ptr() not in (arrivals.data_ptr(), side_arrivals.data_ptr())
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
    partial_sums.release_workspaces()


@pytest.mark.gpu
def test_workspaces_are_dropped_past_the_cap(monkeypatch):
    """At most MAX_WORKSPACES streams keep a workspace: a new one past that drops them all."""
    monkeypatch.setattr(partial_sums, "MAX_WORKSPACES", 2)
    partial_sums.release_workspaces()
    streams = [torch.cuda.Stream() for _ in range(3)]
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            partial_sums.workspace(torch.device("cuda", torch.cuda.current_device()), 4, 8, 1)
        assert len(partial_sums._WORKSPACES) == (i + 1 if i < 2 else 1)
    partial_sums.release_workspaces()
