"""Checkpoint folders on disk: one reader and one writer of safetensors files, in both formats.

* **Hugging Face** (``config.json`` + ``model.safetensors``, or ``model.safetensors.index.json`` + shards),
  loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.
* **torchtsp native** (``torchtsp.json`` + ``model.safetensors`` in torchtsp parameter names).

Reading: ``weight_files`` maps every stored tensor to its file (the index validated here, once, its shard
names kept inside the folder); ``open_*_weights`` reads from those files slice by slice
(``torchtsp.weights.SafetensorsWeights``), ``load_*_checkpoint`` reads them whole (``read_tensors``).
Writing: ``write_weights`` streams any ``WeightSource`` into one file or shards plus an index;
``save_*_checkpoint`` is ``write_weights`` applied to a state dict.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import reference_shapes
from ..paths import contained, hub_blobs
from ..weights import SafetensorsWeights, WeightSource
from .config import config_from_hf, config_to_hf
from .names import (
    check_state_dict,
    file_location,
    format_names,
    stored_location,
    to_hf_name,
    to_hf_tensors,
)

HF_CONFIG_NAME = "config.json"
TORCHTSP_CONFIG_NAME = "torchtsp.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCHTSP_FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 2**30  # streamed exports hold at most one output file of this size


# --------------------------------------------------------------------------- small file helpers


def read_json(path: Path, what: str) -> dict:
    """The JSON object in ``path``; FileNotFoundError (with ``what``: why it is needed) or ValueError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {what}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or regenerate the file") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (not UTF-8 text: {e}); fix or regenerate the file") from e
    if not isinstance(data, dict):
        # Bad file contents, like invalid JSON: a ValueError naming the file, not a TypeError.
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")  # noqa: TRY004
    return data


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def require_dir(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory; pass the checkpoint's directory")


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it
    os.umask(mask)
    return mask


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}; "
                      "re-download or re-save it")


# --------------------------------------------------------------------------- the reader


def _index_weight_map(path: Path, index: Path) -> dict[str, Path]:
    """Tensor name -> shard file of a sharded checkpoint's index, every shard present and inside ``path``
    (a Hugging Face hub snapshot's shards may be symlinks into its ``blobs`` folder)."""
    weight_map = read_json(index, "").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' object; regenerate the index or the checkpoint")
    blobs = hub_blobs(path)
    files = {shard: contained(path, shard, index, also_inside=blobs) for shard in set(weight_map.values())}
    missing = sorted(shard for shard, file in files.items() if not file.is_file())
    if missing:
        raise FileNotFoundError(f"shard(s) named in {index} are missing from {path}: {format_names(missing)}; "
                                "re-download the complete checkpoint")
    return {name: files[shard] for name, shard in weight_map.items()}


