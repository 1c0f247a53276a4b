"""nn.Module drop-ins for gated MLP blocks, and `patch_hf` to swap them into HF models.

The modules hold nn.Linear projections with the Hugging Face attribute names
(gate_proj, up_proj, down_proj), so state dicts load unchanged; only the activation between
the projections is the fused kernel. A projection may also be any linear-like module (see
`_is_linear_like`: e.g. kernel_lab.gemm's `QuantizedLinear`, in either patch order), which the
module calls as it is. With `fuse_gate_up=True` the gate and up projections are
one (2 * intermediate, hidden) nn.Linear `gate_up_proj` whose output rows are [gate | up]: one
GEMM instead of two, and the packed activation (`silu_and_mul` / `gelu_and_mul`) reads its
output in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernel_lab.shared import hf, reference

from .ops import geglu, gelu_and_mul, silu_and_mul, swiglu

__all__ = ["GatedMLP", "GeGLUMLP", "SwiGLUMLP", "patch_hf"]


def _is_linear_like(module: object) -> bool:
    """Whether `module` can serve as a gated MLP projection: an nn.Linear (subclasses included),
    or any other nn.Module with int `in_features` and `out_features` whose `bias`, if it has
    one, is None or a tensor, and whose forward maps (..., in_features) to (..., out_features)
    as x @ W^T + b does. Duck typed, so that the linears of other packages (kernel_lab.gemm's
    `QuantizedLinear`, which keeps int8 / int4 codes instead of a `weight`) are adopted without
    this package importing them."""
    if isinstance(module, nn.Linear):
        return True
    if not isinstance(module, nn.Module):
        return False
    sizes = [getattr(module, a, None) for a in ("in_features", "out_features")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        return False
    return isinstance(getattr(module, "bias", None), (torch.Tensor, type(None)))


def _split_sizes_match(gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> bool:
    """Whether linear-like projections fit together as down(act(gate(x)) * up(x)): gate and up
    of one shape (hidden -> intermediate), down taking intermediate (its output width is free)."""
    d = gate_proj.out_features
    return (up_proj.in_features, up_proj.out_features, down_proj.in_features) == (gate_proj.in_features, d, d)


def _check_linear_like(**projections: object) -> None:
    for arg, p in projections.items():
        if not _is_linear_like(p):
            raise TypeError(f"{arg} must be an nn.Linear or a linear-like module (int in_features / "
                            f"out_features), got {type(p).__name__}")


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with the activation fused in one kernel.

    Use `SwiGLUMLP` (act = silu) or `GeGLUMLP` (act = gelu); this base holds the shared code.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        activation: str = "silu",
        approximate: str = "none",
        fuse_gate_up: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("silu", "gelu"):
            raise ValueError(f"activation must be 'silu' or 'gelu', got {activation!r}")
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        if activation == "silu" and approximate != "none":
            raise ValueError(f"approximate={approximate!r} applies to the gelu activation only; silu takes 'none'")
        for arg, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.approximate, self.fuse_gate_up = activation, approximate, fuse_gate_up
        kw = {"device": device, "dtype": dtype}
        if fuse_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden_size) -> (..., hidden_size)."""
        if self.fuse_gate_up:
            h = self.gate_up_proj(x)
            h = silu_and_mul(h) if self.activation == "silu" else gelu_and_mul(h, self.approximate)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
            h = swiglu(g, u) if self.activation == "silu" else geglu(g, u, self.approximate)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        act = self.activation if self.approximate == "none" else f"{self.activation}-{self.approximate}"
        return f"activation={act}, fuse_gate_up={self.fuse_gate_up}"

    @classmethod
    def from_projections(cls, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, **kwargs) -> GatedMLP:
        """A module that shares the given nn.Linear (or `_is_linear_like`) projections (same
        parameters, no copy): gate_proj and up_proj of one shape (hidden -> intermediate), down_proj
        taking intermediate."""
        _check_linear_like(gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)
        if not _split_sizes_match(gate_proj, up_proj, down_proj):
            raise ValueError(
                f"gate_proj ({gate_proj.in_features} -> {gate_proj.out_features}), up_proj ({up_proj.in_features} "
                f"-> {up_proj.out_features}) and down_proj ({down_proj.in_features} -> {down_proj.out_features}) "
                f"are not a gated MLP"
            )
        with torch.device("meta"):  # build empty, then adopt the caller's projections
            bias = getattr(gate_proj, "bias", None) is not None
            mlp = cls(gate_proj.in_features, gate_proj.out_features, bias, fuse_gate_up=False, **kwargs)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    @classmethod
    def from_packed_projections(cls, gate_up_proj: nn.Module, down_proj: nn.Module, **kwargs) -> GatedMLP:
        """A `fuse_gate_up=True` module that shares the given nn.Linear (or `_is_linear_like`)
        projections (same parameters, no copy). gate_up_proj's output rows are [gate | up]
        (Phi-3, GLM): the packed activation reads the two halves of its output in place."""
        _check_linear_like(gate_up_proj=gate_up_proj, down_proj=down_proj)
        n = gate_up_proj.out_features
        if n % 2 or n != 2 * down_proj.in_features or down_proj.out_features != gate_up_proj.in_features:
            raise ValueError(f"gate_up_proj ({gate_up_proj.in_features} -> {n}) and down_proj "
                             f"({down_proj.in_features} -> {down_proj.out_features}) are not a packed gated MLP")
        with torch.device("meta"):
            bias = getattr(gate_up_proj, "bias", None) is not None
            mlp = cls(gate_up_proj.in_features, n // 2, bias, fuse_gate_up=True, **kwargs)
        mlp.gate_up_proj, mlp.down_proj = gate_up_proj, down_proj
        return mlp


class SwiGLUMLP(GatedMLP):
    """The Llama / Qwen2 / Mistral MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).

    hidden_size, intermediate_size: the projections' sizes; bias: biases on all three
    projections; fuse_gate_up: one gate_up_proj instead of gate_proj and up_proj.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, **kwargs) -> None:
        super().__init__(hidden_size, intermediate_size, bias, activation="silu", **kwargs)


class GeGLUMLP(GatedMLP):
    """The Gemma MLP: down_proj(gelu(gate_proj(x)) * up_proj(x)).

    approximate: "none" (erf GELU) or "tanh" (Gemma's `gelu_pytorch_tanh`); other arguments
    as `SwiGLUMLP`.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, approximate: str = "none", **kwargs
    ) -> None:
        super().__init__(hidden_size, intermediate_size, bias, activation="gelu", approximate=approximate, **kwargs)


def _identify_activation(act_fn) -> tuple[str, str] | None:
    """(activation, approximate) that `act_fn` computes, found by evaluating it, or None.

    HF names the same function many ways (SiLU, SiLUActivation, GELUActivation,
    PytorchGELUTanh, GELUTanh, NewGELUActivation, ...); its values are unambiguous.
    """
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = act_fn(probe)
    except Exception:  # an activation we cannot evaluate is one we do not replace
        return None
    candidates = {
        ("silu", "none"): F.silu(probe),
        ("gelu", "none"): F.gelu(probe),
        ("gelu", "tanh"): F.gelu(probe, approximate="tanh"),
    }
    for key, want in candidates.items():
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-6):
            return key
    return None


