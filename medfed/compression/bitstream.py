"""Bit-level streams and Golomb-Rice coding of non-negative integers.

Bits are written most significant first and packed with ``numpy.packbits``;
every operation works on whole arrays of values at once (no Python loop per
value). A stream may mix bit fields and byte-aligned raw byte blocks (e.g. a
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

import numpy as np

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
    return values.astype(np.uint64)


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
        bits = np.empty((values.size, width), dtype=np.uint8)
        for column in range(width):  # one array operation per bit plane
            bits[:, column] = (values >> np.uint64(width - 1 - column)) & np.uint64(1)
        self._bits.append(bits.ravel())

    def write_unary(self, values: np.ndarray) -> None:
        """Append each value n as n 1-bits followed by one 0-bit."""
        values = _as_uint64(values).astype(np.int64)
        ends = np.cumsum(values + 1)
        bits = np.ones(int(ends[-1]) if values.size else 0, dtype=np.uint8)
        bits[ends - 1] = 0
        self._bits.append(bits)

    def write_rice(self, values: np.ndarray, parameter: int) -> None:
        """Append ``values`` (non-negative integers) Golomb-Rice coded: all quotients, then all remainders."""
        if not 0 <= parameter <= MAX_RICE_PARAMETER:
            raise ValueError(f"parameter: expected 0..{MAX_RICE_PARAMETER}, got {parameter}")
        values = _as_uint64(values)
        self.write_unary((values >> np.uint64(parameter)).astype(np.int64))
        self.write_uints(values & np.uint64((1 << parameter) - 1), parameter)

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

    Every read checks the stream's length: a truncated stream raises
    ValueError naming ``what`` (e.g. "STC stream") instead of returning
    garbage.
    """

    def __init__(self, data: bytes, what: str) -> None:
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._total_bits = 8 * self._data.size
        self._position = 0  # next bit to read
        self._what = what

    def read_uints(self, count: int, width: int) -> np.ndarray:
        """Read ``count`` values of ``width`` bits each; returns (count,) uint64."""
        _check_width(width)
        bits = self._take(count * width).reshape(count, width)
        values = np.zeros(count, dtype=np.uint64)
        for column in range(width):
            values = (values << np.uint64(1)) | bits[:, column]
        return values

    def read_uint(self, width: int) -> int:
        """Read one ``width``-bit value as a Python int."""
        return int(self.read_uints(1, width)[0])

    def read_unary(self, count: int) -> np.ndarray:
        """Read ``count`` unary-coded values; returns (count,) int64."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        zeros = np.zeros(0, dtype=np.int64)
        scanned = self._position
        window = 2 * count + 64  # bits scanned at once (Rice quotients are small), doubled until enough 0-bits
        while zeros.size < count:
            if scanned >= self._total_bits:
                raise self._truncated(f"{count} unary values")
            stop = min(self._total_bits, scanned + window)
            zeros = np.concatenate([zeros, scanned + np.flatnonzero(self._bits(scanned, stop) == 0)])
            scanned = stop
            window *= 2
        zeros = zeros[:count]
        values = np.diff(zeros, prepend=self._position - 1) - 1
        self._position = int(zeros[-1]) + 1
        return values

    def read_rice(self, count: int, parameter: int) -> np.ndarray:
        """Read ``count`` Golomb-Rice values written by ``BitWriter.write_rice``; returns (count,) uint64."""
        if not 0 <= parameter <= MAX_RICE_PARAMETER:
            raise ValueError(f"{self._what}: Rice parameter {parameter} is out of range 0..{MAX_RICE_PARAMETER}")
        quotients = self.read_unary(count).astype(np.uint64)
        return (quotients << np.uint64(parameter)) | self.read_uints(count, parameter)

    def read_bytes(self, count: int) -> bytes:
        """Skip the padding to the next byte boundary, then read ``count`` raw bytes."""
        self._align()
        if self._position + 8 * count > self._total_bits:
            raise self._truncated(f"{count} bytes")
        start = self._position // 8
        self._position += 8 * count
        return self._data[start : start + count].tobytes()

    def finish(self) -> None:
        """Check that only the zero padding of the last byte is left unread."""
        self._align()
        if self._position != self._total_bits:
            raise ValueError(f"{self._what}: {(self._total_bits - self._position) // 8} unexpected trailing bytes")

    def _align(self) -> None:
        padding_end = -(-self._position // 8) * 8
        if padding_end > self._position and self._bits(self._position, padding_end).any():
            raise ValueError(f"{self._what}: corrupt stream (non-zero padding bits)")
        self._position = padding_end

    def _take(self, count: int) -> np.ndarray:
        if self._position + count > self._total_bits:
            raise self._truncated(f"{count} bits")
        bits = self._bits(self._position, self._position + count)
        self._position += count
        return bits

    def _bits(self, start: int, stop: int) -> np.ndarray:
        """Bits [start, stop) of the stream as a uint8 array of 0/1."""
        first_byte, last_byte = start // 8, -(-stop // 8)
        unpacked = np.unpackbits(self._data[first_byte:last_byte])
        return unpacked[start - 8 * first_byte : stop - 8 * first_byte]

    def _truncated(self, wanted: str) -> ValueError:
        return ValueError(
            f"{self._what}: stream truncated (needed {wanted} at bit {self._position} of {self._total_bits})"
        )
