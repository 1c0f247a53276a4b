"""Compile the attention and RoPE kernels for an H100/H200 (sm_90) without a GPU.

The interpreter runs kernels as Python and accepts code the compiler rejects. triton.compile
with an explicit target lowers to PTX and cubin on any machine with the CUDA backend of the
triton wheel. The scale arguments are also compiled as fp64 scalars, which is how
torch.compile (inductor) passes Python floats to user kernels: the kernels must keep their
softmax math in fp32 then (a GPU run failed on exactly that). Under TRITON_INTERPRET=1 (CI) the
kernels are interpreter objects, so one test reruns this file with the interpreter off.
"""

import re

import pytest

triton = pytest.importorskip("triton")

from kernel_lab.attention import _kernels  # noqa: E402
from kernel_lab.shared import testing  # noqa: E402

SCALARS = ("qk_scale", "sm_scale")


def _compile(fn, pointers: dict[str, str], constexprs: dict, *, float_type="fp32", num_warps=8, num_stages=3):
    """Compile `fn` for sm_90: pointers typed by `pointers`, scale args `float_type`, strides
    i64, other ints i32."""
    types = {**pointers, **dict.fromkeys(SCALARS, float_type)}
    return testing.compile_for_sm90(fn, types, constexprs, num_warps=num_warps, num_stages=num_stages)


def _ptrs(dtype, names):
    fp32 = ("LSE", "DLSE", "DELTA")
    return {n: ("*fp32" if n in fp32 else "*i32" if n.startswith("CU_") else f"*{dtype}") for n in names}


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=900)


FWD_NAMES = ("Q", "K", "V", "Out", "LSE", "CU_SEQLENS_Q", "CU_SEQLENS_K")


@pytest.mark.parametrize(
    ("dtype", "head_dim", "varlen", "float_type", "blocks"),
    [("bf16", 128, False, "fp64", (128, 64, 8, 3)), ("fp16", 96, True, "fp32", (128, 128, 8, 3)),
     ("fp32", 64, False, "fp32", (64, 64, 4, 2)), ("bf16", 256, False, "fp32", (64, 64, 4, 2))],
)
def test_forward_kernel_compiles_for_sm90(dtype, head_dim, varlen, float_type, blocks):
    bm, bn, warps, stages = blocks
    kernel = _compile(_kernels._attn_fwd_kernel, _ptrs(dtype, FWD_NAMES), {
        "IS_VARLEN": varlen, "USE_TMA": False, "BSHD": False, "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_M": bm, "BLOCK_N": bn,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "OFFSETS_64": varlen,
    }, float_type=float_type, num_warps=warps, num_stages=stages)
    assert "cubin" in kernel.asm


@pytest.mark.parametrize(("head_dim", "bshd", "blocks"),
                         [(128, False, (128, 128, 8, 3)), (64, True, (128, 64, 8, 3)), (96, False, (128, 64, 8, 4))])
def test_tma_forward_kernel_compiles_for_sm90(head_dim, bshd, blocks):
    """The forward with q/k/v as 4-D TMA descriptors (what the launcher uses on Hopper)."""
    bm, bn, warps, stages = blocks
    block_d = triton.next_power_of_2(head_dim)
    rows = (lambda n: [1, n, 1, block_d]) if bshd else (lambda n: [1, 1, n, block_d])
    types = _ptrs("bf16", FWD_NAMES)
    for name, n in (("Q", bm), ("K", bn), ("V", bn)):
        types[name] = f"tensordesc<bf16{rows(n)}>"
    kernel = _compile(_kernels._attn_fwd_kernel, types, {
        "IS_VARLEN": False, "USE_TMA": True, "BSHD": bshd, "HEAD_DIM": head_dim, "BLOCK_D": block_d,
        "BLOCK_M": bm, "BLOCK_N": bn, "DOT_PRECISION": "tf32", "OFFSETS_64": bshd,
    }, float_type="fp64", num_warps=warps, num_stages=stages)
    assert "cubin" in kernel.asm
    assert "cp.async.bulk.tensor" in kernel.asm["ptx"], "no TMA load in the forward"


