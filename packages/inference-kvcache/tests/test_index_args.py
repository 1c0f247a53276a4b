"""seq_ids, num_new and scalar seq_id arguments of the cache classes and decode_attention: ints of
any integer type are accepted alike; floats and bools are refused, on a first call and on a
repeated one (the memoized seq_ids tensors must never change the answer)."""

import pytest
import torch

from kernel_lab.inference_kvcache import KVCache, PagedKVCache, decode_attention

np = pytest.importorskip("numpy")

D = 16


def _cache(kind: str, layers: int = 1):
    """Sequences 0 and 1 hold 3 and 2 tokens at every layer; 3 rows (paged: max_seqs 3)."""
    if kind == "contiguous":
        cache = KVCache(layers, 3, 8, 1, D, dtype=torch.float32)
    else:
        cache = PagedKVCache(8, 4, layers, 1, D, dtype=torch.float32, max_seqs=3)
        cache.allocate(0)
        cache.allocate(1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 1, D, generator=g)
    v = torch.randn(2, 3, 1, D, generator=g)
    for layer in range(layers):
        cache.append(layer, k, v, num_new=[3, 2])
    return cache


def _q(bsz: int = 2) -> torch.Tensor:
    return torch.randn(bsz, 2, D, generator=torch.Generator().manual_seed(1))


NOT_INTS = {
    "float list": [1.0, 0.0],
    "bool list": [True, False],
    "numpy float scalars": [np.float64(1), np.float64(0)],
    "numpy bool scalars": [np.True_, np.False_],
    "bool 0-d tensors": [torch.tensor(True), torch.tensor(False)],
    "float tuple": (1.0, 0.0),
    "nested lists": [[1], [0]],
    "numpy float array": np.array([1.0, 0.0]),
    "numpy bool array": np.array([True, False]),
    "bool tensor": torch.tensor([True, False]),
    "float tensor": torch.tensor([1.0, 0.0]),
    "complex tensor": torch.tensor([1, 0], dtype=torch.complex64),
}

INTS = {
    "list": [1, 0],
    "tuple": (1, 0),
    "numpy int64 scalars": [np.int64(1), np.int64(0)],
    "int 0-d tensors": [torch.tensor(1), torch.tensor(0)],
    "numpy int64 array": np.array([1, 0]),
    "numpy int32 array": np.array([1, 0], dtype=np.int32),
    "numpy uint8 array": np.array([1, 0], dtype=np.uint8),
    **{f"{dt} tensor": torch.tensor([1, 0], dtype=dt)
       for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)},
    "strided int64 tensor": torch.tensor([1, 9, 0, 9])[::2],
}

SEQ_IDS_ERROR = "seq_ids must be a (sequence of ints|1-D integer tensor)"


@pytest.mark.parametrize("seq_ids", NOT_INTS.values(), ids=NOT_INTS.keys())
def test_decode_refuses_non_integer_seq_ids_before_and_after_the_int_list_is_memoized(cache_kind, seq_ids):
    cache = _cache(cache_kind)
    q = _q()
    with pytest.raises(TypeError, match=SEQ_IDS_ERROR):
        decode_attention(q, cache, 0, seq_ids=seq_ids)
    # [1, 0] and [0, 1] now have memo entries; 1.0 == 1 == True (same hash) must not find them
    for rows in ([1, 0], [0, 1]):
        decode_attention(q, cache, 0, seq_ids=rows)
    assert (1, 0) in cache._seq_ids_memo
    with pytest.raises(TypeError, match=SEQ_IDS_ERROR):
        decode_attention(q, cache, 0, seq_ids=seq_ids)


@pytest.mark.parametrize("seq_ids", NOT_INTS.values(), ids=NOT_INTS.keys())
def test_append_and_reset_refuse_non_integer_seq_ids_and_num_new(cache_kind, seq_ids):
    cache = _cache(cache_kind)
    cache.append(0, torch.zeros(2, 1, 1, D), torch.zeros(2, 1, 1, D), seq_ids=[1, 0])  # memoizes (1, 0)
    before = [list(h) for h in cache._host_lengths]
    new = torch.ones(2, 1, 1, D)
    with pytest.raises(TypeError, match=SEQ_IDS_ERROR):
        cache.append(0, new, new, seq_ids=seq_ids)
    with pytest.raises(TypeError, match="num_new must be a"):
        cache.append(0, new, new, num_new=seq_ids)
    if cache_kind == "contiguous":
        with pytest.raises(TypeError, match=SEQ_IDS_ERROR):
            cache.reset(seq_ids)
    assert cache._host_lengths == before
    assert cache.lengths(0).tolist() == before[0]


@pytest.mark.parametrize("seq_ids", INTS.values(), ids=INTS.keys())
def test_integer_seq_ids_of_any_type_give_the_same_decode_and_append(cache_kind, seq_ids):
    q = _q()
    expected = decode_attention(q, _cache(cache_kind), 0, seq_ids=[1, 0])
    cache = _cache(cache_kind)
    for _ in range(2):  # the first call and the memoized one
        assert torch.equal(decode_attention(q, cache, 0, seq_ids=seq_ids), expected)
    cache.append(0, torch.ones(2, 2, 1, D), torch.ones(2, 2, 1, D), seq_ids=seq_ids, num_new=seq_ids)
    assert cache._host_lengths[0][:2] == [3, 3]  # seq 1 got 1 token (2 -> 3), seq 0 none
    assert cache.lengths(0).tolist()[:2] == [3, 3]
    if cache_kind == "contiguous":
        cache.reset(seq_ids)
        assert cache._host_lengths[0] == [0, 0, 0]


