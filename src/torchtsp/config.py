"""Model configuration and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    dim: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 384
    vocab_size: int = 257
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim = dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def group_size(self) -> int:
        """g = query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return cls(**values)


PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on a CPU; GQA (g=2) and every head count divisible by 1, 2 and 4.
    "tiny": ModelConfig(),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=4096),
    # The paper's 7B reference: h=4096, 32 layers, 32 query and 32 KV heads, ffn = 4h.
    "paper-7b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=16384, vocab_size=32000, max_seq_len=131072
    ),
    # Llama-3-8B shape (GQA g=4, 128K vocabulary), for planning.
    "llama3-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
