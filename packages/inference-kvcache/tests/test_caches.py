"""KVCache / PagedKVCache: appends land where they should, the allocator, input checks."""

import random

import pytest
import torch

from kernel_lab.inference_kvcache import KVCache, PagedKVCache, kv_append
from kernel_lab.inference_kvcache import ops as kv_ops
from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_ragged_prefill_and_decode_tokens_land_in_order(kvh, kernel_device, seed, cache_kind, dtype):
    # Block size 3 (not a power of two) and lengths 0, 1, 3, 7, 10: appends start and end
    # inside blocks and cross block boundaries, in the prefill and in the decode steps.
    lengths = [7, 0, 10, 1, 3]
    cache = kvh.make_cache(cache_kind, batch=5, max_len=12, h_kv=3, d=8, dtype=dtype, device=kernel_device,
                       block_size=3)
    k, v = kvh.fill(cache, 0, lengths, dtype=dtype, seed=seed, prefill=5)
    assert cache.lengths(0).tolist()[:5] == lengths
    got_k, got_v = kvh.dense_view(cache, 0, list(range(5)))
    for b, n in enumerate(lengths):
        assert torch.equal(got_k[b, :n], k[b, :n].double()), f"keys of sequence {b}"
        assert torch.equal(got_v[b, :n], v[b, :n].double()), f"values of sequence {b}"


@pytest.mark.interpret
def test_append_strided_inputs_and_seq_ids(kvh, kernel_device, seed, cache_kind):
    cache = kvh.make_cache(cache_kind, batch=4, max_len=8, h_kv=2, d=16, dtype=torch.float16,
                       device=kernel_device)
    # (B, H, T, D) storage seen as (B, T, H, D): no unit stride on the token dim.
    k = randn(2, 2, 5, 16, dtype=torch.float16, seed=seed, device=kernel_device).transpose(1, 2)
    v = randn(2, 2, 5, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device).transpose(1, 2)
    cache.append(0, k, v, seq_ids=[3, 1], num_new=[5, 2])
    assert cache.lengths(0).tolist()[:4] == [0, 2, 0, 5]
    got_k, got_v = kvh.dense_view(cache, 0, [3, 1])
    assert torch.equal(got_k[0], k[0].double()) and torch.equal(got_v[0], v[0].double())
    assert torch.equal(got_k[1, :2], k[1, :2].double())


