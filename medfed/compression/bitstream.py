"""Bit-level streams and Golomb-Rice coding of non-negative integers.

Bits are written most significant first and packed with ``numpy.packbits``;
every operation works on whole arrays of values at once (no Python loop per
value: small numba kernels turn values into bits and packed bytes back into
values). A stream may mix bit fields and byte-aligned raw byte blocks (e.g. a
float32 array): ``write_bytes`` pads the bits written so far with zeros up to
a byte boundary first.

Golomb-Rice code with parameter b (Golomb code with M = 2^b): the value n is
the quotient n >> b in unary (that many 1 bits, then a 0) and the remainder's
b low bits. ``write_rice`` stores all unary quotients of an array first and
all remainders after them: the same number of bits as interleaving them, but
both halves decode with array operations.

For geometrically distributed values, P(n) = p (1 - p)^n, the parameter that
minimises the expected code length is (Sattler et al. 2019, "Robust and
communication-efficient federated learning from non-iid data")

    b* = 1 + floor(log2(log(phi - 1) / log(1 - p))),   phi the golden ratio,

see ``rice_parameter``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from medfed.errors import MessageError

__all__ = ["BitReader", "BitWriter", "rice_code_length", "rice_parameter", "rice_parameter_for_mean"]

GOLDEN_RATIO = (1.0 + math.sqrt(5.0)) / 2.0
MAX_RICE_PARAMETER = 62
"""Largest Rice parameter: remainders and quotients of uint64 values stay exact."""


def rice_parameter(p: float) -> int:
    """Optimal Golomb-Rice parameter b* for geometric values with success probability ``p``.

    Args:
        p: probability in (0, 1] that a value is 0 (for the gaps between the
            kept entries of a sparse vector: the fraction of kept entries).

    Returns:
        b* of Sattler et al. (2019), clipped to [0, MAX_RICE_PARAMETER].
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p: expected a probability in (0, 1], got {p}")
    if p > 0.382:  # then log(phi - 1) / log(1 - p) < 1, so b* <= 0 (and log(0) at p = 1 is avoided)
        return 0
    b = 1 + math.floor(math.log2(math.log(GOLDEN_RATIO - 1.0) / math.log1p(-p)))
    return min(max(b, 0), MAX_RICE_PARAMETER)


def rice_parameter_for_mean(values: np.ndarray) -> int:
    """b* for ``values`` modelled as geometric with their empirical mean m: p = 1 / (1 + m)."""
    if values.size == 0:
        return 0
    return rice_parameter(1.0 / (1.0 + float(np.mean(values, dtype=np.float64))))


def rice_code_length(values: np.ndarray, parameter: int) -> int:
    """Number of bits ``BitWriter.write_rice(values, parameter)`` writes."""
    values = _as_uint64(values)
    return int(np.sum(values >> np.uint64(parameter), dtype=np.uint64)) + values.size * (1 + parameter)


def _as_uint64(values: np.ndarray | list[int]) -> np.ndarray:
    """``values`` as a flat uint64 array; negative values raise instead of wrapping around."""
    values = np.asarray(values).ravel()
    if values.size and values.dtype.kind not in "uib":
        raise ValueError(f"values: expected integers, got dtype {values.dtype}")
    if values.size and values.dtype.kind == "i" and values.min() < 0:
        raise ValueError(f"values: expected non-negative integers, got {values.min()}")
    return values.astype(np.uint64, copy=False)


@numba.njit(cache=True)
def _uint_bits(values, width):
    """(n * width,) uint8 0/1: each of the (n,) uint64 ``values`` as ``width`` bits, most significant first."""
    bits = np.empty(values.size * width, dtype=np.uint8)
    for i in range(values.size):
        for column in range(width):
            bits[i * width + column] = (values[i] >> np.uint64(width - 1 - column)) & np.uint64(1)
    return bits


@numba.njit(cache=True)
def _unary_bits(values):
    """uint8 0/1: each of the (n,) uint64 ``values`` as that many 1 bits and a 0 bit."""
    bits = np.ones(values.size + int(values.sum()), dtype=np.uint8)
    position = 0
    for value in values:
        position += int(value)
        bits[position] = 0
        position += 1
    return bits


