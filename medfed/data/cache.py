"""A cache of preprocessed federations: real data are read and cut into patches once.

Building a federation from real data reads every volume and cuts its patches,
minutes for BraTS. The tensors depend only on the input files, the task's
preprocessing options, the federation config and the seed, so
:func:`load_or_build` keeps each built federation in one file named by a
SHA-256 key (:func:`cache_key`) of

* the task and its preprocessing version (a task bumps it when its code
  changes the tensors it makes),
* the resolved data root,
* every input file's path, size and modification time (ns),
* the task options, the federation config and the seed,
* where ``federation.site_sizes`` cut a partition's sites down, the subjects
  each site kept (:class:`~medfed.data.federation.Placement`).

Touching, replacing or adding an input file changes the key, so a stale entry
is never read; entries are never deleted (remove the folder to reclaim space).

An entry is ``<cache_dir>/<task>-<key>.pt``: :func:`torch.save` of plain
containers and tensors followed by the SHA-256 of those bytes
(:func:`~medfed.checkpoint.save_with_digest`, as checkpoints are written; read
back with ``weights_only=True``, so a cache file cannot run code), written to
a temporary file in the same folder, made mode 0644 and renamed over the
entry, only once the whole federation was built: a failed build leaves nothing
behind. Reading checks the digest (a flipped bit is found before any tensor is
used), then the federation itself (:func:`check_federation`: every split's
samples of the task's input shape, finite, labels in ``[0, num_classes)``),
since a file that passes its checksum may still have been written by someone
else under the right name. An unreadable, damaged or invalid entry is
reported with :func:`medfed.errors.warn`, rebuilt and rewritten. The
default folder is ``$XDG_CACHE_HOME/medfed``, else ``~/.cache/medfed``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from medfed.checkpoint import load_with_digest, save_with_digest
from medfed.data.federation import Federation, Placement, SiteData
from medfed.errors import DataError, warn

FORMAT = 4
"""Version of the entry layout; part of every key."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/medfed``, or ``~/.cache/medfed`` when XDG_CACHE_HOME is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "medfed"


