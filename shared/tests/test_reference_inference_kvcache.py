"""The KV-cache references against independent float64 PyTorch math (SDPA, explicit scatter)."""

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
