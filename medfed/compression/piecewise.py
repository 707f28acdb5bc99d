"""Coding of piecewise-constant vectors (CER's output) as runs.

A vector u, shape (d,) float32, is stored as its maximal runs of bit-identical
values: the run lengths (equivalently the positions where u changes) and one
value per run. Stream (``write_piecewise``):

    quantisation bits q (8 bits; 0 = exact float32 values), run count r (64 bits),
    Rice parameter (6 bits) and the r - 1 first run lengths minus one,
    Golomb-Rice coded (the last length is d minus the others),
    the run values: r float32 (byte-aligned, little-endian) when q = 0;
    otherwise lo, hi (float32 each) and r levels of q bits.

Quantisation (q in 1..16) is uniform on [lo, hi] = [min, max] of the run
values: level = round((v - lo) / step), step = (hi - lo) / (2^q - 1), decoded
as float32(lo + level * step) in float64 arithmetic. Neighbouring runs that
fall on the same level are merged before coding, so quantising never costs
more runs. Note that 0 is exactly representable only if it is lo or hi (or
falls on the grid): quantised zero runs may decode to a small value.
"""

from __future__ import annotations

import numba
import numpy as np

from medfed.compression.bitstream import BitReader, BitWriter, rice_parameter_for_mean
from medfed.errors import MessageError

__all__ = ["MAX_QUANT_BITS", "read_piecewise", "write_piecewise"]

MAX_QUANT_BITS = 16
_COUNT_BITS = 64
_RICE_PARAMETER_BITS = 6