@numba.njit(cache=True)
def _rice_bits(values, parameter):
    """uint8 0/1: the (n,) uint64 ``values`` Golomb-Rice coded, all unary quotients first, then all remainders."""
    quotient_bits = values.size
    for value in values:
        quotient_bits += int(value >> np.uint64(parameter))
    bits = np.ones(quotient_bits + values.size * parameter, dtype=np.uint8)
    position = 0
    for value in values:
        position += int(value >> np.uint64(parameter))
        bits[position] = 0
        position += 1
    for value in values:
        for column in range(parameter):
            bits[position] = (value >> np.uint64(parameter - 1 - column)) & np.uint64(1)
            position += 1
    return bits


@numba.njit(cache=True)
def _bit_at(data, position):
    """Bit ``position`` (0 = most significant bit of byte 0) of the uint8 array ``data``, as int64."""
    return np.int64((data[position >> 3] >> (7 - (position & 7))) & 1)


@numba.njit(cache=True)
def _add_low_bits(data, position, width, values):
    """values[i] = values[i] << width | the i-th ``width``-bit field from bit ``position`` of ``data``."""
    for i in range(values.size):
        value = values[i]
        for _ in range(width):
            value = (value << np.uint64(1)) | np.uint64(_bit_at(data, position))
            position += 1
        values[i] = value


@numba.njit(cache=True)
def _read_unary_values(data, position, total_bits, out):
    """Fill (n,) integer ``out`` with n unary values from bit ``position`` of ``data``.

    Returns the bit position after them, or -1 if the data end first.
    Branch-free per bit: the running count is stored at every bit and the
    output slot only advances at a 0 bit.
    """
    filled = 0
    ones = 0
    while filled < out.size:
        if position >= total_bits:
            return -1
        bit = _bit_at(data, position)
        position += 1
        out[filled] = ones
        filled += 1 - bit
        ones = (ones + 1) * bit
    return position


def _check_width(width: int) -> None:
    if not 0 <= width <= 64:
        raise ValueError(f"width: expected 0..64 bits, got {width}")


class BitWriter:
    """Accumulates bit fields and byte blocks; ``to_bytes`` returns the stream."""

    def __init__(self) -> None:
        self._blocks: list[bytes] = []  # finished, byte-aligned parts
        self._bits: list[np.ndarray] = []  # uint8 arrays of 0/1, not yet packed

    def write_uints(self, values: np.ndarray | list[int], width: int) -> None:
        """Append each value as ``width`` bits, most significant first.

        Args:
            values: (n,) non-negative integers below 2**width.
            width: bits per value, 0..64.
        """
        _check_width(width)
        values = _as_uint64(values)
        if width < 64 and values.size and int(values.max()) >> width:
            raise ValueError(f"values: {int(values.max())} does not fit in {width} bits")
        self._bits.append(_uint_bits(values, width))

    def write_unary(self, values: np.ndarray) -> None:
        """Append each value n as n 1-bits followed by one 0-bit."""
        self._bits.append(_unary_bits(_as_uint64(values)))

    def write_rice(self, values: np.ndarray, parameter: int) -> None:
        """Append ``values`` (non-negative integers) Golomb-Rice coded: all quotients, then all remainders."""
        if not 0 <= parameter <= MAX_RICE_PARAMETER:
            raise ValueError(f"parameter: expected 0..{MAX_RICE_PARAMETER}, got {parameter}")
        self._bits.append(_rice_bits(_as_uint64(values), parameter))

    def write_bytes(self, data: bytes) -> None:
        """Pad to a byte boundary with 0-bits, then append ``data`` unchanged."""
        self._flush_bits()
        self._blocks.append(bytes(data))

    def to_bytes(self) -> bytes:
        """The whole stream, the last bits padded with zeros to a whole byte."""
        self._flush_bits()
        return b"".join(self._blocks)

    def _flush_bits(self) -> None:
        if self._bits:
            self._blocks.append(np.packbits(np.concatenate(self._bits)).tobytes())
            self._bits = []


