"""PyTorch references for every kernel_lab primitive: the one copy of the math.

Tests compare kernels against these, benchmarks report error against these, and the ops fall
back to these when no Triton backend is available (see `kernel_lab.shared.runtime.backend`).
Each function computes in `compute_dtype` (float64 by default; the CPU fallback asks for
float32) and returns a tensor of that dtype. One module per primitive; add a line below.
"""

from .attention import (
    apply_rope,
    attention,
    attention_backward,
    attention_blocked,
    attention_mask,
    attention_varlen,
    attention_varlen_backward,
    rope,
    rope_backward,
)
from .gemm import (
    dequantize_weight,
    epilogue_activation,
    epilogue_activation_backward,
    fp8_matmul,
    matmul,
    matmul_backward,
    quantized_matmul,
    rms_norm_linear,
    unpack_int4,
)
from .kvcache import decode_attention, paged_gather
from .mlp import (
    bias_gelu,
    bias_gelu_backward,
    gated_mlp,
    geglu,
    geglu_backward,
    gelu,
    gelu_and_mul,
    gelu_and_mul_backward,
    gelu_backward,
    silu,
    silu_and_mul,
    silu_and_mul_backward,
    silu_backward,
    swiglu,
    swiglu_backward,
)
from .norms import (
    layer_norm,
    layer_norm_backward,
    residual_rms_norm,
    residual_rms_norm_backward,
    rms_norm,
    rms_norm_backward,
    rms_norm_gated,
    rms_norm_gated_backward,
)
from .optim_adamw import adamw_step
from .softmax import log_softmax, log_softmax_backward, softmax, softmax_backward

__all__ = [
    "adamw_step",
    "apply_rope",
    "attention",
    "attention_backward",
    "attention_blocked",
    "attention_mask",
    "attention_varlen",
    "attention_varlen_backward",
    "bias_gelu",
    "bias_gelu_backward",
    "decode_attention",
    "dequantize_weight",
    "epilogue_activation",
    "epilogue_activation_backward",
    "fp8_matmul",
    "gated_mlp",
    "geglu",
    "geglu_backward",
    "gelu",
    "gelu_and_mul",
    "gelu_and_mul_backward",
    "gelu_backward",
    "layer_norm",
    "layer_norm_backward",
    "log_softmax",
    "log_softmax_backward",
    "matmul",
    "matmul_backward",
    "paged_gather",
    "quantized_matmul",
    "residual_rms_norm",
    "residual_rms_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_linear",
    "rope",
    "rope_backward",
    "silu",
    "silu_and_mul",
    "silu_and_mul_backward",
    "silu_backward",
    "softmax",
    "softmax_backward",
    "swiglu",
    "swiglu_backward",
    "unpack_int4",
]
