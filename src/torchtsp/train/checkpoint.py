"""Training checkpoints through torch.distributed.checkpoint (DCP), in reference parameter names.

Every tensor is stored as a DTensor over the run's mesh: each rank writes its own pieces, and a
later run with another layout (another D, another scheme) reads back exactly its own pieces.
A checkpoint is written aside (``.step_N.tmp``), its files' sha256 recorded in ``meta.json``, and
published by renaming it once every rank has finished; ``latest`` is updated atomically and always
names a complete checkpoint, whatever point a crash falls on. Loading verifies the checksums.

Like pipelining, this module is an exception to ``distributed.comm`` being the only caller of
``torch.distributed``: it calls DCP, and the DTensors it builds (``sharded_tensor``) only describe pieces for DCP,
never communicated.

A checkpoint may come from elsewhere, so loading runs no code from it: DCP's ``.metadata`` is a pickle, read
here by an unpickler that admits only DCP's own metadata classes (``read_dcp_metadata``); the values DCP
stores as bytes are read with ``torch.load(weights_only=True)``; every file name read from a file (the
metadata's data files, ``meta.json``'s ``files``, the ``latest`` pointer) must lie inside the checkpoint's
folder (``torchtsp.paths.contained``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config import ModelConfig
from ..distributed import comm
from ..model import reference_shapes
from ..paths import contained
from ..weights import WeightSource

FORMAT = "torchtsp-train"
META = "meta.json"
LATEST = "latest"


def training_state(model, optimizer, named_params, mesh, step: int) -> dict:
    """The DCP state dict of a run: weights and AdamW moments (as DTensors), step and RNG.

    ``named_params`` are the (name, tensor) pairs the optimizer updates (fp32 masters under bf16);
    loading fills these tensors and the optimizer's moments in place.
    """
    shapes = reference_shapes(model.cfg)
    # AdamW counts steps per parameter, but every parameter steps together: one counter is stored,
    # so the checkpoint does not depend on how a scheme names its local parameters.
    state: dict = {"train/step": step, "train/rng": torch.get_rng_state(),
                   "optim/step": torch.zeros((), dtype=torch.float32)}
    for name, param in named_params:
        moments = optimizer.state[param]
        if not moments:  # before the first step: create AdamW's state so that loading can fill it
            moments.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(param),
                           exp_avg_sq=torch.zeros_like(param))
        state["optim/step"].copy_(moments["step"])
        for key, tensor in (("model", param.data), ("optim/exp_avg", moments["exp_avg"]),
                            ("optim/exp_avg_sq", moments["exp_avg_sq"])):
            for ref, piece, shard_dims in model.reference_parts(name, tensor):
                state[f"{key}/{ref}"] = sharded_tensor(piece, mesh, shard_dims, shapes[ref])
    return state


# Per parent mesh (forgotten with it, when its job ends): the meshes that only describe DTensors.
_GROUPED_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grouped_mesh(mesh: DeviceMesh, name: str, chunks: int) -> DeviceMesh:
    """``mesh`` with axis ``name`` (size D) viewed as (``name``: chunks, ``name``_replica: D/chunks), for
    DTensors of slices replicated over consecutive ranks. Built without process groups: DTensors over it
    are only described (checkpoints), never communicated."""
    names = tuple(mesh.mesh_dim_names)
    i = names.index(name)
    known = _GROUPED_MESHES.setdefault(mesh, {})
    if (name, chunks) not in known:
        shape = (*mesh.mesh.shape[:i], chunks, mesh.mesh.shape[i] // chunks, *mesh.mesh.shape[i + 1:])
        known[name, chunks] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                                         mesh_dim_names=(*names[:i], name, f"{name}_replica", *names[i + 1:]),
                                         _init_backend=False)
    return known[name, chunks]


def sharded_tensor(local: torch.Tensor, mesh: DeviceMesh, shard_dims: dict, global_shape) -> DTensor:
    """A DTensor view of this rank's piece: sharded along ``shard_dims[axis]`` on those mesh axes
    (torch.chunk split, so the last pieces may be shorter), replicated on the others.

    A value ``(dim, chunks)`` instead of ``dim`` splits ``dim`` into ``chunks`` slices, each held by
    size/chunks consecutive ranks of the axis (replicated KV heads): a checkpoint stores each slice once
    and every rank of its group reads it back."""
    for name, dim in list(shard_dims.items()):
        if isinstance(dim, tuple):
            mesh = _grouped_mesh(mesh, name, dim[1])
            shard_dims = {**shard_dims, name: dim[0]}
    placements = [Shard(shard_dims[name]) if name in shard_dims else Replicate() for name in mesh.mesh_dim_names]
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(global_shape), stride=stride)


def save(run_dir: str | Path, state: dict, meta: dict, keep_last: int | None = None) -> Path:
    """Write ``state`` as ``run_dir/checkpoints/step_N`` (N = state's step) and point ``latest`` at it.

    Every rank writes its pieces into a hidden folder; rank 0 then records a sha256 of every file in
    ``meta.json`` and publishes the folder (see ``publish``). ``keep_last`` removes older checkpoints.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step_{state['train/step']:06d}"
    tmp = root / f".{name}.tmp"
    if comm.global_rank() == 0:
        recover(root)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            raise disk_error(e, root) from None
    comm.barrier()
    try:
        dcp.save(state, checkpoint_id=str(tmp))  # every rank writes its pieces; replicated ones once
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        if comm.global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back
        raise disk_error(e, root, _state_bytes(state)) from None
    comm.barrier()
    if comm.global_rank() == 0:
        try:
            files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            write_file(tmp / META, json.dumps({"format": FORMAT, "version": 1, **meta, "files": files}, indent=2))
            publish(root, name)
            if keep_last:
                prune(root, keep_last)
        except OSError as e:
            raise disk_error(e, root) from None
    comm.barrier()
    return root / name


def publish(root: Path, name: str) -> None:
    """Move the complete folder ``.name.tmp`` to ``name`` and point ``latest`` at it.

    Crash-safe at every point: ``latest`` always names a complete checkpoint. A step saved again
    (a resumed run re-saving its step) cannot be renamed over the old copy in one step, so ``latest``
    names the new copy under its hidden name while the old copy is replaced by hard links to it.
    """
    tmp, final = root / f".{name}.tmp", root / name
    if not final.exists():
        os.replace(tmp, final)  # the folder appears complete or not at all
    else:
        point_latest(root, tmp.name)
        shutil.rmtree(final)
        staged = root / f".{name}.new"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        for f in tmp.iterdir():
            try:
                os.link(f, staged / f.name)
            except OSError:  # a file system without hard links
                shutil.copy2(f, staged / f.name)
        os.replace(staged, final)
    point_latest(root, name)
    shutil.rmtree(tmp, ignore_errors=True)


def recover(root: Path) -> None:
    """Finish a publish a crash interrupted, then drop hidden leftovers that ``latest`` does not name."""
    if not root.is_dir():
        return
    named = latest_name(root)
    if named and named.startswith(".") and named.endswith(".tmp") and (root / named / META).is_file():
        publish(root, named[1:-len(".tmp")])
        named = named[1:-len(".tmp")]
    for leftover in root.glob(".*"):
        if leftover.is_dir() and leftover.name != named:
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.name == f".{LATEST}.tmp":
            leftover.unlink()


def latest_name(root: Path) -> str | None:
    """The checkpoint that ``root/latest`` names (None without one): a folder directly inside ``root``, else
    ValueError (a crafted ``latest`` must not make a save publish or remove a folder elsewhere)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        named = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{pointer} is unreadable ({e}); remove it or resume from a step_N folder") from None
    if not named:
        return None
    if Path(named).name != named or named in (".", ".."):
        raise ValueError(f"{pointer} names {named!r}, which is not a checkpoint folder directly inside {root}; "
                         f"the file is damaged or crafted")
    contained(root, named, pointer)
    return named


def point_latest(root: Path, name: str) -> None:
    pointer = root / f".{LATEST}.tmp"
    write_file(pointer, name)
    os.replace(pointer, root / LATEST)


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints (never the one ``latest`` names)."""
    named = latest_name(root)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name)
    for old in steps[:-keep_last]:
        if old.name != named:
            hidden = root / f".{old.name}.del"  # hidden first: a half-removed folder never looks like a checkpoint
            os.replace(old, hidden)
            shutil.rmtree(hidden, ignore_errors=True)


