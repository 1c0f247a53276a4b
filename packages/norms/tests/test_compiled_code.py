"""The norms kernels do their math in float32 whatever type their float arguments arrive in, and
the cooperative kernels synchronise without a memory fence.

torch.compile (inductor) passes a Python float argument (eps, offset) to a user kernel as
float64, where an eager launch passes float32. Without the kernels' cast, float64 scalars promote
the per-element math to float64 (the RMSNorm forward compiled with float64 scalars had 100 f64
PTX instructions). No GPU needed: triton compiles for sm_90 offline. Under TRITON_INTERPRET=1
(CI) the kernels are interpreter objects, so one test reruns this file in a subprocess with the
interpreter off (kernel_lab.shared.testing.rerun_without_interpreter); the tests skip only where
the triton wheel has no CUDA backend. Also: every kernel reads rows whose length is a multiple of
8 but not of 16 in 16-byte vectors when the launcher's ALIGN says so
(kernel_lab.shared.vector_hints).
"""

import re

import pytest

from kernel_lab.norms import _kernels
from kernel_lab.shared import testing


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


FLAGS = dict(HAS_WEIGHT=True, HAS_GATE=True)
CASES = {  # kernel: (its float arguments, constexprs)
    "_rms_norm_fwd_kernel": (("eps", "offset"), dict(FLAGS, HAS_RESIDUAL=True, ONE_TILE=True, BLOCK_M=2,
                                                     BLOCK_N=2048)),
    "_rms_norm_bwd_kernel": (("offset",), dict(FLAGS, HAS_DU=True, BLOCK_M=2, BLOCK_N=2048)),
    "_rms_norm_bwd_wide_kernel": (("offset",), dict(FLAGS, HAS_DU=True, BLOCK_N=4096)),
    "_layer_norm_fwd_kernel": (("eps",), dict(HAS_WEIGHT=True, HAS_BIAS=True, ONE_TILE=True, BLOCK_M=2,
                                              BLOCK_N=2048)),
    "_rms_norm_fwd_coop_kernel": (("eps", "offset"), dict(FLAGS, HAS_RESIDUAL=True, CHUNK=16384, BLOCK_N=8192,
                                                          SPLITS_POW2=4)),
    "_layer_norm_fwd_coop_kernel": (("eps",), dict(HAS_WEIGHT=True, HAS_BIAS=True, CHUNK=16384, BLOCK_N=8192,
                                                   SPLITS_POW2=4)),
    "_rms_norm_bwd_coop_kernel": (("offset",), dict(FLAGS, HAS_DU=True, CHUNK=2048, SPLITS_POW2=32)),
    "_layer_norm_bwd_coop_kernel": ((), dict(HAS_WEIGHT=True, HAS_BIAS=True, CHUNK=2048, SPLITS_POW2=32)),
    "_layer_norm_bwd_kernel": ((), dict(HAS_WEIGHT=True, HAS_BIAS=True, REREAD=False, BLOCK_M=2, BLOCK_N=2048)),
    "_layer_norm_bwd_wide_kernel": ((), dict(HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_N=4096)),
}
for _floats, _constexprs in CASES.values():
    _constexprs["ALIGN"] = 8  # bf16 rows of a multiple of 8 columns (the test below varies it)
COOP_KERNELS = [name for name in CASES if "coop" in name]


def _pointer_types(kernel) -> dict:
    float32 = ("rstd_ptr", "mean_ptr", "dw_partial_ptr", "partial_ptr", "dot_ptr")
    return {a: "*i32" if a in ("sync_ptr", "clear_ptr") else "*fp32" if a in float32 else "*bf16"
            for a in kernel.arg_names if a.endswith("_ptr")}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_scalar_arguments_leave_no_float64_math(name):
    kernel = getattr(_kernels, name)
    floats, constexprs = CASES[name]
    types = _pointer_types(kernel)
    types.update(dict.fromkeys(floats, "fp64"))
    compiled = testing.compile_for_sm90(kernel, types, constexprs, num_warps=8, num_stages=1)
    f64 = re.findall(r"\b[\w.]*\.f64\b", compiled.asm["ptx"])
    # the one conversion per float argument (f64 -> f32) is all that may remain
    assert all(op.startswith("cvt.") for op in f64) and len(f64) <= len(floats), f64


@pytest.mark.parametrize("name", COOP_KERNELS)
def test_cooperative_kernels_synchronise_without_a_fence(name):
    """The cooperative kernels exchange their chunk statistics as kernel_lab.shared.coop
    describes: relaxed atomics (ticket, arrival count, the word's exchange), no memory fence."""
    kernel = getattr(_kernels, name)
    floats, constexprs = CASES[name]
    types = _pointer_types(kernel)
    types.update(dict.fromkeys(floats, "fp32"))
    ptx = testing.compile_for_sm90(kernel, types, constexprs, num_warps=4, num_stages=3).asm["ptx"]
    atomics = sorted(set(re.findall(r"\batom\.[\w.]+", ptx)))
    assert atomics == ["atom.global.gpu.relaxed.add.u32", "atom.global.gpu.relaxed.exch.b64"], atomics
    assert not re.search(r"\b(fence|membar)\.", ptx), "a memory fence in the cooperative kernel"


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_load_16_bytes_at_a_time_where_the_hint_allows(name):
    """bf16 rows of a length and strides that are multiples of 8 but not of 16 (e.g. 17000), 16-byte
    aligned tensors: ALIGN=8 gives 16-byte loads (ld.global.v4.b32), ALIGN=1 none. Without the
    hint Triton only knows "not a multiple of 16" and reads 2 bytes at a time (ops._row_alignment:
    3.0x torch.compile's time at 4096 x 17000 on an H100)."""
    kernel = getattr(_kernels, name)
    floats, constexprs = CASES[name]
    types = _pointer_types(kernel)
    types.update(dict.fromkeys(floats, "fp32"))
    vector_loads = {}
    for align in (8, 1):
        ptx = testing.compile_for_sm90(kernel, types, constexprs | {"ALIGN": align}, num_warps=4, num_stages=3,
                                       aligned=tuple(a for a, t in types.items() if t == "*bf16")).asm["ptx"]
        vector_loads[align] = len(re.findall(r"\bld\.global[\w:.]*\.v4\.b32", ptx))
    assert vector_loads[8] > 0 and vector_loads[1] == 0, vector_loads
