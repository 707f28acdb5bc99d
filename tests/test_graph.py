import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.csgraph
import torch

from medfed.federated.strategies.solvers.graph import (
    SimilarityGraph,
    connected_components,
    gaussian_edge_weights,
    incidence_matrix,
    knn_edges,
    pairwise_distances,
    similarity_graph,
)


def brute_force_knn_edges(sketches: np.ndarray, k: int, standardize: bool) -> list[tuple[int, int]]:
    """Independent reference: numpy z-scoring, full distance matrix, stable argsort, explicit union."""
    x = sketches.astype(np.float64)
    if standardize:
        spread = x.std(axis=0)
        x = (x[:, spread > 0] - x[:, spread > 0].mean(axis=0)) / spread[spread > 0]
    n = len(x)
    edges = set()
    for i in range(n):
        distance = [(np.sqrt(((x[i] - x[j]) ** 2).sum()), j) for j in range(n) if j != i]
        for _, j in sorted(distance)[:k]:  # ties: smaller index first
            edges.add((min(i, j), max(i, j)))
    return sorted(edges)


def test_knn_keeps_asymmetric_neighbours():
    # On a line at 0, 1, 3, 10 with k = 1: site 3's nearest is site 2, but
    # site 2's nearest is site 1, so (2, 3) is a one-sided neighbourhood, and
    # site 2 is likewise only one-sidedly joined to site 1. Mutual neighbours
    # alone would give just (0, 1).
    sketches = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    assert knn_edges(sketches, k=1) == [(0, 1), (1, 2), (2, 3)]


def test_mutual_rule_keeps_only_two_sided_neighbours():
    sketches = torch.tensor([[0.0], [1.0], [3.0], [10.0]])  # see the union test above
    assert knn_edges(sketches, k=1, rule="mutual") == [(0, 1)]


def test_gaussian_weights_by_hand():
    distances = pairwise_distances(torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64))
    edges = [(0, 1), (1, 2), (0, 2)]  # lengths 1, 2, 3: median 2
    expected = [np.exp(-((1 / 2) ** 2) / 2), np.exp(-0.5), np.exp(-((3 / 2) ** 2) / 2)]
    assert gaussian_edge_weights(distances, edges) == pytest.approx(expected, rel=1e-12)
    assert gaussian_edge_weights(torch.zeros(3, 3, dtype=torch.float64), edges) == [1.0, 1.0, 1.0]


def test_weighted_incidence_scales_each_edge_difference():
    graph = similarity_graph(torch.tensor([[0.0], [1.0], [3.0], [10.0]]), k=1)
    Z = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    differences = Z @ graph.incidence()
    for m, ((i, j), weight) in enumerate(zip(graph.edges, graph.weights)):
        assert torch.allclose(differences[:, m], weight * (Z[:, i] - Z[:, j]))
    restored = SimilarityGraph.from_dict(graph.to_dict())
    assert (restored.n_sites, restored.edges, restored.weights) == (graph.n_sites, graph.edges, graph.weights)
    assert torch.equal(restored.distances, graph.distances)
    uniform = similarity_graph(torch.tensor([[0.0], [1.0], [3.0], [10.0]]), k=1, weighting="uniform")
    assert uniform.weights == [1.0, 1.0, 1.0]


def test_knn_matches_brute_force_on_random_sketches():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, s = int(rng.integers(3, 9)), int(rng.integers(1, 5))
        sketches = rng.normal(size=(n, s)) * rng.uniform(0.1, 100.0, size=s)
        k = int(rng.integers(1, n))
        for standardize in (True, False):
            expected = brute_force_knn_edges(sketches, k, standardize)
            assert knn_edges(torch.tensor(sketches), k, standardize=standardize) == expected


def test_standardize_stops_a_large_scale_feature_from_dominating():
    # Raw distances follow feature 0 (scale 1000): pairs (0, 1) and (2, 3).
    # Standardised, both features spread equally and feature 1 separates
    # {0, 2} from {1, 3} more strongly than feature 0 separates 0 from 2.
    sketches = torch.tensor([[0.0, 0.0], [1000.0, 3.0], [3000.0, 0.1], [4000.0, 3.1]])
    assert knn_edges(sketches, k=1, standardize=False) == [(0, 1), (2, 3)]
    assert knn_edges(sketches, k=1, standardize=True) == [(0, 2), (1, 3)]


