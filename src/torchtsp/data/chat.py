"""Chat datasets: conversations stored as two Megatron indexed datasets side by side.

``PREFIX.bin/.idx`` holds the token ids, one sequence per conversation. ``PREFIX-mask.bin/.idx`` holds, for
the same sequences with the same lengths, one uint8 per token: ``mask[t] = 1`` iff token ``t`` is an assistant
target (predicted from the tokens before it). ``PREFIX.json`` says ``"format": "chat"`` and names the mask
dataset (``"mask": "PREFIX-mask"``, relative to the sidecar's folder).

Conversation boundaries come from the records, never from EOS ids: a chat template ends every turn with its
end-of-turn token, so an EOS cannot tell where one conversation stops.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .indexed import IndexedDataset
from .sources import SIDECAR_SUFFIX, read_sidecar

CHAT_FORMAT = "chat"  # the sidecar's "format" of a chat dataset
MASK_SUFFIX = "-mask"


def mask_prefix(prefix: str) -> str:
    """The prefix of the assistant-target mask stored beside the tokens of chat dataset ``prefix``."""
    return str(prefix) + MASK_SUFFIX


def is_chat_sidecar(sidecar: dict | None) -> bool:
    return bool(sidecar) and sidecar.get("format") == CHAT_FORMAT


def open_chat_dataset(prefix) -> tuple[IndexedDataset, IndexedDataset]:
    """(tokens, assistant-target mask) of the chat dataset ``prefix``, checked against each other: the mask is
    uint8, holds as many sequences as the tokens, each of the same length."""
    prefix = str(prefix)
    sidecar = read_sidecar(prefix)
    if sidecar is not None and sidecar.get("mask") is not None:
        mask_at = str(Path(prefix + SIDECAR_SUFFIX).parent / sidecar["mask"])
    else:
        mask_at = mask_prefix(prefix)
    tokens = IndexedDataset(prefix)
    if not (Path(mask_at + ".bin").exists() or Path(mask_at + ".idx").exists()):
        raise FileNotFoundError(f"chat dataset {prefix} has no assistant-target mask: {mask_at}.bin/.idx do not "
                                f"exist; prepare it again with prepare-data --format chat")
    mask = IndexedDataset(mask_at)
    if mask.dtype != np.uint8:
        raise ValueError(f"{mask.idx_path}: an assistant-target mask is uint8, this one is {mask.dtype}; prepare "
                         f"the dataset again")
    if mask.n_sequences != tokens.n_sequences:
        raise ValueError(f"{mask.idx_path} holds {mask.n_sequences} conversations but {tokens.idx_path} holds "
                         f"{tokens.n_sequences}; the mask belongs to another dataset: prepare it again")
    differ = np.flatnonzero(np.asarray(mask.lengths) != np.asarray(tokens.lengths))
    if len(differ):
        i = int(differ[0])
        raise ValueError(f"{mask.idx_path}: conversation {i} has {int(mask.lengths[i])} mask values but "
                         f"{int(tokens.lengths[i])} tokens; the mask belongs to another dataset: prepare it again")
    return tokens, mask
