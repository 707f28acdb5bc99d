"""Sparse ternary compression (STC, Sattler et al. 2019) and its bit stream.

One message of STC ternarises a (d,) float32 vector A:

    keep the k = ceil(p * d) entries of largest |A|   (ties: lowest index)
    mu <- mean of |A| over the kept entries            (ONE magnitude)
    send mu * sign(A) on the kept entries, 0 elsewhere

(The pFedNet reference code sends two magnitudes, one per sign; that is not
STC.) Exact zeros of A are never kept, so fewer than k entries are sent when
A has fewer than k non-zeros. Sattler's residual accumulation (A is what the
sender has not sent yet) is not kept here: :mod:`medfed.federated.link`
hands the codec A = target - known value (+ the site's residual), which is
that residual.

Stream (``write_ternary``): the kept entries as runs of consecutive
positions with one sign, each run given by the number of zeros before it, its
sign bit and, when that pays off, its length:

    mu (float32) | run count (64 bits) | lengths coded? (1 bit) |
    Rice parameter (6 bits), zeros before each run (Golomb-Rice) |
    [Rice parameter (6 bits), run lengths - 1 (Golomb-Rice)] | one sign bit per run

Rice parameters are Sattler's optimum for the values' mean
(``rice_parameter_for_mean``). The encoder keeps the shorter of two layouts:
every kept entry its own run with no lengths, which is exactly Sattler's
coding (Golomb-coded position gaps plus one sign bit each, best for the
scattered positions of plain STC), or maximal runs with lengths (much
shorter after CER, whose output makes the kept positions come in runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from medfed.compression.bitstream import BitReader, BitWriter, rice_code_length, rice_parameter_for_mean
from medfed.errors import MessageError

__all__ = ["TernaryUpdate", "kept_count", "read_ternary", "select_top_k", "write_ternary"]

_RICE_PARAMETER_BITS = 6  # Rice parameters are 0..62
_COUNT_BITS = 64
_SAMPLE_SIZE = 1 << 15  # entries sampled to bound the top-k threshold


@dataclass(frozen=True)
class TernaryUpdate:
    """The vector magnitude * t with t in {-1, 0, 1}^size, stored sparsely.

    Attributes:
        size: d, the length of the dense vector.
        magnitude: mu >= 0 (float32).
        positions: (k,) int64, strictly increasing indices where t != 0.
        negative: (k,) bool, True where t = -1.
    """

    size: int
    magnitude: np.float32
    positions: np.ndarray
    negative: np.ndarray

    def to_dense(self) -> np.ndarray:
        """The (size,) float32 vector mu * t."""
        dense = np.zeros(self.size, dtype=np.float32)
        dense[self.positions] = np.where(self.negative, -self.magnitude, self.magnitude)
        return dense


def select_top_k(accumulated: np.ndarray, count: int) -> TernaryUpdate:
    """STC's ternarisation of ``accumulated`` (A, shape (d,) float32) keeping ``count`` entries.

    Keeps the ``count`` largest |A_i| among the non-zero entries; among equal
    magnitudes the lowest indices win, so a run of equal values is cut into one
    contiguous piece. mu is the mean |A_i| over the kept entries, computed in
    float64 and rounded to float32.
    """
    magnitudes = np.abs(accumulated)
    candidates = _candidates_above_sampled_bound(magnitudes, count)
    if candidates is None:
        candidates = np.flatnonzero(magnitudes)
    count = min(count, candidates.size)
    if count == 0:
        return TernaryUpdate(accumulated.size, np.float32(0.0), np.zeros(0, np.int64), np.zeros(0, bool))
    values = magnitudes[candidates]
    cut = values.size - count
    threshold = np.partition(values, cut)[cut]  # the count-th largest magnitude
    above = candidates[values > threshold]
    tied = candidates[values == threshold][: count - above.size]  # candidates are in index order
    positions = np.sort(np.concatenate([above, tied]))
    magnitude = np.float32(magnitudes[positions].mean(dtype=np.float64))
    return TernaryUpdate(accumulated.size, magnitude, positions, accumulated[positions] < 0)


def _candidates_above_sampled_bound(magnitudes: np.ndarray, count: int) -> np.ndarray | None:
    """Indices (increasing) of all entries >= a bound below the count-th largest magnitude, or None.

    The bound is an order statistic of a strided sample of about
    ``_SAMPLE_SIZE`` entries, taken at twice the rank the count-th largest
    would have in the sample, plus slack. The result is used only if it holds
    at least ``count`` non-zero entries: then every entry of the top ``count``
    (ties included) is among them, and selecting within them is exact. None
    (use every non-zero entry) for short vectors and when the sample's bound
    is too high or zero.
    """
    stride = magnitudes.size // _SAMPLE_SIZE
    if stride < 2:
        return None
    sample = magnitudes[::stride]
    rank = min(sample.size - 1, 2 * (count // stride) + 32)  # from the top
    bound = np.partition(sample, sample.size - 1 - rank)[sample.size - 1 - rank]
    if bound == 0:
        return None
    candidates = np.flatnonzero(magnitudes >= bound)
    return candidates if candidates.size >= count else None


def kept_count(sparsity: float, size: int) -> int:
    """k = ceil(p d) for p = ``sparsity`` in (0, 1] and d = ``size``, at least 1.

    The tolerance absorbs p's binary rounding (p = 1/400, d = 400 n gives n).
    """
    return max(1, math.ceil(sparsity * size - 1e-9))


def _sign_runs(update: TernaryUpdate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the non-zeros into maximal runs of consecutive positions with one sign.

    Returns:
        (zeros_before, lengths, negative), each (r,): zeros between the end of
        the previous run (or the start) and this run, the run's length, its sign.
    """
    positions, negative = update.positions, update.negative
    starts_run = np.ones(positions.size, dtype=bool)
    starts_run[1:] = (np.diff(positions) != 1) | (negative[1:] != negative[:-1])
    first = np.flatnonzero(starts_run)
    lengths = np.diff(np.append(first, positions.size))
    starts = positions[first]
    previous_ends = np.concatenate([[0], starts[:-1] + lengths[:-1]])
    return starts - previous_ends, lengths, negative[first]


