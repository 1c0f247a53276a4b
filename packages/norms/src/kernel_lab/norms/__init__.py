"""kernel_lab.norms: Triton RMSNorm, LayerNorm, fused residual + RMSNorm and gated RMSNorm,
forward and backward."""

from .modules import LayerNorm, RMSNorm, patch_hf
from .ops import layer_norm, residual_rms_norm, rms_norm, rms_norm_gated

__version__ = "0.1.20"
__all__ = [
    "LayerNorm",
    "RMSNorm",
    "layer_norm",
    "patch_hf",
    "residual_rms_norm",
    "rms_norm",
    "rms_norm_gated",
]
