"""Generated data sets on disk: the ``GENERATED.json`` marker, the cache check, atomic replacement.

Every generator writes its data set into a hidden staging folder next to
``root``, ending with a ``GENERATED.json`` marker that says plainly the data
are generated and records the generator, its version, every parameter (and
optionally the files written) and a one-line ``description`` for result
tables. The staging folder is then swapped in with renames, so ``root`` never
holds a half-written data set, and a folder that is not the same
generator's output is never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medfed.errors import DataError

MARKER = "GENERATED.json"


def read_marker(root: str | Path) -> dict[str, Any] | None:
    """The marker's JSON object, or None if there is none or it is not a readable JSON object."""
    marker = Path(root) / MARKER
    try:
        record = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def describe_generated(root: str | Path) -> str | None:
    """The marker's one-line ``description``; None when ``root`` holds no generated data set.

    Raises:
        DataError: a marker exists but is unreadable or has no "description".
    """
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    record = read_marker(root)
    if record is None or not isinstance(record.get("description"), str):
        raise DataError(f"{marker}: expected a JSON object with a 'description' string")
    return record["description"]


def is_cached(root: str | Path, generator: str, version: int, parameters: dict[str, Any]) -> bool:
    """True if ``root`` holds ``generator``'s output for exactly these parameters, every listed file present."""
    root = Path(root)
    record = read_marker(root)
    return (
        record is not None
        and record.get("generator") == generator
        and record.get("generator_version") == version
        and record.get("parameters") == parameters
        and all((root / name).is_file() for name in record.get("files", []))
    )


def write_marker(folder: Path, generator: str, version: int, parameters: dict[str, Any], description: str, **details: Any) -> None:
    """Write the marker into the staging ``folder`` (the last file a generator writes)."""
    record = {
        "generated": True,
        "description": description,
        "generator": generator,
        "generator_version": version,
        "parameters": parameters,
        **details,
    }
    (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")


def write_atomically(root: str | Path, generator: str, write: Callable[[Path], None]) -> Path:
    """Run ``write(staging_folder)`` and swap the result in at ``root``.

    Args:
        root: the data set's folder; may be missing, empty, or an earlier
            output of ``generator``.
        generator: the generator's name, as recorded in markers.
        write: fills the staging folder, ending with :func:`write_marker`.

    Raises:
        DataError: ``root`` exists, is not empty, and is not ``generator``'s output.
    """
    root = Path(root)
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):
        record = read_marker(root)
        if record is None or record.get("generator") != generator:
            raise DataError(f"{root}: exists and is not a data set written by {generator}; refusing to replace it (choose another root or remove it)")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
    try:
        staging.chmod(0o755)
        write(staging)
        if root.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
            os.rename(root, retired / root.name)
            os.rename(staging, root)
            shutil.rmtree(retired)
        else:
            os.rename(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only left behind when writing failed
    return root
