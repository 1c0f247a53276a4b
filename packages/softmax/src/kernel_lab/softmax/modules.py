"""nn.Module drop-ins."""

from __future__ import annotations

import torch
from torch import nn

from .ops import log_softmax, softmax


class Softmax(nn.Module):
    """Drop-in for `torch.nn.Softmax(dim)` running kernel_lab's softmax (see `softmax`).

    `dim` defaults to -1 and must be an integer: torch.nn.Softmax's default None (a deprecated
    implicit dim, 0 for 0-, 1- and 3-d inputs) is not taken.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """Drop-in for `torch.nn.LogSoftmax(dim)` running kernel_lab's log_softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)
