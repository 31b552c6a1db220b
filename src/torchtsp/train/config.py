"""Training run settings: defaults, overridden by a TOML file, overridden by command-line flags."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainConfig:
    preset: str = "tiny"
    init_from_hf: str | None = None  # HF Llama checkpoint directory to start from (overrides preset)
    scheme: str = "tsp"
    # Mesh degrees; None: not given. The scheme's own axis takes the ranks the others leave
    # (torchtsp.schemes.Scheme.degrees); axes the scheme does not use must stay 1.
    dp: int | None = None
    tsp: int | None = None
    tp: int | None = None
    sp: int | None = None
    nproc: int | None = None  # local CPU ranks to spawn when not under torchrun (default: product of degrees)
    batch_size: int = 8  # global, in sequences
    seq_len: int = 256
    steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # default: steps // 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    data: str | None = None  # text file or folder; default: the Python standard library
    out: str = "runs/latest"
    checkpoint_every: int = 0  # 0: only the final checkpoint
    resume: str | None = None  # a run folder (its latest checkpoint) or a checkpoint folder
    dtype: str = "float32"  # or bfloat16: bf16 compute, fp32 master weights and optimizer state
    recompute: bool = False
    seed: int = 0
    sample_tokens: int = 64  # greedy continuation printed after training (0: none)
    prompt: str = "def "
    timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("dp", "tsp", "tp", "sp", "batch_size", "seq_len", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.checkpoint_every < 0:
            raise ValueError("--checkpoint-every must be >= 0")

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def load_toml(path: str) -> dict:
    """Settings from a TOML file: top-level keys, or a [train] table; names as fields or as flags."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    raw = raw.get("train", raw)
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(FIELDS))}")
    return values


def build_config(file: str | None = None, **flags) -> TrainConfig:
    """Defaults < TOML file < flags given (None means 'not given')."""
    values = load_toml(file) if file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    return TrainConfig(**values)
