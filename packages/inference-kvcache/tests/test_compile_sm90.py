"""Compile the kernels for an H100/H200 (sm_90) without a GPU.

The interpreter runs kernels as Python and accepts code the compiler rejects (a plain Python
global read inside a kernel, for one, which cost a GPU run). triton.compile with an explicit
target lowers to PTX and cubin on any machine with the CUDA backend of the triton wheel.
Under TRITON_INTERPRET=1 (CI) the kernels are interpreter objects, so one test reruns this file
in a subprocess with the interpreter off.
"""

import re

import pytest

pytest.importorskip("triton")

from kernel_lab.inference_kvcache import _kernels
from kernel_lab.shared import testing


def _compile(fn, pointers: dict[str, str], constexprs: dict, *, num_warps=4, num_stages=2):
    """Compile `fn` for sm_90: args typed by `pointers`, strides i64, other ints i32."""
    return testing.compile_for_sm90(fn, pointers, constexprs, num_warps=num_warps, num_stages=num_stages)


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


@pytest.mark.parametrize("cache_dtype,paged", [("fp16", False), ("fp8e4nv", True)])
def test_append_kernel_compiles_for_sm90(cache_dtype, paged):
    ptrs = {"k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "k_cache_ptr": f"*{cache_dtype}",
            "v_cache_ptr": f"*{cache_dtype}", "lengths_ptr": "*i32", "seq_ids_ptr": "*i32",
            "counts_ptr": "*i32", "block_table_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    quant = cache_dtype == "fp8e4nv"
    if not quant:
        ptrs["k_new_ptr"] = ptrs["v_new_ptr"] = "*fp16"
    kernel = _compile(_kernels._kv_append_kernel, ptrs, {
        "PAGED": paged, "PAGE_SIZE": 16, "HAS_SEQ_IDS": True, "HAS_COUNTS": True, "QUANT": quant,
        "BLOCK_H": 8, "BLOCK_D": 128,
    })
    assert "cubin" in kernel.asm
    if quant:  # NaN is stored as NaN (as the reference's torch.clamp): the clamp's min/max keep it
        ptx = kernel.asm["ptx"]
        assert re.search(r"\b(?:min|max)\.NaN[.\w]*\.f32", ptx)
        assert not re.search(r"\b(?:min|max)(?:\.xorsign\.abs)?\.f32\b", ptx)


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,paged,split,block_n,num_stages",
    [("bf16", "bf16", False, True, 64, 3), ("bf16", "bf16", True, False, 128, 2),
     ("bf16", "fp8e4nv", False, True, 64, 4), ("fp32", "fp32", True, True, 32, 3)],
)
def test_decode_kernels_compile_for_sm90(q_dtype, cache_dtype, paged, split, block_n, num_stages):
    ptrs = {"q_ptr": f"*{q_dtype}", "out_ptr": f"*{q_dtype}", "k_ptr": f"*{cache_dtype}",
            "v_ptr": f"*{cache_dtype}", "lengths_ptr": "*i32", "seq_ids_ptr": "*i32",
            "block_table_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            "part_ptr": "*fp32", "qk_scale": "fp32"}
    kernel = _compile(_kernels._decode_split_kernel, ptrs, {
        "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": block_n, "PAGED": paged, "PAGE_SIZE": 16,
        "HAS_SEQ_IDS": False, "QUANT": cache_dtype == "fp8e4nv",
        "FP16_MMA": cache_dtype == "fp8e4nv" and q_dtype == "bf16", "SPLIT": split,
        "DOT_PRECISION": "ieee" if q_dtype == "fp32" else "tf32",
    }, num_stages=num_stages)
    assert "cubin" in kernel.asm
    merge = _compile(_kernels._decode_merge_kernel,
                     {"part_ptr": "*fp32", "out_ptr": f"*{q_dtype}"},
                     {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 64})
    assert "cubin" in merge.asm


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_decode_converts_whole_registers_not_bytes(paged):
    """Over an fp8 cache with a bfloat16 q, the decode loop converts e4m3 to float16 two values
    per instruction and reads shared memory in wide words: no per-value float16 -> bfloat16
    conversion (F2F.BF16.F16) and no byte-by-byte gathers (LDS.U8), which the plain cast
    produced and which bounded that loop on an H200 (see _e4m3_to_float16_in_registers)."""
    ptrs = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "lengths_ptr": "*i32",
            "seq_ids_ptr": "*i32", "block_table_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            "part_ptr": "*fp32", "qk_scale": "fp32"}
    kernel = _compile(_kernels._decode_split_kernel, ptrs, {
        "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": 64, "PAGED": paged, "PAGE_SIZE": 16,
        "HAS_SEQ_IDS": False, "QUANT": True, "FP16_MMA": True, "SPLIT": True, "DOT_PRECISION": "tf32",
        # unit strides along the head dim, as every cache and q the launcher sees
        "stride_kd": 1, "stride_qd": 1, "stride_od": 1,
    }, num_stages=3)
    ops = [i.split()[0] for i in testing.sass_instructions(kernel)]
    assert "F2FP.F16.E4M3.UNPACK_B" in ops
    assert "F2F.BF16.F16" not in ops
    assert "LDS.U8" not in ops
