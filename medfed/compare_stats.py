"""Statistics of a comparison's tables: intervals over seeds, paired differences, ranks, the best group, plateaus.

Input is compare's long table (``comparison.csv``): one row per run and
site, ``{"config": setting, "strategy": method, "seed": int, "site": str,
<column>: float or None, ...}``; a *column* is one of its metric columns
(``last_<m>`` or ``selected_<m>``), higher is better but for distances and
losses (:func:`lower_is_better`: HD95 in mm, a loss), whose best, ranks and
worst site go the other way. A value of None (a
metric missing at a round) is left out. Numbers are in the metric's own
units (a 0-1 score: 0.005 is half a percentage point).

**The seed is the unit of replication.** The sites of one run train in one
federation, on one data draw, from one initialisation: their values are
correlated, and a t interval over the (seed, site) pairs taken as
independent draws is too narrow (:func:`coverage`: with 5 seeds of 5 sites
and an intra-seed correlation of 0.1 it covers the true difference about
90% of the time, at 0.3 about 80%, at 0.7 about 64%, instead of 95%).
Every interval here is therefore over seeds: each seed's sites are first
averaged, and the seeds' values are taken as independent normal draws (the
t over S seeds has S - 1 degrees of freedom and keeps its 95% whatever the
correlation of a seed's sites; for a balanced table it is the fixed-effect
test of a mixed model with a random intercept per seed). A percentile
bootstrap that resamples whole seeds covers about 84% with 5 seeds and 75%
with 3 (too few clusters for a bootstrap): all measured by :func:`coverage`,
which tests/test_compare_stats.py runs. For each setting and method:

- **over seeds** (:func:`summarise`): the *run value* of a seed is the mean
  over its sites; the cell is the mean and sample standard deviation
  (ddof 1) of the run values and a 95% Student t interval for their mean,
  ``mean ± t(0.975, S - 1) · std / √S``.
- **the worst site** (:func:`worst_site_values`): per seed, the lowest of
  its sites' values (the highest, where lower is better); summarised over seeds as above.
- **paired against another method** (:func:`pair_up`): per seed, the mean
  over the sites both have of ``d = method − other`` (same seed: the same
  data draw and split, initialisation and sampler draws), then the mean of
  those S seed differences with a 95% t interval over them (``S - 1``
  degrees of freedom) and the two-sided p value of the paired t test of
  mean 0; the win/tie/loss counts describe the (seed, site) pairs (tie:
  ``|d| <= tolerance``; a win is d > 0, d < 0 where lower is better) and are no test.
- **average rank** (:func:`average_ranks`): in each setting the methods are
  ranked by their mean over seeds, rank 1 the highest, equal means sharing
  the average of their ranks (``scipy.stats.rankdata``); a method's average
  rank is the mean of its ranks over the settings where every method has a
  value (settings with a missing method are left out of every average,
  so all averages are over the same settings).
- **indistinguishable from the best** (:func:`best_group`): the *best*
  method of a setting has the highest mean over seeds (of equal ones, the
  first in the grid's order); every other method is tested against it
  (the seed-level paired t test above), and Holm's step-down correction
  over those M - 1 tests (Holm 1979) keeps the chance of calling any method
  worse than the best when it is not at most 5%: a method is in the best
  group unless its test is rejected after the correction. The best is in its
  own group; a method with fewer than 2 seeds paired with the best has no
  test and is not in it.

Per run, from its validation curve (:func:`plateau_status`): whether it had
stopped improving by its last round.

Only numpy and scipy: the tables are written (and these tested) without torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
"""Coverage of every interval."""
TIE_TOLERANCE = 0.005
"""A paired difference with ``|d| <= TIE_TOLERANCE`` is a tie (half a point of a 0-1 metric)."""
PLATEAU_ROUNDS = 5
"""k: a run has plateaued when its last k rounds did not improve on the best before them."""
PLATEAU_TOLERANCE = 0.005
"""An improvement of at most this much over the earlier best does not count as improving."""

Key = tuple[str, str]
"""``(setting, method)``: a cell of the tables."""
LOWER_IS_BETTER = ("hd95", "loss")
"""A metric whose name holds one of these is better when lower (a Hausdorff distance in mm, a loss)."""


def lower_is_better(column: str) -> bool:
    """Whether a metric column (``last_hd95_wt``, ``selected_lesion_hd95_et``, ``last_auroc``) is better when lower."""
    return any(word in column for word in LOWER_IS_BETTER)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student t interval for the mean of ``values``: ``mean ± t((1 + c) / 2, n - 1) · s / √n`` (s: ddof 1).

    ``(nan, nan)`` for fewer than 2 values; ``(mean, mean)`` when they are all equal.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return math.nan, math.nan
    mean = float(values.mean())
    half = float(stats.t.ppf((1 + confidence) / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean - half, mean + half


@dataclass(frozen=True)
class Summary:
    """A cell over seeds: ``n`` run values (one per seed, each the mean over sites).

    Attributes:
        n: the seeds with a value.
        mean, std: their mean and sample standard deviation (ddof 1; nan for one seed, both nan for none).
        low, high: the 95% t interval for the mean (nan for fewer than 2 seeds).
    """

    n: int
    mean: float
    std: float
    low: float
    high: float


def summarise(values: Sequence[float]) -> Summary:
    """:class:`Summary` of the run values of one (setting, method)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    std = float(values.std(ddof=1)) if values.size > 1 else math.nan
    return Summary(int(values.size), float(values.mean()), std, *t_interval(values))


