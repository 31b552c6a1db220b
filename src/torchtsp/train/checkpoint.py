"""Training checkpoints through torch.distributed.checkpoint (DCP), in reference parameter names.

Every tensor is stored as a DTensor over the run's mesh: each rank writes its own pieces, and a
later run with another layout (another D, another scheme) reads back exactly its own pieces.
A checkpoint is written aside (``.step_N.tmp``), its files' sha256 recorded in ``meta.json``, and
published by renaming it once every rank has finished; ``latest`` is updated atomically and always
names a complete checkpoint, whatever point a crash falls on. Loading verifies the checksums.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..config import ModelConfig
from ..distributed import comm
from ..model import reference_shapes
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
                state[f"{key}/{ref}"] = comm.sharded_tensor(piece, mesh, shard_dims, shapes[ref])
    return state


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
        comm.save_checkpoint(state, str(tmp))
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
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named and named.startswith(".") and named.endswith(".tmp") and (root / named / META).is_file():
        publish(root, named[1:-len(".tmp")])
        named = named[1:-len(".tmp")]
    for leftover in root.glob(".*"):
        if leftover.is_dir() and leftover.name != named:
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.name == f".{LATEST}.tmp":
            leftover.unlink()


def point_latest(root: Path, name: str) -> None:
    pointer = root / f".{LATEST}.tmp"
    write_file(pointer, name)
    os.replace(pointer, root / LATEST)


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints (never the one ``latest`` names)."""
    named = (root / LATEST).read_text().strip()
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
    files = sorted(meta.get("files", {}).items())  # checkpoints written before checksums carry none
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
    for latest in (p / "checkpoints" / LATEST, p / LATEST):
        if latest.is_file():
            p = latest.parent / latest.read_text().strip()
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


def check_model_matches(meta: dict, cfg: ModelConfig, checkpoint: Path) -> None:
    saved = meta.get("model", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in cfg.to_dict().items()
             if k != "max_seq_len" and saved.get(k) != v]
    if diffs:
        raise ValueError(f"checkpoint {checkpoint} holds a different model shape ({'; '.join(diffs)}); "
                         f"resume with the same model settings")


def restore_optimizer_steps(optimizer, state: dict) -> None:
    """After ``load``: every parameter's AdamW step count is the stored one."""
    for moments in optimizer.state.values():
        moments["step"].copy_(state["optim/step"])


def _load_tensors(checkpoint: Path, state: dict) -> None:
    """DCP load into ``state`` in place (resharding); a failure is one ValueError naming the checkpoint."""
    try:
        comm.load_checkpoint(state, str(checkpoint))
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
        super().__init__(ModelConfig.from_dict(meta["model"]))

    def _read(self, name, shape, dim, start, stop):
        full = torch.empty(shape)
        with warnings.catch_warnings():  # DCP warns that it runs without a process group, as intended here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            _load_tensors(self.checkpoint, {f"model/{name}": full})
        return full.narrow(dim, start, stop - start)
