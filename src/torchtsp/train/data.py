"""What the trainer reads: the model's tokenizer and its training and evaluation batches.

The tokenizer is the model's (``--tokenizer DIR``, else the ``--init-from-hf`` folder's tokenizer.json);
presets trained from scratch, and checkpoints that ship no tokenizer, use the byte tokenizer. Datasets are
checked against it and the model's vocabulary before any rank starts (``TrainData(check=True)``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.chat_rows import ChatRow, PackedConversations
from ..data.samples import BatchStream, PackedSamples, inputs_and_labels
from ..data.sources import TokenSource, builtin_corpus, check_source, open_source, parse_blend
from ..data.tokenizers import ByteTokenizer, Tokenizer, hf_folder_tokenizer, load_tokenizer, model_eos_id
from ..layers import IGNORE_INDEX

EVAL_BATCH_CAP = 50  # default --eval-batches: the whole eval set, but at most this many batches
# A preset trained with --tokenizer takes the tokenizer's size rounded up to a multiple of this. Every scheme runs
# any V (TP and TSP pad their slices of the embedding and head with zero rows when D does not divide V), but a
# multiple of 128 splits into equal slices without padding rows for every power-of-two degree D <= 128, and keeps
# the head GEMM's width aligned, as Megatron's --make-vocab-size-divisible-by does.
VOCAB_MULTIPLE = 128


def preset_vocab_size(cfg, preset_vocab: int) -> int:
    """The vocabulary of a preset: the checkpoint's when resuming, else --vocab-size, else that of --tokenizer
    rounded up to VOCAB_MULTIPLE, else the preset's own (its shape was made for the byte tokenizer)."""
    if cfg.resume:
        from . import checkpoint

        return checkpoint.read_meta(checkpoint.resolve(cfg.resume))["model"]["vocab_size"]
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    if cfg.tokenizer and str(cfg.tokenizer) != "byte":
        size = load_tokenizer(cfg.tokenizer).vocab_size
        return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return preset_vocab


def check_tokenizer_fits(cfg, tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer with ids the model has no rows for, naming what fixed the model's vocabulary."""
    if tokenizer.vocab_size <= vocab_size:
        return
    if cfg.resume or cfg.init_from_hf:
        flag = f"--resume {cfg.resume}" if cfg.resume else f"--init-from-hf {cfg.init_from_hf}"
        fixed, fix = f"the checkpoint of {flag}", "give that model's own tokenizer"
    elif cfg.vocab_size is not None:
        fixed, fix = f"--vocab-size {cfg.vocab_size}", f"raise --vocab-size to at least {tokenizer.vocab_size}"
    else:
        fixed = f"preset {cfg.preset}"
        fix = "give --tokenizer DIR (the preset then takes its vocabulary) or --vocab-size"
    raise ValueError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids but the model's vocabulary, "
                     f"fixed by {fixed}, has {vocab_size}; {fix}")


def model_tokenizer(tokenizer: str | None, init_from_hf: str | None) -> tuple[Tokenizer, str | None]:
    """(the model's tokenizer, a notice for the user or None)."""
    if tokenizer is not None:  # an empty one is refused, not taken for "the default tokenizer"
        return load_tokenizer(tokenizer, eos_id=model_eos_id(init_from_hf) if init_from_hf else None), None
    if init_from_hf:
        own = hf_folder_tokenizer(init_from_hf)
        if own is not None:
            return own, None
        return ByteTokenizer(), (f"{init_from_hf} has no tokenizer.json: text is read with the byte tokenizer "
                                 f"(ids 0-256); give --tokenizer DIR to use the model's own")
    return ByteTokenizer(), None


def open_datasets(spec: str | None, tokenizer: Tokenizer, flag: str = "--data") -> list[tuple[float, TokenSource]]:
    if spec is None:
        return [(1.0, TokenSource("the Python standard library", builtin_corpus(tokenizer), "builtin"))]
    return [(weight, open_source(path, tokenizer, flag=flag)) for weight, path in parse_blend(spec, flag)]


def packed_inputs(batch: torch.Tensor, eos_id: int | None):
    """(tokens, labels, document ids or None) of [B, seq_len + 1] packed samples. With ``eos_id`` (a document
    mask) a document ends after its EOS, and that EOS predicts nothing (not the next document's first token)."""
    tokens, labels = inputs_and_labels(batch)
    if eos_id is None:
        return tokens, labels, None
    ends = tokens == eos_id
    return tokens, labels.masked_fill(ends, IGNORE_INDEX), ends.cumsum(dim=1) - ends.long()


def chat_inputs(rows: list[ChatRow], document_mask: bool):
    """(tokens, labels, document ids or None) of packed conversation rows (``data/chat_rows.py``)."""
    tokens, labels, ids = (torch.from_numpy(np.stack([getattr(r, f) for r in rows]))
                           for f in ("tokens", "labels", "documents"))
    return tokens, labels, ids if document_mask else None


