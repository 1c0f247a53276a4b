"""bias_gelu: forward and backward (dx and the row-reduced dbias) against the references.

Baseline of the tolerance rule: PyTorch eager F.gelu(x + bias) in the same dtype, gradients by
autograd (docs/correctness.md).
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab import mlp
from kernel_lab.mlp import ops
from kernel_lab.shared import reference
from kernel_lab.shared.testing import (
    assert_close_to_reference,
    fresh_launch_plans,
    poisoned,
    randn,
    strided_rows,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]


def _check(x, bias, approximate, seed):
    """Forward and backward of the public op against reference and eager baseline."""
    dy = randn(*x.shape, dtype=x.dtype, device=x.device, seed=seed + 5)
    xk, bk = x.detach().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    y = mlp.bias_gelu(xk, bk, approximate)
    dx, db = torch.autograd.grad(y, (xk, bk), dy)
    xb, bb = x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    base = F.gelu(xb + bb, approximate=approximate)
    base_dx, base_db = torch.autograd.grad(base, (xb, bb), dy)
    x, bias = x.detach(), bias.detach()
    assert y.shape == x.shape and y.dtype == x.dtype and db.shape == bias.shape and db.dtype == bias.dtype
    assert_close_to_reference(y, reference.bias_gelu(x, bias, approximate), base, name="y")
    ref_dx, ref_db = reference.bias_gelu_backward(x, bias, dy, approximate)
    assert_close_to_reference(dx, ref_dx, base_dx, name="dx")
    assert_close_to_reference(db, ref_db, base_db, name="dbias")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize(
    "shape",
    # odd sizes; two column blocks with a tail; rows spanning several loop steps of a chunk
    [(3, 5, 33), (37, 1100), (300, 24)],
    ids=["odd", "two-col-blocks", "many-rows"],
)
def test_bias_gelu_forward_backward_match_reference(kernel_device, seed, dtype, approximate, shape):
    x = randn(*shape, dtype=dtype, device=kernel_device, seed=seed, scale=2.0)
    bias = randn(shape[-1], dtype=dtype, device=kernel_device, seed=seed + 1)
    _check(x, bias, approximate, seed)


@pytest.mark.interpret
def test_exact_gelu_kernels_keep_relative_accuracy_down_the_left_tail(kernel_device):
    """The kernels take Phi(x) from the normal tail (erfc), not from 1 + erf(x), which cancels
    for negative x: float32 torch (and 0.5 * (1 + erf) in float32) returns 0 or loses every
    digit below x = -6. Bound: the erfc fit's 1.2e-7 plus float32 rounding of exp2's argument
    (up to about 100 here), measured at 9e-6 on the CPU interpreter."""
    x = torch.linspace(-12.0, -3.0, 901, device=kernel_device).reshape(17, 53)
    zeros = torch.zeros(53, device=kernel_device)
    y = mlp.bias_gelu(x, zeros)
    gate_up = mlp.geglu(x, torch.ones_like(x))
    ref = reference.gelu(x)
    for name, out in (("bias_gelu", y), ("geglu", gate_up)):
        rel = ((out.double() - ref) / ref).abs().max().item()
        assert rel < 5e-5, f"{name}: max relative error {rel:.3g} over x in [-12, -3]"


@pytest.mark.interpret
def test_exact_gelu_float16_output_is_within_one_ulp_of_correct_rounding(kernel_device):
    """16-bit outputs use the cheaper ERFC16_P fit (Phi's relative error below 2e-5): on a dense
    grid every float16 result is the correctly rounded float64 GELU or its neighbour, as
    correct float32 math then one rounding gives. float16, not bfloat16: the interpreter
    truncates float32 -> bfloat16 instead of rounding."""
    x = torch.linspace(-8.0, 8.0, 8192, device=kernel_device).to(torch.float16).reshape(64, 128)
    y = mlp.bias_gelu(x, torch.zeros(128, dtype=torch.float16, device=kernel_device)).double()
    rounded = reference.gelu(x).to(torch.float16).double()  # float64 GELU, correctly rounded
    ulp = (rounded.abs() * 2.0**-10).clamp(min=2.0**-24)  # float16 spacing (2**-24: subnormals)
    off = ((y - rounded).abs() / ulp).max().item()
    assert off <= 1.0, f"float16 bias_gelu is {off:.2f} ulp from the correctly rounded GELU"


@pytest.mark.interpret
@pytest.mark.parametrize("approximate", APPROX)
def test_bias_gelu_strided_rows_match_reference(kernel_device, seed, approximate):
    x = strided_rows(randn(23, 70, device=kernel_device, seed=seed, scale=2.0), pad=6)
    bias = randn(70, device=kernel_device, seed=seed + 1)
    _check(x, bias, approximate, seed)


@pytest.mark.interpret
def test_bias_gelu_strided_bias_matches_reference(kernel_device, seed):
    """A bias that is a strided view (every other element of a buffer) is read as its values,
    not as the buffer's first N elements."""
    x = randn(4, 5, 33, device=kernel_device, seed=seed, scale=2.0)
    bias = randn(2 * 33, device=kernel_device, seed=seed + 1)[::2].requires_grad_(True)
    dy = randn(*x.shape, device=kernel_device, seed=seed + 2)
    xk = x.clone().requires_grad_(True)
    y = mlp.bias_gelu(xk, bias)
    dx, db = torch.autograd.grad(y, (xk, bias), dy)
    bias = bias.detach()
    assert_close_to_reference(y, reference.bias_gelu(x, bias), name="y")
    ref_dx, ref_db = reference.bias_gelu_backward(x, bias, dy)
    assert_close_to_reference(dx, ref_dx, name="dx")
    assert_close_to_reference(db, ref_db, name="dbias")


@pytest.mark.interpret
def test_bias_gelu_launch_recipes_are_reused_across_calls(kernel_device, seed, monkeypatch):
    """Calls of one shape with new values reuse the launchers' recipes (one per launch-plan key)
    and stay right."""
    monkeypatch.setattr(ops, "_RECIPES", {})
    counts = []
    for call in range(2):
        x = randn(2, 70, 33, dtype=torch.float16, device=kernel_device, seed=seed + 10 * call, scale=2.0)
        bias = randn(33, dtype=torch.float16, device=kernel_device, seed=seed + 10 * call + 1)
        _check(x, bias, "tanh", seed + 10 * call)
        counts.append(len(ops._RECIPES))
    assert counts == [2, 2]  # the forward's and the backward's


@pytest.mark.interpret
@pytest.mark.parametrize("approximate", APPROX)
def test_bias_gelu_kernels_write_every_element_of_poisoned_outputs(kernel_device, seed, approximate):
    """The launchers fill NaN-poisoned buffers completely (masked tails, row tails)."""
    m, n = 21, 1030  # neither a multiple of BLOCK_M nor of BLOCK_N
    activation = "gelu_tanh" if approximate == "tanh" else "gelu"
    x = randn(m, n, device=kernel_device, seed=seed, scale=2.0)
    bias = randn(n, device=kernel_device, seed=seed + 1)
    dy = randn(m, n, device=kernel_device, seed=seed + 2)
    out = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    ops._launch_bias_gelu_fwd(x, bias, out, activation)
    base = F.gelu(x + bias, approximate=approximate)
    assert_close_to_reference(out, reference.bias_gelu(x, bias, approximate), base, name="y")
    dx = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    db = ops._launch_bias_gelu_bwd(x, bias, dy, dx, activation)
    ref_dx, ref_db = reference.bias_gelu_backward(x, bias, dy, approximate)
    assert_close_to_reference(dx, ref_dx, name="dx", atol=1e-5 * float(ref_dx.abs().max()))
    assert_close_to_reference(db, ref_db, name="dbias", atol=1e-5 * float(ref_db.abs().max()))


@pytest.mark.interpret
@pytest.mark.parametrize("offsets", [32, 64])
def test_bias_gelu_forward_row_blocks_beyond_grid_axis_1(kernel_device, seed, offsets, monkeypatch):
    """Row blocks past MAX_GRID_Y go to grid axis 2 (CUDA allows 65535 programs on axis 1): with
    the limit patched to 4, 23 rows of 2-row tiles need 12 row blocks, 3 x 4 programs over axes
    2 and 1; every element of the NaN-poisoned output must come out right. With 32- and 64-bit
    offsets (the latter, for tensors past 2**31 elements, forced by the threshold)."""
    monkeypatch.setattr(ops, "_RECIPES", {})
    fresh_launch_plans(monkeypatch)
    monkeypatch.setattr(ops, "MAX_GRID_Y", 4)
    monkeypatch.setattr(ops, "MAX_OFFSET_32", 2**31 if offsets == 32 else 0)
    m, n = 23, 1031 + offsets
    x = randn(m, n, device=kernel_device, seed=seed, scale=2.0)
    bias = randn(n, device=kernel_device, seed=seed + 1)
    out = poisoned(m, n, dtype=torch.float32, device=kernel_device)
    assert ops._blocks(m, n, ops.BIAS_GELU_TILE_ELEMENTS)[0] == 2  # the tiles the docstring counts
    ops._launch_bias_gelu_fwd(x, bias, out, "gelu")
    assert_close_to_reference(out, reference.bias_gelu(x, bias), F.gelu(x + bias), name="y")


@pytest.mark.interpret
@pytest.mark.parametrize("fused", [True, False], ids=["sum-in-kernel", "sum-partials"])
def test_bias_gelu_bias_grad_both_ways_match_reference(kernel_device, seed, fused, monkeypatch):
    """The eager backward adds its partial sums up in the kernel (partial_sums.sum_if_last) up to
    BIAS_GRAD_FUSED_MAX_ELEMENTS and with sum_partials above: both, over several chunks and
    column blocks, twice in a row (the second call reuses the recipe and, on a GPU, the
    workspace: its counters must have been re-armed)."""
    monkeypatch.setattr(ops, "_RECIPES", {})
    fresh_launch_plans(monkeypatch)
    monkeypatch.setattr(ops, "BIAS_GRAD_FUSED_MAX_ELEMENTS", 1 << 40 if fused else 0)
    x = randn(301, 1100, dtype=torch.float32, device=kernel_device, seed=seed, scale=2.0)
    bias = randn(1100, dtype=torch.float32, device=kernel_device, seed=seed + 1)
    for _ in range(2):
        _check(x, bias, "none", seed)
    (_, (_, _, (chunks, _), counters)), = (v for k, v in ops._RECIPES.items() if k[0] is ops._bias_gelu_bwd_recipe)
    assert chunks > 1 and counters == (2 if fused else 0)


@pytest.mark.gpu
def test_bias_gelu_fused_bias_grad_under_cuda_graph_capture(seed):
    """A captured eager backward (fresh workspace in the graph's pool) replays to the result of
    the same backward run eagerly (the kept workspace), bit for bit; that result is checked
    against the reference first."""
    x = randn(1000, 3000, dtype=torch.bfloat16, device="cuda", seed=seed)
    bias = randn(3000, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    dy = randn(1000, 3000, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
    eager_dx, eager_db = ops.bias_gelu_bwd(x, bias, dy, "gelu")
    xb, bb = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    base_dx, base_db = torch.autograd.grad(F.gelu(xb + bb), (xb, bb), dy)
    ref_dx, ref_db = reference.bias_gelu_backward(x, bias, dy, "none")
    assert_close_to_reference(eager_dx, ref_dx, base_dx, name="dx")
    assert_close_to_reference(eager_db, ref_db, base_db, name="dbias")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dx, db = ops.bias_gelu_bwd(x, bias, dy, "gelu")
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dx, eager_dx) and torch.equal(db, eager_db)


@pytest.mark.interpret
def test_bias_gelu_zero_rows_give_zero_bias_grad(kernel_device):
    x = torch.empty(0, 9, device=kernel_device, requires_grad=True)
    bias = torch.randn(9, device=kernel_device, requires_grad=True)
    y = mlp.bias_gelu(x, bias)
    dx, db = torch.autograd.grad(y, (x, bias), torch.empty(0, 9, device=kernel_device))
    assert y.shape == (0, 9) and dx.shape == (0, 9)
    assert torch.equal(db, torch.zeros_like(bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_bias_gelu_llm_sizes_match_reference(seed, dtype, approximate):
    # GPT-style FFN: 2048 tokens x 4 * 2048 hidden; dbias sums 2048 rows over many chunks
    x = randn(2048, 8192, dtype=dtype, device="cuda", seed=seed, scale=2.0)
    bias = randn(8192, dtype=dtype, device="cuda", seed=seed + 1)
    _check(x, bias, approximate, seed)
