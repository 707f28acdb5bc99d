"""Concave fusion penalties (SCAD, MCP) of a vector's norm and their proximal map, the server step of FPFC.

A concave pairwise fusion penalty (Ma and Huang, "A concave pairwise fusion
approach to subgroup analysis", JASA 2017) charges a difference vector
``zeta`` by ``g(||zeta||_2)``, where g grows like the lasso near 0 (so small
differences are set exactly to 0: the pair fuses) and is flat beyond
``a * lam`` (so large differences are left unbiased: the pair stays apart).
FPFC (Yu, Liu, Wang and Sun, arXiv 2211.04218) uses SCAD smoothed near 0
with a small xi (``smoothing``), so that g is differentiable; xi = 0 gives the
plain penalties. For t = ||zeta|| >= 0, lam >= 0, xi < lam (SCAD) or
xi < a lam (MCP)::

    SCAD (a > 2):  g(t) = lam t^2 / (2 xi)                                  t <= xi
                          lam t - lam xi / 2                                xi < t <= lam
                          (2 a lam t - t^2 - lam^2) / (2 (a - 1)) - lam xi / 2   lam < t <= a lam
                          (a + 1) lam^2 / 2 - lam xi / 2                    t > a lam

    MCP (a > 1):   g(t) = lam t^2 / (2 xi) - t^2 / (2 a)                    t <= xi
                          lam t - lam xi / 2 - t^2 / (2 a)                  xi < t <= a lam
                          a lam^2 / 2 - lam xi / 2                          t > a lam

The proximal map ``argmin_zeta (rho / 2) ||zeta - delta||^2 + g(||zeta||)``
keeps the direction of delta and shrinks its norm s = ||delta|| to t*(s),
the minimiser of the convex (for a > 1 + 1/rho, SCAD; a > 1/rho, MCP)
scalar problem (rho / 2)(t - s)^2 + g(t)::

    SCAD: t* = xi rho s / (xi rho + lam)                         s <= xi + lam / rho
               s - lam / rho                                     s <= lam + lam / rho    (block soft threshold)
               (s - a lam / ((a - 1) rho)) / (1 - 1 / ((a - 1) rho))   s <= a lam
               s                                                 s > a lam

    MCP:  t* = xi rho s / (xi rho + lam - xi / a)                s <= xi + lam / rho - xi / (a rho)
               (s - lam / rho) / (1 - 1 / (a rho))               s <= a lam
               s                                                 s > a lam

(with xi = 0 the first regime is t* = 0: the pair fuses exactly). The SCAD
regimes are those of the authors' code, whose first one is the smoothing's;
with lam = 0 the map is the identity.
"""

from __future__ import annotations

import torch


def penalty_value(kind: str, t: torch.Tensor, lam: float, a: float, smoothing: float) -> torch.Tensor:
    """g(t) of the module docstring, elementwise, for norms ``t >= 0`` (any shape), in ``t``'s dtype."""
    xi = smoothing
    quadratic = lam * t.square() / (2 * xi) if xi > 0 else torch.zeros_like(t)
    if kind == "scad":
        middle = (2 * a * lam * t - t.square() - lam**2) / (2 * (a - 1)) - lam * xi / 2
        flat = torch.full_like(t, (a + 1) * lam**2 / 2 - lam * xi / 2)
        return torch.where(t <= xi, quadratic, torch.where(t <= lam, lam * t - lam * xi / 2, torch.where(t <= a * lam, middle, flat)))
    concave = t.square() / (2 * a)
    flat = torch.full_like(t, a * lam**2 / 2 - lam * xi / 2)
    return torch.where(t <= xi, quadratic - concave, torch.where(t <= a * lam, lam * t - lam * xi / 2 - concave, flat))


def shrunk_norm(kind: str, s: torch.Tensor, lam: float, a: float, rho: float, smoothing: float) -> torch.Tensor:
    """t*(s): the norm the proximal map gives a vector of norm ``s`` (elementwise, any shape, ``s``'s dtype)."""
    if lam == 0:
        return s.clone()
    xi = smoothing
    if kind == "scad":
        smoothed = xi * rho * s / (xi * rho + lam)
        soft = s - lam / rho
        concave = (s - a * lam / ((a - 1) * rho)) / (1 - 1 / ((a - 1) * rho))
        return torch.where(
            s <= xi + lam / rho, smoothed, torch.where(s <= lam + lam / rho, soft, torch.where(s <= a * lam, concave, s))
        )
    smoothed = xi * rho * s / (xi * rho + lam - xi / a)
    concave = (s - lam / rho) / (1 - 1 / (a * rho))
    return torch.where(s <= xi + lam / rho - xi / (a * rho), smoothed, torch.where(s <= a * lam, concave, s))


def fusion_prox(delta: torch.Tensor, kind: str, lam: float, a: float, rho: float, smoothing: float) -> torch.Tensor:
    """Row by row, ``argmin_zeta (rho / 2) ||zeta - delta_p||^2 + g(||zeta||)``.

    Args:
        delta: ``(P, d)``, one difference vector per row.
        kind: "scad" or "mcp".
        lam, a, rho, smoothing: lambda, a, rho and xi of the module docstring
            (the caller checks the conditions that make the problem convex).

    Returns:
        ``(P, d)`` like ``delta``: each row scaled by t*(s) / s (0 for a zero row).
        The norms are taken in float64.
    """
    norms = torch.linalg.vector_norm(delta, dim=1, dtype=torch.float64)
    scale = torch.where(norms > 0, shrunk_norm(kind, norms, lam, a, rho, smoothing) / norms.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return delta * scale.to(delta.dtype).unsqueeze(1)