def _coded_bits(zeros_before: np.ndarray, lengths: np.ndarray | None) -> int:
    """Bits of the gap section, the length section (None: left out) and the sign bits."""
    bits = rice_code_length(zeros_before, rice_parameter_for_mean(zeros_before)) + zeros_before.size
    if lengths is not None:
        bits += _RICE_PARAMETER_BITS + rice_code_length(lengths - 1, rice_parameter_for_mean(lengths - 1))
    return bits


def write_ternary(writer: BitWriter, update: TernaryUpdate) -> None:
    """Append ``update`` to ``writer`` (layout in the module docstring; size is not written)."""
    zeros_before, lengths, negative = _sign_runs(update)
    single_zeros_before = np.diff(update.positions, prepend=-1) - 1  # every entry its own run
    code_lengths = _coded_bits(zeros_before, lengths) < _coded_bits(single_zeros_before, None)
    if not code_lengths:
        zeros_before, negative = single_zeros_before, update.negative

    writer.write_uints(np.array([update.magnitude], dtype=np.float32).view(np.uint32), 32)
    writer.write_uints([zeros_before.size], _COUNT_BITS)
    writer.write_uints([int(code_lengths)], 1)
    gap_parameter = rice_parameter_for_mean(zeros_before)
    writer.write_uints([gap_parameter], _RICE_PARAMETER_BITS)
    writer.write_rice(zeros_before, gap_parameter)
    if code_lengths:
        length_parameter = rice_parameter_for_mean(lengths - 1)
        writer.write_uints([length_parameter], _RICE_PARAMETER_BITS)
        writer.write_rice(lengths - 1, length_parameter)
    writer.write_uints(negative, 1)


def read_ternary(reader: BitReader, size: int) -> TernaryUpdate:
    """Read an update written by ``write_ternary`` for a vector of length ``size``.

    Every count is checked against ``size`` and the bits left before
    anything is allocated for it: the arrays built are at most a few times
    ``size`` entries, whatever the stream says.

    Raises:
        MessageError: the stream is truncated, describes entries beyond
            ``size``, or a magnitude that is not a finite number >= 0.
    """
    magnitude = reader.read_uints(1, 32).astype(np.uint32).view(np.float32)[0]
    if not (np.isfinite(magnitude) and magnitude >= 0):
        raise MessageError(f"STC stream: magnitude {magnitude} is not a finite non-negative number")
    run_count = reader.read_uint(_COUNT_BITS)
    if run_count > size:
        raise MessageError(f"STC stream: {run_count} runs of non-zeros cannot fit in {size} entries")
    code_lengths = bool(reader.read_uint(1))
    zeros_before = reader.read_rice(run_count, reader.read_uint(_RICE_PARAMETER_BITS))
    if code_lengths:
        lengths_less_one = reader.read_rice(run_count, reader.read_uint(_RICE_PARAMETER_BITS))
    else:
        lengths_less_one = np.zeros(run_count, dtype=np.uint64)
    negative_runs = reader.read_uints(run_count, 1).astype(bool)
    if run_count and (zeros_before.max() > size or lengths_less_one.max() >= size):
        raise MessageError(f"STC stream: a run of non-zeros lies beyond {size} entries")
    zeros_before, lengths = zeros_before.astype(np.int64), lengths_less_one.astype(np.int64) + 1
    ends = np.cumsum(zeros_before + lengths)
    if run_count and ends[-1] > size:
        raise MessageError(f"STC stream: the runs of non-zeros reach beyond {size} entries")
    first_index = np.cumsum(lengths) - lengths  # index of each run's first entry among all non-zeros
    offsets = np.repeat(ends - lengths - first_index, lengths)
    positions = offsets + np.arange(offsets.size, dtype=np.int64)
    return TernaryUpdate(size, magnitude, positions, np.repeat(negative_runs, lengths))
