"""PyTorch references for every kernel_lab primitive: the one copy of the math.

Tests compare kernels against these, benchmarks report error against these, and the ops fall
back to these when no Triton backend is available (see `kernel_lab.shared.runtime.backend`).
Each function computes in `compute_dtype` (float64 by default; the CPU fallback asks for
float32) and returns a tensor of that dtype. One module per primitive; add a line below.
"""

from .softmax import log_softmax, log_softmax_backward, softmax, softmax_backward

__all__ = [
    "log_softmax",
    "log_softmax_backward",
    "softmax",
    "softmax_backward",
]
