"""KV caches (contiguous and paged) and decode attention over them.

Both caches keep per-layer, per-sequence lengths twice: an int32 tensor on the cache's device
(what the kernels read, so a decode step never synchronizes) and a host copy (what the
overflow checks, the block allocator and the split-K plan read). Every append updates both
with the same numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from kernel_lab.shared.reference.kvcache import FP8_E4M3_MAX

from .ops import FP8_DTYPE, QUERY_DTYPES, DecodeCache, _check_query, decode_checked_cache, kv_append

CACHE_DTYPES = (*QUERY_DTYPES, FP8_DTYPE)
IndexLike = Sequence[int] | torch.Tensor | None
# Device seq_ids tensors a cache keeps per distinct seq_ids list (oldest dropped first): every
# layer of a decode step passes the same list, and a fresh host->device copy of pageable
# memory synchronizes the stream.
SEQ_IDS_MEMO_SIZE = 64
# Tensor dtypes accepted for seq_ids / num_new (bool is not an integer here: True would be 1).
_INT_DTYPES = frozenset(
    getattr(torch, n) for n in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, n)
)


def _index(x) -> int:
    """x as a Python int: an int, a NumPy integer or a one-element integer tensor.

    TypeError for a bool (operator.index(True) is 1, and of a bool tensor too) and for anything
    that is not an integer (a float, even 1.0: int(0.7) would silently pick sequence 0).
    """
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        raise TypeError(f"expected an int, got {x!r}")
    return operator.index(x)


def _seq_id_arg(seq_id, rows: int) -> int:
    """A scalar seq_id argument as a Python int in [0, rows), else ValueError."""
    try:
        s = _index(seq_id)
    except TypeError:
        s = None
    if s is None or not 0 <= s < rows:
        raise ValueError(f"seq_id must be an int in [0, {rows}), got {seq_id!r}")
    return s


def _host_ints(name: str, x: IndexLike, n: int | None = None) -> list[int] | None:
    """A list of Python ints from a sequence or 1-D tensor (a CUDA tensor costs one sync)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in _INT_DTYPES:
            raise TypeError(
                f"{name} must be a 1-D integer tensor or a sequence of ints, got {x.dtype} {tuple(x.shape)}"
            )
        out = x.tolist()
    else:
        try:  # ints only, not bools or floats (see _index)
            out = [_index(i) for i in x]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {x!r}") from None
    if n is not None and len(out) != n:
        raise ValueError(f"{name} must have {n} entries (one per batch entry), got {len(out)}")
    return out


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """An int32 tensor of `values` on `device`, without synchronizing.

    A host->device copy from pageable memory synchronizes the stream (the host waits for every
    kernel queued before it); on CUDA the values are staged in pinned memory from PyTorch's
    caching host allocator (which keeps the block until the copy has run) and copied
    asynchronously.
    """
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int32).to(device)


def _check_positive(**kw: int) -> None:
    for name, v in kw.items():
        # (a bool is an int to isinstance: KVCache(1, True, ...) built a cache of one row)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


