"""Checks and output shared by ``plan`` and ``plan --pp``: bounds every search by the arithmetic, not by the GPU
count, and keeps ``--json`` strict JSON. Torch-free."""

from __future__ import annotations

import json
import math

MAX_GPUS = 2**20  # the planner enumerates every factorization: beyond this the table would be unreadable anyway


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending, by trial division up to sqrt(n) (n <= MAX_GPUS: at most 1024 steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def axis_splits(n: int, axes: tuple[str, ...]):
    """Every way to give ``n`` ranks to ``axes`` with each axis at least 2 (one axis: just n), the first axis's
    share descending."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in reversed(divisors(n)):
        if 1 < d < n:
            for rest in axis_splits(n // d, axes[1:]):
                if all(v > 1 for v in rest.values()):
                    yield {axes[0]: d, **rest}


def check_gpus(gpus: int, flag: str = "--gpus") -> None:
    if gpus < 1:
        raise ValueError(f"{flag} must be positive, got {gpus}")
    if gpus > MAX_GPUS:
        raise ValueError(f"{flag} must be at most {MAX_GPUS} (the planner compares every layout of them), "
                         f"got {gpus}")


def check_gpu_mem(gpu_mem: float) -> None:
    if not 0 < gpu_mem < float("inf"):  # NaN fails every comparison
        raise ValueError(f"--gpu-mem must be positive, got {gpu_mem}")


def dumps(data: dict) -> str:
    """Strict JSON: a NaN or infinity anywhere is a bug to report, never the non-JSON tokens NaN/Infinity."""
    return json.dumps(data, indent=1, allow_nan=False)
