"""Training: data pipeline and training loops."""

from .data import ByteTokenizer, TokenWindows, default_corpus_files, load_corpus

__all__ = ["ByteTokenizer", "TokenWindows", "default_corpus_files", "load_corpus"]
