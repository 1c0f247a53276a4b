"""The softmax references against float64 PyTorch math and against their own gradients."""

import pytest
import torch

from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_reference_matches_torch_float64(seed, dim):
    x = randn(5, 37, 3, dtype=torch.float64, seed=seed, scale=4.0)
    torch.testing.assert_close(reference.softmax(x, dim), torch.softmax(x, dim), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(
        reference.log_softmax(x, dim), torch.log_softmax(x, dim), rtol=1e-12, atol=1e-12
    )


def test_softmax_reference_fully_masked_row_is_zero_and_log_is_neg_inf():
    x = torch.tensor([[float("-inf")] * 4, [0.0, float("-inf"), 1.0, 2.0]])
    y = reference.softmax(x)
    assert torch.equal(y[0], torch.zeros(4, dtype=torch.float64))
    assert y[1, 1] == 0 and torch.isclose(y[1].sum(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.isneginf(reference.log_softmax(x)[0]).all()


def test_softmax_reference_nan_or_inf_entry_makes_the_row_nan_as_in_torch():
    """Only a row with no finite entry (sum 0) is special-cased: a NaN sum must stay NaN."""
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0], [1.0, 2.0, 3.0]])
    y = reference.softmax(x)
    assert torch.isnan(y[:2]).all() and torch.isnan(torch.softmax(x, -1)[:2]).all()
    torch.testing.assert_close(y[2], torch.softmax(x[2].double(), -1))


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_reference_matches_autograd(seed, log):
    x = randn(4, 19, dtype=torch.float64, seed=seed, requires_grad=True)
    dy = randn(4, 19, dtype=torch.float64, seed=seed + 1)
    fwd = torch.log_softmax if log else torch.softmax
    y = fwd(x, -1)
    (expected,) = torch.autograd.grad(y, x, dy)
    bwd = reference.log_softmax_backward if log else reference.softmax_backward
    torch.testing.assert_close(bwd(y.detach(), dy, -1), expected, rtol=1e-12, atol=1e-14)


def test_reference_compute_dtype_is_honoured():
    x = randn(3, 8, dtype=torch.bfloat16, seed=0)
    assert reference.softmax(x).dtype == torch.float64
    assert reference.softmax(x, compute_dtype=torch.float32).dtype == torch.float32
