"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, index format MMIDIDX version 1).

The ``.bin`` holds the token ids of every sequence back to back, in one dtype. The ``.idx`` is, little-endian:

    magic  b"MMIDIDX\\x00\\x00"       9 bytes
    version                         u64, = 1
    dtype code                      u8 (the codes below)
    sequence count  N               u64
    document count  M               u64 (entries of the document index, i.e. documents + 1)
    sequence lengths                N x int32 (tokens)
    sequence pointers               N x int64 (byte offsets into .bin)
    document index                  M x int64 (first sequence of each document, starting at 0, then N)

``torchtsp prepare-data`` writes one sequence per document, as Megatron's ``preprocess_data.py`` does.
Files Megatron wrote (any of its dtype codes) are read as they are. Reading never loads the ``.bin``:
``TokenFile`` reads the slices a batch needs.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype Megatron uses for ids below ``vocab_size``: uint16 when it fits, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


class TokenFile:
    """A 1-D array of ids stored in a file at ``offset`` (``count`` items of ``dtype``), read slice by slice.

    Reads go through ``os.pread`` into small buffers: the file's pages stay in the kernel's page cache (shared
    by every rank on the host) and none is charged to the process, so resident memory does not grow with the
    dataset, however much of it an epoch visits. Without ``os.pread`` (Windows) it falls back to a memory map.
    """

    def __init__(self, path: str | Path, dtype, count: int, offset: int = 0):
        self.path, self.dtype, self.offset = Path(path), np.dtype(dtype), offset
        self.count = count
        self._fd = None
        self._map = None

    def __len__(self) -> int:
        return self.count

    def __getstate__(self):  # a process that receives it opens the file itself
        return {**self.__dict__, "_fd": None, "_map": None}

    def _read(self, start: int, stop: int) -> np.ndarray:
        size = self.dtype.itemsize
        if hasattr(os, "pread"):
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            nbytes = (stop - start) * size
            data = os.pread(self._fd, nbytes, self.offset + start * size)
            if len(data) != nbytes:
                raise ValueError(f"{self.path} is truncated: it ends before token {stop} (read {len(data)} of "
                                 f"{nbytes} bytes at offset {self.offset + start * size})")
            return np.frombuffer(data, dtype=self.dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))
        return np.array(self._map[start:stop])

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a TokenFile is read by contiguous slices")
        start, stop, _ = index.indices(self.count)
        return self._read(start, max(start, stop))

    def chunks(self, size: int = 1 << 22):
        """The whole array in pieces of ``size`` items (for scans that must not load it)."""
        for start in range(0, self.count, size):
            yield self[start:start + size]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def dataset_paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """A Megatron ``PREFIX.bin/.idx`` pair, checked on open; the index arrays are memory-mapped."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = dataset_paths(prefix)
        for path, what in ((self.idx_path, "index"), (self.bin_path, "data")):
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist: a Megatron dataset {self.prefix} needs both "
                                        f"{self.prefix}.bin and {self.prefix}.idx (the {what} file is missing)")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise ValueError(f"{self.idx_path} is not a Megatron index file (no MMIDIDX header); it is damaged or "
                             f"not an .idx file")
        _, version, code, self.n_sequences, n_doc_entries = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{self.idx_path}: index version {version} is not supported (only version {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{self.idx_path}: unknown dtype code {code} (Megatron's codes are 1-8)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        N, M = self.n_sequences, n_doc_entries
        need = _HEADER.size + N * 4 + N * 8 + M * 8
        if idx_size < need:
            raise ValueError(f"{self.idx_path} is truncated: {idx_size} bytes, its header announces {need}")
        self.lengths = np.memmap(self.idx_path, np.int32, "r", _HEADER.size, (N,)) if N else np.zeros(0, np.int32)
        self.pointers = np.memmap(self.idx_path, np.int64, "r", _HEADER.size + 4 * N, (N,)) if N \
            else np.zeros(0, np.int64)
        self.document_indices = np.memmap(self.idx_path, np.int64, "r", _HEADER.size + 12 * N, (M,)) if M \
            else np.zeros(0, np.int64)
        self.n_documents = max(M - 1, 0)
        self._check_index(self.bin_path.stat().st_size)
        self.n_tokens = int(self.lengths.sum(dtype=np.int64)) if N else 0

    def _check_index(self, bin_size: int) -> None:
        """Refuse an index whose arrays contradict each other or the .bin, before any of it is used: lengths are
        counts, pointers lie inside the .bin, and the document index runs monotonically from 0 to N."""
        N, item = self.n_sequences, self.dtype.itemsize
        where = f"{self.idx_path} is damaged or crafted"
        if N and int(self.lengths.min()) < 0:
            first = int(np.argmax(np.asarray(self.lengths) < 0))
            raise ValueError(f"{where}: sequence {first} has a negative length ({int(self.lengths[first])}); "
                             f"prepare the dataset again")
        if N and int(self.pointers.min()) < 0:
            first = int(np.argmax(np.asarray(self.pointers) < 0))
            raise ValueError(f"{where}: sequence {first} starts at a negative byte offset; prepare the dataset again")
        # Compared as room left after the start, so a crafted pointer near 2^63 cannot overflow the sum.
        beyond = np.asarray(self.pointers) > bin_size
        beyond |= np.asarray(self.lengths, np.int64) * item > bin_size - np.minimum(self.pointers, bin_size)
        if N and beyond.any():
            first = int(np.argmax(beyond))
            end = int(self.pointers[first]) + int(self.lengths[first]) * item
            raise ValueError(f"{self.bin_path} is truncated: {bin_size} bytes, its index needs {end} (sequence "
                             f"{first}); prepare the dataset again")
        docs = np.asarray(self.document_indices)
        falls = np.flatnonzero(np.diff(docs) < 0)
        if not len(docs):
            problem = "its document index is empty (it always holds at least the entry 0)"
        elif docs[0] != 0 or docs[-1] != N:
            problem = f"its document index runs from {docs[0]} to {docs[-1]}, not from 0 to the sequence count {N}"
        elif len(falls):
            problem = f"its document index falls from {docs[falls[0]]} to {docs[falls[0] + 1]} (entry {falls[0] + 1})"
        else:
            return
        raise ValueError(f"{where}: {problem}; prepare the dataset again")

    def contiguous(self) -> bool:
        """True when the sequences lie back to back from byte 0 in index order (as every writer lays them)."""
        if not self.n_sequences:
            return True
        starts = np.concatenate([[0], np.cumsum(self.lengths[:-1], dtype=np.int64)]) * self.dtype.itemsize
        return bool(np.array_equal(starts, self.pointers))

    def tokens(self) -> TokenFile:
        """Every sequence's ids, in order, as one stream (sequences end with the EOS their writer appended)."""
        if not self.contiguous():
            raise ValueError(f"{self.bin_path}: its sequences are not stored back to back in index order; "
                             f"rewrite it with torchtsp prepare-data or Megatron's tools/merge_datasets.py")
        return TokenFile(self.bin_path, self.dtype, self.n_tokens)

    def sequence(self, i: int) -> np.ndarray:
        count = int(self.lengths[i])
        return TokenFile(self.bin_path, self.dtype, count, int(self.pointers[i]))[:count]


