"""The AdamW kernel compiles, for Hopper (sm_90), to 16-byte vector loads and stores when every
address of the launch is 16-byte aligned. No GPU needed: triton compiles for a target offline.

A regression guard for a measured shortfall: with addresses read from a table and cast to
pointers, the compiler knew no alignment and issued every access element by element (2 bytes
per LDG.E.U16 for bfloat16 params), and bfloat16 params ran at 84% of copy bandwidth where
float32 ones ran at 93-95%. Under TRITON_INTERPRET=1 (CI) the kernels are interpreter objects,
so one test reruns this file in a subprocess with the interpreter off.
"""

import collections

import pytest
import torch
import triton.language as tl

from kernel_lab.shared import testing

_TORCH_DTYPES = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16}


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


def _compile(param_dtype, state_dtype, aligned: bool, amsgrad: bool = False):
    """The multi-tensor kernel compiled for sm_90 at the launcher's tile sizes."""
    from kernel_lab.optim_adamw import _kernels, ops

    scalars = ("lr", "step", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "log_beta1", "log_beta2", "eps",
               "weight_decay")
    types = {"ptr_table": "*i64", "numels": "*i64", "work_table": "*i64", "lr_ptr": "*fp32",
             **dict.fromkeys(scalars, "fp32")}
    constexprs = dict(PARAM_DTYPE=param_dtype, GRAD_DTYPE=param_dtype, STATE_DTYPE=state_dtype, AMSGRAD=amsgrad,
                      MAXIMIZE=False, MASTER=False, LR_FROM_PTR=False, STEP_FROM_PTR=True, ALIGNED=aligned,
                      CHUNK=ops.gpu_chunk(_TORCH_DTYPES[state_dtype]), BLOCK=ops.BLOCK)
    return testing.compile_for_sm90(_kernels._adamw_multi_tensor_kernel, types, constexprs,
                                    num_warps=ops.NUM_WARPS, num_stages=3, aligned=True)


def _memory_instructions(param_dtype, state_dtype, aligned: bool) -> collections.Counter:
    """Unpredicated global loads/stores of the kernel (the masked tail block's are predicated)."""
    compiled = _compile(param_dtype, state_dtype, aligned)
    return collections.Counter(i.split()[0] for i in testing.sass_instructions(compiled)
                               if i.startswith(("LDG", "STG")))


@pytest.mark.parametrize("param_dtype,state_dtype", [(tl.bfloat16, tl.float32), (tl.bfloat16, tl.bfloat16),
                                                     (tl.float32, tl.float32)])
def test_aligned_blocks_use_16_byte_accesses(param_dtype, state_dtype):
    """Per thread and block (BLOCK / (32 * NUM_WARPS) elements): p, g, m, v are read and p, m, v
    written in 16-byte pieces, one per 16 bytes of data; unaligned launches fall back to
    element-wise accesses."""
    from kernel_lab.optim_adamw import ops

    def pieces(dtype) -> int:
        return ops.BLOCK // (32 * ops.NUM_WARPS) * dtype.primitive_bitwidth // 128

    aligned = _memory_instructions(param_dtype, state_dtype, aligned=True)
    loads = 2 * pieces(param_dtype) + 2 * pieces(state_dtype)  # p, g, m, v
    stores = pieces(param_dtype) + 2 * pieces(state_dtype)
    assert aligned["LDG.E.128"] == loads and aligned["STG.E.128"] == stores, aligned
    assert "LDG.E.U16" not in aligned, aligned
    unaligned = _memory_instructions(param_dtype, state_dtype, aligned=False)
    assert "LDG.E.128" not in unaligned, unaligned


def test_amsgrad_max_propagates_nan():
    """max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq) keeps a NaN, as torch.maximum does: the PTX
    uses max.NaN (a plain max.f32 returns the other operand; the interpreter's numpy max would not
    show the difference)."""
    ptx = _compile(tl.float32, tl.float32, aligned=True, amsgrad=True).asm["ptx"]
    assert "max.NaN.f32" in ptx
    assert "max.f32" not in ptx
