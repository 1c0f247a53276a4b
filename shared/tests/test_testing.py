"""The tolerance rule and input makers catch what they are meant to catch."""

import pytest
import torch

from kernel_lab.shared import runtime, testing


def test_randn_is_reproducible_and_not_constant():
    a = testing.randn(64, seed=7)
    assert torch.equal(a, testing.randn(64, seed=7))
    assert not torch.equal(a, testing.randn(64, seed=8))
    assert a.std() > 0.5


def test_strided_rows_keeps_values_with_padded_row_stride():
    x = testing.randn(4, 10, seed=1)
    v = testing.strided_rows(x, pad=3)
    assert torch.equal(v, x) and v.stride() == (13, 1) and not v.is_contiguous()


def test_transposed_copy_is_column_major():
    x = testing.randn(3, 5, 7, seed=2)
    v = testing.transposed_copy(x)
    assert torch.equal(v, x) and v.stride()[-2:] == (1, 5)


def test_poisoned_is_nan_for_floats_and_max_for_ints():
    assert torch.isnan(testing.poisoned(3, dtype=torch.float16)).all()
    assert (testing.poisoned(3, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()


def test_rule_passes_within_factor_of_baseline_and_fails_beyond():
    ref = testing.randn(100, dtype=torch.float64, seed=3)
    baseline = ref + 1e-3
    ok = testing.assert_close_to_reference(ref + 1.5e-3, ref, baseline, factor=2.0, atol=0.0)
    assert ok.budget == pytest.approx(2e-3)
    with pytest.raises(AssertionError, match=r"max abs error 2\.5"):
        testing.assert_close_to_reference(ref + 2.5e-3, ref, baseline, factor=2.0, atol=0.0)


def test_rule_reports_nan_and_inf_mismatches():
    ref = torch.tensor([0.0, float("inf"), 1.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="NaN/Inf mismatches"):
        testing.assert_close_to_reference(torch.tensor([0.0, float("inf"), float("nan")]), ref, atol=1.0)
    with pytest.raises(AssertionError, match="NaN/Inf mismatches"):
        testing.assert_close_to_reference(torch.tensor([0.0, float("-inf"), 1.0]), ref, atol=1.0)
    testing.assert_close_to_reference(torch.tensor([0.0, float("inf"), 1.0]), ref, atol=0.0)


def test_rule_rejects_shape_mismatch():
    with pytest.raises(AssertionError, match="shape"):
        testing.assert_close_to_reference(torch.zeros(3), torch.zeros(4))


class _FirstOrderSquare(torch.autograd.Function):
    """x^2 whose backward is computed like a kernel's (no graph) and says so."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        from kernel_lab.shared import runtime

        runtime.check_first_order_backward("square")
        (x,) = ctx.saved_tensors
        return (2 * x * dy).detach()


def test_first_order_backward_works_and_double_backward_raises():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(_FirstOrderSquare.apply(x), x, torch.ones(5, dtype=torch.float64))
    assert torch.equal(dx, 2 * x.detach())
    with pytest.raises(RuntimeError, match=r"square: double backward is not supported"):
        torch.autograd.grad(_FirstOrderSquare.apply(x), x, torch.ones(5, dtype=torch.float64), create_graph=True)
    testing.assert_double_backward_raises(_FirstOrderSquare.apply, x)


def test_assert_double_backward_raises_fails_for_a_twice_differentiable_op():
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(pytest.fail.Exception):
        testing.assert_double_backward_raises(torch.sin, x)


def test_integer_outputs_are_compared_exactly_and_complex_refused():
    ref = torch.arange(2_000_000, 2_000_010)
    with pytest.raises(AssertionError):  # off by one at 2e6: the relative float floor was 2
        testing.assert_close_to_reference(ref + 1, ref)
    testing.assert_close_to_reference(ref.clone(), ref)
    z = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="complex tensors are not supported"):
        testing.assert_close_to_reference(z * 1j, z)


def test_fresh_launch_plans_swaps_the_direct_launchers_for_one_test():
    """A test that changes a launcher's policy gets empty direct launchers, and the process's own
    come back when its monkeypatch is undone."""
    own = runtime._DIRECT_LAUNCHERS
    mp = pytest.MonkeyPatch()
    try:
        testing.fresh_launch_plans(mp)
        assert runtime._DIRECT_LAUNCHERS == {} and runtime._DIRECT_LAUNCHERS is not own
    finally:
        mp.undo()
    assert runtime._DIRECT_LAUNCHERS is own
