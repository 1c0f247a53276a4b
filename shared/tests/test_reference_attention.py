"""The attention and RoPE references against independent float64 PyTorch math."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import reference
from kernel_lab.shared.reference.attention import check_cu_seqlens
from kernel_lab.shared.testing import randn


def _sdpa64(q, k, v, allowed, scale=None):
    """Independent float64 attention: torch SDPA with an explicit boolean mask, kv heads
    repeated by hand; rows without any allowed key are zeroed (SDPA gives NaN there)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return torch.where(allowed.any(-1, keepdim=True), out, torch.zeros_like(out))


@pytest.mark.parametrize(
    ("tq", "tk", "causal", "window"),
    [(5, 5, False, None), (5, 9, True, None), (9, 4, True, None), (7, 7, False, (2, 1)),
     (6, 11, True, (3, -1))],
)
def test_attention_mask_is_bottom_right_aligned(tq, tk, causal, window):
    allowed = reference.attention_mask(tq, tk, causal=causal, window=window)
    left, right = window if window else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    for i in range(tq):
        for j in range(tk):
            diag = i + tk - tq
            ok = (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)
            assert bool(allowed[i, j]) == ok, (i, j)


@pytest.mark.parametrize(
    ("hq", "hkv", "tq", "tk", "causal", "window"),
    [(4, 4, 13, 13, False, None), (4, 2, 11, 19, True, None), (6, 1, 17, 7, True, None),
     (2, 2, 23, 23, False, (4, 2)), (4, 2, 9, 30, True, (5, -1))],
)
def test_attention_reference_matches_sdpa_float64(seed, hq, hkv, tq, tk, causal, window):
    q = randn(2, hq, tq, 16, dtype=torch.float64, seed=seed)
    k = randn(2, hkv, tk, 16, dtype=torch.float64, seed=seed + 1)
    v = randn(2, hkv, tk, 16, dtype=torch.float64, seed=seed + 2)
    allowed = reference.attention_mask(tq, tk, causal=causal, window=window)
    expected = _sdpa64(q, k, v, allowed)
    out, lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    rep = hq // hkv
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(16)
    expected_lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    # The blocked online-softmax version gives the same numbers, block by block.
    out_b, lse_b = reference.attention_blocked(q, k, v, causal=causal, window=window, return_lse=True,
                                               block_n=4)
    torch.testing.assert_close(out_b, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse_b, expected_lse, rtol=1e-12, atol=1e-12)


def test_attention_reference_fully_masked_rows_are_zero_not_nan(seed):
    # causal with Tq > Tk: the first Tq - Tk queries see no key at all.
    q = randn(1, 2, 8, 8, dtype=torch.float64, seed=seed)
    kv = randn(1, 2, 3, 8, dtype=torch.float64, seed=seed + 1)
    for fn in (reference.attention, reference.attention_blocked):
        out, lse = fn(q, kv, kv, causal=True, return_lse=True)
        assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
        assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
        assert torch.isfinite(out).all()


def test_attention_reference_scale_is_honoured(seed):
    q, k, v = (randn(1, 2, 6, 8, dtype=torch.float64, seed=seed + i) for i in range(3))
    allowed = torch.ones(6, 6, dtype=torch.bool)
    torch.testing.assert_close(reference.attention(q, k, v, scale=0.3), _sdpa64(q, k, v, allowed, scale=0.3))


@pytest.mark.parametrize(("hq", "hkv", "causal", "window"), [(4, 2, True, None), (2, 2, False, (3, 3))])
def test_attention_backward_reference_matches_sdpa_autograd(seed, hq, hkv, causal, window):
    q = randn(2, hq, 9, 8, dtype=torch.float64, seed=seed, requires_grad=True)
    k = randn(2, hkv, 12, 8, dtype=torch.float64, seed=seed + 1, requires_grad=True)
    v = randn(2, hkv, 12, 8, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    do = randn(2, hq, 9, 8, dtype=torch.float64, seed=seed + 3)
    allowed = reference.attention_mask(9, 12, causal=causal, window=window)
    expected = torch.autograd.grad(_sdpa64(q, k, v, allowed), (q, k, v), do)
    got = reference.attention_backward(q, k, v, do, causal=causal, window=window)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_attention_varlen_reference_matches_per_sequence_sdpa(seed):
    lens_q, lens_k = [3, 0, 1, 7], [5, 0, 1, 7]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lens_q), 4, 8, dtype=torch.float64, seed=seed)
    k = randn(sum(lens_k), 2, 8, dtype=torch.float64, seed=seed + 1)
    v = randn(sum(lens_k), 2, 8, dtype=torch.float64, seed=seed + 2)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        allowed = reference.attention_mask(lens_q[b], lens_k[b], causal=True)
        expected = _sdpa64(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                           v[ks].transpose(0, 1)[None], allowed)[0].transpose(0, 1)
        torch.testing.assert_close(out[qs], expected, rtol=1e-10, atol=1e-12)


