"""Label-imbalance federations: each site gets its own negative-to-positive ratio.

pFedNet (section VI-A) builds its classification federations by label
imbalance delta = n_negative / n_positive. This module makes the sites differ
around the federation's delta as follows.

Target ratios. Site s = 0 .. S-1 gets

    delta_s = delta * spread ** ((s - (S-1)/2) / ((S-1)/2))      (S > 1; delta_0 = delta for S = 1)

a geometric spread from delta / spread (site 0) to delta * spread (site S-1)
whose geometric mean is delta; ``spread = 1`` gives every site delta.

Samples per site. Each site draws from its own pool of samples: the pre-assigned
site of every sample when one is given (e.g. the acquisition site of each CT
series from ``partitioning.csv``), otherwise a seeded random assignment
stratified by label (positives and negatives are each shuffled and dealt into S
near-equal shares). From its pool of P positives and N negatives the site keeps
the largest subset at its ratio: p positives, the most with
round(delta_s * p) <= N (at most P), and n = round(delta_s * p) negatives
(round half up), each drawn uniformly at random without replacement. So
n / p = delta_s up to the rounding of one negative, and a site with fewer
negatives than its ratio asks uses fewer positives.

The result is the data each site owns; splitting it into the site's train and
test rows (80 % / 20 % in the paper) is the caller's step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LabelRatioPartition:
    """Which samples each site keeps.

    Attributes:
        site_indices: one int64 array per site, sorted indices into the labels
            passed in; the arrays are disjoint.
        target_ratios: float64 (S,), delta_s asked of each site.
        realised_ratios: float64 (S,), n_negative / n_positive of each site's samples.
        n_positive: int64 (S,), positives kept per site.
        n_negative: int64 (S,), negatives kept per site.
    """

    site_indices: tuple[np.ndarray, ...]
    target_ratios: np.ndarray
    realised_ratios: np.ndarray
    n_positive: np.ndarray
    n_negative: np.ndarray


def site_ratios(delta: float, n_sites: int, spread: float) -> np.ndarray:
    """float64 (n_sites,): delta * spread ** ((s - c) / c) with c = (n_sites - 1) / 2, increasing in s.

    Raises:
        ValueError: delta <= 0, spread < 1, or n_sites < 1.
    """
    if not delta > 0:
        raise ValueError(f"delta (n_negative / n_positive) must be > 0, got {delta}")
    if not spread >= 1:
        raise ValueError(f"spread must be >= 1 (1 = every site gets delta), got {spread}")
    if n_sites < 1:
        raise ValueError(f"n_sites must be >= 1, got {n_sites}")
    if n_sites == 1:
        return np.array([float(delta)])
    centre = (n_sites - 1) / 2
    return delta * spread ** ((np.arange(n_sites) - centre) / centre)


def partition_by_label_ratio(
    labels,
    *,
    n_sites: int,
    delta: float,
    spread: float = 1.5,
    seed: int,
    site_of_sample=None,
) -> LabelRatioPartition:
    """Give each site a subset of the samples at its target label ratio (see the module docstring).

    Args:
        labels: (n,) 0/1 labels, 1 = positive.
        n_sites: number of sites S.
        delta: the federation's n_negative / n_positive.
        spread: sites range from delta / spread to delta * spread.
        seed: seeds the site assignment (when not given) and the draws.
        site_of_sample: optional (n,) int site of each sample in 0 .. S-1.

    Returns:
        The per-site indices, target and realised ratios, and counts.

    Raises:
        ValueError: labels not 0/1, site ids out of range, delta <= 0,
            spread < 1, or a site without a positive or without enough
            negatives for one positive at its ratio (the message gives what it
            has and what it needs).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be a 1-D array of 0 (negative) and 1 (positive)")
    targets = site_ratios(delta, n_sites, spread)
    rng = np.random.default_rng(seed)
    if site_of_sample is None:
        site_of_sample = _stratified_assignment(labels, n_sites, rng)
    site_of_sample = np.asarray(site_of_sample)
    if site_of_sample.shape != labels.shape:
        raise ValueError(f"site_of_sample must have one entry per label ({labels.shape}), got {site_of_sample.shape}")
    if not np.isin(site_of_sample, np.arange(n_sites)).all():
        raise ValueError(f"site_of_sample must hold site ids 0 .. {n_sites - 1}")

    site_indices, n_positive, n_negative = [], [], []
    for site, ratio in enumerate(targets):
        positives = np.flatnonzero((site_of_sample == site) & (labels == 1))
        negatives = np.flatnonzero((site_of_sample == site) & (labels == 0))
        n_pos = _positives_that_fit(len(positives), len(negatives), ratio)
        if n_pos == 0:
            raise ValueError(
                f"site {site} has {len(positives)} positives and {len(negatives)} negatives; its ratio "
                f"{ratio:.3g} needs at least 1 positive and {_round_half_up(ratio)} negatives"
            )
        n_neg = _round_half_up(ratio * n_pos)
        chosen = np.concatenate(
            [rng.choice(positives, size=n_pos, replace=False), rng.choice(negatives, size=n_neg, replace=False)]
        )
        site_indices.append(np.sort(chosen).astype(np.int64))
        n_positive.append(n_pos)
        n_negative.append(n_neg)

    n_positive, n_negative = np.array(n_positive, dtype=np.int64), np.array(n_negative, dtype=np.int64)
    return LabelRatioPartition(
        site_indices=tuple(site_indices),
        target_ratios=targets,
        realised_ratios=n_negative / n_positive,
        n_positive=n_positive,
        n_negative=n_negative,
    )


def _round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def _positives_that_fit(n_available_pos: int, n_available_neg: int, ratio: float) -> int:
    """Largest p <= n_available_pos with round(ratio * p) <= n_available_neg (0 if none)."""
    p = min(n_available_pos, int(np.floor((n_available_neg + 0.5) / ratio)))
    while p > 0 and _round_half_up(ratio * p) > n_available_neg:  # at most a step or two of float rounding
        p -= 1
    return p


def _stratified_assignment(labels: np.ndarray, n_sites: int, rng: np.random.Generator) -> np.ndarray:
    """int64 (n,): site of each sample; each label's samples shuffled and dealt into near-equal shares."""
    site_of_sample = np.empty(len(labels), dtype=np.int64)
    for label in (0, 1):
        members = rng.permutation(np.flatnonzero(labels == label))
        for site, share in enumerate(np.array_split(members, n_sites)):
            site_of_sample[share] = site
    return site_of_sample
