"""How far the sites' personal parts are from fused, and the penalty that fuses them.

pFedNet's server step is the weighted network-lasso proximal problem

    Z* = argmin_Z  1/(2 eta) ||Z - Z~||_F^2 + lam ||Z Q||_{1,p}           (1)

(``Z`` is d x N, one column per site; ``Q`` the N x M weighted incidence
matrix, column m = w_m (e_i - e_j)). Only the product ``lam * eta`` matters,
and its useful range depends on the model's scale, on ``d`` and on ``p`` by
orders of magnitude (a pair of sites fuses when ``||z~_i - z~_j||_q <= 2 w
lam eta``, ``q`` the dual norm: for p = 2 that grows like sqrt(d), for
p = inf like d). This module gives ``lam`` a scale-free footing.

**Fusion threshold.** Let ``Zbar`` hold, in every column, the mean of that
site's connected component, and ``D = Z~ - Zbar``. ``Zbar`` solves (1) iff
(KKT) some ``G`` (d x M) with ``G Q^T = D / eta`` has every column in the
dual-norm ball of radius ``lam``: ``||G[:, m]||_q <= lam``. (Component means
are kept by every solution, since ``Q^T`` maps each component's indicator
to 0.) The least-norm such ``G`` is ``G0 = (D / eta) L^+ Q`` with
``L = Q Q^T`` the weighted graph Laplacian (``(Q^T)^+ = L^+ Q``, and
``D L^+ L = D`` because D's rows sum to zero on each component). Hence

    lam_fuse  <=  lam_bar := max_m ||(D L^+ Q)[:, m]||_q / eta            (2)

with equality on a forest (there ``Q`` has full column rank, so ``G`` is
unique); on graphs with cycles ``lam_bar`` is an upper bound, found tight in
tests to within a few per cent. Computing it costs one ``(d x N) (N x M)``
product.

**Relative strength.** pFedNet's ``lam_scale: fusion`` sets, each round,
``lam_t = strength * lam_bar(Z~_t)``: 0 keeps the sites' trained parts, 1
fuses every component exactly, and the same number means the same thing for
any model, ``d``, ``p`` and ``eta`` (``lam_t eta`` does not depend on eta).

**Spread.** The between-site spread is ``S(Z) = sqrt(sum_c sum_{n in c}
||z_n - zbar_c||^2)`` (deviations from component means); a server step
removes the fraction ``1 - S(Z*) / S(Z~)`` of it: 0 = no effect, 1 = all
fused.

**Distinct parts.** The spread is dominated by the largest differences, so
a step that fuses each tight group of sites while the groups stay apart
removes little of it; :func:`distinct_parts` counts the personal parts that
remain different (columns closer than a relative tolerance count as one)
and summarises their pairwise distances.
"""

from __future__ import annotations

import math

import torch

from medfed.federated.strategies.solvers.graph import SimilarityGraph, connected_components

#: The dual norm q of each penalty norm p (1/p + 1/q = 1).
DUAL_NORM = {1.0: math.inf, 2.0: 2.0, math.inf: 1.0}


def component_means(Z: torch.Tensor, components: list[list[int]]) -> torch.Tensor:
    """``(d, N)``: every column replaced by the mean of its connected component's columns."""
    means = torch.empty_like(Z)
    for members in components:
        index = torch.tensor(members, device=Z.device)
        means[:, index] = Z[:, index].mean(dim=1, keepdim=True)
    return means


def between_site_spread(Z: torch.Tensor, components: list[list[int]]) -> float:
    """``S(Z)``: Frobenius norm of the columns' deviations from their component means."""
    return float(torch.linalg.matrix_norm(Z - component_means(Z, components)))


def fusion_threshold(Z_tilde: torch.Tensor, graph: SimilarityGraph, eta: float, p: float) -> float:
    """``lam_bar`` of equation (2): at ``lam >= lam_bar`` every component of the graph fuses.

    Args:
        Z_tilde: ``(d, N)`` proximal centre.
        graph: the weighted similarity network over the ``N`` sites.
        eta: server step ``> 0``.
        p: penalty norm, 1, 2 or inf.

    Returns:
        ``lam_bar >= 0`` (0 when there is no edge or nothing to fuse); exact
        on forests, an upper bound on graphs with cycles.
    """
    if not graph.edges:
        return 0.0
    q = graph.incidence(dtype=Z_tilde.dtype, device=Z_tilde.device)
    components = connected_components(graph.edges, graph.n_sites)
    deviation = Z_tilde - component_means(Z_tilde, components)
    laplacian_pinv = torch.linalg.pinv(q @ q.T, hermitian=True)
    multipliers = deviation @ (laplacian_pinv @ q)  # (d, M): G0 * eta
    return float(torch.linalg.vector_norm(multipliers, ord=DUAL_NORM[float(p)], dim=0).max()) / eta


def spread_removed(Z_tilde: torch.Tensor, Z: torch.Tensor, components: list[list[int]]) -> float:
    """``1 - S(Z) / S(Z~)``, the fraction of the between-site spread a server step removed (0 if none to remove)."""
    before = between_site_spread(Z_tilde, components)
    return 0.0 if before == 0.0 else 1.0 - between_site_spread(Z, components) / before


#: columns of Z closer than this fraction of their mean norm count as one personal part
DISTINCT_TOLERANCE = 1e-3


def distinct_parts(Z: torch.Tensor, relative_tolerance: float = DISTINCT_TOLERANCE) -> dict[str, float]:
    """How many different personal parts the columns of ``Z`` (d x N) are, and how far apart.

    Two columns are *the same part* when ``||z_i - z_j||_2 <= relative_tolerance
    * mean_n ||z_n||_2`` (the network lasso fuses columns exactly, up to its
    solver's tolerance, about 1e-5 relative); parts are the groups this
    relation joins (transitively), so ``distinct`` is between 1 (all fused)
    and N.

    Returns:
        ``distinct`` (float); ``distance_min``, ``distance_median``,
        ``distance_max``: the Euclidean distances over the N (N - 1) / 2
        pairs of columns, in parameter units (0 for a single column).
    """
    n = Z.shape[1]
    columns = Z.T.to(torch.float64)
    # exact differences (the matrix-product form of cdist loses the small distances of fused columns)
    distances = torch.cdist(columns, columns, compute_mode="donot_use_mm_for_euclid_dist")
    pairs = torch.triu_indices(n, n, offset=1, device=Z.device)
    between = distances[pairs[0], pairs[1]]
    scale = float(torch.linalg.vector_norm(columns, dim=1).mean())
    same = (between <= relative_tolerance * scale).tolist()
    edges = [(int(i), int(j)) for i, j, joined in zip(pairs[0].tolist(), pairs[1].tolist(), same) if joined]
    summary = {"distinct": float(len(connected_components(edges, n)))}
    if between.numel() == 0:
        return {**summary, "distance_min": 0.0, "distance_median": 0.0, "distance_max": 0.0}
    return {
        **summary,
        "distance_min": float(between.min()),
        "distance_median": float(between.median()),
        "distance_max": float(between.max()),
    }
