"""SwiGLUMLP / GeGLUMLP against the gated-MLP reference, and patch_hf on small HF models."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernel_lab import mlp
from kernel_lab.shared import reference
from kernel_lab.shared.testing import assert_close_to_reference, randn


def _init_(module: nn.Module, seed: int) -> nn.Module:
    """Fresh seeded weights of a realistic scale (1/sqrt(fan_in)), never zeros or ones."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            fan_in = p.shape[-1] if p.ndim > 1 else 16
            p.copy_(randn(*p.shape, seed=seed + i, scale=fan_in**-0.5))
    return module


def _weight(proj: nn.Module) -> torch.Tensor:
    """A projection's (out, in) weight: nn.Linear's, or the test's _LinearLike's transposed buffer."""
    return proj.weight if isinstance(proj, nn.Linear) else proj.weight_t.t()


def _reference_mlp(m: mlp.GatedMLP, x: torch.Tensor) -> torch.Tensor:
    if m.fuse_gate_up:
        w_gate, w_up = _weight(m.gate_up_proj).chunk(2, dim=0)
        b = m.gate_up_proj.bias
        b_gate, b_up = (None, None) if b is None else b.chunk(2)
    else:
        w_gate, w_up = _weight(m.gate_proj), _weight(m.up_proj)
        b_gate, b_up = m.gate_proj.bias, m.up_proj.bias
    return reference.gated_mlp(
        x, w_gate, w_up, _weight(m.down_proj), m.activation, m.approximate, b_gate, b_up, m.down_proj.bias
    )


def _eager_mlp(m: mlp.GatedMLP, x: torch.Tensor) -> torch.Tensor:
    if m.fuse_gate_up:
        g, u = m.gate_up_proj(x).chunk(2, dim=-1)
    else:
        g, u = m.gate_proj(x), m.up_proj(x)
    act = F.silu(g) if m.activation == "silu" else F.gelu(g, approximate=m.approximate)
    return m.down_proj(act * u)


