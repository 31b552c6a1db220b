"""Byte-level tokenizer, text corpora and deterministic random training windows."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8_000_000
TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts", ".java"}
    | {".sh", ".toml", ".yaml", ".yml", ".json", ".csv", ".html", ".tex"}
)
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 marks the end of a document."""

    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")


def default_corpus_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The standard library's own .py sources (no tests, no site-packages), sorted, capped at max_bytes."""
    files = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        # Prune in place so os.walk never descends into installed packages or test suites.
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        files += [Path(root, n) for n in names if n.endswith(".py")]
    chosen, total = [], 0
    for f in sorted(files):
        total += f.stat().st_size
        if total > max_bytes:
            break
        chosen.append(f)
    return chosen


def _text_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in TEXT_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """1-D int64 token ids of a text corpus, documents separated by the end-of-text id.

    ``None`` is the built-in corpus (the Python standard library); a file is used whole; a folder
    contributes its text files recursively. At most ``max_bytes`` bytes are read.
    """
    if path is None:
        files, where = default_corpus_files(max_bytes), "the Python standard library"
    else:
        root = Path(path).expanduser()
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = _text_files(root)
        else:
            raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; expected a text file or a folder")
        where = str(path)
    docs, budget = [], max_bytes
    for f in files:
        if budget <= 0:
            break
        data = f.read_bytes()[:budget]
        # A NUL byte is a reliable sign of a binary file that only looks like text by name.
        if not data or b"\0" in data[:8192]:
            continue
        docs.append(data)
        budget -= len(data)
    if not docs:
        suffixes = ", ".join(sorted(TEXT_SUFFIXES))
        raise ValueError(f"no text found in {where}; expected non-empty text files ({suffixes})")
    eot = torch.tensor([ByteTokenizer.eot_id])
    pieces = []
    for data in docs:
        pieces += [torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), eot]
    return torch.cat(pieces[:-1])


def _mix_seed(seed: int, step: int) -> int:
    # torch's CPU generator keeps only 32 bits of a seed, so hash (seed, step) rather than pack it.
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class TokenWindows:
    """Random windows of a corpus; batch ``step`` depends only on ``(seed, step)``, so resuming needs no replay."""

    def __init__(self, corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if corpus.dim() != 1:
            raise ValueError(f"corpus must be a 1-D tensor of token ids, got shape {tuple(corpus.shape)}")
        if len(corpus) < seq_len + 1:
            raise ValueError(
                f"corpus has {len(corpus)} tokens but seq_len={seq_len} needs at least {seq_len + 1}; "
                "use a larger corpus or a smaller --seq-len"
            )
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed

    def batch(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64 token windows."""
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, step))
        starts = torch.randint(0, len(self.corpus) - self.seq_len, (self.batch_size,), generator=gen)
        return self.corpus[starts[:, None] + torch.arange(self.seq_len + 1)].long()

    def inputs_and_labels(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), each [batch_size, seq_len]; labels[:, t] is the token after tokens[:, t]."""
        windows = self.batch(step)
        return windows[:, :-1], windows[:, 1:]
