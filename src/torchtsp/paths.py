"""Paths read from files stay inside their folder.

Checkpoints, Hugging Face folders and datasets name other files (an index's shards, a manifest's files, the
``latest`` pointer); such a name comes from whoever wrote the file, not from the user. ``contained`` resolves
it (symlinks included) and refuses it unless it lands inside the folder it was read from, so a crafted file
can neither make torchtsp read, hash or convert a file elsewhere nor make it remove a folder elsewhere.
Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path


def contained(folder: str | os.PathLike, name: object, source: str | os.PathLike,
              also_inside: str | os.PathLike | None = None) -> Path:
    """``folder / name`` if ``name`` (a string read from ``source``) is a relative path that resolves, symlinks
    followed, inside ``folder`` (or inside ``also_inside``, for stores that keep the bytes elsewhere by design);
    else ValueError naming ``source`` and ``name``."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{source} names {name!r} where a file name belongs; the file is damaged or crafted")
    joined = Path(folder) / name
    target = joined.resolve()
    roots = [Path(folder).resolve()] + ([Path(also_inside).resolve()] if also_inside is not None else [])
    if Path(name).is_absolute() or not any(target.is_relative_to(root) for root in roots):
        raise ValueError(f"{source} names {name!r}, which lies outside {folder}; torchtsp reads only files inside "
                         f"the folder a file was read from (the file is damaged or crafted)")
    return joined


def hub_blobs(folder: str | os.PathLike) -> Path | None:
    """The ``blobs`` folder of a Hugging Face hub cache when ``folder`` is one of its ``snapshots/<revision>``
    folders (whose files are symlinks into it), else None."""
    folder = Path(folder).resolve()
    blobs = folder.parent.parent / "blobs"
    return blobs if folder.parent.name == "snapshots" and blobs.is_dir() else None
