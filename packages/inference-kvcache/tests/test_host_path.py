"""The eager decode's host-side memos stay correct: per-layer checked caches, launch plans,
the reused autotune choice, memoized seq_ids tensors, the liveness re-checks after
allocate/free, and the host mirror of the lengths."""

import threading

import pytest
import torch

from kernel_lab.inference_kvcache import KVCache, PagedKVCache, decode_attention, flash_decode
from kernel_lab.inference_kvcache import modules as kv_modules
from kernel_lab.inference_kvcache import ops as kv_ops
from kernel_lab.shared.testing import randn


def _mirror_matches(cache) -> bool:
    return all(cache.lengths(layer).tolist() == cache._host_lengths[layer] for layer in range(cache.num_layers))


@pytest.mark.interpret
def test_repeated_decodes_reuse_plans_and_give_identical_results(kvh, kernel_device, seed, cache_kind):
    cache = kvh.make_cache(cache_kind, layers=2, batch=3, max_len=40, h_kv=2, d=16, dtype=torch.float16,
                           device=kernel_device)
    for layer in range(2):
        kvh.fill(cache, layer, [37, 5, 0], dtype=torch.float16, seed=seed + layer, prefill=40)
    q3 = randn(3, 4, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    q4 = randn(2, 2, 4, 16, dtype=torch.float16, seed=seed + 3, device=kernel_device)
    for _ in range(2):  # the second round runs from the memos
        for layer in range(2):
            for kw in ({}, {"num_splits": 3}, {"num_splits": 1}):
                first = decode_attention(q3, cache, layer, **kw)
                kvh.check_decode(first, q3, cache, layer)
                assert torch.equal(decode_attention(q3, cache, layer, **kw), first)
            out = decode_attention(q4, cache, layer, seq_ids=[1, 0], num_splits=2)
            kvh.check_decode(out, q4, cache, layer, rows=[1, 0])
    assert set(cache._decode_caches) == {0, 1}
    assert kv_ops._TUNED  # the autotuner's choice is reused past the first launch of a key
    # The checked layer caches point at the cache's own tensors: later appends are seen.
    kvh.fill(cache, 0, [1, 1, 2], dtype=torch.float16, seed=seed + 4, prefill=2)
    kvh.check_decode(decode_attention(q3, cache, 0), q3, cache, 0)


@pytest.mark.interpret
def test_flash_decode_matches_decode_attention(kvh, kernel_device, seed):
    cache = kvh.make_cache("paged", batch=2, max_len=30, h_kv=2, d=16, dtype=torch.float16, device=kernel_device)
    kvh.fill(cache, 0, [30, 7], dtype=torch.float16, seed=seed, prefill=30)
    q = randn(2, 8, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    a = decode_attention(q, cache, 0, num_splits=2)
    b = flash_decode(q, cache.k[0], cache.v[0], cache.lengths(0).long(), block_table=cache.block_table.long(),
                     num_splits=2)
    assert torch.equal(a, b)


@pytest.mark.interpret
def test_memoized_seq_ids_follow_free_and_allocate(kvh, kernel_device, seed, monkeypatch):
    monkeypatch.setattr(kv_modules, "SEQ_IDS_MEMO_SIZE", 2)
    cache = kvh.make_cache("paged", batch=3, max_len=20, h_kv=1, d=16, dtype=torch.float16, device=kernel_device)
    kvh.fill(cache, 0, [9, 20, 4], dtype=torch.float16, seed=seed, prefill=20)
    q = randn(2, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    for rows in ([2, 0], [0, 1], (1, 2), [2, 0], torch.tensor([0, 1]), [0, 1]):
        kvh.check_decode(decode_attention(q, cache, 0, seq_ids=rows), q, cache, 0, rows=[int(r) for r in rows])
    assert len(cache._seq_ids_memo) <= 2
    cache.free(1)
    with pytest.raises(ValueError, match="sequence 1 is not allocated"):
        decode_attention(q, cache, 0, seq_ids=[0, 1])
    with pytest.raises(ValueError, match="sequence 1 is not allocated"):
        decode_attention(q, cache, 0)
    with pytest.raises(ValueError, match="seq_ids must have 2 entries"):
        decode_attention(q, cache, 0, seq_ids=[0])
    cache.allocate(1)
    kvh.fill(cache, 0, [9, 3, 4], dtype=torch.float16, seed=seed + 2, prefill=3)
    assert _mirror_matches(cache)
    for rows in ([0, 1], [1, 2], None):
        kvh.check_decode(decode_attention(q, cache, 0, seq_ids=rows), q, cache, 0, rows=rows)


def test_contiguous_seq_ids_are_range_checked():
    cache = KVCache(1, 2, 8, 1, 8, dtype=torch.float32)
    q = torch.zeros(2, 2, 8)
    for rows in ([0, 2], [-1, 0]):
        with pytest.raises(ValueError, match=r"seq_id -?\d is outside \[0, 2\)"):
            decode_attention(q, cache, 0, seq_ids=rows)
    with pytest.raises(ValueError, match="q has 3 sequences but the cache has 2 rows"):
        decode_attention(torch.zeros(3, 2, 8), cache, 0)


def test_host_length_mirror_follows_append_reset_and_free(seed):
    cache = KVCache(2, 3, 16, 1, 8, dtype=torch.float32)
    paged = PagedKVCache(12, 4, 2, 1, 8, dtype=torch.float32, max_seqs=3)
    for s in range(3):
        paged.allocate(s)
    for c in (cache, paged):
        k = randn(3, 5, 1, 8, seed=seed)
        c.append(0, k, k, num_new=[5, 2, 0])
        c.append(1, k[:2, :1], k[:2, :1], seq_ids=[2, 0])
        c.append(1, k[:, :3], k[:, :3])
        assert _mirror_matches(c)
        assert c._host_lengths == [[5, 2, 0], [4, 3, 4]]
    cache.reset([1])
    paged.free(1)
    for c in (cache, paged):
        assert _mirror_matches(c) and c._host_lengths == [[5, 0, 0], [4, 0, 4]]
    paged.allocate(1, 6)
    cache.reset()
    assert _mirror_matches(paged) and _mirror_matches(cache)


# ---------------------------------------------------------------------------------------
# direct launches of the compiled kernels (CUDA only): faked here, kernels recorded not run


class _FakeLauncher:
    """Stands in for a CompiledKernel's launcher (`CompiledKernel.run`): its C launch function
    `launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *all_params)` records a "direct"
    launch."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, compiled):
        self.compiled = compiled

    def launch(self, gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
               packed_metadata, launch_metadata, enter_hook, exit_hook, *params):
        c = self.compiled
        assert function is c.function and packed_metadata is c.packed_metadata
        c.log.append(("direct", c.name, (gx, gy, gz), params))
        c.streams.append(stream)


class _FakeCompiled:
    """Stands in for a triton CompiledKernel returned by a JIT launch."""

    packed_metadata = function = object()

    def __init__(self, log, name):
        self.log, self.name = log, name
        self.streams = []  # the stream of every direct launch
        self.run = _FakeLauncher(self)

    def __getitem__(self, grid):
        raise AssertionError("launches go through the JIT function or the C launch function")


class _FakeJit:
    """Stands in for a JITFunction: records every parameter in signature order (what its
    binder would pass to the compiled kernel) and returns a _FakeCompiled."""

    pre_run_hooks = ()

    def __init__(self, real, log, name):
        self.arg_names, self.log, self.name = real.arg_names, log, name
        self.compiled = _FakeCompiled(log, name)

    def run(self, *args, grid, warmup, **kw):
        params = (*args, *(kw[n] for n in self.arg_names[len(args):]))
        self.log.append(("jit", self.name, grid, params))
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kw: self.run(*args, grid=grid, warmup=False, **kw)


def _assert_same_launches(jit, direct, persistent):
    """`direct` launches the kernels of `jit` (launch logs) with the same grids and parameters,
    tensors passed as their addresses: those of `persistent` (the cache's own tensors) equal;
    the per-call ones (q, the output, the split scratch) are checked by the caller."""
    assert [(how, name) for how, name, _, _ in direct] == [("direct", name) for _, name, _, _ in jit]
    for (_, name, grid, params), (_, _, direct_grid, direct_params) in zip(jit, direct, strict=True):
        assert direct_grid == grid and len(direct_params) == len(params), name
        for i, (p, d) in enumerate(zip(params, direct_params, strict=True)):
            if isinstance(p, torch.Tensor):
                assert type(d) is int, (name, i)
                if p.data_ptr() in persistent:
                    assert d == p.data_ptr(), (name, i)
            else:
                assert d == p, (name, i)


def _positions(params, tensor) -> list[int]:
    """Indices of the parameters that are `tensor` itself."""
    return [i for i, p in enumerate(params) if p is tensor]


@pytest.mark.parametrize(
    ("kind", "dtype", "t_q", "num_splits"),
    [("paged", torch.float16, None, 3), ("contiguous", torch.float8_e4m3fn, 2, 3),
     ("contiguous", torch.float16, None, 1)],
    ids=["paged-fp16-3d-split", "contiguous-fp8-4d-split", "contiguous-fp16-3d-unsplit"],
)
def test_direct_launch_replays_exactly_what_the_jit_launch_bound(monkeypatch, seed, kind, dtype, t_q, num_splits):
    if kind == "paged":
        cache = PagedKVCache(40, 4, 1, 2, 16, dtype=dtype, max_seqs=3)
        for s in range(3):
            cache.allocate(s, 30)
    else:
        cache = KVCache(1, 3, 32, 2, 16, dtype=dtype)
        kv = randn(3, 30, 2, 16, dtype=torch.float16, seed=seed + 1)
        cache.append(0, kv, kv)
    log = []
    monkeypatch.setattr(kv_ops.runtime, "backend", lambda x: "triton")
    monkeypatch.setattr(kv_ops, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(kv_ops, "_TUNED", {})
    monkeypatch.setattr(kv_ops._decode_split_kernel, "fn", _FakeJit(kv_ops._decode_split_kernel.fn, log, "split"))
    monkeypatch.setattr(kv_ops._decode_split_kernel, "configs", kv_ops._decode_split_kernel.configs[:1])
    monkeypatch.setattr(kv_ops, "_decode_merge_kernel", _FakeJit(kv_ops._decode_merge_kernel, log, "merge"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    current_stream = 0x5EED  # a stand-in handle: a direct launch must pass the current stream
    monkeypatch.setattr(kv_ops, "_current_raw_stream", lambda device: current_stream)
    scratch = {}  # the kept split scratch of each (device, stream), on the CPU here
    monkeypatch.setattr(kv_ops, "_split_scratch", lambda n, device, stream: scratch.setdefault(
        (device, stream), torch.empty(n, dtype=torch.float32)))
    dc = cache._decode_cache(0)
    dc.is_cuda = True  # what a CUDA cache has
    own = [dc.k_cache, dc.v_cache, dc.lengths] + [t for t in (dc.block_table, dc.k_scale, dc.v_scale) if t is not None]
    persistent = {t.data_ptr() for t in own}
    shape = (3, 8, 16) if t_q is None else (3, t_q, 8, 16)
    q = randn(*shape, dtype=torch.float16, seed=seed)
    split = num_splits > 1

    def launches(q, **kw):
        log.clear()
        out = decode_attention(q, cache, 0, num_splits=num_splits, **kw)
        return list(log), out

    first, first_out = launches(q)
    assert [x[:2] for x in first] == [("jit", "split"), ("jit", "merge")][: 1 + split]
    q2 = q.clone()
    again, out2 = launches(q2)
    _assert_same_launches(first, again, persistent)
    split_fake, merge_fake = kv_ops._decode_split_kernel.fn.compiled, kv_ops._decode_merge_kernel.compiled
    assert split_fake.streams == [current_stream] and merge_fake.streams == [current_stream][:split]
    # the per-call addresses: this call's q and output, and the kept scratch, which the split
    # kernel writes and the merge reads
    jit_split, direct_split = first[0][3], again[0][3]
    (q_at,) = _positions(jit_split, q)
    assert direct_split[q_at] == q2.data_ptr()
    out_at = _positions(jit_split, first_out)
    assert direct_split[out_at[0]] == out2.data_ptr()
    if split:
        (kept,) = scratch.values()
        (part_at,) = _positions(jit_split, kept)
        assert direct_split[part_at] == kept.data_ptr()
        jit_merge, direct_merge = first[1][3], again[1][3]
        assert _positions(jit_merge, kept) == [0] and _positions(jit_merge, first_out) == [2]
        assert direct_merge[0] == kept.data_ptr() and direct_merge[2] == out2.data_ptr()
        # while a CUDA graph is captured the scratch is the graph's own allocation
        capturing[0] = True
        captured, _ = launches(q2)
        capturing[0] = False
        assert captured[0][3][part_at] not in (kept.data_ptr(), out2.data_ptr())
        assert captured[1][3][0] == captured[0][3][part_at]
    else:
        assert len(out_at) == 2  # the output stands in for the unused scratch
    with monkeypatch.context() as m:  # a launch hook (a profiler): JITFunction.run calls it
        m.setattr(kv_ops._knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
        hooked, _ = launches(q.clone())
    assert [x[0] for x in hooked] == ["jit"] * (1 + split)
    # Anything the JIT specializes on that the fingerprint does not pin goes through it again:
    # a q that is not 16-byte aligned, other q strides, other seq_ids.
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert launches(misaligned)[0][0][0] == "jit"
    assert launches(misaligned)[0][0][0] == "direct"
    strided = torch.empty(*shape[:-1], 32, dtype=q.dtype)[..., :16].copy_(q)
    assert launches(strided)[0][0][0] == "jit"
    assert launches(q, seq_ids=[2, 1, 0])[0][0][0] == "jit"
    with_ids, _ = launches(q, seq_ids=[2, 1, 0])
    assert with_ids[0][0] == "direct"
    lengths_at = _positions(jit_split, dc.lengths)[0]  # (also the stand-in of absent pointers)
    assert with_ids[0][3][lengths_at + 1] not in persistent  # the seq_ids tensor, not the stand-in
    # flash_decode builds its DecodeCache per call: nothing to reuse, so every launch goes through
    # the JIT and no direct launch is prepared
    prepared = []
    direct_launch = kv_ops._DirectLaunch
    monkeypatch.setattr(kv_ops, "_DirectLaunch", lambda *a: prepared.append(a) or direct_launch(*a))

    class CudaDecodeCache(kv_ops.DecodeCache):  # what flash_decode builds for a CUDA cache
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.is_cuda = True

    monkeypatch.setattr(kv_ops, "DecodeCache", CudaDecodeCache)
    log.clear()
    for _ in range(2):
        flash_decode(q, dc.k_cache, dc.v_cache, dc.lengths, block_table=dc.block_table, k_scale=dc.k_scale,
                     v_scale=dc.v_scale, num_splits=num_splits, check_indices=False)
    assert [x[0] for x in log] == ["jit"] * 2 * (1 + split)
    assert prepared == []
    monkeypatch.setattr(kv_ops, "DIRECT_LAUNCH", False)
    assert [x[0] for x in launches(q)[0]] == ["jit"] * (1 + split)


def test_split_scratch_is_kept_per_thread_and_stream(monkeypatch):
    """The kept scratch (ops._split_scratch): one buffer per (device, stream) in each thread,
    reused while large enough, replaced by a larger one when not. (Allocated on the CPU here.)"""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: empty(n, dtype=dtype))
    a = kv_ops._split_scratch(100, 0, 7)
    assert a.numel() >= 100 and a.dtype == torch.float32
    assert kv_ops._split_scratch(60, 0, 7) is a
    assert kv_ops._split_scratch(100, 0, 8) is not a and kv_ops._split_scratch(100, 1, 7) is not a
    larger = kv_ops._split_scratch(1000, 0, 7)
    assert larger is not a and larger.numel() >= 1000 and kv_ops._split_scratch(100, 0, 7) is larger
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(kv_ops._split_scratch(100, 0, 7)))
    worker.start()
    worker.join()
    assert other_thread[0] is not larger


@pytest.mark.gpu
def test_the_split_count_is_measured_once_per_class_of_decodes(kvh, seed, monkeypatch):
    import triton.testing

    monkeypatch.setattr(kv_ops, "_MEASURED_PROGRAMS_PER_SM", {})
    # (a suite run with KERNEL_LAB_KVCACHE_AUTOTUNE=0, which turns the measurement off)
    monkeypatch.delenv("KERNEL_LAB_KVCACHE_AUTOTUNE", raising=False)
    timed = []  # the split measurements (the autotuner's own timings pass quantiles)
    do_bench = triton.testing.do_bench

    def spy(fn, **kw):
        if "quantiles" not in kw:
            timed.append(fn)
        return do_bench(fn, **kw)

    monkeypatch.setattr(triton.testing, "do_bench", spy)
    launched = []  # the split count of every decode launch, measurements included
    decode_launch = kv_ops._decode_launch

    def launch_spy(q, c, seq_ids, scale, num_splits, **kw):
        launched.append(num_splits)
        return decode_launch(q, c, seq_ids, scale, num_splits, **kw)

    monkeypatch.setattr(kv_ops, "_decode_launch", launch_spy)
    cache = kvh.make_cache("contiguous", batch=3, max_len=32768, h_kv=8, d=128, dtype=torch.float8_e4m3fn,
                           device="cuda")
    kvh.fill(cache, 0, [32768, 30000, 20000], dtype=torch.bfloat16, seed=seed, prefill=32768)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    candidates = {p: kv_ops._num_splits(2, 8, 1, 32768, sms, p)
                  for p in (kv_ops.SPLIT_PROGRAMS_PER_SM, *kv_ops.SPLIT_WAVE_CANDIDATES)}
    q = randn(2, 32, 128, dtype=torch.bfloat16, seed=seed + 1, device="cuda")
    out = decode_attention(q, cache, 0)
    kvh.check_decode(out, q, cache, 0)
    assert len(timed) == kv_ops.SPLIT_MEASURE_ROUNDS * len(set(candidates.values()))
    assert len(set(candidates.values())) > 1
    (per_sm,) = kv_ops._MEASURED_PROGRAMS_PER_SM.values()
    assert launched[-1] == candidates[per_sm]  # the decode itself, after the measurement
    # batch 3 (24 unsplit programs) is in batch 2's class (16 to 31): its split count follows
    # from the measured programs per SM, without timing again
    q3 = randn(3, 32, 128, dtype=torch.bfloat16, seed=seed + 2, device="cuda")
    launched.clear()
    kvh.check_decode(decode_attention(q3, cache, 0), q3, cache, 0)
    assert len(timed) == kv_ops.SPLIT_MEASURE_ROUNDS * len(set(candidates.values()))
    assert launched == [kv_ops._num_splits(3, 8, 1, 32768, sms, per_sm)]
    assert len(kv_ops._MEASURED_PROGRAMS_PER_SM) == 1


def test_default_split_counts():
    """The default split plan on a 132-SM GPU with 8 kv heads (ops._num_splits): splits of at
    least 256 keys up to three programs per SM; short contexts whose 256-key plan leaves most
    SMs idle split down to 128 keys, at most 16 splits; batches that fill the GPU are not split."""

    def splits(batch, max_len):
        return kv_ops._num_splits(batch, 8, 1, max_len, 132)

    by_length = [splits(1, t) for t in (100, 256, 1024, 2048, 3000, 4096, 8192, 32768, 131072)]
    assert by_length == [1, 2, 8, 16, 11, 16, 32, 49, 49]
    # B = 2 at T = 1k (64 programs under the 256-key plan) splits further; at T = 2k it does not
    assert (splits(2, 1024), splits(2, 2048), splits(4, 1024)) == (8, 8, 4)
    assert (splits(8, 8192), splits(32, 4096), splits(64, 2048)) == (6, 1, 1)
    # the measured candidates reach one program per SM: 16 splits of a B = 1 decode
    assert 1 in kv_ops.SPLIT_WAVE_CANDIDATES
    assert kv_ops._num_splits(1, 8, 1, 32768, 132, programs_per_sm=min(kv_ops.SPLIT_WAVE_CANDIDATES)) == 16
