"""Checkpoints you can trust: one file per finished round, checksummed, the newest few kept.

After every round the loop's whole state (every site's module, optimiser and
RNG, the strategy's server state, the links' known values, residuals and byte
counters, the history) and the run's config are streamed with
:func:`torch.save` into ``<output_dir>/checkpoints/round-<n>.ckpt`` through
:func:`~medfed.atomic.atomic_write`, hashed while they are written (no second
serialised copy in memory). The file ends with a fixed-size trailer holding
the SHA-256 of everything before it. Then the checkpoints older than the
newest ``trainer.keep_checkpoints`` are deleted, so an interruption at any
moment leaves complete checkpoints only, and the one before the newest is
there if the newest is damaged.

Reading checks the trailer and the digest before anything is unpickled, then
unpickles with ``weights_only=True`` (tensors, containers, numbers, strings:
a crafted file cannot run code, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
says). Every failure is one line naming the file; ``--resume`` adds which
earlier checkpoint is intact and how to continue from it.
"""

from __future__ import annotations

import copy
import hashlib
import io
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from medfed.atomic import atomic_write, remove_stale_temporaries
from medfed.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

FOLDER = "checkpoints"
"""The checkpoints' folder inside ``output_dir``."""

RESUMABLE_KEYS = ("output_dir", "trainer.rounds", "trainer.keep_checkpoints", "logger.figures")
"""Config keys a resumed run may change: the run folder may have moved, run longer, keep more or fewer checkpoints,
draw its PNGs or not."""

_NAME = re.compile(r"round-(\d+)\.ckpt")
_TRAILER_START = b"\nmedfed checkpoint sha256 "
_TRAILER_SIZE = len(_TRAILER_START) + 64 + 1  # hex digest and a newline
_CHUNK = 1 << 20


