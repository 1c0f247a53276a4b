"""Decode attention over a KV cache (GPU): kernel_lab vs SDPA, naive PyTorch and torch.compile.

Llama-3-8B attention shapes: 32 query heads, 8 kv heads, D=128, bfloat16, one new token per
sequence, every sequence full (length T). Groups are (B, T); rows:
- `sdpa` (baseline): F.scaled_dot_product_attention(enable_gqa=True) on the contiguous cache;
- `torch naive`: matmul, float32 softmax, matmul in eager PyTorch; `torch.compile`: the same
  function compiled;
- kernel_lab on the contiguous cache, on paged caches (blocks of 16 and 64 tokens, handed
  out in a shuffled order as after allocator churn), and on the float8 e4m3 contiguous cache.
Bytes are the K and V bytes read (the floor of a decode step); % bw is against the measured
device copy bandwidth. Each call reads the next layer of a cache whose layers add up to at
least 256 MiB (4x the largest L2), so no row is timed from L2. max_error is against the
float64 reference of the bfloat16 cache (for the fp8 row it includes the quantization).

`decode-graph` groups replay one call per layer from a CUDA graph, as serving engines run a
decode step: the time is the GPU's, without the Python and launch overhead of eager calls.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import bench, reference, shapes

kv = pytest.importorskip("kernel_lab.inference_kvcache")

pytestmark = pytest.mark.gpu

MODEL = shapes.model("llama-3-8b")
H_Q, H_KV, D = MODEL.num_heads, MODEL.num_kv_heads, MODEL.head_dim
DTYPE = torch.bfloat16
BT = [(1, 4096), (1, 32768), (1, 131072), (8, 8192), (32, 4096), (64, 2048)]
MIN_CACHE_BYTES = 256 << 20
IMPLS = ["sdpa", "torch naive", "torch.compile", "kernel_lab", "kernel_lab paged16", "kernel_lab paged64",
         "kernel_lab fp8"]
GRAPH_IMPLS = ["sdpa", "kernel_lab", "kernel_lab paged16", "kernel_lab paged64", "kernel_lab fp8"]

_state: dict = {}


def _layers(bsz: int, t: int) -> int:
    per_layer = 2 * bsz * t * H_KV * D * DTYPE.itemsize
    return max(1, math.ceil(MIN_CACHE_BYTES / per_layer))


def _setup(bsz: int, t: int) -> dict:
    """Caches, queries and the reference of one (B, T), shared by its rows (built once)."""
    if _state.get("key") == (bsz, t):
        return _state
    _state.clear()
    torch.cuda.empty_cache()
    layers = _layers(bsz, t)
    gen = torch.Generator(device="cuda").manual_seed(bsz * 1_000_003 + t)
    contiguous = kv.KVCache(layers, bsz, t, H_KV, D, dtype=DTYPE, device="cuda")
    fp8 = kv.KVCache(layers, bsz, t, H_KV, D, dtype=torch.float8_e4m3fn, device="cuda")
    paged = {}
    for bs in (16, 64):
        nb = bsz * t // bs
        paged[bs] = kv.PagedKVCache(nb, bs, layers, H_KV, D, dtype=DTYPE, device="cuda", max_seqs=bsz,
                                    max_blocks_per_seq=t // bs)
        # A shuffled free list: sequences own scattered blocks, as after allocate/free churn.
        paged[bs]._free = torch.randperm(nb, generator=torch.Generator().manual_seed(bs)).tolist()
        for s in range(bsz):
            paged[bs].allocate(s)
    for layer in range(layers):
        k = torch.randn(bsz, t, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn(bsz, t, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        for c in (contiguous, fp8, *paged.values()):
            c.append(layer, k, v)
        del k, v
    q = torch.randn(bsz, H_Q, D, device="cuda", dtype=DTYPE, generator=gen)
    ref = reference.decode_attention(q, contiguous.k[0], contiguous.v[0], contiguous.lengths(0))
    _state.update(key=(bsz, t), layers=layers, contiguous=contiguous, fp8=fp8, paged=paged, q=q, ref=ref)
    return _state


def _naive(q, k, v):
    """Eager GQA decode: q (B, Hq, D), k/v (B, T, Hkv, D) -> (B, Hq, D)."""
    bsz = q.shape[0]
    qg = q.view(bsz, H_KV, H_Q // H_KV, D)
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)) * D**-0.5  # (B, Hkv, G, T)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v.transpose(1, 2)).view(bsz, H_Q, D)


def _sdpa(q, k, v):
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    return out.squeeze(2)


def _call(impl: str, st: dict):
    """A function of the layer index running `impl` once."""
    q, c = st["q"], st["contiguous"]
    if impl == "sdpa":
        return lambda layer: _sdpa(q, c.k[layer], c.v[layer])
    if impl == "torch naive":
        return lambda layer: _naive(q, c.k[layer], c.v[layer])
    if impl == "torch.compile":
        # one static-shape compile per case: a single dynamic-shape compile shared by all cases
        # failed in inductor ("Attempting to broadcast a dimension of length s25") on torch 2.11
        torch._dynamo.reset()
        compiled = torch.compile(_naive, dynamic=False)
        return lambda layer: compiled(q, c.k[layer], c.v[layer])
    cache = {"kernel_lab": c, "kernel_lab fp8": st["fp8"], "kernel_lab paged16": st["paged"][16],
             "kernel_lab paged64": st["paged"][64]}[impl]
    return lambda layer: kv.decode_attention(q, cache, layer)


def _bytes(impl: str, bsz: int, t: int) -> int:
    itemsize = 1 if impl == "kernel_lab fp8" else DTYPE.itemsize
    return 2 * bsz * t * H_KV * D * itemsize


def _role(impl: str) -> str:
    return "baseline" if impl == "sdpa" else ("kernel_lab" if impl.startswith("kernel_lab") else "peer")


@pytest.mark.parametrize("bsz,t,impl", [(b, t, i) for b, t in BT for i in IMPLS],
                         ids=lambda x: str(x))
def test_decode_attention(benchmark, bsz, t, impl):
    st = _setup(bsz, t)
    benchmark.group = f"decode bf16 B={bsz} T={t} Hq={H_Q} Hkv={H_KV} D={D}"
    fn = _call(impl, st)
    try:
        out = fn(0)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        # torch 2.11's inductor fails on the naive decode at batch 1 (a broadcast of the key length
        # against the head count); the peer is reported as absent rather than as our failure.
        pytest.skip(f"torch.compile cannot compile the naive decode for this shape: {' '.join(str(e).split())[:200]}")
    layers = itertools.cycle(range(st["layers"]))
    bench.run_cuda(benchmark, lambda: fn(next(layers)))
    bench.annotate(benchmark, impl=impl, role=_role(impl), bytes_moved=_bytes(impl, bsz, t),
                   max_error=bench.max_error(out, st["ref"]))


@pytest.mark.parametrize("bsz,t,impl", [(b, t, i) for b, t in BT for i in GRAPH_IMPLS], ids=lambda x: str(x))
def test_decode_attention_cuda_graph(benchmark, bsz, t, impl):
    """One call per layer captured in a CUDA graph; the row's time is per call (per layer)."""
    st = _setup(bsz, t)
    layers = st["layers"]
    benchmark.group = f"decode-graph bf16 B={bsz} T={t} Hq={H_Q} Hkv={H_KV} D={D}"
    fn = _call(impl, st)
    for layer in range(layers):  # warm-up: autotuning and compilation happen outside capture
        fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = [fn(layer) for layer in range(layers)]
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    bench.run_cuda(benchmark, graph.replay)
    # pytest-benchmark's stats are per replay (all layers): report per-call figures in extra_info.
    bench.annotate(benchmark, impl=impl, role=_role(impl), bytes_moved=_bytes(impl, bsz, t) * layers,
                   max_error=bench.max_error(outs[0], st["ref"]), calls_per_round=layers)
