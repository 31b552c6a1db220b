"""Training run settings: defaults, overridden by a TOML file, overridden by command-line flags.

Every value is checked here, whatever its source: a wrong type or a value outside its domain is
one ``ValueError`` naming the setting, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

from ..presets import PRESETS
from ..recompute import recompute_policy
from ..runenv import launched_by_torchrun
from ..schemes import PIPELINE_SCHEDULES, SCHEMES
from ..timeouts import COLLECTIVE_TIMEOUT_S

# ZeRO-2 by default: the same bytes and float operations as ZeRO-1 (both reduce each backward pass as it ends),
# and less memory (README, "Distributed optimizer").
ZERO_DEFAULT = 2


@dataclass
class TrainConfig:
    preset: str = "tiny"
    init_from_hf: str | None = None  # HF checkpoint directory (any family torchtsp.hf reads) to start from
    scheme: str = "tsp"
    # Mesh degrees; None: not given. The scheme's own axis takes the ranks the others leave
    # (torchtsp.schemes.Scheme.degrees); axes the scheme does not use must stay 1.
    dp: int | None = None
    tsp: int | None = None
    tp: int | None = None
    sp: int | None = None
    pp: int = 1  # pipeline stages (outermost mesh axis); each stage is the scheme's model of contiguous layers
    microbatches: int | None = None  # per data-parallel replica and step (default: the number of stages)
    schedule: str = "1f1b"  # pipeline schedule: gpipe, 1f1b or interleaved_1f1b
    nproc: int | None = None  # local CPU ranks to spawn when not under torchrun (default: product of degrees)
    batch_size: int = 8  # global, in sequences
    seq_len: int = 256
    steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # default: steps // 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    skip_nonfinite: int = 0  # steps with a non-finite loss or gradient norm that may be skipped before failing
    data: str | None = None  # a dataset or a blend (torchtsp.data.sources); default: the Python standard library
    tokenizer: str | None = None  # folder of the model's tokenizer.json (default: --init-from-hf's, else bytes)
    # A preset's vocabulary (rows of the embedding and the head). None: the preset's own with the byte tokenizer,
    # else the tokenizer's size rounded up (preset_vocab_size). A checkpoint's vocabulary is its own.
    vocab_size: int | None = None
    eval_data: str | None = None  # evaluation dataset (same forms as data)
    eval_every: int = 0  # evaluate every N steps (0: only at the end, when eval_data is given)
    eval_batches: int | None = None  # batches per evaluation (default: the whole eval set, capped)
    grad_accum: int = 1  # micro-batches per optimizer step; the global batch is split into them
    # Attend within documents of packed samples (a document ends after its EOS; a chat dataset's are its
    # conversations). None: on for chat datasets, off for token streams.
    document_mask: bool | None = None
    # Chat datasets: conversations longer than this are skipped (None: those longer than seq_len are split).
    max_conversation_tokens: int | None = None
    tensorboard: bool = False  # also write the metrics as TensorBoard scalars under out/tensorboard
    profile_steps: str | None = None  # "A:B": a torch.profiler trace of steps A..B per rank under out/profile
    out: str | None = None  # default: the --resume run folder, else a new runs/<UTC time>-<scheme> (new_run_folder)
    overwrite: bool = False  # replace the run already in `out` (its metrics and checkpoints)
    checkpoint_every: int = 0  # 0: only the final checkpoint
    keep_last: int | None = None  # keep only the newest N checkpoints (default: all)
    resume: str | None = None  # a run folder (its latest checkpoint) or a checkpoint folder
    reset_data: bool = False  # a resumed run reads its (other) data from the start instead of the saved position
    dtype: str = "float32"  # or bfloat16: bf16 compute, fp32 master weights and optimizer state
    # Distributed optimizer over dp (train/zero.py): 0 replicates AdamW state on every replica; 1 shards it (and
    # the fp32 masters) 1/dp; 2 also frees gradients outside the owned chunk; 3 is FSDP2 (train/fsdp.py: weights
    # too). None: ZERO_DEFAULT where the scheme supports it, else 0. Without data parallelism (dp = 1) it changes
    # nothing.
    zero: int | None = None
    zero_bucket_mb: float = 32.0  # float32 gradient bucket of one reduce-scatter (all dp rows together)
    reshard_after_forward: bool = True  # --zero 3: free the gathered weights after forward, gather them again
    cpu_offload: bool = False  # --zero 3: sharded weights, gradients and AdamW state in host memory (a GPU run)
    recompute: str = "none"  # a recompute.POLICIES name; a bool (configs and runs from before) reads as full/none
    compile: bool = False  # torch.compile each block's math, collectives eager (torchtsp.compiled)
    seed: int = 0
    sample_tokens: int = 64  # continuation printed after training, sampled (temperature 0.8, top-k 40); 0: none
    prompt: str = "def "
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    # Also measure the live-tensor peak every N steps. 0: only the first step and the first with optimizer state,
    # which hold the run's peak (later steps repeat them); a measured step costs 2-3x an unmeasured one (MemTracker).
    mem_every: int = 0

    def __post_init__(self):
        self.recompute = recompute_policy(self.recompute)
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked_type(f.name, getattr(self, f.name), hints[f.name]))
        at_least = {"dp": 1, "tp": 1, "sp": 1, "tsp": 1, "pp": 1, "microbatches": 1, "nproc": 1,
                     "batch_size": 1, "seq_len": 1, "steps": 1, "vocab_size": 1,
                    "warmup_steps": 0, "skip_nonfinite": 0, "checkpoint_every": 0, "keep_last": 1,
                    "sample_tokens": 0, "mem_every": 0, "seed": 0, "eval_every": 0, "eval_batches": 1,
                    "grad_accum": 1, "max_conversation_tokens": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{_name(name)} must be >= {low}, got {value}")
        for name in ("lr", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_name(name)} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ValueError(f"{_name('zero')} must be 0, 1, 2 or 3, got {self.zero}")
        if self.zero != 3 and (self.cpu_offload or not self.reshard_after_forward):
            flag = _name("cpu_offload") if self.cpu_offload else "--no-reshard-after-forward"
            raise ValueError(f"{flag} applies to FSDP2: give --zero 3 (and dp > 1)")
        if self.zero == 3 and self.pp > 1:
            raise ValueError("--zero 3 (FSDP2) with --pp is not supported: a pipeline stage runs forward and backward "
                             "in one schedule; use --zero 2 with --pp")
        if self.zero_bucket_mb <= 0:
            raise ValueError(f"{_name('zero_bucket_mb')} must be > 0, got {self.zero_bucket_mb}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{_name('min_lr_ratio')} must lie in [0, 1], got {self.min_lr_ratio}")
        for name, choices in (("dtype", ("float32", "bfloat16")), ("scheme", tuple(SCHEMES)),
                              ("schedule", PIPELINE_SCHEDULES),
                              ("preset", tuple(PRESETS))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{_name(name)} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.zero and not SCHEMES[self.scheme].zero:
            raise ValueError(f"{_name('zero')} {self.zero}: scheme {self.scheme!r} has no distributed optimizer over "
                             f"dp (its parameters are DTensors); use --zero 0 or another scheme")
        if self.vocab_size is not None and self.init_from_hf:
            raise ValueError(f"{_name('vocab_size')} applies to presets trained from scratch; the checkpoint of "
                             f"--init-from-hf {self.init_from_hf} fixes the vocabulary: drop --vocab-size")
        if self.microbatches is not None and self.pp == 1:
            raise ValueError(f"{_name('microbatches')} applies to pipeline stages; give --pp N (N >= 2) or drop it")
        if self.eval_every and not self.eval_data:
            raise ValueError(f"{_name('eval_every')} needs {_name('eval_data')}: give the evaluation dataset")
        if self.eval_batches is not None and not self.eval_data:
            raise ValueError(f"{_name('eval_batches')} needs {_name('eval_data')}: give the evaluation dataset")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"{_name('grad_accum')} {self.grad_accum} does not divide the batch "
                             f"(--batch-size {self.batch_size}) into equal micro-batches")
        if self.profile_steps is not None:
            from .metrics import parse_step_range

            parse_step_range(self.profile_steps)
        if self.reset_data and not self.resume:
            raise ValueError(f"{_name('reset_data')} applies to a resumed run; give --resume RUN")
        if self.out is None:  # a resumed run continues in its own folder unless told otherwise
            self.out = str(run_folder_of(self.resume)) if self.resume else str(new_run_folder(self.scheme))
        _check_run_folder(self.out)

    def zero_level(self, dp: int) -> int:
        """The distributed optimizer's level on ``dp`` replicas (0 without data parallelism)."""
        if dp == 1:
            return 0
        if self.zero is None:
            return ZERO_DEFAULT if SCHEMES[self.scheme].zero else 0
        return self.zero

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def _name(field: str) -> str:
    return f"{field} (--{field.replace('_', '-')})"


