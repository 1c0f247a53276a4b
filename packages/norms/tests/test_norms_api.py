"""Input validation, the reference backend, torch.library registration, modules and patch_hf.

Unmarked tests run anywhere on the CPU (reference tier); those that need the PyTorch reference
path set TRITON_INTERPRET=0 for their duration (`runtime.backend` reads it at call time).
"""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kernel_lab.norms import LayerNorm, RMSNorm, layer_norm, patch_hf, residual_rms_norm, rms_norm, rms_norm_gated
from kernel_lab.shared import reference, testing

# nox runs pytest with --import-mode=importlib, which leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).parent))
from _norms_checks import OPS, call, check_op, make_inputs


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float64])
def test_unsupported_x_dtype_raises_type_error(dtype):
    x = torch.zeros(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=r"x\.dtype must be float16, bfloat16 or float32"):
        rms_norm(x, None)
    with pytest.raises(TypeError, match=r"x\.dtype must be"):
        layer_norm(x, None, None)


def test_weight_shape_dtype_and_type_are_checked():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        layer_norm(x, torch.ones(8), torch.ones(2, 8))
    with pytest.raises(TypeError, match=r"weight\.dtype must be"):
        rms_norm_gated(x, x, torch.ones(8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor"):
        rms_norm(x, [1.0] * 8)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        rms_norm([[1.0]], None)
    with pytest.raises(ValueError, match="at least one dim"):
        rms_norm(torch.tensor(1.0), None)


def test_residual_and_gate_must_match_x():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(3, 8\)"):
        residual_rms_norm(x, torch.zeros(3, 9), None)
    with pytest.raises(TypeError, match=r"residual\.dtype must equal x\.dtype"):
        residual_rms_norm(x, torch.zeros(3, 8, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match=r"gate must have x's shape"):
        rms_norm_gated(x, torch.zeros(8), None)
    with pytest.raises(TypeError, match=r"gate must be a torch\.Tensor"):
        rms_norm_gated(x, None, None)


# 1e-50 is 0 as float32 (the kernels' eps): an all-zero row would get rstd = 1 / 0
@pytest.mark.parametrize("eps", [0.0, -1e-6, 1e-50, 1e300, float("nan"), float("inf")])
def test_bad_eps_raises_value_error(eps):
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm(torch.zeros(2, 4), None, eps)
    with pytest.raises(ValueError, match="eps must be"):
        layer_norm(torch.zeros(2, 4), None, None, eps)


def test_non_numeric_eps_and_offset_raise_type_error():
    with pytest.raises(TypeError, match="eps must be a float"):
        rms_norm(torch.zeros(2, 4), None, "1e-6")
    with pytest.raises(TypeError, match="eps must be a float"):
        rms_norm(torch.zeros(2, 4), None, True)
    with pytest.raises(TypeError, match="offset must be a float"):
        rms_norm(torch.zeros(2, 4), None, offset=None)


def test_unknown_or_unusable_backend_raises(no_interpreter):
    with pytest.raises(ValueError, match="backend must be"):
        rms_norm(torch.zeros(3, 4), None, backend="cuda")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1"):
        layer_norm(torch.zeros(3, 4), None, None, backend="triton")


# --- the reference paths -------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_explicit_reference_backend_is_differentiable(op, seed):
    inputs = make_inputs(op, (6, 33), torch.float32, "cpu", seed)
    # outputs and gradients (random output grads) against the reference
    check_op(op, inputs, seed=seed, backend="reference")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_without_interpreter_runs_reference_in_the_launchers(op, dtype, no_interpreter, seed):
    # backend=None on a CPU tensor without TRITON_INTERPRET: the launchers' reference branch,
    # with the same autograd.Function (and backward launcher) as the Triton path
    inputs = make_inputs(op, (2, 5, 40), dtype, "cpu", seed, weight_dtype=torch.float32)
    check_op(op, inputs, eps=1e-5, offset=0.0, seed=seed)


@pytest.mark.parametrize("op", OPS)
def test_registered_ops_pass_opcheck(op, no_interpreter, kernel_device, seed):
    # Fake-tensor tracing cannot run the interpreter (it reads real data): on the CPU this checks
    # the registration around the reference backend; on CUDA, around the Triton kernels.
    inputs = make_inputs(op, (3, 24), torch.float32, kernel_device, seed)
    x, w = inputs["x"].requires_grad_(True), inputs["weight"].requires_grad_(True)
    rstd = torch.rand(3, device=kernel_device) + 0.5
    if op == "layer_norm":
        b = inputs["bias"].requires_grad_(True)
        torch.library.opcheck(torch.ops.kernel_lab.layer_norm_fwd.default, (x, w, b, 1e-5))
        torch.library.opcheck(torch.ops.kernel_lab.layer_norm_bwd.default,
                              (torch.randn_like(x), x.detach(), w.detach(), b.detach(), x.detach().mean(-1),
                               rstd, 1e-5))
        return
    res = inputs.get("residual")
    gate = inputs.get("gate")
    torch.library.opcheck(torch.ops.kernel_lab.rms_norm_fwd.default, (x, res, gate, w, 1e-6, 0.0))
    du = torch.randn_like(x) if res is not None else None
    torch.library.opcheck(torch.ops.kernel_lab.rms_norm_bwd.default,
                          (torch.randn_like(x), du, x.detach(), gate, w.detach(), rstd, 1e-6, 0.0))


@pytest.mark.parametrize("op", OPS)
def test_torch_compile_fullgraph_has_no_graph_break(op, no_interpreter, seed):
    # aot_eager traces the registered ops and their autograd without a C++ compiler
    inputs = make_inputs(op, (4, 32), torch.float32, "cpu", seed)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if v is not None}
    full = dict.fromkeys(("residual", "gate", "weight", "bias")) | leaves

    def loss(**kw):
        return sum((o * o).sum() for o in call(op, kw, 1e-6, 0.0))

    torch._dynamo.reset()
    loss_compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(**full)
    grads = torch.autograd.grad(loss_compiled, list(leaves.values()))
    eager = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    expected = torch.autograd.grad(loss(**(full | eager)), list(eager.values()))
    torch.testing.assert_close(loss_compiled, loss(**(full | eager)))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


# --- modules and patch_hf ------------------------------------------------------------------------


def test_modules_wrap_the_ops(seed):
    x = testing.randn(4, 16, seed=seed)
    m = RMSNorm(16, eps=1e-5)
    assert "16, eps=1e-05" in repr(m) and torch.equal(m.weight, torch.ones(16))
    with torch.no_grad():  # non-trivial parameters: a module that dropped one would show
        m.weight.copy_(testing.randn(16, seed=seed + 1))
    testing.assert_close_to_reference(m(x), reference.rms_norm(x, m.weight.detach(), 1e-5),
                                      torch.nn.functional.rms_norm(x, (16,), eps=1e-5))
    gemma = RMSNorm(16, offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(16))  # (1 + 0) * xhat: the identity scale
    ln = LayerNorm(16)
    with torch.no_grad():
        ln.weight.copy_(testing.randn(16, seed=seed + 2))
        ln.bias.copy_(testing.randn(16, seed=seed + 3))
    testing.assert_close_to_reference(ln(x), reference.layer_norm(x, ln.weight.detach(), ln.bias.detach(), 1e-5),
                                      torch.nn.functional.layer_norm(x, (16,)))
    assert LayerNorm(16, bias=False).bias is None and LayerNorm(16, elementwise_affine=False).weight is None


class LlamaRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, verbatim in behaviour (transformers need not be installed)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        # float32 inputs here: HF's formula is the reference's in float32
        return reference.rms_norm(hidden_states, self.weight, self.variance_epsilon,
                                  compute_dtype=torch.float32).to(hidden_states.dtype)


class GemmaRMSNorm(nn.Module):
    """Hugging Face's GemmaRMSNorm: weights stored as w - 1."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return reference.rms_norm(x, self.weight, self.eps, offset=1.0, compute_dtype=torch.float32).to(x.dtype)


def test_patch_hf_swaps_by_class_name_keeping_parameters(seed):
    torch.manual_seed(seed % 2**31)
    model = nn.Sequential(nn.Linear(24, 24), LlamaRMSNorm(24, eps=1e-5), nn.Sequential(GemmaRMSNorm(24)),
                          nn.LayerNorm(24), nn.Linear(24, 5))
    for p in model.parameters():
        nn.init.normal_(p)
    x = testing.randn(7, 24, seed=seed)
    with torch.no_grad():
        expected = model(x)
    params = dict(model.named_parameters())
    assert patch_hf(model) == 3
    assert isinstance(model[1], RMSNorm) and model[1].eps == 1e-5 and model[1].offset == 0.0
    assert isinstance(model[2][0], RMSNorm) and model[2][0].offset == 1.0
    assert isinstance(model[3], LayerNorm)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    with torch.no_grad():
        # float32 on both sides; only the norms' summation order differs (docs/correctness.md, norms)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert patch_hf(model) == 0  # nothing left to swap


def test_patch_hf_replaces_a_norm_under_every_name_and_keeps_eval_mode():
    """A norm registered twice in one parent (`final_norm = norm`) gets the one replacement under
    both names (named_children() yields it once); an eval-mode model stays in eval mode."""
    model = nn.Sequential(nn.LayerNorm(8))
    model.add_module("again", model[0])
    model.eval()
    assert patch_hf(model) == 1
    assert isinstance(model[0], LayerNorm) and model.again is model[0] and not model[0].training


def test_patch_hf_leaves_layer_norm_subclasses_and_replaces_shared_modules_once():
    """A subclass of nn.LayerNorm computes something else under the same parameters (Nemotron's
    weight + 1): it is left alone. A norm shared by two parents becomes one module, counted once."""
    class OffsetLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    shared = nn.LayerNorm(8)
    model = nn.Sequential(OffsetLayerNorm(8), nn.Sequential(shared), nn.Sequential(shared))
    assert patch_hf(model) == 1
    assert type(model[0]) is OffsetLayerNorm
    assert isinstance(model[1][0], LayerNorm) and model[1][0] is model[2][0]


@pytest.mark.interpret
def test_patch_hf_on_a_transformers_llama_keeps_logits(kernel_device, seed):
    # float32 on both sides: the only difference is our kernels against HF's eager norm
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed % 2**31)
    model = transformers.LlamaForCausalLM(config).eval().to(kernel_device)
    for m in model.modules():  # random norm weights, so that a dropped weight shows
        if type(m).__name__ == "LlamaRMSNorm":
            nn.init.normal_(m.weight, 1.0, 0.3)
    ids = torch.randint(0, 128, (2, 17), generator=testing.make_generator(seed)).to(kernel_device)
    with torch.no_grad():
        expected = model(ids).logits
    assert patch_hf(model) == 2 * 2 + 1  # two per layer and the final norm
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 5
    with torch.no_grad():
        # float32 end to end; the norms' summation order differs, carried through two layers and
        # the LM head (docs/correctness.md, norms)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_double_backward_raises_instead_of_dropping_second_order_terms(op, kernel_device, seed):
    inputs = make_inputs(op, (3, 40), torch.float32, kernel_device, seed)
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if v is not None}
    full = dict.fromkeys(("residual", "gate", "weight", "bias"))
    testing.assert_double_backward_raises(
        lambda *ts: tuple(call(op, full | dict(zip(leaves, ts, strict=True)), 1e-6, 0.0)), *leaves.values()
    )