def write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _state_bytes(state: dict) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in state.values() if isinstance(t, torch.Tensor))


def disk_error(error: BaseException, where: Path, needed_bytes: int = 0) -> BaseException:
    """``error`` as "no space left on <dir>" when the disk is full (torch's zip writer reports a full disk as
    "unexpected pos"); any other error unchanged."""
    text = str(error)
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    full = full or "No space left on device" in text or "unexpected pos" in text
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    full = full or (free is not None and needed_bytes and free < needed_bytes)
    if not full:
        return error
    shown = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
    return OSError(errno.ENOSPC, f"no space left on {where}{shown}; free some space or choose another --out")


def verify(checkpoint: Path, meta: dict, world=None, device: torch.device | str = "cpu") -> None:
    """Check every file against the sha256 recorded at save time; ranks share the reading.

    ``world`` is an ``AxisComm`` over every rank (None: this process checks every file).
    """
    listed = meta.get("files", {})  # checkpoints written before checksums carry none
    if not isinstance(listed, dict):
        raise ValueError(f"checkpoint {checkpoint} is damaged: {META}'s 'files' is not an object of sha256 digests")
    files = sorted(listed.items())
    for name, _ in files:  # every rank checks every name, so that every rank refuses alike
        contained(checkpoint, name, checkpoint / META)
    size, rank = (world.size, world.rank) if world is not None else (1, 0)
    status = torch.zeros(len(files), dtype=torch.float32)
    for i, (name, digest) in enumerate(files):
        if i % size == rank:
            path = checkpoint / name
            status[i] = 1 if not path.is_file() else 2 if sha256(path) != digest else 0
    if size > 1 and files:
        status = world.all_reduce(status.to(device), label="checksums").cpu()
    for (name, _), code in zip(files, status.tolist()):
        if code:
            why = "is missing" if code == 1 else "does not match the checksum recorded when it was saved"
            raise ValueError(f"checkpoint {checkpoint} is damaged: {name} {why}; "
                             f"resume from another checkpoint")


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from a run folder (its latest checkpoint) or a checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {p} does not exist")
    for root in (p / "checkpoints", p):
        if (named := latest_name(root)) is not None:
            p = root / named
            break
    if not (p / META).is_file():
        raise FileNotFoundError(f"{p} is not a complete torchtsp checkpoint (no {META}); give a run folder "
                                f"or one of its checkpoints/step_N folders")
    return p