class IndexedWriter:
    """Writes ``PREFIX.bin`` and ``PREFIX.idx`` (one sequence per document) under temporary names; ``finish``
    renames them into place, so an interrupted write never leaves a dataset that looks whole."""

    def __init__(self, prefix: str | Path, dtype, tmp_suffix: str = ".partial"):
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        self.tmp_bin = self.bin_path.with_name(self.bin_path.name + tmp_suffix)
        self.tmp_idx = self.idx_path.with_name(self.idx_path.name + tmp_suffix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.tmp_bin, "wb")  # noqa: SIM115 - closed by finish or abort
        self.lengths: list[np.ndarray] = []
        self.n_tokens = self.max_id = 0
        self.min_id = None

    def add_document(self, ids) -> None:
        self.add_documents([ids])

    def add_documents(self, documents) -> None:
        lengths = []
        for ids in documents:
            array = np.asarray(ids)
            if array.size:
                low, high = int(array.min()), int(array.max())
                info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
                if info is not None and (low < info.min or high > info.max):
                    raise ValueError(f"token id {high if high > info.max else low} does not fit {self.dtype}")
                self.max_id = max(self.max_id, high)
                self.min_id = low if self.min_id is None else min(self.min_id, low)
            self._bin.write(array.astype(self.dtype, copy=False).tobytes())
            lengths.append(array.size)
        self.lengths.append(np.asarray(lengths, dtype=np.int64))
        self.n_tokens += int(sum(lengths))

    def finish(self) -> tuple[int, int]:
        """Write the index and rename both files into place; returns (documents, tokens)."""
        self._bin.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2^31 tokens does not fit Megatron's int32 lengths")
        n = lengths.size
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64) * self.dtype.itemsize \
            if n else np.zeros(0, np.int64)
        with open(self.tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], n, n + 1))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.astype(np.int64).tobytes())
            f.write(np.arange(n + 1, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        with open(self.tmp_bin, "rb+") as f:
            os.fsync(f.fileno())
        # An old index is removed first: at no moment do a new .bin and an old .idx sit side by side.
        self.idx_path.unlink(missing_ok=True)
        os.replace(self.tmp_bin, self.bin_path)
        os.replace(self.tmp_idx, self.idx_path)
        return n, self.n_tokens

    def abort(self) -> None:
        self._bin.close()
        self.tmp_bin.unlink(missing_ok=True)
        self.tmp_idx.unlink(missing_ok=True)
