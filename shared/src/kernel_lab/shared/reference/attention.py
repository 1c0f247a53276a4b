"""Attention and rotary-embedding references: naive, blocked online-softmax, varlen, RoPE.

Conventions shared with kernel_lab.attention (docs/correctness.md):

- Layout (B, H, T, D) ("bhsd"); k and v may have fewer heads than q (GQA/MQA): query head h
  reads key/value head h // (Hq // Hkv).
- `causal` with Tq != Tk is aligned bottom-right (FlashAttention 2.1+): query i sees key j
  iff j <= i + (Tk - Tq). `window=(left, right)` keeps keys with
  i + (Tk - Tq) - left <= j <= i + (Tk - Tq) + right; a negative bound means unbounded.
  `causal=True` caps `right` at 0.
- A query row that sees no key (possible with causal Tq > Tk, or a window) gives output 0
  and logsumexp -inf, never NaN.

All math runs in `compute_dtype` (float64 by default) and the results stay in it.
"""

from __future__ import annotations

import itertools
import math

import torch


def attention_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Boolean (Tq, Tk) matrix, True where query i may attend key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    return allowed


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Repeat the kv heads of `t` (B, Hkv, T, D) so each query head has its own (GQA)."""
    hq, hkv = q.shape[-3], t.shape[-3]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return t.repeat_interleave(hq // hkv, dim=-3) if hq != hkv else t


def _prepare_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """q (B, Hq, Tq, D) and k/v expanded to (B, Hq, Tk, D), all in compute_dtype, and the
    scale (1/sqrt(D) when None)."""
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q, _expand_kv(q, k), _expand_kv(q, v), scale


def _softmax_probs(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, window: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """P = softmax(scale * q k^T + mask) (B, Hq, Tq, Tk) and its rows' logsumexp (B, Hq, Tq),
    for q (B, Hq, Tq, D) and k already expanded to Hq heads. A row without keys gets P = 0 and
    lse = -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = attention_mask(q.shape[-2], k.shape[-2], causal=causal, window=window, device=q.device)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) on a row with lse = -inf would be NaN; such a row has no key, so p = 0.
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe_lse.unsqueeze(-1)), lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
):
    """Naive materialised attention: softmax(scale * q k^T + mask) v.

    q: (B, Hq, Tq, D), k/v: (B, Hkv, Tk, D) with Hq % Hkv == 0. scale defaults to 1/sqrt(D).
    Returns out (B, Hq, Tq, D), and with `return_lse` also lse (B, Hq, Tq), the natural-log
    logsumexp of each row of scaled scores (-inf for a row that sees no key).
    """
    q, k, v, scale = _prepare_qkv(q, k, v, scale, compute_dtype)
    p, lse = _softmax_probs(q, k, scale, causal, window)
    out = torch.matmul(p, v)
    return (out, lse) if return_lse else out


def attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    block_n: int = 64,
    compute_dtype: torch.dtype = torch.float64,
):
    """The same result as `attention`, by the online-softmax recurrence over key blocks.

    This is the FlashAttention algorithm in plain PyTorch: for each block of `block_n` keys,
    m' = max(m, rowmax(s)), l' = l * exp(m - m') + rowsum(exp(s - m')),
    acc' = acc * exp(m - m') + exp(s - m') v; finally out = acc / l, lse = m + log(l).
    Only a (Tq, block_n) slice of scores exists at a time.
    """
    q, k, v, scale = _prepare_qkv(q, k, v, scale, compute_dtype)
    tq, tk = q.shape[-2], k.shape[-2]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=compute_dtype, device=q.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute_dtype, device=q.device)
    allowed = attention_mask(tq, tk, causal=causal, window=window, device=q.device)
    for n0 in range(0, tk, block_n):
        s = torch.matmul(q, k[..., n0 : n0 + block_n, :].transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[:, n0 : n0 + block_n], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        # A row with no key so far keeps m = -inf; shift by 0 there so exp() stays 0, not NaN.
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        l_sum = l_sum * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v[..., n0 : n0 + block_n, :])
        m = m_new
    denom = l_sum.clamp_min(torch.finfo(compute_dtype).tiny).unsqueeze(-1)
    out = torch.where(l_sum.unsqueeze(-1) > 0, acc / denom, torch.zeros_like(acc))
    lse = m + torch.log(l_sum)  # -inf + log(0) = -inf on rows without keys
    return (out, lse) if return_lse else out


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    grad_lse: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention` for the output gradient `grad_out` (and optionally the
    gradient `grad_lse` of the logsumexp), by the explicit formulas (no autograd, so it also
    runs inside custom ops):

        P = softmax(S), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O) + dlse),
        dQ = scale * dS K, dK = scale * dS^T Q.

    With GQA, dk/dv are summed over the query heads that share a kv head.
    """
    hq, hkv = q.shape[-3], k.shape[-3]
    q, ke, ve, scale = _prepare_qkv(q, k, v, scale, compute_dtype)
    do = grad_out.to(compute_dtype)
    p, _ = _softmax_probs(q, ke, scale, causal, window)
    out = torch.matmul(p, ve)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, ve.transpose(-1, -2))
    delta = (do * out).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(compute_dtype).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    if hq != hkv:  # sum the gradients of the query heads that share each kv head
        dk = dk.unflatten(-3, (hkv, hq // hkv)).sum(-3)
        dv = dv.unflatten(-3, (hkv, hq // hkv)).sum(-3)
    return dq, dk, dv


def check_cu_seqlens(cu: torch.Tensor, total: int, name: str) -> list[int]:
    """The offsets of a cu_seqlens tensor (batch + 1,) as a list, after checking that they start
    at 0, never decrease (empty sequences are allowed) and end at `total` (the packed rows).

    Raises ValueError naming the tensor as `name`. Reads the tensor on the host (a device sync).
    """
    vals = [int(x) for x in cu.tolist()]
    if vals[0] != 0 or vals[-1] != total or any(b < a for a, b in itertools.pairwise(vals)):
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at {total}; got {vals}")
    return vals


def _packed_sequences(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence of a packed batch, q (total_q, ...) and k
    (total_k, ...), after checking both cu_seqlens."""
    cq = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    ck = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries but cu_seqlens_k has {len(ck)}")
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _heads_first(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows `rows` of a packed (total, H, D) tensor as a batch of one sequence, (1, H, T, D)."""
    return t[rows].transpose(0, 1).unsqueeze(0)


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `_heads_first`: (1, H, T, D) -> (T, H, D)."""
    return t[0].transpose(0, 1)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
):
    """Attention over packed sequences: sequence b is q[cu_q[b]:cu_q[b+1]] against
    k/v[cu_k[b]:cu_k[b+1]], each with the masks of `attention` (bottom-right per sequence).

    q: (total_q, Hq, D), k/v: (total_k, Hkv, D). Returns out (total_q, Hq, D) and with
    `return_lse` also lse (Hq, total_q) (the FlashAttention varlen layout).
    """
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    for qs, ks in _packed_sequences(q, k, cu_seqlens_q, cu_seqlens_k):
        if qs.start == qs.stop:
            continue
        o_b, lse_b = attention(
            _heads_first(q, qs), _heads_first(k, ks), _heads_first(v, ks), causal=causal, scale=scale,
            window=window, return_lse=True, compute_dtype=compute_dtype,
        )
        out[qs] = _tokens_first(o_b)
        lse[:, qs] = lse_b[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    grad_lse: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_varlen`, sequence by sequence with `attention_backward`.
    grad_lse, if given, is (Hq, total_q) like the forward's lse."""
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=v.device)
    for qs, ks in _packed_sequences(q, k, cu_seqlens_q, cu_seqlens_k):
        if qs.start == qs.stop or ks.start == ks.stop:
            continue  # no query, or no key: every gradient of this sequence is 0
        g = attention_backward(
            _heads_first(q, qs), _heads_first(k, ks), _heads_first(v, ks), _heads_first(grad_out, qs),
            causal=causal, scale=scale, window=window,
            grad_lse=None if grad_lse is None else grad_lse[:, qs].unsqueeze(0), compute_dtype=compute_dtype,
        )
        dq[qs], dk[ks], dv[ks] = (_tokens_first(t) for t in g)
    return dq, dk, dv


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """rotate_half (HF, NeoX: halves [x1, x2] -> [-x2, x1]) or the GPT-J interleaved rotation
    (pairs (x0, x1) -> (-x1, x0))."""
    if interleaved:
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, rotary_dim: int | None,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, R) for `rope`/`rope_backward`: the per-position rows (gathered by
    position_ids when given), cut to the first R dims (R = rotary_dim, or cos's last dim) and
    shaped (T, R) -> (1, T, R) or (B, T, R) -> (B, 1, T, R) to broadcast over heads."""
    cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    return cos[..., :r].unsqueeze(-3), sin[..., :r].unsqueeze(-3), r


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Rotary position embedding of x (B, H, T, D): on the first R = rotary_dim dims,
    x * cos + rotate(x) * sin (the HF `apply_rotary_pos_emb` formula); dims R..D pass through.

    cos/sin: (T, R) or (B, T, R) per position (HF's rotary_emb output), or, with
    `position_ids` (B, T), a table (max_positions, R) indexed by it. R defaults to cos's last
    dim. `interleaved` selects the GPT-J pairwise rotation instead of rotate_half.
    """
    x = x.to(compute_dtype)
    cos, sin, r = _rope_tables(cos, sin, position_ids, rotary_dim, compute_dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + _rotate(x_rot, interleaved) * sin, x_pass), dim=-1)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of q (B, Hq, T, D) and k (B, Hkv, T, D) with the same cos/sin."""
    kw = dict(position_ids=position_ids, interleaved=interleaved, rotary_dim=rotary_dim,
              compute_dtype=compute_dtype)
    return rope(q, cos, sin, **kw), rope(k, cos, sin, **kw)


def rope_backward(
    grad: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """dx of `rope` for the output gradient dy: the rotation is antisymmetric (R^T = -R), so
    dx = dy * cos - rotate(dy * sin) on the first R dims, dy elsewhere."""
    dy = grad.to(compute_dtype)
    cos, sin, r = _rope_tables(cos, sin, position_ids, rotary_dim, compute_dtype)
    dy_rot, dy_pass = dy[..., :r], dy[..., r:]
    return torch.cat((dy_rot * cos - _rotate(dy_rot * sin, interleaved), dy_pass), dim=-1)
