"""The run's folder: its problems found before any data is read, and an ``--overwrite`` that loses nothing.

A run writes only inside ``output_dir`` (``config.json``, ``results.json``,
figures, ``checkpoints/``, ``csv/``, ``wandb/``) and records no path to it, so
a run folder can be moved and still be resumed.

:func:`check_output_dir` runs right after the config is checked: ``output_dir``
(or the nearest existing folder above it) must be a folder this user can
write in, and an earlier run in it is never touched unless ``--resume``
continues it or ``--overwrite`` replaces it.

``--overwrite`` renames the earlier run to ``<output_dir>.previous`` in one
atomic step (:func:`start_run`, just before the new run writes its first
file) and deletes that folder when a run in ``output_dir`` finishes
(:func:`finish_run`). An interrupted overwrite thus leaves the earlier run
whole in ``<output_dir>.previous`` and only the new run's files in
``output_dir``, never a mixture.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from medfed.atomic import TEMPORARY_SUFFIX, remove_stale_temporaries
from medfed.checkpoint import FOLDER, checkpoints
from medfed.errors import ConfigError

RUN_ENTRIES = frozenset({"config.json", "results.json", FOLDER, "csv", "wandb"})
"""What a run writes into ``output_dir``, besides its ``*.png`` figures and hidden temporary files."""


def previous_run(output_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the earlier run until the new one finishes: ``<output_dir>.previous``."""
    return output_dir.with_name(output_dir.name + ".previous")


def holds_run(output_dir: Path) -> bool:
    """True if ``output_dir`` holds a finished run (``results.json``) or one with a checkpoint to resume."""
    return (output_dir / "results.json").exists() or bool(checkpoints(output_dir / FOLDER))


def lock_file(output_dir: Path) -> Path:
    """The lock :func:`hold_output_dir` takes: ``<output_dir>.lock``, beside the folder."""
    return output_dir.with_name(output_dir.name + ".lock")


@contextmanager
def hold_output_dir(output_dir: Path, key: str | None = None, owner: str = "run", instead: str = "choose another output_dir") -> Iterator[None]:
    """Hold ``output_dir`` for this process while the block runs (the lock file is deleted at the end).

    ``key`` names the folder in messages (default: the config's ``output_dir``; a deployment's is a run config key);
    ``owner`` says what holds it (a ``run``, a ``compare``) and ``instead`` what else to do than wait.

    Raises:
        ConfigError: another living process holds it (the message names its
            pid, host and start time), the folder above cannot be created, or
            the lock is not a regular file of this user (a link planted there).
    """
    key = key or f"config key 'output_dir' = {str(output_dir)!r}"
    path = lock_file(output_dir)
    _check_writable(path.parent, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = _lock(path, key, owner, instead)
    except OSError as error:
        raise ConfigError(f"{key}: cannot create its lock file {path} ({error.strerror})") from None
    try:
        yield
    finally:
        try:
            named, held = os.lstat(path), os.fstat(descriptor)
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):  # never another entry put in its place
                os.unlink(path)  # while locked: a run waiting on this file finds it gone and locks a new one
        except FileNotFoundError:
            pass
        os.close(descriptor)


def _lock(path: Path, key: str, owner: str, instead: str) -> int:
    """An open descriptor of ``path`` holding its exclusive lock, the holder written in it.

    The lock is opened without following a link (``O_NOFOLLOW``) and used only if it is a regular
    file of this user with no other name: a lock planted as a symbolic or hard link to another
    file, a device or a pipe is refused, so a run never truncates or creates a file elsewhere.
    """
    while True:
        _check_lock_entry(path, key)
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:  # became a link after the check
                raise ConfigError(_NOT_A_LOCK.format(key=key, path=path, what="a symbolic link")) from None
            raise
        try:
            _check_lock_file(os.fstat(descriptor), path, key)
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise ConfigError(f"{key} is being written by another {owner} ({holder}); wait for it to end, or {instead}") from None
        except BaseException:
            os.close(descriptor)
            raise
        try:
            named, opened = os.lstat(path), os.fstat(descriptor)
            current = (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
        except FileNotFoundError:
            current = False
        if current:  # not a file its last holder deleted after we opened it
            break
        os.close(descriptor)
    stale = _holder(descriptor)
    if stale != "holder unknown":
        logging.getLogger("medfed").info(f"took over the lock on {path.with_suffix('')} of a run that is no longer running ({stale})")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(record).encode(), 0)
    return descriptor


