"""The kernels compile for Hopper (sm_90), and to what was measured to matter: the cooperative
kernels to the synchronisation kernel_lab.shared.coop describes (relaxed atomics and volatile
64-bit loads of the statistics words, no memory fence), the rows kernels to 16-byte loads on rows
whose length is a multiple of 8 but not of 16 (kernel_lab.shared.vector_hints).

A regression guard for a measured cost: the earlier protocol (a release fence before each
program's arrival, then a load of the statistics after the wait) made the forward 5-10% slower
on an H200 (ops.py: 164.5 against 156.0 us at 1024 x 131072, 166.1 against 151.0 at 4096 x
32768). No GPU needed: triton compiles for a target offline. Under TRITON_INTERPRET=1 (CI) the
kernels are interpreter objects, so one test reruns this file in a subprocess with the
interpreter off (kernel_lab.shared.testing.rerun_without_interpreter).
"""

import re

import pytest

from kernel_lab.shared import testing


@pytest.fixture(autouse=True)
def _needs_cuda_backend(request):
    testing.require_sm90_compiler(request.node.name)


def test_rerun_without_interpreter():
    testing.rerun_without_interpreter(__file__, timeout=600)


def _coop_ptx(direction: str, log: bool, dtype: str) -> str:
    from kernel_lab.softmax import _kernels, ops

    if direction == "forward":
        fn, tensors = _kernels._softmax_fwd_coop_kernel, ("x_ptr", "y_ptr")
        constexprs = dict(LOG=log, CHUNK=ops.COOP_CHUNK, BLOCK_N=ops.COOP_BLOCK_N, SPLITS_POW2=8, ALIGN=8,
                          WINDOW=False, VEC=8)
        num_warps = ops.COOP_NUM_WARPS
    else:
        fn, tensors = _kernels._softmax_bwd_coop_kernel, ("y_ptr", "dy_ptr", "dx_ptr")
        constexprs = dict(LOG=log, CHUNK=ops.LOG_BWD_COOP_CHUNK if log else ops.BWD_COOP_CHUNK, SPLITS_POW2=16,
                          ALIGN=8, WINDOW=False, VEC=8)
        num_warps = ops.LOG_BWD_COOP_NUM_WARPS if log else ops.BWD_COOP_NUM_WARPS
    types = {name: f"*{dtype}" for name in tensors} | {"sync_ptr": "*i32", "clear_ptr": "*i32"}
    return testing.compile_for_sm90(fn, types, constexprs, num_warps=num_warps, num_stages=3).asm["ptx"]


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cooperative_kernels_synchronise_without_a_fence(direction, log, dtype):
    ptx = _coop_ptx(direction, log, dtype)
    atomics = sorted(set(re.findall(r"\batom\.[\w.]+", ptx)))
    # the ticket and the row's arrival count (add), the chunk's statistics word (exch.b64)
    assert atomics == ["atom.global.gpu.relaxed.add.u32", "atom.global.gpu.relaxed.exch.b64"], atomics
    assert not re.search(r"\b(fence|membar)\.", ptx), "a memory fence in the cooperative kernel"
    assert "ld.volatile.global.b64" in ptx, "the statistics words are not read with volatile 64-bit loads"


KERNELS = {  # every kernel of the package, with its constexprs (ALIGN, KEEP_IN_L2, PREFETCH, WINDOW vary below)
    "_softmax_fwd_rows_kernel": dict(LOG=False, BLOCK_M=2, BLOCK_N=1024),
    "_softmax_fwd_coop_kernel": dict(LOG=False, CHUNK=16384, BLOCK_N=8192, SPLITS_POW2=8),
    "_softmax_fwd_looped_kernel": dict(LOG=False, BLOCK_N=16384),
    "_softmax_fwd_partial_kernel": dict(BLOCK_N=4096),
    "_softmax_fwd_split_kernel": dict(LOG=False, BLOCK_N=4096, SPLITS_POW2=8),
    "_softmax_bwd_rows_kernel": dict(LOG=False, BLOCK_M=2, BLOCK_N=1024),
    "_softmax_bwd_coop_kernel": dict(LOG=False, CHUNK=8192, SPLITS_POW2=16),
    "_softmax_bwd_looped_kernel": dict(LOG=True, BLOCK_N=8192),
    "_softmax_bwd_partial_kernel": dict(LOG=True, BLOCK_N=4096),
    "_softmax_bwd_split_kernel": dict(LOG=True, BLOCK_N=4096, SPLITS_POW2=8),
}


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("align", [1, 8])
def test_every_kernel_compiles(name, align):
    """What the interpreter cannot show: Triton's code generator rejected the split kernels on
    CUDA (a jit helper's str default, kernel-lab-softmax 0.2.13), and no GPU test ran them."""
    from kernel_lab.softmax import _kernels

    fn = getattr(_kernels, name)
    pointers = {a: "*i32" if a in ("sync_ptr", "clear_ptr") else "*fp32" if a in ("max_ptr", "sum_ptr", "dot_ptr")
                else "*bf16"
                for a in fn.arg_names if a.endswith("_ptr")}
    variants = [{}]
    for flag in ("KEEP_IN_L2", "PREFETCH", "WINDOW", "REREAD"):
        if flag in fn.arg_names:
            variants = [v | {flag: on} for v in variants for on in (False, True)]
    if "WINDOW" in fn.arg_names:
        variants = [v | {"VEC": 8} for v in variants if not (v["WINDOW"] and v.get("PREFETCH"))]
    if "PREFETCH" in fn.arg_names:  # its loops differ between the ops (log-softmax's first reads dy alone)
        variants = [v | {"LOG": log} for v in variants for log in (False, True)]
    for variant in variants:
        constexprs = KERNELS[name] | {"ALIGN": align} | variant
        compiled = testing.compile_for_sm90(fn, pointers, constexprs, num_warps=8, num_stages=3)
        assert "ld.global" in compiled.asm["ptx"]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_rows_kernels_load_16_bytes_at_a_time_where_the_hint_allows(direction):
    """bf16 rows of a length and stride that are multiples of 8 but not of 16 (e.g. 1000), 16-byte
    aligned tensors: ALIGN=8 gives 16-byte loads (ld.global.v4.b32), ALIGN=1 none: without the
    hint Triton only knows "not a multiple of 16" and reads 2 bytes at a time (12% slower at
    131072 x 1000 on an H200, ops.py)."""
    from kernel_lab.softmax import _kernels

    fn = getattr(_kernels, f"_softmax_{direction}_rows_kernel")
    pointers = {a: "*bf16" for a in fn.arg_names if a.endswith("_ptr")}
    vector_loads = {}
    for align in (8, 1):
        constexprs = dict(LOG=False, BLOCK_M=2, BLOCK_N=1024, ALIGN=align) | (
            {"REREAD": False} if direction == "bwd" else {})
        ptx = testing.compile_for_sm90(fn, pointers, constexprs, num_warps=4, num_stages=3,
                                       aligned=tuple(pointers)).asm["ptx"]
        vector_loads[align] = len(re.findall(r"\bld\.global[\w:.]*\.v4\.b32", ptx))
    assert vector_loads[8] > 0 and vector_loads[1] == 0, vector_loads


