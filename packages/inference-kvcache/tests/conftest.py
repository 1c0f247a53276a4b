"""Helpers shared by the tests: fill a cache with known tokens, build the dense expectation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernel_lab.inference_kvcache import KVCache, PagedKVCache
from kernel_lab.shared import reference
from kernel_lab.shared.testing import assert_close_to_reference, randn

# The FlashAttention KV-cache rule: 3x the same-precision PyTorch error (docs/correctness.md).
DECODE_FACTOR = 3.0


def make_cache(kind: str, *, layers=1, batch, max_len, h_kv, d, dtype, device, block_size=4):
    """An empty cache of `kind` ("contiguous" or "paged"), storage poisoned with NaN so that a
    read outside the written tokens shows; paged sequences 0..batch-1 allocated."""
    if kind == "contiguous":
        cache = KVCache(layers, batch, max_len, h_kv, d, dtype=dtype, device=device)
    else:
        # A shuffled free list, so sequences get scattered, non-consecutive blocks.
        num_blocks = batch * -(-max_len // block_size) + 3
        cache = PagedKVCache(num_blocks, block_size, layers, h_kv, d, dtype=dtype, device=device,
                             max_seqs=batch + 2)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks)).tolist()
        cache._free = perm
        for s in range(batch):
            cache.allocate(s)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    return cache


def fill(cache, layer, lengths, *, dtype, seed, prefill):
    """Append random tokens until sequence b holds lengths[b]: one ragged prefill of up to
    `prefill` tokens per sequence (one launch), then one-token decode appends. Returns the
    dense K, V (B, max(lengths), H, D) that were appended, in `dtype`."""
    bsz = len(lengths)
    t_max = max(max(lengths), 1)
    shape = (bsz, t_max, cache.num_kv_heads, cache.head_dim)
    k = randn(*shape, dtype=dtype, seed=seed, device=cache.device)
    v = randn(*shape, dtype=dtype, seed=seed + 1, device=cache.device)
    pos = [min(prefill, n) for n in lengths]
    if max(pos) > 0:
        cache.append(layer, k[:, : max(pos)], v[:, : max(pos)], num_new=pos)
    rows = torch.arange(bsz)
    while any(p < n for p, n in zip(pos, lengths, strict=True)):
        step = [int(p < n) for p, n in zip(pos, lengths, strict=True)]
        idx = torch.tensor([min(p, t_max - 1) for p in pos])
        cache.append(layer, k[rows, idx][:, None], v[rows, idx][:, None], num_new=step)
        pos = [p + s for p, s in zip(pos, step, strict=True)]
    return k, v


def dense_view(cache, layer, rows):
    """The cache contents of `rows` as a dense (B, max_len, H, D) float64 tensor, on the cache's
    device (the gpu tier's 128k-token references would take minutes on the CPU)."""
    lengths = torch.tensor([cache.seq_len(layer, r) for r in rows], device=cache.device)
    if isinstance(cache, PagedKVCache):
        table = cache.block_table[rows]
        return (reference.paged_gather(cache.k[layer], table, lengths),
                reference.paged_gather(cache.v[layer], table, lengths))
    n = int(lengths.max())
    return cache.k[layer, rows, :n].double(), cache.v[layer, rows, :n].double()


def check_decode(out, q, cache, layer, rows=None, scale=None):
    """Compare `out` with the reference and the same-precision baseline on the cache's contents."""
    rows = list(range(q.shape[0])) if rows is None else rows
    k, v = dense_view(cache, layer, rows)
    lengths = torch.tensor([cache.seq_len(layer, r) for r in rows])
    scales = {}
    if cache.is_fp8:
        scales = {"k_scale": cache.k_scale[layer], "v_scale": cache.v_scale[layer]}
    return check_decode_dense(out, q, k, v, lengths, scale=scale, **scales)


def check_decode_dense(out, q, k, v, lengths, *, scale=None, k_scale=None, v_scale=None, name="output"):
    """Compare `out` with the reference and the same-precision baseline on dense (B, T, H, D)
    keys and values (stored values; fp8 ones times k_scale / v_scale per head)."""
    kw = dict(scale=scale, k_scale=k_scale, v_scale=v_scale)
    ref = reference.decode_attention(q, k, v, lengths, **kw)
    base = reference.decode_attention(q, k, v, lengths, compute_dtype=q.dtype, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    return assert_close_to_reference(out, ref, base, factor=DECODE_FACTOR, name=name)


@pytest.fixture
def kvh() -> SimpleNamespace:
    """The helpers above, as a fixture: test modules cannot import conftest under
    --import-mode=importlib (what nox uses)."""
    return SimpleNamespace(make_cache=make_cache, fill=fill, dense_view=dense_view, check_decode=check_decode,
                           check_decode_dense=check_decode_dense)


@pytest.fixture(params=["contiguous", "paged"])
def cache_kind(request) -> str:
    return request.param