class BitReader:
    """Reads back what a ``BitWriter`` wrote, in the same order.

    Every read checks the stream's length before it allocates: a count of
    values the remaining bits cannot hold (every value takes at least one
    bit) or a truncated stream raises :class:`~medfed.errors.MessageError`
    naming ``what`` (e.g. "STC stream") instead of returning garbage; so
    the values a read returns never take more than 64 times the stream's
    bits of memory.
    """

    def __init__(self, data: bytes, what: str) -> None:
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._total_bits = 8 * self._data.size
        self._position = 0  # next bit to read
        self._what = what

    def read_uints(self, count: int, width: int) -> np.ndarray:
        """Read ``count`` values of ``width`` bits each; returns (count,) uint64."""
        _check_width(width)
        self._check_count(count, max(width, 1))
        values = np.zeros(count, dtype=np.uint64)
        _add_low_bits(self._data, self._position, width, values)
        self._position += count * width
        return values

    def read_uint(self, width: int) -> int:
        """Read one ``width``-bit value as a Python int."""
        return int(self.read_uints(1, width)[0])

    def read_unary(self, count: int) -> np.ndarray:
        """Read ``count`` unary-coded values; returns (count,) int64."""
        self._check_count(count, 1)
        values = np.empty(count, dtype=np.int64)
        end = _read_unary_values(self._data, self._position, self._total_bits, values)
        if end < 0:
            raise self._truncated(f"{count} unary values")
        self._position = end
        return values

    def read_rice(self, count: int, parameter: int) -> np.ndarray:
        """Read ``count`` Golomb-Rice values written by ``BitWriter.write_rice``; returns (count,) uint64."""
        if not 0 <= parameter <= MAX_RICE_PARAMETER:
            raise MessageError(f"{self._what}: Rice parameter {parameter} is out of range 0..{MAX_RICE_PARAMETER}")
        self._check_count(count, 1 + parameter)
        values = np.empty(count, dtype=np.uint64)
        end = _read_unary_values(self._data, self._position, self._total_bits, values)
        if end < 0 or end + count * parameter > self._total_bits:
            raise self._truncated(f"{count} Rice-coded values")
        _add_low_bits(self._data, end, parameter, values)
        self._position = end + count * parameter
        return values

    def read_bytes(self, count: int) -> bytes:
        """Skip the padding to the next byte boundary, then read ``count`` raw bytes."""
        self._align()
        self._check_count(count, 8)
        start = self._position // 8
        self._position += 8 * count
        return self._data[start : start + count].tobytes()

    def finish(self) -> None:
        """Check that only the zero padding of the last byte is left unread."""
        self._align()
        if self._position != self._total_bits:
            raise MessageError(f"{self._what}: {(self._total_bits - self._position) // 8} unexpected trailing bytes")

    def _align(self) -> None:
        padding_end = -(-self._position // 8) * 8
        if padding_end > self._position and self._bits(self._position, padding_end).any():
            raise MessageError(f"{self._what}: corrupt stream (non-zero padding bits)")
        self._position = padding_end

    def _bits(self, start: int, stop: int) -> np.ndarray:
        """Bits [start, stop) of the stream as a uint8 array of 0/1."""
        first_byte, last_byte = start // 8, -(-stop // 8)
        unpacked = np.unpackbits(self._data[first_byte:last_byte])
        return unpacked[start - 8 * first_byte : stop - 8 * first_byte]

    def _check_count(self, count: int, bits_each: int) -> None:
        """Raise unless ``count`` values of at least ``bits_each`` bits each fit in the bits left (before any allocation)."""
        if count < 0 or count * bits_each > self._total_bits - self._position:
            raise self._truncated(f"{count} values of at least {bits_each} bits" if bits_each != 8 else f"{count} bytes")

    def _truncated(self, wanted: str) -> MessageError:
        return MessageError(
            f"{self._what}: stream truncated (needed {wanted} at bit {self._position} of {self._total_bits})"
        )
