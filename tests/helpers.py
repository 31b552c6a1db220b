"""Helpers shared by tests (importable by spawned ranks, which unpickle functions by module name)."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| / max |b|: error relative to the tensor's scale, robust to near-zero entries."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def batch(cfg, B, S, seed=0, ignore=3):
    """Random tokens and labels [B, S]; the first ``ignore`` labels of row 0 are ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels[0, :ignore] = -100
    return tokens, labels
