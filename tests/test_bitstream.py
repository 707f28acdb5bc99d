"""Bit writer/reader and Golomb-Rice coding."""

import math

import numpy as np
import pytest

from medfed.compression.bitstream import (
    BitReader,
    BitWriter,
    rice_code_length,
    rice_parameter,
    rice_parameter_for_mean,
)
from medfed.errors import MessageError


def test_fields_are_written_most_significant_bit_first():
    writer = BitWriter()
    writer.write_uints([5, 1], 3)  # 101 001
    writer.write_rice([5, 2], 1)  # quotients 2, 1 -> 110 10; remainders 1, 0 -> 1 0
    # 101001 11010 10, padded with zeros: 10100111 01010000
    assert writer.to_bytes() == bytes([0b10100111, 0b01010000])


def test_round_trip_of_mixed_fields_and_byte_blocks():
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 2**63, 50, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # uses all 64 bits
    small = rng.integers(0, 8, 33)
    geometric = rng.geometric(0.01, 1000) - 1
    raw = rng.bytes(17)

    writer = BitWriter()
    writer.write_uints(small, 3)
    writer.write_uints(wide, 64)
    writer.write_uints([], 12)
    writer.write_bytes(raw)
    writer.write_rice(geometric, rice_parameter(0.01))
    writer.write_unary([0, 4, 0])
    writer.write_uints([1], 1)
    reader = BitReader(writer.to_bytes(), "test stream")

    assert np.array_equal(reader.read_uints(33, 3), small)
    assert np.array_equal(reader.read_uints(50, 64), wide)
    assert reader.read_uints(0, 12).size == 0
    assert reader.read_bytes(17) == raw
    assert np.array_equal(reader.read_rice(1000, rice_parameter(0.01)), geometric)
    assert np.array_equal(reader.read_unary(3), [0, 4, 0])
    assert reader.read_uint(1) == 1
    reader.finish()


@pytest.mark.parametrize("parameter", [0, 1, 5, 20])
def test_rice_code_length_counts_the_bits_written(parameter):
    values = np.random.default_rng(parameter).geometric(0.05, 333) - 1
    writer = BitWriter()
    writer.write_rice(values, parameter)
    bits = rice_code_length(values, parameter)
    assert bits == sum(1 + parameter + (int(v) >> parameter) for v in values)
    assert len(writer.to_bytes()) == math.ceil(bits / 8)


def _expected_rice_length(p: float, parameter: int) -> float:
    """E[code length] for P(n) = p (1 - p)^n: 1 + b + E[n >> b] = 1 + b + t / (1 - t), t = (1 - p)^(2^b)."""
    tail = (1 - p) ** (2**parameter)
    return 1 + parameter + tail / (1 - tail)


@pytest.mark.parametrize("p", [0.9, 0.5, 0.3, 0.1, 1 / 30, 0.01, 1 / 400, 1e-4, 1e-6])
def test_sattler_parameter_minimises_the_expected_length(p):
    lengths = [_expected_rice_length(p, b) for b in range(40)]
    assert _expected_rice_length(p, rice_parameter(p)) == pytest.approx(min(lengths), rel=1e-12)


def test_sattler_parameter_at_typical_sparsity_and_from_the_mean():
    assert rice_parameter(1 / 400) == 8  # 1 + floor(log2(log(0.618...) / log(399/400))) = 1 + floor(7.59)
    assert rice_parameter(1.0) == 0
    # mean of a geometric gap with success probability p is (1 - p) / p
    assert rice_parameter_for_mean(np.full(10, 399.0)) == rice_parameter(1 / 400)
    assert rice_parameter_for_mean(np.zeros(0)) == 0
    with pytest.raises(ValueError, match="probability"):
        rice_parameter(0.0)


def test_truncated_stream_raises():
    writer = BitWriter()
    writer.write_rice(np.arange(100), 2)
    data = writer.to_bytes()
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        with pytest.raises(ValueError, match="test stream: stream truncated"):
            BitReader(data[:cut], "test stream").read_rice(100, 2)
    with pytest.raises(ValueError, match="truncated"):
        BitReader(b"\x00", "test stream").read_bytes(2)


def test_a_count_the_remaining_bits_cannot_hold_is_refused_before_anything_is_allocated():
    # every value takes at least one bit (1 + parameter for Rice, width for fields): 10 bytes hold at most 80
    reader = BitReader(bytes(10), "test stream")
    for read in (lambda: reader.read_rice(2**62, 0), lambda: reader.read_unary(81), lambda: reader.read_rice(41, 1),
                 lambda: reader.read_uints(2**40, 0), lambda: reader.read_uints(3, 27), lambda: reader.read_bytes(11)):
        with pytest.raises(MessageError, match="test stream: stream truncated"):
            read()
    assert reader.read_rice(40, 1).tolist() == [0] * 40  # the same stream, a count it holds


def test_trailing_data_and_non_zero_padding_raise():
    with pytest.raises(ValueError, match="trailing"):
        reader = BitReader(b"\x80\x00", "test stream")
        reader.read_uint(1)
        reader.finish()
    with pytest.raises(ValueError, match="padding"):
        reader = BitReader(b"\xc0", "test stream")
        reader.read_uint(1)
        reader.finish()


def test_rejects_values_that_do_not_fit():
    writer = BitWriter()
    with pytest.raises(ValueError, match="does not fit in 3 bits"):
        writer.write_uints([8], 3)
    with pytest.raises(ValueError, match="non-negative"):
        writer.write_unary([-1])
    with pytest.raises(ValueError, match="non-negative"):
        writer.write_rice(np.array([3, -2]), 1)
    with pytest.raises(ValueError, match="integers"):
        writer.write_uints([0.5], 3)
    with pytest.raises(ValueError, match="parameter"):
        writer.write_rice([1], 63)
