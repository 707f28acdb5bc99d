"""Checkpoints written atomically at the end of every round.

The loop's whole state (every site's module, optimiser and RNG, the
strategy's server state, the links' known values, residuals and byte counters, the
history) goes to a temporary file through Fabric and is renamed over
``last.ckpt`` only once complete, so an interruption at any moment leaves
either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric

from medfed.errors import ConfigError

CHECKPOINT_NAME = "last.ckpt"


def save_atomic(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` to ``path`` via a temporary sibling file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fabric.save(tmp, state)
    os.replace(tmp, path)


def load_checkpoint(fabric: Fabric, path: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_atomic`."""
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path} (was the run started with this output_dir?)")
    return fabric.load(path)


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (``trainer.rounds`` excepted)."""
    differences = []
    for key in sorted(set(saved) | set(current)):
        full = f"{prefix}{key}"
        if full == "trainer.rounds":
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differences += config_differences(a, b, f"{full}.")
        elif a != b:
            differences.append(full)
    return differences
