"""Generated data sets on disk: the ``GENERATED.json`` marker, the cache check, locked atomic replacement.

Every generator writes its data set into a hidden staging folder next to
``root`` (``.<root name>.partial``), ending with a ``GENERATED.json`` marker
that says plainly the data are generated and records the generator, its
version, every parameter (and optionally the files written) and a one-line
``description`` for result tables. The staging folder is then swapped in
with renames, so ``root`` never holds a half-written data set, and a folder
that is not the same generator's output is never replaced.

Runs side by side share a ``root`` through a lock file next to it
(``.<root name>.lock``, :func:`fcntl.flock`, so POSIX only): :func:`hold`
keeps a shared lock while a run reads the data set, and a data set is
replaced only under the exclusive lock, after every reader is done. Two runs
asking for different parameters (say ``cases_per_site``) thus take turns
instead of swapping the data under each other. Either lock also means no
generator is at work, so staging folders a killed generator left behind are
removed then. Folders and files are created with the permissions a plain
``mkdir``/``open`` gives (0755/0644 under umask 022), never 0700/0600.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def hold(root: str | Path, generator: str, version: int, parameters: dict[str, Any], write: Callable[[Path], None]) -> Iterator[Path]:
    """``root`` holding ``generator``'s output for ``parameters``, written first unless it is there; unchanged until the block ends.

    Args:
        root: the data set's folder; may be missing, empty, or an earlier
            output of ``generator`` (replaced if its parameters differ).
        generator: the generator's name, as recorded in markers.
        version: the generator's version, as recorded in markers.
        parameters: every parameter, as recorded in markers.
        write: fills a staging folder, ending with :func:`write_marker`.

    Raises:
        DataError: ``root`` exists, is not empty, and is not ``generator``'s
            output; or the lock file next to it cannot be created.
    """
    root = Path(root)
    with _Lock(root) as lock:
        while True:
            lock.acquire(shared=True)
            _remove_stale_staging(root)
            if is_cached(root, generator, version, parameters):
                yield root
                return
            lock.acquire(shared=False)  # waits until every run reading the data set there now is done
            if not is_cached(root, generator, version, parameters):  # another run may have written it meanwhile
                _replace(root, generator, write)


def _replace(root: Path, generator: str, write: Callable[[Path], None]) -> None:
    """Run ``write(staging_folder)`` and swap the result in at ``root`` (under the exclusive lock)."""
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):
        record = read_marker(root)
        if record is None or record.get("generator") != generator:
            raise DataError(f"{root}: exists and is not a data set written by {generator}; refusing to replace it (choose another root or remove it)")
    staging = _staging(root, "partial")
    staging.mkdir()
    try:
        write(staging)
        if root.exists():
            retired = _staging(root, "old")
            os.rename(root, retired)
            os.rename(staging, root)
            shutil.rmtree(retired)
        else:
            os.rename(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only left behind when writing failed


def _staging(root: Path, kind: str) -> Path:
    """The hidden sibling of ``root`` where a data set is written (``partial``) or retired (``old``)."""
    return root.with_name(f".{root.name}.{kind}")


def _remove_stale_staging(root: Path) -> None:
    """Delete the staging folders an interrupted generator left (also older medfed's ``.partial-*``); needs a lock."""
    for kind in ("partial", "old"):
        for stale in root.parent.glob(f"{glob.escape(_staging(root, kind).name)}*"):
            shutil.rmtree(stale, ignore_errors=True)


class _Lock:
    """The lock file guarding ``root``, taken shared or exclusive, released when the ``with`` block ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root.with_name(f".{root.name}.lock")

    def __enter__(self) -> _Lock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.descriptor = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError as error:
            raise DataError(f"{self.path}: cannot create the lock file guarding {self.root} ({error.strerror})") from None
        return self

    def acquire(self, shared: bool) -> None:
        """Take (or convert to) the shared or the exclusive lock, saying so if another run makes it wait."""
        operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(self.descriptor, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            doing = "writing" if shared else "using"
            logging.getLogger("medfed").info(f"waiting for another medfed run {doing} the data set at {self.root}")
            fcntl.flock(self.descriptor, operation)

    def __exit__(self, *exception) -> None:
        os.close(self.descriptor)  # releases the lock
