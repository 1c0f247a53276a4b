"""Input validation, the reference backend, torch.library registration, modules and patch_hf.

Unmarked tests run anywhere on the CPU (reference tier); those that need the PyTorch reference
path set TRITON_INTERPRET=0 for their duration (`runtime.backend` reads it at call time).
"""

import sys
from pathlib import Path

import numpy as np
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


# Hugging Face configs may hold eps as a NumPy scalar. 2**-17 is exact in float32 and float64.
NUMPY_EPS = 2.0**-17


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("np_type", [np.float32, np.float64], ids=lambda t: t.__name__)
def test_numpy_scalar_eps_and_offset_match_the_reference(op, np_type, kernel_device, seed):
    inputs = make_inputs(op, (5, 40), torch.float32, kernel_device, seed)
    offset = 0.5 if op in ("rms_norm", "residual_rms_norm") else 0.0

    def numpy_call(op, ins, eps, offset, **kw):  # ours gets NumPy scalars, the references Python floats
        return call(op, ins, np_type(eps), np_type(offset), **kw)

    check_op(op, inputs, eps=NUMPY_EPS, offset=offset, seed=seed, fn=numpy_call)


@pytest.mark.parametrize("op", OPS)
def test_numpy_scalar_eps_on_the_reference_backend_is_a_python_float(op, seed):
    inputs = make_inputs(op, (3, 16), torch.float32, "cpu", seed)
    want = call(op, inputs, NUMPY_EPS, 0.0, backend="reference")
    for eps in (np.float32(NUMPY_EPS), np.float64(NUMPY_EPS)):
        for o, w in zip(call(op, inputs, eps, np.float32(0.0), backend="reference"), want, strict=True):
            assert torch.equal(o, w)
    # an integer eps from NumPy: a real number like Python's 1
    got = call(op, inputs, np.int64(1), np.int32(0), backend="reference")
    for o, w in zip(got, call(op, inputs, 1.0, 0.0, backend="reference"), strict=True):
        assert torch.equal(o, w)


def test_bool_tensor_and_bad_numpy_eps_are_refused():
    x = torch.zeros(2, 4)
    for bad in (True, np.True_, np.array([1e-6])):
        with pytest.raises(TypeError, match="eps must be a float"):
            rms_norm(x, None, bad)
    with pytest.raises(TypeError, match=r"eps must be a float .*got Tensor \(pass float\(t\) for a 0-d tensor\)"):
        layer_norm(x, None, None, torch.tensor(1e-5))
    with pytest.raises(TypeError, match="offset must be a float"):
        residual_rms_norm(x, x, None, 1e-6, offset=np.bool_(False))
    # the bounds hold for NumPy scalars too: 1e-50 is 0 in float32, 1e300 inf
    for bad in (np.float32(0.0), np.float64(-1e-6), np.float64(1e-50), np.float64(1e300), np.float32("nan")):
        with pytest.raises(ValueError, match="eps must be"):
            rms_norm_gated(x, x, None, bad)
    with pytest.raises(ValueError, match="offset must be finite"):
        rms_norm(x, None, offset=np.float32("inf"))


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


def test_modules_take_numpy_scalar_eps_as_python_floats(seed):
    x = testing.randn(4, 16, seed=seed)
    m = RMSNorm(16, eps=np.float32(NUMPY_EPS), offset=np.float64(1.0))
    ln = LayerNorm(16, eps=np.float32(NUMPY_EPS))
    assert type(m.eps) is float and type(m.offset) is float and type(ln.eps) is float
    assert m.eps == NUMPY_EPS and m.offset == 1.0 and ln.eps == NUMPY_EPS
    with torch.no_grad():
        m.weight.copy_(testing.randn(16, seed=seed + 1))
        ln.weight.copy_(testing.randn(16, seed=seed + 2))
        ln.bias.copy_(testing.randn(16, seed=seed + 3))
    w, b = m.weight.detach(), ln.bias.detach()
    testing.assert_close_to_reference(m(x), reference.rms_norm(x, w, NUMPY_EPS, offset=1.0),
                                      torch.nn.functional.rms_norm(x, (16,), eps=NUMPY_EPS) * (1.0 + w))
    testing.assert_close_to_reference(ln(x), reference.layer_norm(x, ln.weight.detach(), b, NUMPY_EPS),
                                      torch.nn.functional.layer_norm(x, (16,), ln.weight.detach(), b, NUMPY_EPS))
    # checked at construction, not at the first forward
    with pytest.raises(TypeError, match="RMSNorm: eps must be a float"):
        RMSNorm(16, eps=True)
    with pytest.raises(ValueError, match="LayerNorm: eps must be a float32 normal"):
        LayerNorm(16, eps=np.float64(1e-50))


