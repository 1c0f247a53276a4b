"""AdamW step: kernel_lab vs torch.optim.AdamW (for-loop baseline, foreach, fused).

One group per (model size, param dtype, state dtype); one row per implementation. Parameters
are split into the tensor shapes of real models (kernel_lab.shared.shapes): 10M and 100M from
Qwen2.5-0.5B layers, 1B from Llama-3-8B layers; every tensor gets a gradient. Traffic per
parameter, each implementation's own minimum: float32 params read p, g, m, v and write p, m, v
(28 B). bfloat16 params come in two groups:
- "bfloat16": ours keeps float32 moments (22 B; 28 B with float32 master weights). torch cannot
  run this configuration (its fused kernel refuses moments of another dtype than the param's),
  so its rows there are its own bfloat16-state step (14 B): less work, not the same work.
- "bfloat16, bfloat16 state": ours with state_dtype=bfloat16, like for like with torch (14 B).
All inputs are many times the L2 (10M float32 parameters are 280 MB of traffic).
"""

from __future__ import annotations

import gc

import pytest
import torch

from kernel_lab.optim_adamw import AdamW
from kernel_lab.shared import bench, reference, shapes

pytestmark = pytest.mark.gpu

SIZES = {
    "10M": (10_000_000, "qwen2.5-0.5b"),
    "100M": (100_000_000, "qwen2.5-0.5b"),
    "1B": (1_000_000_000, "llama-3-8b"),
}
F32, BF16 = torch.float32, torch.bfloat16
# (size, param dtype, state dtype of our rows); cases of one (size, param dtype) are adjacent,
# so that their tensors are made once
CASES = [("10M", F32, F32), ("100M", F32, F32), ("1B", F32, F32), ("100M", BF16, F32), ("100M", BF16, BF16),
         ("1B", BF16, F32), ("1B", BF16, BF16)]
IMPLS = ["torch_forloop", "torch_foreach", "torch_fused", "kernel_lab"]
ROWS = [(*case, i) for case in CASES for i in IMPLS + (["kernel_lab_master"] if case[1:] == (BF16, F32) else [])]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def layer_shapes(name: str) -> list[tuple[int, ...]]:
    """The parameter shapes of one decoder layer of preset `name`, in module order."""
    m = shapes.model(name)
    h = m.hidden_size
    return [(h,), (m.q_size, h), (m.kv_size, h), (m.kv_size, h), (h, m.q_size), (h,),
            (m.intermediate_size, h), (m.intermediate_size, h), (h, m.intermediate_size)]


def model_shapes(total: int, name: str) -> list[tuple[int, ...]]:
    """Whole layers' shapes, repeated until `total` parameters; the rest as one flat tensor."""
    out, count, layer = [], 0, layer_shapes(name)
    while True:
        for s in layer:
            n = torch.Size(s).numel()
            if count + n > total:
                if total > count:
                    out.append((total - count,))
                return out
            out.append(s)
            count += n


_PARAMS: dict[tuple, tuple[list[torch.nn.Parameter], list[torch.Tensor], list[torch.Tensor]]] = {}


def _params(size: str, dtype: torch.dtype):
    """Params, their grads and the params' initial values for a case, shared by the case's rows
    (one case in memory at a time)."""
    key = (size, dtype)
    if key not in _PARAMS:
        _PARAMS.clear()
        gc.collect()
        torch.cuda.empty_cache()
        total, name = SIZES[size]
        gen = torch.Generator(device="cuda").manual_seed(0)
        params, grads, initial = [], [], []
        for s in model_shapes(total, name):
            p = torch.empty(s, device="cuda", dtype=dtype).normal_(0, 0.02, generator=gen)
            params.append(torch.nn.Parameter(p))
            initial.append(p.detach().clone())
            grads.append(torch.empty(s, device="cuda", dtype=dtype).normal_(0, 1e-3, generator=gen))
        _PARAMS[key] = (params, grads, initial)
    return _PARAMS[key]


def _optimizer(impl: str, params, state_dtype: torch.dtype):
    if impl == "torch_forloop":
        return torch.optim.AdamW(params, foreach=False, **HP)
    if impl == "torch_foreach":
        return torch.optim.AdamW(params, foreach=True, **HP)
    if impl == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **HP)
    return AdamW(params, master_weights=impl == "kernel_lab_master", state_dtype=state_dtype, **HP)


def _bytes_per_param(impl: str, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    """p read and written (with master weights: the float32 master instead, p only written), g
    read, m and v read and written."""
    if impl.startswith("torch"):
        state_dtype = dtype  # torch keeps its moments in the param dtype
    param, state = dtype.itemsize, state_dtype.itemsize
    if impl == "kernel_lab_master":
        return param + 8 + param + 4 * state
    return 2 * param + param + 4 * state


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("size,dtype,state_dtype,impl", ROWS,
                         ids=[f"{s}-{_name(d)}-{'bf16state-' if sd == BF16 else ''}{i}" for s, d, sd, i in ROWS])
def test_adamw_step(benchmark, size, dtype, state_dtype, impl):
    benchmark.group = f"adamw {size} params {_name(dtype)}" + (", bfloat16 state" if state_dtype == BF16 else "")
    params, grads, initial = _params(size, dtype)
    # every row starts from the same values: the timed steps of the rows before moved them
    # (by about lr per step), and the error below is taken on the first step
    with torch.no_grad():
        for p, p0, g in zip(params, initial, grads, strict=True):
            p.copy_(p0)
            p.grad = g
    originals = initial[:2]
    opt = _optimizer(impl, params, state_dtype)
    # Error of the first step on one tensor (a projection matrix) against the float64 reference.
    opt.step()
    expected, _, _, _ = reference.adamw_step(
        originals[1], grads[1], torch.zeros_like(grads[1], dtype=torch.float32),
        torch.zeros_like(grads[1], dtype=torch.float32), step=1, lr=HP["lr"], beta1=HP["betas"][0],
        beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"],
    )
    max_error = bench.max_error(params[1].detach(), expected)
    del expected
    bench.run_cuda(benchmark, opt.step)
    numel = sum(p.numel() for p in params)
    bench.annotate(
        benchmark, impl=impl, role="baseline" if impl == "torch_forloop" else "kernel_lab" if impl.startswith(
            "kernel_lab") else "peer",
        bytes_moved=numel * _bytes_per_param(impl, dtype, state_dtype), max_error=max_error, num_tensors=len(params),
    )
    for p in params:
        p.grad = None
    del opt
    gc.collect()
    torch.cuda.empty_cache()
