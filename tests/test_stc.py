"""Sparse ternary compression: selection, what one message leaves unsent, and its bit stream."""

import numpy as np
import pytest

from medfed.compression.bitstream import BitReader, BitWriter, rice_parameter
from medfed.compression.stc import TernaryUpdate, kept_count, read_ternary, select_top_k, write_ternary


def _round_trip(update: TernaryUpdate) -> tuple[TernaryUpdate, int]:
    writer = BitWriter()
    write_ternary(writer, update)
    data = writer.to_bytes()
    reader = BitReader(data, "STC stream")
    decoded = read_ternary(reader, update.size)
    reader.finish()
    return decoded, len(data)


def _assert_same(a: TernaryUpdate, b: TernaryUpdate) -> None:
    assert a.size == b.size and a.magnitude == b.magnitude
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.negative, b.negative)


@pytest.mark.parametrize("seed", range(5))
def test_selection_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    accumulated = rng.integers(-4, 5, 60).astype(np.float32)  # many ties and zeros
    count = int(rng.integers(1, 40))
    update = select_top_k(accumulated, count)

    order = sorted(range(60), key=lambda i: (-abs(accumulated[i]), i))
    expected = sorted(i for i in order[:count] if accumulated[i] != 0)
    assert update.positions.tolist() == expected
    assert update.negative.tolist() == [bool(accumulated[i] < 0) for i in expected]
    assert update.magnitude == pytest.approx(np.mean(np.abs(accumulated[expected])))
    dense = update.to_dense()
    assert set(np.abs(dense[expected])) == {update.magnitude} and np.count_nonzero(dense) == len(expected)


def _reference_top_k(accumulated: np.ndarray, count: int) -> np.ndarray:
    """Positions of the top ``count`` non-zero |A_i|, ties to the lowest index, by a full sort."""
    order = np.lexsort((np.arange(accumulated.size), -np.abs(accumulated)))[:count]
    return np.sort(order[accumulated[order] != 0])


def _long_vectors() -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(3)
    d = 200_003
    noise = rng.standard_t(3, d).astype(np.float32)
    run_values = rng.integers(-30, 31, 4_000).astype(np.float32) / 8  # few distinct values: wide ties
    piecewise = np.repeat(run_values, rng.multinomial(d, np.full(4_000, 1 / 4_000)))
    sparse = np.zeros(d, np.float32)
    sparse[rng.choice(d, 100, replace=False)] = rng.standard_normal(100)
    off_sample = np.ones(1 << 17, np.float32)
    off_sample[:: (1 << 17) // (1 << 15)] = 10.0  # the strided sample sees only the large entries
    return {
        "heavy-tailed noise": (noise, 500),
        "piecewise constant with ties": (piecewise, 2_000),
        "fewer non-zeros than k": (sparse, 500),
        "sample bound too high": (off_sample, 40_000),
    }


@pytest.mark.parametrize("name", list(_long_vectors()))
def test_selection_on_long_vectors_matches_a_full_sort(name):
    accumulated, count = _long_vectors()[name]
    update = select_top_k(accumulated, count)
    expected = _reference_top_k(accumulated, count)
    assert np.array_equal(update.positions, expected)
    assert update.magnitude == np.float32(np.abs(accumulated[expected]).mean(dtype=np.float64))


def test_all_zero_input_sends_nothing():
    update = select_top_k(np.zeros(10, dtype=np.float32), 3)
    assert update.positions.size == 0 and update.magnitude == 0
    decoded, _ = _round_trip(update)
    _assert_same(decoded, update)
    assert not decoded.to_dense().any()


def test_kept_count_is_ceil_of_sparsity_times_d():
    assert [kept_count(1 / 400, d) for d in (1, 400, 401, 1_600_000)] == [1, 1, 2, 4000]


def test_one_message_removes_k_mu_squared_from_the_squared_error():
    # A - sent differs from A only on the kept entries, where |A_i| becomes ||A_i| - mu|; with mu the
    # mean of the kept |A_i|: ||A - sent||^2 = ||A||^2 - k mu^2. This is why the link's error feedback
    # (it codes A = target - known value) never moves the known value away from a fixed target.
    rng = np.random.default_rng(1)
    accumulated = rng.standard_t(3, 5_000).astype(np.float32)
    update = select_top_k(accumulated, 25)
    assert update.positions.size == 25
    left = accumulated.astype(np.float64) - update.to_dense()
    expected = np.sum(accumulated.astype(np.float64) ** 2) - 25 * float(update.magnitude) ** 2
    assert np.sum(left**2) == pytest.approx(expected, rel=1e-6)
    assert np.sum(left**2) < np.sum(accumulated.astype(np.float64) ** 2)


def test_scattered_positions_cost_what_sattler_predicts():
    # Plain STC: gaps between kept positions are ~geometric(p); with b* each costs
    # 1 + b* + E[gap >> b*] bits, plus one sign bit.
    rng = np.random.default_rng(2)
    d, p = 400_000, 1 / 400
    update = select_top_k(rng.standard_normal(d).astype(np.float32), kept_count(p, d))
    decoded, size = _round_trip(update)
    _assert_same(decoded, update)
    b = rice_parameter(p)
    tail = (1 - p) ** (2**b)
    predicted_bits = update.positions.size * (1 + b + tail / (1 - tail) + 1)
    assert 8 * size == pytest.approx(predicted_bits, rel=0.05)


def test_runs_of_positions_code_much_shorter_than_scattered_ones():
    rng = np.random.default_rng(3)
    d, k = 100_000, 2_000
    in_runs = np.zeros(d, dtype=np.float32)
    for start in rng.choice(d // 100, 20, replace=False) * 100:  # 20 runs of 100
        in_runs[start : start + 100] = rng.choice([-1.0, 1.0])
    scattered = np.zeros(d, dtype=np.float32)
    scattered[rng.choice(d, k, replace=False)] = rng.choice([-1.0, 1.0], k)

    run_update, scattered_update = select_top_k(in_runs, k), select_top_k(scattered, k)
    decoded_runs, run_size = _round_trip(run_update)
    decoded_scattered, scattered_size = _round_trip(scattered_update)
    _assert_same(decoded_runs, run_update)
    _assert_same(decoded_scattered, scattered_update)
    assert run_size < scattered_size / 20


def test_adjacent_runs_of_opposite_sign_round_trip():
    accumulated = np.array([0, 2, 2, -2, -2, 2, 0, 0, -2, 2], dtype=np.float32)
    update = select_top_k(accumulated, 7)
    decoded, _ = _round_trip(update)
    _assert_same(decoded, update)
    assert np.array_equal(decoded.to_dense(), accumulated)


def test_stream_describing_entries_beyond_d_is_rejected():
    update = select_top_k(np.array([0, 0, 0, 5], dtype=np.float32), 1)
    writer = BitWriter()
    write_ternary(writer, update)
    with pytest.raises(ValueError, match="beyond 3 entries"):
        read_ternary(BitReader(writer.to_bytes(), "STC stream"), 3)