def test_constant_feature_is_ignored():
    rng = np.random.default_rng(1)
    sketches = rng.normal(size=(6, 3))
    with_constant = np.concatenate([sketches, np.full((6, 1), 7.0)], axis=1)
    assert knn_edges(torch.tensor(with_constant), 2) == knn_edges(torch.tensor(sketches), 2)


def test_ties_are_broken_by_index():
    identical = torch.ones(5, 2)
    # Every site is equally far from all others: each picks the lowest other index.
    assert knn_edges(identical, k=1) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert knn_edges(identical, k=2) == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 4)]


@pytest.mark.parametrize("k", [3, 4, 10])
def test_k_at_least_n_minus_one_gives_the_complete_graph(k):
    sketches = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert knn_edges(sketches, k) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_single_site_has_no_edges():
    assert knn_edges(torch.zeros(1, 3), 1) == []


@pytest.mark.parametrize(
    "sketches, k, argument",
    [
        (torch.zeros(4, 2), 0, "k"),
        (torch.zeros(4, 2), 1.5, "k"),
        (torch.zeros(4), 1, "sketches"),
        (torch.zeros(0, 2), 1, "sketches"),
        (torch.tensor([[0.0], [float("nan")], [1.0]]), 1, "sketches"),
    ],
)
def test_knn_rejects_bad_arguments(sketches, k, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        knn_edges(sketches, k)


def test_incidence_matrix_columns_are_edge_differences():
    edges = [(0, 1), (1, 3), (0, 2)]
    q = incidence_matrix(edges, 4)
    expected = torch.tensor(
        [[1.0, 0.0, 1.0], [-1.0, 1.0, 0.0], [0.0, 0.0, -1.0], [0.0, -1.0, 0.0]], dtype=torch.float64
    )
    assert torch.equal(q, expected)
    z = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for m, (i, j) in enumerate(edges):
        assert torch.allclose((z @ q)[:, m], z[:, i] - z[:, j])


def test_incidence_matrix_gives_the_graph_laplacian():
    rng = np.random.default_rng(2)
    n = 7
    edges = sorted({tuple(sorted(rng.choice(n, size=2, replace=False).tolist())) for _ in range(10)})
    adjacency = np.zeros((n, n))
    for i, j in edges:
        adjacency[i, j] = adjacency[j, i] = 1
    laplacian = np.diag(adjacency.sum(axis=1)) - adjacency
    q = incidence_matrix(edges, n, dtype=torch.float32)
    assert q.dtype == torch.float32
    np.testing.assert_array_equal((q @ q.T).numpy(), laplacian)


def test_incidence_matrix_without_edges():
    assert incidence_matrix([], 3).shape == (3, 0)


@pytest.mark.parametrize(
    "edges, n_nodes, argument",
    [
        ([(0, 0)], 3, r"edges\[0\]"),
        ([(0, 1), (1, 3)], 3, r"edges\[1\]"),
        ([(-1, 1)], 3, r"edges\[0\]"),
        ([(0, 1.5)], 3, r"edges\[0\]"),
        ([(0, 1, 2)], 3, r"edges\[0\]"),
        ([], 0, "n_nodes"),
    ],
)
def test_graph_functions_reject_bad_edges(edges, n_nodes, argument):
    for function in (incidence_matrix, connected_components):
        with pytest.raises(ValueError, match=f"^{argument}:"):
            function(edges, n_nodes)


def test_connected_components_of_a_known_graph():
    assert connected_components([(0, 2), (2, 4), (3, 1)], 6) == [[0, 2, 4], [1, 3], [5]]


def test_connected_components_match_scipy():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 10))
        pairs = rng.integers(0, n, size=(int(rng.integers(0, 8)), 2))
        edges = [(int(i), int(j)) for i, j in pairs if i != j]
        rows, columns = np.array(edges, dtype=int).reshape(-1, 2).T
        adjacency = scipy.sparse.coo_matrix((np.ones(len(edges)), (rows, columns)), shape=(n, n))
        _, labels = scipy.sparse.csgraph.connected_components(adjacency, directed=False)
        expected = sorted(sorted(np.flatnonzero(labels == label).tolist()) for label in np.unique(labels))
        assert connected_components(edges, n) == expected
