"""Where a parallel model's weights come from, one reference tensor (or the piece a rank keeps) at a time.

A scheme never needs the whole model: it asks a ``WeightSource`` for each reference parameter it holds,
whole (replicated) or as one of ``parts`` chunks along a dimension (torch.chunk's split: chunks of
ceil(size / parts), the last ones shorter or empty). Three sources:

* ``ModelWeights``: the tensors of a built reference model (what ``parallelize`` of a real model uses);
* ``SeededWeights``: the initial values of a model built on the meta device, drawn from its init seed
  block by block, so a rank draws only its rows (plus one block of rows for column shards);
* ``SafetensorsWeights``: a checkpoint on disk (Hugging Face or torchtsp native), read slice by slice with
  ``safe_open`` + ``get_slice``, so a rank reads only its bytes.

Every source hands out tensors in its ``dtype`` (float32, or a built model's own) on its ``device``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .config import ModelConfig
from .model import INIT_BLOCK_ROWS, initial_value, reference_shapes

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' dtype names


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``torch.chunk(range(size), parts)`` (empty past the end)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


class WeightSource:
    """Reference-named weights of the model ``cfg`` describes."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.shapes = reference_shapes(cfg)
        self.device, self.dtype = torch.device(device), dtype

    def on(self, device: torch.device | str) -> WeightSource:
        """The same source handing out tensors on ``device``."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__, device=torch.device(device))
        return clone

    def get(self, name: str, dim: int | None = None, parts: int = 1, index: int = 0) -> torch.Tensor:
        """Parameter ``name`` whole (``dim=None``), or chunk ``index`` of ``parts`` along ``dim``."""
        if name not in self.shapes:
            raise KeyError(f"{name} is not a parameter of this model")
        shape = self.shapes[name]
        if dim is None:
            start, stop = 0, shape[0]
            dim = 0
        else:
            start, stop = chunk_bounds(shape[dim], parts, index)
        return self._read(name, shape, dim, start, stop).to(device=self.device, dtype=self.dtype)

    def _read(self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError


class ModelWeights(WeightSource):
    """The tensors of a built reference model (copies of the requested pieces)."""

    def __init__(self, model):
        first = next(model.parameters())
        super().__init__(model.cfg, first.device, first.dtype)
        self._tensors = {name: t.detach() for name, t in model.state_dict().items()}

    def _read(self, name, shape, dim, start, stop):
        return self._tensors[name].narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)


class SeededWeights(WeightSource):
    """The initial values of a reference model whose init seed is ``seed`` (``Transformer.init_seed``)."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.seed = seed

    def _read(self, name, shape, dim, start, stop):
        if dim == 0:
            return initial_value(self.seed, name, shape, rows=(start, stop))
        # A column piece: every row block in turn, keeping this piece's columns (one block alive at a time).
        out = torch.empty(shape[0], stop - start)
        for lo in range(0, shape[0], INIT_BLOCK_ROWS):
            hi = min(lo + INIT_BLOCK_ROWS, shape[0])
            out[lo:hi] = initial_value(self.seed, name, shape, rows=(lo, hi))[:, start:stop]
        return out


class SafetensorsWeights(WeightSource):
    """Weights in safetensors files: ``files`` maps each stored tensor name to its file, ``stored_name`` maps a
    reference name to the stored one (Hugging Face names, or the reference names themselves)."""

    def __init__(self, cfg: ModelConfig, files: dict[str, Path], stored_name: Callable[[str], str],
                 device: torch.device | str = "cpu"):
        from safetensors import SafetensorError, safe_open

        super().__init__(cfg, device)
        self.files, self.stored_name = files, stored_name
        missing = [stored_name(n) for n in self.shapes if stored_name(n) not in files]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}")
        # Headers only: every file opens and every tensor has the model's shape, before anything is read.
        self.stored_dtype = None
        for path in sorted(set(files[stored_name(n)] for n in self.shapes)):
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in (n for n in self.shapes if files[stored_name(n)] == path):
                        piece = f.get_slice(stored_name(name))
                        if tuple(piece.get_shape()) != tuple(self.shapes[name]):
                            raise ValueError(f"{stored_name(name)} in {path} has shape {tuple(piece.get_shape())}, "
                                             f"the model expects {tuple(self.shapes[name])}")
                        self.stored_dtype = self.stored_dtype or _DTYPES.get(piece.get_dtype())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}; "
                                 "re-download or re-save it") from e

    def _read(self, name, shape, dim, start, stop):
        from safetensors import SafetensorError, safe_open

        stored = self.stored_name(name)
        path = self.files[stored]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                piece = f.get_slice(stored)
                if dim == 0:
                    return piece[start:stop].clone()  # reads only these rows' bytes
                # A column piece: row block by row block, so only one block is copied at a time.
                out = torch.empty(shape[0], stop - start, dtype=piece[0:1].dtype)
                for lo in range(0, shape[0], INIT_BLOCK_ROWS):
                    out[lo:lo + INIT_BLOCK_ROWS] = piece[lo:lo + INIT_BLOCK_ROWS, start:stop]
                return out
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from e