def save_checkpoint(folder: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (with its ``"round"``) as ``folder/round-<n>.ckpt`` and delete all but the newest ``keep``.

    Raises:
        DataError: the file could not be written (a full disk shows up in
            torch's zip writer as "unexpected pos"); the message names the
            file and the space left, nothing is half-written and the earlier
            checkpoints are kept.
    """
    path = folder / f"round-{state['round']}.ckpt"
    try:
        with atomic_write(path, "wb") as file:
            save_with_digest(state, file)
    except (OSError, RuntimeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip().splitlines()[0]
        free_mib = shutil.disk_usage(folder).free / 2**20
        raise DataError(
            f"checkpoint {path} could not be written ({reason}); {free_mib:.0f} MiB free on its file system; "
            "the earlier checkpoints are kept: free some space and continue with --resume"
        ) from None
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def state_on_device(state: Any, device: torch.device) -> Any:
    """``state`` (nested dicts, lists, tuples) with every floating-point tensor moved to ``device``.

    A checkpoint is read onto the CPU; a half's state goes through this before
    its ``load_state_dict``, so a resumed run on cuda computes with its
    models, duals and mixing weights where a fresh run has them. Integer and
    byte tensors (counters, generator states, indices) stay where they are:
    medfed keeps those on the CPU on purpose.
    """
    import torch  # here, as in the rest of this module: listing checkpoints needs no torch

    if isinstance(state, torch.Tensor):
        return state.to(device) if state.is_floating_point() else state
    if isinstance(state, dict):
        return {key: state_on_device(value, device) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_on_device(value, device) for value in state)
    return state


def round_checkpoints(output_dir: Path, config: dict[str, Any], keep: int) -> Callable[[dict[str, Any]], Path]:
    """The loop's ``save_checkpoint``: each round's state with ``config`` into ``output_dir``'s checkpoints' folder, the newest ``keep`` kept."""
    return lambda state: save_checkpoint(output_dir / FOLDER, {**state, "config": config}, keep)


class BackgroundCheckpoints:
    """The loop's ``save_checkpoint`` off the training path: each round's state copied, then written by a thread.

    Calling it copies the state (every tensor cloned: the loop goes on
    changing its own in place) and returns; a writer thread streams the copy
    to ``round-<n>.ckpt`` exactly as :func:`save_checkpoint` does (atomically,
    checksummed, the newest ``keep`` kept) while the next round trains. One
    write is in flight at a time: the next call, and :meth:`wait`, wait for
    it and raise the error it met (a full disk: :class:`~medfed.errors.DataError`).
    Every checkpoint on disk is complete, so an interruption at any moment
    (``kill -9`` during a write included) leaves the rounds written so far,
    and ``--resume`` continues exactly from the newest of them; :meth:`wait`
    before results.json and on the way out of an interrupted run puts the
    last finished round's on disk too.

    Args:
        output_dir: the run folder (checkpoints go into its ``checkpoints/``).
        config: the run's resolved config, saved in every checkpoint.
        keep: how many of the newest checkpoints are kept.
    """

    def __init__(self, output_dir: Path, config: dict[str, Any], keep: int) -> None:
        self.folder = output_dir / FOLDER
        self.config = config
        self.keep = keep
        #: seconds the writer thread spent writing (beside the training, not on its path)
        self.write_s = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __call__(self, state: dict[str, Any]) -> None:
        self.wait()
        snapshot = copy.deepcopy({**state, "config": self.config})
        self._thread = threading.Thread(target=self._write, args=(snapshot,), name="medfed-checkpoint")
        self._thread.start()

    def _write(self, snapshot: dict[str, Any]) -> None:
        tic = time.perf_counter()
        try:
            save_checkpoint(self.folder, snapshot, self.keep)
        except BaseException as error:  # raised in the training thread, at the next call or wait()
            self._error = error
        finally:
            self.write_s += time.perf_counter() - tic

    def wait(self) -> None:
        """Wait for the write in flight; raise the error it met, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoint files in ``folder``, oldest round first (none if the folder is missing)."""
    found = [path for path in folder.glob("round-*.ckpt") if _NAME.fullmatch(path.name)] if folder.is_dir() else []
    return sorted(found, key=lambda path: int(_NAME.fullmatch(path.name)[1]))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint`, mapped to the CPU, its keys checked.

    Raises:
        DataError: the file is missing, empty, truncated, changed since it
            was written, not a medfed checkpoint, holds objects other than
            tensors and plain data, or lacks a key the loop's state has
            (a file that passes its checksum was still written by someone).
    """
    state = load_with_digest(path, "checkpoint")
    if not isinstance(state, dict):
        raise DataError(f"checkpoint {path} is not a medfed checkpoint (expected a dict of the run's state)")
    _check_keys(path, state, STATE_KEYS)
    return state


STATE_KEYS = ("round", "config", "sites", "links")
"""The keys of every checkpoint: the loop's (:meth:`~medfed.federated.loop.FederatedLoop.state_dict` and the config) and a deployed site's snapshot."""
LOOP_KEYS = ("history", "server", "failure_streaks", "excluded", "num_threads")
"""The further keys of a loop's checkpoint, which a resumed run needs (:func:`resume_state`)."""
SITE_KEYS = ("slots", "generator", "data_orders", "strategy")
"""The keys of each entry of ``sites`` (:meth:`~medfed.federated.site.Site.state_dict`)."""
SLOT_KEYS = ("module", "optimizer")
"""The keys of each of a site's ``slots``."""
DEPLOYED_SITE_KEYS = ("seq", "round")
"""The keys of each entry of ``sites`` in a deployment server's checkpoint (the sites keep their own state:
:meth:`~medfed.deploy.server_app.FlowerSites.state_dict`)."""


def _check_keys(path: Path, state: dict[str, Any], required: tuple[str, ...]) -> None:
    """One DataError naming the first missing or mistyped entry of ``state``, so that loading it never meets a KeyError."""
    missing = [key for key in required if key not in state]
    if missing:
        raise DataError(f"checkpoint {path} lacks the key {missing[0]!r} (expected {', '.join(required)}): not written by this medfed")
    if not (isinstance(state["round"], int) and state["round"] >= 0):
        raise DataError(f"checkpoint {path}: 'round' is {state['round']!r}, expected an integer >= 0")
    for key, kind in (("config", dict), ("sites", list), ("links", list)):
        if not isinstance(state[key], kind):
            raise DataError(f"checkpoint {path}: {key!r} is a {type(state[key]).__name__}, expected a {kind.__name__}")
    for index, site in enumerate(state["sites"]):
        if isinstance(site, dict) and "seq" in site:  # a deployment server's entry: where the site's own state is
            if not all(isinstance(site.get(key), int) and site[key] >= 0 for key in DEPLOYED_SITE_KEYS):
                raise DataError(f"checkpoint {path}: deployed site {index}'s entry is {site!r}, expected whole numbers >= 0 at {', '.join(DEPLOYED_SITE_KEYS)}")
            continue
        lacking = [key for key in SITE_KEYS if not isinstance(site, dict) or key not in site]
        if lacking:
            raise DataError(f"checkpoint {path}: site {index}'s state lacks the key {lacking[0]!r} (expected {', '.join(SITE_KEYS)})")
        slots = site["slots"]
        for name, slot in slots.items() if isinstance(slots, dict) else [("?", None)]:
            lacking = [key for key in SLOT_KEYS if not isinstance(slot, dict) or key not in slot]
            if lacking:
                raise DataError(f"checkpoint {path}: site {index}'s model slot {name!r} lacks the key {lacking[0]!r}")


def save_with_digest(obj: Any, file: BinaryIO) -> None:
    """:func:`torch.save` ``obj`` into ``file``, hashed while written, then the SHA-256 trailer (no second copy in memory)."""
    import torch  # here, not at the top: listing a run folder's checkpoints (the CLI's first checks) needs no torch

    hashing = _HashingWriter(file)
    torch.save(obj, hashing)
    file.write(_TRAILER_START + hashing.digest.hexdigest().encode() + b"\n")


def load_with_digest(path: Path, what: str) -> Any:
    """What :func:`save_with_digest` wrote to ``path``, mapped to the CPU: the digest checked before anything is unpickled.

    ``what`` names the kind of file in the messages ("checkpoint").

    Raises:
        DataError: the file is missing, empty, truncated, fails its SHA-256
            check, or holds objects other than tensors and plain data.
    """
    import torch

    try:
        with open(path, "rb") as file:
            size = _verify(file, path, what)
            return torch.load(_Prefix(file, size), map_location="cpu", weights_only=True)
    except OSError as error:
        raise DataError(f"{what} {path} cannot be read ({error.strerror})") from None
    except DataError:
        raise
    except Exception as error:  # whatever the unpickler makes of a file that passed the checksum
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "weights_only" in str(error):
            reason = "it holds objects other than tensors and plain data, refused by torch.load(weights_only=True)"
        raise DataError(f"{what} {path} cannot be unpickled safely: {reason}") from None


def resume_state(
    output_dir: Path, config: dict[str, Any], switch: str = "--resume", fresh: str = "start the run again with --overwrite"
) -> dict[str, Any]:
    """The newest checkpoint's state in ``output_dir``, checked against the resolved ``config`` of the run resuming it.

    Temporary files interrupted writes left in ``output_dir`` and its
    checkpoints' folder are removed first. ``switch`` (how the user asked
    to resume) and ``fresh`` (how to start anew) go into the messages: the
    command line's by default, a deployment's run config keys there.

    Raises:
        ConfigError: no checkpoint; the config differs from the checkpoint's
            outside :data:`RESUMABLE_KEYS`; ``trainer.rounds`` is below the
            rounds already done.
        DataError: the newest checkpoint is damaged (the message names the
            previous intact one, or says there is none).
    """
    folder = output_dir / FOLDER
    for written_to in (output_dir, folder):
        remove_stale_temporaries(written_to)
    found = checkpoints(folder)
    if not found:
        raise ConfigError(f"{switch}: no checkpoint in {folder} (was the run started with this output_dir?)")
    newest = found[-1]
    try:
        state = read_checkpoint(newest)
        _check_keys(newest, state, STATE_KEYS + LOOP_KEYS)
    except DataError as error:
        raise DataError(f"{switch}: {error}; {_fallback(found[:-1], newest, switch, fresh)}") from None
    changed = config_differences(state["config"], config)
    if changed:
        raise ConfigError(f"{switch}: the config differs from the checkpoint's ({newest}) at {', '.join(changed)}")
    rounds = config["trainer"]["rounds"]
    if rounds < state["round"]:
        raise ConfigError(
            f"config key 'trainer.rounds' = {rounds}: the run to resume has done {state['round']} rounds; "
            f"{switch} needs trainer.rounds >= {state['round']} (for fewer rounds start a new run)"
        )
    return state


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (:data:`RESUMABLE_KEYS` excepted)."""
    differences = []
    for key in sorted(set(saved) | set(current)):
        full = f"{prefix}{key}"
        if full in RESUMABLE_KEYS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differences += config_differences(a, b, f"{full}.")
        elif a != b:
            differences.append(full)
    return differences


def _verify(file: BinaryIO, path: Path, what: str = "checkpoint") -> int:
    """Check ``file``'s trailer and digest; returns the payload's size (the bytes before the trailer)."""
    size = file.seek(0, io.SEEK_END)
    if size == 0:
        raise DataError(f"{what} {path} is empty (0 bytes)")
    if size < _TRAILER_SIZE:
        raise DataError(f"{what} {path} is truncated ({size} bytes)")
    file.seek(size - _TRAILER_SIZE)
    trailer = file.read(_TRAILER_SIZE)
    expected = trailer[len(_TRAILER_START) : -1]
    if not (trailer.startswith(_TRAILER_START) and trailer.endswith(b"\n") and re.fullmatch(rb"[0-9a-f]{64}", expected)):
        raise DataError(f"{what} {path} has no checksum trailer (truncated, or not written by medfed)")
    payload = size - _TRAILER_SIZE
    digest = hashlib.sha256()
    file.seek(0)
    for chunk in iter(lambda: file.read(min(_CHUNK, payload - file.tell())), b""):
        digest.update(chunk)
    if digest.hexdigest().encode() != expected:
        raise DataError(f"{what} {path} fails its SHA-256 check (changed or damaged since it was written)")
    file.seek(0)
    return payload


def _fallback(earlier: list[Path], damaged: Path, switch: str, fresh: str) -> str:
    """What to do when ``damaged`` (the newest checkpoint) cannot be used: the newest intact earlier one, if any."""
    for path in reversed(earlier):
        try:
            with open(path, "rb") as file:
                _verify(file, path)
        except (OSError, DataError):
            continue
        return (
            f"the previous checkpoint {path.name} is intact: move {damaged.name} out of {damaged.parent} "
            f"and run with {switch} again to continue from {path.name}"
        )
    return f"no earlier checkpoint is intact; {fresh}"


class _HashingWriter:
    """A binary file that hashes what is written to it (all :func:`torch.save` needs)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class _Prefix(io.RawIOBase):
    """The first ``size`` bytes of a binary file, read in place (the checkpoint without its trailer)."""

    def __init__(self, file: BinaryIO, size: int) -> None:
        self.file = file
        self.size = size
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, start + offset)
        return self.position

    def readinto(self, buffer) -> int:
        wanted = max(0, min(len(buffer), self.size - self.position))
        self.file.seek(self.position)
        count = self.file.readinto(memoryview(buffer)[:wanted])
        self.position += count
        return count
