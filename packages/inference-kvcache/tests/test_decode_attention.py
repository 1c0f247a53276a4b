"""decode_attention / flash_decode against the float64 reference (FlashAttention KV-cache rule).

Budget: max|out - ref| <= 3 * max|baseline - ref| + atol, where the baseline is the same
reference computed in the query dtype (FlashAttention's KV-cache tests use 3x; see
docs/correctness.md). Under the interpreter tl.dot on bfloat16 is wrong, so the interpret
tier runs float16 and float32 and the gpu tier adds bfloat16.
"""

import pytest
import torch

from kernel_lab.inference_kvcache import KVCache, PagedKVCache, decode_attention, flash_decode, kv_append
from kernel_lab.inference_kvcache._kernels import _decode_split_kernel
from kernel_lab.shared import reference, shapes
from kernel_lab.shared.testing import randn, strided_rows


@pytest.mark.interpret
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 2), (16, 2), (8, 1)])  # GQA ratios 1, 4, 8, MQA
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged_gqa_matches_reference(kvh, kernel_device, seed, h_q, h_kv, num_splits):
    lengths = [0, 1, 37, 69]
    cache = kvh.make_cache("contiguous", batch=4, max_len=70, h_kv=h_kv, d=32, dtype=torch.float16,
                       device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=69)
    q = randn(4, h_q, 32, dtype=torch.float16, seed=seed + 7, device=kernel_device)
    out = decode_attention(q, cache, 0, num_splits=num_splits)
    kvh.check_decode(out, q, cache, 0)
    assert torch.equal(out[0], torch.zeros_like(out[0])), "an empty sequence gives zeros"


@pytest.mark.interpret
@pytest.mark.parametrize("d", [64, 128, 80])
def test_decode_merge_in_head_dim_chunks_matches_reference(kvh, kernel_device, seed, d):
    """One sequence of two query heads: fewer merge programs than SMs (runtime.sm_count, 4 under
    the interpreter), so the merge cuts each head into 32- or 64-column chunks; 80 is not a power
    of two (the last chunk is masked)."""
    cache = kvh.make_cache("contiguous", batch=1, max_len=50, h_kv=1, d=d, dtype=torch.float16, device=kernel_device)
    kvh.fill(cache, 0, [50], dtype=torch.float16, seed=seed, prefill=50)
    q = randn(1, 2, d, dtype=torch.float16, seed=seed + 3, device=kernel_device)
    kvh.check_decode(decode_attention(q, cache, 0, num_splits=3), q, cache, 0)


@pytest.mark.interpret
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_paged_gives_the_contiguous_result(kvh, kernel_device, seed, block_size):
    lengths = [23, 1, 0, 40]
    caches = [
        kvh.make_cache(kind, batch=4, max_len=41, h_kv=2, d=16, dtype=torch.float16, device=kernel_device,
                   block_size=block_size)
        for kind in ("contiguous", "paged")
    ]
    for c in caches:
        kvh.fill(c, 0, lengths, dtype=torch.float16, seed=seed, prefill=20)
    q = randn(4, 8, 16, dtype=torch.float16, seed=seed + 3, device=kernel_device)
    outs = [decode_attention(q, c, 0, num_splits=2) for c in caches]
    for out, cache in zip(outs, caches, strict=True):
        kvh.check_decode(out, q, cache, 0)
    # Paging only changes addresses: with the same tiles, the same sums in the same order. The
    # autotuner tunes the paged and the contiguous kernel separately (PAGED is in its key) and
    # may give them different BLOCK_N, hence a different summation order (on the H200: output
    # differences of 1e-4, within the rule above); with one config they must be identical.
    if len(_decode_split_kernel.configs) == 1:
        assert torch.equal(outs[0], outs[1])


@pytest.mark.interpret
def test_decode_split_and_unsplit_agree(kvh, kernel_device, seed, cache_kind):
    lengths = [97, 5, 64]
    cache = kvh.make_cache(cache_kind, batch=3, max_len=97, h_kv=1, d=32, dtype=torch.float32,
                       device=kernel_device, block_size=8)
    kvh.fill(cache, 0, lengths, dtype=torch.float32, seed=seed, prefill=97)
    q = randn(3, 4, 32, dtype=torch.float32, seed=seed + 1, device=kernel_device)
    for splits in (1, 4, None):
        kvh.check_decode(decode_attention(q, cache, 0, num_splits=splits), q, cache, 0)


