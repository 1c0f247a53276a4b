"""partial_sums.sum_partials: column sums of float32 partials, cast to the gradient's dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_lab.shared import partial_sums  # (after the importorskip: it needs triton)


@pytest.mark.interpret
@pytest.mark.parametrize("n_rows, n_cols", [(1, 1), (33, 65), (70, 200), (5, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_partials_matches_float64_sums(kernel_device, seed, n_rows, n_cols, dtype):
    """Rows past one BLOCK_M step and columns past one BLOCK_N block, both with masked tails. The
    kernel sums in float32, so the budget is float32's rounding over n_rows terms, plus half an
    ulp of the cast to dtype."""
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


def test_sum_partials_rejects_bad_partials():
    for bad in (torch.zeros((2, 2), dtype=torch.float16), torch.zeros((2, 4))[:, ::2], torch.zeros((1, 2, 2))):
        with pytest.raises(ValueError, match="contiguous 2-D float32"):
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