def test_modules_with_numpy_scalar_eps_compile_without_graph_break(no_interpreter, seed):
    # the modules hold Python floats: dynamo traces a NumPy scalar as a 0-d ndarray, which the ops refuse
    x = testing.randn(4, 32, seed=seed)
    for m in (RMSNorm(32, eps=np.float32(NUMPY_EPS)), LayerNorm(32, eps=np.float32(NUMPY_EPS))):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), m(x))


@pytest.mark.parametrize("module", [RMSNorm, LayerNorm])
def test_module_hidden_size_is_checked_and_stored_as_int(module):
    # an int, NumPy / 0-d tensor integers and one-dim shapes (nn.LayerNorm((8,)) style) give one module
    for size in (8, np.int64(8), torch.tensor(8), (8,), [8], torch.Size([8])):
        m = module(size)
        assert type(m.hidden_size) is int and m.hidden_size == 8 and m.weight.shape == (8,)
        assert repr(m).startswith(f"{module.__name__}(8, eps=")
    assert module(0).weight.shape == (0,)
    # a shape of two dims built a (4, 8) weight that every forward refused with layer_norm's /
    # rms_norm's "weight must have shape (8,)"; negative sizes raised torch's RuntimeError
    for bad in ((4, 8), (), -1):
        with pytest.raises(ValueError, match=f"{module.__name__}: .*hidden_size"):
            module(bad)
    for bad in (8.0, True, "8", None):
        with pytest.raises(TypeError, match=f"{module.__name__}: hidden_size must be an int, got"):
            module(bad)


@pytest.mark.parametrize("offset", [0.0, 1.0, 0.5, -2.0])
def test_rms_norm_module_starts_as_the_identity_scale_for_any_offset(offset, seed):
    # the weight starts at 1 - offset (it was ones for every offset but 1.0: a scale of 1.5 at 0.5)
    x = testing.randn(4, 16, seed=seed)
    m = RMSNorm(16, eps=1e-5, offset=offset)
    assert torch.equal(m.weight.detach(), torch.full((16,), 1.0 - offset))
    with torch.no_grad():
        testing.assert_close_to_reference(m(x), reference.rms_norm(x, None, 1e-5),
                                          torch.nn.functional.rms_norm(x, (16,), eps=1e-5))


def test_modules_reset_parameters_after_meta_device_construction(seed):
    """Meta-device initialisation (FSDP, `to_empty`) calls reset_parameters where a module has
    it; ours had none, so their weights kept whatever to_empty's memory held."""
    x = testing.randn(4, 16, seed=seed)
    for m, nn_m in ((RMSNorm(16, eps=1e-5, offset=1.0, device="meta"), nn.RMSNorm(16, eps=1e-5)),
                    (LayerNorm(16, device="meta"), nn.LayerNorm(16))):
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():  # what to_empty may leave
                p.copy_(testing.randn(16, seed=seed + 1))
        m.reset_parameters()
        with torch.no_grad():
            ref = (reference.rms_norm(x, None, 1e-5) if isinstance(m, RMSNorm)
                   else reference.layer_norm(x, None, None, 1e-5))
            testing.assert_close_to_reference(m(x), ref, nn_m(x))
    ln = LayerNorm(16, elementwise_affine=False)
    ln.reset_parameters()  # no parameters: nothing to reset
    assert ln.weight is None and ln.bias is None


