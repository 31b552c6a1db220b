"""Samples, their order and epochs, and blends.

A dataset's ids are one stream (documents joined with their EOS). Sample ``i`` is the ``seq_len + 1``
consecutive ids starting at ``i * seq_len`` (neighbours share one id: the last label of one is the first
input of the next), as Megatron-LM's GPT dataset packs them. Each epoch visits every sample once, in a
permutation drawn from ``(seed, dataset, epoch)``.

A blend draws each row of the global batch from the dataset furthest behind its weight (the greedy rule of
Megatron's blended dataset), so after k rows each dataset has supplied within one row of ``weight * k``. The
position is how many samples each dataset has supplied: it fixes everything that follows, so saving it in a
checkpoint makes a resumed run read exactly what the uninterrupted one would, whatever its mesh.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .sources import TokenSource


class PackedSamples:
    """The ``seq_len + 1``-id samples of one token stream."""

    def __init__(self, source: TokenSource, seq_len: int, vocab_size: int | None = None):
        """``vocab_size``: every sample read is checked to hold ids in [0, vocab_size) (the check before launch
        may rest on a sidecar's claim for a large dataset; an embedding lookup must never see a wrong id)."""
        self.source, self.seq_len, self.vocab_size = source, seq_len, vocab_size
        self.n_samples = (len(source.tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise ValueError(f"{source.name} has {len(source.tokens)} tokens; a sample needs seq_len + 1 = "
                             f"{seq_len + 1}")

    def __len__(self) -> int:
        return self.n_samples

    def order(self, seed: int, stream: int, shuffle: bool) -> EpochOrder:
        return EpochOrder(self.n_samples, seed, stream, shuffle)

    def sample(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        ids = np.asarray(self.source.tokens[start:start + self.seq_len + 1])
        check_ids(ids, self.vocab_size, self.source.name, start)
        return ids


def check_ids(ids: np.ndarray, vocab_size: int | None, name: str, start: int) -> None:
    """Refuse ids read from dataset ``name`` (from its token ``start`` on) outside [0, vocab_size)."""
    if vocab_size is not None and ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
        raise ValueError(f"{name} holds token id {bad} (at token {start + int(np.argmax(ids == bad))}), outside the "
                         f"model's vocabulary of {vocab_size}; it was tokenized for another model, or its sidecar's "
                         f"max_id is wrong")


class EpochOrder:
    """A seeded permutation of ``n`` samples per epoch, without replacement; one epoch's is kept at a time."""

    def __init__(self, n: int, seed: int, stream: int = 0, shuffle: bool = True):
        self.n, self.seed, self.stream, self.shuffle = n, seed, stream, shuffle
        self._epoch, self._order = None, None

    def __call__(self, visit: int) -> tuple[int, int]:
        """(epoch, sample index) of the ``visit``-th sample drawn from this dataset (0-based)."""
        epoch, k = divmod(visit, self.n)
        if not self.shuffle:
            return epoch, k
        if epoch != self._epoch:
            dtype = np.int32 if self.n < 2**31 else np.int64
            rng = np.random.default_rng([self.seed, self.stream, epoch])
            self._order, self._epoch = rng.permutation(np.arange(self.n, dtype=dtype)), epoch
        return epoch, int(self._order[k])

    def epochs(self, visits: int) -> float:
        """Epochs completed, fractionally, after ``visits`` samples."""
        return visits / self.n


class BatchStream:
    """Global batches of ``batch_size`` samples drawn from one dataset or a weighted blend.

    ``position`` (samples drawn from each dataset) is the whole state; ``next_batch`` advances it.
    """

    def __init__(self, datasets: list[tuple[float, PackedSamples]], batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        total = sum(w for w, _ in datasets)
        self.weights = np.array([w / total for w, _ in datasets])
        self.datasets = [d for _, d in datasets]
        self.orders = [d.order(seed, i, shuffle) for i, d in enumerate(self.datasets)]
        self.batch_size = batch_size
        self.drawn = [0] * len(self.datasets)

    @property
    def n_samples(self) -> int:
        return sum(len(d) for d in self.datasets)

    @property
    def epoch(self) -> float:
        """Epochs completed, fractionally, of the dataset furthest along relative to its size."""
        return max(order.epochs(drawn) for drawn, order in zip(self.drawn, self.orders))

    def _pick(self) -> int:
        if len(self.datasets) == 1:
            return 0
        rows = sum(self.drawn) + 1
        return int(np.argmax(self.weights * rows - np.asarray(self.drawn)))

    def next_rows(self, rows: int) -> list[tuple[int, int, int]]:
        """Advance by ``rows`` samples; (dataset, epoch, sample index) of each."""
        picked = []
        for _ in range(rows):
            d = self._pick()
            epoch, index = self.orders[d](self.drawn[d])
            self.drawn[d] += 1
            picked.append((d, epoch, index))
        return picked

    def next_samples(self) -> list:
        """The next ``batch_size`` samples, each as its dataset gives it (the same on every rank that holds this
        position)."""
        return [self.datasets[d].sample(i) for d, _, i in self.next_rows(self.batch_size)]

    def next_batch(self) -> torch.Tensor:
        """The next [batch_size, seq_len + 1] int64 batch of token-stream samples."""
        return torch.from_numpy(np.stack(self.next_samples()).astype(np.int64))

    def position(self) -> dict:
        return {"drawn": list(self.drawn), "datasets": [d.source.name for d in self.datasets],
                "fingerprints": self.fingerprints}

    @functools.cached_property
    def fingerprints(self) -> list[str]:
        return [source_fingerprint(d.source) for d in self.datasets]

    def set_position(self, position: dict, reset: bool = False) -> None:
        """Continue where ``position`` stopped, on the same datasets; ``reset``: start these datasets afresh
        (a position means nothing on other data: applied to it, it would silently skip or repeat samples)."""
        if reset:
            self.drawn = [0] * len(self.datasets)
            return
        drawn = list(position["drawn"])
        saved = position.get("fingerprints")  # checkpoints written before fingerprints carry only the names
        if len(drawn) != len(self.datasets) or (saved is not None and saved != self.fingerprints):
            raise ValueError(f"the checkpoint's data position is for the dataset(s) "
                             f"{', '.join(position.get('datasets', [])) or '?'}, but this run reads "
                             f"{', '.join(d.source.name for d in self.datasets)} (another dataset, or the same "
                             f"path with other contents); resume with the run's own --data, or pass --reset-data "
                             f"to read the new data from its start")
        self.drawn = [int(x) for x in drawn]


def source_fingerprint(source) -> str:
    """Which data a position counts samples of: a file's resolved path and size (and its sidecar's content);
    for ids tokenized in memory (text, the built-in corpus) the ids themselves."""
    digest = hashlib.sha256()
    path = getattr(source.tokens, "path", None)
    if path is not None:
        stat = Path(path).stat()
        digest.update(f"{Path(path).resolve()}|{stat.st_size}|{source.tokens.offset}".encode())
        digest.update(json.dumps(source.sidecar, sort_keys=True, default=str).encode())
        mask = getattr(source, "mask", None)
        if mask is not None:  # a chat dataset's assistant-target mask decides its targets
            digest.update(f"|{Path(mask.path).resolve()}|{Path(mask.path).stat().st_size}".encode())
    else:
        digest.update(np.ascontiguousarray(source.tokens).tobytes())
    return f"{source.kind}:{digest.hexdigest()[:16]}"


def inputs_and_labels(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of [B, seq_len + 1] samples: labels[:, t] is the id after tokens[:, t]."""
    return batch[:, :-1], batch[:, 1:]
