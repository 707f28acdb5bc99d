"""Statistics of a comparison's tables: intervals over seeds, paired differences, ranks, the best group, plateaus.

Input is compare's long table (``comparison.csv``): one row per run and
site, ``{"config": setting, "strategy": method, "seed": int, "site": str,
<column>: float or None, ...}``; a *column* is one of its metric columns
(``last_<m>`` or ``selected_<m>``), higher is better. A value of None (a
metric missing at a round) is left out. Numbers are in the metric's own
units (a 0-1 score: 0.005 is half a percentage point).

For each setting and method:

- **over seeds** (:func:`summarise`): the *run value* of a seed is the mean
  over its sites; the cell is the mean and sample standard deviation
  (ddof 1) of the run values and a 95% Student t interval for their mean,
  ``mean ± t(0.975, n - 1) · std / √n`` — it assumes the seeds' run values
  are independent draws from a normal distribution (with 3 seeds, t(0.975,
  2) = 4.30: the interval is wide on purpose).
- **paired against a reference method** (:func:`paired_difference`): on
  every (seed, site) both methods have a value, ``d = method − reference``
  (same seed: the same data split, initialisation and sampler draws); the
  mean of d with a 95% t interval over the pairs, and the win/tie/loss
  counts (tie: ``|d| <= tolerance``). The interval treats the n pairs as
  independent normal draws. Sites of one run are not independent (they
  train in the same federation), so it is narrower than an interval that
  modelled that correlation would be: read it as a screen, not a test at
  exactly 5%.
- **average rank** (:func:`average_ranks`): in each setting the methods are
  ranked by their mean over seeds, rank 1 the highest, equal means sharing
  the average of their ranks (``scipy.stats.rankdata``); a method's average
  rank is the mean of its ranks over the settings where every method has a
  value (settings with a missing method are left out of every average,
  so all averages are over the same settings).
- **indistinguishable from the best** (:func:`best_group`): the *best*
  method of a setting has the highest mean over seeds (of equal ones, the
  first in the grid's order); a method belongs to the best group when the
  95% paired interval of ``method − best`` (as above, over the (seed,
  site) pairs both have) contains 0, ends included. The best is in its own
  group; a method with fewer than 2 pairs has no interval and is not in it.

Per run, from its validation curve (:func:`plateau_status`): whether it had
stopped improving by its last round.

Only numpy and scipy: the tables are written (and these tested) without torch.
"""

from __future__ import annotations

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
    """A method against another on the (seed, site) pairs both have: ``d = method − other``.

    Attributes:
        n: the pairs.
        mean: the mean of d (nan for no pair).
        low, high: the 95% t interval of the mean of d over the pairs (nan for fewer than 2).
        wins, ties, losses: pairs with ``d > tolerance``, ``|d| <= tolerance``, ``d < −tolerance``.
    """

    n: int
    mean: float
    low: float
    high: float
    wins: int
    ties: int
    losses: int

    @property
    def contains_zero(self) -> bool:
        """Whether the interval contains 0 (ends included); False without an interval."""
        return self.low <= 0.0 <= self.high


def paired_difference(differences: Sequence[float], tolerance: float = TIE_TOLERANCE) -> Paired:
    """:class:`Paired` from the per-pair differences ``d = method − other``."""
    d = np.asarray(differences, dtype=np.float64)
    mean = float(d.mean()) if d.size else math.nan
    wins, losses = int((d > tolerance).sum()), int((d < -tolerance).sum())
    return Paired(int(d.size), mean, *t_interval(d), wins, int(d.size) - wins - losses, losses)


def site_values(rows: Iterable[dict[str, Any]], column: str) -> dict[Key, dict[tuple[int, str], float]]:
    """``{(setting, method): {(seed, site): value of column}}``, rows whose value is None left out."""
    values: dict[Key, dict[tuple[int, str], float]] = {}
    for row in rows:
        if row[column] is not None:
            values.setdefault((row["config"], row["strategy"]), {})[(int(row["seed"]), row["site"])] = float(row[column])
    return values