@pytest.mark.parametrize("offsets_64", [False, True])
def test_token_offsets_are_64_bit_only_with_offsets_64(offsets_64):
    """The launcher passes strides below 2**31 as int32, so row offset x token stride is a 32-bit
    multiply (mul.lo.s32) unless OFFSETS_64 widens the offsets first (mul.lo.s64): what a
    (B, T, H, D) prefill past 2**31 / (H * D) tokens needs (ops._offsets_64)."""
    fn = _kernels._attn_fwd_kernel
    types = {**_ptrs("bf16", FWD_NAMES), **{n: "i32" for n in fn.arg_names if n.startswith("stride")}}
    kernel = _compile(fn, types, {
        "IS_VARLEN": False, "USE_TMA": False, "BSHD": True, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128,
        "BLOCK_N": 64, "DOT_PRECISION": "tf32", "OFFSETS_64": offsets_64,
    })
    ptx = kernel.asm["ptx"]
    wide, narrow = len(re.findall(r"mul\.lo\.s64", ptx)), len(re.findall(r"mul\.lo\.s32", ptx))
    # (the per-row address multiplies of q, k, v and out outnumber every other multiply)
    assert (wide > narrow) == offsets_64, (wide, narrow)


HOPPER_SMEM = 227 * 1024  # shared memory a Hopper block may use


@pytest.mark.parametrize(("dtype", "head_dim", "float_type"),
                         [("bf16", 128, "fp64"), ("bf16", 64, "fp32"), ("fp32", 128, "fp32"), ("fp32", 64, "fp32")])
def test_backward_kernels_compile_for_sm90(dtype, head_dim, float_type):
    """The backward kernels with the tiles the launcher runs first (autotuning off) compile for
    sm_90 and fit in its shared memory, float32 included."""
    from kernel_lab.attention import ops

    itemsize = 4 if dtype == "fp32" else 2
    common = {"IS_VARLEN": False, "HEAD_DIM": head_dim, "BLOCK_D": head_dim,
              "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "OFFSETS_64": float_type == "fp64"}
    names = ("Q", "K", "V", "DO", "Out", "LSE", "DLSE", "DELTA", "DK", "DV", "DQ", "CU_SEQLENS_Q", "CU_SEQLENS_K")
    compiled = {}
    for kind, fn in (("dkdv", _kernels._attn_bwd_dkdv_kernel), ("dq", _kernels._attn_bwd_dq_kernel)):
        cfg = ops._configs(kind, ops._row_class(kind, head_dim, itemsize))[0]
        consts = {**common, **cfg.kwargs, **({"HAS_DLSE": dtype == "bf16"} if kind == "dq" else {})}
        compiled[kind] = _compile(fn, _ptrs(dtype, names), consts, float_type=float_type,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        assert compiled[kind].metadata.shared <= HOPPER_SMEM, (kind, cfg, compiled[kind].metadata.shared)
    assert all("cubin" in k.asm for k in compiled.values())
    if float_type == "fp64":
        # fp64 arguments are converted once; no fp64 arithmetic in the loops (slow on GPUs).
        assert compiled["dq"].asm["ptx"].count(".f64") <= 4, "fp64 math in the dq kernel"


@pytest.mark.parametrize(("interleaved", "position_ids", "copy_tail"), [(False, False, True), (True, True, False)])
def test_rope_kernel_compiles_for_sm90(interleaved, position_ids, copy_tail):
    ptrs = {n: "*bf16" for n in ("Q", "K", "QO", "KO", "COS", "SIN")}
    ptrs["POS"] = "*i64" if position_ids else "*bf16"
    kernel = _compile(_kernels._rope_kernel, ptrs, {
        "HAS_POSITION_IDS": position_ids, "INTERLEAVED": interleaved, "BACKWARD": not interleaved,
        "COPY_TAIL": copy_tail, "HEAD_DIM": 128, "ROTARY_DIM": 64 if copy_tail else 128, "BLOCK_T": 64,
        "BLOCK_HALF": 32 if copy_tail else 64, "BLOCK_TAIL": 64 if copy_tail else 1, "HEADS_PER_PROGRAM": 8,
    }, num_warps=4, num_stages=1)
    assert "cubin" in kernel.asm
