"""``torchtsp convert``: checkpoints between Hugging Face, the native torchtsp format and training runs.

It sits above both ``hf`` (names, config and safetensors IO) and ``train`` (DCP training checkpoints), so
neither imports the other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .hf import (
    DEFAULT_SHARD_BYTES,
    HF_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    TORCHTSP_CONFIG_NAME,
    open_hf_weights,
    open_torchtsp_weights,
    require_dir,
    write_weights,
)

GENERATION_CONFIG_NAME = "generation_config.json"


def _is_training_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "checkpoints" / "latest").is_file()


def detect_checkpoint_kind(path: str | os.PathLike) -> str:
    """``"torchtsp"`` if the directory holds torchtsp.json, ``"hf"`` if it holds config.json,
    ``"train"`` for a training checkpoint (a ``torchtsp train`` run folder or one of its checkpoints)."""
    path = Path(path)
    require_dir(path)
    if _is_training_checkpoint(path):
        return "train"
    if (path / TORCHTSP_CONFIG_NAME).is_file():
        return "torchtsp"
    if (path / HF_CONFIG_NAME).is_file():
        return "hf"
    raise FileNotFoundError(
        f"{path} is not a checkpoint directory: it has neither {TORCHTSP_CONFIG_NAME} (torchtsp) "
        f"nor {HF_CONFIG_NAME} (Hugging Face)"
    )


def open_weights(path: str | os.PathLike):
    """``(kind, weights)`` of a checkpoint directory of any kind, nothing read yet (see ``torchtsp.weights``)."""
    kind = detect_checkpoint_kind(path)
    if kind == "train":
        from .train.checkpoint import CheckpointWeights  # imports torch.distributed.checkpoint: only when needed

        return kind, CheckpointWeights(path)
    return kind, (open_hf_weights if kind == "hf" else open_torchtsp_weights)(path)[1]


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> str:
    """Convert the checkpoint directory ``src`` into ``dst``; returns the kind written (``"hf"``/``"torchtsp"``).

    Without ``to`` the output is the other kind from the source (Hugging Face for a training checkpoint).
    A non-empty ``dst`` is refused unless ``overwrite`` (CLI ``--overwrite``); then only checkpoint files in it are
    replaced. Streamed: one tensor is read at a time and at most one output file (``max_shard_bytes``, default
    1 GiB) is held, so a model larger than memory converts.
    """
    if to not in (None, "hf", "torchtsp"):
        raise ValueError(f"unknown target format to={to!r}; choose 'hf' or 'torchtsp'")
    if not str(src).strip() or not str(dst).strip():  # Path("") is the current folder: an unset variable
        raise ValueError("convert needs a source and a destination folder; one is an empty path")
    src, dst = Path(src), Path(dst)
    kind, weights = open_weights(src)
    # The model's tokenizer travels with it: a Hugging Face folder's own files, or the one a training run kept.
    # Its files are checked (no link out of its folder) before anything is written.
    from .data.tokenizers import (
        BYTE_FINGERPRINT,
        copy_tokenizer_files,
        run_tokenizer_folder,
        tokenizer_files,
        write_byte_tokenizer,
    )

    tokenizer = run_tokenizer_folder(src) if kind == "train" else src
    if tokenizer is not None:
        tokenizer_files(tokenizer)
    # A run that kept no tokenizer read bytes (checkpoints of before the fingerprint was saved included).
    byte_run = kind == "train" and tokenizer is None and (
        getattr(weights, "tokenizer_fingerprint", None) in (None, BYTE_FINGERPRINT))
    target = to or ("torchtsp" if kind == "hf" else "hf")
    if dst.exists():
        if not dst.is_dir():
            raise ValueError(f"destination {dst} exists and is not a directory")
        if dst.resolve() == src.resolve():
            raise ValueError(f"destination {dst} is the source directory; choose another destination")
        if any(dst.iterdir()) and not overwrite:
            raise ValueError(f"destination {dst} is not empty; pass --overwrite (overwrite=True) to replace its "
                             f"checkpoint files")
        # Drop the other format's marker so detection of dst cannot find a stale one.
        for name in (TORCHTSP_CONFIG_NAME, HF_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME):
            if (dst / name).is_file():
                (dst / name).unlink()
    write_weights(dst, weights, target, max_shard_bytes or DEFAULT_SHARD_BYTES,
                  dtype=getattr(weights, "stored_dtype", None))
    if tokenizer is not None:
        copy_tokenizer_files(tokenizer, dst)
    elif byte_run and target == "hf":  # the byte tokenizer as HF files: serve --hf and AutoTokenizer read it
        write_byte_tokenizer(dst)
    if target == "hf":
        write_special_token_ids(dst)
    return target


def write_special_token_ids(folder: Path) -> None:
    """The BOS / EOS / PAD ids of the folder's tokenizer in ``config.json`` and a ``generation_config.json``, as
    ``save_pretrained`` writes them: without them transformers' ``generate`` never stops at the EOS and servers
    that read the model folder find no stop token."""
    from .data.tokenizers import hf_folder_tokenizer

    tokenizer = hf_folder_tokenizer(folder)
    if tokenizer is None:
        return  # no tokenizer travels with the weights: nothing to name
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": getattr(tokenizer, "pad_id", None)}
    ids = {k: v for k, v in ids.items() if v is not None}
    config_path = folder / HF_CONFIG_NAME
    config = json.loads(config_path.read_text())
    config.update(ids)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, **ids}
    (folder / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