def seed_values(rows: Iterable[dict[str, Any]], column: str) -> dict[Key, dict[int, float]]:
    """``{(setting, method): {seed: the mean over its sites of column}}`` (the run values), seeds in row order."""
    means: dict[Key, dict[int, float]] = {}
    for key, by_pair in site_values(rows, column).items():
        per_seed: dict[int, list[float]] = {}
        for (seed, _), value in by_pair.items():
            per_seed.setdefault(seed, []).append(value)
        means[key] = {seed: float(np.mean(values)) for seed, values in per_seed.items()}
    return means


def pair_up(method: dict[tuple[int, str], float], other: dict[tuple[int, str], float], tolerance: float = TIE_TOLERANCE) -> Paired:
    """:func:`paired_difference` of ``method − other`` on the (seed, site) pairs both have (in ``method``'s order)."""
    return paired_difference([value - other[pair] for pair, value in method.items() if pair in other], tolerance)


def average_ranks(means: dict[Key, float], settings: Sequence[str], strategies: Sequence[str]) -> tuple[dict[str, float], list[str]]:
    """Each method's mean rank over settings (1 = the highest mean; equal means share their average rank).

    Args:
        means: ``{(setting, method): mean over seeds}``; a missing or nan entry is no value.
        settings, strategies: the table's columns and rows.

    Returns:
        ``({method: average rank}, the settings ranked)``; only settings where
        every method has a value are ranked (nan ranks if none is).
    """
    ranked = [s for s in settings if all(math.isfinite(means.get((s, m), math.nan)) for m in strategies)]
    if not ranked:
        return {m: math.nan for m in strategies}, []
    ranks = np.stack([stats.rankdata([-means[(s, m)] for m in strategies], method="average") for s in ranked])
    return {m: float(rank) for m, rank in zip(strategies, ranks.mean(axis=0))}, ranked


def best_group(
    values: dict[Key, dict[tuple[int, str], float]], means: dict[Key, float], setting: str, strategies: Sequence[str]
) -> tuple[str | None, set[str]]:
    """The best method of ``setting`` and the methods indistinguishable from it (itself included).

    Args:
        values: :func:`site_values`.
        means: ``{(setting, method): mean over seeds}``.
        setting: the setting.
        strategies: the methods in the grid's order (the first of equal best means wins).

    Returns:
        ``(best, group)``: ``(None, set())`` when no method has a value.
    """
    present = [m for m in strategies if math.isfinite(means.get((setting, m), math.nan))]
    if not present:
        return None, set()
    best = max(present, key=lambda m: means[(setting, m)])  # max keeps the first of equal ones
    group = {m for m in present if m == best or pair_up(values[(setting, m)], values[(setting, best)]).contains_zero}
    return best, group


@dataclass(frozen=True)
class Cell:
    """Everything a table shows for one (setting, method).

    Attributes:
        summary: over seeds.
        versus_reference: paired against the reference method (None when the reference has no value in this setting).
        with_best: in the setting's best group.
    """

    summary: Summary
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
) -> TableStatistics:
    """Summaries, paired differences against ``reference``, ranks and best groups of ``column`` (see the module's docstring)."""
    rows = list(rows)
    values, per_seed = site_values(rows, column), seed_values(rows, column)
    summaries = {(s, m): summarise(list(per_seed.get((s, m), {}).values())) for s in settings for m in strategies}
    means = {key: summary.mean for key, summary in summaries.items()}
    ranks, ranked = average_ranks(means, settings, strategies)
    cells, best = {}, {}
    for s in settings:
        best[s], group = best_group(values, means, s, strategies)
        against = values.get((s, reference))
        for m in strategies:
            paired = pair_up(values[(s, m)], against, tolerance) if against is not None and (s, m) in values else None
            cells[(s, m)] = Cell(summaries[(s, m)], paired, m in group)
    return TableStatistics(cells, ranks, ranked, best)


def validation_curve(history: Sequence[dict[str, Any]], metric: str) -> list[float]:
    """A run's validation curve: per round, the mean over sites of ``record["validation"][site][metric]``.

    Non-finite or missing scores are left out of a round's mean; a round with none is left out.
    """
    curve = []
    for record in history:
        scores = [s.get(metric) for s in record.get("validation", {}).values()]
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
