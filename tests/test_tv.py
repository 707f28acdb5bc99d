"""Exact CER (1-D total variation with the last entry pulled to 0) against independent references."""

import cvxpy as cp
import numpy as np
import pytest
import torch

from medfed.compression import tv
from medfed.compression.tv import cer, zero_solution_threshold


def _cvxpy_cer(delta: np.ndarray, weight: float) -> np.ndarray:
    """argmin 1/2||u - delta||^2 + weight ||Lambda u||_1 with the d x d matrix Lambda written out."""
    d = delta.size
    first_difference = np.eye(d) - np.eye(d, k=1)  # last row [0 ... 0 1]
    u = cp.Variable(d)
    objective = 0.5 * cp.sum_squares(u - delta) + weight * cp.norm1(first_difference @ u)
    cp.Problem(cp.Minimize(objective)).solve(solver="CLARABEL", tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    return u.value


def _change_points(u: np.ndarray) -> set[int]:
    return set(np.flatnonzero(u[1:] != u[:-1]).tolist())


@pytest.mark.parametrize("d", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.9])
def test_matches_cvxpy(d, fraction):
    rng = np.random.default_rng(1000 * d + int(100 * fraction))
    delta = rng.standard_normal(d) * 3.0
    weight = fraction * zero_solution_threshold(delta)
    np.testing.assert_allclose(cer(delta, weight), _cvxpy_cer(delta, weight), rtol=0, atol=1e-6)


def test_single_entry_is_soft_thresholding():
    for value, weight in [(2.5, 1.0), (-2.5, 1.0), (0.3, 1.0), (-1.0, 0.0)]:
        expected = np.sign(value) * max(abs(value) - weight, 0.0)
        assert cer(np.array([value]), weight)[0] == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("shape", ["heavy-tailed noise", "ramp", "sorted noise"])
def test_satisfies_optimality_conditions_on_a_long_vector(shape):
    # KKT: the dual variable z = cumsum(delta - u) lies in [-w, w] and equals
    # w * sign(u_i - u_{i+1}) where u jumps, and w * sign(u_{d-1}) if u_{d-1} != 0.
    rng = np.random.default_rng(0)
    noise = rng.standard_t(3, 20_000)
    delta = {"heavy-tailed noise": noise, "ramp": np.linspace(-5, 5, noise.size), "sorted noise": np.sort(noise)}[shape]
    weight = 2.0
    u = cer(delta, weight)
    z = np.cumsum(delta - u)
    assert np.abs(z).max() <= weight * (1 + 1e-9)
    jumps = np.flatnonzero(u[:-1] != u[1:])
    assert jumps.size > 100  # the check below is not vacuous
    np.testing.assert_allclose(z[jumps], weight * np.sign(u[jumps] - u[jumps + 1]), atol=1e-8)
    if u[-1] != 0:
        assert z[-1] == pytest.approx(weight * np.sign(u[-1]), abs=1e-8)


def test_zero_weight_returns_delta_exactly():
    delta = torch.randn(100, generator=torch.Generator().manual_seed(0))
    u = cer(delta, 0.0)
    assert torch.equal(u, delta) and u.data_ptr() != delta.data_ptr()


def test_zero_exactly_from_the_threshold_on_and_constant_then_zero_just_below():
    rng = np.random.default_rng(3)
    delta = rng.standard_normal(500)
    running_sum = np.cumsum(delta)
    k_star = int(np.argmax(np.abs(running_sum)))
    threshold = zero_solution_threshold(delta)
    assert threshold == pytest.approx(abs(running_sum[k_star]))

    assert np.all(cer(delta, threshold * (1 + 1e-12)) == 0)
    assert np.all(cer(delta, 10 * threshold) == 0)

    weight = threshold * (1 - 1e-6)
    u = cer(delta, weight)
    constant = np.sign(running_sum[k_star]) * (threshold - weight) / (k_star + 1)
    assert np.all(u[k_star + 1 :] == 0)
    assert np.unique(u[: k_star + 1]).size == 1
    assert u[0] == pytest.approx(constant, abs=1e-12 * threshold)
    assert u[0] != 0


def test_runs_merge_as_the_weight_grows():
    # 1-D fused lasso path property: jumps of a larger weight are jumps of every smaller one.
    rng = np.random.default_rng(5)
    delta = rng.standard_normal(2_000)
    weights = np.array([0.01, 0.1, 0.5, 2.0, 10.0, 40.0])
    jumps = [_change_points(cer(delta, w)) for w in weights]
    for smaller, larger in zip(jumps, jumps[1:]):
        assert larger <= smaller
    assert len(jumps[0]) > 10 * len(jumps[-1])


def test_float32_in_float32_out_and_close_to_float64():
    rng = np.random.default_rng(7)
    delta64 = rng.standard_normal(1_000)
    delta32 = delta64.astype(np.float32)
    u32 = cer(delta32, 0.7)
    assert u32.dtype == np.float32
    np.testing.assert_allclose(u32, cer(delta32.astype(np.float64), 0.7), rtol=0, atol=1e-6)
    u_torch = cer(torch.from_numpy(delta32), 0.7)
    assert isinstance(u_torch, torch.Tensor) and u_torch.dtype == torch.float32
    assert np.array_equal(u_torch.numpy(), u32)


