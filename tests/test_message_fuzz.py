"""Fuzzed messages: whatever bytes arrive, a receiver decodes the valid value or raises one MessageError, fast and small.

Seeded cases against the receiving end of a :class:`~medfed.federated.link.Link`
(every codec) and the deployment's record reader:

* valid frames: decoded bit for bit;
* every single-bit flip of whole frames: refused (the CRC covers the header
  too, so none decodes to another value or length);
* truncations and random bytes;
* crafted frames with a correct CRC: huge or wrong element counts (the
  issue's 32-byte CER message claiming 2^28 values), NaN and infinite
  values, random payloads behind an intact header, run counts beyond the
  vector, quantisation out of range;
* malformed wire entries (shapes (2, -1), (8192, 16384) without a stream,
  no stream for values, a stream for no values, wrong types) and records
  (not JSON, 50,000 nested brackets, missing or extra parts).

Each case (after one untimed decode per codec, which compiles numba's
kernels) must end within the time bound, allocate (tracemalloc peak, NumPy
included) at most ``MEMORY_FACTOR`` times the expected tensor plus a small
constant, and either return exactly the valid value, a finite float32 tensor
of the expected shape (crafted frames whose CRC was recomputed: any vector of
that shape is a valid message), or raise MessageError; any other exception
fails the test. The figures (cases, seconds, largest peak) are printed with
``-s``.
"""

import json
import struct
import time
import tracemalloc

import numpy as np
import pytest
import torch

from medfed.compression.bitstream import BitWriter
from medfed.compression.codecs import FORMAT_VERSION, HEADER_SIZE, MAGIC, frame_checksum
from medfed.errors import MessageError
from medfed.federated.link import Link

D = 20_000
"""Values of the model vector every coded message carries (80 kB as float32)."""
EXPECTED_BYTES = 4 * D
MEMORY_FACTOR = 16
MEMORY_SLACK = 256 << 10
"""A decode may allocate at most MEMORY_FACTOR x the expected tensor plus this much (bytes)."""
SECONDS_PER_CASE = 0.25
CODECS = {
    "dense": {"name": "dense"},
    "stc": {"name": "stc", "sparsity": 0.01},
    "cer": {"name": "cer", "gamma": 0.05},
    "cer-quantised": {"name": "cer", "gamma": 0.05, "quant_bits": 6},
    "cer+stc": {"name": "cer+stc", "gamma": 0.05, "sparsity": 0.01},
}
CODEC_ID = {"dense": 0, "stc": 1, "cer": 2, "cer-quantised": 2, "cer+stc": 3}
KEYS = {"all": "all"}


def _pair(spec):
    """A sender's and a receiver's end of a link carrying ``spec`` up, both from the same seeded initial model."""
    initial = {"all": torch.from_numpy(np.random.default_rng(0).standard_normal(D).astype(np.float32))}
    return tuple(Link(spec, {"name": "dense"}, KEYS, initial, torch.device("cpu"), peer="site7") for _ in range(2))