def _checked_type(name: str, value, hint):
    """``value`` as the field's type: ints stay ints (64.0 is refused), floats accept ints and must be finite,
    booleans must be booleans (the string "false" is refused, not read as true)."""
    kinds = typing.get_args(hint) or (hint,)
    if value is None:
        if type(None) in kinds:
            return None
        raise ValueError(f"{_name(name)} must be set, got nothing")
    kind = next(k for k in kinds if k is not type(None))
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{_name(name)} must be a finite number, got {value}")
    else:
        ok = isinstance(value, kind)
    if not ok:
        what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise ValueError(f"{_name(name)} must be {what}, got {value!r} ({type(value).__name__})")
    if name in _PATH_FIELDS and not value.strip():  # Path("") is the current folder, never what was meant
        raise ValueError(f"{_name(name)} is an empty path; give one or leave the setting out (an unset variable?)")
    return value


_PATH_FIELDS = frozenset({"init_from_hf", "data", "tokenizer", "eval_data", "out", "resume"})


def _check_run_folder(out: str) -> None:
    """``out`` can be (or become) a folder: neither it nor the nearest existing folder above it is a file."""
    path = Path(out)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise ValueError(f"{_name('out')}: {out} {where}; give a folder for the run (it is created if missing)")


# Runs without --out: each its own folder under runs/, and runs/latest a link to the newest, so that a second run
# never collides with the first and `--resume runs/latest` / `convert runs/latest` name the last one.
RUNS = Path("runs")
LATEST_RUN = RUNS / "latest"
_DEFAULT_RUN_NAME = re.compile(r"\d{8}-\d{6}-[a-z_]+(-\d+)?")


