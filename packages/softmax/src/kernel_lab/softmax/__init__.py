"""kernel_lab.softmax: Triton softmax and log-softmax, forward and backward."""

from .modules import LogSoftmax, Softmax
from .ops import log_softmax, softmax

__version__ = "0.2.18"
__all__ = ["LogSoftmax", "Softmax", "log_softmax", "softmax"]
