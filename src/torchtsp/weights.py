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
from .model import INIT_BLOCK_ROWS, expert_name, initial_value, norm_weight_init, reference_shapes

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
        if len(shape) == 3 and dim > 0:  # a piece of every expert: each expert's matrix is drawn alone
            return torch.stack([self._read(expert_name(name, e), shape[1:], dim - 1, start, stop)
                                for e in range(shape[0])])
        if dim == 0:
            return initial_value(self.seed, name, shape, rows=(start, stop), norm_init=norm_weight_init(self.cfg))
        # A column piece: every row block in turn, keeping this piece's columns (one block alive at a time).
        out = torch.empty(shape[0], stop - start)
        for lo in range(0, shape[0], INIT_BLOCK_ROWS):
            hi = min(lo + INIT_BLOCK_ROWS, shape[0])
            out[lo:hi] = initial_value(self.seed, name, shape, rows=(lo, hi), norm_init=norm_weight_init(self.cfg))[
                :, start:stop]
        return out


class SafetensorsWeights(WeightSource):
    """Weights in safetensors files: ``files`` maps each stored tensor name to its file, ``stored_name`` maps a
    reference name to where it is stored: a stored name (Hugging Face names, or the reference names
    themselves); ``("fused", name, dim, part, widths)`` for part ``part`` along ``dim`` of a stored tensor that
    fuses parameters of ``widths`` along it; ``("experts", [name of each expert])`` for a stacked [E, ...]
    parameter stored expert by expert; a ``hf.names.ExpertPart`` for one stored in another layout (GPT-OSS's,
    MXFP4 dequantized on read).
    """

    def __init__(self, cfg: ModelConfig, files: dict[str, Path], stored_name: Callable[[str], str | tuple],
                 device: torch.device | str = "cpu"):
        from safetensors import SafetensorError, safe_open

        super().__init__(cfg, device)
        self.files, self.location = files, stored_name
        self.stored_name = lambda name: self._stored(name)[0]
        missing = [s for n in self.shapes for s in self._stored(n) if s not in files]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}")
        # Headers only: every file opens and every tensor has the model's shape, before anything is read.
        want = {}
        for name, shape in self.shapes.items():
            spec = self._spec(name)
            if spec[0] == "fused":
                want[spec[1]] = tuple(sum(spec[4]) if d == spec[2] else n for d, n in enumerate(shape))
            elif spec[0] == "part":
                want.update(spec[1].stored_shapes(tuple(shape)))
            else:
                want.update(dict.fromkeys(self._stored(name), tuple(shape[1:] if spec[0] == "experts" else shape)))
        self.stored_dtype = None
        for path in sorted(set(files[s] for s in want)):
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for stored in (s for s in want if files[s] == path):
                        piece = f.get_slice(stored)
                        if tuple(piece.get_shape()) != want[stored]:
                            raise ValueError(f"{stored} in {path} has shape {tuple(piece.get_shape())}, "
                                             f"the model expects {want[stored]}")
                        self.stored_dtype = self.stored_dtype or _DTYPES.get(piece.get_dtype())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}; "
                                 "re-download or re-save it") from e

    def _spec(self, name: str) -> tuple:
        where = self.location(name)
        if isinstance(where, str):
            return "whole", where
        return ("part", where) if hasattr(where, "stored_names") else where

    def _stored(self, name: str) -> list[str]:
        spec = self._spec(name)
        return list(spec[1]) if spec[0] == "experts" else spec[1].stored_names if spec[0] == "part" else [spec[1]]

    def _read_part(self, part, shape, dim, start, stop):
        """A stacked expert parameter stored in another layout (``hf.names.ExpertPart``), expert by expert: only
        the experts this rank keeps are read, one at a time."""
        experts = range(start, stop) if dim == 0 else range(shape[0])
        pieces = []
        for e in experts:
            one = part.expert([self._with_slice(n, lambda piece, e=e: piece[e:e + 1])[0] for n in part.stored_names])
            pieces.append(one if dim == 0 else one.narrow(dim - 1, start, stop - start))
        return torch.stack(pieces) if pieces else torch.empty(0, *shape[1:])

    def _read(self, name, shape, dim, start, stop):
        spec = self._spec(name)
        if spec[0] == "part":
            return self._read_part(spec[1], shape, dim, start, stop)
        if spec[0] == "experts":  # one stored matrix per expert
            experts = range(start, stop) if dim == 0 else range(shape[0])
            inner = (0, 0, shape[1]) if dim == 0 else (dim - 1, start, stop)
            pieces = [self._read_stored(spec[1][e], shape[1:], *inner) for e in experts]
            return torch.stack(pieces) if pieces else torch.empty(0, *shape[1:])
        if spec[0] == "fused":  # one part of a fused tensor (of stacked experts: one expert at a time)
            _, stored, fused_dim, part, widths = spec
            bounds = [[0, n] for n in shape]
            bounds[dim] = [start, stop]
            bounds[fused_dim] = [b + sum(widths[:part]) for b in bounds[fused_dim]]
            if len(shape) == 2:  # a matrix (Phi-3's qkv_proj, gate_up_proj): its block at once
                return self._with_slice(stored, lambda piece: piece[slice(*bounds[0]), slice(*bounds[1])])
            (e0, e1), rest = bounds[0], [slice(*b) for b in bounds[1:]]
            return self._with_slice(stored, lambda piece: torch.cat(
                [piece[(slice(e, e + 1), *rest)] for e in range(e0, e1)]))
        return self._read_stored(spec[1], shape, dim, start, stop)

    def _with_slice(self, stored: str, read):
        from safetensors import SafetensorError, safe_open

        path = self.files[stored]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return read(f.get_slice(stored))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from e

    def _read_stored(self, stored, shape, dim, start, stop):
        def read(piece):
            if dim == 0:
                return piece[start:stop].clone()  # reads only these rows' bytes
            if len(shape) == 3:  # a piece of every expert, one expert at a time
                return torch.cat([piece[e:e + 1, start:stop] if dim == 1 else piece[e:e + 1, :, start:stop]
                                  for e in range(shape[0])])
            # A column piece: row block by row block, so only one block is copied at a time.
            out = torch.empty(shape[0], stop - start, dtype=piece[0:1].dtype)
            for lo in range(0, shape[0], INIT_BLOCK_ROWS):
                out[lo:lo + INIT_BLOCK_ROWS] = piece[lo:lo + INIT_BLOCK_ROWS, start:stop]
            return out

        return self._with_slice(stored, read)