def test_backward_rows_kernel_rereading_loads_each_row_twice():
    """REREAD (ops.BWD_REREAD_*): y and dy are loaded again for dx, the second time with
    evict_first, not kept from the first loads (which a compiler merging equal loads would do)."""
    from kernel_lab.softmax import _kernels

    fn = _kernels._softmax_bwd_rows_kernel
    pointers = {a: "*bf16" for a in fn.arg_names if a.endswith("_ptr")}
    loads = {}
    for reread in (False, True):
        constexprs = dict(LOG=False, BLOCK_M=1, BLOCK_N=32768, ALIGN=8, REREAD=reread)
        ptx = testing.compile_for_sm90(fn, pointers, constexprs, num_warps=32, num_stages=3,
                                       aligned=tuple(pointers)).asm["ptx"]
        loads[reread] = len(re.findall(r"\bld\.global[\w:.]*\.v4\.b32", ptx))
        assert ("evict_first" in ptx) == reread
    assert loads[True] == 2 * loads[False] > 0, loads


WINDOW_KERNELS = {  # the long-row kernels, at the tiles of odd rows (ops.py) where those differ
    "_softmax_fwd_coop_kernel": dict(LOG=False, CHUNK=16384, BLOCK_N=8192, SPLITS_POW2=8),
    "_softmax_fwd_looped_kernel": dict(LOG=False, BLOCK_N=16384, KEEP_IN_L2=True),
    "_softmax_bwd_coop_kernel": dict(LOG=False, CHUNK=4096, SPLITS_POW2=16),
    "_softmax_bwd_split_kernel": dict(LOG=True, BLOCK_N=4096, SPLITS_POW2=8),
}


@pytest.mark.parametrize("name", list(WINDOW_KERNELS))
def test_odd_rows_read_through_windows_move_16_bytes_at_a_time(name):
    """bf16 rows of odd length (GPT-2's 50257 tokens): no two neighbours can be proven to share a
    16-byte vector, so without windows every load and store is of one element (ALIGN=1); read
    through 16-byte aligned windows (WINDOW, the kernels' _row_window) the loads are whole vectors
    and so are the stores but for the row's two partial end vectors."""
    from kernel_lab.softmax import _kernels

    fn = getattr(_kernels, name)
    pointers = {a: "*i32" if a in ("sync_ptr", "clear_ptr") else "*fp32" if a == "dot_ptr" else "*bf16"
                for a in fn.arg_names if a.endswith("_ptr")}
    counts = {}
    for window in (True, False):
        constexprs = WINDOW_KERNELS[name] | dict(ALIGN=1, WINDOW=window, VEC=8)
        if "PREFETCH" in fn.arg_names:
            constexprs["PREFETCH"] = False
        # (the split kernels' chunk, a multiple of 16 columns, is specialised so at launch)
        ptx = testing.compile_for_sm90(fn, pointers, constexprs, num_warps=4, num_stages=3,
                                       aligned=(*pointers, "chunk")).asm["ptx"]
        counts[window] = (len(re.findall(r"\bld\.global[\w:.]*\.v4\.b32", ptx)),
                          len(re.findall(r"\bst\.global[\w:.]*\.v4\.b32", ptx)))
    (loads, stores), (plain_loads, plain_stores) = counts[True], counts[False]
    assert loads > 0 and stores > 0 and plain_loads == plain_stores == 0, counts