def weight_files(path: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file that holds it: ``model.safetensors``, else the shards of the
    index (transformers' order of preference), else the folder's only ``.safetensors`` file."""
    from safetensors import SafetensorError, safe_open

    single, index = path / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file() and not single.is_file():
        return _index_weight_map(path, index)
    candidates = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if len(candidates) > 1:
        raise ValueError(
            f"{path} holds several .safetensors files ({format_names([c.name for c in candidates])}) but no "
            f"{SAFE_WEIGHTS_INDEX_NAME}; add the index that maps tensors to shards"
        )
    if not candidates:
        hint = ""
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            hint = " (found PyTorch pickle weights; re-save them with save_pretrained(safe_serialization=True))"
        raise FileNotFoundError(f"no safetensors weights in {path}: expected {SAFE_WEIGHTS_NAME} or "
                                f"{SAFE_WEIGHTS_INDEX_NAME} with its shards{hint}")
    try:
        with safe_open(str(candidates[0]), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), candidates[0])
    except (SafetensorError, OSError, RuntimeError) as e:
        raise _unreadable(candidates[0], e) from e


def read_tensors(files: dict[str, Path], index: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (``weight_files``), whole, each file read once."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        try:
            tensors = load_file(str(file), device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise _unreadable(file, e) from e
        wanted = [k for k, f in files.items() if f == file]
        absent = [k for k in wanted if k not in tensors]
        if absent:
            raise ValueError(f"{file} lacks tensor(s) that {index or 'its index'} places there: "
                             f"{format_names(absent)}")
        out.update((k, tensors[k]) for k in wanted)
    return out


def _hf_dir_config(path: Path) -> tuple[ModelConfig, Path]:
    """The ModelConfig of an HF checkpoint directory, and its config.json (errors name the file)."""
    require_dir(path)
    cfg_path = path / HF_CONFIG_NAME
    hf_config = read_json(cfg_path, "a Hugging Face checkpoint directory needs config.json (as written by "
                                    "save_pretrained)")
    try:
        return config_from_hf(hf_config), cfg_path
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e


def _native_config(path: Path) -> tuple[ModelConfig, Path]:
    """The ModelConfig of a native torchtsp checkpoint directory, and its torchtsp.json."""
    require_dir(path)
    meta_path = path / TORCHTSP_CONFIG_NAME
    hint = "a torchtsp checkpoint directory needs torchtsp.json (written by save_torchtsp_checkpoint)"
    if not meta_path.is_file() and (path / HF_CONFIG_NAME).is_file():
        hint += "; this looks like a Hugging Face checkpoint: use load_hf_checkpoint or `torchtsp convert`"
    meta = read_json(meta_path, hint)
    if meta.get("format") != "torchtsp":
        raise ValueError(f"{meta_path}: format={meta.get('format')!r}, expected 'torchtsp'")
    if meta.get("version") != TORCHTSP_FORMAT_VERSION:
        raise ValueError(f"{meta_path}: unsupported version={meta.get('version')!r}; this torchtsp reads version "
                         f"{TORCHTSP_FORMAT_VERSION}")
    if not isinstance(meta.get("model"), dict):
        raise ValueError(f"{meta_path}: 'model' must be an object of ModelConfig fields")  # noqa: TRY004
    try:
        return ModelConfig.from_dict(meta["model"]), meta_path
    except (TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: invalid model config: {e}") from e


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF checkpoint directory of a supported family; returns ``(cfg, state dict in torchtsp names)``."""
    from .names import from_hf_state_dict

    path = Path(path)
    cfg, cfg_path = _hf_dir_config(path)
    hf_sd = read_tensors(weight_files(path), path / SAFE_WEIGHTS_INDEX_NAME)
    try:
        return cfg, from_hf_state_dict(hf_sd, cfg)
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {cfg_path}: {e}") from e


def load_torchtsp_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a native torchtsp checkpoint directory; returns ``(cfg, state dict)``."""
    path = Path(path)
    cfg, meta_path = _native_config(path)
    weights = path / SAFE_WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"weights file {weights} not found; re-save the checkpoint")
    sd = read_tensors(weight_files(path))
    try:
        check_state_dict(sd, reference_shapes(cfg), f"{weights}")
    except ValueError as e:
        raise ValueError(f"{e} (config from {meta_path})") from e
    return cfg, sd


def open_hf_weights(path: str | os.PathLike):
    """``(cfg, weights)`` of an HF checkpoint directory without reading its tensors: ``weights`` is a
    ``torchtsp.weights.SafetensorsWeights`` that ``parallelize(..., weights=weights)`` reads slice by slice,
    so each rank reads only the bytes of its own shards."""
    path = Path(path)
    cfg, cfg_path = _hf_dir_config(path)
    files = weight_files(path)
    if any(name.endswith("_blocks") for name in files):
        check_dequantize_room(cfg, path)
    try:
        return cfg, SafetensorsWeights(cfg, files, stored_location(cfg, files))
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {cfg_path}: {e}") from e


def mxfp4_dequantized_bytes(cfg: ModelConfig) -> int:
    """The bf16 bytes of every expert matrix of a GPT-OSS model (what its MXFP4 blocks dequantize to: about 3.8x
    their stored bytes of 4.25 bits per value)."""
    sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    return sparse * cfg.n_experts * 3 * cfg.moe_ffn_dim * cfg.dim * 2


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_dequantize_room(cfg: ModelConfig, path: Path) -> None:
    """GPT-OSS's MXFP4 experts are dequantized to bf16 on load: note what that costs, and refuse in one line where
    this host's ranks cannot hold their share (the ranks read only their own experts or slices)."""
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    needed = mxfp4_dequantized_bytes(cfg) * min(local, world) // max(world, 1)
    free = _available_host_bytes()
    if free is not None and needed > free:
        raise ValueError(f"{path}: GPT-OSS's MXFP4 experts dequantize to bf16 on load: this host's {local} rank(s) "
                          f"need {needed / 2**30:.1f} GiB for their share, {free / 2**30:.1f} GiB is free; use more "
                          "ranks or hosts (each keeps 1/D of the experts)")
    if os.environ.get("RANK", "0") == "0":
        total = mxfp4_dequantized_bytes(cfg) / 2**30
        print(f"note: {path.name}: MXFP4 experts dequantized to bf16 on load ({total:.1f} GiB for the whole model, "
              "about 3.8x their stored size), split over the ranks", file=sys.stderr)


def open_torchtsp_weights(path: str | os.PathLike):
    """``(cfg, weights)`` of a native torchtsp checkpoint directory, read slice by slice like ``open_hf_weights``."""
    path = Path(path)
    cfg, meta_path = _native_config(path)
    try:
        return cfg, SafetensorsWeights(cfg, weight_files(path), lambda name: name)
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {meta_path}: {e}") from e


# --------------------------------------------------------------------------- the writer


def _remove_weight_files(path: Path) -> None:
    stale = [path / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_INDEX_NAME, *path.glob("model-*-of-*.safetensors")]
    for f in stale:
        if f.is_file():
            f.unlink()


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600; exports are ordinary files
    os.replace(tmp, path)


def write_weights(path: str | os.PathLike, weights, fmt: str = "hf", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  dtype: torch.dtype | None = None) -> None:
    """Write the model ``weights`` (a ``torchtsp.weights.WeightSource``) as a Hugging Face (``fmt="hf"``) or
    native torchtsp checkpoint, streaming: tensors are read one at a time in reference order and written as
    soon as an output file of ``max_shard_bytes`` is full, so at most one file's worth is ever held. A model
    under ``max_shard_bytes`` is one ``model.safetensors``; a larger one, shards plus an index. Weight files of
    an earlier save in the same directory are removed so no stale file shadows the new ones."""
    if fmt not in ("hf", "torchtsp"):
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose 'hf' or 'torchtsp'")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = weights.cfg
    stored = (lambda name: to_hf_name(name, cfg)) if fmt == "hf" else (lambda name: name)
    dtype = dtype or weights.dtype
    nbytes = {name: math.prod(shape) * dtype.itemsize for name, shape in weights.shapes.items()}
    units: dict[str, list[str]] = {}  # stored tensor -> the reference names it is made of (several for fused parts)
    for name in weights.shapes:  # reference order
        units.setdefault(stored(name), []).append(name)
    groups: list[list[str]] = [[]]
    for unit in units.values():
        size = sum(nbytes[n] for n in unit)
        if groups[-1] and sum(nbytes[n] for n in groups[-1]) + size > max_shard_bytes:
            groups.append([])
        groups[-1].extend(unit)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_weight_files(path)
    metadata = {"format": "pt"} if fmt == "hf" else {"format": "pt", "torchtsp": str(TORCHTSP_FORMAT_VERSION)}
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        fname = SAFE_WEIGHTS_NAME if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        if fmt == "hf":  # as save_pretrained writes: one tensor per expert
            tensors = {k: t.to(dtype).contiguous() for k, t in
                       to_hf_tensors({n: weights.get(n) for n in names}, names, file_location(cfg)).items()}
        else:
            tensors = {n: weights.get(n).to(dtype).contiguous() for n in names}
        _save_safetensors(path / fname, tensors, metadata)
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if len(groups) > 1:
        _write_json(path / SAFE_WEIGHTS_INDEX_NAME,
                    {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
    if fmt == "hf":
        _write_json(path / HF_CONFIG_NAME, config_to_hf(cfg, dtype=str(dtype).removeprefix("torch.")))
    else:
        _write_json(path / TORCHTSP_CONFIG_NAME,
                    {"format": "torchtsp", "version": TORCHTSP_FORMAT_VERSION, "model": cfg.to_dict()})


class StateDictWeights(WeightSource):
    """A state dict in torchtsp names as a ``WeightSource`` (what ``save_*_checkpoint`` hands ``write_weights``)."""

    def __init__(self, sd: dict[str, torch.Tensor], cfg: ModelConfig):
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
            if t.device.type == "meta":
                raise ValueError(f"{name} is on the meta device and has no data to save")
        dtype = next((t.dtype for t in sd.values() if t.is_floating_point()), torch.float32)
        super().__init__(cfg, "cpu", dtype)
        self._tensors = sd

    def _read(self, name, shape, dim, start, stop):
        # A copy: tensors of a state dict may share storage (halves of a fused tensor), which safetensors refuses.
        piece = self._tensors[name].detach().narrow(dim, start, stop - start)
        return piece.clone(memory_format=torch.contiguous_format)


def _write_state_dict(path, sd: dict[str, torch.Tensor], cfg: ModelConfig, fmt: str,
                      max_shard_bytes: int | None) -> None:
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    check_state_dict(sd, reference_shapes(cfg), "torchtsp state dict")
    weights = StateDictWeights(sd, cfg)
    whole = sum(t.numel() * weights.dtype.itemsize for t in sd.values()) + 1  # one file unless told otherwise
    write_weights(path, weights, fmt, max_shard_bytes or whole)


def save_hf_checkpoint(path: str | os.PathLike, sd: dict[str, torch.Tensor], cfg: ModelConfig,
                       max_shard_bytes: int | None = None) -> None:
    """Write ``sd`` (torchtsp names) as an HF checkpoint ``AutoModelForCausalLM.from_pretrained`` loads: one
    ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes``, shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (``write_weights``)."""
    _write_state_dict(path, sd, cfg, "hf", max_shard_bytes)


def save_torchtsp_checkpoint(path: str | os.PathLike, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Write ``torchtsp.json`` + ``model.safetensors`` (torchtsp names; a tied embedding is stored once)."""
    _write_state_dict(path, sd, cfg, "torchtsp", None)
