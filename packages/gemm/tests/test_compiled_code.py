"""The GEMM kernels compile, for Hopper (sm_90), to software-pipelined loops with 16-byte
asynchronous copies. No GPU needed: triton compiles for a target offline.

A regression guard for a measured slowdown: a K-tail mask written `k + offs_k < k_end` hid the
mask's 16-element constancy from the compiler, which then emitted 2-byte loads and no pipeline,
several times slower for both prefill and decode on Hopper. Under TRITON_INTERPRET=1 (CI) the
kernels are interpreter objects, so one test reruns this file in a subprocess with the
interpreter off (kernel_lab.shared.testing.rerun_without_interpreter); the tests skip only where
the triton wheel has no CUDA backend, and a compile failure fails them.
"""

import re

import pytest

from kernel_lab.shared import testing


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


def compile_for_sm90(fn, pointer_types, constexprs, num_warps, num_stages):
    """Like testing.compile_for_sm90, plus the launcher's 16-divisibility specialisation of the
    integer and pointer arguments, which the 16-byte loads checked here depend on (the shared
    helper passes no `attrs`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointer_types.get(name, "i32")
    # Every pointer, size and stride is specialised as a multiple of 16 (as the launcher's
    # arguments are for aligned LLM shapes), except what the kernel says it never specialises.
    skip = {p.name for p in fn.params if p.do_not_specialize} | {"eps"}
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n, t in signature.items()
        if t != "constexpr" and n not in skip
    }
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


CASES = {
    "prefill": ("_matmul_kernel", dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16",
                                       scale_a_ptr="*fp32", scale_b_ptr="*fp32"),
                dict(HAS_BIAS=False, HAS_SCALE=False, ACTIVATION="none", WRITE_PARTIAL=False, PDL=0,
                     BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, stride_ak=1, stride_bk=1, stride_cn=1), 8, 3),
    "decode": ("_matmul_kernel", dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*fp32", bias_ptr="*bf16",
                                      scale_a_ptr="*fp32", scale_b_ptr="*fp32"),
               dict(HAS_BIAS=False, HAS_SCALE=False, ACTIVATION="none", WRITE_PARTIAL=True, PDL=1, BLOCK_M=16,
                    BLOCK_N=64, BLOCK_K=256, GROUP_M=1, stride_ak=1, stride_bk=1, stride_cn=1), 4, 3),
    "int8-decode": ("_weight_only_decode_kernel", dict(x_ptr="*bf16", q_ptr="*i8", scales_ptr="*bf16",
                                                       zeros_ptr="*u8", c_ptr="*fp32", bias_ptr="*bf16"),
                    dict(BITS=8, HAS_ZEROS=False, PER_CHANNEL=True, HAS_BIAS=False, WRITE_PARTIAL=True, USE_PRMT=True,
                         SLICES=2, K_TAIL=False, MASK_M=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, GROUP_SIZE=0,
                         stride_xk=1, stride_qk=1, stride_cn=1, stride_sg=1), 2, 4),
    # (the launcher's tiles: ops.QUANT_PREFILL_TILES)
    "int8-prefill": ("_quantized_matmul_kernel", dict(x_ptr="*bf16", q_ptr="*i8", scales_ptr="*bf16",
                                                      zeros_ptr="*u8", c_ptr="*bf16", bias_ptr="*bf16"),
                     dict(BITS=8, HAS_ZEROS=False, HAS_BIAS=False, USE_PRMT=True, BLOCK_M=128, BLOCK_N=64,
                          BLOCK_K=128, GROUP_M=8, stride_xk=1, stride_qk=1, stride_cn=1, stride_sg=1), 4, 3),
    "int4-prefill": ("_quantized_matmul_kernel", dict(x_ptr="*bf16", q_ptr="*u8", scales_ptr="*bf16",
                                                      zeros_ptr="*u8", c_ptr="*bf16", bias_ptr="*bf16"),
                     dict(BITS=4, HAS_ZEROS=False, HAS_BIAS=False, USE_PRMT=True, BLOCK_M=128, BLOCK_N=128,
                          BLOCK_K=128, GROUP_M=8, stride_xk=1, stride_qk=1, stride_cn=1, stride_sg=1), 8, 3),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_loads_are_pipelined_async_copies(case):
    from kernel_lab.gemm import _kernels

    name, pointers, constexprs, num_warps, num_stages = CASES[case]
    compiled = compile_for_sm90(getattr(_kernels, name), pointers, constexprs, num_warps, num_stages)
    ptx = compiled.asm["ptx"]
    assert "async_copy_global_to_local" in compiled.asm["ttgir"], "the K loop is not software-pipelined"
    sixteen_bytes = r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], (?:16|0x10)\b"
    assert re.search(sixteen_bytes, ptx), "no 16-byte asynchronous copies"
    if name == "_matmul_kernel":  # (the quantized kernel gathers its per-column bf16 scales)
        assert not re.search(r"ld\.global(?:\.[a-z0-9]+)*\.b16", ptx), "2-byte global loads of the operands"


PDL_CASES = {  # decode kernels launched as programmatic dependent launches: (case or FLOAT_CASES name, prefetches)
    "decode": True, "_gemv_kernel": True, "_int4_gemv_kernel": True, "_rms_norm_rows_kernel": False,
}
INT4_GEMV = (dict(x_ptr="*bf16", q_ptr="*u8", scales_ptr="*bf16", zeros_ptr="*u8", c_ptr="*bf16", bias_ptr="*bf16"),
             dict(HAS_ZEROS=False, HAS_BIAS=False, USE_PRMT=True, GROUP_SIZE=128, BLOCK_N=16, ROW_BYTES=256,
                  stride_xk=1))


@pytest.mark.parametrize("case,pdl", [(c, p) for c in PDL_CASES for p in (0, 1, 2) if p < 2 or c == "decode"])
def test_pdl_launches_wait_for_the_kernel_before(case, pdl):
    """As a programmatic dependent launch (PDL 1 or 2, ops._pdl) a decode kernel prefetches
    its weight rows' first lines into L2 (the GEMMs and GEMVs), waits (griddepcontrol.wait)
    before its first global load and lets the next kernel launch: at its start (1), after its
    K loop (2, the skinny GEMM only); with 0 none of that is compiled in."""
    from kernel_lab.gemm import _kernels

    if case in CASES:
        name, pointers, constexprs, num_warps, num_stages = CASES[case]
    elif case == "_int4_gemv_kernel":
        name, (pointers, constexprs), num_warps, num_stages = case, INT4_GEMV, 4, 1
    else:
        name, (pointers, _, constexprs), num_warps, num_stages = case, FLOAT_CASES[case], 4, 1
    ptx = compile_for_sm90(getattr(_kernels, name), pointers, {**constexprs, "PDL": pdl}, num_warps,
                           num_stages).asm["ptx"]
    assert ("griddepcontrol.launch_dependents" in ptx) == bool(pdl)
    assert ("griddepcontrol.wait" in ptx) == bool(pdl)
    assert ("prefetch.global.L2" in ptx) == (bool(pdl) and PDL_CASES[case])
    if pdl:
        wait = ptx.index("griddepcontrol.wait")
        first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
        assert wait < first_load, "a global load before griddepcontrol.wait"
        # 1: the signal comes before the wait; 2: after the K loop's last asynchronous copy
        signal = ptx.index("griddepcontrol.launch_dependents")
        assert (signal < wait) if pdl == 1 else (signal > ptx.rindex("cp.async"))


def test_relu_epilogue_keeps_nan():
    """relu(NaN) is NaN, as torch.relu: the epilogue's max must be max.NaN in the PTX (a plain
    max.f32 returns 0; the interpreter's numpy max would not show the difference)."""
    from kernel_lab.gemm import _kernels

    name, pointers, constexprs, num_warps, num_stages = CASES["decode"]
    relu = {**constexprs, "ACTIVATION": "relu", "WRITE_PARTIAL": False}
    ptx = compile_for_sm90(getattr(_kernels, name), pointers, relu, num_warps, num_stages).asm["ptx"]
    assert "max.NaN.f32" in ptx
    assert "max.f32" not in ptx


