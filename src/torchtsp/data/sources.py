"""The token datasets the trainer reads, and the ``--data`` syntax.

``--data`` names one dataset or a blend of them (``"0.7 PREFIX_A 0.3 PREFIX_B"``, as Megatron-LM's
``--data-path``). A dataset is one of:

- a Megatron prefix (``PREFIX.bin`` + ``PREFIX.idx``, any dtype code; ``PREFIX.json``, the sidecar
  ``torchtsp prepare-data`` writes, is optional);
- a 1-D ``.npy`` array of ids;
- ``.jsonl`` / ``.parquet`` / text files or folders, tokenized on the fly with the model's tokenizer (small
  corpora: their ids are held in memory).

Files are read slice by slice (``TokenFile``), never loaded whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .documents import DEFAULT_MAX_BYTES, default_corpus_files, iter_documents
from .indexed import CODE_OF_DTYPE, IndexedDataset, TokenFile, dataset_paths
from .tokenizers import BYTE_FINGERPRINT, ByteTokenizer, Tokenizer

SIDECAR_SUFFIX = ".json"
SCAN_BYTES = 1 << 30  # datasets up to this size are scanned for their ids before launch (about a second a GiB)


@dataclass
class TokenSource:
    """One dataset: its name as given, its ids as one stream (documents joined with their EOS)."""

    name: str
    tokens: TokenFile | np.ndarray
    kind: str  # "megatron", "chat", "npy", "text" or "builtin"
    sidecar: dict | None = None
    _max_id: int | None = None
    # A chat dataset (data/chat.py) only: each conversation's token count (the records' boundaries) and the
    # assistant-target mask, one uint8 per token of ``tokens``.
    conversation_lengths: np.ndarray | None = None
    mask: TokenFile | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def max_id(self) -> int:
        """The largest id, found by one scan in 4M-id pieces (a sidecar's record is a claim, not a proof)."""
        if self._max_id is None:
            if isinstance(self.tokens, np.ndarray):
                self._max_id = int(self.tokens.max()) if len(self.tokens) else -1
            else:
                self._max_id = max((int(c.max()) for c in self.tokens.chunks() if c.size), default=-1)
        return self._max_id

    def min_id(self) -> int:
        if isinstance(self.tokens, np.ndarray):
            return int(self.tokens.min()) if len(self.tokens) else 0
        if self.tokens.dtype.kind == "u":
            return 0
        return min((int(c.min()) for c in self.tokens.chunks() if c.size), default=0)

    def nbytes(self) -> int:
        return len(self.tokens) * self.tokens.dtype.itemsize


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_STRING = (lambda v: isinstance(v, str), "a string")
_COUNT = (_count, "a count (an integer >= 0)")
_ID_OR_NULL = (lambda v: v is None or _count(v), "a token id or null")
# Each field of the sidecar prepare-data writes: (its check, what it must be). A field that is absent is not
# checked (older sidecars, other writers); one that is present must be what prepare-data writes.
_SIDECAR_FIELDS = {
    "format": _STRING, "dtype": _STRING, "documents": _COUNT, "tokens": _COUNT,
    "max_id": (_count, "a token id (an integer >= 0)"),
    "eos_appended": (lambda v: isinstance(v, bool), "true or false"),
    "text_key": _STRING, "inputs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                                    "a list of strings"),
    "tokenizer": (lambda v: isinstance(v, dict), "an object"),
    # --format chat: the mask's prefix (a name beside the sidecar) and the conversation counts
    "mask": _STRING, "conversations": _COUNT, "assistant_tokens": _COUNT, "longest_conversation": _COUNT,
    "skipped_no_assistant": _COUNT,
}
_SIDECAR_TOKENIZER_FIELDS = {
    "fingerprint": _STRING, "vocab_size": _COUNT, "eos_id": _ID_OR_NULL, "bos_id": _ID_OR_NULL,
    "path": (lambda v: v is None or isinstance(v, str), "a string or null"),
}


def _check_fields(record: dict, fields: dict, path: Path, prefix: str = "") -> None:
    for name, (valid, what) in fields.items():
        if name in record and not valid(record[name]):
            raise ValueError(f"{path}: field {prefix + name!r} must be {what}, got {json.dumps(record[name])[:60]}; "
                             f"delete {path.name} (the dataset is read without it) or run prepare-data again")


def read_sidecar(prefix: str | Path) -> dict | None:
    """``PREFIX.json`` checked field by field once here, so every later use may trust its types; None if absent."""
    path = Path(str(prefix) + SIDECAR_SUFFIX)
    if not path.is_file():
        return None
    try:
        sidecar = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError(f"{path} is not valid JSON; delete it (the dataset is read without it) or prepare the "
                         f"dataset again") from None
    if not isinstance(sidecar, dict):
        raise ValueError(f"{path} must hold a JSON object; delete it (the dataset is read without it) or prepare "
                         f"the dataset again")
    _check_fields(sidecar, _SIDECAR_FIELDS, path)
    _check_fields(sidecar.get("tokenizer", {}), _SIDECAR_TOKENIZER_FIELDS, path, "tokenizer.")
    return sidecar


def _check_sidecar_describes(sidecar: dict | None, dataset: IndexedDataset) -> None:
    """A sidecar left beside another dataset (rewritten by another tool) would vouch for the wrong tokenizer."""
    if sidecar is None:
        return
    path = Path(dataset.prefix + SIDECAR_SUFFIX)
    actual = {"tokens": dataset.n_tokens, "documents": dataset.n_documents, "dtype": dataset.dtype.name}
    for name, value in actual.items():
        if name in sidecar and sidecar[name] != value:
            raise ValueError(f"{path} describes another dataset ({name} {sidecar[name]}, but {dataset.prefix} "
                             f"holds {value}); delete {path.name} or run prepare-data again")


def _npy_tokens(path: Path) -> TokenFile:
    from numpy.lib import format as npy_format

    with open(path, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            read_header = npy_format.read_array_header_1_0 if version == (1, 0) else \
                npy_format.read_array_header_2_0
            shape, _, dtype = read_header(f)
        except ValueError as e:
            raise ValueError(f"{path} is not a .npy file ({e})") from None
        offset = f.tell()
    if len(shape) != 1 or dtype.kind not in "iu" or dtype.hasobject:
        raise ValueError(f"{path}: expected a 1-D array of integer token ids, got shape {shape} of {dtype}")
    count = shape[0]
    size = path.stat().st_size
    if size < offset + count * dtype.itemsize:
        raise ValueError(f"{path} is truncated: {size} bytes, its header announces {offset + count * dtype.itemsize}")
    return TokenFile(path, dtype, count, offset)


def text_tokens(paths, tokenizer: Tokenizer, text_key: str = "text", append_eos: bool = True,
                batch: int = 256) -> np.ndarray:
    """The ids of every document of ``paths``, each followed by the tokenizer's EOS, in one int32 array (held by
    every rank: half the memory of int64; batches are widened when drawn)."""
    eos = [tokenizer.eos_id] if append_eos and tokenizer.eos_id is not None else []
    pieces, pending = [], []

    def flush():
        if isinstance(tokenizer, ByteTokenizer):  # the bytes are the ids: no Python list per byte
            encoded = [np.frombuffer(text.encode("utf-8"), np.uint8) for text in pending]
        else:
            encoded = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(pending)]
        for ids in encoded:
            pieces.append(ids)
            pieces.append(np.asarray(eos, dtype=np.int64))
        pending.clear()

    for text in iter_documents(paths, text_key):
        pending.append(text)
        if len(pending) >= batch:
            flush()
    flush()
    return np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, np.int32)