@pytest.mark.interpret
@pytest.mark.parametrize("t_q", [2, 5])
def test_decode_speculative_queries_are_causal_among_themselves(kvh, kernel_device, seed, cache_kind, t_q):
    lengths = [1, 0, 13, 30]  # 1 < T_q: the earliest queries of sequence 0 see no key
    cache = kvh.make_cache(cache_kind, batch=4, max_len=30, h_kv=2, d=16, dtype=torch.float16,
                       device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=30)
    q = randn(4, t_q, 8, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    kvh.check_decode(decode_attention(q, cache, 0, num_splits=2), q, cache, 0)


@pytest.mark.interpret
def test_decode_several_masked_tiles_in_one_split(kvh, kernel_device, seed, cache_kind):
    """T_q = 8 queries end their keys at eight different positions, so with one split the tiles
    after the last fully visible one run masked, several of them when the length lands just past
    a tile boundary (38 and 70 with the interpreter's 32-key tiles): the block lookup carried
    from one masked tile to the next (paged) must be the next tile's."""
    lengths = [38, 70, 3]
    cache = kvh.make_cache(cache_kind, batch=3, max_len=70, h_kv=2, d=16, dtype=torch.float16,
                           device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=70)
    q = randn(3, 8, 4, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    kvh.check_decode(decode_attention(q, cache, 0, num_splits=1), q, cache, 0)


@pytest.mark.interpret
@pytest.mark.parametrize("h_q,h_kv,d", [(16, 1, 16), (4, 2, 256)])
def test_decode_eight_queries_per_sequence_and_wide_heads(kvh, kernel_device, seed, cache_kind, h_q, h_kv, d):
    """T_q = 8 (the most speculative tokens the issue asks for): MQA with 16 query heads packs
    16 x 8 = 128 rows, two M tiles of MAX_BLOCK_M = 64; and head dim 256, the widest supported."""
    lengths = [5, 40, 17]
    cache = kvh.make_cache(cache_kind, batch=3, max_len=40, h_kv=h_kv, d=d, dtype=torch.float16,
                           device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=40)
    q = randn(3, 8, h_q, d, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    kvh.check_decode(decode_attention(q, cache, 0, num_splits=2), q, cache, 0)


@pytest.mark.interpret
def test_decode_fp8_cache_matches_dequantized_reference(kvh, kernel_device, seed, cache_kind):
    lengths = [45, 0, 7]
    cache = kvh.make_cache(cache_kind, batch=3, max_len=45, h_kv=2, d=32, dtype=torch.float8_e4m3fn,
                       device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=45)
    q = randn(3, 8, 32, dtype=torch.float16, seed=seed + 5, device=kernel_device)
    for splits in (1, 2):
        kvh.check_decode(decode_attention(q, cache, 0, num_splits=splits), q, cache, 0)


@pytest.mark.interpret
def test_decode_fp8_cache_bfloat16_query_of_any_magnitude(kvh, kernel_device, seed, cache_kind):
    """A bfloat16 q over an fp8 cache runs a float16 MMA, each q row scaled by a power of two
    first (FP16_MMA in the kernel): rows far above float16's range (65504), far below its
    normal range, zero and ordinary still give the reference result. (This path needs no
    bfloat16 tl.dot, so the interpreter checks it too.)"""
    lengths = [45, 3]
    cache = kvh.make_cache(cache_kind, batch=2, max_len=45, h_kv=2, d=32, dtype=torch.float8_e4m3fn,
                           device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.bfloat16, seed=seed, prefill=45)
    row_scale = torch.tensor([1e6, 1.0, 3e-6, 0.0, 7e4, 1e-30, 2.0, 5e4], device=kernel_device)
    q = (randn(2, 8, 32, dtype=torch.float32, seed=seed + 5, device=kernel_device) * row_scale[:, None])
    q = q.to(torch.bfloat16)
    for splits in (1, 2):
        kvh.check_decode(decode_attention(q, cache, 0, num_splits=splits), q, cache, 0)


@pytest.mark.interpret
@pytest.mark.parametrize("d", [40, 64, 128])
def test_decode_head_dims_and_strided_query(kvh, kernel_device, seed, d):
    lengths = [19, 33]
    cache = kvh.make_cache("paged", batch=2, max_len=33, h_kv=2, d=d, dtype=torch.float16,
                       device=kernel_device, block_size=16)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=33)
    q = strided_rows(randn(2, 4, d, dtype=torch.float16, seed=seed + 1, device=kernel_device))
    kvh.check_decode(decode_attention(q, cache, 0, scale=0.2), q, cache, 0, scale=0.2)


@pytest.mark.interpret
def test_decode_seq_ids_select_and_reorder_sequences(kvh, kernel_device, seed, cache_kind):
    lengths = [9, 21, 0, 5]
    cache = kvh.make_cache(cache_kind, batch=4, max_len=21, h_kv=1, d=16, dtype=torch.float16,
                       device=kernel_device)
    kvh.fill(cache, 0, lengths, dtype=torch.float16, seed=seed, prefill=21)
    q = randn(3, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    out = decode_attention(q, cache, 0, seq_ids=[3, 1, 2])
    kvh.check_decode(out, q, cache, 0, rows=[3, 1, 2])


# ---------------------------------------------------------------------------------------
# input checks (no kernel runs)


def _tensor_args(**over):
    args = {
        "q": torch.zeros(2, 8, 16, dtype=torch.float16),
        "k_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float16),
        "v_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float16),
        "lengths": torch.zeros(2, dtype=torch.int32),
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        ({"q": torch.zeros(2, 8, 16)}, TypeError, "cache dtype torch.float16 must be q's dtype"),
        ({"q": torch.zeros(2, 8, 16, dtype=torch.int32)}, TypeError, "q must be float16"),
        ({"q": torch.zeros(8, 16, dtype=torch.float16)}, ValueError, "q must have 3 or 4 dims"),
        ({"q": torch.zeros(2, 6, 16, dtype=torch.float16).transpose(0, 0)[:, :3]}, ValueError,
         r"query heads \(3\) must be a multiple of kv heads \(2\)"),
        ({"q": torch.zeros(2, 8, 32, dtype=torch.float16)}, ValueError, r"head dim of q \(32\)"),
        ({"q": torch.zeros(3, 8, 16, dtype=torch.float16)}, ValueError, "q has 3 sequences"),
        ({"v_cache": torch.zeros(2, 5, 2, 16, dtype=torch.float16)}, ValueError, "same shape and strides"),
        ({"lengths": torch.zeros(3, dtype=torch.int32)}, ValueError, "one entry per cache row"),
        ({"lengths": torch.zeros(2)}, TypeError, "lengths must be int32 or int64"),
        ({"block_table": torch.zeros(2, 3)}, TypeError, "block_table must be int32 or int64"),
        ({"seq_ids": torch.zeros(1, dtype=torch.int32)}, ValueError, "one entry per query row"),
        ({"k_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn),
          "v_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn)}, ValueError, "k_scale is required"),
        ({"k_scale": torch.ones(2)}, ValueError, "apply to float8_e4m3fn caches only"),
        ({"num_splits": 0}, ValueError, "num_splits must be a positive int"),
        # a bool is an int to isinstance: True reached the kernels as a 1-bit constant
        ({"num_splits": True}, ValueError, "num_splits must be a positive int, got True"),
        # a NaN or infinite scale gave NaN outputs (zeros on the reference backend)
        *(({"scale": bad}, ValueError, "scale must be positive and finite")
          for bad in (float("nan"), float("inf"), 0.0, -0.125)),
        ({"scale": "0.1x"}, TypeError, "scale must be a float"),
        ({"scale": True}, TypeError, "scale must be a float, got True"),  # ran as scale=1.0
        ({"max_len": 4.0}, ValueError, "max_len must be an int >= 0"),  # AttributeError from the split plan
        ({"max_len": -1}, ValueError, "max_len must be an int >= 0"),
    ],
)
def test_flash_decode_input_checks(over, exc, match):
    with pytest.raises(exc, match=match):
        flash_decode(**_tensor_args(**over))


def _paged_args(table, lengths, **over):
    """flash_decode arguments over a pool of 5 blocks of 4 tokens (2 kv heads, D = 16)."""
    args = {
        "q": torch.zeros(len(lengths), 8, 16, dtype=torch.float16),
        "k_cache": torch.zeros(5, 4, 2, 16, dtype=torch.float16),
        "v_cache": torch.zeros(5, 4, 2, 16, dtype=torch.float16),
        "lengths": torch.tensor(lengths, dtype=torch.int32),
        "block_table": torch.tensor(table, dtype=torch.int32),
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    "args, match",
    [
        (_tensor_args(lengths=torch.tensor([4, 5], dtype=torch.int32)), r"lengths must be at most 4 .*got 5"),
        (_tensor_args(lengths=torch.tensor([-1, 2], dtype=torch.int32)), r"lengths must be >= 0, got -1"),
        (_tensor_args(seq_ids=torch.tensor([1, 2], dtype=torch.int32)), r"seq_ids must be cache rows in \[0, 2\)"),
        (_tensor_args(seq_ids=torch.tensor([-1, 0], dtype=torch.int32)), r"seq_ids must be cache rows"),
        # row 1 holds 5 tokens: its entries 0 and 1 are read, and entry 1 is past the pool's 5 blocks
        (_paged_args([[0, 1, 9], [2, 5, 9]], [3, 5]), r"block_table entries .* in \[0, 5\); got values in \[0, 5\]"),
        (_paged_args([[-1, 1, 9], [2, 3, 9]], [3, 5]), r"block_table entries .* got values in \[-1, 3\]"),
        (_paged_args([[0, 1, 9], [2, 3, 4]], [3, 13]), r"lengths must be at most 12 .*got 13"),
        # int64 values are checked as given, not after the int32 copy the kernels read (2**32 + 3
        # wrapped to 3, 2**32 + 1 to block 1: a silent read of the wrong tokens)
        (_tensor_args(lengths=torch.tensor([2**32 + 3, 0])), r"lengths must be at most 4 .*got 4294967299"),
        (_paged_args([[0, 1, 9], [2, 3, 9]], [5, 5], block_table=torch.tensor([[0, 2**32 + 1, 9], [2, 3, 9]])),
         r"block_table entries .* got values in \[0, 4294967297\]"),
    ],
)
def test_flash_decode_index_values_are_checked(args, match):
    """Values the kernels would follow out of the cache (a row id, a length past the row, a block
    id past the pool) raise instead of reading out of bounds."""
    with pytest.raises(ValueError, match=match):
        flash_decode(**args)


@pytest.mark.interpret
def test_block_table_entries_past_the_cached_tokens_are_not_read(kvh, kernel_device, seed):
    """Only the entries covering a row's tokens are checked and read: the rest may hold
    anything (-1 here, as padding), and the result equals the decode over a clean table."""
    k = randn(5, 4, 2, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    v = randn(5, 4, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    q = randn(2, 8, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    lengths = torch.tensor([3, 6], dtype=torch.int32, device=kernel_device)
    padded = torch.tensor([[4, -1, -1], [0, 2, -1]], dtype=torch.int32, device=kernel_device)
    clean = torch.tensor([[4, 0, 0], [0, 2, 0]], dtype=torch.int32, device=kernel_device)
    out = flash_decode(q, k, v, lengths, block_table=padded, num_splits=2)
    torch.testing.assert_close(out, flash_decode(q, k, v, lengths, block_table=clean, num_splits=2), rtol=0, atol=0)
    gather = lambda pool: reference.paged_gather(pool, clean, lengths, compute_dtype=pool.dtype)
    kvh.check_decode_dense(out, q, gather(k), gather(v), lengths)


@pytest.mark.interpret
def test_strided_int32_index_tensors_are_read_by_value(kvh, kernel_device, seed):
    """lengths, seq_ids and counts as strided int32 views and a column-major block table give the
    results of their contiguous copies (the kernels index them at unit stride)."""
    def strided(t):  # the same values at twice the stride (a column of a wider table)
        return torch.stack([t, t * 0 - 7], dim=-1)[..., 0]

    lengths = torch.tensor([5, 0, 11], dtype=torch.int32, device=kernel_device)
    table = torch.tensor([[0, 3, 9], [1, 2, 4], [6, 5, 8]], dtype=torch.int32, device=kernel_device)
    column_major = table.t().contiguous().t()
    k = randn(10, 4, 2, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    v = randn(10, 4, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    q = randn(2, 4, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    seq_ids = torch.tensor([2, 0], dtype=torch.int32, device=kernel_device)
    want = flash_decode(q, k, v, lengths, block_table=table, seq_ids=seq_ids, num_splits=2)
    got = flash_decode(q, k, v, strided(lengths), block_table=column_major, seq_ids=strided(seq_ids), num_splits=2)
    assert torch.equal(got, want)
    rows = seq_ids.long()
    gather = lambda pool: reference.paged_gather(pool, table[rows], lengths[rows], compute_dtype=pool.dtype)
    kvh.check_decode_dense(got, q, gather(k), gather(v), lengths[rows])

    caches = [torch.zeros(3, 6, 2, 16, dtype=torch.float16, device=kernel_device) for _ in range(4)]
    new = randn(2, 3, 2, 16, dtype=torch.float16, seed=seed + 3, device=kernel_device)
    start = torch.tensor([1, 2, 0], dtype=torch.int32, device=kernel_device)
    counts = torch.tensor([3, 2], dtype=torch.int32, device=kernel_device)
    kv_append(new, new, caches[0], caches[1], start, seq_ids=seq_ids, counts=counts)
    kv_append(new, new, caches[2], caches[3], strided(start), seq_ids=strided(seq_ids), counts=strided(counts))
    assert torch.equal(caches[2], caches[0]) and caches[0].abs().sum() > 0


@pytest.mark.interpret
def test_strided_fp8_scales_are_read_by_value(kernel_device, seed):
    """k_scale / v_scale as strided views (a column of a wider table) give the results of their
    contiguous copies in kv_append and flash_decode (the kernels read them at unit stride: the
    append stored, and the decode read, with the wrong heads' scales)."""
    wide = torch.tensor([[0.5, 9.0], [0.25, 9.0]], device=kernel_device)
    strided, dense = wide[:, 0], wide[:, 0].contiguous()
    assert not strided.is_contiguous()
    new = randn(2, 3, 2, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn, device=kernel_device) for _ in range(4)]
    lengths = torch.zeros(2, dtype=torch.int32, device=kernel_device)
    kv_append(new, new, caches[0], caches[1], lengths, k_scale=dense, v_scale=dense)
    kv_append(new, new, caches[2], caches[3], lengths, k_scale=strided, v_scale=strided)
    assert torch.equal(caches[2].float(), caches[0].float()) and caches[0].float().abs().sum() > 0
    q = randn(2, 4, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    lengths += 3
    want = flash_decode(q, caches[0], caches[1], lengths, k_scale=dense, v_scale=dense, num_splits=2)
    got = flash_decode(q, caches[0], caches[1], lengths, k_scale=strided, v_scale=strided, num_splits=2)
    assert torch.equal(got, want)


def test_kv_append_index_values_are_checked():
    kc = torch.zeros(2, 4, 1, 8)
    new = torch.zeros(2, 3, 1, 8)
    zeros = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lengths \+ new tokens must be at most 4 .*got 5"):
        kv_append(new, new, kc, kc.clone(), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got -1"):  # a write before the row
        kv_append(new, new, kc, kc.clone(), torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 3\] \(T_new\), got values in \[3, 5\]"):
        kv_append(new, new, kc, kc.clone(), zeros, counts=torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_ids must be cache rows in \[0, 2\)"):
        kv_append(new, new, kc, kc.clone(), zeros, seq_ids=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="seq_ids of an append must be distinct"):
        kv_append(new, new, kc, kc.clone(), zeros, seq_ids=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"lengths must have one entry per cache row \(2\), got 3"):
        kv_append(new, new, kc, kc.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="k_new has 3 sequences but the cache has 2 rows"):
        kv_append(torch.zeros(3, 1, 1, 8), torch.zeros(3, 1, 1, 8), kc, kc.clone(), zeros)
    pool = torch.zeros(3, 2, 1, 8)  # 3 blocks of 2 tokens; row 0 writes tokens 1..3: entries 0 and 1
    with pytest.raises(ValueError, match=r"block_table entries .* in \[0, 3\); got values in \[0, 3\]"):
        kv_append(new[:1], new[:1], pool, pool.clone(), torch.tensor([1], dtype=torch.int32),
                  block_table=torch.tensor([[0, 3, 7]], dtype=torch.int32))


def test_decode_attention_checks_cache_and_sequences():
    q = torch.zeros(1, 4, 8)
    with pytest.raises(TypeError, match="cache must be a KVCache or PagedKVCache"):
        decode_attention(q, object(), 0)
    paged = PagedKVCache(4, 2, 1, 1, 8, dtype=torch.float32, max_seqs=2)
    with pytest.raises(ValueError, match="sequence 0 is not allocated"):
        decode_attention(q, paged, 0)
    with pytest.raises(ValueError, match="layer must be an int in"):
        decode_attention(q, KVCache(1, 1, 4, 1, 8, dtype=torch.float32), 1)
    with pytest.raises(ValueError, match="scale must be positive and finite, got nan"):
        decode_attention(q, KVCache(1, 1, 4, 1, 8, dtype=torch.float32), 0, scale=float("nan"))


# ---------------------------------------------------------------------------------------
# gpu tier: LLM sizes


@pytest.mark.gpu
@pytest.mark.parametrize("kind,dtype", [("contiguous", torch.bfloat16), ("paged", torch.bfloat16),
                                        ("contiguous", torch.float8_e4m3fn), ("paged", torch.float16)])
def test_decode_llama3_8b_long_context_matches_reference(kvh, seed, kind, dtype):
    m = shapes.model("llama-3-8b")
    t = 128 * 1024
    q_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    if kind == "contiguous":
        cache = KVCache(1, 1, t, m.num_kv_heads, m.head_dim, dtype=dtype, device="cuda")
    else:
        cache = PagedKVCache(t // 16 + 1, 16, 1, m.num_kv_heads, m.head_dim, dtype=dtype, device="cuda",
                             max_seqs=1)
        cache.allocate(0)
    k = randn(1, t, m.num_kv_heads, m.head_dim, dtype=q_dtype, seed=seed, device="cuda")
    v = randn(1, t, m.num_kv_heads, m.head_dim, dtype=q_dtype, seed=seed + 1, device="cuda")
    cache.append(0, k[:, : t - 1], v[:, : t - 1])
    cache.append(0, k[:, t - 1 :], v[:, t - 1 :])
    if dtype == torch.float8_e4m3fn:  # the GPU's cast: the same bytes as torch's quantization
        expected = reference.kvcache.quantize_fp8_per_head(k[0], cache.k_scale[0], dtype)
        assert torch.equal(cache.k[0, 0].view(torch.uint8), expected.view(torch.uint8))
    q = randn(1, m.num_heads, m.head_dim, dtype=q_dtype, seed=seed + 2, device="cuda", scale=3.0)
    out = decode_attention(q, cache, 0)
    kvh.check_decode(out, q, cache, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_ragged_batch_gpu(kvh, seed, cache_kind, d):
    lengths = [8191, 1, 0, 4096, 3000, 17, 512, 8000]
    cache = kvh.make_cache(cache_kind, batch=8, max_len=8192, h_kv=4, d=d, dtype=torch.bfloat16,
                       device="cuda", block_size=16)
    kvh.fill(cache, 0, lengths, dtype=torch.bfloat16, seed=seed, prefill=8190)
    q = randn(8, 3, 32, d, dtype=torch.bfloat16, seed=seed + 1, device="cuda")
    kvh.check_decode(decode_attention(q, cache, 0), q, cache, 0)


@pytest.mark.gpu
def test_decode_under_torch_compile_fullgraph(kvh, seed):
    cache = KVCache(1, 4, 2048, 8, 128, dtype=torch.bfloat16, device="cuda")
    kvh.fill(cache, 0, [2048, 100, 1, 1500], dtype=torch.bfloat16, seed=seed, prefill=2048)
    q = randn(4, 32, 128, dtype=torch.bfloat16, seed=seed + 1, device="cuda")

    def step(q, k, v, lengths):
        return flash_decode(q * 1.0, k, v, lengths, num_splits=4) + 0.0

    compiled = torch.compile(step, fullgraph=True)
    out = compiled(q, cache.k[0], cache.v[0], cache.lengths(0))
    torch.testing.assert_close(out, flash_decode(q, cache.k[0], cache.v[0], cache.lengths(0), num_splits=4))
    kvh.check_decode(out, q, cache, 0)


@pytest.mark.gpu
def test_decode_under_cuda_graph_compile_matches_eager(kvh, seed):
    """torch.compile(mode="reduce-overhead"): cudagraph trees warm the custom op up outside
    capture with every allocation in the graph's memory pool, then capture it; the op's split
    scratch must be per call there (a kept one was refused as a live untracked pool tensor)."""
    torch._dynamo.reset()
    cache = KVCache(1, 2, 4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    kvh.fill(cache, 0, [4096, 3000], dtype=torch.bfloat16, seed=seed, prefill=4096)
    args = (cache.k[0], cache.v[0], cache.lengths(0))

    def step(q, k, v, lengths):
        return flash_decode(q * 1.0, k, v, lengths, num_splits=8) + 0.0

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(3):  # warm-up, capture, replay
        q = randn(2, 32, 128, dtype=torch.bfloat16, seed=seed + 1 + i, device="cuda")
        out = compiled(q, *args).clone()
        assert torch.equal(out, flash_decode(q, *args, num_splits=8))
    kvh.check_decode(out, q, cache, 0)


# ---------------------------------------------------------------------------------------
# torch.library registration


@pytest.mark.interpret
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_decode_and_append_compile_fullgraph_match_eager(kvh, kernel_device, dynamic, seed):
    """fullgraph=True: no graph break around either custom op; results equal the eager ones,
    for a new batch size too."""
    torch._dynamo.reset()
    cache = kvh.make_cache("paged", batch=3, max_len=40, h_kv=2, d=16, dtype=torch.float16,
                           device=kernel_device)
    kvh.fill(cache, 0, [37, 5, 20], dtype=torch.float16, seed=seed, prefill=40)
    backend = "inductor" if kernel_device == "cuda" else "aot_eager"

    def step(q, k, v, lengths, table):
        return flash_decode(q * 1.0, k, v, lengths, block_table=table, num_splits=3) + 0.0

    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=dynamic)
    for batch in (2, 3):
        q = randn(batch, 8, 16, dtype=torch.float16, seed=seed + batch, device=kernel_device)
        args = (cache.k[0], cache.v[0], cache.lengths(0)[:batch], cache.block_table[:batch])
        out = compiled(q, *args)
        assert torch.equal(out, flash_decode(q, *args[:3], block_table=args[3], num_splits=3))
        kvh.check_decode(out, q, cache, 0, rows=list(range(batch)))

    def append(k_new, k_cache, v_cache, lengths):
        kv_append(k_new * 1.0, k_new, k_cache, v_cache, lengths)

    k_cache = torch.zeros(2, 8, 2, 16, dtype=torch.float16, device=kernel_device)
    v_cache = torch.zeros_like(k_cache)
    k_new = randn(2, 3, 2, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    lengths = torch.tensor([0, 4], dtype=torch.int32, device=kernel_device)
    torch.compile(append, fullgraph=True, backend=backend, dynamic=dynamic)(k_new, k_cache, v_cache, lengths)
    assert torch.equal(k_cache[0, :3], k_new[0]) and torch.equal(v_cache[1, 4:7], k_new[1])


@pytest.mark.interpret
def test_custom_ops_pass_opcheck(kernel_device, seed):
    q = randn(2, 8, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    k = randn(2, 20, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    lengths = torch.tensor([20, 3], dtype=torch.int32, device=kernel_device)
    torch.library.opcheck(torch.ops.kernel_lab.kvcache_decode.default,
                          (q, k, k.clone(), lengths, None, None, None, None, 0.25, 2))
    k_new = randn(2, 1, 2, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device)
    torch.library.opcheck(torch.ops.kernel_lab.kvcache_append.default,
                          (k_new, k_new, k.clone(), k.clone(), lengths - 1, None, None, None, None, None))


@pytest.mark.interpret
def test_backward_through_decode_raises(kernel_device, seed):
    """Inference only: with a query that requires grad, a backward raises instead of silently
    dropping the attention's gradient."""
    k = randn(2, 8, 2, 16, dtype=torch.float16, seed=seed, device=kernel_device)
    v = randn(2, 8, 2, 16, dtype=torch.float16, seed=seed + 1, device=kernel_device)
    q = randn(2, 4, 16, dtype=torch.float16, seed=seed + 2, device=kernel_device).requires_grad_(True)
    lengths = torch.tensor([8, 5], dtype=torch.int32, device=kernel_device)
    out = flash_decode(q, k, v, lengths)
    with pytest.raises(RuntimeError, match="flash_decode is forward only"):
        (out.float().sum() + q.float().sum()).backward()


@pytest.mark.gpu
def test_decode_and_append_run_on_the_cache_gpu_not_the_current_one(kvh, seed):
    """A model spread over GPUs (device_map="auto") keeps each layer's cache on its GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cache = kvh.make_cache("paged", batch=2, max_len=64, h_kv=2, d=64, dtype=torch.bfloat16, device="cuda:1")
    with torch.cuda.device(0):
        kvh.fill(cache, 0, [64, 9], dtype=torch.bfloat16, seed=seed, prefill=64)
        q = randn(2, 8, 64, dtype=torch.bfloat16, seed=seed + 1, device="cuda:1")
        out = decode_attention(q, cache, 0)
    kvh.check_decode(out, q, cache, 0)
