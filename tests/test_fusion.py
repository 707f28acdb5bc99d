"""The fusion threshold and the between-site spread, against cvxpy and hand computations."""

import math

import cvxpy as cp
import numpy as np
import pytest
import torch

from medfed.federated.strategies.solvers.fusion import (
    between_site_spread, component_means, distinct_parts, fusion_threshold, spread_removed,
)
from medfed.federated.strategies.solvers.graph import SimilarityGraph, connected_components

NORMS = [1.0, 2.0, math.inf]


def _graph(n_sites, edges, weights=None):
    weights = [1.0] * len(edges) if weights is None else weights
    return SimilarityGraph(n_sites, list(edges), list(weights), torch.zeros(n_sites, n_sites, dtype=torch.float64))


def _cvxpy_solution(Z_tilde, graph, lam, eta, p):
    """Independent reference: the weighted network-lasso proximal problem through cvxpy."""
    Z = cp.Variable(Z_tilde.shape)
    penalty = sum(w * cp.norm(Z[:, i] - Z[:, j], p) for (i, j), w in zip(graph.edges, graph.weights))
    problem = cp.Problem(cp.Minimize(cp.sum_squares(Z - Z_tilde) / (2 * eta) + lam * penalty))
    problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    return Z.value


def _fused_gap(Z, graph):
    """Largest distance of a column from its component's mean (0 when fused)."""
    components = connected_components(graph.edges, graph.n_sites)
    Z = torch.as_tensor(Z)
    return float((Z - component_means(Z, components)).abs().max())


TREE = [(0, 1), (1, 2), (1, 3), (3, 4)]
CYCLES = [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (0, 4)]
FOREST = [(0, 1), (2, 3), (3, 4)]


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("edges", [TREE, CYCLES, FOREST], ids=["tree", "cycles", "forest"])
def test_the_threshold_fuses_every_component(p, edges):
    rng = np.random.default_rng(int(p if p != math.inf else 3) + len(edges))
    Z_tilde = rng.normal(size=(4, 5))
    graph = _graph(5, edges, rng.uniform(0.3, 1.0, size=len(edges)).tolist())
    eta = 0.7
    lam_bar = fusion_threshold(torch.tensor(Z_tilde), graph, eta, p)
    assert _fused_gap(_cvxpy_solution(Z_tilde, graph, lam_bar * 1.001, eta, p), graph) < 1e-5


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("edges", [TREE, FOREST], ids=["tree", "forest"])
def test_on_a_forest_the_threshold_is_exact(p, edges):
    rng = np.random.default_rng(11)
    Z_tilde = rng.normal(size=(4, 5))
    graph = _graph(5, edges, rng.uniform(0.3, 1.0, size=len(edges)).tolist())
    lam_bar = fusion_threshold(torch.tensor(Z_tilde), graph, 1.0, p)
    assert _fused_gap(_cvxpy_solution(Z_tilde, graph, 0.97 * lam_bar, 1.0, p), graph) > 1e-4


def test_two_sites_fuse_at_half_their_dual_norm_distance():
    # One edge of weight w: z1 - z2 shrinks by 2 w lam eta in the penalty's dual norm.
    Z_tilde = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
    difference = Z_tilde[:, 0] - Z_tilde[:, 1]
    for p, q in ((1.0, math.inf), (2.0, 2.0), (math.inf, 1.0)):
        expected = float(torch.linalg.vector_norm(difference, ord=q)) / (2 * 0.5 * 0.25)
        assert fusion_threshold(Z_tilde, _graph(2, [(0, 1)], [0.5]), 0.25, p) == pytest.approx(expected, rel=1e-12)


def test_no_edge_no_threshold():
    assert fusion_threshold(torch.randn(3, 4, dtype=torch.float64), _graph(4, []), 1.0, 2.0) == 0.0


def test_spread_is_the_deviation_from_component_means():
    Z = torch.tensor([[0.0, 2.0, 5.0], [1.0, 1.0, -3.0]], dtype=torch.float64)
    # components {0, 1} (mean column [1, 1]) and {2} (no spread)
    assert between_site_spread(Z, [[0, 1], [2]]) == pytest.approx(math.sqrt(2.0))
    fused = component_means(Z, [[0, 1], [2]])
    assert spread_removed(Z, fused, [[0, 1], [2]]) == 1.0
    assert spread_removed(Z, Z, [[0, 1], [2]]) == 0.0
    assert spread_removed(fused, fused, [[0, 1], [2]]) == 0.0  # nothing to remove


def test_distinct_parts_count_columns_closer_than_the_tolerance_as_one():
    a, b = np.array([3.0, 4.0]), np.array([0.0, -5.0])  # norms 5 and 5: the tolerance is 1e-3 * 5 = 5e-3
    columns = [a, a + [1e-3, 0.0], b, b + [0.0, 1e-2], a + [2e-3, 0.0]]  # 0 ~ 1 ~ 4 (1e-3 apart: a chain), 2 and 3 apart
    Z = torch.tensor(np.stack(columns, axis=1), dtype=torch.float64)
    parts = distinct_parts(Z)
    distances = [np.linalg.norm(columns[i] - columns[j]) for i in range(5) for j in range(i + 1, 5)]
    assert parts["distinct"] == 3.0
    assert parts["distance_min"] == pytest.approx(min(distances)) and parts["distance_max"] == pytest.approx(max(distances))
    assert parts["distance_median"] == pytest.approx(sorted(distances)[4])  # torch's median of 10: the lower middle
    assert distinct_parts(Z, relative_tolerance=1e-4)["distinct"] == 5.0
    assert distinct_parts(Z, relative_tolerance=10.0)["distinct"] == 1.0
    assert distinct_parts(Z[:, :1]) == {"distinct": 1.0, "distance_min": 0.0, "distance_median": 0.0, "distance_max": 0.0}
