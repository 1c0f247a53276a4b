"""kernel_lab.attention: FlashAttention-style attention (forward and backward, GQA, varlen,
sliding window), rotary embeddings, and a Hugging Face attention backend."""

from .modules import patch_hf, register_hf
from .ops import apply_rope, attention, attention_backend, flash_attention, flash_attention_varlen

__version__ = "0.1.9"
__all__ = [
    "apply_rope",
    "attention",
    "attention_backend",
    "flash_attention",
    "flash_attention_varlen",
    "patch_hf",
    "register_hf",
]
