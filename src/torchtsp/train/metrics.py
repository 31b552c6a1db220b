"""What a run records: metrics.jsonl (and TensorBoard scalars), the budget of non-finite steps, a profiler window."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: metrics.jsonl writes them as null."""
    return value if math.isfinite(value) else None


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


class MetricsLog:
    """Rank 0's metrics.jsonl, plus TensorBoard scalars under ``out/tensorboard`` when asked.

    A fresh run starts the file anew; a resumed run keeps the steps up to its checkpoint (the checkpoint is the
    truth: lines past its step are cut, damaged lines from a crash mid-write are dropped).
    """

    def __init__(self, out: Path, resume_step: int | None, tensorboard: bool):
        self.out = out
        path = out / "metrics.jsonl"
        kept, damaged = [], 0
        if resume_step is not None and path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    damaged += bool(line.strip())
        if damaged:
            tqdm.write(f"torchtsp: dropped {damaged} damaged line(s) of {path}", file=sys.stderr)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        self.file = path.open("a")
        self.board = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            from .checkpoint import disk_error

            raise disk_error(e, self.out) from None
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.board.add_scalar(f"train/{key}" if not key.startswith("eval") else f"eval/{key}", value,
                                          record["step"])
            self.board.flush()

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


class NonFiniteBudget:
    """Up to ``allowed`` steps with a non-finite loss or gradient norm are skipped; one more stops the run."""

    def __init__(self, allowed: int, announce: bool):
        self.allowed, self.announce, self.skipped = allowed, announce, 0

    def charge(self, step: int, loss: float, norm: float) -> None:
        self.skipped += 1
        if self.skipped > self.allowed:
            budget = f"{self.skipped - 1} skipped already, --skip-nonfinite {self.allowed}" if self.allowed \
                else "pass --skip-nonfinite N to skip up to N such steps"
            raise ValueError(f"step {step}: non-finite loss ({loss}) or gradient norm ({norm}); the step was not "
                             f"applied and no checkpoint was written; lower --lr ({budget})")
        if self.announce:
            tqdm.write(f"torchtsp: step {step} skipped: non-finite loss ({loss}) or gradient norm ({norm}); "
                       f"{self.skipped}/{self.allowed} of the budget used", file=sys.stderr)


def parse_step_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), steps counted from 1 as in metrics.jsonl, A <= B."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError(f"profile_steps (--profile-steps) must be A:B (steps, e.g. 3:5), got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"profile_steps (--profile-steps) must be A:B with 1 <= A <= B, got {text!r}")
    return a, b


class ProfileWindow:
    """A torch.profiler trace of steps A..B (1-based), one Chrome trace per rank: out/profile/rank{R}.json
    (open it in https://ui.perfetto.dev or chrome://tracing)."""

    def __init__(self, steps: str | None, out: Path, rank: int):
        self.range = parse_step_range(steps) if steps else None
        self.path = out / "profile" / f"rank{rank}.json"
        self.profiler = None

    def before(self, step: int) -> None:
        """Called before running step ``step`` (1-based)."""
        if self.range and step == self.range[0] and self.profiler is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is not None and step >= self.range[1]:
            self.finish()

    def finish(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
