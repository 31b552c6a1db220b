"""How this process was started (torch-free, so that the command line decides before importing torch)."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    """True under torchrun (or any launcher that sets the torch.distributed environment variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