def read_meta(checkpoint: Path) -> dict:
    try:
        meta = json.loads((checkpoint / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {checkpoint} is damaged: {META} is unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{checkpoint / META} is not a torchtsp training checkpoint")
    return meta


def check_tokenizer_matches(meta: dict, tokenizer, checkpoint: Path) -> None:
    """The run reads text through the tokenizer the checkpoint was trained with (ids mean the same tokens)."""
    saved = meta.get("tokenizer")
    if saved is not None and saved != tokenizer.fingerprint:
        raise ValueError(f"checkpoint {checkpoint} was trained with another tokenizer (fingerprint {saved[:12]}) "
                         f"than this run's {tokenizer.name} ({tokenizer.fingerprint[:12]}); resume with the run's "
                         f"own --tokenizer (a bare --resume restores it)")


def check_model_matches(meta: dict, cfg: ModelConfig, checkpoint: Path) -> None:
    saved = meta.get("model", {})
    try:  # fields the checkpoint's torchtsp did not have yet take their defaults (head_dim: dim / n_heads)
        saved = ModelConfig.from_dict(saved).to_dict()
    except (TypeError, ValueError):
        pass  # compared as written: the differences are reported below
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in cfg.to_dict().items()
             if k != "max_seq_len" and saved.get(k) != v]
    if diffs:
        raise ValueError(f"checkpoint {checkpoint} holds a different model shape ({'; '.join(diffs)}); "
                         f"resume with the same model settings")


def restore_optimizer_steps(optimizer, state: dict) -> None:
    """After ``load``: every parameter's AdamW step count is the stored one."""
    for moments in optimizer.state.values():
        moments["step"].copy_(state["optim/step"])


def _load_tensors(checkpoint: Path, state: dict, metadata: dcp_metadata.Metadata | None = None) -> None:
    """DCP load into ``state`` in place (resharding); a failure is one ValueError naming the checkpoint.
    ``metadata``: the checkpoint's ``read_dcp_metadata`` when already read."""
    metadata = metadata or read_dcp_metadata(checkpoint)
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=_CheckedReader(checkpoint, metadata), planner=_WeightsOnlyPlanner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        # DCP's messages embed every rank's traceback; their last line names the cause.
        cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise ValueError(f"checkpoint {checkpoint} could not be loaded, it looks damaged or incomplete "
                         f"({cause[0][:200]})") from None


def load(checkpoint: Path, state: dict) -> None:
    """Fill ``state`` (from ``training_state``) in place; reshards to this run's layout."""
    _load_tensors(checkpoint, state)
    torch.set_rng_state(state["train/rng"])


def load_full_state_dict(checkpoint: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Single process: the full model weights of a training checkpoint (for checks; exports stream instead)."""
    weights = CheckpointWeights(checkpoint)
    return weights.cfg, {name: weights.get(name) for name in weights.shapes}


class CheckpointWeights(WeightSource):
    """The model weights of a training checkpoint, read one tensor at a time (for a streamed export): each
    read loads just that tensor from the DCP files, in a single process, resharded to its full shape."""

    def __init__(self, checkpoint: str | Path):
        self.checkpoint = resolve(checkpoint)
        meta = read_meta(self.checkpoint)
        verify(self.checkpoint, meta)  # a damaged file is named before anything is read
        self._metadata = read_dcp_metadata(self.checkpoint)  # once, and a crafted one is refused before any write
        self.tokenizer_fingerprint = meta.get("tokenizer")  # what the run read its text with ("byte": bytes)
        super().__init__(ModelConfig.from_dict(meta["model"]))

    def _read(self, name, shape, dim, start, stop):
        full = torch.empty(shape)
        with warnings.catch_warnings():  # DCP warns that it runs without a process group, as intended here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            _load_tensors(self.checkpoint, {f"model/{name}": full}, self._metadata)
        return full.narrow(dim, start, stop - start)


# ---------------------------------------------------------------- reading DCP files without running their code

DCP_METADATA = ".metadata"
# Everything a DCP metadata pickle refers to: DCP's own dataclasses and the torch values inside them.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}


class _RefusedGlobal(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the objects a DCP metadata file holds: any other class or function (``os.system``,
    ``builtins.eval``, ...) stops the read before it can be called."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")


def read_dcp_metadata(checkpoint: Path) -> dcp_metadata.Metadata:
    """The DCP ``Metadata`` of ``checkpoint``, read without running code from the file, its data files
    checked to lie inside the folder; ValueError (one line) for a crafted, damaged or missing file."""
    path = checkpoint / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _RefusedGlobal as e:
        raise ValueError(f"checkpoint {checkpoint} refused: its {DCP_METADATA} asks to build {e}, which DCP "
                         f"metadata never holds (a crafted file that would run code); nothing was loaded") from None
    except FileNotFoundError:
        raise ValueError(f"checkpoint {checkpoint} is incomplete: {DCP_METADATA} is missing; resume from another "
                         f"checkpoint") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways; each is one line
        raise ValueError(f"checkpoint {checkpoint} is damaged: {DCP_METADATA} is unreadable "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(storage, dict):
        raise ValueError(f"checkpoint {checkpoint} is damaged: {DCP_METADATA} does not hold DCP metadata")
    for info in storage.values():
        if not isinstance(info, _StorageInfo):
            raise ValueError(f"checkpoint {checkpoint} is damaged: {DCP_METADATA} does not hold DCP metadata")
        contained(checkpoint, info.relative_path, path)
    return metadata


class _CheckedReader(FileSystemReader):
    """DCP's file reader, handed metadata that ``read_dcp_metadata`` has already read and checked, so DCP
    never unpickles ``.metadata`` itself (nor its per-rank fallback)."""

    def __init__(self, checkpoint: Path, metadata: dcp_metadata.Metadata):
        super().__init__(str(checkpoint))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, reading the values it stores as bytes (the step counter) with ``weights_only=True``
    instead of an unrestricted ``torch.load``."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _from_dcp(record: logging.LogRecord) -> bool:
    return "torch/distributed/checkpoint" in record.pathname.replace(os.sep, "/")


@contextlib.contextmanager
def _quiet_dcp():
    """DCP logs every failure with its traceback (on the root logger) before raising; the raised error becomes
    torchtsp's one line, so those records are dropped while DCP runs."""
    root = logging.getLogger()
    drop = lambda record: not _from_dcp(record)
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)
