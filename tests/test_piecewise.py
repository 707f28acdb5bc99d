"""Run coding of piecewise-constant vectors, exact and quantised."""

import numpy as np
import pytest

from medfed.compression.bitstream import BitReader, BitWriter
from medfed.compression.piecewise import read_piecewise, write_piecewise


def _encode(u: np.ndarray, quant_bits=None) -> tuple[bytes, np.ndarray]:
    writer = BitWriter()
    implied = write_piecewise(writer, u, quant_bits)
    return writer.to_bytes(), implied


def _decode(data: bytes, size: int) -> np.ndarray:
    reader = BitReader(data, "piecewise stream")
    u = read_piecewise(reader, size)
    reader.finish()
    return u


def _bits(u: np.ndarray) -> np.ndarray:
    return u.view(np.uint32)


def _piecewise_vector(seed: int, d: int, mean_run: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / mean_run, d)
    return np.repeat(rng.standard_normal(lengths.size).astype(np.float32), lengths)[:d]


@pytest.mark.parametrize(
    "u",
    [
        np.array([3.5], dtype=np.float32),
        np.array([0.0, -0.0, -0.0, 1e-30, 1e-30, 0.0], dtype=np.float32),
        _piecewise_vector(0, 5_000, 40),
        np.random.default_rng(1).standard_normal(300).astype(np.float32),  # no runs at all
    ],
)
def test_exact_round_trip_is_bit_identical(u):
    data, implied = _encode(u)
    assert np.array_equal(_bits(implied), _bits(u))
    assert np.array_equal(_bits(_decode(data, u.size)), _bits(u))


def test_exact_coding_costs_a_float_and_a_short_gap_per_run():
    u = _piecewise_vector(2, 100_000, 50)
    runs = 1 + np.count_nonzero(u[1:] != u[:-1])
    data, _ = _encode(u)
    assert 4 * runs < len(data) < 4.9 * runs  # ~ b* + 2 bits per run length (mean 50: b* = 5)


@pytest.mark.parametrize("quant_bits", [1, 3, 8, 16])
def test_quantised_round_trip_matches_the_implied_vector(quant_bits):
    u = _piecewise_vector(3, 4_000, 20)
    data, implied = _encode(u, quant_bits)
    assert np.array_equal(_bits(_decode(data, u.size)), _bits(implied))

    low, high = u.min(), u.max()
    step = (float(high) - float(low)) / (2**quant_bits - 1)
    assert np.abs(implied.astype(np.float64) - u).max() <= step / 2 * (1 + 1e-6) + 1e-7
    assert np.unique(implied).size <= 2**quant_bits
    assert implied.min() == low and implied.max() == pytest.approx(high, rel=1e-6)
    # runs are never split, and neighbouring runs on the same level are merged
    assert set(np.flatnonzero(implied[1:] != implied[:-1])) <= set(np.flatnonzero(u[1:] != u[:-1]))
    assert len(data) < len(_encode(u)[0])


def test_constant_vector_quantises_to_itself():
    u = np.full(10, -2.25, dtype=np.float32)
    data, implied = _encode(u, 4)
    assert np.array_equal(implied, u) and np.array_equal(_decode(data, 10), u)


def test_runs_longer_than_the_vector_are_rejected():
    data, _ = _encode(_piecewise_vector(4, 100, 10))
    with pytest.raises(ValueError, match="piecewise stream"):
        _decode(data, 50)
    with pytest.raises(ValueError, match="quant_bits"):
        _encode(np.zeros(3, dtype=np.float32), 17)
