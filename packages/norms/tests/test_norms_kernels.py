"""The Triton kernels of every norm against the float64 reference, forward and backward, with
the FlashAttention tolerance rule (see _norms_checks.py).

Tiers (kernel_lab.shared.pytest_plugin): `interpret` tests run the real kernels on small
shapes (CPU under TRITON_INTERPRET=1, or CUDA), `gpu` tests run LLM-sized shapes.
"""

import sys
from pathlib import Path

import pytest
import torch

import kernel_lab.norms.ops as ops
from kernel_lab.norms import layer_norm, residual_rms_norm, rms_norm, rms_norm_gated
from kernel_lab.shared import coop, reference, runtime, testing
from kernel_lab.shared.vector_hints import vector_alignment

# nox runs pytest with --import-mode=importlib, which leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).parent))
from _norms_checks import OPS, call, check_op, make_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _forget_recipes(monkeypatch):
    """The launchers remember per shape what they launch (tiles, grids), and so do the kernels'
    direct launchers on a GPU: a test that changes the constants those follow from starts from
    an empty recipe cache and fresh launch plans."""
    monkeypatch.setattr(ops, "_RECIPES", {})
    testing.fresh_launch_plans(monkeypatch)


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink the thresholds so small rows take the long-row paths: the looped forward and the
    wide backward (the interpreter) or the cooperative ones (CUDA: `loop_block`-column chunks,
    two steps each in the forward, two programs per SM in the backward)."""

    def shrink(max_fused: int, loop_block: int) -> None:
        _forget_recipes(monkeypatch)
        monkeypatch.setattr(ops, "FWD_MAX_FUSED_COLS", max_fused)
        monkeypatch.setattr(ops, "BWD_MAX_FUSED_COLS", max_fused)
        monkeypatch.setattr(ops, "LAYER_NORM_BWD_MAX_FUSED_COLS", max_fused)
        for loop in ("RMS_LOOP", "LAYER_NORM_LOOP", "RMS_WIDE", "LAYER_NORM_WIDE"):
            monkeypatch.setattr(ops, loop, ops._Loop(loop_block, 2, 4))
        for plan in ("RMS_FWD_COOP", "LAYER_NORM_FWD_COOP"):
            monkeypatch.setattr(ops, plan, ops._Coop(loop_block, loop_block // 2, 1))
        for plan in ("RMS_BWD_COOP", "RESIDUAL_RMS_BWD_COOP", "LAYER_NORM_BWD_COOP"):
            monkeypatch.setattr(ops, plan, ops._CoopBwd(max_fused, loop_block, 1, (2, 2)))

    return shrink


# --- launch plans (host arithmetic, no kernel) ------------------------------------------------


@pytest.mark.parametrize("plan", ["RMS_BWD_COOP", "RESIDUAL_RMS_BWD_COOP", "LAYER_NORM_BWD_COOP"])
@pytest.mark.parametrize("element_size", [2, 4])
def test_cooperative_backward_grid_fits_the_gpu(plan, element_size, monkeypatch):
    """The cooperative backward's grid on a 132-SM GPU (an H100's count; no GPU needed): every
    row in exactly one group, no group without rows, never more programs than the plan's
    programs per SM fill, never more chunks a row than SMs (kernel_lab.shared.coop), and no
    cooperative launch at all for rows its one-tile kernel takes or under the interpreter."""
    monkeypatch.setattr(ops.runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(ops.runtime, "interpret_mode", lambda: False)
    c = getattr(ops, plan)
    cuda = torch.device("cuda", 0)
    for n_rows in (1, 5, 37, 1000, 1024, 4097):
        for n_cols in (c.above_cols + 1, 50001, 65536, 131072, 132 * c.chunk, 132 * c.chunk + 1):
            n_splits, n_groups, rows_per_group = ops._bwd_coop_groups(n_rows, n_cols, element_size, cuda, c)
            if n_cols > 132 * c.chunk:
                assert n_splits == 0, (n_rows, n_cols)
                continue
            assert n_splits == runtime.cdiv(n_cols, c.chunk), (n_rows, n_cols)
            assert (n_groups - 1) * rows_per_group < n_rows <= n_groups * rows_per_group, (n_rows, n_cols)
            assert n_groups * n_splits <= max(132 * c.programs_per_sm[element_size == 4], n_splits)
    assert ops._bwd_coop_groups(1024, c.above_cols, element_size, cuda, c)[0] == 0
    assert ops._bwd_coop_groups(1024, 65536, element_size, torch.device("cpu"), c)[0] == 0
    monkeypatch.setattr(ops.runtime, "interpret_mode", lambda: True)
    assert ops._bwd_coop_groups(1024, 65536, element_size, cuda, c)[0] == 0


def test_layer_norm_backward_takes_the_cooperative_kernel_for_sparse_rows(monkeypatch):
    """LayerNorm's backward on CUDA (a 132-SM GPU, no GPU needed): 16-bit rows of 4097-8192
    columns that fill at most 75% of their power-of-two block (4608, 5120, 6144) are cooperative,
    fuller ones (7168, 8192) and rows of at most 4096 columns one tile; float32 rows keep the
    one-tile kernel up to 8192 columns. Two rows a program only at exactly 4096 columns."""
    monkeypatch.setattr(ops.runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(ops.runtime, "interpret_mode", lambda: False)
    cuda = torch.device("cuda", 0)

    def cooperative(n_cols, element_size):
        c = ops._layer_norm_bwd_coop_plan(n_cols, element_size)
        return ops._bwd_coop_groups(4096, n_cols, element_size, cuda, c)[0] > 0

    assert [n for n in (2560, 4096, 4097, 4608, 5120, 6144, 6145, 7168, 8192, 8193, 12288)
            if cooperative(n, 2)] == [4097, 4608, 5120, 6144, 8193, 12288]
    assert [n for n in (4608, 6144, 8192, 8193) if cooperative(n, 4)] == [8193]

    def rows_per_program(n_cols):
        t = ops._bwd_tile(4096, n_cols, ops.LAYER_NORM_BWD_MAX_FUSED_COLS, ops.LAYER_NORM_WIDE, ops.LAYER_NORM_BWD,
                          ops._layer_norm_bwd_tile_elements(n_cols))
        return t.block_m

    assert [rows_per_program(n) for n in (2560, 3072, 4000, 4096)] == [1, 1, 1, 2]


# --- interpret tier ------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (2, 3, 130)])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32, "none"])
def test_rms_norm_one_tile_matches_reference(dtype, shape, weight_dtype, kernel_device, seed):
    inputs = make_inputs("rms_norm", shape, dtype, kernel_device, seed,
                         weight_dtype="same" if weight_dtype == "none" else weight_dtype,
                         affine=weight_dtype != "none")
    check_op("rms_norm", inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("offset", [1.0, -0.25])
def test_rms_norm_offset_matches_reference(offset, kernel_device, seed):
    inputs = make_inputs("rms_norm", (5, 48), torch.bfloat16, kernel_device, seed)
    check_op("rms_norm", inputs, offset=offset, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 130)])
@pytest.mark.parametrize("use_u", [True, False])
def test_residual_rms_norm_matches_reference(dtype, shape, use_u, kernel_device, seed):
    inputs = make_inputs("residual_rms_norm", shape, dtype, kernel_device, seed)
    check_op("residual_rms_norm", inputs, seed=seed, use_u=use_u, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 130)])
def test_rms_norm_gated_matches_reference(dtype, shape, kernel_device, seed):
    inputs = make_inputs("rms_norm_gated", shape, dtype, kernel_device, seed)
    check_op("rms_norm_gated", inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op", ["residual_rms_norm", "rms_norm_gated"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (7, 37)])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_rms_variants_without_weight_and_at_width_one(op, shape, affine, kernel_device, seed):
    """The residual and gated variants with weight=None (no affine) and at hidden size 1, forward
    and backward (rms_norm and layer_norm have their own cases above)."""
    inputs = make_inputs(op, shape, torch.float32, kernel_device, seed, affine=affine)
    check_op(op, inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op, shape", [("rms_norm_gated", (3, 4100)), ("rms_norm", (3, 8200))])
def test_rms_norm_forward_tiles_past_the_heuristic_match_reference(op, shape, kernel_device, seed):
    """The tiles chosen over the row-tile heuristic's (ops._rms_fwd_one_tile): the gated
    forward's two-row programs, here with a masked second row in the last program, and the plain
    forward's 64 values a thread, here with a masked column tail."""
    inputs = make_inputs(op, shape, torch.float32, kernel_device, seed)
    check_op(op, inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (2, 3, 130)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_reference(dtype, shape, affine, kernel_device, seed):
    inputs = make_inputs("layer_norm", shape, dtype, kernel_device, seed, affine=affine, shift=1.5)
    check_op("layer_norm", inputs, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("present", ["weight", "bias"])
@pytest.mark.parametrize("long_rows", [False, True])
def test_layer_norm_with_one_affine_parameter(present, long_rows, small_blocks, kernel_device, seed):
    """The backward kernels write one slab of partial sums per parameter present: with only the
    bias, its slab is the first (one-tile kernel, and long rows: the wide kernel under the
    interpreter, the cooperative one on CUDA)."""
    if long_rows:
        small_blocks(64, 32)
    inputs = make_inputs("layer_norm", (9, 100), torch.float32, kernel_device, seed, shift=1.0)
    inputs["bias" if present == "weight" else "weight"] = None
    check_op("layer_norm", inputs, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_parameter_gradients_in_one_or_two_sums(bias_dtype, monkeypatch, kernel_device, seed):
    """An eager backward adds dweight's and dbias' partial sums up in one launch when the two
    share a dtype (rows of one (2, hidden) result), in two when they do not (float32 weight,
    bfloat16 bias): both against the float64 reference."""
    launches = []
    real = ops.partial_sums.sum_partials

    def counted(partials, *args, **kwargs):
        launches.append(partials.shape)
        return real(partials, *args, **kwargs)

    monkeypatch.setattr(ops.partial_sums, "sum_partials", counted)
    inputs = make_inputs("layer_norm", (7, 70), torch.bfloat16, kernel_device, seed, weight_dtype=torch.float32,
                         shift=1.0)
    inputs["bias"] = inputs["bias"].to(bias_dtype)
    check_op("layer_norm", inputs, eps=1e-5, seed=seed, backend="triton")
    if bias_dtype == torch.float32:  # as the weight: both slabs (2, programs, 70) in one sum
        assert len(launches) == 1 and len(launches[0]) == 3 and launches[0][0] == 2, launches
    else:
        assert len(launches) == 2 and all(len(shape) == 2 for shape in launches), launches


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_cols, long_rows", [(40, False), (200, True)])
def test_rows_of_a_multiple_of_8_columns_match_reference(op, n_cols, long_rows, small_blocks, kernel_device, seed):
    """bf16 rows whose length and stride are multiples of 8 but not of 16: the launchers pass
    ALIGN=8 (ops._row_alignment) and every kernel rewrites the length and strides with that
    factor (kernel_lab.shared.vector_hints). One tile, and long rows (the looped forward and the
    wide backward here, the cooperative kernels on CUDA); rows 8 columns apart in NaN padding."""
    if long_rows:
        small_blocks(64, 32)
    inputs = make_inputs(op, (9, n_cols), torch.bfloat16, kernel_device, seed, shift=2.0 if op == "layer_norm" else 0.0)
    for k in ("x", "residual", "gate"):
        if k in inputs:
            inputs[k] = testing.strided_rows(inputs[k], pad=8)
    assert ops._row_alignment(n_cols, (n_cols + 8,), inputs["x"]) == 8
    check_op(op, inputs, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows, n_cols", [(9, 300), (3, 65)])
def test_long_row_paths_match_reference(op, n_rows, n_cols, small_blocks, kernel_device, seed):
    # rows longer than 64 columns loop in 32-column steps (masked tails included) in the forward
    # and take the wide two-phase backward (the cooperative one on CUDA, but for the gated
    # RMSNorm); 9 rows over 4 stand-in SMs x 4 programs leave some
    # programs without rows
    small_blocks(64, 32)
    assert ops._fwd_tile(n_rows, n_cols, ops.RMS_LOOP).one_tile is False
    inputs = make_inputs(op, (n_rows, n_cols), torch.bfloat16, kernel_device, seed, weight_dtype=torch.float32,
                         shift=3.0 if op == "layer_norm" else 0.0)
    check_op(op, inputs, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op", ["rms_norm", "residual_rms_norm", "layer_norm"])
def test_cooperative_backward_kernels_walk_their_rows(op, kernel_device, seed):
    """The cooperative backward kernels, launched directly with one chunk a row, so that they run
    under the interpreter too (which runs programs one after another: a wait on another chunk
    would never end there; the GPU tier covers rows of many chunks). What this checks: a group
    walks its block of rows, the last group shorter (11 rows over 4 groups of 3), dweight (and
    dbias) add up across a group's rows into its row of partial sums, a chunk wider than the row
    (100 of 128 columns) masks its tail, LayerNorm's prefetched next row is the one it then
    uses, and a row whose gradient is exactly 0 publishes a non-zero word (else its wait would
    never end)."""
    n_rows, n_cols, chunk, rows_per_group = 11, 100, 128, 3
    n_groups = runtime.cdiv(n_rows, rows_per_group)
    make = lambda *shape, k: testing.randn(*shape, device=kernel_device, seed=seed + k)
    x, dy, du, w, b = make(n_rows, n_cols, k=0), make(n_rows, n_cols, k=1), make(n_rows, n_cols, k=2), \
        make(n_cols, k=3), make(n_cols, k=4)
    dy[4] = 0
    dx = torch.empty_like(x)
    work = coop.workspace(n_rows, 1, x.device)  # (scratch, region to clear, its length)
    align = vector_alignment(x.element_size(), n_cols)  # as the launchers compute it
    if op == "layer_norm":
        mean, rstd = (t.float().contiguous() for t in reference.layer_norm_stats(x, 1e-5))
        partial = torch.empty(2, n_groups, n_cols, device=kernel_device)
        ops._layer_norm_bwd_coop_kernel[(n_groups,)](
            dy, x, w, mean, rstd, dx, partial, n_rows, n_cols, rows_per_group, n_cols, n_cols, n_cols, *work, 1,
            HAS_WEIGHT=True, HAS_BIAS=True, CHUNK=chunk, SPLITS_POW2=1, ALIGN=align, num_warps=1)
        got = {"dx": dx, "dw": partial[0].sum(0), "db": partial[1].sum(0)}
        expected = dict(zip(("dx", "dw", "db"), reference.layer_norm_backward(dy, x, w, b, 1e-5), strict=True))
        same_precision = reference.layer_norm_backward(dy, x, w, b, 1e-5, compute_dtype=torch.float32)
    else:
        du_or_dx = du if op == "residual_rms_norm" else dx
        rstd = reference.rms_norm_rstd(x, 1e-6).float().contiguous()
        partial = torch.empty(n_groups, n_cols, device=kernel_device)
        ops._rms_norm_bwd_coop_kernel[(n_groups,)](
            dy, x, x, w, rstd, du_or_dx, dx, dx, partial, n_rows, n_cols, 0.0, rows_per_group,
            n_cols, n_cols, n_cols, n_cols, n_cols, n_cols, *work, 1,
            HAS_WEIGHT=True, HAS_GATE=False, HAS_DU=op == "residual_rms_norm", CHUNK=chunk, SPLITS_POW2=1,
            ALIGN=align, num_warps=1)
        got = {"dx": dx, "dw": partial.sum(0)}
        ref_dx, ref_dw = reference.rms_norm_backward(dy, x, w, 1e-6)
        base_dx, base_dw = reference.rms_norm_backward(dy, x, w, 1e-6, compute_dtype=torch.float32)
        if op == "residual_rms_norm":
            ref_dx, base_dx = ref_dx + du.double(), base_dx + du
        expected, same_precision = {"dx": ref_dx, "dw": ref_dw}, (base_dx, base_dw)
    for (name, out), base in zip(got.items(), same_precision, strict=True):
        testing.assert_close_to_reference(out, expected[name], base, factor=3.0, name=f"{op} {name}")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_persistent_backward_walks_several_row_blocks(op, monkeypatch, kernel_device, seed):
    """Each program of the one-tile backward strides over row blocks and accumulates dweight
    across them; LayerNorm's prefetches the next block, masked past the last row. 2-row blocks,
    one 1-warp program per SM: 9 blocks a program, the last block half full."""
    for plan in ("RMS_BWD", "RESIDUAL_RMS_BWD", "GATED_RMS_BWD", "LAYER_NORM_BWD"):
        monkeypatch.setattr(ops, plan, ops._BwdPlan(32, 128, 1))
    _forget_recipes(monkeypatch)
    sms = runtime.sm_count(torch.device(kernel_device))
    n_rows = 18 * sms - 1
    t = ops._bwd_tile(n_rows, 40, ops.BWD_MAX_FUSED_COLS, ops.RMS_WIDE, ops.RMS_BWD)
    assert (t.one_tile, t.block_m, t.num_warps) == (True, 2, 1)
    assert ops._bwd_programs(t, n_rows, torch.device(kernel_device), ops.RMS_WIDE, ops.RMS_BWD)[0] == sms
    inputs = make_inputs(op, (n_rows, 40), torch.float32, kernel_device, seed, shift=1.0 if op == "layer_norm" else 0.0)
    check_op(op, inputs, eps=1e-5, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("n_cols, reread", [(100, True), (33, True), (32, False)])
def test_layer_norm_backward_rereading_tiles_matches_reference(affine, n_cols, reread, monkeypatch, kernel_device,
                                                                seed):
    """Rows past ops.LAYER_NORM_BWD_PREFETCH_MAX_COLS take, where the cooperative backward does not
    run, the one-tile LayerNorm backward that
    touches each tile twice (REREAD). Shrunk here to 32 columns: 33 and 100 columns (masked tails
    of 64- and 128-column tiles, two rows and one a program) reread, 32 prefetch; one 1-warp
    program per stand-in SM strides over several row blocks."""
    monkeypatch.setattr(ops, "LAYER_NORM_BWD_PREFETCH_MAX_COLS", 32)
    monkeypatch.setattr(ops, "LAYER_NORM_BWD_REREAD", ops._BwdPlan(128, 128, 1))
    # (on CUDA the cooperative kernel would take these rows: kept to the one-tile kernel here)
    monkeypatch.setattr(ops, "LAYER_NORM_BWD_COOP", ops._CoopBwd(1 << 30, 2048, 2, (4, 4)))
    _forget_recipes(monkeypatch)
    sms = runtime.sm_count(torch.device(kernel_device))
    inputs = make_inputs("layer_norm", (3 * sms + 1, n_cols), torch.float32, kernel_device, seed, shift=1.5)
    if affine in ("bias", "none"):
        inputs["weight"] = None
    if affine in ("weight", "none"):
        inputs["bias"] = None
    check_op("layer_norm", inputs, eps=1e-5, seed=seed, backend="triton")
    # what the launcher built for the backward (the interpreter's launches are plain kernels)
    ((launch, *_),) = [recipe for key, recipe in ops._RECIPES.items() if key[0] == "layer_norm_bwd"]
    assert launch.keywords["REREAD"] is reread


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_recipes_are_reused_across_calls(op, monkeypatch, kernel_device, seed):
    """One shape called with other eps, offsets and values: each launcher works its launch out
    once and passes eps and offset per call, and every call is still right. Strided rows (NaN
    padding: a read with the wrong stride shows) are another key, with recipes of their own."""
    _forget_recipes(monkeypatch)
    family = "layer_norm" if op == "layer_norm" else "rms_norm"
    shift = 1.5 if op == "layer_norm" else 0.0
    first = None
    for i, (eps, offset) in enumerate(((1e-6, 0.0), (1e-2, 1.0), (1e-5, -0.5))):
        inputs = make_inputs(op, (5, 48), torch.float32, kernel_device, seed + i, shift=shift)
        check_op(op, inputs, eps=eps, offset=offset, seed=seed + i, backend="triton")
        if first is None:
            first = dict(ops._RECIPES)
            assert sorted(key[0] for key in first) == [f"{family}_bwd", f"{family}_fwd"]
        # the same recipe objects: looked up, not worked out again
        assert ops._RECIPES.keys() == first.keys()
        assert all(ops._RECIPES[key] is recipe for key, recipe in first.items())
    inputs = make_inputs(op, (5, 48), torch.float32, kernel_device, seed, shift=shift)
    inputs["x"] = testing.strided_rows(inputs["x"], pad=11)
    check_op(op, inputs, seed=seed, backend="triton")
    # residual_rms_norm's backward reads u, fresh and contiguous however x is laid out
    assert len(ops._RECIPES) == (3 if op == "residual_rms_norm" else 4)


@pytest.mark.interpret
@pytest.mark.parametrize("long_rows", [False, True])
def test_layer_norm_variance_is_stable_for_large_mean(long_rows, small_blocks, kernel_device, seed):
    """|mean| = 1e4 with std 1: E[x^2] - E[x]^2 in float32 would lose every digit of the variance."""
    if long_rows:
        small_blocks(64, 32)
    x = testing.randn(6, 200, device=kernel_device, seed=seed) + 1e4
    y = layer_norm(x, None, None, 1e-5, backend="triton")
    testing.assert_close_to_reference(y, reference.layer_norm(x, None, None, 1e-5), atol=1e-2, name="layer_norm")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_strided_rows_are_read_in_place(op, kernel_device, seed):
    inputs = make_inputs(op, (6, 45), torch.float16, kernel_device, seed)
    for k in ("x", "residual", "gate"):
        if k in inputs:
            inputs[k] = testing.strided_rows(inputs[k], pad=11)  # NaN padding: a read past a row shows
    assert runtime.rows_view(inputs["x"]).data_ptr() == inputs["x"].data_ptr()  # what the launchers read: no copy
    check_op(op, inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_strided_parameters_are_read_right(op, kernel_device, seed):
    """The kernels read weight and bias at w_ptr + column: a strided view (every other value of a
    longer tensor) must be read with its stride, and get its gradient."""
    inputs = make_inputs(op, (6, 45), torch.float32, kernel_device, seed, shift=1.0 if op == "layer_norm" else 0.0)
    for k in ("weight", "bias"):
        if k in inputs:
            inputs[k] = torch.stack([inputs[k], torch.full_like(inputs[k], float("nan"))], dim=1)[:, 0]
            assert inputs[k].stride() == (2,)
    check_op(op, inputs, seed=seed, backend="triton")


@pytest.mark.interpret
def test_transposed_input_is_copied_and_correct(kernel_device, seed):
    inputs = make_inputs("rms_norm", (20, 33), torch.float32, kernel_device, seed)
    inputs["x"] = testing.transposed_copy(inputs["x"])
    check_op("rms_norm", inputs, seed=seed, backend="triton")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 8)])
def test_zero_size_inputs(op, shape, kernel_device, seed):
    inputs = make_inputs(op, shape, torch.float32, kernel_device, seed)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if v is not None}
    fn = {"rms_norm": lambda: (rms_norm(leaves["x"], leaves["weight"]),),
          "residual_rms_norm": lambda: residual_rms_norm(leaves["x"], leaves["residual"], leaves["weight"]),
          "rms_norm_gated": lambda: (rms_norm_gated(leaves["x"], leaves["gate"], leaves["weight"]),),
          "layer_norm": lambda: (layer_norm(leaves["x"], leaves["weight"], leaves["bias"]),)}[op]
    outs = fn()
    assert all(o.shape == inputs["x"].shape for o in outs)
    sum(o.sum() for o in outs).backward()
    assert torch.equal(leaves["weight"].grad, torch.zeros_like(leaves["weight"]))
    assert leaves["x"].grad.shape == inputs["x"].shape


# --- gpu tier -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows, n_cols",
                         [(4096, 4096), (2048, 3584), (1024, 8192), (999, 8192), (520, 16384), (96, 65536)])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_llm_sizes_match_reference(op, n_rows, n_cols, weight_dtype, seed):
    inputs = make_inputs(op, (n_rows, n_cols), torch.bfloat16, "cuda", seed, weight_dtype=weight_dtype,
                         shift=2.0 if op == "layer_norm" else 0.0)
    check_op(op, inputs, eps=1e-5, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows, n_cols, dtype",
                         [(1000, 5120, torch.bfloat16), (37, 4609, torch.float16), (300, 6144, torch.bfloat16)])
def test_layer_norm_backward_of_sparse_rows_matches_reference(n_rows, n_cols, dtype, seed):
    """LayerNorm rows of 4097-6144 columns (at most 75% of their 8192 block) take the cooperative
    backward on CUDA: an odd length, strided rows in NaN padding, a row of zero gradients."""
    cuda = torch.device("cuda")
    c = ops._layer_norm_bwd_coop_plan(n_cols, dtype.itemsize)
    assert ops._bwd_coop_groups(n_rows, n_cols, dtype.itemsize, cuda, c)[0] == runtime.cdiv(n_cols, c.chunk)
    inputs = make_inputs("layer_norm", (n_rows, n_cols), dtype, "cuda", seed, shift=2.0)
    inputs["x"] = testing.strided_rows(inputs["x"], pad=7)
    grad_mask = torch.ones(n_rows, 1, dtype=dtype, device="cuda")
    grad_mask[3] = 0
    check_op("layer_norm", inputs, eps=1e-5, seed=seed, grad_mask=grad_mask)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows, n_cols", [(300, 4100), (64, 17000), (8, 65544)])
def test_rows_of_a_multiple_of_8_columns_read_in_vectors_match_reference(op, n_rows, n_cols, seed):
    """bf16 rows whose length and stride are multiples of 8 but not of 16, read 16 bytes at a time
    (ALIGN=8): one tile, and the cooperative forward and backward; rows 8 columns apart in NaN
    padding, so that a vector reaching past a row shows."""
    inputs = make_inputs(op, (n_rows, n_cols), torch.bfloat16, "cuda", seed, shift=2.0 if op == "layer_norm" else 0.0)
    for k in ("x", "residual", "gate"):
        if k in inputs:
            inputs[k] = testing.strided_rows(inputs[k], pad=8)
    check_op(op, inputs, eps=1e-5, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_cooperative_forward_matches_reference(op, seed):
    """Rows past 16384 columns run the cooperative forward on CUDA: chunks across programs that
    exchange their statistics (kernel_lab.shared.coop). An odd length (a short last chunk), far
    more programs than fit the GPU at once (1000 rows x 7 chunks of 8192), strided rows, and
    whole chunks of zeros in every row (LayerNorm's chunk then publishes mean 0, m2 0)."""
    n_rows, n_cols = 1000, 50001
    for c in (ops.RMS_FWD_COOP, ops.LAYER_NORM_FWD_COOP):
        assert ops._fwd_coop_splits(n_cols, torch.device("cuda"), c) == runtime.cdiv(n_cols, c.chunk) > 1
    inputs = make_inputs(op, (n_rows, n_cols), torch.bfloat16, "cuda", seed, weight_dtype=torch.float32)
    inputs["x"][:, 16384:32768] = 0
    padded = torch.full((n_rows, n_cols + 7), float("nan"), dtype=torch.bfloat16, device="cuda")
    padded[:, :n_cols] = inputs["x"]
    inputs["x"] = padded[:, :n_cols]  # NaN padding: a read past the row would show
    check_op(op, inputs, eps=1e-5, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op, affine", [("rms_norm", "weight"), ("rms_norm", "none"), ("residual_rms_norm", "weight"),
                                        ("layer_norm", "both"), ("layer_norm", "bias"), ("layer_norm", "none")])
@pytest.mark.parametrize("n_rows, n_cols, dtype",
                         [(1000, 50001, torch.bfloat16), (37, 16385, torch.float32), (5, 131072, torch.float16)])
def test_cooperative_backward_matches_reference(op, affine, n_rows, n_cols, dtype, seed):
    """Rows past the one-tile backwards' reach (RMSNorm: 16384 columns, LayerNorm: 8192) run the
    cooperative backward on CUDA: groups of programs, one per chunk of a row, exchanging each
    row's dot terms (kernel_lab.shared.coop), each group walking a block of rows. Odd lengths (a
    short last chunk), more rows than groups with a short last group (1000 rows), fewer rows
    than the groups the GPU could hold (5 and 37), float32 and float16, strided rows (NaN
    padding), with and without the affine parameters (no partial sums written), and gradients
    of exactly 0: whole rows and a whole chunk of every row, so that chunks publish sums of +0.0
    (LayerNorm's sum(g) travels as -0.0 to keep its word non-zero; a zero word would read as not
    yet published, and the row would wait forever). The widest rows are cut to what the GPU's
    SM count allows (at most one chunk a row per SM). (The gated RMSNorm keeps the wide kernel:
    the tests of long rows above cover it.)"""
    c = {"rms_norm": ops.RMS_BWD_COOP, "residual_rms_norm": ops.RESIDUAL_RMS_BWD_COOP,
         "layer_norm": ops.LAYER_NORM_BWD_COOP}[op]
    cuda = torch.device("cuda")
    n_cols = min(n_cols, coop.max_chunks(cuda) * c.chunk - 3)
    n_splits, n_groups, rows_per_group = ops._bwd_coop_groups(n_rows, n_cols, dtype.itemsize, cuda, c)
    assert n_splits == runtime.cdiv(n_cols, c.chunk) > 1 and n_groups == runtime.cdiv(n_rows, rows_per_group)
    inputs = make_inputs(op, (n_rows, n_cols), dtype, "cuda", seed, weight_dtype=torch.float32,
                         shift=2.0 if op == "layer_norm" else 0.0)
    if affine in ("none", "bias"):
        inputs["weight"] = None
    if affine in ("none", "weight") and "bias" in inputs:
        inputs["bias"] = None
    padded = torch.full((n_rows, n_cols + 7), float("nan"), dtype=dtype, device="cuda")
    padded[:, :n_cols] = inputs["x"]
    inputs["x"] = padded[:, :n_cols]
    grad_mask = torch.ones(n_rows, n_cols, dtype=dtype, device="cuda")
    grad_mask[::3] = 0
    grad_mask[:, c.chunk:2 * c.chunk] = 0
    check_op(op, inputs, eps=1e-5, seed=seed, grad_mask=grad_mask)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_float32_wide_rows_match_reference(op, seed):
    """float32 at 16384 columns: the widest rows the one-tile kernels hold in registers, in the
    widest dtype (the LLM-size test above is bfloat16)."""
    inputs = make_inputs(op, (130, 16384), torch.float32, "cuda", seed)
    check_op(op, inputs, eps=1e-5, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_float16_llm_size_with_leading_dims(op, seed):
    inputs = make_inputs(op, (2, 1000, 5120), torch.float16, "cuda", seed)
    check_op(op, inputs, eps=1e-5, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_torch_compile_fullgraph_inductor(op, dynamic, seed):
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: _call(op, kw), fullgraph=True, dynamic=dynamic)
    # new row counts, then new hidden sizes (the last one past 16384 columns: the cooperative
    # forward and backward, workspace allocated inside the traced op); outputs and gradients of
    # the compiled graph against the reference, as for the eager op
    for i, shape in enumerate([(300, 4096), (77, 4096), (129, 1000), (40, 20000)]):
        inputs = make_inputs(op, shape, torch.bfloat16, "cuda", seed + i)
        check_op(op, inputs, seed=seed + i,
                 fn=lambda _op, ins, _eps, _offset: compiled(**{k: v for k, v in ins.items() if v is not None}))


def _call(op, kw):
    full = dict.fromkeys(("residual", "gate", "weight", "bias")) | kw
    return call(op, full, 1e-6, 0.0)


@pytest.mark.gpu
def test_rows_beyond_int32_offsets(seed):
    """More than 2**31 elements: row offsets must be computed in 64 bits."""
    n_cols = 4096
    n_rows = (2**31) // n_cols + 64
    x = torch.empty(n_rows, n_cols, dtype=torch.bfloat16, device="cuda")
    x[-64:] = testing.randn(64, n_cols, dtype=torch.bfloat16, device="cuda", seed=seed)
    x[:-64] = 1.0
    w = testing.randn(n_cols, dtype=torch.bfloat16, device="cuda", seed=seed + 1).requires_grad_(True)
    xl = x.requires_grad_(True)
    y = rms_norm(xl, w)
    tail = reference.rms_norm(x.detach()[-64:], w.detach())
    testing.assert_close_to_reference(y[-64:], tail, baseline=None, atol=2e-2 * float(tail.abs().max()))
    dy = torch.zeros_like(y)
    dy[-64:] = 1.0
    (dx,) = torch.autograd.grad(y, xl, dy)
    ref_dx, _ = reference.rms_norm_backward(dy[-64:], x.detach()[-64:], w.detach())
    testing.assert_close_to_reference(dx[-64:], ref_dx, atol=2e-2 * float(ref_dx.abs().max()))