_NOT_A_LOCK = "{key}: its lock file {path} is {what}, not a lock a run wrote; nothing was written through it: delete it and run again"


def _check_lock_entry(path: Path, key: str) -> None:
    """``path`` does not exist, or is what :func:`_check_lock_file` accepts (checked by name, without following a link)."""
    try:
        entry = os.lstat(path)
    except FileNotFoundError:
        return
    _check_lock_file(entry, path, key)


def _check_lock_file(entry: os.stat_result, path: Path, key: str) -> None:
    """Refuse a lock that is not a regular file of this user with exactly one name."""
    if stat.S_ISLNK(entry.st_mode):
        what = "a symbolic link"
    elif not stat.S_ISREG(entry.st_mode):
        what = "not a regular file"
    elif entry.st_uid != os.geteuid():
        what = f"owned by another user (uid {entry.st_uid})"
    elif entry.st_nlink != 1:
        what = f"a file with {entry.st_nlink} names (a hard link)"
    else:
        return
    raise ConfigError(_NOT_A_LOCK.format(key=key, path=path, what=what))


def _holder(descriptor: int) -> str:
    """``pid 123 on host h, started <UTC time>`` from a lock file's record."""
    try:
        record = json.loads(os.pread(descriptor, 4096, 0))
        return f"pid {int(record['pid'])} on host {record['host']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def check_output_dir(output_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Every problem with ``output_dir`` as a one-line ConfigError, before any data is read or anything written.

    Raises:
        ConfigError: ``output_dir`` (or a folder above it) is a file or not
            writable; it holds a run and neither ``resume`` nor ``overwrite``
            is set; ``--overwrite`` would have to replace files no run
            writes, or an unfinished ``--overwrite`` left two runs.
    """
    key = f"config key 'output_dir' = {str(output_dir)!r}"
    if resume and overwrite:
        raise ConfigError("--resume continues the run in output_dir and --overwrite replaces it: pass only one")
    _check_writable(output_dir, key)
    if not holds_run(output_dir):
        return
    if not (resume or overwrite):
        raise ConfigError(f"{key} already holds a run; pass --resume to continue it, --overwrite to replace it, or choose another output_dir")
    if overwrite:
        previous = previous_run(output_dir)
        if previous.exists():
            raise ConfigError(
                f"{key} holds the unfinished run of an interrupted --overwrite and {previous} the run it replaces: "
                "continue the new run with --resume, or delete one of the two folders"
            )
        foreign = _foreign_entries(output_dir)
        if foreign:
            raise ConfigError(
                f"{key} also holds {foreign[0]!r}, which no run writes; --overwrite moves the whole folder aside: "
                "move such files out, or choose another output_dir"
            )
        _check_writable(output_dir.parent, key)


def start_run(output_dir: Path, overwrite: bool) -> None:
    """Before a new run writes its first file: with ``overwrite``, rename an earlier run to :func:`previous_run`.

    Temporary files a killed run left (before its first checkpoint) are deleted.
    """
    if overwrite and holds_run(output_dir):
        previous = previous_run(output_dir)
        os.rename(output_dir, previous)
        logging.getLogger("medfed").info(f"moved the earlier run in {output_dir} to {previous}; it is deleted when this run finishes")
    for folder in (output_dir, output_dir / FOLDER):
        remove_stale_temporaries(folder)


def finish_run(output_dir: Path) -> None:
    """After a run finished: delete the earlier run ``--overwrite`` moved aside, if there is one."""
    previous = previous_run(output_dir)
    if previous.is_dir() and not _foreign_entries(previous):
        shutil.rmtree(previous)


def _check_writable(folder: Path, key: str) -> None:
    """``folder``, or the nearest existing folder above it, is a folder this user can create files in."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, expected a folder (or a path that does not exist yet)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write in {existing} (permission denied); choose another output_dir")


def _foreign_entries(folder: Path) -> list[str]:
    """Names in ``folder`` that no run writes (sorted)."""
    return sorted(
        entry.name
        for entry in folder.iterdir()
        if not (entry.name in RUN_ENTRIES or entry.suffix == ".png" or (entry.name.startswith(".") and entry.name.endswith(TEMPORARY_SUFFIX)))
    )
