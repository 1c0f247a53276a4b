"""LLM shape presets for tests and benchmarks (from each model's published config.json)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelShape", "model"]


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def gqa_ratio(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
        ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
        ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
        ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32768),
        ModelShape("gemma-2-9b", 3584, 14336, 42, 16, 8, 256, 256000),
        ModelShape("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 64, 151936),
    )
}


def model(name: str) -> ModelShape:
    """The preset called `name` (see MODELS); raises KeyError listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
