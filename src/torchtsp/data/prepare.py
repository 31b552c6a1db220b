"""``torchtsp prepare-data``: tokenize raw text into a Megatron-LM indexed dataset plus a JSON sidecar.

``--format text``: documents (``torchtsp.data.documents``) are tokenized in worker processes, in chunks, and
written in input order whatever the worker count: ``PREFIX.bin`` + ``PREFIX.idx`` (one sequence per document,
uint16 when the vocabulary fits, else int32) and ``PREFIX.json`` (tokenizer fingerprint, vocabulary, EOS,
counts). ``--format chat``: conversations rendered with the chat template, one sequence each, plus their loss
mask (``torchtsp.data.chat``), in this process. Files are written under temporary names and renamed at the
end: an interrupted or refused run leaves no dataset that looks whole.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .chat import MASK_DTYPE, ChatEncoder, iter_conversations, mask_prefix
from .documents import input_files, iter_documents
from .indexed import IndexedWriter, dataset_paths, token_dtype
from .sources import SIDECAR_SUFFIX
from .tokenizers import ByteTokenizer, load_tokenizer

CHUNK_DOCUMENTS = 256  # documents per task handed to a worker: large enough to amortise the hand-over
_worker_tokenizer = None


def _init_worker(spec: str, eos_id) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(spec, eos_id)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.int64) for ids in _worker_tokenizer.encode_batch(texts)]


def _in_order(pool, chunks, window: int):
    """Each chunk's encoding, in input order, with at most ``window`` chunks in flight (``Pool.imap`` would read
    the whole input ahead into memory)."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_chunk, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("inputs", nargs="+", metavar="INPUT", help=".jsonl, .parquet, .txt/.md files or folders of them")
    add("--tokenizer", required=True, metavar="DIR",
        help="folder holding the model's tokenizer.json (and tokenizer_config.json), or 'byte'")
    add("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    add("--text-key", default="text", help="the text field of .jsonl records / column of .parquet (default: text)")
    add("--no-eos", action="store_true", help="do not append the EOS id after every document")
    add("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 1) - 1)),
        help="tokenizer processes for --format text (default: CPUs - 1, at most 8)")
    add("--overwrite", action="store_true", help="replace an existing dataset at PREFIX")
    add("--format", choices=("text", "chat"), default="text",
        help="text: documents (default); chat: conversations ({\"messages\": [...]} records) rendered with the "
             "tokenizer's chat template, with a loss mask of the assistant's tokens in PREFIX-mask.bin/.idx")


def prepare(inputs, tokenizer_spec: str, out: str, text_key: str = "text", append_eos: bool = True,
            workers: int = 1, overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into the dataset ``out``; returns the sidecar written (with throughput)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    _check_out(inputs, out, overwrite)
    tokenizer = load_tokenizer(tokenizer_spec)
    if append_eos and tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer.name} names no EOS token (eos_token in tokenizer_config.json); add it, or "
                         f"pass --no-eos")
    sidecar_path = Path(out + SIDECAR_SUFFIX)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = [tokenizer.eos_id] if append_eos else []
    documents = iter_documents(inputs, text_key)
    chunks = iter(lambda: list(itertools.islice(documents, CHUNK_DOCUMENTS)), [])
    from tqdm import tqdm

    writer = IndexedWriter(out, dtype)
    bar = tqdm(desc="prepare-data", unit="doc", dynamic_ncols=True, disable=not progress, file=sys.stderr)
    pool = None
    start = time.perf_counter()
    try:
        if workers > 1:
            import multiprocessing

            # spawn, not fork: the tokenizers library's threads do not survive a fork.
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer_spec),
                                                                                    tokenizer.eos_id))
            encoded = _in_order(pool, chunks, window=2 * workers)
        else:
            encoded = ([np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(c)] for c in chunks)
        for docs in encoded:
            writer.add_documents(np.concatenate([d, np.asarray(eos, np.int64)]) for d in docs)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.update(len(docs))
            bar.set_postfix(tok_s=f"{writer.n_tokens / elapsed:,.0f}", tokens=f"{writer.n_tokens:,}")
        if not writer.n_tokens:
            raise ValueError(f"no documents with text in {' '.join(map(str, inputs))}; nothing was written")
        sidecar_path.unlink(missing_ok=True)
        n_docs, n_tokens = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = time.perf_counter() - start
    sidecar = {
        "format": "megatron-mmidx-v1", "tokenizer": _tokenizer_record(tokenizer),
        "dtype": dtype.name, "documents": n_docs, "tokens": n_tokens, "max_id": writer.max_id,
        "eos_appended": append_eos, "text_key": text_key, "inputs": [str(p) for p in inputs],
    }
    _write_sidecar(sidecar_path, sidecar)
    return {**sidecar, "seconds": elapsed, "tokens_per_s": n_tokens / max(elapsed, 1e-9), "workers": workers}


