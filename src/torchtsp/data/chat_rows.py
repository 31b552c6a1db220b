"""Training rows of whole conversations, and their order.

A chat dataset (``data/chat.py``) is cut into rows of ``seq_len`` positions by the records' own boundaries.
Each epoch shuffles the conversations (seeded by ``(seed, dataset, epoch)``), then packs them greedily in that
order: a conversation goes into the current row if it fits in what is left of it, else the row is closed (its
rest padded) and a new one begins (next-fit, so the packing is a function of the order alone). A conversation
never straddles two rows unless it is longer than a row: then it is cut into row-sized pieces (the last one
shorter), each packed as a document of its own.

A row gives, at every position, the token, its label and its document: the label is the next token of the same
conversation where the mask marks that token an assistant target, IGNORE_INDEX elsewhere (conversation ends,
padding). A piece's last position still predicts the first token of the next piece (a target, not something
attended to). Every position of a document attends to that document only (under a document mask), positions
counting from 0 at its start.

``PackedConversations`` has the interface ``BatchStream`` reads (``order``, ``sample``, ``source``); a
position (rows drawn) fixes every row that follows, as for token-stream samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layers import IGNORE_INDEX
from .samples import check_ids
from .sources import TokenSource

PAD_ID = 0  # the token of padding positions: a row's tail, attended by nothing that is trained


@dataclass
class ChatRow:
    """One row: ``tokens``, ``labels`` and ``documents`` (equal values in a run: one document), each [seq_len]."""

    tokens: np.ndarray
    labels: np.ndarray
    documents: np.ndarray


def pack_rows(piece_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Next-fit: the index of the first piece of each row, for pieces of ``piece_lengths`` (each <= seq_len)
    packed in order."""
    starts, room = [], 0
    for i, n in enumerate(piece_lengths.tolist()):
        if n > room:
            starts.append(i)
            room = seq_len
        room -= n
    return np.asarray(starts, dtype=np.int64)