@pytest.mark.interpret
@pytest.mark.parametrize("cls_kw", [("swiglu", {}), ("geglu", {"approximate": "tanh"}), ("geglu", {})], ids=str)
@pytest.mark.parametrize("fuse_gate_up", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_module_matches_reference_forward_and_grads(kernel_device, seed, cls_kw, fuse_gate_up, bias):
    name, kw = cls_kw
    cls = mlp.SwiGLUMLP if name == "swiglu" else mlp.GeGLUMLP
    m = _init_(cls(24, 40, bias, fuse_gate_up=fuse_gate_up, **kw), seed).to(kernel_device)
    x = randn(2, 5, 24, device=kernel_device, seed=seed + 100, requires_grad=True)
    y = m(x)
    assert_close_to_reference(y, _reference_mlp(m, x.detach()), _eager_mlp(m, x.detach()), name="y")
    # gradients: the same module run eagerly (torch activation) is the baseline of each grad
    dy = randn(*y.shape, device=kernel_device, seed=seed + 200)
    params = [x, *m.parameters()]
    grads = torch.autograd.grad(y, params, dy)
    x64 = x.detach().cpu().double().requires_grad_(True)
    m64 = _init_(cls(24, 40, bias, fuse_gate_up=fuse_gate_up, **kw), seed).double()
    ref_grads = torch.autograd.grad(_eager_mlp(m64, x64), [x64, *m64.parameters()], dy.cpu().double())
    base_grads = torch.autograd.grad(_eager_mlp(m, x), params, dy)
    for (pname, _), g, r, b in zip([("x", x), *m.named_parameters()], grads, ref_grads, base_grads, strict=True):
        assert_close_to_reference(g, r, b, name=f"d{pname}")


def test_gated_mlp_module_rejects_bad_arguments():
    with pytest.raises(ValueError, match="hidden_size"):
        mlp.SwiGLUMLP(0, 8)
    with pytest.raises(ValueError, match="approximate"):
        mlp.GeGLUMLP(8, 8, approximate="fast")
    # silu has no tanh form: the argument was accepted and ignored
    with pytest.raises(ValueError, match="applies to the gelu activation only"):
        mlp.SwiGLUMLP(8, 8, approximate="tanh")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        mlp.patch_hf("model")


def test_from_projections_rejects_projections_that_are_no_gated_mlp():
    """Mismatched sizes failed only at the first forward (or not at all), a non-linear module
    with an AttributeError, fuse_gate_up=True with an error about meta tensors."""
    lin = nn.Linear
    with pytest.raises(ValueError, match=r"up_proj \(6 -> 8\) .* are not a gated MLP"):
        mlp.SwiGLUMLP.from_projections(lin(4, 8), lin(6, 8), lin(8, 4))
    with pytest.raises(ValueError, match="are not a gated MLP"):
        mlp.SwiGLUMLP.from_projections(lin(4, 8), lin(4, 6), lin(8, 4))
    with pytest.raises(ValueError, match=r"down_proj \(6 -> 4\) are not a gated MLP"):
        mlp.GeGLUMLP.from_projections(lin(4, 8), lin(4, 8), lin(6, 4))
    with pytest.raises(TypeError, match=r"gate_proj must be an nn\.Linear or a linear-like module .*, got ReLU"):
        mlp.SwiGLUMLP.from_projections(nn.ReLU(), lin(4, 8), lin(8, 4))
    with pytest.raises(TypeError, match=r"gate_up_proj must be an nn\.Linear or a linear-like module .*, got ReLU"):
        mlp.SwiGLUMLP.from_packed_projections(nn.ReLU(), lin(8, 4))
    with pytest.raises(TypeError, match="fuse_gate_up"):
        mlp.SwiGLUMLP.from_projections(lin(4, 8), lin(4, 8), lin(8, 4), fuse_gate_up=True)
    m = mlp.SwiGLUMLP.from_projections(lin(4, 8), lin(4, 8), lin(8, 4))
    assert m(torch.randn(2, 4)).shape == (2, 4)
    # patch_hf leaves such a module alone instead of raising
    odd = _ToyHFMLP(nn.SiLU())
    odd.up_proj = lin(16, 20, bias=False)
    model = nn.Sequential(odd)
    assert mlp.patch_hf(model) == 0 and model[0] is odd


class _ToyHFMLP(nn.Module):
    """The attribute layout of LlamaMLP / GemmaMLP, without transformers."""

    def __init__(self, act_fn: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down_proj, self.act_fn = nn.Linear(24, 16, bias=False), act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_patch_hf_replaces_gated_mlps_by_their_activation_and_keeps_weights(seed):
    class Tanh(nn.Module):  # an activation kernel_lab does not fuse: left alone
        def forward(self, x):
            return torch.tanh(x)

    model = nn.ModuleDict(
        {
            "a": _ToyHFMLP(nn.SiLU()),
            "b": nn.Sequential(_ToyHFMLP(nn.GELU(approximate="tanh"))),
            "c": _ToyHFMLP(nn.GELU()),
            "d": _ToyHFMLP(Tanh()),
        }
    )
    _init_(model, seed)
    weight = model["a"].gate_proj.weight
    x = randn(3, 16, seed=seed + 1)
    before = {k: model[k](x) for k in model}
    assert mlp.patch_hf(model) == 3
    assert isinstance(model["a"], mlp.SwiGLUMLP) and model["a"].gate_proj.weight is weight
    assert isinstance(model["b"][0], mlp.GeGLUMLP) and model["b"][0].approximate == "tanh"
    assert isinstance(model["c"], mlp.GeGLUMLP) and model["c"].approximate == "none"
    assert isinstance(model["d"], _ToyHFMLP)
    for k in model:
        torch.testing.assert_close(model[k](x), before[k], rtol=1e-5, atol=1e-6)
    assert mlp.patch_hf(model) == 0  # idempotent


def test_patch_hf_replaces_a_shared_mlp_once():
    shared = _ToyHFMLP(nn.SiLU())
    model = nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared)])
    assert mlp.patch_hf(model) == 1
    assert isinstance(model[0][0], mlp.SwiGLUMLP) and model[0][0] is model[1][0]