def _runs(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of bit-identical entries of ``u`` ((d,) float32): (lengths (r,) int64, values (r,) float32)."""
    return _find_runs(np.ascontiguousarray(u).view(np.uint32), u)


@numba.njit(cache=True)
def _find_runs(bits, u):
    """Runs of equal entries of ``bits`` ((d,) uint32, d >= 1): their lengths and the matching entries of ``u``.

    Branch-free: where runs are short and irregular (small CER weights) a
    branch per entry would be mispredicted about half the time.
    """
    count = 1
    for i in range(1, bits.size):
        count += bits[i] != bits[i - 1]
    starts = np.empty(count + 1, dtype=np.int64)
    starts[0] = 0
    run = 0
    for i in range(1, bits.size):
        starts[min(run + 1, count)] = i  # kept only if a new run starts at i
        run += bits[i] != bits[i - 1]
    starts[count] = bits.size
    lengths = np.empty(count, dtype=np.int64)
    values = np.empty(count, dtype=u.dtype)
    for r in range(count):
        lengths[r] = starts[r + 1] - starts[r]
        values[r] = u[starts[r]]
    return lengths, values


@numba.njit(cache=True)
def _expand_runs(values, lengths, out):
    """out = values[0] repeated lengths[0] times, then values[1] ... (``np.repeat`` into ``out``), branch-free."""
    ends = np.cumsum(lengths)
    run = 0
    for position in range(out.size):
        out[position] = values[run]
        run += position + 1 == ends[run]


def _dequantise(levels: np.ndarray, low: np.float32, high: np.float32, quant_bits: int) -> np.ndarray:
    """Float32 values of quantisation ``levels`` ((r,) integers) on the uniform grid over [low, high]."""
    step = (np.float64(high) - np.float64(low)) / (2**quant_bits - 1)
    return (np.float64(low) + levels.astype(np.float64) * step).astype(np.float32)


def _quantise(values: np.ndarray, quant_bits: int) -> tuple[np.ndarray, np.float32, np.float32]:
    """Levels ((r,) uint64 in 0..2^q - 1) of float32 ``values`` on the grid over [min, max], and min, max."""
    low, high = values.min(), values.max()
    if high == low:
        return np.zeros(values.size, dtype=np.uint64), low, high
    step = (np.float64(high) - np.float64(low)) / (2**quant_bits - 1)
    levels = np.rint((values.astype(np.float64) - np.float64(low)) / step)
    return np.clip(levels, 0, 2**quant_bits - 1).astype(np.uint64), low, high


def write_piecewise(writer: BitWriter, u: np.ndarray, quant_bits: int | None = None) -> np.ndarray:
    """Append ``u`` ((d,) float32, d >= 1) as runs; return the vector the stream decodes to.

    Args:
        writer: the stream to append to (d itself is not written).
        u: the vector; any float32 vector works, fewer runs code shorter.
        quant_bits: None for exact float32 run values, or 1..16 to quantise
            them uniformly between their minimum and maximum.

    Returns:
        (d,) float32: u itself when quant_bits is None, else the quantised u,
        bit-identical to what ``read_piecewise`` returns.
    """
    if quant_bits is not None and not 1 <= quant_bits <= MAX_QUANT_BITS:
        raise ValueError(f"quant_bits: expected None or 1..{MAX_QUANT_BITS}, got {quant_bits}")
    lengths, values = _runs(u)
    if quant_bits is not None:
        levels, low, high = _quantise(values, quant_bits)
        new_level = np.concatenate([[True], levels[1:] != levels[:-1]])
        lengths = np.add.reduceat(lengths, np.flatnonzero(new_level))
        levels = levels[new_level]
        values = _dequantise(levels, low, high, quant_bits)

    writer.write_uints([quant_bits or 0], 8)
    writer.write_uints([lengths.size], _COUNT_BITS)
    gaps = lengths[:-1] - 1
    parameter = rice_parameter_for_mean(gaps)
    writer.write_uints([parameter], _RICE_PARAMETER_BITS)
    writer.write_rice(gaps, parameter)
    if quant_bits is None:
        writer.write_bytes(values.astype("<f4").tobytes())
    else:
        writer.write_uints(np.array([low, high], dtype=np.float32).view(np.uint32), 32)
        writer.write_uints(levels, quant_bits)
    if quant_bits is None:
        return u
    sent = np.empty_like(u)
    _expand_runs(values, lengths, sent)
    return sent


def read_piecewise(reader: BitReader, size: int) -> np.ndarray:
    """Read a vector of length ``size`` (>= 1) written by ``write_piecewise``; returns (size,) float32.

    The run count is checked against ``size`` and the bits left before
    anything is allocated for the runs; the one array of ``size`` entries is
    allocated last, once the runs are known to add up to it.

    Raises:
        MessageError: the stream is truncated, its runs do not add up to
            ``size``, or a run value is not finite.
    """
    quant_bits = reader.read_uint(8)
    if quant_bits > MAX_QUANT_BITS:
        raise MessageError(f"piecewise stream: quantisation to {quant_bits} bits is out of range 0..{MAX_QUANT_BITS}")
    run_count = reader.read_uint(_COUNT_BITS)
    if not 1 <= run_count <= size:
        raise MessageError(f"piecewise stream: {run_count} runs cannot make up {size} entries")
    gaps = reader.read_rice(run_count - 1, reader.read_uint(_RICE_PARAMETER_BITS))
    if run_count > 1 and gaps.max() >= size - 1:
        raise MessageError(f"piecewise stream: a run is longer than the {size} entries")
    lengths = np.empty(run_count, dtype=np.int64)
    lengths[:-1] = gaps
    lengths[:-1] += 1
    lengths[-1] = size - int(lengths[:-1].sum())
    if lengths[-1] < 1:
        raise MessageError(f"piecewise stream: the runs add up to more than {size} entries")
    if quant_bits == 0:
        values = np.frombuffer(reader.read_bytes(4 * run_count), dtype="<f4").astype(np.float32)
    else:
        low, high = reader.read_uints(2, 32).astype(np.uint32).view(np.float32)
        if not (np.isfinite(low) and np.isfinite(high)):
            raise MessageError(f"piecewise stream: quantisation range [{low}, {high}] is not finite")
        values = _dequantise(reader.read_uints(run_count, quant_bits), low, high, quant_bits)
    if not np.isfinite(values).all():
        raise MessageError("piecewise stream: a run value is NaN or infinite")
    u = np.empty(size, dtype=np.float32)
    _expand_runs(values, lengths, u)
    return u
