"""The similarity network between sites that pFedNet's regulariser runs over.

Each site sends the server a small *sketch* (a vector describing its data,
features or model; never the data itself). Sites whose sketches are close are
joined by an edge, and pFedNet's penalty ``lambda * ||Z Q||_{1,p}`` pulls the
personal parameters of joined sites together. This module builds that graph:

- :func:`knn_edges`: the symmetric k-nearest-neighbour graph of the sketches,
- :func:`incidence_matrix`: its N x M incidence matrix ``Q``,
- :func:`connected_components`: the groups of sites a strong penalty fuses.

Edges are ``(i, j)`` pairs of site indices ``0 <= i < j < N``, sorted.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

Edge = tuple[int, int]


def knn_edges(sketches: torch.Tensor, k: int, standardize: bool = True) -> list[Edge]:
    """Join each site to its ``k`` nearest sites (symmetric union).

    Distance is Euclidean between sketch rows. With ``standardize`` every
    feature is first z-scored across sites (mean 0, population standard
    deviation 1), so features on large scales do not dominate; features with
    zero spread across sites carry no information and are ignored.

    The edge ``(i, j)`` is present iff ``j`` is among ``i``'s ``k`` nearest
    sites **or** ``i`` is among ``j``'s: neighbourhoods are not symmetric, and
    keeping only mutual neighbours would silently drop edges. Equal distances
    are broken by the smaller site index, so the graph is deterministic.

    Args:
        sketches: ``(N, s)`` real tensor, one row per site (any float or
            integer dtype; distances are computed in float64).
        k: number of neighbours per site, ``>= 1``; ``k >= N - 1`` gives the
            complete graph.
        standardize: z-score features across sites before measuring distance.

    Returns:
        Sorted list of edges ``(i, j)`` with ``i < j``.

    Raises:
        ValueError: ``sketches`` is not a 2-D finite real tensor with at least
            one row, or ``k`` is not an integer ``>= 1``.
    """
    if not isinstance(sketches, torch.Tensor) or sketches.ndim != 2 or sketches.shape[0] == 0:
        found = f"shape {tuple(sketches.shape)}" if isinstance(sketches, torch.Tensor) else type(sketches).__name__
        raise ValueError(f"sketches: expected a 2-D tensor (N sites, s features) with N >= 1, found {found}")
    if sketches.is_complex() or sketches.dtype == torch.bool:
        raise ValueError(f"sketches: expected a real tensor, found dtype {sketches.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1 (neighbours per site), found {k!r}")
    features = sketches.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(features).all():
        raise ValueError("sketches: expected finite values, found NaN or infinity")
    n_sites = features.shape[0]
    if k >= n_sites - 1:
        return [(i, j) for i in range(n_sites) for j in range(i + 1, n_sites)]
    if standardize:
        features = _zscore_informative_features(features)
    distances = _pairwise_distances(features)
    distances.fill_diagonal_(float("inf"))  # a site is not its own neighbour
    # A stable sort keeps equal distances in index order: the tie-break.
    nearest = torch.sort(distances, dim=1, stable=True).indices[:, :k]
    edges = {(min(i, j), max(i, j)) for i in range(n_sites) for j in nearest[i].tolist()}
    return sorted(edges)


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


def _zscore_informative_features(features: torch.Tensor) -> torch.Tensor:
    """``(N, s)`` float64 -> ``(N, s')``: z-scored across rows, zero-spread columns dropped."""
    spread = features.std(dim=0, unbiased=False)
    informative = spread > 0
    centred = features[:, informative] - features[:, informative].mean(dim=0)
    return centred / spread[informative]


def _pairwise_distances(features: torch.Tensor) -> torch.Tensor:
    """``(N, s)`` -> ``(N, N)`` Euclidean distances, exactly symmetric.

    One row at a time (``O(N s)`` memory for large sketches); each pair is
    computed once and mirrored so that ``d(i, j) == d(j, i)`` bit for bit.
    """
    n_sites = features.shape[0]
    distances = torch.zeros(n_sites, n_sites, dtype=features.dtype)
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

