"""Training checkpoints through torch.distributed.checkpoint (DCP), in reference parameter names.

Every tensor is stored as a DTensor over the run's mesh: each rank writes its own pieces, and a
later run with another layout (another D, another scheme) reads back exactly its own pieces.
A checkpoint is written aside (``.step_N.tmp``) and published by renaming it once every rank has
finished, then ``latest`` is updated atomically: a crash mid-save never leaves a checkpoint that
looks valid but is not.
"""

from __future__ import annotations

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


def save(run_dir: str | Path, state: dict, meta: dict) -> Path:
    """Write ``state`` as ``run_dir/checkpoints/step_N`` (N = state's step) and point ``latest`` at it."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{state['train/step']:06d}"
    tmp, final = root / f".{name}.tmp", root / name
    if comm.global_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    comm.save_checkpoint(state, str(tmp))
    comm.barrier()
    if comm.global_rank() == 0:
        (tmp / META).write_text(json.dumps({"format": FORMAT, "version": 1, **meta}, indent=2))
        old = root / f".{name}.old"
        if final.exists():  # saving a step again (a resumed run): keep the old copy until the new one is in
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)  # publish: the folder appears complete or not at all
        shutil.rmtree(old, ignore_errors=True)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / LATEST)
    comm.barrier()
    return final


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


def load(checkpoint: Path, state: dict) -> None:
    """Fill ``state`` (from ``training_state``) in place; reshards to this run's layout."""
    try:
        comm.load_checkpoint(state, str(checkpoint))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        # DCP's messages embed every rank's traceback; their last line names the cause.
        cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise ValueError(f"checkpoint {checkpoint} could not be loaded, it looks damaged or incomplete "
                         f"({cause[0][:200]})") from None
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
        super().__init__(ModelConfig.from_dict(meta["model"]))

    def _read(self, name, shape, dim, start, stop):
        full = torch.empty(shape)
        with warnings.catch_warnings():  # DCP warns that it runs without a process group, as intended here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            try:
                comm.load_checkpoint({f"model/{name}": full}, str(self.checkpoint))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
                cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
                raise ValueError(f"checkpoint {self.checkpoint} could not be loaded, it looks damaged or "
                                 f"incomplete ({cause[0][:200]})") from None
        return full.narrow(dim, start, stop - start)