def test_attention_varlen_reference_rejects_bad_cu_seqlens():
    q = torch.zeros(5, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        reference.attention_varlen(q, q, q, torch.tensor([0, 3, 2, 5]), torch.tensor([0, 2, 3, 5]))


@pytest.mark.parametrize("offsets", [[1, 3, 5], [0, 3, 2, 5], [0, 3, 4], [0, 3, 6]])
def test_check_cu_seqlens_rejects_offsets_not_from_0_to_total_non_decreasing(offsets):
    with pytest.raises(ValueError, match="cu must start at 0, be non-decreasing and end at 5"):
        check_cu_seqlens(torch.tensor(offsets, dtype=torch.int32), 5, "cu")


def test_check_cu_seqlens_returns_the_offsets_empty_sequences_allowed():
    assert check_cu_seqlens(torch.tensor([0, 3, 3, 5], dtype=torch.int32), 5, "cu") == [0, 3, 3, 5]


def test_attention_varlen_backward_reference_rejects_batch_mismatch():
    q = torch.zeros(5, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 entries but cu_seqlens_k has 2"):
        reference.attention_varlen_backward(q, q, q, q, torch.tensor([0, 2, 5]), torch.tensor([0, 5]))


def _rope_complex(x, theta, interleaved):
    """Independent RoPE: rotate each (x_a, x_b) pair by its angle as a complex product."""
    if interleaved:
        z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(theta), theta)
        return torch.stack((z.real, z.imag), -1).flatten(-2)
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat((z.real, z.imag), -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rope_reference_matches_complex_rotation(seed, interleaved, rotary_dim):
    d, t = 16, 5
    r = d if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    pos = torch.tensor([[3, 0, 9, 4, 1], [0, 1, 2, 3, 4]])
    theta = pos[..., None].double() * inv_freq  # (B, T, r/2)
    # The HF tables: rotate_half repeats the angles by halves, GPT-J interleaves them.
    ang = theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1)
    x = randn(2, 3, t, d, dtype=torch.float64, seed=seed)
    expected = torch.cat((_rope_complex(x[..., :r], theta[:, None], interleaved), x[..., r:]), -1)
    got = reference.rope(x, ang.cos(), ang.sin(), interleaved=interleaved, rotary_dim=rotary_dim)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # The same through a position table indexed by position_ids.
    table = torch.arange(10, dtype=torch.float64)[:, None] * inv_freq
    table = table.repeat_interleave(2, -1) if interleaved else torch.cat((table, table), -1)
    got_ids = reference.rope(x, table.cos(), table.sin(), position_ids=pos, interleaved=interleaved)
    torch.testing.assert_close(got_ids, expected, rtol=1e-12, atol=1e-12)
    q2, k2 = reference.apply_rope(x, x[:, :1], ang.cos(), ang.sin(), interleaved=interleaved)
    torch.testing.assert_close(q2, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k2, expected[:, :1], rtol=1e-12, atol=1e-12)


def test_attention_reference_compute_dtype_is_honoured():
    q = randn(1, 1, 4, 8, dtype=torch.bfloat16, seed=0)
    assert reference.attention(q, q, q).dtype == torch.float64
    assert reference.attention(q, q, q, compute_dtype=torch.float32).dtype == torch.float32


def test_attention_backward_reference_with_lse_gradient_matches_autograd(seed):
    q = randn(1, 4, 7, 8, dtype=torch.float64, seed=seed, requires_grad=True)
    k = randn(1, 2, 5, 8, dtype=torch.float64, seed=seed + 1, requires_grad=True)
    v = randn(1, 2, 5, 8, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    do, dlse = randn(1, 4, 7, 8, dtype=torch.float64, seed=seed + 3), randn(1, 4, 7, dtype=torch.float64, seed=seed)
    allowed = reference.attention_mask(7, 5, causal=True)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    live = torch.isfinite(lse)  # rows 0 and 1 see no key: their lse is a constant -inf
    loss = (_sdpa64(q, k, v, allowed) * do).sum() + (torch.where(live, lse, 0) * dlse).sum()
    expected = torch.autograd.grad(loss, (q, k, v))
    got = reference.attention_backward(q, k, v, do, causal=True, grad_lse=dlse)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_attention_varlen_backward_reference_matches_autograd(seed):
    lens_q, lens_k = [3, 0, 1, 6, 2], [4, 2, 1, 6, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lens_q), 2, 8, dtype=torch.float64, seed=seed, requires_grad=True)
    k = randn(sum(lens_k), 1, 8, dtype=torch.float64, seed=seed + 1, requires_grad=True)
    v = randn(sum(lens_k), 1, 8, dtype=torch.float64, seed=seed + 2, requires_grad=True)
    do = randn(sum(lens_q), 2, 8, dtype=torch.float64, seed=seed + 3)
    out = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=(2, -1))
    expected = torch.autograd.grad(out, (q, k, v), do)
    got = reference.attention_varlen_backward(q, k, v, do, cu_q, cu_k, causal=True, window=(2, -1))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_backward_reference_matches_autograd(seed, interleaved):
    x = randn(2, 3, 5, 16, dtype=torch.float64, seed=seed, requires_grad=True)
    cos, sin = randn(5, 12, dtype=torch.float64, seed=seed + 1), randn(5, 12, dtype=torch.float64, seed=seed + 2)
    dy = randn(2, 3, 5, 16, dtype=torch.float64, seed=seed + 3)
    (expected,) = torch.autograd.grad(reference.rope(x, cos, sin, interleaved=interleaved), x, dy)
    got = reference.rope_backward(dy, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
