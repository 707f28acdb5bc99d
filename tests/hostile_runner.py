"""A SuperNode runner whose site sends hostile replies (tests only: medfed itself has no switch for this).

``python tests/hostile_runner.py --runtime-api-address HOST:PORT --insecure``
is medfed's own runner (:mod:`medfed.deploy.runner`) answering with medfed's
own ClientApp, except that the reply to a phase's work in the rounds of
:data:`ATTACKS`, or to the delivery in the rounds of :data:`DELIVERY_ATTACKS`,
is altered after the real site made it, the way a broken
or malicious hospital could: every byte the server then reads takes the
server's real code path. ``tests/test_deploy.py`` starts it in place of one
site's runner.

With ``--secure`` first, the site's replies to securely aggregated work are
altered instead, in the rounds of :data:`SECURE_ATTACKS`, before Flower's
SecAgg+ mod masks them (what the site hands the mod: its vectors, its plain
weight and the shapes it declares); ``tests/test_deploy_secagg.py`` uses it.
"""

import json
import os
import struct
import sys

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

import medfed.deploy.client_app as client_app
import medfed.deploy.runner as runner
from medfed.compression.codecs import FORMAT_VERSION, MAGIC, frame_checksum
from medfed.deploy.client_app import app as medfed_app
from medfed.deploy.records import STYPE, from_record


def dense_stream(values: np.ndarray) -> bytes:
    """A dense codec stream of ``values`` with a correct CRC (medfed's encoder refuses non-finite values: built here)."""
    payload = np.asarray(values, dtype="<f4").tobytes()
    start = struct.pack("<4sBBQ", MAGIC, FORMAT_VERSION, 0, len(payload) // 4)
    return start + struct.pack("<I", frame_checksum(start, payload)) + payload


def _stream(data: bytes) -> Array:
    return Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)


def _altered(content: RecordDict, key: str, data: bytes | None = None, shape: list[int] | None = None) -> RecordDict:
    """``content`` with the last wire's ``key`` carrying ``data`` and/or declared with ``shape``."""
    fields = json.loads(content["fields"]["json"])
    last = len(fields["_shapes"]) - 1
    arrays = dict(content["wire"].items())
    if data is not None:
        arrays[f"{last}:{key}"] = _stream(data)
    if shape is not None:
        fields["_shapes"][last][key] = shape
    return RecordDict({"fields": ConfigRecord({"json": json.dumps(fields)}), "wire": ArrayRecord(arrays)})


def garbage(content: RecordDict) -> RecordDict:
    """The model's stream replaced by random bytes of the same length."""
    length = len(content["wire"][f"{len(json.loads(content['fields']['json'])['_shapes']) - 1}:all"].data)
    return _altered(content, "all", data=os.urandom(length))


def nan_stream(content: RecordDict) -> RecordDict:
    """An intact dense stream of NaN in place of the model."""
    size = json.loads(content["fields"]["json"])["_shapes"][-1]["all"][0]
    return _altered(content, "all", data=dense_stream(np.full(size, np.nan)))


def wrong_shape(content: RecordDict) -> RecordDict:
    """The model's shape declared as (2, -1) (``reshape`` would have accepted it)."""
    return _altered(content, "all", shape=[2, -1])


def inflated_samples(content: RecordDict) -> RecordDict:
    """An intact stream claiming 1e9 training samples."""
    return _altered(content, "num_samples", data=dense_stream(np.array([1e9])))


def missing_samples(content: RecordDict) -> RecordDict:
    """The sample count left out (the model intact): FedAvg's aggregate would meet a KeyError."""
    fields = json.loads(content["fields"]["json"])
    last = len(fields["_shapes"]) - 1
    del fields["_shapes"][last]["num_samples"]
    arrays = {name: array for name, array in content["wire"].items() if name != f"{last}:num_samples"}
    return RecordDict({"fields": ConfigRecord({"json": json.dumps(fields)}), "wire": ArrayRecord(arrays)})


def unreadable_metrics(content: RecordDict) -> RecordDict:
    """A delivery reply whose metrics are words, not numbers."""
    fields = json.loads(content["fields"]["json"])
    fields["replies"][-1]["metrics"] = dict.fromkeys(fields["replies"][-1]["metrics"], "high")
    return RecordDict({"fields": ConfigRecord({"json": json.dumps(fields)}), "wire": content["wire"]})


ATTACKS = {1: garbage, 2: nan_stream, 3: wrong_shape, 4: inflated_samples, 5: missing_samples}
"""The attack in each round's work reply (FedAvg's "all" and "num_samples"); other rounds are answered honestly."""
DELIVERY_ATTACKS = {6: unreadable_metrics}
"""The attack in each round's delivery reply (its evaluation); other rounds are answered honestly."""


def hostile_app(message: Message, context) -> Message:
    """medfed's ClientApp, its work replies altered in the rounds of :data:`ATTACKS`."""
    reply = medfed_app(message=message, context=context)
    if message.metadata.message_type != "train" or reply.has_error():
        return reply
    request = from_record(message.content, "the server")[0]["requests"][-1]
    attack = {"work": ATTACKS, "deliver": DELIVERY_ATTACKS}.get(request["kind"], {}).get(request.get("round"))
    return reply if attack is None else Message(attack(reply.content), reply_to=message)


def inflated_weight(vectors: dict, weight: int) -> tuple[dict, int, None]:
    """The vectors as trained, the plain weight 10^9 (SecAgg+ then scales the masked vector by it as well)."""
    return vectors, 10**9, None


def extra_entries(vectors: dict, weight: int) -> tuple[dict, int, None]:
    """The model vector with 7 extra entries, its shape declared accordingly."""
    import torch

    return {**vectors, "all": torch.cat([vectors["all"], torch.zeros(7)])}, weight, None


def shape_lie(vectors: dict, weight: int) -> tuple[dict, int, dict]:
    """The model vector with 7 extra entries, its honest shape declared in plain."""
    honest = {key: list(value.shape) for key, value in vectors.items()}
    return extra_entries(vectors, weight)[0], weight, honest


SECURE_ATTACKS = {1: inflated_weight, 2: extra_entries, 3: shape_lie}
"""The attack on each round's securely aggregated work reply; other rounds are answered honestly."""


def hostile_fit_reply(message: Message, site_index: int, fields: dict, vectors: dict, weight: int) -> Message:
    """medfed's SecAgg+ reply (:func:`medfed.deploy.secure_aggregation.fit_reply`), altered in the rounds of :data:`SECURE_ATTACKS`."""
    attack = SECURE_ATTACKS.get(int(message.metadata.group_id))
    if attack is None:
        return honest_fit_reply(message, site_index, fields, vectors, weight)
    vectors, weight, declared = attack(vectors, weight)
    reply = honest_fit_reply(message, site_index, fields, vectors, weight)
    if declared is not None:
        metrics = reply.content.config_records["fitres.metrics"]
        plain = json.loads(metrics["json"])
        plain["shapes"] = [declared[key] for key in plain["keys"]]
        metrics["json"] = json.dumps(plain)
    return reply


honest_fit_reply = client_app.fit_reply

if __name__ == "__main__":
    if sys.argv[1:2] == ["--secure"]:
        del sys.argv[1]
        client_app.fit_reply = hostile_fit_reply
    else:
        runner.app = hostile_app
    sys.exit(runner.main())