def test_patch_hf_keeps_hooks_and_leaves_accelerate_wrapped_mlps_alone(seed):
    """A forward hook on a replaced MLP fires on its replacement (kernel_lab.shared.hf); an MLP
    whose forward accelerate wrapped (`_hf_hook`: device_map / offload) is not replaced."""
    hooked, wrapped = _ToyHFMLP(nn.SiLU()), _ToyHFMLP(nn.SiLU())
    _init_(hooked, seed)
    calls = []
    hooked.register_forward_hook(lambda m, args, out: calls.append(m))
    wrapped._hf_hook = object()
    model = nn.ModuleList([hooked, wrapped])
    assert mlp.patch_hf(model) == 1
    assert isinstance(model[0], mlp.SwiGLUMLP) and model[1] is wrapped
    model[0](randn(3, 16, seed=seed))
    assert calls == [model[0]]


def test_patch_hf_leaves_sparse_activation_mlps_alone():
    """Gemma 3n's MLP layers with activation_sparsity > 0 take a top-k of the gate first: not a
    plain gated MLP, left alone (the dense layers, sparsity 0, are swapped)."""
    sparse, dense = _ToyHFMLP(nn.GELU(approximate="tanh")), _ToyHFMLP(nn.GELU(approximate="tanh"))
    sparse.activation_sparsity, dense.activation_sparsity = 0.95, 0.0
    model = nn.ModuleList([sparse, dense])
    assert mlp.patch_hf(model) == 1
    assert model[0] is sparse and isinstance(model[1], mlp.GeGLUMLP)


def test_patch_hf_leaves_mlps_with_more_than_the_plain_forward_alone():
    """Multipliers (FalconH1), clamps (DeepSeek-V4, GLM-5), a dropout or a sub-norm change the
    forward: such a module is left alone, a plain one beside it is swapped."""
    scaled, dropped, plain = (_ToyHFMLP(nn.SiLU()) for _ in range(3))
    scaled.gate_multiplier = 0.5
    dropped.dropout = nn.Dropout(0.1)
    model = nn.ModuleList([scaled, dropped, plain])
    assert mlp.patch_hf(model) == 1
    assert model[0] is scaled and model[1] is dropped and isinstance(model[2], mlp.SwiGLUMLP)


