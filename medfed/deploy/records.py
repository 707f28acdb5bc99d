"""medfed's messages in Flower records: the codec streams as raw byte arrays, the rest as one JSON text.

A message is ``(fields, wires)``: ``fields`` a JSON-serialisable dict (the
requests' kinds and numbers, or the replies' losses, norms, metrics),
``wires`` a list of ``{payload key: (shape, codec stream)}``, each from a
:class:`~medfed.federated.link.Link`'s ``encode`` (one per request or reply
the message carries). Each stream travels unchanged as a Flower ``Array``
of stype ``medfed-codec`` (uint8, one dimension: Flower chunks large arrays
on its own), named ``<wire index>:<payload key>``, so the bytes Flower
carries are the bytes the simulator counts; the shapes ride in the JSON
text. A tensor without elements has a shape and no stream.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from medfed.federated.link import Wire

STYPE = "medfed-codec"


def to_record(fields: dict[str, Any], wires: list[dict[str, Wire]]) -> RecordDict:
    """``(fields, wires)`` -> a RecordDict of ``"fields"`` (ConfigRecord) and ``"wire"`` (ArrayRecord)."""
    shapes = [{key: list(shape) for key, (shape, _) in wire.items()} for wire in wires]
    arrays = {
        _name(index, key): Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)
        for index, wire in enumerate(wires)
        for key, (_, data) in wire.items()
        if data is not None
    }
    return RecordDict({"fields": ConfigRecord({"json": json.dumps({**fields, "_shapes": shapes})}), "wire": ArrayRecord(arrays)})


def from_record(record: RecordDict) -> tuple[dict[str, Any], list[dict[str, Wire]]]:
    """The inverse of :func:`to_record`.

    Raises:
        ValueError: an array that is not a medfed codec stream.
    """
    fields = json.loads(record["fields"]["json"])
    arrays = record["wire"]
    wires: list[dict[str, Wire]] = []
    for index, shapes in enumerate(fields.pop("_shapes")):
        wire: dict[str, Wire] = {}
        for key, shape in shapes.items():
            array = arrays.get(_name(index, key))
            if array is not None and array.stype != STYPE:
                raise ValueError(f"payload {key!r}: expected a {STYPE} stream, got stype {array.stype!r}")
            wire[key] = (tuple(shape), None if array is None else array.data)
        wires.append(wire)
    return fields, wires


def _name(index: int, key: str) -> str:
    """The array name of payload ``key`` of wire ``index`` (built, never parsed: a key may hold any character)."""
    return f"{index}:{key}"