def test_decode_seq_ids_range_duplicates_and_empty(cache_kind):
    cache = _cache(cache_kind)
    q = _q()
    bad_range = r"seq_id -?\d+ is outside \[0, 3\)" if cache_kind == "contiguous" else "is not allocated"
    for rows in ([-1, 0], [0, 3], [0, 2**40]):
        for _ in range(2):
            with pytest.raises(ValueError, match=bad_range):
                decode_attention(q, cache, 0, seq_ids=rows)
            with pytest.raises(ValueError, match=bad_range):
                decode_attention(q, cache, 0, seq_ids=torch.tensor(rows))
    # decode only reads: a repeated sequence is allowed and reads the same row
    out = decode_attention(q, cache, 0, seq_ids=[1, 1])
    assert torch.equal(out, decode_attention(q, cache, 0, seq_ids=torch.tensor([1, 1], dtype=torch.int16)))
    single = decode_attention(q[:1], cache, 0, seq_ids=[1])
    assert torch.equal(out[0], single[0])
    with pytest.raises(ValueError, match="seq_ids must have 2 entries"):
        decode_attention(q, cache, 0, seq_ids=[])
    assert decode_attention(q[:0], cache, 0, seq_ids=[]).shape == (0, 2, D)


def test_append_seq_ids_range_duplicates_and_empty(cache_kind):
    cache = _cache(cache_kind)
    new = torch.ones(2, 1, 1, D)
    for rows in ([-1, 0], [0, 3], [0, 2**40], torch.tensor([0, -1], dtype=torch.int8)):
        with pytest.raises(ValueError, match=r"seq_id -?\d+ is outside \[0, 3\)"):
            cache.append(0, new, new, seq_ids=rows)
    for rows in ([1, 1], torch.tensor([1, 1], dtype=torch.uint8), np.array([0, 0])):
        with pytest.raises(ValueError, match="seq_ids must be distinct"):
            cache.append(0, new, new, seq_ids=rows)
    with pytest.raises(ValueError, match=r"num_new entries must be in \[0, 1\], got -1"):
        cache.append(0, new, new, num_new=[-1, 0])
    cache.append(0, new[:0], new[:0], seq_ids=[], num_new=[])  # an empty batch writes nothing
    assert cache._host_lengths[0] == [3, 2, 0]


def test_kvcache_reset_seq_ids():
    cache = _cache("contiguous")
    cache.reset([])
    assert cache._host_lengths[0] == [3, 2, 0]
    cache.reset([1, 1])  # repeating a sequence is harmless here
    assert cache._host_lengths[0] == [3, 0, 0] and cache.lengths(0).tolist() == [3, 0, 0]
    for rows in ([-1], [3]):
        with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
            cache.reset(rows)
    cache.reset()
    assert cache._host_lengths[0] == [0, 0, 0]


@pytest.mark.parametrize("bad", [0.0, 1.0, True, False, np.float64(0), torch.tensor(True), "0", None, -1, 3],
                         ids=["0.0", "1.0", "True", "False", "np.float64", "bool tensor", "str", "None", "-1", "3"])
def test_paged_scalar_seq_id_arguments_refuse_non_ints_and_change_nothing(bad):
    cache = _cache("paged")
    live, free, owned = cache.live_sequences(), cache.num_free_blocks, {s: cache.owned_blocks(s) for s in (0, 1)}
    epoch = cache._epoch
    with pytest.raises(ValueError, match=r"seq_id must be an int in \[0, 3\)"):
        cache.free(bad)  # free(0.0) used to free sequence 0 and then raise; free(True) freed 1
    with pytest.raises(ValueError, match=r"seq_id must be an int in \[0, 3\)"):
        cache.owned_blocks(bad)
    with pytest.raises(ValueError, match=r"seq_id must be an int in \[0, 3\)"):
        cache.allocate(bad)
    with pytest.raises(ValueError, match=r"seq_id must be an int in \[0, 3\)"):
        cache.seq_len(0, bad)
    assert cache.live_sequences() == live and cache.num_free_blocks == free and cache._epoch == epoch
    assert {s: cache.owned_blocks(s) for s in (0, 1)} == owned
    assert cache._host_lengths[0] == [3, 2, 0]


@pytest.mark.parametrize("seq_id", [2, np.int64(2), np.int32(2), torch.tensor(2), torch.tensor(2, dtype=torch.uint8)],
                         ids=["int", "np.int64", "np.int32", "int64 tensor", "uint8 tensor"])
def test_paged_scalar_seq_id_arguments_accept_any_integer_type(seq_id):
    cache = _cache("paged")
    cache.allocate(seq_id, 5)
    assert cache.live_sequences() == [0, 1, 2] and all(type(s) is int for s in cache.live_sequences())
    assert cache.owned_blocks(seq_id) == cache.owned_blocks(2) and len(cache.owned_blocks(2)) == 2
    assert cache.seq_len(0, seq_id) == 0
    cache.free(seq_id)
    assert cache.live_sequences() == [0, 1]
    with pytest.raises(ValueError, match="sequence 2 is not allocated"):
        cache.free(seq_id)


def test_kvcache_seq_len_and_layer_refuse_bools():
    cache = _cache("contiguous", layers=2)
    assert cache.seq_len(1, np.int64(1)) == 2
    with pytest.raises(ValueError, match=r"seq_id must be an int in \[0, 3\)"):
        cache.seq_len(0, True)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.lengths(True)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        decode_attention(_q(), cache, True)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.append(True, torch.ones(2, 1, 1, D), torch.ones(2, 1, 1, D))
