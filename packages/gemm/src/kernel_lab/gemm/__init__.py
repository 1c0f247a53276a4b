"""kernel_lab.gemm: Triton GEMMs: FP16/BF16 matmul with fused epilogues, FP8 scaled matmul,
int8/int4 weight-only matmul, and RMSNorm fused into a linear layer."""

from .modules import Linear, QuantizedLinear, RMSNormLinear, patch_hf
from .ops import (
    QuantizedWeight,
    fp8_matmul,
    matmul,
    quantize_fp8,
    quantize_weight,
    quantized_matmul,
    rms_norm_linear,
)

__version__ = "0.1.23"
__all__ = [
    "Linear",
    "QuantizedLinear",
    "QuantizedWeight",
    "RMSNormLinear",
    "fp8_matmul",
    "matmul",
    "patch_hf",
    "quantize_fp8",
    "quantize_weight",
    "quantized_matmul",
    "rms_norm_linear",
]