def cache_key(task: str, version: int, root: str | Path, files: Iterable[Path], settings: Mapping[str, Any]) -> str:
    """SHA-256 hex digest of everything a task's federation depends on.

    Args:
        task: the task's name.
        version: the task's preprocessing version.
        root: the data root (resolved here).
        files: every input file; each one's absolute path, size and mtime_ns enter the key.
        settings: JSON-serialisable options, federation config and seed.

    Raises:
        DataError: an input file has disappeared.
    """
    stats = []
    for path in sorted({os.path.abspath(path) for path in files}):
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise DataError(f"{path}: input file disappeared while the federation was being planned") from None
        stats.append((path, stat.st_size, stat.st_mtime_ns))
    record = {
        "format": FORMAT,
        "task": task,
        "version": version,
        "root": str(Path(root).resolve()),
        "files": stats,
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def key_settings(
    options: Any, federation: Any, seed: int, not_stored: tuple[str, ...] = (), placement: Placement | None = None
) -> dict[str, Any]:
    """The ``settings`` of :func:`cache_key`: every task option but ``cache``, ``cache_dir`` and ``not_stored``, the federation config, the seed,
    and the subjects each site kept where ``federation.site_sizes`` cut a partition's sites down.

    Args:
        options: the task's options dataclass.
        federation: the :class:`~medfed.config.FederationConfig`.
        seed: the run's seed.
        not_stored: options that act only after the cache (e.g. augmentation
            of drawn samples), so that changing them reuses the entry.
        placement: the subjects placed at sites; its ``sites`` enter the key
            (as ``kept_subjects``) when they are a draw of a partition's
            (``partition_sizes`` not None). Every other key is as it was
            before sites could be cut down, so existing entries stay valid.
    """
    task_options = {name: value for name, value in asdict(options).items() if name not in ("cache", "cache_dir", *not_stored)}
    settings = {"options": task_options, "federation": asdict(federation), "seed": seed}
    if placement is not None and placement.partition_sizes is not None:
        settings["kept_subjects"] = placement.sites
    return settings


def load_or_build(
    key: str, build: Callable[[], Federation], *, task: str, enabled: bool, cache_dir: str | Path | None
) -> Federation:
    """The federation stored under ``key``, or ``build()``'s, stored under ``key`` once it succeeded.

    Args:
        key: from :func:`cache_key`.
        build: makes the federation from the data (the expensive part).
        task: the task's name, the entry's file name prefix.
        enabled: False builds without reading or writing the cache
            (``Federation.cache`` stays None).
        cache_dir: the cache folder; None for :func:`default_cache_dir`.

    Returns:
        The federation, its ``cache`` recording the key, the file and whether it was a hit.
    """
    if not enabled:
        return build()
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"{task}-{key}.pt"
    federation = _read(path, key, task) if path.exists() else None
    hit = federation is not None
    if not hit:
        federation = build()
        _write(path, key, federation)
    federation.cache = {"key": key, "file": str(path), "hit": hit}
    return federation


MEMORY_ENTRIES = 4
"""Checked entries kept in this process (fused runs of one data set, e.g. tuning points of one seed, read theirs once)."""
_memory: OrderedDict[tuple[str, int, int], dict[str, Any]] = OrderedDict()


def _read(path: Path, key: str, task: str) -> Federation | None:
    """The federation in ``path``, or None (with a warning) when the file is damaged, invalid or not ``task``'s entry for ``key``.

    An entry read and checked before in this process (the same file, size and modification time) is not read
    again: its tensors are shared (training never writes to them), each caller gets its own Federation of them.
    """
    source = f"preprocessed-data cache entry {path}"
    try:
        stat = path.stat()
        remembered = (str(path), stat.st_size, stat.st_mtime_ns)
        if remembered in _memory:
            _memory.move_to_end(remembered)
            return _decode(_memory[remembered], source)
        entry = load_with_digest(path, "preprocessed-data cache entry")
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            raise DataError(f"preprocessed-data cache entry {path} was written in another format or for another key")
        federation = _decode(entry["federation"], source)
        check_federation(federation, task, source)
        _memory[remembered] = entry["federation"]
        while len(_memory) > MEMORY_ENTRIES:
            _memory.popitem(last=False)
        return federation
    except DataError as error:
        warn(f"{error}; rebuilding it")
    except Exception as error:  # any other damage to a cache file means "rebuild it", never a failed run
        warn(f"{path}: unreadable preprocessed-data cache entry ({type(error).__name__}); rebuilding it")
    return None


def check_federation(federation: Federation, task: str, source: str) -> None:
    """Refuse a federation whose tensors training could not use or would be poisoned by.

    Every split of every site: at least two tensors ``(x, y, ...)`` of one
    length; ``x`` of shape ``(n, *input_shape)``; every floating-point tensor
    finite; ``y`` in ``[0, num_classes)``. Each site's training volumes
    (``random_crops``): floating-point tensors finite, integer ones
    non-negative, crop centres inside their volume.

    Raises:
        DataError: naming ``source``, the site and the split.
    """
    if federation.task != task:
        raise DataError(f"{source} holds a {federation.task!r} federation, expected {task!r}")
    if not federation.sites:
        raise DataError(f"{source} holds no site")
    for site in federation.sites:
        splits = {"train": site.train, "test": site.test, "validation": site.validation}
        for split, data in splits.items():
            if data is not None:
                _check_split(list(data.tensors), federation, f"{source}: {site.name}'s {split} samples")
        for index, volume in enumerate(site.train_volumes or []):
            _check_volume(volume, f"{source}: {site.name}'s training volume {index}")


def _dataset(tensors: list[torch.Tensor], where: str) -> TensorDataset:
    """``TensorDataset(*tensors)``; DataError (not TensorDataset's AssertionError) for tensors of different lengths."""
    lengths = sorted({len(tensor) for tensor in tensors})
    if len(lengths) > 1:
        raise DataError(f"{where}: tensors of different lengths {lengths}")
    return TensorDataset(*tensors)


def _check_split(tensors: list[torch.Tensor], federation: Federation, where: str) -> None:
    if len(tensors) < 2 or not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        raise DataError(f"{where}: expected tensors (x, y, ...)")
    x, y = tensors[:2]
    if tuple(x.shape[1:]) != tuple(federation.input_shape):
        raise DataError(f"{where}: x has shape {tuple(x.shape)}, expected (n, {', '.join(map(str, federation.input_shape))})")
    for name, tensor in zip(("x", "y", *(f"tensor {k}" for k in range(2, len(tensors)))), tensors):
        if tensor.is_floating_point():
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                raise DataError(f"{where}: {name} holds {bad} NaN or infinite values")
    if y.numel() and (y.is_floating_point() or y.dtype.is_signed or y.dtype == torch.uint8):
        low, high = y.min().item(), y.max().item()
        if low < 0 or high >= federation.num_classes:
            raise DataError(f"{where}: labels range over [{low:g}, {high:g}], expected values in [0, {federation.num_classes})")


def _check_volume(volume: Any, where: str) -> None:
    if not (isinstance(volume, dict) and all(isinstance(tensor, torch.Tensor) for tensor in volume.values())):
        raise DataError(f"{where}: expected a dict of tensors")
    for name, tensor in volume.items():
        if tensor.is_floating_point():
            if not bool(torch.isfinite(tensor).all()):
                raise DataError(f"{where}: {name} holds NaN or infinite values")
        elif tensor.numel() and tensor.min().item() < 0:
            raise DataError(f"{where}: {name} holds negative values")
    label = volume.get("label")
    for name in ("tumour", "background"):
        centres = volume.get(name)
        if label is not None and centres is not None and centres.numel() and centres.max().item() >= label.numel():
            raise DataError(f"{where}: {name} crop centres lie outside the volume's {label.numel()} voxels")


def _write(path: Path, key: str, federation: Federation) -> None:
    """Store ``federation`` at ``path`` atomically; a failure to write is a warning, not an error."""
    entry = {"format": FORMAT, "key": key, "federation": _encode(federation)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as error:
        warn(f"{path.parent}: cannot write the preprocessed-data cache ({error}); the next run reads the data again")
        return
    try:
        with os.fdopen(handle, "wb") as stream:
            save_with_digest(entry, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except OSError as error:
        warn(f"{path}: cannot write the preprocessed-data cache ({error}); the next run reads the data again")
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _encode(federation: Federation) -> dict[str, Any]:
    """Plain containers and tensors; ``info``, ``features`` and ``site_sizes`` as JSON text (they go to results.json, so they serialise).

    A site's ``train_volumes`` (None, or a list of dicts of tensors) are stored as they are.
    """
    return {
        "task": federation.task,
        "input_shape": list(federation.input_shape),
        "num_classes": federation.num_classes,
        "description": federation.description,
        "generated": federation.generated,
        "holdout": federation.holdout,
        "features": json.dumps(federation.features),
        "site_sizes": json.dumps(federation.site_sizes),
        "sites": [
            {
                "name": site.name,
                "train": list(site.train.tensors),
                "test": list(site.test.tensors),
                "validation": None if site.validation is None else list(site.validation.tensors),
                "info": json.dumps(site.info),
                "train_volumes": site.train_volumes,
            }
            for site in federation.sites
        ],
    }


def _decode(encoded: dict[str, Any], source: str) -> Federation:
    sites = [
        SiteData(
            name=site["name"],
            train=_dataset(site["train"], f"{source}: {site['name']}'s train samples"),
            test=_dataset(site["test"], f"{source}: {site['name']}'s test samples"),
            info=json.loads(site["info"]),
            train_volumes=site["train_volumes"],
            validation=None if site["validation"] is None else _dataset(site["validation"], f"{source}: {site['name']}'s validation samples"),
        )
        for site in encoded["sites"]
    ]
    return Federation(
        task=encoded["task"],
        sites=sites,
        input_shape=tuple(encoded["input_shape"]),
        num_classes=encoded["num_classes"],
        description=encoded["description"],
        generated=encoded["generated"],
        holdout=encoded["holdout"],
        features=json.loads(encoded["features"]),
        site_sizes=json.loads(encoded["site_sizes"]),
    )
