"""The exact-GELU kernels compile, for Hopper (sm_90), to few enough instructions per element.

No GPU needed: triton compiles for a target offline and nvdisasm lists the SASS. Why count:
bias_gelu moves 4 bytes per element forward (6 backward), and an H200 can issue only about as
many instructions per element as the forward needs while moving them at copy bandwidth:
132 SMs x 128 lanes x the clock (1.98 GHz boost, NVIDIA's spec), over the copy bandwidth
measured in benchmarks/history (about 4.2 TB/s) / 4 B, is about 32 per element. With libdevice's erf the
forward took more than that, so the kernel was bound by instruction issue instead of memory.
The erfc formulation of `_normal_cdf` is cheaper; the limits below fail if a change brings the
old cost back. The count is static (whole kernel / elements of one tile per thread), which for
these straight-line kernels is the per-element cost of the loop body plus a small prologue.

Under TRITON_INTERPRET=1 (CI) the kernels are interpreter objects, so one test reruns this
file in a subprocess with the interpreter off; the tests skip only where the triton wheel has
no CUDA backend.
"""

import pytest

from kernel_lab.shared import testing


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


POINTERS = {n: "*bf16" for n in ("x_ptr", "bias_ptr", "out_ptr", "dy_ptr", "dx_ptr", "gate_ptr", "up_ptr")}
POINTERS |= {"dbias_part_ptr": "*fp32", "dbias_ptr": "*bf16", "arrivals_ptr": "*i32"}
# Row strides at ROWS x COLS fit 32 bits, and Triton passes such Python ints as i32.
POINTERS |= {f"stride_{t}": "i32" for t in ("x", "out", "dy", "dx", "gate", "up", "dgate", "dup")}
# Llama-3-8B's intermediate size and a prefill's worth of rows: the tile the launcher picks there.
ROWS, COLS = 16384, 14336


def _instructions_per_element(kernel_name: str, tile_elements: int) -> float:
    from kernel_lab.mlp import _kernels, ops

    block_m, block_n = ops._blocks(ROWS, COLS, tile_elements)
    # The backward's row loop is counted unpipelined (STAGES=1): pipelining changes how its loads
    # are issued, not the math per element, and its fill and drain code would swamp this static
    # count. Likewise without the fused bias-gradient sum, which runs once per program after the
    # loop, not per element.
    loop = dict(STAGES=1, FUSED_SUM=False, SUM_ROWS=4) if kernel_name == "_bias_gelu_bwd_kernel" else {}
    if kernel_name == "_bias_gelu_fwd_kernel":
        loop = dict(OFFSETS_64=False)  # 32-bit offsets, as the launcher picks at this size
    compiled = testing.compile_for_sm90(
        getattr(_kernels, kernel_name), POINTERS,
        dict(ACTIVATION=_kernels.GELU, BLOCK_M=block_m, BLOCK_N=block_n) | loop,
        num_warps=ops.NUM_WARPS, num_stages=3, aligned=True,
    )  # fmt: skip
    executed = [i for i in testing.sass_instructions(compiled) if not i.startswith("NOP")]
    return len(executed) / (block_m * block_n / (ops.NUM_WARPS * 32))


@pytest.mark.parametrize(
    ("kernel_name", "tile", "limit"),
    [
        # bfloat16 in and out, so the degree-5 ERFC16_P fit. Forward, 4 B per element: under
        # the issue budget (libdevice's erf: about 39; the erfc fit with `1 / d`: about 32, at
        # the budget; with rsqrt: 27; with ERFC16_P: 23 over 4096-element tiles). The launcher's
        # tiles are 2048 elements since mlp 0.1.4 (faster on an H200): the kernel's prologue then
        # spreads over 16 elements a thread instead of 32, 24.1 per element; with the 2-D grid
        # and 32-bit offsets (mlp 0.1.9: no division of the program id, no 64-bit offsets) 22.6.
        ("_bias_gelu_fwd_kernel", "BIAS_GELU_TILE_ELEMENTS", 23),
        # backward, 6 B per element and a column sum: under its budget of about 48 (erf: 53;
        # erfc with `1 / d`: about 42; rsqrt: 37; ERFC16_P: 33). Counted over 4096-element
        # steps, which spread the loop's prologue thin; the launcher's 1024-element steps run
        # the same loop body.
        ("_bias_gelu_bwd_kernel", 4096, 34),
        # geglu forward, 6 B per element (erf: about 40; erfc with `1 / d`: about 33; rsqrt:
        # 28; ERFC16_P: 24; the 1-D grid's division of the program id: 25)
        ("_gated_fwd_kernel", "TILE_ELEMENTS", 26),
    ],
)
def test_exact_gelu_kernels_stay_within_the_instruction_budget(kernel_name, tile, limit):
    from kernel_lab.mlp import ops

    per_element = _instructions_per_element(kernel_name, tile if isinstance(tile, int) else getattr(ops, tile))
    assert per_element <= limit, f"{kernel_name}: {per_element:.1f} SASS instructions per element (limit {limit})"
