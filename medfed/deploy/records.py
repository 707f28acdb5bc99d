"""medfed's messages in Flower records: the codec streams as raw byte arrays, the rest as one JSON text.

A message is ``(fields, wire)``: ``fields`` a JSON-serialisable dict (the
request's kind and numbers, or a reply's losses, norms, metrics), ``wire``
``{payload key: (shape, codec stream)}`` from a
:class:`~medfed.federated.link.Link`'s ``encode``. Each stream travels
unchanged as a Flower ``Array`` of stype ``medfed-codec`` (uint8, one
dimension: Flower chunks large arrays on its own), so the bytes Flower
carries are the bytes the simulator counts; the shapes ride in the JSON
text. A tensor without elements has a shape and no stream.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from medfed.federated.link import Wire

STYPE = "medfed-codec"


def to_record(fields: dict[str, Any], wire: dict[str, Wire]) -> RecordDict:
    """``(fields, wire)`` -> a RecordDict of ``"fields"`` (ConfigRecord) and ``"wire"`` (ArrayRecord)."""
    shapes = {key: list(shape) for key, (shape, _) in wire.items()}
    arrays = {
        key: Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data) for key, (_, data) in wire.items() if data is not None
    }
    return RecordDict({"fields": ConfigRecord({"json": json.dumps({**fields, "_shapes": shapes})}), "wire": ArrayRecord(arrays)})


def from_record(record: RecordDict) -> tuple[dict[str, Any], dict[str, Wire]]:
    """The inverse of :func:`to_record`.

    Raises:
        ValueError: an array that is not a medfed codec stream.
    """
    fields = json.loads(record["fields"]["json"])
    shapes = fields.pop("_shapes")
    arrays = record["wire"]
    wire: dict[str, Wire] = {}
    for key, shape in shapes.items():
        if key not in arrays:
            wire[key] = (tuple(shape), None)
            continue
        array = arrays[key]
        if array.stype != STYPE:
            raise ValueError(f"payload {key!r}: expected a {STYPE} stream, got stype {array.stype!r}")
        wire[key] = (tuple(shape), array.data)
    return fields, wire