@pytest.mark.parametrize("x_type", ["*bf16", "*fp16"])
@pytest.mark.parametrize("slices", [1, 4])
def test_int4_dequantization_stays_within_the_issue_budget(x_type, slices):
    """int4 decode moves half a byte per weight: at an H200's copy bandwidth (about 4.2 TB/s) that
    is 8.4e12 weights/s, or 32 per SM per cycle over 132 SMs at 1.98 GHz; with 128 lanes per SM
    about 4 instructions per weight can issue. Converting each code with I2F plus byte shuffles
    took 9.8 per weight in the K loop, the magic-number form in Triton with the nibbles joined
    into column order 5.8-5.9, the PTX form with x split into even and odd columns 3.7
    (_int4_weights, _weight_only_decode_kernel). Counted over one 128-column step of the decode
    kernel in the launcher's tile (16 weight rows, one warp a K slice, group 128)."""
    from kernel_lab.gemm import _kernels

    pointers = dict(x_ptr=x_type, q_ptr="*u8", scales_ptr=x_type, zeros_ptr="*u8", c_ptr="*fp32", bias_ptr=x_type)
    constexprs = dict(BITS=4, HAS_ZEROS=False, PER_CHANNEL=False, HAS_BIAS=False, WRITE_PARTIAL=True, USE_PRMT=True,
                      SLICES=slices, K_TAIL=False, MASK_M=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_SIZE=128,
                      stride_xk=1, stride_qk=1)
    compiled = compile_for_sm90(_kernels._weight_only_decode_kernel, pointers, constexprs, slices, 3)
    loop = [i for i in testing.sass_loop_body(compiled) if not i.startswith("NOP")]
    weights_per_thread = 16 * 128 / 32  # a warp a slice
    per_weight = len(loop) / weights_per_thread
    assert not any(i.startswith("I2F") for i in loop), "codes converted (I2F)"
    assert per_weight <= 4.5, f"{per_weight:.1f} SASS instructions per weight in the K loop (limit 4.5)"