def new_run_folder(scheme: str) -> Path:
    """``runs/<UTC time>-<scheme>`` (``-2``, ``-3``, ... if a run of the same second has it). Under torchrun every
    rank builds its own settings, and their clocks need not agree on the second: there it stays ``runs/latest``,
    a plain folder, as before (give --out to keep several)."""
    if launched_by_torchrun():
        return LATEST_RUN
    base = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{scheme}"
    folder, n = RUNS / base, 1
    while folder.exists() or folder.is_symlink():
        n += 1
        folder = RUNS / f"{base}-{n}"
    return folder


def is_new_run_folder(out: str | Path) -> bool:
    """Whether ``out`` is a name ``new_run_folder`` gives (runs/latest then points at it)."""
    out = Path(out)
    return out.parent == RUNS and _DEFAULT_RUN_NAME.fullmatch(out.name) is not None


def point_latest_run(out: str | Path) -> str | None:
    """Point ``runs/latest`` at the run folder ``out`` (a relative link, replaced atomically); the reason when it
    cannot be, for a notice: an older runs/latest that is a real folder is left alone."""
    if LATEST_RUN.exists() and not LATEST_RUN.is_symlink():
        return (f"{LATEST_RUN} is the folder of an earlier run, so it was left as it is and does not point at "
                f"{out}; move it away (e.g. to runs/previous) to have {LATEST_RUN} follow the newest run")
    staged = RUNS / f".latest.{os.getpid()}"
    try:
        staged.unlink(missing_ok=True)
        os.symlink(Path(out).name, staged, target_is_directory=True)
        os.replace(staged, LATEST_RUN)
    except OSError as e:
        return f"could not point {LATEST_RUN} at {out} ({e.strerror or e}); name the run folder itself"
    return None


