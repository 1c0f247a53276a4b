"""Attention and RoPE benchmarks (GPU): kernel_lab vs SDPA backends, FlexAttention, naive torch.

Attention groups are (direction, dtype, B x H x T x D, mask). Rows:
- `torch-naive` (baseline): materialised softmax(q k^T) v in eager PyTorch, where memory allows
  (T <= 4096); at T = 16384 the (T, T) scores need tens of GB, so `sdpa-flash` is that group's
  baseline instead;
- `sdpa-flash` (FlashAttention-2), `sdpa-cudnn`, `flex` (FlexAttention under torch.compile);
- `kernel_lab`.
FLOPs: 4*B*H*Tq*Tk*D forward (half under causal), 2.5x that backward; TFLOP/s and % of the
measured bf16 matmul rate are what to read (attention is compute bound). max_error: the first
head against the float64 reference.

KERNEL_LAB_BENCH_FULL=1 runs the issue's whole matrix (T in {1k, 4k, 16k}, D in {64, 128},
causal and not, forward and backward, bf16 and fp16, plus GQA); by default a subset that fits
in a few minutes of device time runs (bf16 everywhere, fp16 on one shape).

RoPE groups (Llama-3-8B heads, B=4, T=4096): the HF formula in eager (baseline) and under
torch.compile, Liger's rope, kernel_lab's one-launch kernel. Memory bound: q and k are read and
written once (320 MiB), so GB/s and % of copy bandwidth are what to read.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernel_lab.shared import bench, reference

attn = pytest.importorskip("kernel_lab.attention")

pytestmark = pytest.mark.gpu

FULL = os.environ.get("KERNEL_LAB_BENCH_FULL", "0") == "1"
IMPLS = ["torch-naive", "sdpa-flash", "sdpa-cudnn", "flex", "kernel_lab"]


def _shapes():
    """(dtype, B, Hq, Hkv, T, D, causal) per group."""
    bf16, fp16 = torch.bfloat16, torch.float16
    if FULL:
        out = []
        for dtype in (bf16, fp16):
            for t in (1024, 4096, 16384):
                for d in (64, 128):
                    for causal in (False, True):
                        out.append((dtype, 1 if t == 16384 else 4, 32, 32, t, d, causal))
        out.append((bf16, 4, 32, 8, 4096, 128, True))
        return out
    return [
        (bf16, 4, 32, 32, 1024, 128, False), (bf16, 4, 32, 32, 1024, 128, True),
        (bf16, 4, 32, 32, 4096, 128, False), (bf16, 4, 32, 32, 4096, 128, True),
        (bf16, 4, 32, 32, 4096, 64, True), (bf16, 1, 32, 32, 16384, 128, True),
        (fp16, 4, 32, 32, 4096, 128, True), (bf16, 4, 32, 8, 4096, 128, True),
    ]


SHAPES = _shapes()


def _sid(s):
    dtype, b, hq, hkv, t, d, causal = s
    heads = f"H{hq}" if hq == hkv else f"H{hq}/{hkv}"
    return f"{str(dtype)[6:]} B{b} {heads} T{t} D{d} {'causal' if causal else 'full'}"


def _naive(q, k, v, causal):
    """Eager PyTorch attention in the input dtype, scores materialised (what a model's
    `eager` attention does)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        t = q.shape[-2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)


def _impl(name, causal, t, gqa):
    if name == "torch-naive":
        if t > 4096:
            pytest.skip("naive attention materialises (T, T) scores: tens of GB at T=16384")
        return lambda q, k, v: _naive(q, k, v, causal)
    if name in ("sdpa-flash", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return sdpa
    if name == "flex":
        if not FULL and (t != 4096 or gqa):
            pytest.skip("subset: FlexAttention compiles per shape (~10 s each); it runs at T=4096 MHA here "
                        "(KERNEL_LAB_BENCH_FULL=1 runs it everywhere)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t, device="cuda")
        return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=gqa)
    return lambda q, k, v: attn.flash_attention(q, k, v, causal=causal)


def _role(impl, t):
    if impl == "kernel_lab":
        return "kernel_lab"
    baseline = "sdpa-flash" if t > 4096 else "torch-naive"
    return "baseline" if impl == baseline else "peer"


def _inputs(s, grad):
    dtype, b, hq, hkv, t, d, _ = s
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=dtype, generator=g)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _call(fn, q, k, v, impl):
    try:
        return fn(q, k, v)
    except RuntimeError as e:  # e.g. an SDPA backend that does not take this shape / GQA
        pytest.skip(f"{impl} cannot run this case: {str(e).splitlines()[0][:160]}")


