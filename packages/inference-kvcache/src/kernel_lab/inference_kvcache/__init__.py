"""kernel_lab.inference_kvcache: KV caches (contiguous, paged, fp8) and split-K decode attention.

    cache = KVCache(num_layers, batch_size, max_seq_len, num_kv_heads, head_dim,
                    dtype=torch.bfloat16, device="cuda")
    cache.append(layer, k, v)                 # (B, T_new, H_kv, D): prefill or one token
    out = decode_attention(q, cache, layer)   # q (B, H_q, D) -> (B, H_q, D)
"""

from .modules import KVCache, PagedKVCache, decode_attention
from .ops import flash_decode, kv_append

__all__ = ["KVCache", "PagedKVCache", "decode_attention", "flash_decode", "kv_append"]
__version__ = "0.1.14"