def run_folder_of(resume: str) -> Path:
    """The run folder a resume path belongs to: the folder itself, or the run of a ``checkpoints/step_N`` folder.
    A link (runs/latest) is followed now, so that the resumed run keeps writing to the folder it named even when
    a newer run moves the link."""
    p = Path(resume)
    if p.parent.name == "checkpoints" and not (p / "checkpoints").exists():
        p = p.parent.parent
    return p.parent / os.readlink(p) if p.is_symlink() and not Path(os.readlink(p)).is_absolute() else p


def load_toml(path: str) -> dict:
    """Settings from a TOML file: top-level keys, or a [train] table; names as fields or as flags."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    if "train" in raw:
        outside = sorted(k for k in raw if k != "train")
        if outside:  # a [train] table holds every setting: anything beside it would be silently ignored
            raise ValueError(f"config file {path}: {', '.join(outside)} outside the [train] table would be "
                             f"ignored; move the settings into [train] or remove them")
        raw = raw["train"]
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path}: [train] must be a table of settings")
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        tables = [k for k in unknown if isinstance(values[k], dict)]
        what = f"unknown table(s) {', '.join(tables)} and " if tables else ""
        keys = [k for k in unknown if k not in tables]
        what += f"unknown setting(s) {', '.join(keys)}" if keys else ""
        raise ValueError(f"config file {path}: {what.removesuffix(' and ')}; known settings: "
                         f"{', '.join(sorted(FIELDS))}")
    return values


# Settings a resumed run never takes from the run it continues: where it writes and how it starts.
NOT_RESTORED = ("resume", "out", "overwrite", "reset_data")
# The mesh is restored whole or not at all: a run resumed under another scheme or degree names its own, and a
# saved degree of the old scheme's axis must not leak into it.
MESH_SETTINGS = ("scheme", "dp", "tsp", "tp", "sp", "pp", "microbatches", "schedule", "nproc", "zero",
                 "zero_bucket_mb", "reshard_after_forward", "cpu_offload")


def build_config(file: str | None = None, **flags) -> TrainConfig:
    """Defaults < the resumed run's saved settings < TOML file < flags given (None means 'not given')."""
    given = load_toml(file) if file else {}
    given.update({k: v for k, v in flags.items() if v is not None})
    values = saved_settings(given["resume"], given) if given.get("resume") else {}
    values.update(given)
    return TrainConfig(**values)


def saved_settings(resume: str, given: dict) -> dict:
    """The settings ``resume``'s run was trained with, less those ``given`` replaces (reported on stderr), so
    that ``--resume RUN`` alone continues that very run: its ranks, data, evaluation, masking, schedule."""
    from .checkpoint import read_meta, resolve

    saved = read_meta(resolve(resume)).get("train") or {}
    saved = {k: v for k, v in saved.items() if k in FIELDS and k not in NOT_RESTORED}
    if any(k in given for k in MESH_SETTINGS):
        saved = {k: v for k, v in saved.items() if k not in MESH_SETTINGS}
    changed = [f"{_flag(k)} {given[k]!r} (saved {saved[k]!r})" for k in sorted(given)
               if k in saved and given[k] != saved[k]]
    if changed and os.environ.get("RANK", "0") == "0":
        print(f"torchtsp: resuming {resume} with its saved settings, except: {'; '.join(changed)}",
              file=sys.stderr)
    return saved


def _flag(field: str) -> str:
    return f"--{field.replace('_', '-')}"
