"""Documents of raw text files: ``.jsonl`` (one JSON object per line, text under a key), ``.parquet`` (a
text column), plain text files (one document each) and folders of them.

``torchtsp prepare-data`` and the trainer's on-the-fly text datasets read through here, so both see the
same documents in the same order (files sorted by path, folders walked recursively).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})
TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts", ".java"}
    | {".sh", ".toml", ".yaml", ".yml", ".json", ".csv", ".html", ".tex"}
)
DOCUMENT_SUFFIXES = JSONL_SUFFIXES | PARQUET_SUFFIXES | TEXT_SUFFIXES
DEFAULT_MAX_BYTES = 8_000_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def input_files(paths) -> list[Path]:
    """The document files named by ``paths`` (files, or folders searched recursively), in a fixed order."""
    files = []
    for raw in paths:
        if not str(raw).strip():  # Path("") is the current folder: an unset variable must not read all of it
            raise ValueError("an input is an empty path; give a .jsonl, .parquet or text file, or a folder")
        root = Path(raw).expanduser()
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            found = sorted(p for p in root.rglob("*") if p.suffix.lower() in DOCUMENT_SUFFIXES and p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
            if not found:
                raise ValueError(f"{root} holds no .jsonl, .parquet or text files")
            files += found
        else:
            raise FileNotFoundError(f"{raw} does not exist; expected a .jsonl, .parquet or text file, or a folder")
    return files


def _not_utf8(where: str, e: UnicodeDecodeError, offset: int) -> ValueError:
    """The error for ``e``, raised decoding bytes that start at byte ``offset`` of their file."""
    return ValueError(f"{where}: byte {e.object[e.start]:#04x} at byte offset {offset + e.start} is not UTF-8 "
                      f"({e.reason}); convert the file to UTF-8 or remove it")


def encodable(text: str, where: str) -> str:
    """``text`` unless it holds a lone surrogate (a JSON ``\\ud800`` escape), which no tokenizer can encode."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where}: the text holds {text[e.start]!r} (a lone surrogate), which is not valid "
                             f"Unicode text; fix or remove the record") from None
    return text


def jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    """(1-based line number, parsed JSON value) of every non-blank line of a JSON-lines file."""
    with open(path, "rb") as f:  # bytes, so a bad byte is named by line and offset rather than by the codec
        offset = 0
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(f"{path}:{number}", e, offset) from None
            start, offset = offset, offset + len(raw)
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write: not part of the JSON
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:
                cause = e.args[0][:80] if isinstance(e, ValueError) else "nested too deeply"
                raise ValueError(f"{path}:{number}: not a JSON object ({cause}; the line starts at byte offset "
                                 f"{start})") from None
            yield number, record


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    for number, record in jsonl_records(path):
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = "has no" if not isinstance(record, dict) or text_key not in record else "has a non-string"
            raise ValueError(f"{path}:{number}: the record {what} {text_key!r} field; choose the field with "
                             f"--text-key")
        yield encodable(text, f"{path}:{number}")


def parquet_rows(path: Path, columns: list[str], remedy: str, optional: tuple[str, ...] = ()) \
        -> Iterator[tuple[int, dict]]:
    """(0-based row, {column: value}) of every row of a parquet file, for ``columns`` (each must exist: ``remedy``
    ends the error when one does not) and those of ``optional`` it has."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OSError("reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        source = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid for a damaged file
        raise ValueError(f"{path} is not a readable parquet file ({str(e)[:120]})") from None
    names = source.schema_arrow.names
    for column in columns:
        if column not in names:
            raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)}); {remedy}")
    read = [*columns, *(c for c in optional if c in names)]
    row = 0
    batches = source.iter_batches(columns=read, batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid for a damaged file
            raise ValueError(f"{path}: rows from {row} on are unreadable ({str(e)[:120]}); the file is damaged") \
                from None
        if batch is None:
            return
        values = {name: _column_values(batch.column(i), f"{path}: row", row) for i, name in enumerate(read)}
        for i in range(batch.num_rows):
            yield row + i, {name: column[i] for name, column in values.items()}
        row += batch.num_rows


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    for i, record in parquet_rows(path, [text_key], "choose it with --text-key"):
        text = record[text_key]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{path}: row {i} of column {text_key!r} holds {type(text).__name__}, not text; "
                             f"choose a text column with --text-key")
        if text is not None:
            yield encodable(text, f"{path}: row {i}")


def _column_values(column, where: str, first_row: int) -> list:
    """A parquet column's values; a string that is not UTF-8 is named by its row and byte."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as e:
                raise _not_utf8(f"{where} {first_row + i}", e, 0) from None
        raise


def _text_document(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    # A NUL byte is a reliable sign of a binary file that only looks like text by name.
    if data and b"\0" not in data[:8192]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:  # named by line and offset, not replaced: nothing silently altered
            line = data.count(b"\n", 0, e.start) + 1
            raise _not_utf8(f"{path}:{line}", e, 0) from None
        yield text


def iter_documents(paths, text_key: str = "text") -> Iterator[str]:
    """Every document of ``paths``, in order."""
    for path in input_files(paths):
        suffix = path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_key)
        elif suffix in PARQUET_SUFFIXES:
            yield from _parquet_documents(path, text_key)
        else:
            yield from _text_document(path)


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