def _first_head_ref(q, k, v, causal):
    return reference.attention(q[:1, :1].detach(), k[:1, :1].detach(), v[:1, :1].detach(), causal=causal)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_attention_forward(benchmark, impl, shape):
    _, b, hq, hkv, t, d, causal = shape
    benchmark.group = f"attn-fwd {_sid(shape)}"
    q, k, v = _inputs(shape, grad=False)
    fn = _impl(impl, causal, t, hq != hkv)
    with torch.no_grad():
        out = _call(fn, q, k, v, impl)
        err = bench.max_error(out[:1, :1], _first_head_ref(q, k, v, causal))
        del out
        bench.run_cuda(benchmark, lambda: fn(q, k, v), rounds=10)
    bench.annotate(benchmark, impl=impl, role=_role(impl, t), max_error=err,
                   flops=bench.attention_flops(b, hq, t, t, d, causal=causal))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_attention_backward(benchmark, impl, shape):
    dtype, b, hq, hkv, t, d, causal = shape
    if not FULL and (dtype == torch.float16 or (t == 1024 and not causal)):
        pytest.skip("subset: backward on bf16, T >= 1024 causal or T = 4096 (KERNEL_LAB_BENCH_FULL=1 runs all)")
    benchmark.group = f"attn-bwd {_sid(shape)}"
    q, k, v = _inputs(shape, grad=True)
    fn = _impl(impl, causal, t, hq != hkv)
    out = _call(fn, q, k, v, impl)
    do = torch.randn_like(out)
    bench.run_cuda(benchmark, lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), rounds=10)
    dq = torch.autograd.grad(out, (q,), do, retain_graph=True)[0]
    ref_dq = reference.attention_backward(q[:1, :1], k[:1, :1], v[:1, :1], do[:1, :1], causal=causal)[0]
    err = bench.max_error(dq[:1, :1], ref_dq)
    bench.annotate(benchmark, impl=impl, role=_role(impl, t), max_error=err,
                   flops=bench.attention_flops(b, hq, t, t, d, causal=causal, backward=True))


# --- RoPE ---------------------------------------------------------------------------------------


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (rotate_half), cos/sin (B, T, D) unsqueezed at dim 1."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


ROPE_IMPLS = ["torch", "torch.compile", "liger", "kernel_lab"]


@pytest.mark.parametrize("impl", ROPE_IMPLS)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_rope(benchmark, impl, backward):
    b, t, hq, hkv, d, dtype = 4, 4096, 32, 8, 128, torch.bfloat16
    benchmark.group = f"rope-{'bwd' if backward else 'fwd'} bfloat16 B{b} T{t} H{hq}/{hkv} D{d}"
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=dtype, generator=g).requires_grad_(backward)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=dtype, generator=g).requires_grad_(backward)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    ang = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    ang = torch.cat((ang, ang), -1)[None].expand(b, t, d)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    if impl == "torch":
        fn = _hf_rope
    elif impl == "torch.compile":
        torch._dynamo.reset()
        fn = torch.compile(_hf_rope, dynamic=False)
    elif impl == "liger":
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
        except ImportError:
            pytest.skip("liger-kernel is not installed")
        fn = liger_rotary_pos_emb
    else:
        fn = attn.apply_rope
    qo, ko = fn(q, k, cos, sin)
    ref_q = reference.rope(q[:1].detach(), cos[:1], sin[:1])
    err = bench.max_error(qo[:1], ref_q)
    if backward:
        dq, dk = torch.randn_like(qo), torch.randn_like(ko)
        bench.run_cuda(benchmark, lambda: torch.autograd.grad((qo, ko), (q, k), (dq, dk), retain_graph=True))
    else:
        bench.run_cuda(benchmark, lambda: fn(q, k, cos, sin))
    # Fewest bytes: read q, k (and cos/sin once per position), write q, k.
    moved = 2 * bench.bytes_of(q, k) + bench.bytes_of(cos[0], sin[0])
    bench.annotate(benchmark, impl=impl, role={"torch": "baseline", "kernel_lab": "kernel_lab"}.get(impl, "peer"),
                   bytes_moved=moved, max_error=err)
