"""kernel_lab.optim_adamw: a fused multi-tensor AdamW, drop-in for torch.optim.AdamW."""

from .ops import adamw_step_
from .optimizer import AdamW

__version__ = "0.2.5"
__all__ = ["AdamW", "adamw_step_"]