def _target(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    steps = np.repeat(rng.standard_normal(D // 50), 50).astype(np.float32)
    return torch.from_numpy(steps + 0.01 * rng.standard_normal(D).astype(np.float32))


def _frame(codec_id: int, size: int, payload: bytes) -> bytes:
    """A frame with a correct CRC over ``payload``, whatever it holds."""
    start = struct.pack("<4sBBQ", MAGIC, FORMAT_VERSION, codec_id, size)
    return start + struct.pack("<I", frame_checksum(start, payload)) + payload


class Fuzz:
    """Runs cases, checks their outcome and bounds, keeps the figures."""

    def __init__(self) -> None:
        self.cases = 0
        self.refused = 0
        self.seconds = 0.0
        self.peak = 0

    def run(self, decode, valid=None, shape=(D,)):
        """Run ``decode()``; its result must be ``valid`` (when given) or a finite float32 tensor of ``shape``, or it raises MessageError."""
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        tic = time.perf_counter()
        try:
            result = decode()
        except MessageError as error:
            result = error
        elapsed = time.perf_counter() - tic
        peak = tracemalloc.get_traced_memory()[1] - before
        self.cases += 1
        self.seconds += elapsed
        self.peak = max(self.peak, peak)
        assert elapsed < SECONDS_PER_CASE, f"case {self.cases} took {elapsed:.3f} s"
        assert peak <= MEMORY_FACTOR * EXPECTED_BYTES + MEMORY_SLACK, f"case {self.cases} allocated {peak} bytes"
        if isinstance(result, MessageError):
            self.refused += 1
            assert result.sender is not None, result
            return result
        if valid is not None:
            assert torch.equal(result.view(torch.int32), valid.view(torch.int32))
        else:
            assert result.dtype == torch.float32 and tuple(result.shape) == shape and bool(torch.isfinite(result).all())
        return result


@pytest.fixture(scope="module")
def fuzz():
    for spec in CODECS.values():  # numba compiles (or loads) the decoders' kernels on first use: not timed
        sender, receiver = _pair(spec)
        receiver.decode("up", sender.encode("up", {"all": _target(0)}))
    tracemalloc.start()
    figures = Fuzz()
    yield figures
    tracemalloc.stop()
    print(f"\nfuzz: {figures.cases} cases, {figures.refused} refused, {figures.seconds:.2f} s decoding, "
          f"largest peak {figures.peak / 1024:.0f} KiB (expected tensor {EXPECTED_BYTES / 1024:.0f} KiB)")


@pytest.mark.parametrize("codec", list(CODECS))
def test_valid_truncated_bit_flipped_and_random_frames(codec, fuzz):
    sender, receiver = _pair(CODECS[codec])
    rng = np.random.default_rng(CODEC_ID[codec] * 10 + len(codec))
    for round_ in range(3):
        target = _target(round_)
        shape, data = sender.encode("up", {"all": target})["all"]
        state = receiver.state_dict()
        valid = fuzz.run(lambda: receiver.decode("up", {"all": (shape, data)})["all"], valid=sender.known.get("all", target))
        # the receiver's K moved with the valid message: corrupt copies are decoded against the K before it
        corrupt_receiver = _pair(CODECS[codec])[1]
        corrupt_receiver.load_state_dict(state)
        undetected = 0
        bits = range(8 * len(data)) if len(data) <= 400 else rng.choice(8 * len(data), 400, replace=False)
        for bit in bits:
            flipped = bytearray(data)
            flipped[bit // 8] ^= 0x80 >> (bit % 8)
            outcome = fuzz.run(lambda: corrupt_receiver.decode("up", {"all": (shape, bytes(flipped))})["all"], valid=valid)
            undetected += not isinstance(outcome, MessageError)
        assert undetected == 0  # CRC-32 over the whole frame: every single flip is seen
        for cut in sorted(set(rng.integers(0, len(data), 60).tolist()) | {0, HEADER_SIZE - 1, HEADER_SIZE}):
            assert isinstance(fuzz.run(lambda: corrupt_receiver.decode("up", {"all": (shape, data[:cut])})["all"]), MessageError)
        for length in rng.integers(0, 2 * len(data) + 40, 60):
            assert isinstance(fuzz.run(lambda: corrupt_receiver.decode("up", {"all": (shape, rng.bytes(int(length)))})["all"]), MessageError)
        assert corrupt_receiver.state_dict()["bytes_sent"] == state["bytes_sent"]  # refused messages leave the link as it was


@pytest.mark.parametrize("codec", list(CODECS))
def test_random_payloads_behind_an_intact_header_decode_to_a_finite_vector_of_the_expected_length_or_are_refused(codec, fuzz):
    receiver = _pair(CODECS[codec])[1]
    rng = np.random.default_rng(100 + CODEC_ID[codec] * 10 + len(codec))
    for _ in range(400):
        length = int(rng.choice([rng.integers(0, 64), rng.integers(0, 4 * D + 64), 4 * D]))
        payload = bytearray(rng.bytes(length))
        if length and rng.random() < 0.5:  # a plausible start: small counts and parameters, to get past the first checks
            payload[: min(length, 12)] = bytes(min(length, 12))
            payload[min(length - 1, 6)] = int(rng.integers(0, 4))
        frame = _frame(CODEC_ID[codec], D, bytes(payload))
        fuzz.run(lambda: receiver.decode("up", {"all": ((D,), frame)})["all"])


def _piecewise(quant_bits: int, runs: int, gaps: list[int], values: bytes) -> bytes:
    """A run-coded stream; ``values``: the float32 run values (q = 0), else lo, hi as float32 and then the levels' bytes."""
    writer = BitWriter()
    writer.write_uints([quant_bits], 8)
    writer.write_uints([runs], 64)
    writer.write_uints([0], 6)  # Rice parameter 0: unary gaps
    writer.write_rice(np.array(gaps, dtype=np.uint64), 0)
    if quant_bits == 0:
        writer.write_bytes(values)
    else:
        writer.write_uints(np.frombuffer(values[:8], dtype=np.uint32), 32)
        writer.write_uints(np.frombuffer(values[8:], dtype=np.uint8), 8)
    return writer.to_bytes()


def _ternary(magnitude: float, runs: int, zeros_before: list[int], signs: list[int]) -> bytes:
    writer = BitWriter()
    writer.write_uints(np.array([magnitude], dtype=np.float32).view(np.uint32), 32)
    writer.write_uints([runs], 64)
    writer.write_uints([0], 1)  # every kept entry its own run
    writer.write_uints([0], 6)
    writer.write_rice(np.array(zeros_before, dtype=np.uint64), 0)
    writer.write_uints(np.array(signs, dtype=np.uint64), 1)
    return writer.to_bytes()


CRAFTED = {
    # the 32-byte CER message: one run of 2^28 values (the old decoder allocated and filled 1 GiB)
    "cer claims 2^28 values": ("cer", _frame(2, 1 << 28, _piecewise(0, 1, [], np.float32([1.0]).tobytes()))),
    "cer claims 2^63 values": ("cer", _frame(2, 1 << 63, _piecewise(0, 1, [], np.float32([1.0]).tobytes()))),
    "cer claims 2^40 runs": ("cer", _frame(2, D, _piecewise(0, 1 << 40, [], b""))),
    "cer run value NaN": ("cer", _frame(2, D, _piecewise(0, 1, [], np.float32([np.nan]).tobytes()))),
    "cer run value inf": ("cer", _frame(2, D, _piecewise(0, 2, [5], np.float32([1.0, np.inf]).tobytes()))),
    "cer quantised to 17 bits": ("cer", _frame(2, D, _piecewise(17, 1, [], b"\0" * 12))),
    "cer quantisation range NaN": ("cer-quantised", _frame(2, D, _piecewise(6, 1, [], np.float32([np.nan, 1.0]).tobytes() + b"\0"))),
    "cer runs add up beyond d": ("cer", _frame(2, D, _piecewise(0, 2, [D], np.float32([1.0, 2.0]).tobytes()))),
    "stc claims 2^28 values": ("stc", _frame(1, 1 << 28, _ternary(1.0, 1, [0], [0]))),
    "stc claims 2^40 runs": ("stc", _frame(1, D, _ternary(1.0, 1 << 40, [], []))),
    "stc magnitude NaN": ("stc", _frame(1, D, _ternary(np.nan, 1, [0], [0]))),
    "stc magnitude -1": ("stc", _frame(1, D, _ternary(-1.0, 1, [0], [0]))),
    "stc run beyond d": ("stc", _frame(1, D, _ternary(1.0, 2, [D - 1, 3], [0, 1]))),
    "dense NaN stream": ("dense", _frame(0, D, np.full(D, np.nan, np.float32).tobytes())),
    "dense inf stream": ("dense", _frame(0, D, np.full(D, -np.inf, np.float32).tobytes())),
    "dense one value short": ("dense", _frame(0, D, np.zeros(D - 1, np.float32).tobytes())),
    "dense 2^28 values, 4 bytes sent": ("dense", _frame(0, 1 << 28, b"\0" * 4)),
    "dense 0 values": ("dense", _frame(0, 0, b"")),
    "another codec's stream": ("stc", _frame(2, D, _piecewise(0, 1, [], np.float32([1.0]).tobytes()))),
    "unknown codec id": ("dense", _frame(9, D, b"")),
    "format version 1": ("dense", b"MFCD\x01" + _frame(0, D, np.zeros(D, np.float32).tobytes())[5:]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_frames_with_a_correct_crc_are_refused_before_they_allocate(case, fuzz):
    codec, frame = CRAFTED[case]
    receiver = _pair(CODECS[codec])[1]
    error = fuzz.run(lambda: receiver.decode("up", {"all": ((D,), frame)})["all"])
    assert isinstance(error, MessageError) and error.sender == "site7" and error.key == "all"
    assert str(error).startswith("message from site7, payload 'all': ")


def _dense_frame(values) -> bytes:
    return _frame(0, len(values), np.asarray(values, np.float32).tobytes())


WIRES = {
    "shape (2, -1) on a model vector": {"all": ((2, -1), _dense_frame(np.zeros(D)))},
    "shape (8192, 16384), no stream": {"weights": ((8192, 16384), None)},
    "shape (8192, 16384) on a model vector, no stream": {"all": ((8192, 16384), None)},
    "values without a stream": {"num_samples": ((1,), None)},
    "a stream for no values": {"num_samples": ((0,), _dense_frame([1.0]))},
    "shape of 9 dimensions": {"x": ((1,) * 9, _dense_frame([1.0]))},
    "shape of floats": {"x": ((1.0,), _dense_frame([1.0]))},
    "shape of booleans": {"x": ((True,), _dense_frame([1.0]))},
    "shape a string": {"x": ("1", _dense_frame([1.0]))},
    "shape a number": {"x": (1, _dense_frame([1.0]))},
    "stream a string": {"x": ((1,), "abcd")},
    "stream a list": {"x": ((1,), [1, 2, 3])},
    "stream a number": {"x": ((1,), 7)},
    "entry not a pair": {"x": ((1,), _dense_frame([1.0]), b"")},
    "entry None": {"x": None},
    "key not a string": {7: ((1,), _dense_frame([1.0]))},
    "model vector one value short": {"all": ((D - 1,), _dense_frame(np.zeros(D - 1)))},
    "dense entry of 2^21 values": {"sketch": ((1 << 21,), _frame(0, 1 << 21, b""))},
    "dense stream with a NaN": {"num_samples": ((1,), _dense_frame([np.nan]))},
    "shape and stream disagree": {"num_samples": ((2,), _dense_frame([1.0]))},
}


@pytest.mark.parametrize("case", list(WIRES))
def test_malformed_wire_entries_are_refused_naming_the_sender_and_the_key(case, fuzz):
    receiver = _pair(CODECS["dense"])[1]
    before = receiver.state_dict()
    error = fuzz.run(lambda: receiver.decode("up", WIRES[case]))
    assert isinstance(error, MessageError) and error.sender == "site7" and error.key == str(next(iter(WIRES[case]))), error
    assert receiver.state_dict() == before
    assert isinstance(fuzz.run(lambda: receiver.decode("up", [("all", None)])), MessageError)  # not even a dict


def test_a_wire_is_decoded_whole_or_not_at_all(fuzz):
    sender, receiver = _pair(CODECS["stc"])
    wire = sender.encode("up", {"all": _target(0), "num_samples": torch.tensor([12.0])})
    wire["num_samples"] = ((1,), _dense_frame([np.inf]))  # the second key is bad: the first one's K must not move
    error = fuzz.run(lambda: receiver.decode("up", wire))
    assert isinstance(error, MessageError) and error.key == "num_samples"
    assert receiver.known == {} and receiver.bytes_sent == {"up": 0, "down": 0}


def test_records_that_are_not_medfeds_layout_are_refused_naming_the_sender(fuzz):
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from medfed.deploy.records import from_record, to_record

    good = to_record({"losses": {"": 0.5}}, [{"all": ((3,), b"abc")}])
    assert from_record(good, "site2") == ({"losses": {"": 0.5}}, [{"all": ((3,), b"abc")}])

    def record(text, arrays=None, **extra):
        return RecordDict({"fields": ConfigRecord({"json": text}), "wire": ArrayRecord(arrays or {}), **extra})

    def array(data=b"ab", stype="medfed-codec", dtype="uint8"):
        return Array(dtype=dtype, shape=(len(data),), stype=stype, data=data)

    cases = [
        record("not json"),
        record("[" * 50_000 + "]" * 50_000),  # a RecursionError in json.loads, caught
        record(json.dumps({"a": 1})),  # no shapes
        record(json.dumps({"_shapes": {"0": {}}})),
        record(json.dumps({"_shapes": [["all"]]})),
        record(json.dumps({"_shapes": [{"all": 3}]})),
        record(json.dumps([1, 2])),
        record(json.dumps({"_shapes": [{"all": [2]}]}), {"0:all": array(stype="numpy.ndarray")}),
        record(json.dumps({"_shapes": [{"all": [2]}]}), {"0:all": array(dtype="float32")}),
        record(json.dumps({"_shapes": []}), {"0:all": array()}),  # an array no shape names
        record(json.dumps({"_shapes": []}), extra=ConfigRecord({"x": 1})),
        RecordDict({"fields": ConfigRecord({"json": 7}), "wire": ArrayRecord({})}),
        RecordDict({"fields": ArrayRecord({}), "wire": ArrayRecord({})}),
        RecordDict({"wire": ArrayRecord({})}),
        "not a record",
    ]
    for case in cases:
        error = fuzz.run(lambda: from_record(case, "site2"), shape=None)
        assert isinstance(error, MessageError) and error.sender == "site2", case
