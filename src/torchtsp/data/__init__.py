"""Training data: tokenizers, datasets (Megatron .bin/.idx, .npy, text), packing, order and blends, prepare.

Submodules: ``tokenizers``, ``documents`` (raw text files), ``indexed`` (Megatron's format), ``sources``
(what ``--data`` names), ``samples`` (packing, epochs, blends), ``chat`` (conversations and their loss mask),
``prepare`` (``torchtsp prepare-data``).
Only ``samples`` imports torch, so tokenizer worker processes start quickly.
"""

from .tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
