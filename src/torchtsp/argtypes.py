"""Argument types shared by the commands' flags (torch-free: ``torchtsp --help`` stays fast)."""

from __future__ import annotations

import argparse
import re

# Binary multiples, as sequence lengths are quoted ("32K context" = 32768 tokens).
_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20}
_LENGTH = re.compile(r"\s*(-?\d+)\s*([kKmM]?)\s*")


def length(text: str) -> int:
    """A count of tokens: ``4096``, ``32k`` or ``32K`` (x1024), ``1M`` (x1024²). Range checks stay with each
    flag (some take 0)."""
    match = _LENGTH.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 4096, 32k or 1M, got {text!r}")
    return int(match.group(1)) * _SUFFIXES[match.group(2).lower()]


def length_list(text: str) -> list[int]:
    """Comma-separated positive lengths, each as ``length`` reads it: ``"4k,8k,16384"``."""
    try:
        values = [length(v) for v in text.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths such as 4096,32k, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive lengths, got {text!r}")
    return values


# Bytes per element of the model dtypes every command names alike; bf16 and fp32 are accepted as aliases.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def dtype(text: str) -> str:
    """``float32`` or ``bfloat16`` (``fp32``/``bf16`` read as those)."""
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose float32 or bfloat16 (fp32, bf16)")
    return name
