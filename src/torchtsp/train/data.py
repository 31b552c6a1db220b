"""What the trainer reads: the model's tokenizer and its training and evaluation batches.

The tokenizer is the model's (``--tokenizer DIR``, else the ``--init-from-hf`` folder's tokenizer.json);
presets trained from scratch, and checkpoints that ship no tokenizer, use the byte tokenizer. Datasets are
checked against it and the model's vocabulary before any rank starts (``TrainData(check=True)``).
"""

from __future__ import annotations

import torch

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


class TrainData:
    """The tokenizer, the training batch stream and the evaluation set of a run (``cfg``: a TrainConfig)."""

    def __init__(self, cfg, vocab_size: int, check: bool = True):
        self.tokenizer, self.notice = model_tokenizer(cfg.tokenizer, cfg.init_from_hf)
        check_tokenizer_fits(cfg, self.tokenizer, vocab_size)
        self.mask_eos = None  # the EOS id that ends documents under a document mask
        if cfg.document_mask:
            self.mask_eos = self.tokenizer.eos_id
            if self.mask_eos is None:
                raise ValueError("--document-mask needs the tokenizer's EOS id, and this tokenizer names none: "
                                 "give --tokenizer DIR with an eos_token, or train without --document-mask")
        self.batch_size, self.seq_len = cfg.batch_size, cfg.seq_len
        self.train = self._stream(cfg.data, "--data", vocab_size, check, cfg.seed, shuffle=True)
        self.eval, self.eval_batches = None, 0
        if cfg.eval_data is not None:  # an empty one is refused, not taken for "no evaluation"
            self.eval = self._stream(cfg.eval_data, "--eval-data", vocab_size, check, cfg.seed, shuffle=False)
            available = self.eval.n_samples // cfg.batch_size
            if available < 1:
                raise ValueError(f"--eval-data {cfg.eval_data} holds {self.eval.n_samples} samples of "
                                 f"{cfg.seq_len + 1} tokens, fewer than one batch of {cfg.batch_size}")
            self.eval_batches = min(cfg.eval_batches or EVAL_BATCH_CAP, available)

    def _stream(self, spec, flag, vocab_size, check, seed, shuffle) -> BatchStream:
        datasets = open_datasets(spec, self.tokenizer, flag)
        if check:
            for _, source in datasets:
                check_source(source, vocab_size, self.tokenizer, self.seq_len, flag)
        return BatchStream([(w, PackedSamples(s, self.seq_len, vocab_size)) for w, s in datasets], self.batch_size,
                           seed, shuffle=shuffle)

    def next_train_batch(self, device) -> tuple:
        """The next training batch: (tokens, labels) on ``device`` and the document ids (host) or None."""
        tokens, labels, ids = packed_inputs(self.train.next_batch(), self.mask_eos)
        return tokens.to(device), labels.to(device), ids

    def eval_stream(self, device):
        """The evaluation batches as ``next_train_batch`` gives them, from the first sample of the eval set in
        order, every time."""
        stream = BatchStream([(w, d) for w, d in zip(self.eval.weights, self.eval.datasets)], self.batch_size,
                             shuffle=False)
        for _ in range(self.eval_batches):
            tokens, labels, ids = packed_inputs(stream.next_batch(), self.mask_eos)
            yield tokens.to(device), labels.to(device), ids