@pytest.mark.interpret
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_append_stores_the_bytes_torch_quantization_gives(kvh, kernel_device, seed, cache_kind, in_dtype):
    cache = kvh.make_cache(cache_kind, batch=2, max_len=9, h_kv=3, d=16, dtype=torch.float8_e4m3fn,
                       device=kernel_device)
    k = randn(2, 9, 3, 16, dtype=in_dtype, seed=seed, device=kernel_device, scale=3.0)
    v = randn(2, 9, 3, 16, dtype=in_dtype, seed=seed + 1, device=kernel_device)
    # Out of range, ties and signed zeros: saturation and round-to-nearest-even are visible.
    k[0, 0, 0, :6] = torch.tensor([1e4, -1e4, 0.0, -0.0, 1e-9, -1e-9])
    cache.set_scales(0, torch.tensor([0.01, 0.003, 0.5]), torch.tensor([0.02, 1.0, 0.004]))
    cache.append(0, k, v, num_new=[9, 4])
    for src, pool, s in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        expected = reference.kvcache.quantize_fp8_per_head(src.cpu(), s[0].cpu())
        if cache_kind == "paged":
            got = [pool[0, cache.block_table[r, t // cache.block_size].item(), t % cache.block_size]
                   for r, t in ((0, t) for t in range(9))]
            got = torch.stack(got).cpu()
        else:
            got = pool[0, 0, :9].cpu()
        assert torch.equal(got.view(torch.uint8), expected[0].view(torch.uint8))
    assert cache.lengths(0).tolist()[:2] == [9, 4]


@pytest.mark.interpret
def test_fp8_first_append_calibrates_per_head_scales(kernel_device, seed):
    cache = KVCache(1, 2, 6, 2, 16, dtype=torch.float8_e4m3fn, device=kernel_device)
    k = randn(2, 6, 2, 16, seed=seed, device=kernel_device)
    k[:, :, 1] *= 100
    cache.append(0, k, k)
    amax = k.abs().amax(dim=(0, 1, 3)).cpu()
    torch.testing.assert_close(cache.k_scale[0].cpu(), amax / reference.kvcache.FP8_E4M3_MAX)
    restored = cache.k[0].float().cpu() * cache.k_scale[0].cpu()[:, None]
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of each value's binade.
    torch.testing.assert_close(restored, k.cpu(), rtol=2**-4, atol=amax.max().item() * 2**-9)


@pytest.mark.interpret
def test_fp8_scales_come_from_the_written_tokens_only(kernel_device, seed):
    """The calibrating append's padding (tokens past num_new) is not stored and must not set the
    scale; an append that writes nothing (num_new all 0, or T_new = 0) leaves the scales open."""
    cache = KVCache(1, 2, 6, 2, 16, dtype=torch.float8_e4m3fn, device=kernel_device)
    empty = torch.zeros(2, 0, 2, 16, device=kernel_device)
    cache.append(0, empty, empty)
    k = randn(2, 4, 2, 16, seed=seed, device=kernel_device)
    cache.append(0, k * 0.01, k * 0.01, num_new=[0, 0])
    assert cache.lengths(0).tolist() == [0, 0]
    padded = k.clone()
    padded[0, 2:] = 1e4  # entry 0 writes 2 tokens: the rest is padding
    cache.append(0, padded, padded, num_new=[2, 4])
    written = torch.cat([k[0, :2], k[1]]).abs().amax(dim=(0, 2)).cpu()
    torch.testing.assert_close(cache.k_scale[0].cpu(), written / reference.kvcache.FP8_E4M3_MAX)
    restored = cache.k[0, 1, :4].float().cpu() * cache.k_scale[0].cpu()[:, None]
    torch.testing.assert_close(restored, k[1].cpu(), rtol=2**-4, atol=written.max().item() * 2**-9)


def test_decode_reads_the_caches_own_index_tensors_not_copies():
    """The decode side of a cache layer is built once and reused (`_decode_cache`): it must hold
    the cache's own lengths and block table (no contiguous / int32 copy), or later appends and
    allocations would be invisible to it."""
    for cache in (KVCache(2, 3, 8, 1, 8, dtype=torch.float32),
                  PagedKVCache(6, 2, 2, 1, 8, dtype=torch.float32, max_seqs=3)):
        decode_side = cache._decode_cache(1)
        assert decode_side.lengths.data_ptr() == cache._lengths[1].data_ptr()
        if isinstance(cache, PagedKVCache):
            assert decode_side.block_table is cache.block_table


def test_kvcache_overflow_raises_and_writes_nothing():
    cache = KVCache(2, 2, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="over max_seq_len 4"):
        cache.append(1, torch.zeros(2, 5, 1, 8), torch.zeros(2, 5, 1, 8), num_new=[1, 5])
    assert cache.lengths(1).tolist() == [0, 0] and cache.seq_len(1, 1) == 0


def test_kvcache_reset_empties_sequences_at_every_layer():
    cache = KVCache(2, 3, 4, 1, 8, dtype=torch.float32)
    for layer in range(2):
        cache.append(layer, torch.ones(3, 2, 1, 8), torch.ones(3, 2, 1, 8))
    cache.reset([0, 2])
    assert cache.lengths(0).tolist() == [0, 2, 0] and cache.lengths(1).tolist() == [0, 2, 0]
    assert cache.seq_len(1, 2) == 0 and cache.seq_len(1, 1) == 2


def _assert_allocator_consistent(cache: PagedKVCache):
    owned = [b for s in cache.live_sequences() for b in cache.owned_blocks(s)]
    assert len(owned) == len(set(owned)), "a block is owned by two live sequences"
    assert sorted(owned + cache._free) == list(range(cache.num_blocks)), "blocks lost or duplicated"
    for s in cache.live_sequences():
        blocks = cache.owned_blocks(s)
        assert cache.block_table[s, : len(blocks)].tolist() == blocks


@pytest.mark.parametrize("num_tokens", [2.5, -5, True, "3"])
def test_paged_allocate_with_a_bad_token_count_raises_and_allocates_nothing(num_tokens):
    cache = PagedKVCache(8, 4, 1, 1, 8, dtype=torch.float32, max_seqs=4, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
        cache.allocate(0, num_tokens)
    assert cache.live_sequences() == [] and cache.num_free_blocks == 8
    cache.allocate(0, 5)  # the sequence id is still free
    assert cache.live_sequences() == [0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_set_scales_refuses_scales_that_are_not_positive_and_finite(bad):
    cache = KVCache(1, 2, 6, 2, 16, dtype=torch.float8_e4m3fn)
    good = torch.ones(2)
    with pytest.raises(ValueError, match="k_scale must be positive and finite"):
        cache.set_scales(0, torch.tensor([1.0, bad]), good)
    with pytest.raises(ValueError, match=r"v_scale must be one value or one per kv head \(2,\)"):
        cache.set_scales(0, good, torch.ones(3))
    cache.set_scales(0, 2.0, torch.tensor([0.5, 0.25]))  # one value for every head, or one per head
    assert cache.k_scale[0].tolist() == [2.0, 2.0] and cache.v_scale[0].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_fp8_set_scales_refuses_a_layer_that_holds_tokens(kind):
    """Its tokens were stored as x / the old scales: new scales would silently misread them."""
    if kind == "contiguous":
        cache = KVCache(2, 2, 6, 2, 16, dtype=torch.float8_e4m3fn)
    else:
        cache = PagedKVCache(4, 4, 2, 2, 16, dtype=torch.float8_e4m3fn, max_seqs=2)
        cache.allocate(1)
    new = torch.ones(1, 2, 2, 16)
    cache.append(0, new, new, seq_ids=[1])
    before = cache.k_scale.clone()
    with pytest.raises(ValueError, match="set_scales must come before layer 0 caches tokens"):
        cache.set_scales(0, 2.0, 2.0)
    assert torch.equal(cache.k_scale, before)
    cache.set_scales(1, 2.0, 2.0)  # another layer, still empty
    if kind == "contiguous":
        cache.reset([1])
    else:
        cache.free(1)
    cache.set_scales(0, 2.0, 2.0)  # emptied: allowed again
    assert cache.k_scale.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_paged_allocator_random_allocate_free_never_shares_a_block(seed):
    rng = random.Random(seed)
    cache = PagedKVCache(40, 4, 1, 1, 8, dtype=torch.float32, max_seqs=12, max_blocks_per_seq=16)
    for _ in range(300):
        live = cache.live_sequences()
        op = rng.random()
        if op < 0.45 and len(live) < cache.max_seqs:
            s = rng.choice([i for i in range(cache.max_seqs) if i not in live])
            n = rng.randint(0, 30)
            free_before = cache.num_free_blocks
            if -(-n // 4) > free_before:
                with pytest.raises(ValueError, match="out of KV cache blocks"):
                    cache.allocate(s, n)
                assert cache.num_free_blocks == free_before and s not in cache.live_sequences()
            else:
                cache.allocate(s, n)
        elif op < 0.75 and live:
            s = rng.choice(live)
            need = len(cache.owned_blocks(s)) * 4 + rng.randint(1, 9)
            try:
                cache._reserve({s: need})
            except ValueError as e:  # out of blocks or over max_blocks_per_seq: both legal here
                assert "out of KV cache blocks" in str(e) or "max_blocks_per_seq" in str(e)
        elif live:
            cache.free(rng.choice(live))
        _assert_allocator_consistent(cache)


def test_paged_append_out_of_blocks_raises_and_writes_nothing():
    cache = PagedKVCache(3, 4, 1, 1, 8, dtype=torch.float32, max_seqs=2)
    cache.allocate(0)
    cache.allocate(1, 8)
    with pytest.raises(ValueError, match="need 2 more, 1 free"):
        cache.append(0, torch.zeros(1, 5, 1, 8), torch.zeros(1, 5, 1, 8))
    assert cache.owned_blocks(0) == [] and cache.num_free_blocks == 1 and cache.seq_len(0, 0) == 0


def test_paged_append_past_a_sequence_block_limit_raises_and_writes_nothing():
    cache = PagedKVCache(8, 2, 1, 1, 8, dtype=torch.float32, max_seqs=2, max_blocks_per_seq=2)
    cache.allocate(0)
    cache.append(0, torch.ones(1, 3, 1, 8), torch.ones(1, 3, 1, 8))
    before = cache.k.clone()
    with pytest.raises(ValueError, match=r"sequence 0 would hold 5 tokens, over max_blocks_per_seq \* block_size = 4"):
        cache.append(0, torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    assert cache.seq_len(0, 0) == 3
    assert torch.equal(cache.k, before)


def test_paged_lifecycle_errors():
    cache = PagedKVCache(4, 2, 1, 1, 8, dtype=torch.float32, max_seqs=2)
    with pytest.raises(ValueError, match="not allocated"):
        cache.append(0, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    cache.allocate(0)
    with pytest.raises(ValueError, match="already allocated"):
        cache.allocate(0)
    with pytest.raises(ValueError, match="seq_id must be an int in"):
        cache.allocate(2)
    cache.free(0)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(0)


@pytest.mark.parametrize(
    "make, match, exc",
    [
        (lambda c: c.append(0, torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8)), r"must be \(B, T_new, 1, 8\)",
         ValueError),
        (lambda c: c.append(0, torch.zeros(1, 1, 1, 8, dtype=torch.float64), torch.zeros(1, 1, 1, 8)),
         "must be torch.float32", TypeError),
        (lambda c: c.append(0, torch.zeros(1, 1, 1, 8), torch.zeros(1, 2, 1, 8)), "same shape", ValueError),
        (lambda c: c.append(3, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)), "layer must be", ValueError),
        (lambda c: c.append(0, torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8), seq_ids=[1, 1]), "distinct",
         ValueError),
        (lambda c: c.append(0, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), seq_ids=[0.7]),
         "seq_ids must be a sequence of ints", TypeError),
        (lambda c: c.seq_len(0, -1), r"seq_id must be an int in \[0, 2\)", ValueError),
        (lambda c: c.append(0, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), seq_ids=[5]), "outside",
         ValueError),
        (lambda c: c.append(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), num_new=[3]), r"in \[0, 2\]",
         ValueError),
        (lambda c: c.set_scales(0, torch.ones(1), torch.ones(1)), "float8_e4m3fn caches", ValueError),
        (lambda c: KVCache(1, 1, 0, 1, 8), "max_seq_len must be a positive int", ValueError),
        (lambda c: KVCache(1, True, 4, 1, 8), "batch_size must be a positive int, got True", ValueError),
        (lambda c: KVCache(1, 1, 4, 1, 8, dtype=torch.int8), "dtype must be one of", TypeError),
    ],
)
def test_cache_input_checks(make, match, exc):
    cache = KVCache(1, 2, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(exc, match=match):
        make(cache)


def test_kv_append_tensor_level_checks():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    new = torch.zeros(2, 1, 1, 8)
    lengths = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale is required"):
        kv_append(new, new, kc, kc.clone(), lengths)
    with pytest.raises(ValueError, match="same shape and strides"):
        kv_append(new, new, kc, torch.zeros(2, 5, 1, 8, dtype=torch.float8_e4m3fn), lengths)
    with pytest.raises(TypeError, match="lengths must be int32 or int64"):
        kv_append(new, new, kc.float(), kc.float(), lengths.float())
    with pytest.raises(ValueError, match="seq_ids must have one entry per batch entry"):
        kv_append(new, new, kc.float(), kc.float(), lengths, seq_ids=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"v_new must be the cache dtype torch\.float16, got torch\.float32"):
        kv_append(new.half(), new, kc.half(), kc.half(), lengths)  # was converted silently


def test_reference_backend_append_and_decode(kvh, monkeypatch, seed, cache_kind):
    """CPU without the interpreter: the append and the decode run on torch indexing and the
    shared reference (`reference.kvcache.kv_append`, `reference.decode_attention` in float32).

    Checked against what does not go through that path: the cache contents (gathered by the
    separately tested `paged_gather`) must equal the dense tokens that were appended (for fp8,
    `quantize_fp8_per_head` of them, itself tested against the e4m3 grid in shared/tests), and
    the decode output must match the float64 reference on those dense tokens, never read from
    the cache. Catches tokens written to the wrong row, block, slot or position (ragged prefill
    then one-token appends, paged blocks shuffled), the wrong scale or saturation, a decode
    gathering the wrong blocks or rows, reading past a length (the unwritten slots are NaN),
    or dropping the fp8 scales.
    """
    monkeypatch.setattr(kv_ops.runtime, "backend", lambda x: "reference")
    from kernel_lab.inference_kvcache import decode_attention

    for dtype in (torch.float32, torch.float8_e4m3fn):
        cache = kvh.make_cache(cache_kind, batch=3, max_len=9, h_kv=2, d=8, dtype=dtype, device="cpu")
        lengths = [9, 0, 4]
        k, v = kvh.fill(cache, 0, lengths, dtype=torch.float32, seed=seed, prefill=3)
        scales = {}
        if dtype == torch.float8_e4m3fn:
            scales = {"k_scale": cache.k_scale[0], "v_scale": cache.v_scale[0]}
            k = reference.kvcache.quantize_fp8_per_head(k, scales["k_scale"])
            v = reference.kvcache.quantize_fp8_per_head(v, scales["v_scale"])
        got_k, got_v = kvh.dense_view(cache, 0, [0, 1, 2])
        for b, n in enumerate(lengths):
            assert torch.equal(got_k[b, :n], k[b, :n].double()), f"{dtype} keys of sequence {b}"
            assert torch.equal(got_v[b, :n], v[b, :n].double()), f"{dtype} values of sequence {b}"
        q = randn(3, 4, 8, seed=seed + 2)
        out = decode_attention(q, cache, 0)
        kvh.check_decode_dense(out, q, k, v, torch.tensor(lengths), name=f"reference-backend decode {dtype}",
                               **scales)


@pytest.mark.interpret
def test_kv_append_of_views_of_the_cache_matches_the_append_of_copies(kernel_device, seed):
    # k_new / v_new read from the cache's own storage, where the append writes: row r's tokens
    # 0..3 appended at 1..4 (token t lands on where t + 1 is read from), and across rows with
    # seq_ids [1, 0] (entry 0 writes row 1 while entry 1 reads it). Each program read its source
    # token after an earlier one had overwritten it (in order under the interpreter, a race on a
    # GPU): 3.5 off the append of copies. Swapped caches (k_new in v_cache) too.
    caches = randn(2, 2, 8, 2, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    lengths = torch.tensor([1, 1], dtype=torch.int32, device=kernel_device)
    cases = [
        lambda kc, vc: (kc[:, 0:4], vc[:, 0:4], {}),
        lambda kc, vc: (kc[:, 0:4], vc[:, 0:4], {"seq_ids": torch.tensor([1, 0], dtype=torch.int32,
                                                                           device=kernel_device)}),
        lambda kc, vc: (vc[:, 0:4], kc[:, 2:6], {}),
    ]
    for i, make in enumerate(cases):
        kc, vc = caches.clone().unbind(0)
        expected_k, expected_v = kc.clone(), vc.clone()
        k_new, v_new, kw = make(kc, vc)
        # the shared reference's append of copies of the views (a float16 cache stores exactly)
        reference.kv_append(k_new.clone(), v_new.clone(), expected_k, expected_v, lengths, **kw)
        kv_append(k_new, v_new, kc, vc, lengths, **kw)
        assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v), f"case {i}"


@pytest.mark.interpret
def test_cache_append_of_its_own_tokens_matches_the_append_of_copies(kvh, kernel_device, seed, cache_kind):
    # A sequence of 6 tokens re-appends its slots 4..7 at 6..9: slots 6, 7 (not yet written, NaN)
    # are both read and written. The paged view is the sequence's block 1 (slots 4..7).
    caches = [kvh.make_cache(cache_kind, batch=1, max_len=12, h_kv=2, d=16, dtype=torch.float16,
                             device=kernel_device, block_size=4) for _ in range(2)]
    for cache in caches:
        kvh.fill(cache, 0, [6], dtype=torch.float16, seed=seed, prefill=6)
    if cache_kind == "paged":
        views = [(c.k[0][c.owned_blocks(0)[1]][None], c.v[0][c.owned_blocks(0)[1]][None]) for c in caches]
    else:
        views = [(c.k[0][:, 4:8], c.v[0][:, 4:8]) for c in caches]
    caches[0].append(0, views[0][0].clone(), views[0][1].clone())
    caches[1].append(0, *views[1])
    for got, want in zip(kvh.dense_view(caches[1], 0, [0]), kvh.dense_view(caches[0], 0, [0]), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_reference_backend_append_of_a_view_of_the_cache(monkeypatch, seed):
    # torch's index_put refused the overlapping write (RuntimeError "... refer to a single memory
    # location"): the append now reads copies, as the kernels do.
    monkeypatch.setattr(kv_ops.runtime, "backend", lambda x: "reference")
    kc, vc = randn(2, 2, 8, 2, 8, seed=seed).unbind(0)
    expected_k, expected_v = kc.clone(), vc.clone()
    lengths = torch.tensor([1, 1], dtype=torch.int32)
    kv_append(kc[:, 0:4].clone(), vc[:, 0:4].clone(), expected_k, expected_v, lengths)
    kv_append(kc[:, 0:4], vc[:, 0:4], kc, vc, lengths)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)


@pytest.mark.interpret
def test_kv_append_refuses_one_cache_for_both_and_caches_with_shared_rows(kernel_device, seed):
    new = randn(2, 1, 2, 8, seed=seed, device=kernel_device)
    lengths = torch.zeros(2, dtype=torch.int32, device=kernel_device)
    kc = torch.zeros(2, 4, 2, 8, device=kernel_device)
    # every key was overwritten by its value
    with pytest.raises(ValueError, match="k_cache and v_cache must be different tensors"):
        kv_append(new, new + 1, kc, kc, lengths)
    # rows of an expanded cache are one memory: row 0 kept row 1's token
    def shared_rows():
        return torch.zeros(1, 4, 2, 8, device=kernel_device).expand(2, 4, 2, 8)

    with pytest.raises(ValueError, match="k_cache has elements that share memory"):
        kv_append(new, new, shared_rows(), shared_rows(), lengths)
    # legit: K and V interleaved in one packed buffer (B, T, 2, H, D) are disjoint views
    packed = torch.zeros(2, 4, 2, 2, 8, device=kernel_device)
    kv_append(new, new + 1, packed[:, :, 0], packed[:, :, 1], lengths)
    assert torch.equal(packed[:, 0, 0], new[:, 0]) and torch.equal(packed[:, 0, 1], new[:, 0] + 1)