def test_layer_norm_module_repr_names_both_parameters():
    # with bias=False the repr said affine=True, as for the full affine
    assert repr(LayerNorm(8)) == "LayerNorm(8, eps=1e-05, elementwise_affine=True, bias=True)"
    assert repr(LayerNorm(8, bias=False)) == "LayerNorm(8, eps=1e-05, elementwise_affine=True, bias=False)"
    no_affine = "LayerNorm(8, eps=1e-05, elementwise_affine=False, bias=False)"
    assert repr(LayerNorm(8, elementwise_affine=False)) == no_affine
    model = nn.Sequential(nn.LayerNorm(8, bias=False))
    patch_hf(model)  # the replacement takes the parameters after construction
    assert repr(model[0]) == "LayerNorm(8, eps=1e-05, elementwise_affine=True, bias=False)"


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
    assert model[1].variance_epsilon == 1e-5  # the name HF code reads
    assert isinstance(model[2][0], RMSNorm) and model[2][0].offset == 1.0
    assert isinstance(model[3], LayerNorm)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    with torch.no_grad():
        # float32 on both sides; only the norms' summation order differs (docs/correctness.md, norms)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert patch_hf(model) == 0  # nothing left to swap


def test_patch_hf_keeps_hooks_and_leaves_accelerate_wrapped_norms_alone(seed):
    """A forward hook on a replaced norm fires on its replacement (kernel_lab.shared.hf); a norm
    whose forward accelerate wrapped (`_hf_hook`: device_map / offload) is not replaced."""
    hooked, wrapped = LlamaRMSNorm(24), nn.LayerNorm(24)
    calls = []
    hooked.register_forward_hook(lambda m, args, out: calls.append(m))
    wrapped._hf_hook = object()
    model = nn.ModuleList([hooked, wrapped])
    assert patch_hf(model) == 1
    assert isinstance(model[0], RMSNorm) and model[1] is wrapped
    model[0](testing.randn(3, 24, seed=seed))
    assert calls == [model[0]]


def test_patch_hf_converts_numpy_scalar_eps(seed):
    """Norms built from a config that holds eps as np.float32 (nn.LayerNorm keeps it as given):
    swapped, with a Python float eps, and the same outputs."""
    model = nn.Sequential(LlamaRMSNorm(24, eps=np.float32(NUMPY_EPS)), nn.Linear(24, 24),
                          nn.LayerNorm(24, eps=np.float32(NUMPY_EPS)), GemmaRMSNorm(24, eps=np.float64(NUMPY_EPS)))
    torch.manual_seed(seed % 2**31)
    for p in model.parameters():
        nn.init.normal_(p)
    x = testing.randn(7, 24, seed=seed)
    with torch.no_grad():
        expected = model(x)
    assert patch_hf(model) == 3
    for i in (0, 2, 3):
        assert type(model[i]) in (RMSNorm, LayerNorm) and type(model[i].eps) is float and model[i].eps == NUMPY_EPS
    with torch.no_grad():
        # float32 on both sides; only the norms' summation order differs (docs/correctness.md, norms)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_patch_hf_refuses_an_eps_the_kernels_cannot_take_before_replacing_anything():
    model = nn.Sequential(nn.LayerNorm(8), LlamaRMSNorm(8, eps=np.float32(0.0)))
    with pytest.raises(ValueError, match="eps must be a float32 normal"):
        patch_hf(model)
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is LlamaRMSNorm


@pytest.mark.parametrize("model", ["model", None, [nn.LayerNorm(8)], {"norm": nn.LayerNorm(8)}],
                         ids=["str", "None", "list", "dict"])
def test_patch_hf_refuses_a_non_module(model):
    # an AttributeError on named_modules before
    with pytest.raises(TypeError, match=r"patch_hf: model must be a torch\.nn\.Module, got"):
        patch_hf(model)


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