class _ToyPackedHFMLP(nn.Module):
    """The attribute layout of Phi3MLP / GlmMLP: one gate_up_proj whose output is [gate | up]
    (or [up | gate], as Phi-4-multimodal's audio MLP, with up_first)."""

    def __init__(self, act_fn: nn.Module, up_first: bool = False, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(16, 48, bias=bias)
        self.down_proj, self.activation_fn = nn.Linear(24, 16, bias=bias), act_fn
        if up_first:
            self.forward = self._up_first

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))

    def _up_first(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


@pytest.mark.parametrize("bias", [False, True])
def test_patch_hf_replaces_packed_gate_up_mlps_sharing_the_projections(seed, bias):
    acts = (nn.SiLU(), nn.GELU(approximate="tanh"))
    model = nn.ModuleList([_ToyPackedHFMLP(act, bias=bias) for act in acts])
    _init_(model, seed)
    gate_up, down = model[0].gate_up_proj, model[0].down_proj
    keys = set(model.state_dict())
    x = randn(3, 5, 16, seed=seed + 1)
    with torch.no_grad():
        before = [m(x) for m in model]
    assert mlp.patch_hf(model) == 2
    assert isinstance(model[0], mlp.SwiGLUMLP) and model[0].fuse_gate_up
    assert isinstance(model[1], mlp.GeGLUMLP) and model[1].fuse_gate_up and model[1].approximate == "tanh"
    assert model[0].gate_up_proj is gate_up and model[0].down_proj is down  # shared, not copied
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        for m, b in zip(model, before, strict=True):
            assert_close_to_reference(m(x), _reference_mlp(m, x), _eager_mlp(m, x), name="packed mlp")
            # and against the module it replaced (float32, apart in the activation's rounding only)
            torch.testing.assert_close(m(x), b, rtol=1e-5, atol=1e-6)
    assert mlp.patch_hf(model) == 0  # idempotent


def test_patch_hf_leaves_packed_mlps_it_cannot_verify_alone():
    """The split order of gate_up_proj is checked on the module's forward: an [up | gate] split, a
    packed MLP with meta weights (the forward cannot run on data) or with an extra submodule stays."""
    up_first = _ToyPackedHFMLP(nn.SiLU(), up_first=True)
    with torch.device("meta"):
        meta = _ToyPackedHFMLP(nn.SiLU())
    dropped = _ToyPackedHFMLP(nn.SiLU())
    dropped.dropout = nn.Dropout(0.1)
    plain = _ToyPackedHFMLP(nn.SiLU())
    model = nn.ModuleList([up_first, meta, dropped, plain])
    assert mlp.patch_hf(model) == 1
    assert model[0] is up_first and model[1] is meta and model[2] is dropped
    assert isinstance(model[3], mlp.SwiGLUMLP) and model[3].fuse_gate_up


@pytest.mark.parametrize("family", ["phi3", "glm"])
def test_patch_hf_on_small_transformers_packed_mlp_model_keeps_logits(seed, family):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg_cls, model_cls, mlp_cls = {
        "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi3MLP"),
        "glm": ("GlmConfig", "GlmForCausalLM", "GlmMLP"),
    }[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    config = getattr(transformers, cfg_cls)(
        vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(seed % 2**31)
    model = getattr(transformers, model_cls)(config).eval()
    assert all(type(layer.mlp).__name__ == mlp_cls for layer in model.model.layers)
    weights = [layer.mlp.gate_up_proj.weight for layer in model.model.layers]
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        before = model(ids).logits
        assert mlp.patch_hf(model) == 2
        after = model(ids).logits
    assert all(isinstance(layer.mlp, mlp.SwiGLUMLP) and layer.mlp.fuse_gate_up for layer in model.model.layers)
    assert all(layer.mlp.gate_up_proj.weight is w for layer, w in zip(model.model.layers, weights, strict=True))
    # float32 end to end; the fused activation rounds once where torch rounds twice
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_patch_hf_on_small_transformers_model_keeps_logits(seed, family):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    common = dict(
        vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    cfg_cls, model_cls, expected = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", mlp.SwiGLUMLP),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", mlp.SwiGLUMLP),
        "mistral": ("MistralConfig", "MistralForCausalLM", mlp.SwiGLUMLP),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", mlp.GeGLUMLP),
    }[family]
    extra = {"head_dim": 8} if family == "gemma" else {}
    torch.manual_seed(seed % 2**31)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**common, **extra)).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        before = model(ids).logits
        assert mlp.patch_hf(model) == 2
        after = model(ids).logits
    assert all(isinstance(layer.mlp, expected) for layer in model.model.layers)
    # float32 end to end; the fused activation rounds once where torch rounds twice
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


