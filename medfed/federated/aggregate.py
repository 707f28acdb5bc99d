"""Server-side aggregation of equally shaped vectors: the sample-weighted mean, and robust rules that bound one site's pull.

``weighted_average`` is FedAvg's rule. The robust rules answer a hospital
that sends a plausible but poisoned update (scaled, sign-flipped), which
the mean follows without limit: one site of K moves it by its own
deviation / K, whatever that is. Each rule works on K replies ``x_k`` (d,)
of one key, with the server's previous value ``g`` (what the sites started
from) where it needs updates ``x_k - g``:

* ``median`` -- the coordinate-wise median (Yin, Chen, Ramchandran and
  Bartlett, *Byzantine-robust distributed learning: towards optimal
  statistical rates*, ICML 2018, Definition 1): ``agg_j = med_k x_kj``
  (the mean of the two middle values for even K); unweighted.
* ``trimmed_mean`` -- the coordinate-wise beta-trimmed mean (Yin et al. 2018,
  Definition 2): per coordinate, sort the K values, drop the
  ``b = floor(beta K)`` smallest and largest, average the other ``K - 2b``;
  unweighted (beta < 1/2).
* ``norm_bounded`` -- norm bounding (Sun, Kairouz, Suresh and McMahan, *Can
  you really backdoor federated learning?*, 2019, section 4): each update is
  scaled to L2 norm at most M, ``u_k = (x_k - g) / max(1, ||x_k - g|| / M)``,
  and ``agg = g + sum_k n_k u_k / sum_k n_k`` (sample-weighted as FedAvg).
  M is ``norm_bound``; with none given, the median of the round's update
  norms (an adaptive M: Sun et al. fix M in advance, which needs knowing the
  update's scale).

Median and trimmed mean are translation-equivariant, so they give the same
result on models as on updates (``g + rule(x_k - g) = rule(x_k)``) and need
no ``g``. With at most ``b`` hostile sites of K (``b < K/2`` for the median,
``b <= floor(beta K)`` for the trimmed mean), every coordinate of the result
lies between the smallest and the largest honest value of that coordinate:
a hostile site moves it by at most the honest sites' own spread, whatever it
sends. The mean has no such bound; norm bounding bounds a site's pull to
``n_k M / sum n`` in L2 but does not stop a sign flip within M.

Every rule reads all K vectors of a key at once, so none can run on a
securely aggregated sum (the server sees only ``sum_k n_k x_k``); a run asking
for one with secure aggregation or client-level DP is refused by name
(:func:`refuse_robust_aggregation`). Median and trimmed mean sort in chunks
of :data:`CHUNK` coordinates: a (K, CHUNK) copy at a time, never (K, d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medfed.config import AGGREGATIONS

CHUNK = 1 << 20
"""Coordinates sorted at once by the median and the trimmed mean."""


def weighted_average(vectors: list[torch.Tensor], weights: list[float] | torch.Tensor) -> torch.Tensor:
    """Sample-weighted mean of equally shaped vectors.

    Args:
        vectors: K tensors of shape ``(d,)``.
        weights: K non-negative weights (e.g. training-set sizes), not all zero.

    Returns:
        ``sum_k w_k v_k / sum_k w_k``, shape ``(d,)``, dtype of the vectors,
        summed in place one vector after another (no (K, d) stack: the
        replies are already K model-sized vectors in memory).
    """
    if not vectors:
        raise ValueError("weighted_average needs at least one vector")
    w = _weights(weights, len(vectors))
    total = torch.zeros_like(vectors[0])
    for share, vector in zip((w / w.sum()).tolist(), vectors):
        total.add_(vector, alpha=share)
    return total


def coordinate_median(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of K equally shaped vectors (the mean of the two middle values for even K)."""
    count = len(vectors)
    return _sorted_mean(vectors, (count - 1) // 2, count // 2 + 1)


def trimmed_mean(vectors: list[torch.Tensor], beta: float) -> torch.Tensor:
    """The coordinate-wise mean of K equally shaped vectors after dropping the ``floor(beta K)`` smallest and largest values."""
    if not 0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta {beta} is not in [0, 1/2)")
    trim = int(beta * len(vectors))
    return _sorted_mean(vectors, trim, len(vectors) - trim)


def norm_bounded_mean(
    vectors: list[torch.Tensor], weights: list[float] | torch.Tensor, reference: torch.Tensor, bound: float | None
) -> torch.Tensor:
    """``reference`` plus the weighted mean of the updates ``vectors[k] - reference`` each scaled to L2 norm at most
    ``bound`` (None: the median of their norms). Memory: one update at a time beside the sum."""
    if not vectors:
        raise ValueError("norm_bounded_mean needs at least one vector")
    w = _weights(weights, len(vectors))
    norms = torch.stack([torch.linalg.vector_norm((vector - reference).double()) for vector in vectors])  # (K,)
    limit = torch.median(norms) if bound is None else torch.tensor(float(bound), dtype=torch.float64, device=norms.device)
    scales = (limit / norms.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0)  # one host read: the K factors
    total = reference.clone()
    for share, scale, vector in zip((w / w.sum()).tolist(), scales.tolist(), vectors):
        total.add_(vector - reference, alpha=share * scale)
    return total


def _sorted_mean(vectors: list[torch.Tensor], low: int, high: int) -> torch.Tensor:
    """Per coordinate, the mean of the K values' order statistics ``low`` to ``high - 1`` (0-based, ascending)."""
    if not vectors:
        raise ValueError("a robust aggregate needs at least one vector")
    first = vectors[0]
    out = torch.empty_like(first).reshape(-1)
    for start in range(0, first.numel(), CHUNK):
        chunk = torch.stack([vector.reshape(-1)[start:start + CHUNK] for vector in vectors])  # (K, c)
        out[start:start + CHUNK] = torch.sort(chunk, dim=0).values[low:high].mean(dim=0)
    return out.reshape(first.shape)


def _weights(weights: list[float] | torch.Tensor, count: int) -> torch.Tensor:
    """K non-negative weights with a positive sum, float64 on the host (a few numbers)."""
    w = torch.as_tensor(weights, dtype=torch.float64, device="cpu").flatten()
    if w.numel() != count or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"weights must be {count} non-negative numbers with a positive sum, got {w.tolist()}")
    return w


@dataclass(frozen=True)
class Aggregation:
    """How a server half combines the K replies of one averaged key (``aggregation`` config group; module docstring).

    Attributes:
        name: one of :data:`~medfed.config.AGGREGATIONS`.
        trim: beta of ``trimmed_mean``, the fraction dropped at each end.
        norm_bound: M of ``norm_bounded`` (None: the median of the round's update norms).
    """

    name: str = "mean"
    trim: float = 0.2
    norm_bound: float | None = None

    def __post_init__(self) -> None:
        if self.name not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.name!r}: expected one of {', '.join(AGGREGATIONS)}")

    def __call__(self, vectors: list[torch.Tensor], weights: list[float] | torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
        """The aggregate of ``vectors`` (sample ``weights``; ``reference``: the value the sites started from)."""
        if self.name == "median":
            return coordinate_median(vectors)
        if self.name == "trimmed_mean":
            return trimmed_mean(vectors, self.trim)
        if self.name == "norm_bounded":
            if reference is None:
                raise ValueError("norm_bounded needs the value the sites started from")
            return norm_bounded_mean(vectors, weights, reference, self.norm_bound)
        return weighted_average(vectors, weights)
