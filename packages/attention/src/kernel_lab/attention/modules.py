"""Hugging Face integration: an attention backend (`register_hf`) and the RoPE patch (`patch_hf`)."""

from __future__ import annotations

import importlib
import sys

import torch

from kernel_lab.shared import reference

from .ops import apply_rope, flash_attention

HF_NAME = "kernel_lab"


def _require_transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as e:  # the integration is optional; the kernels work without it
        raise ImportError(
            "kernel_lab.attention.register_hf / patch_hf need the `transformers` package, which is not "
            "installed (pip install transformers)"
        ) from e


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention-interface function: query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D)
    -> (attn_output (B, Tq, Hq, D), None).

    With no attention mask (HF's sdpa mask builder returns None for plain causal attention
    without padding) the kernel runs; causal is bottom-right aligned, which is also right for
    decoding and chunked prefill against a KV cache. An explicit mask (padding, packed
    sequences) is handed to transformers' SDPA path unchanged, so results stay correct.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("kernel_lab attention: logit soft-capping (Gemma-2 `softcap`) is not supported")
    if kwargs.get("s_aux") is not None:
        raise ValueError("kernel_lab attention: attention sinks (gpt-oss `s_aux`) are not supported")
    if dropout and module.training:
        raise ValueError("kernel_lab attention: attention dropout is not supported (set attention_dropout=0)")
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    # HF's sliding window of W keeps keys j > i - W, i.e. W - 1 keys to the left of the diagonal.
    window = (sliding_window - 1, -1) if sliding_window else None
    out = flash_attention(query, key, value, causal=causal, scale=scaling, window=window)
    return out.transpose(1, 2), None


def register_hf() -> None:
    """Register kernel_lab attention with transformers as attn_implementation="kernel_lab"
    (Llama, Qwen2, Mistral and other models that use the attention interface).

    Also registers HF's SDPA mask builder under the same name, so plain causal batches reach
    the kernel with no mask and padded batches get an explicit mask (and the SDPA path).
    Raises ImportError with a clear message if transformers is missing.
    """
    transformers = _require_transformers()
    transformers.AttentionInterface.register(HF_NAME, hf_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53 builds masks without this interface
        return
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)


def _hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Drop-in for HF's `apply_rotary_pos_emb` (rotate_half layout): q/k are (B, H, T, D) when
    unsqueeze_dim == 1 (HF's default) and (B, T, H, D) when it is 2."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"kernel_lab apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    if cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return apply_rope(q, k, cos, sin, layout="bhsd" if unsqueeze_dim == 1 else "bshd")


def _is_rotate_half_rope(fn) -> bool:
    """Whether `fn`, a modeling module's apply_rotary_pos_emb, computes the rotate_half RoPE that
    `_hf_apply_rotary_pos_emb` replaces (q * cos + rotate_half(q) * sin, cos/sin of duplicated
    halves): probed on small random tensors. GLM's and Cohere's interleaved RoPE have the same
    name and signature and differ."""
    if fn is _hf_apply_rotary_pos_emb:
        return True
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, 3, 8, generator=gen).unbind(0)  # (B, H, T, D)
    angles = torch.randn(1, 3, 4, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (B, T, D)
    try:
        q_out, k_out = fn(q, k, cos, sin)
    except Exception:  # another signature: not the function this patch knows
        return False
    q_ref, k_ref = reference.apply_rope(q, k, cos, sin, compute_dtype=torch.float32)
    return bool(torch.allclose(q_out, q_ref, atol=1e-6) and torch.allclose(k_out, k_ref, atol=1e-6))


def patch_hf(model: torch.nn.Module) -> torch.nn.Module:
    """Replace `apply_rotary_pos_emb` in the modeling module of `model` (e.g.
    transformers.models.llama.modeling_llama) by kernel_lab's one-launch RoPE kernel.

    The patch is per modeling module, so it affects every model of that architecture in the
    process. Returns the model. Raises ImportError without transformers, ValueError when the
    model's module has no `apply_rotary_pos_emb`, or one that is not the rotate_half RoPE (e.g.
    GLM's or Cohere's interleaved one, whose logits the replacement would change silently).
    """
    _require_transformers()
    module = sys.modules.get(type(model).__module__)
    if module is None or not callable(getattr(module, "apply_rotary_pos_emb", None)):
        raise ValueError(
            f"patch_hf: {type(model).__module__} has no apply_rotary_pos_emb to replace (supported: Llama, "
            "Qwen2, Mistral and other rotate_half models)"
        )
    if not _is_rotate_half_rope(module.apply_rotary_pos_emb):
        raise ValueError(
            f"patch_hf: {type(model).__module__}.apply_rotary_pos_emb is not the rotate_half RoPE that kernel_lab's "
            "kernel replaces (an interleaved RoPE such as GLM's or Cohere's): left unpatched"
        )
    module.apply_rotary_pos_emb = _hf_apply_rotary_pos_emb
    return model
