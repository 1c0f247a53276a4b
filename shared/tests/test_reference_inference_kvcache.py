"""The KV-cache references against independent PyTorch math (float64 SDPA, explicit scatter,
the float8 e4m3 grid)."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import reference
from kernel_lab.shared.testing import make_generator, randn


def _sdpa_one(q, k, v, n, scale):
    """SDPA (float64, explicit boolean mask) for one sequence: q (Tq, Hq, D), k/v (n, Hkv, D)."""
    t_q = q.shape[0]
    pos_q = torch.arange(n - t_q, n)[:, None]
    allowed = torch.arange(n)[None, :] <= pos_q  # (Tq, n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("t_q", [1, 3])
def test_decode_attention_reference_matches_sdpa_float64(seed, h_q, h_kv, t_q):
    bsz, t_max, d = 3, 21, 16
    lengths = torch.tensor([21, 7, 3])
    q = randn(bsz, t_q, h_q, d, dtype=torch.float64, seed=seed)
    k = randn(bsz, t_max, h_kv, d, dtype=torch.float64, seed=seed + 1)
    v = randn(bsz, t_max, h_kv, d, dtype=torch.float64, seed=seed + 2)
    out = reference.decode_attention(q, k, v, lengths, scale=0.3)
    for b in range(bsz):
        n = int(lengths[b])
        expected = _sdpa_one(q[b], k[b, :n], v[b, :n], n, 0.3)
        torch.testing.assert_close(out[b], expected, rtol=1e-12, atol=1e-12)


def test_decode_attention_reference_3d_query_and_default_scale(seed):
    q = randn(2, 4, 8, dtype=torch.float64, seed=seed)
    k = randn(2, 5, 2, 8, dtype=torch.float64, seed=seed + 1)
    v = randn(2, 5, 2, 8, dtype=torch.float64, seed=seed + 2)
    lengths = torch.tensor([5, 2])
    out = reference.decode_attention(q, k, v, lengths)
    assert out.shape == (2, 4, 8) and out.dtype == torch.float64
    for b in range(2):
        n = int(lengths[b])
        expected = _sdpa_one(q[b][None], k[b, :n], v[b, :n], n, 8**-0.5)[0]
        torch.testing.assert_close(out[b], expected, rtol=1e-12, atol=1e-12)


def test_decode_attention_reference_empty_sequences_give_zeros(seed):
    q = randn(2, 2, 2, 8, dtype=torch.float64, seed=seed)
    k = randn(2, 4, 1, 8, dtype=torch.float64, seed=seed + 1)
    lengths = torch.tensor([0, 1])  # b=1: T_q=2 > length, so query 0 sits at position -1
    out = reference.decode_attention(q, k, k, lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    torch.testing.assert_close(out[1, 1], k[1, 0].expand(2, 8), rtol=0, atol=0)


def test_decode_attention_reference_dequantizes_fp8_with_per_head_scales(seed):
    k = (randn(1, 6, 2, 8, seed=seed) * 50).to(torch.float8_e4m3fn)
    v = (randn(1, 6, 2, 8, seed=seed + 1) * 50).to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.02, 0.5]), torch.tensor([0.1, 0.03])
    q = randn(1, 4, 8, dtype=torch.float64, seed=seed + 2)
    lengths = torch.tensor([6])
    out = reference.decode_attention(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale)
    k_real = k.double() * k_scale.double()[:, None]
    v_real = v.double() * v_scale.double()[:, None]
    torch.testing.assert_close(out, reference.decode_attention(q, k_real, v_real, lengths))


def test_paged_gather_reference_inverts_a_scatter(seed):
    bsz, block_size, h, d = 3, 4, 2, 5
    lengths = torch.tensor([9, 0, 4])
    max_blocks = 3
    num_blocks = bsz * max_blocks + 2
    g = make_generator(seed)
    block_table = torch.randperm(num_blocks, generator=g)[: bsz * max_blocks].view(bsz, max_blocks)
    dense = randn(bsz, max_blocks * block_size, h, d, dtype=torch.float64, seed=seed)
    pool = torch.full((num_blocks, block_size, h, d), float("nan"), dtype=torch.float64)
    for b in range(bsz):
        for t in range(int(lengths[b])):
            pool[block_table[b, t // block_size], t % block_size] = dense[b, t]
    out = reference.paged_gather(pool, block_table, lengths)
    assert out.shape == (bsz, 9, h, d)
    for b in range(bsz):
        n = int(lengths[b])
        assert torch.equal(out[b, :n], dense[b, :n])
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


def test_kvcache_reference_compute_dtype_is_honoured(seed):
    q = randn(1, 2, 8, dtype=torch.bfloat16, seed=seed)
    k = randn(1, 3, 1, 8, dtype=torch.bfloat16, seed=seed + 1)
    lengths = torch.tensor([3])
    assert reference.decode_attention(q, k, k, lengths).dtype == torch.float64
    assert reference.decode_attention(q, k, k, lengths, compute_dtype=torch.float32).dtype == torch.float32
    table = torch.tensor([[0]])
    assert reference.paged_gather(k[0, None], table, lengths, compute_dtype=torch.float32).dtype == torch.float32


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, as float64 (from the 256 bit patterns)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    return vals[torch.isfinite(vals)].unique()


def test_fp8_max_constant_is_the_largest_finite_e4m3():
    assert reference.kvcache.FP8_E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max == float(_e4m3_grid().max())


def test_quantize_fp8_per_head_is_the_nearest_e4m3_value_saturated(seed):
    x = randn(3, 5, 4, 16, seed=seed, scale=4.0)
    x[0, 0, 0, :6] = torch.tensor([1e4, -1e4, 0.0, -0.0, 1e-9, -1e-9])  # saturation, zeros
    scale = torch.tensor([0.01, 0.5, 0.003, 1.0])  # per head: head 0, 2 saturate often
    got = reference.kvcache.quantize_fp8_per_head(x, scale)
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
    got64 = got.double()
    assert torch.isfinite(got64).all()
    # The float32 quotient, clamped: each stored value is a nearest grid value to it.
    limit = reference.kvcache.FP8_E4M3_MAX
    target = (x / scale[:, None]).double().clamp(-limit, limit)
    dist = (target[..., None] - _e4m3_grid()).abs().amin(dim=-1)
    assert torch.equal((got64 - target).abs(), dist)
    saturated = (x / scale[:, None]).abs() >= limit
    assert saturated.any() and torch.equal(got64[saturated].abs(), torch.full_like(got64[saturated], limit))
    # float16 / bfloat16 inputs go through the same float32 quotient
    xh = x.to(torch.bfloat16)
    assert torch.equal(reference.kvcache.quantize_fp8_per_head(xh, scale).view(torch.uint8),
                       reference.kvcache.quantize_fp8_per_head(xh.float(), scale).view(torch.uint8))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_kv_append_reference_matches_a_token_by_token_scatter(seed, paged, fp8):
    """kv_append against a per-token Python loop over explicit (block, slot) indices, with
    seq_ids, ragged counts, non-zero starting lengths and a shuffled block table."""
    rows, h, d, block_size, max_blocks = 4, 2, 8, 3, 4
    lengths = torch.tensor([2, 0, 5, 7])
    seq_ids = torch.tensor([3, 0, 2])
    counts = torch.tensor([4, 5, 0])
    k_new = randn(3, 5, h, d, seed=seed)
    v_new = randn(3, 5, h, d, seed=seed + 1)
    k_scale, v_scale = (torch.tensor([0.01, 0.2]), torch.tensor([0.05, 0.003])) if fp8 else (None, None)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if paged:
        num_blocks = rows * max_blocks + 1
        block_table = torch.randperm(num_blocks, generator=make_generator(seed))[: rows * max_blocks]
        block_table = block_table.view(rows, max_blocks).int()
        shape = (num_blocks, block_size, h, d)
    else:
        block_table = None
        shape = (rows, max_blocks * block_size, h, d)
    k_cache = torch.full(shape, float("nan")).to(dtype)
    v_cache = torch.full(shape, float("nan")).to(dtype)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    reference.kvcache.kv_append(k_new, v_new, k_cache, v_cache, lengths, seq_ids=seq_ids, counts=counts,
                                block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    for b in range(3):
        r = int(seq_ids[b])
        for i in range(int(counts[b])):
            t = int(lengths[r]) + i
            at = (int(block_table[r, t // block_size]), t % block_size) if paged else (r, t)
            for src, dst, s in ((k_new, k_exp, k_scale), (v_new, v_exp, v_scale)):
                for hh in range(h):
                    val = src[b, i, hh].float()
                    if s is not None:  # divide, saturate, round: spelled out per element
                        val = torch.clamp(val / s[hh], -fp8_max, fp8_max)
                    dst[at][hh] = val.to(dtype)
    assert torch.equal(k_cache.view(torch.uint8), k_exp.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_exp.view(torch.uint8))
    assert lengths.tolist() == [2, 0, 5, 7]  # the caller owns the lengths


def test_kv_append_defaults_write_every_token_of_row_b(seed):
    k_new = randn(2, 3, 1, 4, dtype=torch.float64, seed=seed)
    cache = torch.zeros(2, 6, 1, 4, dtype=torch.float64)
    lengths = torch.tensor([1, 3])
    reference.kvcache.kv_append(k_new, k_new, cache, cache.clone(), lengths)
    assert torch.equal(cache[0, 1:4], k_new[0]) and torch.equal(cache[1, 3:6], k_new[1])
    assert torch.equal(cache[0, [0, 4, 5]], torch.zeros(3, 1, 4, dtype=torch.float64))
    assert torch.equal(cache[1, :3], torch.zeros(3, 1, 4, dtype=torch.float64))
