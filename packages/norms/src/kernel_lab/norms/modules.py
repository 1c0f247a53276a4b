"""nn.Module drop-ins and `patch_hf`, which swaps a Hugging Face model's norms for them."""

from __future__ import annotations

import operator

import torch
from torch import nn

from kernel_lab.shared import hf

from .ops import check_eps_offset, layer_norm, rms_norm

# Hugging Face RMSNorm classes `patch_hf` replaces, by class name, with their weight offset:
# Gemma stores w - 1 and multiplies by (1 + w).
HF_RMS_NORM_OFFSETS: dict[str, float] = {
    "LlamaRMSNorm": 0.0,
    "MistralRMSNorm": 0.0,
    "MixtralRMSNorm": 0.0,
    "Qwen2RMSNorm": 0.0,
    "Qwen2MoeRMSNorm": 0.0,
    "Qwen3RMSNorm": 0.0,
    "Qwen3MoeRMSNorm": 0.0,
    "Phi3RMSNorm": 0.0,  # (the same forward as LlamaRMSNorm)
    "GemmaRMSNorm": 1.0,
    "Gemma2RMSNorm": 1.0,
    "Gemma3RMSNorm": 1.0,
}


def _check_hidden_size(name: str, hidden_size) -> int:
    """hidden_size as an int: an int (NumPy and 0-d integer tensors too, not bools) or, as
    `torch.nn.LayerNorm`'s normalized_shape, a shape of one dim. These modules normalize over the
    last dim only: a longer shape would build a weight that every forward refuses."""
    shape = hidden_size
    if isinstance(hidden_size, (tuple, list, torch.Size)):
        if len(hidden_size) != 1:
            raise ValueError(f"{name}: normalizes over the last dim only; hidden_size must be an int or a "
                             f"shape of one dim, got {tuple(hidden_size)}")
        shape = hidden_size[0]
    try:
        if isinstance(shape, bool):
            raise TypeError
        n = operator.index(shape)
    except TypeError:
        raise TypeError(f"{name}: hidden_size must be an int, got {type(shape).__name__}") from None
    if n < 0:
        raise ValueError(f"{name}: hidden_size must be >= 0, got {n}")
    return n


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * (offset + weight).

    hidden_size: an int or a shape of one dim ((hidden,), as torch.nn.RMSNorm takes), stored as
    an int. weight: (hidden_size,), initialised (`reset_parameters`) to 1 - offset, so that
    y = x / rms(x) (ones, or zeros when offset is 1.0, the Gemma convention). See
    `kernel_lab.norms.rms_norm` for dtypes and layouts. eps and offset are checked here and kept
    as Python floats (NumPy scalars, as some Hugging Face configs hold, are converted). Raises
    TypeError / ValueError for a bad hidden_size, eps or offset.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden_size = _check_hidden_size(type(self).__name__, hidden_size)
        eps, offset = check_eps_offset(type(self).__name__, eps, offset)
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initial weight, 1 - offset: the identity scale for any offset (it was ones for every
        offset but 1.0, a scale of 1.5 at offset 0.5). Meta-device initialisation (FSDP,
        `to_empty`) calls it, as for torch.nn.RMSNorm."""
        nn.init.constant_(self.weight, 1.0 - self.offset)

    @property
    def variance_epsilon(self) -> float:
        """eps, under the name Hugging Face's RMSNorm modules give it: code that reads it from a
        module `patch_hf` swapped (exporters, serving engines' weight loaders) still finds it."""
        return self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, a drop-in for `torch.nn.LayerNorm(hidden_size)`:
    y = (x - mean) / sqrt(var + eps) * weight + bias. See `kernel_lab.norms.layer_norm`.
    hidden_size and eps as `RMSNorm`'s: checked here, kept as an int and a Python float."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden_size = _check_hidden_size(type(self).__name__, hidden_size)
        self.hidden_size, self.eps = hidden_size, float(check_eps_offset(type(self).__name__, eps)[0])
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(hidden_size, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(hidden_size, **kw)) if elementwise_affine and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight ones, bias zeros, as torch.nn.LayerNorm.reset_parameters (which meta-device
        initialisation, FSDP or `to_empty`, calls where a module has it)."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        # both parameters: bias=False (weight only) showed as the full affine before
        return (f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.weight is not None}, "
                f"bias={self.bias is not None}")


def _replacement(module: nn.Module) -> nn.Module | None:
    """Our module sharing `module`'s parameters, or None if it is not a norm we replace."""
    name = type(module).__name__
    if name in HF_RMS_NORM_OFFSETS:
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(weight, nn.Parameter) or weight.ndim != 1 or eps is None:
            return None
        # eps as the module holds it (a NumPy scalar from some configs): RMSNorm checks and converts
        new = RMSNorm(weight.shape[0], eps, HF_RMS_NORM_OFFSETS[name], device="meta")
        new.weight = weight  # the same Parameter: tying, device, dtype and optimizer state kept
        return new
    # nn.LayerNorm itself, not subclasses: those compute something else (Nemotron's weight + 1,
    # channels-first 2-D norms) under the same parameters.
    if type(module) is nn.LayerNorm and len(module.normalized_shape) == 1:
        new = LayerNorm(module.normalized_shape[0], module.eps, elementwise_affine=False)
        new.weight, new.bias = module.weight, module.bias
        return new
    return None


def patch_hf(model: nn.Module) -> int:
    """Replace, in place, the RMSNorm modules of a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Phi-3 /
    Gemma model (matched by class name, see HF_RMS_NORM_OFFSETS) and every 1-D
    `torch.nn.LayerNorm` (not its subclasses) by kernel_lab's `RMSNorm` / `LayerNorm`, keeping the
    same weight Parameters; a module shared by several parents is replaced by one module. Returns
    how many modules were swapped.

    Differs from Hugging Face's LlamaRMSNorm in rounding only: that one rounds the normalized
    value to the input dtype before multiplying by the weight (and returns the promoted dtype
    when the weight is float32 and the input is not); ours applies the weight in float32 and
    rounds once, to the input dtype.

    A norm's eps may be a Python or NumPy real scalar (it is stored as a Python float); one that
    the kernels cannot take (not a float32 normal, a bool, a string) raises TypeError / ValueError
    before anything is replaced. TypeError where `model` is not a torch.nn.Module.
    """
    if not isinstance(model, nn.Module):  # (a bare AttributeError on named_modules before)
        raise TypeError(f"patch_hf: model must be a torch.nn.Module, got {type(model).__name__}")
    swaps, replaced = [], {}  # a module shared by several parents gets one replacement, counted once
    for _, parent in model.named_modules():
        # every name: named_children() yields a module registered twice in one parent once, and
        # the second name kept the original
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in replaced:
                new = _replacement(child) if hf.swappable(child) else None
                if new is not None:
                    new.train(child.training)  # an eval-mode model stays in eval mode
                    hf.carry_hooks(child, new)
                replaced[id(child)] = new
            if replaced[id(child)] is not None:
                swaps.append((parent, child_name, replaced[id(child)]))
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    return sum(new is not None for new in replaced.values())
