"""nn.Module drop-ins and `patch_hf`, which swaps a Hugging Face model's norms for them."""

from __future__ import annotations

import torch
from torch import nn

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


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * (offset + weight).

    weight: (hidden_size,), initialised so that y = x / rms(x) (ones, or zeros when offset is
    1.0, the Gemma convention). See `kernel_lab.norms.rms_norm` for dtypes and layouts. eps and
    offset are checked here and kept as Python floats (NumPy scalars, as some Hugging Face
    configs hold, are converted).
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
        eps, offset = check_eps_offset(type(self).__name__, eps, offset)
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        init = torch.zeros if offset == 1.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, a drop-in for `torch.nn.LayerNorm(hidden_size)`:
    y = (x - mean) / sqrt(var + eps) * weight + bias. See `kernel_lab.norms.layer_norm`. eps as
    `RMSNorm`'s: checked here, kept as a Python float."""

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
        self.hidden_size, self.eps = hidden_size, float(check_eps_offset(type(self).__name__, eps)[0])
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(hidden_size, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size, **kw)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}"


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
    before anything is replaced.
    """
    swaps, replaced = [], {}  # a module shared by several parents gets one replacement, counted once
    for _, parent in model.named_modules():
        # every name: named_children() yields a module registered twice in one parent once, and
        # the second name kept the original
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in replaced:
                replaced[id(child)] = _replacement(child)
                if replaced[id(child)] is not None:
                    replaced[id(child)].train(child.training)  # an eval-mode model stays in eval mode
            if replaced[id(child)] is not None:
                swaps.append((parent, child_name, replaced[id(child)]))
    for parent, child_name, new in swaps:
        setattr(parent, child_name, new)
    return sum(new is not None for new in replaced.values())