class _CacheBase:
    """What both caches share: storage dtype, fp8 scales, lengths, append bookkeeping."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    k: torch.Tensor  # (num_layers, rows_or_blocks, T, H_kv, D)
    v: torch.Tensor

    def _init_common(self, num_layers, rows, num_kv_heads, head_dim, dtype, device) -> None:
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = dtype
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda" and dev.index is None:
            # Tensors report "cuda:0", never "cuda": pin the index so device checks compare equal.
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._lengths = torch.zeros((num_layers, rows), dtype=torch.int32, device=self.device)
        # Bumped whenever the set of valid sequences changes (paged allocate/free): decode
        # re-checks a seq_ids list it has checked before only after a bump.
        self._epoch = 0
        self._decode_caches: dict[int, DecodeCache] = {}
        self._seq_ids_memo: dict[tuple[int, ...], tuple[list[int], torch.Tensor, int]] = {}
        self._default_rows_checked: tuple[int, int] | None = None
        self._host_lengths = [[0] * rows for _ in range(num_layers)]
        if dtype == FP8_DTYPE:
            self.k_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones_like(self.k_scale)
            self._scales_fixed = [False] * num_layers
        else:
            self.k_scale = self.v_scale = None

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def lengths(self, layer: int) -> torch.Tensor:
        """(rows,) int32 tokens cached per sequence at `layer`, on the cache's device."""
        self._check_layer(layer)
        return self._lengths[layer]

    def seq_len(self, layer: int, seq_id: int) -> int:
        """Tokens cached for sequence `seq_id` at `layer` (host value, no synchronization)."""
        self._check_layer(layer)
        return self._host_lengths[layer][_seq_id_arg(seq_id, len(self._host_lengths[layer]))]

    def set_scales(self, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Fix the per-kv-head dequantization scales (H_kv,) of an fp8 cache's `layer`.

        Without this call the first append of a layer sets them to amax / 448 per head of what
        it writes (the prefill), and later tokens saturate at +-448 * scale. Only while the layer
        holds no tokens (ValueError otherwise: the stored ones would be read with the new scales).
        """
        if not self.is_fp8:
            raise ValueError(f"set_scales applies to float8_e4m3fn caches, this one is {self.dtype}")
        self._check_layer(layer)
        if any(self._host_lengths[layer]):  # its tokens were stored as x / the old scales: they would be misread
            raise ValueError(f"set_scales must come before layer {layer} caches tokens (reset or free its sequences "
                             "first)")
        scales = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            s = torch.as_tensor(s, dtype=torch.float32, device=self.device)
            if s.numel() not in (1, self.num_kv_heads) or s.dim() > 1:
                raise ValueError(f"{name} must be one value or one per kv head ({self.num_kv_heads},), got shape "
                                 f"{tuple(s.shape)}")
            # (a setup call: reading the values back is fine) a 0 scale stores 448 and reads back 0,
            # a negative one flips the sign, a NaN poisons every token of the head
            if not bool(((s > 0) & torch.isfinite(s)).all()):
                raise ValueError(f"{name} must be positive and finite, got {s.tolist()}")
            scales.append(s)
        self.k_scale[layer].copy_(scales[0])
        self.v_scale[layer].copy_(scales[1])
        self._scales_fixed[layer] = True

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts_list: list[int],
                   cnt_t: torch.Tensor | None) -> None:
        """Set an fp8 layer's scales from the first append that writes tokens: amax / 448 per kv
        head over the tokens it writes (entry b's first counts[b]; the padding past them is not
        stored and does not count), on the device (no synchronization). A head of zeros keeps
        scale 1 rather than 0 (which would divide by zero)."""
        if not self.is_fp8 or self._scales_fixed[layer] or sum(counts_list) == 0:
            return
        written = None
        if cnt_t is not None:  # (B, T_new, 1, 1): token t of entry b is written when t < counts[b]
            written = (torch.arange(k.shape[1], device=k.device)[None, :] < cnt_t[:, None])[..., None, None]
        for src, dst in ((k, self.k_scale), (v, self.v_scale)):
            mag = src.detach().abs().float()
            if written is not None:
                mag = torch.where(written, mag, 0.0)
            amax = mag.amax(dim=(0, 1, 3))
            dst[layer].copy_(torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)))
        self._scales_fixed[layer] = True

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must be (B, T_new, {self.num_kv_heads}, {self.head_dim}), got {tuple(t.shape)}"
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
            if t.dtype not in QUERY_DTYPES or (not self.is_fp8 and t.dtype != self.dtype):
                expected = "float16, bfloat16 or float32" if self.is_fp8 else str(self.dtype)
                raise TypeError(f"{name} must be {expected} for a {self.dtype} cache, got {t.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")

    def _plan_append(self, layer, k, v, seq_ids, num_new):
        """Host checks of an append; returns (rows, counts) as lists."""
        self._check_layer(layer)
        self._check_new(k, v)
        bsz, t_new = k.shape[:2]
        rows = _host_ints("seq_ids", seq_ids, bsz)
        counts = _host_ints("num_new", num_new, bsz)
        rows_list = rows if rows is not None else list(range(bsz))
        counts_list = counts if counts is not None else [t_new] * bsz
        if len(set(rows_list)) != len(rows_list):
            raise ValueError(f"seq_ids must be distinct, got {rows_list}")
        for r in rows_list:
            if not 0 <= r < self._num_rows():
                raise ValueError(f"seq_id {r} is outside [0, {self._num_rows()})")
        for c in counts_list:
            if not 0 <= c <= t_new:
                raise ValueError(f"num_new entries must be in [0, {t_new}], got {c}")
        return rows, counts, rows_list, counts_list

    def _commit_append(self, layer, k, v, rows, counts, rows_list, counts_list, block_table=None):
        seq_t = self._seq_ids_tensor(rows) if rows is not None else None
        cnt_t = _device_ints(counts, self.device) if counts is not None else None
        self._calibrate(layer, k, v, counts_list, cnt_t)
        kv_append(
            k, v, self.k[layer], self.v[layer], self._lengths[layer],
            seq_ids=seq_t, counts=cnt_t, block_table=block_table,
            k_scale=self.k_scale[layer] if self.is_fp8 else None,
            v_scale=self.v_scale[layer] if self.is_fp8 else None,
            check_indices=False,  # rows, counts and capacity were checked on the host above
        )
        # Advance the lengths after the kernel has read them (same stream, so ordered).
        if rows is None and counts is None:
            self._lengths[layer, : len(rows_list)] += k.shape[1]
        else:
            idx = seq_t.long() if seq_t is not None else torch.arange(len(rows_list), device=self.device)
            add = cnt_t if cnt_t is not None else torch.full_like(idx, k.shape[1], dtype=torch.int32)
            self._lengths[layer].index_add_(0, idx, add)
        host = self._host_lengths[layer]
        for r, c in zip(rows_list, counts_list, strict=True):
            host[r] += c

    def _num_rows(self) -> int:
        raise NotImplementedError

    def _decode_cache(self, layer: int) -> DecodeCache:
        """The checked cache side of a decode of `layer`, built once: indexing the tensors and
        checking them costs microseconds, and a decode step at small batch is launch-bound."""
        c = self._decode_caches.get(layer)
        if c is None:
            c = DecodeCache(self.k[layer], self.v[layer], self._lengths[layer], self._block_table(),
                            self.k_scale[layer] if self.is_fp8 else None,
                            self.v_scale[layer] if self.is_fp8 else None, reused=True)
            self._decode_caches[layer] = c
        return c

    def _block_table(self) -> torch.Tensor | None:
        return None

    def _check_rows(self, rows: Sequence[int]) -> None:
        """Raise ValueError unless every row is a sequence decode may read."""
        raise NotImplementedError

    def _check_default_rows(self, bsz: int) -> None:
        """The same for the default seq_ids 0..bsz-1 (flash_decode checks bsz <= rows)."""

    def _decode_rows(self, seq_ids: IndexLike, bsz: int) -> tuple[list[int] | None, torch.Tensor | None]:
        """seq_ids of a decode as (host list, device int tensor), both None for the default 0..B-1.

        Checks them on the host (range, or liveness of paged sequences). A list, tuple or CPU
        tensor is copied to the device once per distinct value (memoized, re-checked only after
        allocate/free); a tensor already on the cache's device is used as it is, but its
        .tolist() for the checks synchronizes: pass a list on a hot path.
        """
        if seq_ids is None:
            if self._default_rows_checked != (bsz, self._epoch):
                self._check_default_rows(bsz)
                self._default_rows_checked = (bsz, self._epoch)
            return None, None
        memo = self._seq_ids_memo
        compiling = torch.compiler.is_compiling()
        if isinstance(seq_ids, (list, tuple)) and not compiling:
            key = tuple(seq_ids)
            # Exact ints only: 1.0, True or np.float64(1) hash and compare equal to 1, so they
            # would find the entry of [1] and pass where a first call refuses them (and an
            # unhashable entry would raise from the lookup, not from the check).
            hit = memo.get(key) if all(type(i) is int for i in key) else None
            if hit is not None and len(hit[0]) == bsz:
                rows, seq_t, epoch = hit
                if epoch != self._epoch:
                    self._check_rows(rows)
                    memo[tuple(rows)] = (rows, seq_t, self._epoch)
                return rows, seq_t
        rows = _host_ints("seq_ids", seq_ids, bsz)
        self._check_rows(rows)
        if isinstance(seq_ids, torch.Tensor) and seq_ids.device == self.device:
            # any integer dtype (flash_decode reads int32 or int64): converted on the device
            return rows, seq_ids if seq_ids.dtype in (torch.int32, torch.int64) else seq_ids.to(torch.int32)
        return rows, self._seq_ids_tensor(rows)

    def _seq_ids_tensor(self, rows: list[int]) -> torch.Tensor:
        """The device int32 tensor of `rows` (checked by the caller at the current epoch),
        memoized: the kernels only read it, so one copy serves every layer and step."""
        if torch.compiler.is_compiling():
            return _device_ints(rows, self.device)
        memo = self._seq_ids_memo
        key = tuple(rows)
        hit = memo.get(key)
        if hit is None:
            seq_t = _device_ints(rows, self.device)
            if len(memo) >= SEQ_IDS_MEMO_SIZE:
                del memo[next(iter(memo))]
        else:
            seq_t = hit[1]
        memo[key] = (rows, seq_t, self._epoch)
        return seq_t

    def _max_len(self, layer: int, rows: list[int] | None, bsz: int) -> int:
        host = self._host_lengths[layer]
        if rows is None:
            return max(host[:bsz], default=0)
        return max(map(host.__getitem__, rows), default=0)


class KVCache(_CacheBase):
    """A pre-allocated contiguous KV cache: per layer (batch_size, max_seq_len, H_kv, D).

    Sequence b's tokens sit in rows [0, length) of its slot, as production engines lay them
    out, with a length per layer and sequence (ragged batches). `dtype` is the storage dtype:
    float16/bfloat16/float32, or float8_e4m3fn (half the bytes of bf16 per token) with float32
    per-layer, per-kv-head scales `k_scale`/`v_scale` (num_layers, H_kv).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        _check_positive(num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len,
                        num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self._init_common(num_layers, batch_size, num_kv_heads, head_dim, dtype, device)
        shape = (num_layers, batch_size, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def _num_rows(self) -> int:
        return self.batch_size

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, seq_ids: IndexLike = None,
               num_new: IndexLike = None) -> None:
        """Write k, v (B, T_new, H_kv, D) at each sequence's current length, then advance it.

        One Triton launch writes a whole prefill chunk or one decode token per sequence.
        seq_ids: cache slot of each batch entry (default 0..B-1); num_new: how many of the
        T_new tokens of each entry are real (default all; ragged prefill, 0 skips an entry).
        Raises ValueError if a sequence would exceed max_seq_len (nothing is written then).
        """
        rows, counts, rows_list, counts_list = self._plan_append(layer, k, v, seq_ids, num_new)
        host = self._host_lengths[layer]
        for r, c in zip(rows_list, counts_list, strict=True):
            if host[r] + c > self.max_seq_len:
                raise ValueError(
                    f"sequence {r} at layer {layer} would hold {host[r] + c} tokens, over max_seq_len "
                    f"{self.max_seq_len}"
                )
        self._commit_append(layer, k, v, rows, counts, rows_list, counts_list)

    def reset(self, seq_ids: IndexLike = None) -> None:
        """Empty the given sequences (default: all) at every layer; storage is not cleared."""
        rows = _host_ints("seq_ids", seq_ids)
        rows = list(range(self.batch_size)) if rows is None else rows
        self._check_rows(rows)
        self._lengths[:, rows] = 0
        for host in self._host_lengths:
            for r in rows:
                host[r] = 0

    def _check_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            if not 0 <= r < self.batch_size:
                raise ValueError(f"seq_id {r} is outside [0, {self.batch_size})")


class PagedKVCache(_CacheBase):
    """A vLLM-style paged KV cache: a pool of fixed-size blocks and per-sequence block tables.

    Per layer the pool is (num_blocks, block_size, H_kv, D); sequence s owns a list of blocks
    (row s of `block_table`, (max_seqs, max_blocks_per_seq) int32 on the device), shared by
    all layers. Blocks are taken from the free list as appends need them and returned by
    `free`; a block is never owned by two live sequences. `dtype` as in KVCache (fp8 too).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        max_seqs: int = 256,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        max_blocks_per_seq = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
        _check_positive(num_blocks=num_blocks, block_size=block_size, num_layers=num_layers,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, max_seqs=max_seqs,
                        max_blocks_per_seq=max_blocks_per_seq)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seqs, self.max_blocks_per_seq = max_seqs, max_blocks_per_seq
        self._init_common(num_layers, max_seqs, num_kv_heads, head_dim, dtype, device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.block_table = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=self.device)
        # Free list as a stack, lowest ids handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[int, list[int]] = {}

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def owned_blocks(self, seq_id: int) -> list[int]:
        """The block ids of live sequence `seq_id`, in token order (a copy)."""
        seq_id = _seq_id_arg(seq_id, self.max_seqs)
        self._check_live(seq_id)
        return list(self._owned[seq_id])

    def live_sequences(self) -> list[int]:
        return sorted(self._owned)

    def _num_rows(self) -> int:
        return self.max_seqs

    def _check_live(self, seq_id: int) -> None:
        if seq_id not in self._owned:
            raise ValueError(f"sequence {seq_id} is not allocated (live: {self.live_sequences()})")

    def allocate(self, seq_id: int, num_tokens: int = 0) -> None:
        """Start sequence `seq_id` (an int in [0, max_seqs)) with room for `num_tokens` tokens."""
        seq_id = _seq_id_arg(seq_id, self.max_seqs)
        if seq_id in self._owned:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        self._owned[seq_id] = []
        self._epoch += 1
        for host in self._host_lengths:
            host[seq_id] = 0
        self._lengths[:, seq_id] = 0
        try:
            self._reserve({seq_id: num_tokens})
        except ValueError:
            del self._owned[seq_id]
            raise

    def free(self, seq_id: int) -> None:
        """End sequence `seq_id`: its blocks go back to the free list, its lengths to 0."""
        seq_id = _seq_id_arg(seq_id, self.max_seqs)  # before any change: free(0.0) freed 0, then raised
        self._check_live(seq_id)
        self._free.extend(reversed(self._owned.pop(seq_id)))
        self._epoch += 1
        for host in self._host_lengths:
            host[seq_id] = 0
        self._lengths[:, seq_id] = 0

    def _reserve(self, need_tokens: dict[int, int]) -> None:
        """Give each sequence enough blocks for `need_tokens[seq]` tokens, all or nothing."""
        need_blocks = {}
        for s, n in need_tokens.items():
            if n > self.max_seq_len:
                raise ValueError(
                    f"sequence {s} would hold {n} tokens, over max_blocks_per_seq * block_size = {self.max_seq_len}"
                )
            extra = -(-n // self.block_size) - len(self._owned[s])
            if extra > 0:
                need_blocks[s] = extra
        total = sum(need_blocks.values())
        if total > len(self._free):
            raise ValueError(f"out of KV cache blocks: need {total} more, {len(self._free)} free of {self.num_blocks}")
        for s, extra in need_blocks.items():
            owned = self._owned[s]
            first = len(owned)
            owned.extend(self._free.pop() for _ in range(extra))
            self.block_table[s, first : len(owned)] = _device_ints(owned[first:], self.device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, seq_ids: IndexLike = None,
               num_new: IndexLike = None) -> None:
        """Write k, v (B, T_new, H_kv, D) through the block tables, then advance the lengths.

        seq_ids: the live sequence of each batch entry (default 0..B-1); num_new as in
        KVCache.append. New blocks are taken from the free list as needed (all or nothing:
        raises ValueError when blocks run out, and then nothing is written).
        """
        rows, counts, rows_list, counts_list = self._plan_append(layer, k, v, seq_ids, num_new)
        for r in rows_list:
            self._check_live(r)
        host = self._host_lengths[layer]
        self._reserve({r: host[r] + c for r, c in zip(rows_list, counts_list, strict=True)})
        self._commit_append(layer, k, v, rows, counts, rows_list, counts_list, block_table=self.block_table)

    def _block_table(self) -> torch.Tensor | None:
        return self.block_table

    def _check_rows(self, rows: Sequence[int]) -> None:
        for r in rows:
            self._check_live(r)

    def _check_default_rows(self, bsz: int) -> None:
        self._check_rows(range(bsz))


def decode_attention(
    q: torch.Tensor,
    cache: KVCache | PagedKVCache,
    layer: int,
    *,
    scale: float | None = None,
    seq_ids: IndexLike = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of q over `cache` at `layer` (split-K flash-decoding, GQA packed).

    q: (B, H_q, D) one new token per sequence, or (B, T_q, H_q, D) for the last T_q tokens
    (speculative decoding; query t sees keys up to position length - T_q + t). The new
    tokens' keys/values must already be appended. seq_ids: the cache sequence of each q row
    (default 0..B-1). Empty sequences give zeros. See `ops.flash_decode` for the rest.
    """
    if not isinstance(cache, _CacheBase):
        raise TypeError(f"cache must be a KVCache or PagedKVCache, got {type(cache).__name__}")
    cache._check_layer(layer)
    _check_query(q)
    bsz = q.shape[0]
    rows, seq_t = cache._decode_rows(seq_ids, bsz)
    return decode_checked_cache(
        q, cache._decode_cache(layer), seq_ids=seq_t, scale=scale, num_splits=num_splits,
        max_len=cache._max_len(layer, rows, bsz),
    )
