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

:func:`from_record` reads what the other end sent, which it does not trust:
a record that is not exactly this layout (a missing or extra part, a JSON
text over ``MAX_JSON_CHARS`` characters or nested deeper than Python parses,
fields that are not an object, an array that is not a medfed codec stream or
names no payload key) raises :class:`~medfed.errors.MessageError` naming the
sender; the shapes and streams themselves are checked by the receiving
:class:`~medfed.federated.link.Link`, against the model it holds.
:func:`expect` checks the fields a message's reader takes.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from medfed.errors import MessageError
from medfed.federated.link import Wire

STYPE = "medfed-codec"
MAX_JSON_CHARS = 256 << 10
"""Longest JSON text of fields a message may carry (the run's resolved config rides in the server's: a few kB; a
reply's fields: under 1 kB). It bounds what parsing a hostile text allocates (measured: a text of 0.9 MB of empty
objects parses into 42 MB of Python objects, so at most about 12 MB here)."""


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


def from_record(record: RecordDict, sender: str = "the other end") -> tuple[dict[str, Any], list[dict[str, Wire]]]:
    """The inverse of :func:`to_record`, for a record from ``sender`` (named in the errors).

    Raises:
        MessageError: the record is not laid out as :func:`to_record` lays it out (module docstring).
    """
    try:
        return _read(record)
    except MessageError as error:
        raise error.about(sender) from None


def _read(record: Any) -> tuple[dict[str, Any], list[dict[str, Wire]]]:
    if not isinstance(record, RecordDict) or set(record) != {"fields", "wire"}:
        raise MessageError("expected a record of 'fields' and 'wire' alone")
    config, arrays = record["fields"], record["wire"]
    if not isinstance(config, ConfigRecord) or set(config) != {"json"} or not isinstance(config["json"], str):
        raise MessageError("expected 'fields' to hold one JSON text")
    if not isinstance(arrays, ArrayRecord):
        raise MessageError("expected 'wire' to hold codec streams")
    text = config["json"]
    if len(text) > MAX_JSON_CHARS:
        raise MessageError(f"fields: {len(text)} characters of JSON, more than {MAX_JSON_CHARS}")
    try:
        fields = json.loads(text)
    except RecursionError:
        raise MessageError("fields: JSON nested too deeply") from None
    except ValueError as error:
        raise MessageError(f"fields: not JSON ({error})") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("_shapes"), list):
        raise MessageError("fields: expected a JSON object with a '_shapes' list")
    names = set()
    wires: list[dict[str, Wire]] = []
    for index, shapes in enumerate(fields.pop("_shapes")):
        if not isinstance(shapes, dict):
            raise MessageError(f"fields: wire {index}: expected an object of payload shapes")
        wire: dict[str, Wire] = {}
        for key, shape in shapes.items():
            if not isinstance(shape, list):
                raise MessageError(f"fields: wire {index}: the shape of payload {key!r} is not a list")
            name = _name(index, key)
            names.add(name)
            array = arrays.get(name)
            if array is not None and (array.stype != STYPE or array.dtype != "uint8" or not isinstance(array.data, bytes)
                                      or tuple(array.shape) != (len(array.data),)):
                raise MessageError(f"expected a {STYPE} stream of bytes, got stype {array.stype!r}", key=key)
            wire[key] = (tuple(shape), None if array is None else array.data)
        wires.append(wire)
    unexpected = sorted(set(arrays) - names)
    if unexpected:
        raise MessageError(f"wire: {len(unexpected)} array(s) named by no payload shape (first {unexpected[0][:80]!r})")
    return fields, wires


def expect(fields: Any, kinds: dict[str, Any], what: str) -> dict[str, Any]:
    """``fields`` if it is a dict with exactly the keys of ``kinds`` and each value of its kind.

    A kind is a type (``str``, ``list``, ``dict``, ``bool``), ``float`` (any
    finite number, not a bool) or ``int`` (a whole number, not a bool).

    Raises:
        MessageError: naming ``what`` (e.g. "reply") and the first field that is missing, extra or of another kind.
    """
    if not isinstance(fields, dict):
        raise MessageError(f"{what}: expected an object, got {type(fields).__name__}")
    if set(fields) != set(kinds):
        raise MessageError(f"{what}: expected the fields {sorted(kinds)}, got {sorted(map(str, fields))}")
    for key, kind in kinds.items():
        if not _is(fields[key], kind):
            raise MessageError(f"{what}: field {key!r} is not {_KIND_NAMES[kind]} (got {type(fields[key]).__name__})")
    return fields


_KIND_NAMES = {int: "a whole number", float: "a finite number", str: "a string", list: "a list", dict: "an object", bool: "true or false"}


def _is(value: Any, kind: type) -> bool:
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral if kind is int else numbers.Real)):
            return False
        return kind is int or value == value and abs(value) != float("inf")
    return isinstance(value, kind)


def _name(index: int, key: str) -> str:
    """The array name of payload ``key`` of wire ``index`` (built, never parsed: a key may hold any character)."""
    return f"{index}:{key}"
