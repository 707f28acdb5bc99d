"""Files written whole or not at all, with the permissions a plain ``open()`` gives.

:func:`atomic_write` opens a hidden temporary sibling of the target
(``.<name>.<pid>-<random>.tmp``) and, only when the block ends without an
error, flushes it to disk and renames it over the target: a reader sees the
old file or the new one, never a torn one. The temporary file is created like
any other file (mode 0666 less the umask: 0644 under the usual umask 022),
not with :mod:`tempfile`'s 0600, so the other users of a shared folder can
read the result.

A process killed outright (SIGKILL, power loss) can still leave a temporary
file behind; :func:`remove_stale_temporaries` deletes them at the next start.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TEMPORARY_SUFFIX = ".tmp"


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", **open_options) -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; rename it over ``path`` when the block succeeds.

    Args:
        path: the file to write; its folder is created if missing.
        mode: ``"w"`` (text) or ``"wb"`` (binary).
        open_options: passed to :func:`open` (``newline``, ``encoding``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")
    try:
        with open(temporary, mode.replace("w", "x"), **open_options) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the temporary files interrupted writes left in ``folder`` (not its subfolders); returns them.

    Only call it when no other process is writing into ``folder``.
    """
    folder = Path(folder)
    stale = sorted(folder.glob(f".*{TEMPORARY_SUFFIX}")) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
