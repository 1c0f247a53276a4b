"""kernel_lab.mlp: fused MLP activations in Triton, forward and backward.

Functions: `bias_gelu`, `swiglu`, `geglu`, `silu_and_mul`, `gelu_and_mul`.
Modules: `SwiGLUMLP`, `GeGLUMLP`; `patch_hf(model)` swaps them into Hugging Face models.
"""

from .modules import GatedMLP, GeGLUMLP, SwiGLUMLP, patch_hf
from .ops import bias_gelu, geglu, gelu_and_mul, silu_and_mul, swiglu

__all__ = [
    "GatedMLP",
    "GeGLUMLP",
    "SwiGLUMLP",
    "bias_gelu",
    "geglu",
    "gelu_and_mul",
    "patch_hf",
    "silu_and_mul",
    "swiglu",
]
__version__ = "0.1.16"
