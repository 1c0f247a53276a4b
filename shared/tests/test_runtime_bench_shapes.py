"""runtime, bench and shapes: what can be checked without a GPU, plus the gpu tier."""

import pytest
import torch

from kernel_lab.shared import bench, runtime, shapes


def test_backend_on_cpu_follows_the_interpreter_flag(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.backend(x) == ("triton-interpret" if runtime.triton_available() else "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert runtime.backend(x) == "reference"


def test_check_backend_names_the_op_and_the_bad_choice(monkeypatch):
    x = torch.zeros(1)
    runtime.check_backend("op", None, x)
    runtime.check_backend("op", "reference", x)
    with pytest.raises(ValueError, match="op: backend must be None, 'triton' or 'reference', got 'cuda'"):
        runtime.check_backend("op", "cuda", x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"op: backend='triton' needs a CUDA tensor.*; q is on cpu"):
        runtime.check_backend("op", "triton", x, "q")


def test_versions_name_torch_and_python():
    v = runtime.versions()
    assert v["torch"] == torch.__version__ and "python" in v


def test_byte_and_flop_models():
    a = torch.empty(10, 4, dtype=torch.bfloat16)
    assert bench.bytes_of(a, None, a) == 2 * 10 * 4 * 2
    assert bench.matmul_flops(2, 3, 4) == 48
    assert bench.attention_flops(1, 2, 8, 8, 4, causal=True) == 4 * 2 * 8 * 8 * 4 / 2
    # bottom-right causal with Tq != Tk: a decode step keeps every key; Tq = 3 of Tk = 5 keeps 3 + 4 + 5
    assert bench.attention_flops(1, 1, 1, 1024, 4, causal=True) == 4 * 1024 * 4
    assert bench.attention_flops(1, 1, 3, 5, 4, causal=True) == 4 * (3 + 4 + 5) * 4
    assert bench.attention_flops(1, 1, 5, 3, 4, causal=True) == 4 * (1 + 2 + 3) * 4


def test_add_speedups_and_table():
    def row(group, impl, role, median):
        return {"group": group, "name": impl, "stats": {"median": median},
                "extra_info": {"impl": impl, "role": role}}

    rows = [row("g", "torch", "baseline", 2.0), row("g", "compile", "peer", 1.0),
            row("g", "ours", "kernel_lab", 0.5)]
    bench.add_speedups(rows)
    assert rows[2]["extra_info"]["speedup"] == 4.0
    assert rows[2]["extra_info"]["vs_best_peer"] == 2.0
    assert "geomean speedup over baseline 4.00x" in bench.format_table(rows)


def test_speedups_are_per_call_when_rows_replay_several_calls():
    """A row timing a CUDA graph of 10 calls (10 ms a replay) against one timing single calls
    (2 ms each): 1 ms against 2 ms per call, so 2x, not 0.2x."""
    rows = [
        {"group": "g", "name": "torch", "stats": {"median": 2e-3}, "extra_info": {"impl": "torch", "role": "baseline"}},
        {"group": "g", "name": "ours", "stats": {"median": 10e-3},
         "extra_info": {"impl": "ours", "role": "kernel_lab", "calls_per_round": 10}},
    ]
    bench.add_speedups(rows)
    assert rows[1]["extra_info"]["speedup"] == pytest.approx(2.0)
    assert bench.per_call(rows[1]) == pytest.approx(1e-3)
    assert "   1.0000 " in bench.format_table(rows)  # ms per call in the table


def test_max_error_is_the_largest_difference_and_nan_on_a_nonfinite_mismatch():
    ref = torch.tensor([[1.0, -2.0], [3.0, float("inf")]], dtype=torch.float64)
    out = torch.tensor([[1.5, -2.0], [2.0, float("inf")]], dtype=torch.bfloat16)
    assert bench.max_error(out, ref) == 1.0
    out[0, 0] = float("nan")
    assert bench.max_error(out, ref) != bench.max_error(out, ref)  # NaN


def test_shape_presets():
    m = shapes.model("llama-3-8b")
    assert (m.hidden_size, m.intermediate_size, m.gqa_ratio, m.head_dim) == (4096, 14336, 4, 128)
    assert m.num_heads * m.head_dim == m.hidden_size
    with pytest.raises(KeyError, match="known"):
        shapes.model("gpt-5")


@pytest.mark.gpu
def test_device_facts_and_measured_peaks_are_plausible():
    info = runtime.device_info()
    assert info.sm_count > 0 and info.l2_bytes > 0 and info.capability >= (7, 0)
    bw = runtime.measured_copy_bandwidth()
    assert 1e11 < bw < 2e13, bw
    assert runtime.measured_matmul_flops() > 1e13
    assert runtime.backend(torch.zeros(1, device="cuda")) == "triton"
    assert runtime.sm_count(torch.device("cuda")) == info.sm_count


def test_host_cdiv_and_next_power_of_2_match_triton():
    triton = pytest.importorskip("triton")
    for n in [0, 1, 2, 3, 4, 5, 127, 128, 129, 65535, 65536, 65537, (1 << 31) + 1]:
        assert runtime.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in [1, 2, 3, 64, 8192]:
            assert runtime.cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("n", [2, 3, 300, 512, 513, 4099])
def test_next_power_of_2_of_a_symbolic_size_guards_its_bucket_not_its_value(n):
    """Under torch.compile with dynamic shapes the launchers see torch.SymInt sizes. The power of
    two must come out right, and the guards it leaves must hold for every size of the same
    bucket, so that a new token count there reuses the compiled graph (no recompile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    size = mode.from_tensor(torch.empty(n), symbolic_context=dynamic).shape[0]
    assert isinstance(size, torch.SymInt)
    bucket = runtime.next_power_of_2(n)
    assert runtime.next_power_of_2(size) == bucket

    def guards_hold(m: int) -> bool:  # (the only symbol in the guards is the size's)
        return all(bool(g.expr.subs(dict.fromkeys(g.expr.free_symbols, m))) for g in env.guards)

    assert all(guards_hold(m) for m in range(bucket // 2 + 1, bucket + 1))
    assert not guards_hold(bucket + 1)
    # (sizes 0 and 1 always get graphs of their own: a symbolic size is known to be >= 2)
    assert bucket // 2 < 2 or not guards_hold(bucket // 2)


def test_sm_count_off_cuda_is_the_interpreter_stand_in():
    assert runtime.sm_count(torch.device("cpu")) == runtime.INTERPRET_SM_COUNT > 1


@pytest.mark.parametrize(
    "n_rows, n_cols, tile, cap, expected",
    [
        (1000, 100, 4096, None, (32, 128, 8)),  # short rows batched up to the tile
        (3, 100, 4096, None, (4, 128, 4)),  # no more rows than there are (next power of two)
        (1000, 5000, 4096, None, (1, 8192, 16)),  # a row longer than the tile: one per program
        (1000, 5000, 4096, 1024, (4, 1024, 8)),  # capped columns: the kernel loops over the row
        (1, 1, 2048, None, (1, 1, 4)),  # at least 4 warps
        (1 << 20, 16384, 16384, None, (1, 16384, 32)),  # at most 32 warps
    ],
)
def test_row_tile(n_rows, n_cols, tile, cap, expected):
    assert runtime.row_tile(n_rows, n_cols, tile, cap) == expected


def test_rows_view_is_a_view_when_the_layout_allows_and_a_copy_otherwise():
    padded = torch.randn(6, 10)[:, :7]  # rows of 7 with row stride 10
    rows = runtime.rows_view(padded.view(2, 3, 7))
    assert rows.shape == (6, 7) and rows.data_ptr() == padded.data_ptr() and rows.stride() == (10, 1)
    packed = torch.randn(2, 3, 8)
    half = runtime.rows_view(packed[..., 4:])  # the second half of a packed (..., 2 * d) tensor
    assert half.shape == (6, 4) and half.data_ptr() == packed[..., 4:].data_ptr()
    transposed = torch.randn(7, 6).t()  # column stride 6: copied to unit stride
    rows = runtime.rows_view(transposed)
    assert rows.stride(-1) == 1 and torch.equal(rows, transposed)
    assert runtime.rows_view(torch.randn(3, 0)).shape == (3, 0)  # zero columns: no -1 ambiguity
    assert runtime.rows_view(torch.randn(0, 5)).shape == (0, 5)
    one_col = torch.randn(4, 3)[:, :1]
    assert runtime.rows_view(one_col).data_ptr() == one_col.data_ptr()  # a lone column needs no unit stride


def test_forward_only_output_is_untouched_unless_an_input_requires_grad():
    x = torch.randn(4)
    out = x * 2
    assert runtime.forward_only("op", out, x, None) is out and out.grad_fn is None
    w = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        assert runtime.forward_only("op", out, x, w) is out and not out.requires_grad


def test_forward_only_backward_raises_naming_the_op():
    w = torch.randn(4, requires_grad=True)
    out = runtime.forward_only("my_op", w.detach() * 2, None, w)
    assert out.requires_grad
    out += 1  # the same tensor comes back, not a view: in-place updates stay legal
    with pytest.raises(RuntimeError, match=r"my_op is forward only \(inference\): it has no backward"):
        (out.sum() + w.sum()).backward()


def test_plan_arg_key_tells_apart_what_a_launch_specialises_on():
    base = torch.zeros(8, 64, dtype=torch.float16)
    assert runtime.plan_arg_key(None) is None
    assert runtime.plan_arg_key(base) == (64, torch.float16, base.data_ptr() % 16)
    # another row stride, dtype or 16-byte alignment: another key
    assert runtime.plan_arg_key(base[:, :32]) == runtime.plan_arg_key(base)  # same stride and address
    assert runtime.plan_arg_key(base[::2])[0] == 128
    assert runtime.plan_arg_key(base.float())[1] == torch.float32
    assert runtime.plan_arg_key(base[:, 1:])[2] == (base.data_ptr() + 2) % 16