def is_chat(datasets: list[tuple[float, TokenSource]], spec: str, flag: str) -> bool:
    """Whether ``datasets`` (one --data or --eval-data) are conversations; a blend mixing them with token
    streams is refused (their rows are cut by different rules)."""
    kinds = {source.kind == "chat" for _, source in datasets}
    if len(kinds) > 1:
        raise ValueError(f"{flag} {spec!r} blends chat datasets with token streams; blend chat datasets only with "
                         f"chat datasets (prepare-data --format chat)")
    return kinds == {True}


class TrainData:
    """The tokenizer, the training batch stream and the evaluation set of a run (``cfg``: a TrainConfig).

    A chat dataset (``data/chat.py``) is read as whole conversations packed into rows, its targets the assistant
    tokens, with a document mask unless ``--no-document-mask``; any other dataset is one token stream cut into
    samples (``data/samples.py``), documents ending at the EOS under ``--document-mask``."""

    def __init__(self, cfg, vocab_size: int, check: bool = True):
        self.tokenizer, notice = model_tokenizer(cfg.tokenizer, cfg.init_from_hf)
        self.notices = [notice] if notice else []
        check_tokenizer_fits(cfg, self.tokenizer, vocab_size)
        self.batch_size, self.seq_len = cfg.batch_size, cfg.seq_len
        self.max_conversation_tokens = cfg.max_conversation_tokens
        train = open_datasets(cfg.data, self.tokenizer, "--data")
        self.chat = is_chat(train, cfg.data, "--data")
        evaluation, self.eval_chat = None, False
        if cfg.eval_data is not None:  # an empty one is refused, not taken for "no evaluation"
            evaluation = open_datasets(cfg.eval_data, self.tokenizer, "--eval-data")
            self.eval_chat = is_chat(evaluation, cfg.eval_data, "--eval-data")
        if cfg.max_conversation_tokens is not None and not self.chat:
            raise ValueError(f"--max-conversation-tokens applies to chat datasets (prepare-data --format chat); "
                             f"--data {cfg.data or '(the built-in corpus)'} is a token stream")
        # Chat data attends within each conversation by default: each is trained as if it were alone.
        self.document_mask = self.chat if cfg.document_mask is None else cfg.document_mask
        self.mask_eos = None  # the EOS id that ends documents of a token stream under a document mask
        token_stream = not self.chat or (evaluation is not None and not self.eval_chat)
        if self.document_mask and token_stream:
            self.mask_eos = self.tokenizer.eos_id
            if self.mask_eos is None:
                raise ValueError("--document-mask needs the tokenizer's EOS id, and this tokenizer names none: "
                                 "give --tokenizer DIR with an eos_token, or train without --document-mask")
        self.train = self._stream(train, "--data", vocab_size, check, cfg.seed, shuffle=True)
        self.eval, self.eval_batches = None, 0
        if evaluation is not None:
            self.eval = self._stream(evaluation, "--eval-data", vocab_size, check, cfg.seed, shuffle=False)
            available = self.eval.n_samples // cfg.batch_size
            if available < 1:
                what = f"rows of {cfg.seq_len} tokens" if self.eval_chat else f"samples of {cfg.seq_len + 1} tokens"
                raise ValueError(f"--eval-data {cfg.eval_data} holds {self.eval.n_samples} {what}, fewer than one "
                                 f"batch of {cfg.batch_size}")
            self.eval_batches = min(cfg.eval_batches or EVAL_BATCH_CAP, available)

    def _stream(self, datasets, flag, vocab_size, check, seed, shuffle) -> BatchStream:
        if check:
            for _, source in datasets:
                check_source(source, vocab_size, self.tokenizer, self.seq_len, flag)
        rows = []
        for weight, source in datasets:
            if source.kind == "chat":
                packed = PackedConversations(source, self.seq_len, vocab_size, self.max_conversation_tokens)
                self.notices += packed.notices(self.max_conversation_tokens)
            else:
                packed = PackedSamples(source, self.seq_len, vocab_size)
            rows.append((weight, packed))
        return BatchStream(rows, self.batch_size, seed, shuffle=shuffle)

    def _inputs(self, stream: BatchStream, chat: bool):
        if chat:
            return chat_inputs(stream.next_samples(), self.document_mask)
        return packed_inputs(stream.next_batch(), self.mask_eos)

    def next_train_batch(self, device) -> tuple:
        """The next training batch: (tokens, labels) on ``device`` and the document ids (host) or None."""
        tokens, labels, ids = self._inputs(self.train, self.chat)
        return tokens.to(device), labels.to(device), ids

    def eval_stream(self, device):
        """The evaluation batches as ``next_train_batch`` gives them, from the first sample of the eval set in
        order, every time."""
        stream = BatchStream([(w, d) for w, d in zip(self.eval.weights, self.eval.datasets)], self.batch_size,
                             shuffle=False)
        for _ in range(self.eval_batches):
            tokens, labels, ids = self._inputs(stream, self.eval_chat)
            yield tokens.to(device), labels.to(device), ids
