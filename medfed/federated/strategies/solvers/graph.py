"""The similarity network between sites that pFedNet's regulariser runs over.

Each site is a point in some space (a sketch of its data, of its features'
covariance, or its locally trained personal parameters; never the data
itself). Sites whose points are close are joined by an edge, and pFedNet's
penalty ``lambda * sum_m w_m ||z_i - z_j||_p`` pulls the personal parameters
of joined sites together, each edge with weight ``w_m``. This module builds
that graph:

- :func:`pairwise_distances`: the ``(N, N)`` Euclidean distances of the points,
- :func:`knn_edges`: the k-nearest-neighbour graph (union or mutual rule),
- :func:`gaussian_edge_weights`: weights ``exp(-d^2 / (2 sigma^2))``, sigma the
  median edge length, so closer pairs are pulled harder,
- :class:`SimilarityGraph`: edges + weights, and its weighted incidence matrix,
- :func:`incidence_matrix`: the N x M incidence matrix ``Q``,
- :func:`connected_components`: the groups of sites a strong penalty fuses.

Edges are ``(i, j)`` pairs of site indices ``0 <= i < j < N``, sorted.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from medfed.options.strategies import EDGE_WEIGHTINGS, KNN_RULES

Edge = tuple[int, int]


@dataclass(frozen=True)
class SimilarityGraph:
    """A weighted similarity network over ``n_sites`` sites.

    Attributes:
        n_sites: number of sites ``N``.
        edges: sorted ``(i, j)`` pairs, ``i < j``.
        weights: one weight in ``(0, 1]`` per edge (same order).
        distances: ``(N, N)`` float64 distances the graph was built from.
    """

    n_sites: int
    edges: list[Edge]
    weights: list[float]
    distances: torch.Tensor

    def incidence(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
        """``(N, M)`` weighted incidence ``Q diag(w)``: column m is ``w_m (e_i - e_j)``.

        So ``||(Z Q diag(w))[:, m]||_p = w_m ||z_i - z_j||_p`` and the penalty
        ``lam ||Z Q diag(w)||_{1,p}`` is the weighted network lasso.
        """
        q = incidence_matrix(self.edges, self.n_sites, dtype=dtype, device=device)
        return q * torch.tensor(self.weights, dtype=dtype, device=q.device)

    def to_dict(self) -> dict:
        """JSON/checkpoint form (plain lists)."""
        return {
            "n_sites": self.n_sites,
            "edges": [list(edge) for edge in self.edges],
            "weights": list(self.weights),
            "distances": self.distances.tolist(),
        }

    @classmethod
    def from_dict(cls, state: dict) -> SimilarityGraph:
        return cls(
            n_sites=int(state["n_sites"]),
            edges=[tuple(edge) for edge in state["edges"]],
            weights=[float(w) for w in state["weights"]],
            distances=torch.tensor(state["distances"], dtype=torch.float64, device="cpu"),
        )


def similarity_graph(
    points: torch.Tensor, k: int, rule: str = "union", weighting: str = "gaussian", standardize: bool = False
) -> SimilarityGraph:
    """The KNN similarity graph of ``points`` ``(N, s)``, weighted (see :func:`knn_edges`, :func:`gaussian_edge_weights`)."""
    if weighting not in EDGE_WEIGHTINGS:
        raise ValueError(f"weighting: expected one of {', '.join(EDGE_WEIGHTINGS)}, found {weighting!r}")
    features = _checked_points(points)
    if standardize:
        features = _zscore_informative_features(features)
    distances = pairwise_distances(features)
    edges = knn_edges_from_distances(distances, k, rule)
    weights = gaussian_edge_weights(distances, edges) if weighting == "gaussian" else [1.0] * len(edges)
    return SimilarityGraph(n_sites=features.shape[0], edges=edges, weights=weights, distances=distances)


def knn_edges(sketches: torch.Tensor, k: int, rule: str = "union", standardize: bool = False) -> list[Edge]:
    """Join each site to its ``k`` nearest sites.

    Distance is Euclidean between sketch rows. With ``standardize`` every
    feature is first z-scored across sites (mean 0, population standard
    deviation 1) and features with zero spread are dropped; off by default,
    since it rescales each statistic by how much the sites happen to differ
    in it (pFedNet's paper measures plain distances).

    Args:
        sketches: ``(N, s)`` real tensor, one row per site (any float or
            integer dtype; distances are computed in float64).
        k: number of neighbours per site, ``>= 1``; ``k >= N - 1`` gives the
            complete graph.
        rule: ``"union"``: ``(i, j)`` is an edge iff ``j`` is among ``i``'s
            ``k`` nearest **or** ``i`` among ``j``'s (neighbourhoods are not
            symmetric; pFedNet's reference code silently dropped one side);
            ``"mutual"``: iff both.
        standardize: z-score features across sites before measuring distance.

    Returns:
        Sorted list of edges ``(i, j)`` with ``i < j``.

    Raises:
        ValueError: ``sketches`` is not a 2-D finite real tensor with at least
            one row, ``k`` is not an integer ``>= 1``, or ``rule`` is unknown.
    """
    features = _checked_points(sketches)
    if standardize:
        features = _zscore_informative_features(features)
    return knn_edges_from_distances(pairwise_distances(features), k, rule)


def knn_edges_from_distances(distances: torch.Tensor, k: int, rule: str = "union") -> list[Edge]:
    """KNN edges from an ``(N, N)`` symmetric distance matrix (see :func:`knn_edges`).

    Equal distances are broken by the smaller site index, so the graph is
    deterministic.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1 (neighbours per site), found {k!r}")
    if rule not in KNN_RULES:
        raise ValueError(f"rule: expected one of {', '.join(KNN_RULES)}, found {rule!r}")
    n_sites = distances.shape[0]
    if k >= n_sites - 1:
        return [(i, j) for i in range(n_sites) for j in range(i + 1, n_sites)]
    masked = distances.clone()
    masked.fill_diagonal_(float("inf"))  # a site is not its own neighbour
    # A stable sort keeps equal distances in index order: the tie-break.
    nearest = torch.sort(masked, dim=1, stable=True).indices[:, :k]
    neighbours = [set(row) for row in nearest.tolist()]
    if rule == "union":
        edges = {(min(i, j), max(i, j)) for i in range(n_sites) for j in neighbours[i]}
    else:
        edges = {(min(i, j), max(i, j)) for i in range(n_sites) for j in neighbours[i] if i in neighbours[j]}
    return sorted(edges)


def gaussian_edge_weights(distances: torch.Tensor, edges: Sequence[Edge]) -> list[float]:
    """Edge weights ``w_m = exp(-d_m^2 / (2 sigma^2))``, ``sigma`` the median edge distance.

    The median makes the weights scale-free (the same graph at any unit of
    distance): the median edge gets ``exp(-1/2) ~ 0.61``, closer pairs up to
    1, farther ones less. All distances zero (identical sites) gives weight 1.
    """
    if not edges:
        return []
    lengths = torch.tensor([float(distances[i, j]) for i, j in edges], dtype=torch.float64, device="cpu")
    sigma = float(lengths.median())
    if sigma == 0.0:
        return [1.0] * len(edges)
    return [math.exp(-(length / sigma) ** 2 / 2) for length in lengths.tolist()]


def incidence_matrix(
    edges: Sequence[Edge],
    n_nodes: int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Incidence matrix ``Q`` of a graph: column ``m`` is ``e_i - e_j`` for edge ``m = (i, j)``.

    So ``(Z Q)[:, m] = z_i - z_j`` for a matrix ``Z`` with one column per node.

    Args:
        edges: ``M`` pairs ``(i, j)`` of distinct node indices in ``[0, n_nodes)``.
        n_nodes: number of nodes ``N >= 1``.
        dtype, device: of the returned tensor.

    Returns:
        ``(N, M)`` tensor with ``+1`` at ``(i, m)``, ``-1`` at ``(j, m)``, zeros elsewhere.

    Raises:
        ValueError: ``n_nodes < 1``, or an edge is not a pair of distinct
            in-range node indices.
    """
    n_nodes = _check_graph(edges, n_nodes)
    q = torch.zeros(n_nodes, len(edges), dtype=dtype, device=device)
    for m, (i, j) in enumerate(edges):
        q[i, m] = 1
        q[j, m] = -1
    return q


def connected_components(edges: Sequence[Edge], n_nodes: int) -> list[list[int]]:
    """Groups of nodes joined by paths of edges.

    Args:
        edges: pairs ``(i, j)`` of distinct node indices in ``[0, n_nodes)``.
        n_nodes: number of nodes ``N >= 1``.

    Returns:
        One sorted list of node indices per component (isolated nodes form
        their own), ordered by their smallest member; together they partition
        ``range(n_nodes)``.

    Raises:
        ValueError: as :func:`incidence_matrix`.
    """
    n_nodes = _check_graph(edges, n_nodes)
    neighbours: list[list[int]] = [[] for _ in range(n_nodes)]
    for i, j in edges:
        neighbours[i].append(j)
        neighbours[j].append(i)
    component_of = [-1] * n_nodes
    components: list[list[int]] = []
    for start in range(n_nodes):
        if component_of[start] >= 0:
            continue
        members, frontier = [start], [start]
        component_of[start] = len(components)
        while frontier:
            node = frontier.pop()
            for other in neighbours[node]:
                if component_of[other] < 0:
                    component_of[other] = len(components)
                    members.append(other)
                    frontier.append(other)
        components.append(sorted(members))
    return components


def _checked_points(points: torch.Tensor) -> torch.Tensor:
    """``points`` as ``(N, s)`` float64 on the CPU, after checking it is a finite real 2-D tensor."""
    if not isinstance(points, torch.Tensor) or points.ndim != 2 or points.shape[0] == 0:
        found = f"shape {tuple(points.shape)}" if isinstance(points, torch.Tensor) else type(points).__name__
        raise ValueError(f"sketches: expected a 2-D tensor (N sites, s features) with N >= 1, found {found}")
    if points.is_complex() or points.dtype == torch.bool:
        raise ValueError(f"sketches: expected a real tensor, found dtype {points.dtype}")
    features = points.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(features).all():
        raise ValueError("sketches: expected finite values, found NaN or infinity")
    return features


def _zscore_informative_features(features: torch.Tensor) -> torch.Tensor:
    """``(N, s)`` float64 -> ``(N, s')``: z-scored across rows, zero-spread columns dropped."""
    spread = features.std(dim=0, unbiased=False)
    informative = spread > 0
    centred = features[:, informative] - features[:, informative].mean(dim=0)
    return centred / spread[informative]


def pairwise_distances(features: torch.Tensor) -> torch.Tensor:
    """``(N, s)`` float64 -> ``(N, N)`` Euclidean distances, exactly symmetric.

    One row at a time (``O(N s)`` memory for large sketches); each pair is
    computed once and mirrored so that ``d(i, j) == d(j, i)`` bit for bit.
    """
    n_sites = features.shape[0]
    distances = torch.zeros(n_sites, n_sites, dtype=features.dtype, device=features.device)
    for i in range(n_sites - 1):
        row = torch.linalg.vector_norm(features[i + 1 :] - features[i], dim=1)
        distances[i, i + 1 :] = row
        distances[i + 1 :, i] = row
    return distances


def _check_graph(edges: Sequence[Edge], n_nodes: int) -> int:
    """``n_nodes`` as an int, after checking it and every edge."""
    if isinstance(n_nodes, bool) or not hasattr(n_nodes, "__index__") or operator.index(n_nodes) < 1:
        raise ValueError(f"n_nodes: expected an integer >= 1, found {n_nodes!r}")
    n_nodes = operator.index(n_nodes)
    for m, edge in enumerate(edges):
        try:
            i, j = (operator.index(node) for node in edge)
        except (TypeError, ValueError):
            raise ValueError(f"edges[{m}]: expected a pair of integers (i, j), found {edge!r}") from None
        if not (0 <= i < n_nodes and 0 <= j < n_nodes) or i == j:
            raise ValueError(
                f"edges[{m}]: expected two distinct node indices in [0, {n_nodes}), found {edge!r}"
            )
    return n_nodes

