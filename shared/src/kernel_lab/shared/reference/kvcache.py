"""References for inference with a KV cache: decode attention over a cache, paged gather, the
append (scatter of new tokens, with per-head float8 quantization).

Layouts follow production engines:
- contiguous cache: (B, T_max, H_kv, D) per layer; sequence b holds `lengths[b]` valid tokens
  in rows [0, lengths[b]); what lies beyond is never read.
- paged cache: a pool (num_blocks, block_size, H_kv, D) per layer and a block table
  (B, max_blocks) of int block ids; token t of sequence b lives at
  pool[block_table[b, t // block_size], t % block_size].

Decode queries are the newest `T_q` tokens of each sequence (T_q = 1 for plain decoding, a few
more for speculative decoding), already appended to the cache: query t of sequence b sits at
absolute position lengths[b] - T_q + t and attends to the keys at positions <= its own.
A query with no key to attend to (lengths[b] == 0, or lengths[b] < T_q) returns zeros, the
convention of the kernels (softmax over an empty set has no value; zeros keep the residual
stream finite).

float8 caches (float8_e4m3fn) store x / scale per kv head, computed in float32, saturated to
+-FP8_E4M3_MAX and rounded to nearest even (`quantize_fp8_per_head`); reading multiplies by
the scale again.

decode_attention and paged_gather run in `compute_dtype` (float64 by default) and return it;
kv_append writes into the caches it is given, in their dtype.
"""

from __future__ import annotations

import torch

# Largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max): the saturation
# bound of a quantizing append, and the divisor of an amax calibration (scale = amax / it).
FP8_E4M3_MAX = 448.0


def _dequant(x: torch.Tensor, scale: torch.Tensor | None, compute_dtype: torch.dtype) -> torch.Tensor:
    """x (..., H, D) in compute_dtype, times a per-head scale (H,) when one is given."""
    x = x.to(compute_dtype)
    if scale is not None:
        x = x * scale.to(device=x.device, dtype=compute_dtype)[:, None]
    return x


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for each sequence over its cached tokens, with GQA.

    q: (B, H_q, D) or (B, T_q, H_q, D); k_cache, v_cache: (B, T_max, H_kv, D), any dtype
    (float8 included: the stored value times `k_scale`/`v_scale`, per kv head, shape (H_kv,));
    lengths: (B,) ints. H_q must be a multiple of H_kv: query head h reads kv head
    h // (H_q // H_kv). scale defaults to 1/sqrt(D). Returns q's shape in `compute_dtype`.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q = q.unsqueeze(1)
    bsz, t_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(bsz, t_q, h_q, d, dtype=compute_dtype, device=q.device)
    for b in range(bsz):
        n = int(lengths[b])
        if n == 0:
            continue
        k = _dequant(k_cache[b, :n], k_scale, compute_dtype).repeat_interleave(group, dim=1)  # (n, Hq, D)
        v = _dequant(v_cache[b, :n], v_scale, compute_dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("thd,nhd->htn", q[b].to(compute_dtype), k) * scale  # (Hq, Tq, n)
        # Query t sits at position n - T_q + t and sees keys at positions <= it.
        pos_q = torch.arange(n - t_q, n, device=q.device)[:, None]
        pos_k = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(pos_k > pos_q, float("-inf"))
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(s - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        p = torch.where(denom > 0, p / denom, torch.zeros_like(p))
        out[b] = torch.einsum("htn,nhd->thd", p, v)
    return out.squeeze(1) if squeeze else out


def paged_gather(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The contiguous (B, max_len, H, D) cache that a paged pool and block table describe.

    pool: (num_blocks, block_size, H, D); block_table: (B, max_blocks) ints; lengths: (B,).
    Row t < lengths[b] of sequence b is pool[block_table[b, t // block_size], t % block_size];
    rows beyond a sequence's length are zero. max_len defaults to max(lengths).
    """
    bsz = block_table.shape[0]
    block_size = pool.shape[1]
    if max_len is None:
        max_len = int(lengths.max()) if bsz else 0
    out = torch.zeros(bsz, max_len, *pool.shape[2:], dtype=compute_dtype, device=pool.device)
    for b in range(bsz):
        n = int(lengths[b])
        t = torch.arange(n, device=pool.device)
        blocks = block_table[b].to(device=pool.device, dtype=torch.long)[t // block_size]
        out[b, :n] = pool[blocks, t % block_size].to(compute_dtype)
    return out


def quantize_fp8_per_head(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """What a float8 cache stores for x: x / scale per head, saturated, rounded to nearest.

    x: (..., H, D), any float dtype; scale: (H,) per-head scales. The division runs in float32
    (as in the kernels), the quotient is clamped to +-FP8_E4M3_MAX (no NaN, no inf) and cast
    to `dtype` (round to nearest even). Returns x's shape in `dtype`, on x's device.
    """
    s = scale.to(device=x.device, dtype=torch.float32)[:, None]
    return (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def cache_slots(
    row: int, positions: torch.Tensor, block_table: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) index of token positions of cache row `row`: (row, t) in a contiguous
    cache, (block_table[row, t // block_size], t % block_size) in a paged pool."""
    positions = positions.long()
    if block_table is None:
        return torch.full_like(positions, row), positions
    blocks = block_table[row].to(device=positions.device, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


def kv_append(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    seq_ids: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new tokens into the caches in place, after each sequence's current tokens.

    k_new, v_new: (B, T_new, H, D); k_cache, v_cache: contiguous (rows, T_max, H, D), or a paged
    pool (num_blocks, block_size, H, D) with block_table (rows, max_blocks). Batch entry b goes
    to cache row seq_ids[b] (default b); its first counts[b] tokens (default T_new) land at
    positions lengths[row] + i (see `cache_slots`). With k_scale / v_scale (H,) the values are
    stored as `quantize_fp8_per_head` gives them, else cast to the cache dtype. `lengths` is
    not updated (the caller owns it). Unlike the other references this one mutates its
    arguments: an append is a write.
    """
    bsz, t_new = k_new.shape[:2]
    block_size = k_cache.shape[1]
    for b in range(bsz):
        row = int(seq_ids[b]) if seq_ids is not None else b
        n = int(counts[b]) if counts is not None else t_new
        pos = int(lengths[row]) + torch.arange(n, device=k_cache.device)
        idx = cache_slots(row, pos, block_table, block_size)
        for src, dst, s in ((k_new, k_cache, k_scale), (v_new, v_cache, v_scale)):
            x = src[b, :n]
            dst[idx] = quantize_fp8_per_head(x, s, dst.dtype) if s is not None else x.to(dst.dtype)
