"""The compute frontier: a comparison at several equal budgets (``compare --budgets 1 2 4``), each method's metric against its budget.

Rankings move with the budget (a method that splits one epoch into two
half-epoch phases learns slower at 1 epoch a round and may be level with the
best at 2), so a reader choosing a method for their own compute needs each
method's metric *against* its budget. :func:`budget_grid` gives each budget
``B`` its own comparison, ``<output>/budget-<B>/``, whose every run gets
``trainer.local_epochs=B`` (:data:`BUDGET_KEY`): within a budget the tables
are compare's own (equal compute), and the same command resumes them.

:func:`frontier_rows` then reads, per (setting, method, budget), the
*measured* training epochs per site and round (the mean over the finished
runs of ``results.json`` ``compute.mean_training_epochs_per_round``, not the
requested budget) and, per metric, the last round's test metric: the mean over
seeds of each run's mean over sites, with its 95% t interval over seeds
(:func:`medfed.compare_stats.summarise`). They go to ``frontier.csv`` and
``frontier.png`` (:func:`medfed.viz.plots.plot_frontier`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from medfed.compare.grid import Grid
from medfed.compare.plan import Run, plan_runs
from medfed.compare.tables import Finished, run_compute
from medfed.compare_stats import seed_values, summarise
from medfed.config import MAX_LOCAL_EPOCHS
from medfed.errors import ConfigError

BUDGET_KEY = "trainer.local_epochs"
"""The config key ``--budgets`` sets in every run: every strategy's budget of training passes per site and round."""
FRONTIER_COLUMNS = ("config", "strategy", "metric", "budget", "epochs_per_round", "n_seeds", "mean", "std", "low", "high")
"""frontier.csv's columns: the requested budget, the measured epochs, the metric's mean over seeds, std (ddof 1) and 95% t interval."""


def check_budgets(budgets: list[float], overrides: list[str] | tuple[str, ...]) -> list[float]:
    """The budgets, checked: numbers in (0, :data:`~medfed.config.MAX_LOCAL_EPOCHS`] without repeats, and no ``trainer.local_epochs=`` override beside them.

    Raises:
        ConfigError: one line naming the bad budget or the override.
    """
    for override in overrides:
        if override.partition("=")[0].strip() == BUDGET_KEY:
            raise ConfigError(
                f"override {override!r} with --budgets: --budgets sets {BUDGET_KEY} of every run itself (one comparison per budget); "
                f"drop the override, or drop --budgets to compare at one budget"
            )
    if not budgets:
        raise ConfigError("--budgets: expected one or more numbers > 0 (training epochs per site and round, e.g. --budgets 1 2 4)")
    for budget in budgets:
        if not (isinstance(budget, (int, float)) and 0 < budget <= MAX_LOCAL_EPOCHS):
            raise ConfigError(f"--budgets {budget!r}: expected a finite number > 0 and at most {MAX_LOCAL_EPOCHS} (training epochs per site and round)")
    if len(set(budgets)) != len(budgets):
        raise ConfigError(f"--budgets {' '.join(f'{b:g}' for b in budgets)}: a budget is given twice")
    return list(budgets)


def budget_grid(grid: Grid, budget: float) -> tuple[Grid, str]:
    """``(the grid of one budget, its override)``: the same grid writing to ``<output>/budget-<B>`` (``B`` as ``%g``),
    each run with ``trainer.local_epochs=<B>``."""
    return replace(grid, output=grid.output / f"budget-{budget:g}"), f"{BUDGET_KEY}={budget:g}"


def plan_budgets(
    grid: Grid, overrides: list[str] | tuple[str, ...], budgets: list[float], jobs: int | None = None
) -> list[tuple[float, Grid, list[str], list[Run]]]:
    """Every budget's grid, overrides and planned runs (:func:`~medfed.compare.plan.plan_runs`), all checked before any run starts.

    Returns:
        per budget ``(budget, its grid (output <output>/budget-<B>), its overrides (``overrides`` and
        ``trainer.local_epochs=<B>``), its runs)``.

    Raises:
        ConfigError: a bad budget or a ``trainer.local_epochs`` override (:func:`check_budgets`), or any
            problem :func:`~medfed.compare.plan.plan_runs` finds in any budget's runs.
    """
    check_budgets(budgets, [*grid.overrides, *overrides])
    planned = []
    for index, budget in enumerate(budgets):
        one, setting = budget_grid(grid, budget)
        planned.append((budget, one, [*overrides, setting], plan_runs(one, [*overrides, setting], jobs, announce=index == 0)))
    return planned


def frontier_rows(
    per_budget: list[tuple[float, list[Finished], list[dict[str, Any]]]], metrics: list[str], settings: list[str], strategies: list[str]
) -> list[dict[str, Any]]:
    """One row per (setting, method, metric, budget) with a finished run: :data:`FRONTIER_COLUMNS`.

    Args:
        per_budget: ``(budget, its finished runs, its comparison rows)`` (:func:`~medfed.compare.tables.comparison_rows`).
        metrics: the tabulated metrics (their ``last_<m>`` columns are read).
        settings, strategies: the rows' order.

    ``epochs_per_round`` is the mean over the cell's finished runs of their
    measured training epochs per site and round (None when no run has a
    compute record); ``mean``/``std``/``low``/``high`` summarise the run values
    (each seed's mean over sites) over seeds, std and interval nan for one seed.
    """
    frontier = []
    for setting in settings:
        for strategy in strategies:
            for metric in metrics:
                for budget, finished, rows in per_budget:
                    spent = [run_compute(item.results) for item in finished if (item.run.setting, item.run.strategy) == (setting, strategy)]
                    values = list(seed_values(rows, f"last_{metric}").get((setting, strategy), {}).values())
                    if not values:
                        continue
                    known = [value[0] for value in spent if value is not None]
                    summary = summarise(values)
                    frontier.append(
                        {
                            "config": setting, "strategy": strategy, "metric": metric, "budget": budget,
                            "epochs_per_round": float(np.mean(known)) if known else None, "n_seeds": summary.n,
                            "mean": summary.mean, "std": summary.std, "low": summary.low, "high": summary.high,
                        }
                    )
    return frontier