@dataclass(frozen=True)
class Paired:
    """A method against another: ``d = method − other`` per seed (mean over the sites both have), then over seeds.

    Attributes:
        n: the seeds paired (the replication unit: the interval's S).
        mean: the mean of the seed differences (nan for none).
        low, high: the 95% t interval of that mean over the seeds (nan for fewer than 2).
        p_value: two-sided p of the paired t test of mean 0 over the seeds (nan for fewer than 2; 1 when every
            seed difference is 0, 0 when they are all one other value).
        pairs: the (seed, site) pairs behind them.
        wins, ties, losses: pairs with ``d > tolerance``, ``|d| <= tolerance``, ``d < −tolerance`` (a description,
            not a test: the pairs of one seed are correlated).
    """

    n: int
    mean: float
    low: float
    high: float
    p_value: float
    pairs: int
    wins: int
    ties: int
    losses: int

    @property
    def contains_zero(self) -> bool:
        """Whether the interval contains 0 (ends included); False without an interval."""
        return self.low <= 0.0 <= self.high


def t_test_p(values: Sequence[float]) -> float:
    """Two-sided p of the one-sample t test of mean 0 (nan for fewer than 2 values; 1 for all 0, 0 for all one other value)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return math.nan
    std = values.std(ddof=1)
    if std == 0:
        return 1.0 if values[0] == 0 else 0.0
    t = values.mean() / (std / math.sqrt(values.size))
    return float(2 * stats.t.sf(abs(t), values.size - 1))


def paired_difference(
    seed_differences: Sequence[float], pair_differences: Sequence[float] = (), tolerance: float = TIE_TOLERANCE
) -> Paired:
    """:class:`Paired` from each seed's mean difference and the (seed, site) pairs' differences (for W/T/L)."""
    d = np.asarray(seed_differences, dtype=np.float64)
    pairs = np.asarray(pair_differences, dtype=np.float64)
    wins, losses = int((pairs > tolerance).sum()), int((pairs < -tolerance).sum())
    mean = float(d.mean()) if d.size else math.nan
    return Paired(int(d.size), mean, *t_interval(d), t_test_p(d), int(pairs.size), wins, int(pairs.size) - wins - losses, losses)


def site_values(rows: Iterable[dict[str, Any]], column: str) -> dict[Key, dict[tuple[int, str], float]]:
    """``{(setting, method): {(seed, site): value of column}}``, rows whose value is None left out."""
    values: dict[Key, dict[tuple[int, str], float]] = {}
    for row in rows:
        if row[column] is not None:
            values.setdefault((row["config"], row["strategy"]), {})[(int(row["seed"]), row["site"])] = float(row[column])
    return values


def by_seed(values: dict[tuple[int, str], float]) -> dict[int, list[float]]:
    """``{seed: its sites' values}`` of one cell's ``{(seed, site): value}``, seeds in the cell's order."""
    per_seed: dict[int, list[float]] = {}
    for (seed, _), value in values.items():
        per_seed.setdefault(seed, []).append(value)
    return per_seed


def seed_values(rows: Iterable[dict[str, Any]], column: str) -> dict[Key, dict[int, float]]:
    """``{(setting, method): {seed: the mean over its sites of column}}`` (the run values), seeds in row order."""
    return {key: {seed: float(np.mean(v)) for seed, v in by_seed(pairs).items()} for key, pairs in site_values(rows, column).items()}


def worst_site_values(rows: Iterable[dict[str, Any]], column: str) -> dict[Key, dict[int, float]]:
    """``{(setting, method): {seed: the worst of its sites' values of column}}``: the lowest, the highest where lower is better."""
    worst = np.max if lower_is_better(column) else np.min
    return {key: {seed: float(worst(v)) for seed, v in by_seed(pairs).items()} for key, pairs in site_values(rows, column).items()}


def pair_up(method: dict[tuple[int, str], float], other: dict[tuple[int, str], float], tolerance: float = TIE_TOLERANCE) -> Paired:
    """``method − other`` on the (seed, site) pairs both have (in ``method``'s order), at the seed level (:class:`Paired`)."""
    per_seed: dict[int, list[float]] = {}
    for (seed, site), value in method.items():
        if (seed, site) in other:
            per_seed.setdefault(seed, []).append(value - other[(seed, site)])
    pairs = [d for values in per_seed.values() for d in values]
    return paired_difference([float(np.mean(values)) for values in per_seed.values()], pairs, tolerance)


def average_ranks(
    means: dict[Key, float], settings: Sequence[str], strategies: Sequence[str], lower_better: bool = False
) -> tuple[dict[str, float], list[str]]:
    """Each method's mean rank over settings (1 = the highest mean, the lowest with ``lower_better``; equal means
    share their average rank).

    Args:
        means: ``{(setting, method): mean over seeds}``; a missing or nan entry is no value.
        settings, strategies: the table's columns and rows.
        lower_better: the metric is better when lower (:func:`lower_is_better`).

    Returns:
        ``({method: average rank}, the settings ranked)``; only settings where
        every method has a value are ranked (nan ranks if none is).
    """
    ranked = [s for s in settings if all(math.isfinite(means.get((s, m), math.nan)) for m in strategies)]
    if not ranked:
        return {m: math.nan for m in strategies}, []
    sign = 1.0 if lower_better else -1.0
    ranks = np.stack([stats.rankdata([sign * means[(s, m)] for m in strategies], method="average") for s in ranked])
    return {m: float(rank) for m, rank in zip(strategies, ranks.mean(axis=0))}, ranked


def holm_rejected(p_values: dict[str, float], alpha: float = 1 - CONFIDENCE) -> set[str]:
    """The hypotheses Holm's step-down procedure rejects at family-wise level ``alpha`` (nan p values are never rejected).

    Sorted ascending, ``p_(k)`` (k = 1..M) is rejected while ``p_(j) <= alpha / (M - j + 1)`` for every j <= k.
    """
    finite = sorted((p, name) for name, p in p_values.items() if math.isfinite(p))
    m = len(p_values)
    rejected = set()
    for k, (p, name) in enumerate(finite):
        if p > alpha / (m - k):
            break
        rejected.add(name)
    return rejected


def best_group(
    values: dict[Key, dict[tuple[int, str], float]], means: dict[Key, float], setting: str, strategies: Sequence[str],
    lower_better: bool = False,
) -> tuple[str | None, set[str]]:
    """The best method of ``setting`` and the methods indistinguishable from it (itself included; Holm-corrected).

    Args:
        values: :func:`site_values`.
        means: ``{(setting, method): mean over seeds}``.
        setting: the setting.
        strategies: the methods in the grid's order (the first of equal best means wins).
        lower_better: the best mean is the lowest (:func:`lower_is_better`).

    Returns:
        ``(best, group)``: ``(None, set())`` when no method has a value.
    """
    present = [m for m in strategies if math.isfinite(means.get((setting, m), math.nan))]
    if not present:
        return None, set()
    sign = -1.0 if lower_better else 1.0
    best = max(present, key=lambda m: sign * means[(setting, m)])  # max keeps the first of equal ones
    tests = {m: pair_up(values[(setting, m)], values[(setting, best)]) for m in present if m != best}
    rejected = holm_rejected({m: paired.p_value for m, paired in tests.items()})
    return best, {best} | {m for m, paired in tests.items() if paired.n >= 2 and m not in rejected}


@dataclass(frozen=True)
class Cell:
    """Everything a table shows for one (setting, method).

    Attributes:
        summary: over seeds.
        worst: the worst site's value per seed, over seeds.
        versus_reference: paired against the reference method (None when the reference has no value in this setting).
        with_best: in the setting's best group.
    """

    summary: Summary
    worst: Summary
    versus_reference: Paired | None
    with_best: bool


@dataclass(frozen=True)
class TableStatistics:
    """The statistics of one table (a column of the long table, methods x settings).

    Attributes:
        cells: ``{(setting, method): Cell}`` for every setting and method (an empty summary where no run finished).
        ranks: ``{method: average rank}`` over ``ranked``.
        ranked: the settings the ranks average over.
        best: ``{setting: the best method}`` (None where no method has a value).
    """

    cells: dict[Key, Cell]
    ranks: dict[str, float]
    ranked: list[str]
    best: dict[str, str | None]


def table_statistics(
    rows: Iterable[dict[str, Any]],
    column: str,
    settings: Sequence[str],
    strategies: Sequence[str],
    reference: str,
    tolerance: float = TIE_TOLERANCE,
    extra: Sequence[str] = (),
) -> TableStatistics:
    """Summaries, worst sites, paired differences against ``reference``, ranks and best groups of ``column`` (see the module's docstring).

    ``extra``: rows (the baselines) that get cells and paired differences but no rank and no place in a best group.
    """
    rows = list(rows)
    values, per_seed, worst = site_values(rows, column), seed_values(rows, column), worst_site_values(rows, column)
    everything = [*strategies, *extra]
    summaries = {(s, m): summarise(list(per_seed.get((s, m), {}).values())) for s in settings for m in everything}
    means = {key: summary.mean for key, summary in summaries.items()}
    lower_better = lower_is_better(column)
    ranks, ranked = average_ranks(means, settings, strategies, lower_better)
    cells, best = {}, {}
    for s in settings:
        best[s], group = best_group(values, means, s, strategies, lower_better)
        against = values.get((s, reference))
        for m in everything:
            paired = pair_up(values[(s, m)], against, tolerance) if against is not None and (s, m) in values else None
            if paired is not None and lower_better:  # a win is a lower value
                paired = dataclasses.replace(paired, wins=paired.losses, losses=paired.wins)
            lowest = summarise(list(worst.get((s, m), {}).values()))
            cells[(s, m)] = Cell(summaries[(s, m)], lowest, paired, m in group)
    return TableStatistics(cells, ranks, ranked, best)


INTERVALS = ("pairs_t", "seeds_t", "seed_bootstrap")
"""The interval methods :func:`coverage` measures: a t over the (seed, site) pairs taken as independent (what
medfed's tables used before), a t over the seeds' mean differences (what they use), a percentile bootstrap that
resamples whole seeds."""


def simulated_differences(
    n_seeds: int, n_sites: int, correlation: float, replicates: int, rng: np.random.Generator, difference: float = 0.0
) -> np.ndarray:
    """``(replicates, n_seeds, n_sites)`` paired differences of a comparison whose sites share their seed.

    ``d[s, i] = difference + a_s + e_{s,i}`` with ``a_s ~ N(0, ρ)`` (what a seed's federation, data draw and
    initialisation give all its sites) and ``e_{s,i} ~ N(0, 1 − ρ)``: unit variance, intra-seed correlation ρ.
    """
    shared = rng.normal(0.0, math.sqrt(correlation), size=(replicates, n_seeds, 1))
    own = rng.normal(0.0, math.sqrt(1.0 - correlation), size=(replicates, n_seeds, n_sites))
    return difference + shared + own


def interval_bounds(d: np.ndarray, method: str, rng: np.random.Generator, resamples: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """95% intervals for the mean difference of each replicate of ``d`` (``(replicates, seeds, sites)``) by ``method`` (:data:`INTERVALS`)."""
    replicates, n_seeds, n_sites = d.shape
    quantile = (1 + CONFIDENCE) / 2
    if method == "pairs_t":
        flat = d.reshape(replicates, -1)
        half = stats.t.ppf(quantile, flat.shape[1] - 1) * flat.std(axis=1, ddof=1) / math.sqrt(flat.shape[1])
        return flat.mean(axis=1) - half, flat.mean(axis=1) + half
    seeds = d.mean(axis=2)  # (replicates, seeds)
    if method == "seeds_t":
        half = stats.t.ppf(quantile, n_seeds - 1) * seeds.std(axis=1, ddof=1) / math.sqrt(n_seeds)
        return seeds.mean(axis=1) - half, seeds.mean(axis=1) + half
    if method == "seed_bootstrap":
        draws = rng.integers(0, n_seeds, size=(replicates, resamples, n_seeds))
        means = np.take_along_axis(seeds[:, None, :], draws, axis=2).mean(axis=2)
        return np.quantile(means, 1 - quantile, axis=1), np.quantile(means, quantile, axis=1)
    raise ValueError(f"interval method {method!r}: expected one of {', '.join(INTERVALS)}")


def coverage(method: str, n_seeds: int, n_sites: int, correlation: float, replicates: int = 4000, seed: int = 0) -> float:
    """The share of simulated comparisons (:func:`simulated_differences`, true difference 0) whose 95% interval
    by ``method`` contains the true difference: 0.95 for an interval that means what it says."""
    rng = np.random.default_rng(seed)
    d = simulated_differences(n_seeds, n_sites, correlation, replicates, rng)
    low, high = interval_bounds(d, method, rng)
    return float(np.mean((low <= 0.0) & (0.0 <= high)))


def validation_curve(history: Sequence[dict[str, Any]], metric: str, key: str = "validation") -> list[float]:
    """A run's validation curve: per round, the mean over sites of ``record[key][site][metric]`` (``key``
    ``"validation"``: the validation split beside the test split; ``"metrics"`` for a run whose evaluated split
    is its validation split, ``holdout: validation``).

    Non-finite or missing scores are left out of a round's mean; a round with none is left out.
    """
    curve = []
    for record in history:
        scores = [s.get(metric) for s in record.get(key, {}).values()]
        scores = [float(s) for s in scores if s is not None and math.isfinite(s)]
        if scores:
            curve.append(float(np.mean(scores)))
    return curve


def plateau_status(curve: Sequence[float], rounds: int = PLATEAU_ROUNDS, tolerance: float = PLATEAU_TOLERANCE) -> str:
    """Whether a validation curve (higher is better) had stopped improving over its last ``rounds`` rounds.

    With ``k = rounds``, ``early`` before ``before = max(curve[:-k])`` is defined
    (fewer than k + 1 values: an early-training snapshot); else
    ``plateaued`` when ``max(curve[-k:]) <= before + tolerance`` (the last k
    rounds did not beat the earlier best by more than the tolerance),
    ``improving`` otherwise.
    """
    if rounds < 1:
        raise ValueError(f"rounds = {rounds}: expected an integer >= 1")
    if len(curve) < rounds + 1:
        return "early"
    return "plateaued" if max(curve[-rounds:]) <= max(curve[:-rounds]) + tolerance else "improving"
