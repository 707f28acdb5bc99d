"""Read an offline W&B run back from its ``.wandb`` file, with wandb's own protobuf records.

The file is wandb's transaction log: a 7-byte header (``:W&B``, magic,
version) and then LevelDB-log framing, 32 KiB blocks of chunks each with a
7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last),
whose payloads are serialised ``wandb.proto.wandb_internal_pb2.Record``
messages. (wandb 0.31 no longer ships a Python reader for it; the record
type is its own.) wandb's service process writes the file on its own time,
so ``run.finish()`` may return before the file is complete:
:func:`offline_runs` waits for each segment's exit record, the last one.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

from wandb.proto.wandb_internal_pb2 import Record

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _LAST = 1, 4


def read_records(path: Path) -> list[Record]:
    """Every record of one ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pieces, position = [], [], 7
    while position + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + _CHUNK_HEADER])
        if left_in_block < _CHUNK_HEADER or kind == 0:  # block trailer / zero padding
            position += left_in_block
            continue
        if position + _CHUNK_HEADER + length > len(data):  # a chunk still being written
            break
        pieces.append(data[position + _CHUNK_HEADER : position + _CHUNK_HEADER + length])
        position += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


class WandbRun:
    """One offline run segment (one ``offline-run-*`` directory): its id, config, history rows and files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = read_records(path)
        kinds = [record.WhichOneof("record_type") for record in self.records]
        (self.run,) = [record.run for record, kind in zip(self.records, kinds) if kind == "run"]
        self.config: dict[str, Any] = {}
        for record, kind in zip(self.records, kinds):
            updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
            for update in updates:
                self.config[update.key] = json.loads(update.value_json)
        self.history = [_row(record.history.item) for record, kind in zip(self.records, kinds) if kind == "history"]
        self.media = {f.path for record, kind in zip(self.records, kinds) if kind == "files" for f in record.files.files}

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        """History rows holding ``key``, in order."""
        return [row for row in self.history if key in row]


def offline_runs(output_dir: Path, timeout_s: float = 30.0) -> list[WandbRun]:
    """The finished offline run segments W&B wrote under ``output_dir/wandb``, oldest first."""
    paths = sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while not any(record.HasField("exit") for record in read_records(path)):
            assert time.monotonic() < deadline, f"{path}: no exit record {timeout_s} s after the run finished"
            time.sleep(0.1)
    return [WandbRun(path) for path in paths]


def _row(items) -> dict[str, Any]:
    """A history record's items as ``{key: value}``; a media value (nested keys) becomes a dict."""
    row: dict[str, Any] = {}
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        target = row
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = json.loads(item.value_json)
    return row