def builtin_corpus(tokenizer: Tokenizer, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The default corpus: the Python standard library's sources (at most ``max_bytes``), tokenized."""
    return text_tokens(default_corpus_files(max_bytes), tokenizer)


def open_source(path: str, tokenizer: Tokenizer, text_key: str = "text", flag: str = "--data") -> TokenSource:
    """One dataset named by ``path`` (see the module docstring)."""
    if not path.strip():  # Path("") is the current folder: an unset variable must not train on all of it
        raise ValueError(f"{flag} is an empty path; give a dataset (an unset variable?)")
    p = Path(path).expanduser()
    prefix = str(p)[:-4] if p.suffix in (".bin", ".idx") else str(p)
    bin_path, idx_path = dataset_paths(prefix)
    if bin_path.exists() or idx_path.exists():
        dataset = IndexedDataset(prefix)  # names the missing half, a wrong header, a truncated .bin
        if dataset.dtype.kind not in "iu":
            raise ValueError(f"{idx_path}: dtype {dataset.dtype} (Megatron code {CODE_OF_DTYPE[dataset.dtype]}) "
                             f"holds no token ids; a token dataset stores integers (codes 1-5 and 8): prepare it "
                             f"again")
        sidecar = read_sidecar(prefix)
        _check_sidecar_describes(sidecar, dataset)
        from .chat import is_chat_sidecar, open_chat_dataset  # chat.py's writer side imports this module

        if is_chat_sidecar(sidecar):
            mask_at = sidecar.get("mask")  # a name beside the sidecar
            dataset, mask = open_chat_dataset(prefix, None if mask_at is None else str(Path(prefix).parent / mask_at))
            return TokenSource(path, dataset.tokens(), "chat", sidecar, conversation_lengths=dataset.lengths,
                               mask=mask.tokens())
        return TokenSource(path, dataset.tokens(), "megatron", sidecar)
    if p.suffix == ".npy":
        if not p.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return TokenSource(path, _npy_tokens(p), "npy")
    if p.exists():
        return TokenSource(path, text_tokens([p], tokenizer, text_key), "text")
    raise FileNotFoundError(f"--data {path}: no such file, folder or Megatron dataset ({bin_path.name} + "
                            f"{idx_path.name})")


def parse_blend(spec: str, flag: str = "--data") -> list[tuple[float, str]]:
    """``"0.7 A 0.3 B"`` -> [(0.7, "A"), (0.3, "B")]; a single path -> [(1.0, path)]."""
    words = spec.split()
    if not words:  # Path("") is the current folder: an unset variable must not train on all of it
        raise ValueError(f"{flag} is empty; give a dataset or a blend such as \"0.7 PREFIX_A 0.3 PREFIX_B\" "
                         f"(an unset variable?)")
    if len(words) == 1:
        return [(1.0, spec.strip())]
    if len(words) % 2:
        raise ValueError(f"{flag} {spec!r}: a blend is pairs of weight and dataset, e.g. \"0.7 PREFIX_A 0.3 "
                         f"PREFIX_B\" (a single path must not contain spaces)")
    pairs = []
    for weight, path in zip(words[::2], words[1::2]):
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {spec!r}: blend weight {weight!r} is not a positive number")
        pairs.append((value, path))
    return pairs


def check_source(source: TokenSource, vocab_size: int, tokenizer: Tokenizer, seq_len: int, flag: str) -> None:
    """Refuse a dataset the model cannot train on: ids outside its vocabulary, another tokenizer, too short."""
    if source.kind == "chat" and not len(source):  # conversations are padded to rows: any length trains
        raise ValueError(f"{flag} {source.name} holds no conversation tokens; prepare it again")
    if source.kind != "chat" and len(source) < seq_len + 1:
        what = "is empty" if not len(source) else f"has {len(source)} tokens"
        raise ValueError(f"{flag} {source.name} {what}; a sample needs seq_len + 1 = {seq_len + 1} tokens")
    recorded = ((source.sidecar or {}).get("tokenizer") or {}).get("fingerprint")
    if recorded is not None and recorded != tokenizer.fingerprint:
        prepared = "the byte tokenizer" if recorded == BYTE_FINGERPRINT else \
            f"another tokenizer ({(source.sidecar['tokenizer'].get('path') or recorded[:12])})"
        raise ValueError(f"{flag} {source.name} was prepared with {prepared}, but the model uses {tokenizer.name}; "
                         f"prepare it again with --tokenizer of the model")
    high, low = _id_range(source, vocab_size)
    if high >= vocab_size:
        raise ValueError(f"{flag} {source.name} holds token id {high}, outside the model's vocabulary of "
                         f"{vocab_size}; it was tokenized for another model")
    if low < 0:
        raise ValueError(f"{flag} {source.name} holds negative token ids; it is not a dataset of token ids")


def _id_range(source: TokenSource, vocab_size: int) -> tuple[int, int]:
    """(largest, smallest) id as far as checking before launch can tell. A dtype whose every value is an id of
    the vocabulary needs no look; a dataset up to ``SCAN_BYTES`` is scanned (the sidecar's ``max_id`` is only a
    claim: whoever wrote the file wrote it); a larger one is judged by its sidecar's claim when it has one, else
    scanned. Whatever passes here, ``PackedSamples`` still checks every sample it reads against the vocabulary,
    so an understated claim stops the run with an error naming the dataset, never trains on a wrong id."""
    dtype = source.tokens.dtype
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return int(np.iinfo(dtype).max), 0
    claimed = (source.sidecar or {}).get("max_id")
    if source.nbytes() > SCAN_BYTES and claimed is not None:
        return claimed, 0
    return source.max_id(), source.min_id()