class _LinearLike(nn.Module):
    """A linear projection that is no nn.Linear and has no `weight` (as kernel_lab.gemm's
    QuantizedLinear, which keeps codes and scales): in_features, out_features, a bias, and a
    transposed weight buffer."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", linear.weight.detach().t().clone())
        self.bias = linear.bias

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def test_patch_hf_adopts_linear_like_projections(seed):
    """Projections that are not nn.Linear but have its interface (in_features, out_features,
    bias: `_is_linear_like`) are adopted as they are, in the split and the packed layout (whose
    split order is probed through the projections' own forward); a projection without that
    interface (an nn.Sequential around an nn.Linear) leaves its MLP alone."""
    split, wrapped = _ToyHFMLP(nn.SiLU()), _ToyHFMLP(nn.SiLU())
    packed = _ToyPackedHFMLP(nn.GELU(approximate="tanh"), bias=True)
    model = nn.ModuleList([split, packed, wrapped])
    _init_(model, seed)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(split, name, _LinearLike(getattr(split, name)))
    packed.gate_up_proj, packed.down_proj = _LinearLike(packed.gate_up_proj), _LinearLike(packed.down_proj)
    wrapped.down_proj = nn.Sequential(wrapped.down_proj)
    projections = [split.gate_proj, split.up_proj, split.down_proj, packed.gate_up_proj, packed.down_proj]
    keys = set(model.state_dict())
    x = randn(3, 5, 16, seed=seed + 1)
    with torch.no_grad():
        before = [m(x) for m in model]
    assert mlp.patch_hf(model) == 2  # 0 before: only nn.Linear projections were recognised
    assert isinstance(model[0], mlp.SwiGLUMLP) and not model[0].fuse_gate_up
    assert isinstance(model[1], mlp.GeGLUMLP) and model[1].fuse_gate_up and model[1].approximate == "tanh"
    assert model[2] is wrapped
    adopted = [model[0].gate_proj, model[0].up_proj, model[0].down_proj, model[1].gate_up_proj, model[1].down_proj]
    assert all(a is p for a, p in zip(adopted, projections, strict=True))
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        for m in model[:2]:  # the two swapped modules
            assert_close_to_reference(m(x), _reference_mlp(m, x), _eager_mlp(m, x), name="linear-like mlp")
        for m, b in zip(model, before, strict=True):
            # the swapped module against the one it replaced: both float32 through the same
            # projections, apart in the activation's rounding only (the rule above bounds the error)
            torch.testing.assert_close(m(x), b, rtol=1e-5, atol=1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("order", ["gemm_then_mlp", "mlp_then_gemm"])
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_patch_hf_combines_with_gemm_patch_hf_in_either_order(seed, family, order, bits):
    """kernel_lab.gemm's patch_hf (nn.Linear -> gemm.Linear, or QuantizedLinear with bits) before
    or after this one: every MLP is swapped (gemm first with bits=8 swapped none, silently: its
    QuantizedLinear projections are no nn.Linear), every linear but lm_head is gemm's, the state
    dict keys are those of the gemm-only model, and the float16 logits keep gemm's tolerance rule
    (factor 2) against the float64 model of the same (dequantized) weights."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    gemm = pytest.importorskip("kernel_lab.gemm", reason="kernel_lab.gemm is not installed")
    cfg_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM")
    }[family]
    config = getattr(transformers, cfg_cls)(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed % 2**31)
    model = getattr(transformers, model_cls)(config).eval().to(torch.float16)
    dense = copy.deepcopy(model)
    n_linear = sum(type(m) is nn.Linear for name, m in model.named_modules() if "lm_head" not in name)
    gemm_only = copy.deepcopy(model)
    assert gemm.patch_hf(gemm_only, bits=bits, group_size=32) == n_linear
    steps = {"gemm": lambda: gemm.patch_hf(model, bits=bits, group_size=32), "mlp": lambda: mlp.patch_hf(model)}
    counts = {step: steps[step]() for step in order.split("_then_")}
    assert counts == {"gemm": n_linear, "mlp": 2}
    proj_cls = gemm.Linear if bits is None else gemm.QuantizedLinear
    for layer in model.model.layers:
        assert isinstance(layer.mlp, mlp.SwiGLUMLP) and layer.mlp.fuse_gate_up == (family == "phi3")
        assert all(isinstance(p, proj_cls) for p in layer.mlp.children())
    assert set(model.state_dict()) == set(gemm_only.state_dict())
    assert mlp.patch_hf(model) == 0 and gemm.patch_hf(model, bits=bits) == 0  # idempotent, either way
    with torch.no_grad():  # the reference model: the unpatched one with the weights the patched one uses
        for name, m in model.named_modules():
            if isinstance(m, gemm.QuantizedLinear):
                dense.get_submodule(name).weight.copy_(m.qweight.dequantize())
        ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(seed))
        ref = copy.deepcopy(dense).double()(ids).logits
        baseline, out = dense(ids).logits, model(ids).logits
    assert_close_to_reference(out, ref, baseline, factor=2.0, name=f"{family} {order} bits={bits} logits")