@pytest.mark.parametrize(
    "delta, weight, message",
    [
        (np.ones(3), -1.0, "weight"),
        (np.ones(3), float("nan"), "weight"),
        (np.ones((2, 2)), 1.0, "1-D"),
        (np.ones(3, dtype=np.int64), 1.0, "dtype"),
        (np.array([1.0, np.nan]), 1.0, "NaN"),
        ([1.0, 2.0], 1.0, "torch.Tensor or numpy.ndarray"),
    ],
    ids=["negative weight", "NaN weight", "matrix", "integers", "NaN entry", "list"],
)
def test_rejects_bad_input(delta, weight, message):
    with pytest.raises(ValueError, match=message):
        cer(delta, weight)


def test_rejects_an_unknown_core_count():
    with pytest.raises(ValueError, match="cores"):
        cer(np.ones(3), 1.0, cores=3)


# ------------------------------------------------------------ the two-core solver
# It meets in the middle from both ends; these tests drive it directly with
# small blocks so the passes alternate and meet at nodes that depend on timing.


def _two_core(delta: np.ndarray, weight: float, block_nodes: int) -> np.ndarray:
    out = np.empty_like(delta)
    tv._TwoCoreSolver(block_nodes)(delta, weight, out)
    return out


def _serial(delta: np.ndarray, weight: float) -> np.ndarray:
    return cer(delta, weight, cores=1)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.9, 1.5])
def test_two_core_solver_matches_cvxpy(d, fraction):
    rng = np.random.default_rng(7 * d + int(10 * fraction))
    delta = rng.standard_normal(d) * 3.0
    weight = fraction * zero_solution_threshold(delta)
    expected = _cvxpy_cer(delta, weight)
    for block_nodes in (1, 2, 5):
        np.testing.assert_allclose(_two_core(delta, weight, block_nodes), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", ["heavy-tailed noise", "ramp", "sorted noise", "spikes"])
def test_two_core_solver_equals_the_one_pass_solver_on_long_vectors(shape):
    rng = np.random.default_rng(11)
    noise = rng.standard_t(3, 30_001)
    spikes = np.where(rng.random(noise.size) < 0.01, 50.0 * noise, 0.0)
    ramp = np.linspace(-5, 5, noise.size)
    delta = {"heavy-tailed noise": noise, "ramp": ramp, "sorted noise": np.sort(noise), "spikes": spikes}[shape]
    tolerance = 1e-9 * np.abs(delta).max()
    for weight in (0.05, 2.0, 0.5 * zero_solution_threshold(delta)):
        serial = _serial(delta, weight)
        assert np.unique(serial).size >= 3  # not trivially constant
        for block_nodes in (997, 1 << 15):
            np.testing.assert_allclose(_two_core(delta, weight, block_nodes), serial, rtol=0, atol=tolerance)


def _meeting_at(delta: np.ndarray, weight: float, m: int) -> np.ndarray:
    """The two-core solver's steps, run one after the other with the passes meeting at node m."""
    d = delta.size
    below, above, bounds = np.zeros((2 * d + 2, 3)), np.zeros((2 * d + 2, 3)), np.zeros((d, 2))
    below_span = tv._forward_pass(delta, weight, below, bounds, 0, m, *tv._start_deque(weight, False, below, d))
    above_span = tv._forward_pass(
        delta[::-1], weight, above, bounds[::-1], 0, d - 1 - m, *tv._start_deque(weight, True, above, d)
    )
    out = np.empty_like(delta)
    out[m] = tv._meet(delta[m], weight, below, below_span, above, above_span)
    tv._backtrack(bounds[::-1][: d - 1 - m], out[m], out[::-1][: d - 1 - m])
    tv._backtrack(bounds[:m], out[m], out[:m])
    return out


@pytest.mark.parametrize("shape", ["ramp", "descending ramp", "sorted noise"])
def test_the_meeting_node_is_as_accurate_as_the_one_pass_solver_wherever_the_passes_meet(shape):
    # On trends the deques hold long fused segments whose knots carry large,
    # cancelling coefficients; summing across them at the meeting node once
    # cost 3e-9 relative accuracy (measured) against < 1e-12 now.
    ramp = np.linspace(-5, 5, 20_001)
    delta = {"ramp": ramp, "descending ramp": -ramp, "sorted noise": np.sort(np.random.default_rng(3).standard_t(3, ramp.size))}[shape]
    for fraction in (1e-5, 0.5):
        weight = fraction * zero_solution_threshold(delta)
        serial = _serial(delta, weight)
        worst = max(np.abs(_meeting_at(delta, weight, m) - serial).max() for m in range(0, delta.size, 97))
        assert worst <= 1e-11 * np.abs(delta).max()


def test_two_cores_agree_with_one_on_a_long_float32_update():
    rng = np.random.default_rng(12)
    delta = (1e-2 * rng.standard_t(3, 2 * tv.PARALLEL_MIN_SIZE + 1)).astype(np.float32)
    u = cer(delta, 1e-2, cores=2)
    serial = _serial(delta, 1e-2)
    assert u.dtype == np.float32 and (u != 0).any()
    assert np.max(np.abs(u - serial)) <= 1e-6 * np.abs(delta).max()
    # the shared workspace is reused: a second, shorter call is unaffected by the first
    short = delta[:1000]
    np.testing.assert_allclose(cer(short, 1e-2, cores=2), _serial(short, 1e-2), rtol=0, atol=1e-6 * np.abs(delta).max())