def _check_out(inputs, out: str, overwrite: bool) -> None:
    """Refuse an empty --out, missing inputs, and a dataset already at ``out`` (unless ``overwrite``), before the
    tokenizer loads."""
    if not str(out).strip():  # would write .bin/.idx/.json into the current folder
        raise ValueError("--out is an empty path; give the dataset's PREFIX (an unset variable?)")
    input_files(inputs)  # a missing or empty-path input is refused before the tokenizer loads
    paths = [*dataset_paths(out), Path(out + SIDECAR_SUFFIX), *dataset_paths(mask_prefix(out))]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"--out {out}: {existing[0]} already exists; pass --overwrite to replace the dataset or "
                         f"choose another --out")


def _tokenizer_record(tokenizer) -> dict:
    return {"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "bos_id": tokenizer.bos_id,
            "path": "byte" if isinstance(tokenizer, ByteTokenizer) else str(Path(tokenizer.path).resolve())}


def _write_sidecar(path: Path, sidecar: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(sidecar, indent=1) + "\n")
    os.replace(tmp, path)


def prepare_chat(inputs, tokenizer_spec: str, out: str, overwrite: bool = False, progress: bool = True) -> dict:
    """Render, tokenize and mask the conversations of ``inputs`` into the chat dataset ``out`` (``data/chat.py``
    describes it); returns the sidecar written (with throughput). Conversations without an assistant message
    are skipped and counted; any other bad record stops the run with nothing written at ``out``."""
    _check_out(inputs, out, overwrite)
    tokenizer = load_tokenizer(tokenizer_spec)
    encoder = ChatEncoder(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    sidecar_path = Path(out + SIDECAR_SUFFIX)
    from tqdm import tqdm

    tokens, mask = IndexedWriter(out, dtype), IndexedWriter(mask_prefix(out), MASK_DTYPE)
    bar = tqdm(desc="prepare-data", unit="conv", dynamic_ncols=True, disable=not progress, file=sys.stderr)
    skipped = targets = longest = 0
    start = time.perf_counter()
    try:
        for where, messages, tools in iter_conversations(inputs):
            if not any(m["role"] == "assistant" for m in messages):
                skipped += 1  # nothing to learn from: no target token
                continue
            ids, targets_of = encoder.encode(messages, tools, where)
            tokens.add_document(np.asarray(ids, dtype=np.int64))
            mask.add_document(targets_of)
            targets += int(targets_of.sum())
            longest = max(longest, len(ids))
            bar.update(1)
            bar.set_postfix(tokens=f"{tokens.n_tokens:,}", skipped=skipped)
        if not tokens.n_tokens:
            raise ValueError(f"no conversation with an assistant message in {' '.join(map(str, inputs))} "
                             f"({skipped} without one); nothing was written")
        sidecar_path.unlink(missing_ok=True)
        mask.finish()  # the mask first: the tokens, renamed last, are what makes the dataset look whole
        n_conversations, n_tokens = tokens.finish()
    except BaseException:
        tokens.abort()
        mask.abort()
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - start
    sidecar = {
        "format": "chat", "mask": Path(mask_prefix(out)).name, "tokenizer": _tokenizer_record(tokenizer),
        "dtype": dtype.name, "documents": n_conversations, "tokens": n_tokens, "max_id": tokens.max_id,
        "eos_appended": False, "conversations": n_conversations, "assistant_tokens": targets,
        "longest_conversation": longest, "skipped_no_assistant": skipped, "inputs": [str(p) for p in inputs],
    }
    _write_sidecar(sidecar_path, sidecar)
    return {**sidecar, "seconds": elapsed, "tokens_per_s": n_tokens / max(elapsed, 1e-9)}


def cmd_prepare_data(args: argparse.Namespace) -> int:
    if args.format == "chat":
        if args.no_eos or args.text_key != "text":
            raise ValueError(f"{'--no-eos' if args.no_eos else '--text-key'} is for --format text; --format chat "
                             f"reads each record's \"messages\" and adds nothing beyond what the chat template writes")
        result = prepare_chat(args.inputs, args.tokenizer, args.out, overwrite=args.overwrite)
        skipped = result["skipped_no_assistant"]
        print(f"wrote {args.out}.bin/.idx/.json and {result['mask']}.bin/.idx: {result['conversations']:,} "
              f"conversations, {result['tokens']:,} tokens ({result['dtype']}), {result['assistant_tokens']:,} "
              f"assistant tokens (targets), longest conversation {result['longest_conversation']:,} tokens"
              f"{f', {skipped:,} without an assistant message skipped' if skipped else ''} "
              f"in {result['seconds']:.1f} s")
        return 0
    result = prepare(args.inputs, args.tokenizer, args.out, text_key=args.text_key, append_eos=not args.no_eos,
                     workers=args.workers, overwrite=args.overwrite)
    print(f"wrote {args.out}.bin/.idx/.json: {result['documents']:,} documents, {result['tokens']:,} tokens "
          f"({result['dtype']}) in {result['seconds']:.1f} s, {result['tokens_per_s']:,.0f} tokens/s with "
          f"{result['workers']} worker(s)")
    return 0