class PackedConversations:
    """The rows of a chat dataset (``source.kind == "chat"``) at ``seq_len`` positions.

    ``max_tokens``: conversations longer than this are skipped (counted in ``skipped``); the others longer than
    ``seq_len`` are cut into pieces (counted in ``split``). ``len`` is the rows of the conversations in record
    order (an evaluation set's, which is not shuffled); a shuffled epoch may pack into a few more or fewer.
    """

    def __init__(self, source: TokenSource, seq_len: int, vocab_size: int | None = None,
                 max_tokens: int | None = None):
        self.source, self.seq_len, self.vocab_size = source, seq_len, vocab_size
        lengths = np.asarray(source.conversation_lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.lengths = lengths
        too_long = lengths > max_tokens if max_tokens is not None else np.zeros(len(lengths), bool)
        self.kept = np.flatnonzero((lengths > 0) & ~too_long)
        self.n_conversations = int((lengths > 0).sum())
        self.skipped = int(too_long.sum())
        self.split = int((lengths[self.kept] > seq_len).sum())
        if not len(self.kept):
            raise ValueError(f"{source.name}: every one of its {self.n_conversations} conversations is longer than "
                             f"--max-conversation-tokens {max_tokens}; raise it or drop it")
        self._record_order = self.pieces(self.kept)

    def __len__(self) -> int:
        return len(self._record_order[1])

    def notices(self, max_tokens: int | None) -> list[str]:
        """One line for each way conversations were not trained whole in one row."""
        lines = []
        if self.split:
            lines.append(f"{self.source.name}: {self.split} of {len(self.kept)} conversations are longer than "
                         f"--seq-len {self.seq_len} and were split")
        if self.skipped:
            lines.append(f"{self.source.name}: {self.skipped} of {self.n_conversations} conversations are longer "
                         f"than --max-conversation-tokens {max_tokens} and were skipped")
        return lines

    def pieces(self, conversations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pieces [P, 3] of (conversation, start, length) in order, the first piece of each row) of
        ``conversations`` packed in the order given."""
        lengths = self.lengths[conversations]
        counts = -(-lengths // self.seq_len)
        conversation = np.repeat(conversations, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        start = (np.arange(len(conversation)) - first) * self.seq_len
        length = np.minimum(self.seq_len, self.lengths[conversation] - start)
        return np.stack([conversation, start, length], axis=1), pack_rows(length, self.seq_len)

    def order(self, seed: int, stream: int, shuffle: bool) -> ConversationOrder:
        return ConversationOrder(self, seed, stream, shuffle)

    def sample(self, pieces: np.ndarray) -> ChatRow:
        """The row of ``pieces`` ((conversation, start, length) each, in row order)."""
        S = self.seq_len
        tokens = np.full(S, PAD_ID, dtype=np.int64)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        documents = np.empty(S, dtype=np.int64)
        at = 0
        for document, (conversation, start, length) in enumerate(pieces.tolist()):
            begin = int(self.offsets[conversation]) + start
            # One token past the piece, if the conversation goes on: the piece's last label.
            end = begin + min(length + 1, int(self.lengths[conversation]) - start)
            ids = np.asarray(self.source.tokens[begin:end], dtype=np.int64)
            targets = np.asarray(self.source.mask[begin:end])
            check_ids(ids, self.vocab_size, self.source.name, begin)
            if targets.size and targets.max() > 1:
                raise ValueError(f"{self.source.name}: its assistant-target mask holds the value "
                                 f"{int(targets.max())} in conversation {conversation} (only 0 and 1 mean "
                                 f"something); prepare the dataset again")
            tokens[at:at + length] = ids[:length]
            following = ids[1:]
            labels[at:at + len(following)] = np.where(targets[1:] == 1, following, IGNORE_INDEX)
            documents[at:at + length] = document
            at += length
        documents[at:] = len(pieces)  # the padding: a document of its own
        return ChatRow(tokens, labels, documents)


class ConversationOrder:
    """Which row is drawn at each visit: epoch after epoch, each the conversations in a seeded permutation (or
    record order without ``shuffle``), packed into rows. One epoch's rows are kept at a time; the rows of the
    epochs before are counted once."""

    def __init__(self, dataset: PackedConversations, seed: int, stream: int = 0, shuffle: bool = True):
        self.dataset, self.seed, self.stream, self.shuffle = dataset, seed, stream, shuffle
        self.epoch_starts = [0]  # visits before each epoch counted so far
        self._epoch, self._packing = None, None

    def _pack(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.shuffle:
            return self.dataset._record_order
        rng = np.random.default_rng([self.seed, self.stream, epoch])
        return self.dataset.pieces(rng.permutation(self.dataset.kept))

    def _packing_of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch != self._epoch:
            self._packing, self._epoch = self._pack(epoch), epoch
        return self._packing

    def _epoch_of(self, visit: int) -> int:
        while self.epoch_starts[-1] <= visit:  # count the rows of the epochs up to this visit's
            rows = len(self._packing_of(len(self.epoch_starts) - 1)[1])
            self.epoch_starts.append(self.epoch_starts[-1] + rows)
        return int(np.searchsorted(self.epoch_starts, visit, side="right")) - 1

    def __call__(self, visit: int) -> tuple[int, np.ndarray]:
        """(epoch, the row's pieces) of the ``visit``-th row drawn from this dataset (0-based)."""
        epoch = self._epoch_of(visit)
        pieces, row_starts = self._packing_of(epoch)
        row = visit - self.epoch_starts[epoch]
        stop = row_starts[row + 1] if row + 1 < len(row_starts) else len(pieces)
        return epoch, pieces[row_starts[row]:stop]

    def epochs(self, visits: int) -> float:
        """Epochs completed, fractionally, after ``visits`` rows."""
        if visits == 0:
            return 0.0
        epoch = self._epoch_of(visits - 1)
        rows = self.epoch_starts[epoch + 1] - self.epoch_starts[epoch]
        return epoch + (visits - self.epoch_starts[epoch]) / rows
