"""``torchtsp convert``: checkpoints between Hugging Face, the native torchtsp format and training runs.

It sits above both ``hf`` (names, config and safetensors IO) and ``train`` (DCP training checkpoints), so
neither imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path

from .hf import (
    HF_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    TORCHTSP_CONFIG_NAME,
    _require_dir,
    load_hf_checkpoint,
    load_torchtsp_checkpoint,
    save_hf_checkpoint,
    save_torchtsp_checkpoint,
)


def _is_training_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "checkpoints" / "latest").is_file()


def _load_training_checkpoint(path):
    from .train.checkpoint import load_full_state_dict  # imports torch.distributed.checkpoint: only when needed

    return load_full_state_dict(path)


def detect_checkpoint_kind(path: str | os.PathLike) -> str:
    """``"torchtsp"`` if the directory holds torchtsp.json, ``"hf"`` if it holds config.json,
    ``"train"`` for a training checkpoint (a ``torchtsp train`` run folder or one of its checkpoints)."""
    path = Path(path)
    _require_dir(path)
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


_LOADERS = {"hf": load_hf_checkpoint, "torchtsp": load_torchtsp_checkpoint, "train": _load_training_checkpoint}


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> str:
    """Convert the checkpoint directory ``src`` into ``dst``; returns the kind written (``"hf"``/``"torchtsp"``).

    Without ``to`` the output is the other kind from the source (Hugging Face for a training checkpoint).
    A non-empty ``dst`` is refused unless
    ``overwrite`` (CLI ``--force``); then only checkpoint files in it are replaced.
    """
    if to not in (None, "hf", "torchtsp"):
        raise ValueError(f"unknown target format to={to!r}; choose 'hf' or 'torchtsp'")
    src, dst = Path(src), Path(dst)
    kind = detect_checkpoint_kind(src)
    target = to or ("torchtsp" if kind == "hf" else "hf")
    if dst.exists():
        if not dst.is_dir():
            raise ValueError(f"destination {dst} exists and is not a directory")
        if dst.resolve() == src.resolve():
            raise ValueError(f"destination {dst} is the source directory; choose another destination")
        if any(dst.iterdir()) and not overwrite:
            raise ValueError(f"destination {dst} is not empty; pass --force (overwrite=True) to overwrite it")
    cfg, sd = _LOADERS[kind](src)
    if dst.exists():
        # Drop the other format's marker so detection of dst cannot find a stale one.
        for name in (TORCHTSP_CONFIG_NAME, HF_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME):
            if (dst / name).is_file():
                (dst / name).unlink()
    if target == "hf":
        save_hf_checkpoint(dst, sd, cfg, max_shard_bytes=max_shard_bytes)
    else:
        save_torchtsp_checkpoint(dst, sd, cfg)
    return target