@pytest.mark.parametrize("codes,has_zeros", [("*i8", False), ("*u8", True)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_decode_converts_no_code_with_i2f(codes, has_zeros, per_channel):
    """The weight-only int8 decode kernel turns codes into floats by a byte permute
    (_biased_code_floats), not I2F, which issues at a quarter of the FMA rate on Hopper: at about
    16 codes per SM per cycle, as many as an H200 reads, it held the M = 16 decode back."""
    from kernel_lab.gemm import _kernels

    pointers = dict(x_ptr="*bf16", q_ptr=codes, scales_ptr="*bf16", zeros_ptr="*u8", c_ptr="*fp32", bias_ptr="*bf16")
    constexprs = dict(BITS=8, HAS_ZEROS=has_zeros, PER_CHANNEL=per_channel, HAS_BIAS=False, WRITE_PARTIAL=True,
                      USE_PRMT=True, SLICES=2, K_TAIL=False, MASK_M=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128,
                      GROUP_SIZE=0 if per_channel else 128, stride_xk=1, stride_qk=1)
    compiled = compile_for_sm90(_kernels._weight_only_decode_kernel, pointers, constexprs, 2, 3)
    loop = [i for i in testing.sass_loop_body(compiled) if not i.startswith("NOP")]
    codes_per_thread = 16 * 128 // 32  # a warp a slice
    # (with group-wise zero points, each row's zero point is converted once a step, a few per thread)
    i2f = sum(i.startswith("I2F") for i in loop)
    assert i2f <= codes_per_thread // 16, f"{i2f} I2F for {codes_per_thread} codes a thread in the K loop"
    assert sum(i.startswith("PRMT") for i in loop) >= codes_per_thread, "codes not permuted into floats"


@pytest.mark.parametrize("w_type,has_zeros,has_norm", [("*i8", False, False), ("*u8", True, False),
                                                        ("*bf16", False, False), ("*bf16", False, True)])
def test_gemv_loop_reduces_only_after_the_loop(w_type, has_zeros, has_norm):
    """The one-row kernel accumulates a (BLOCK_N, BLOCK_K) tile: its K loop has no warp shuffles
    (a tl.sum per step would add them to every step) and no barriers (x and the weight tile
    share one layout, no shared-memory conversion), and converts no int8 code with I2F (a
    quarter-rate instruction: the codes become floats by byte permutes)."""
    from kernel_lab.gemm import _kernels

    pointers = dict(x_ptr="*bf16", w_ptr=w_type, scales_ptr="*bf16", zeros_ptr="*u8", g_ptr="*bf16", c_ptr="*bf16",
                    bias_ptr="*bf16")
    constexprs = dict(HAS_SCALES=w_type != "*bf16", HAS_ZEROS=has_zeros, HAS_NORM=has_norm, HAS_BIAS=True,
                      ACTIVATION="none", USE_PRMT=True, PDL=1, BLOCK_N=4, BLOCK_K=1024, stride_xk=1,
                      stride_wk=1)
    compiled = compile_for_sm90(_kernels._gemv_kernel, pointers, constexprs, 4, 1)
    loop = [i for i in testing.sass_loop_body(compiled) if not i.startswith("NOP")]
    assert not any(i.startswith("SHFL") for i in loop), "a cross-thread reduction inside the K loop"
    assert not any(i.startswith("BAR") for i in loop), "a layout conversion through shared memory in the K loop"
    assert not any(i.startswith("I2F") for i in loop), "int8 codes converted with I2F"


@pytest.mark.parametrize("has_zeros", [False, True])
def test_int4_gemv_loop_dequantizes_without_conversions(has_zeros):
    """The one-row int4 kernel: no I2F per code (the nibbles become floats by byte permutes; a
    zero point converts once per row and group), no warp shuffles in its K loop, and at most
    7.5 instructions per code (offline: 5.2-8 across the configs swept; 5.2 for this one without zero points)."""
    from kernel_lab.gemm import _kernels

    pointers = dict(x_ptr="*bf16", q_ptr="*u8", scales_ptr="*bf16", zeros_ptr="*u8", c_ptr="*bf16", bias_ptr="*bf16")
    constexprs = dict(HAS_ZEROS=has_zeros, HAS_BIAS=True, USE_PRMT=True, PDL=0, GROUP_SIZE=128, BLOCK_N=16,
                      ROW_BYTES=256, stride_xk=1)
    compiled = compile_for_sm90(_kernels._int4_gemv_kernel, pointers, constexprs, 2, 1)
    loop = [i for i in testing.sass_loop_body(compiled) if not i.startswith("NOP")]
    codes = 16 * 256 * 2 / (2 * 32)  # per thread and step: 16 rows x 256 bytes over 64 threads
    assert not any(i.startswith("SHFL") for i in loop), "a cross-thread reduction inside the K loop"
    conversions = sum(i.startswith("I2F") for i in loop)
    assert conversions <= 16 * 2, f"{conversions} int -> float conversions for {codes:.0f} codes per thread"
    per_code = len(loop) / codes
    assert per_code <= 7.5, f"{per_code:.1f} SASS instructions per code in the K loop (limit 7.5)"


FLOAT_CASES = {  # kernel: (pointer types, its float arguments, constexprs)
    "_rms_norm_linear_kernel": (
        dict(x_ptr="*bf16", g_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", ssq_ptr="*fp32", bias_ptr="*bf16"),
        ("eps",),
        dict(HAS_BIAS=False, WRITE_PARTIAL=False, SSQ_BY_DOT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1),
    ),
    "_rms_norm_rows_kernel": (
        dict(x_ptr="*bf16", g_ptr="*bf16", y_ptr="*bf16"), ("eps",), dict(BLOCK_K=4096, ONE_STEP=True, PDL=1),
    ),
    "_gemv_kernel": (
        dict(x_ptr="*bf16", w_ptr="*bf16", scales_ptr="*bf16", zeros_ptr="*u8", g_ptr="*bf16", c_ptr="*bf16",
             bias_ptr="*bf16"),
        ("eps",),
        dict(HAS_SCALES=False, HAS_ZEROS=False, HAS_NORM=True, HAS_BIAS=False, ACTIVATION="none", USE_PRMT=True,
             PDL=0, BLOCK_N=8, BLOCK_K=512),
    ),
    "_splitk_reduce_kernel": (
        dict(ws_ptr="*fp32", c_ptr="*bf16", ssq_ptr="*fp32", bias_ptr="*bf16", scale_a_ptr="*fp32",
             scale_b_ptr="*fp32"),
        ("inv_k", "eps"),
        dict(HAS_BIAS=False, HAS_SCALE=False, HAS_RSTD=True, ACTIVATION="none", BLOCK_M=16, BLOCK_N=128),
    ),
}


@pytest.mark.parametrize("name", list(FLOAT_CASES))
def test_float64_scalar_arguments_leave_no_float64_math(name):
    """torch.compile (inductor) passes a Python float argument to a user kernel as float64 (an
    eager launch: float32). The kernels cast it first: a float64 rstd would otherwise promote the
    epilogue's per-element math to float64."""
    from kernel_lab.gemm import _kernels

    pointers, floats, constexprs = FLOAT_CASES[name]
    types = dict(pointers, **dict.fromkeys(floats, "fp64"))
    compiled = testing.compile_for_sm90(getattr(_kernels, name), types, constexprs, num_warps=4, num_stages=2)
    f64 = re.findall(r"\b[\w.]*\.f64\b", compiled.asm["ptx"])
    # the one conversion per float argument (f64 -> f32) is all that may remain
    assert all(op.startswith("cvt.") for op in f64) and len(f64) <= len(floats), f64