# What a plain gated MLP (down(act(gate(x)) * up(x)): Llama, Qwen2/3, Mistral, Gemma; with one
# packed gate_up_proj: Phi-3, GLM) holds besides nn.Module's own state: anything else (FalconH1's
# gate/down multipliers, the clamps of DeepSeek-V4 / GLM-5 (`limit`), a sub-norm or dropout
# module) changes its forward, which the fused module would drop silently.
_PLAIN_MLP_MODULES = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_PACKED_MLP_MODULES = {"gate_up_proj", "down_proj", "act_fn", "activation_fn"}
_PLAIN_MLP_ATTRIBUTES = {"training", "config", "hidden_size", "intermediate_size", "activation_sparsity"}


def _plain_gated_mlp(module: nn.Module, modules: set[str] = _PLAIN_MLP_MODULES) -> bool:
    if set(module._modules) - modules or module._buffers:
        return False
    extra = {k for k in vars(module) if not k.startswith("_")} - _PLAIN_MLP_ATTRIBUTES
    return not extra


def _probe_dtype_device(*projections: nn.Module) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of the projections' first floating tensor (an nn.Linear's weight; a
    quantized linear's scales), the input they take; None when any tensor is on meta or none is
    floating."""
    tensors = [t for p in projections for t in (*p.parameters(), *p.buffers())]
    if any(t.is_meta for t in tensors):
        return None
    weights = [getattr(p, "weight", None) for p in projections]
    buffers = [t for p in projections for t in p.buffers()]  # before a bias, whose dtype may differ
    floating = [t for t in (*weights, *buffers, *tensors) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return (floating[0].dtype, floating[0].device) if floating else None


def _packed_order_is_gate_up(module: nn.Module, gate_up: nn.Module, down: nn.Module, kind: tuple[str, str]) -> bool:
    """Whether `module`'s forward computes down(act(gate) * up) from gate_up's output split
    [gate | up] (Phi-3, GLM), checked on two random rows: Phi-4-multimodal's audio MLP, for one,
    splits it [up | gate]. False when the forward cannot run on real data (meta weights).
    The projections are called as modules (they may be linear-like modules without a `weight`)."""
    like = _probe_dtype_device(gate_up, down)
    if like is None:
        return False
    dtype, device = like
    probe = torch.randn(2, gate_up.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=device, dtype=dtype)
    activation, approximate = kind
    try:
        with torch.no_grad():
            got = module(probe)
            packed = gate_up(probe)
            if activation == "silu":
                act_and_mul = reference.silu_and_mul(packed, compute_dtype=torch.float32)
            else:
                act_and_mul = reference.gelu_and_mul(packed, approximate, compute_dtype=torch.float32)
            want = down(act_and_mul.to(dtype)).float()
    except Exception:  # a forward we cannot run is one we do not replace
        return False
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    # the other order is off by the size of the output itself; 5% of it covers bf16 rounding
    return bool((got.float() - want).abs().max() <= 0.05 * want.abs().max())


def _gated_mlp_layout(module: nn.Module) -> tuple[tuple[nn.Module, ...], tuple[str, str]] | None:
    """(projections, (activation, approximate)) of a plain gated MLP `patch_hf` replaces:
    projections (gate_proj, up_proj, down_proj), or (gate_up_proj, down_proj) for the packed
    layout; None for any other module."""
    if getattr(module, "activation_sparsity", 0.0):
        return None  # Gemma 3n: a top-k of the gate before the activation, which ours does not do
    split = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    if all(_is_linear_like(p) for p in split) and hasattr(module, "act_fn"):
        if not _split_sizes_match(*split) or not _plain_gated_mlp(module):
            return None
        kind = _identify_activation(module.act_fn)
        return None if kind is None else (tuple(split), kind)
    packed = [getattr(module, p, None) for p in ("gate_up_proj", "down_proj")]
    acts = [a for a in ("act_fn", "activation_fn") if hasattr(module, a)]
    if not all(_is_linear_like(p) for p in packed) or len(acts) != 1:
        return None
    gate_up, down = packed
    if gate_up.out_features != 2 * down.in_features or down.out_features != gate_up.in_features:
        return None
    if not _plain_gated_mlp(module, _PACKED_MLP_MODULES):
        return None
    kind = _identify_activation(getattr(module, acts[0]))
    if kind is None or not _packed_order_is_gate_up(module, gate_up, down, kind):
        return None
    return tuple(packed), kind


def patch_hf(model: nn.Module) -> int:
    """Replace, in place, every gated MLP of a Hugging Face model by `SwiGLUMLP` / `GeGLUMLP`.

    A module is replaced when it has linear `gate_proj`, `up_proj` and `down_proj` and an
    `act_fn` that computes SiLU (Llama, Qwen2, Mistral) or GELU, exact or tanh (Gemma), and no
    `activation_sparsity` (Gemma 3n's sparse layers keep their own forward), nor any other
    submodule or attribute (`_plain_gated_mlp`: multipliers, clamps, sub-norms or dropout change
    the forward; such modules are left alone). The new module
    adopts the same nn.Linear objects, so weights, dtype, device and parameter identity
    (optimizer state) are kept. Returns the number of modules replaced.

    The packed layout (Phi-3, GLM, GLM-4: one nn.Linear `gate_up_proj` whose output is [gate | up],
    then `down_proj`, with `act_fn` or `activation_fn`) is replaced by a `fuse_gate_up=True`
    module adopting those two nn.Linear objects (state dict keys unchanged). Its split order is
    checked by running the module's forward once on two random rows (`_packed_order_is_gate_up`),
    so a packed MLP with meta weights, or one whose forward is not down(act(gate) * up), is left
    alone.

    A projection is linear when it is an nn.Linear (subclasses included) or linear-like
    (`_is_linear_like`: an nn.Module with int `in_features` / `out_features` and a `bias` that
    is None or a tensor, if any, computing x @ W^T + b). So kernel_lab.gemm's `patch_hf` may run
    before or after this one: its `Linear` (an nn.Linear) and `QuantizedLinear` (linear-like)
    projections are adopted as they are, and after this one it replaces the nn.Linear
    projections inside the new modules under the same names. Either order gives the same
    modules, state dict keys and logits (within rounding).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_hf: model must be an nn.Module, got {type(model).__name__}")
    targets, layouts = [], {}
    for parent in model.modules():
        for name, child in parent._modules.items():  # every name, a module under two included
            if child is None or isinstance(child, GatedMLP):
                continue
            if id(child) not in layouts:  # a shared module is examined (and probed) once
                layouts[id(child)] = _gated_mlp_layout(child) if hf.swappable(child) else None
            if layouts[id(child)] is not None:
                targets.append((parent, name, child, *layouts[id(child)]))
    replaced: dict[int, nn.Module] = {}  # a module shared by several parents: one replacement
    for parent, name, child, projections, (activation, approximate) in targets:
        new = replaced.get(id(child))
        if new is None:
            cls, kw = (SwiGLUMLP, {}) if activation == "silu" else (GeGLUMLP, {"approximate": approximate})
            if len(projections) == 3:
                new = cls.from_projections(*projections, **kw)
            else:
                new = cls.from_packed_projections(*projections, **kw)
            new.train(parent.training)
            hf.carry_hooks(child, new)
            replaced[id(child)] = new
        setattr(parent, name, new)
    return len(replaced)
