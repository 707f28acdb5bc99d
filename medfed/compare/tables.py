"""A comparison's tables: comparison.csv (one row per run and site) and comparison.md (methods x settings).

The validation-selected round of a site (:func:`selected_round`) is the round
whose validation score of the *primary* metric (the first of ``metrics``;
higher is better) is highest, the earliest of equal ones; the site's *test*
metrics at that round are reported. The test split never takes part in the
choice.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from medfed.atomic import atomic_write
from medfed.compare.grid import Grid
from medfed.compare.plan import Run, read_run_file
from medfed.errors import ConfigError, DataError

RESULTS_KEYS = ("config", "federation", "history", "timing")
"""What the tables read from each run's results.json."""


@dataclass(frozen=True)
class Finished:
    """A finished run's results, as the tables need them.

    Attributes:
        run: the run.
        results: its results.json.
    """

    run: Run
    results: dict[str, Any]


def collect(runs: list[Run]) -> list[Finished]:
    """The runs whose results.json is there (failed ones are left out).

    Raises:
        DataError: a results.json is damaged or lacks what the tables read (naming the file).
    """
    finished = []
    for run in runs:
        path = run.output_dir / "results.json"
        if path.is_file():
            results = read_run_file(path)
            missing = [key for key in RESULTS_KEYS if key not in results]
            if missing or not results["history"]:
                raise DataError(f"{path}: no {(missing or ['history'])[0]!r} in it; the file is damaged: delete its run folder to run it again")
            finished.append(Finished(run, results))
    return finished


def selected_round(history: list[dict[str, Any]], site: str, metric: str) -> dict[str, Any]:
    """The round record whose validation ``metric`` of ``site`` is highest (ties: the earliest).

    Args:
        history: a run's per-round records, ``record["validation"][site][metric]``.
        site: the site's name.
        metric: the primary metric (higher is better); rounds without a
            finite score for it are skipped.

    Raises:
        ConfigError: no round has a validation score of ``metric`` for ``site``.
    """
    best, best_score = None, -math.inf
    for record in history:
        score = record.get("validation", {}).get(site, {}).get(metric)
        if score is not None and math.isfinite(score) and score > best_score:
            best, best_score = record, score
    if best is None:
        raise ConfigError(f"grid key 'metrics': no round has a validation score of {metric!r} for {site} (the primary metric)")
    return best


def comparison_rows(finished: list[Finished], metrics: list[str]) -> list[dict[str, Any]]:
    """One row per run and site: last-round test metrics, the validation-selected round and its test metrics, wall time.

    Columns: ``config, strategy, seed, site, last_<m>..., selected_round,
    validation_<primary>, selected_<m>..., wall_s`` (``wall_s``: the run's
    ``timing.wall_s``, the same on each of its sites' rows; a resumed run's
    counts its last part only). A metric missing at a round is None.

    Raises:
        ConfigError: naming ``metrics`` when a run reports none of a metric.
    """
    primary = metrics[0]
    rows = []
    for item in finished:
        history = item.results["history"]
        last = history[-1]["metrics"]
        reported = sorted({name for scores in last.values() for name in scores})
        missing = [metric for metric in metrics if metric not in reported]
        if missing:
            raise ConfigError(f"grid key 'metrics': {missing[0]!r} is not reported by run {item.run.name} (it reports {', '.join(reported)})")
        for site, scores in last.items():
            chosen = selected_round(history, site, primary)
            rows.append(
                {
                    "config": item.run.setting,
                    "strategy": item.run.strategy,
                    "seed": item.run.seed,
                    "site": site,
                    **{f"last_{metric}": scores.get(metric) for metric in metrics},
                    "selected_round": chosen["round"],
                    f"validation_{primary}": chosen["validation"][site][primary],
                    **{f"selected_{metric}": chosen["metrics"][site].get(metric) for metric in metrics},
                    "wall_s": item.results["timing"]["wall_s"],
                }
            )
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as CSV (header from the first row's keys; None as an empty cell), written atomically."""
    with atomic_write(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["config", "strategy", "seed", "site"])
        writer.writeheader()
        writer.writerows(rows)


def run_means(rows: list[dict[str, Any]], column: str) -> dict[tuple[str, str], list[float]]:
    """``{(config, strategy): [per seed: the mean over sites of column]}``, seeds in row order; missing values skipped."""
    per_run: dict[tuple[str, str, int], list[float]] = {}
    for row in rows:
        if row[column] is not None:
            per_run.setdefault((row["config"], row["strategy"], row["seed"]), []).append(float(row[column]))
    means: dict[tuple[str, str], list[float]] = {}
    for (config, strategy, _), values in per_run.items():
        means.setdefault((config, strategy), []).append(float(np.mean(values)))
    return means


def format_cell(values: list[float], n_seeds: int, digits: int = 4) -> str:
    """``mean ± std`` (sample std, ddof 1) over seeds, the mean alone for one seed; ``(k/n)`` when only k of the
    grid's n seeds finished; ``—`` for none."""
    if not values:
        return "—"
    cell = f"{np.mean(values):.{digits}f}" + (f" ± {np.std(values, ddof=1):.{digits}f}" if len(values) > 1 else "")
    return cell if len(values) == n_seeds else f"{cell} ({len(values)}/{n_seeds})"


def markdown(
    grid: Grid, source: str, settings: list[str], rows: list[dict[str, Any]], finished: list[Finished], failed: dict[str, str], metrics: list[str]
) -> str:
    """comparison.md: provenance, one methods x settings table per metric and round choice, wall times, failures.

    Args:
        grid, source: what was compared and where the grid came from.
        settings: the configs' labels, the tables' columns in this order.
        rows: :func:`comparison_rows`.
        finished: the runs with results (their data descriptions, rounds).
        failed: ``{run name: end of its log}``.
        metrics: the tabulated metrics, the first primary.
    """
    descriptions = {item.run.setting: item.results["federation"]["description"] for item in finished}
    generated = any(item.results["federation"]["generated"] for item in finished)
    rounds = sorted({item.results["config"]["trainer"]["rounds"] for item in finished})
    tag = " (GENERATED data)" if generated else ""
    n_seeds = len(grid.seeds)

    def table(column: str, digits: int = 4) -> list[str]:
        means = run_means(rows, column)
        lines = ["| method | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
        for strategy in grid.strategies:
            cells = [format_cell(means.get((setting, strategy), []), n_seeds, digits) for setting in settings]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        return lines

    lines = [
        f"# Method comparison{tag}",
        "",
        f"Grid: {source}; {len(grid.strategies)} methods x {len(settings)} settings x seeds {grid.seeds}; "
        f"rounds: {', '.join(map(str, rounds)) or '?'}; overrides: {' '.join(grid.overrides) or 'none'}.",
        "",
        *(f"- {setting}: {text}" for setting, text in descriptions.items()),
        "",
        "Each cell: mean ± standard deviation (ddof 1) over seeds of the mean over sites of the site's TEST metric (the mean "
        "alone for one seed); "
        f"(k/{n_seeds}) marks a cell with only k of the {n_seeds} seeds finished. Validation-selected: for each site, the round "
        f"with the highest VALIDATION {metrics[0]} (ties: the earliest round), and that site's test metric at that round.",
    ]
    for metric in metrics:
        for when, column in (("last round", f"last_{metric}"), ("validation-selected round", f"selected_{metric}")):
            lines += ["", f"## {metric}, {when}{tag}", "", *table(column)]
    lines += ["", "## Wall time per run, seconds (timing.wall_s; a resumed run's counts its last part only)", "", *table("wall_s", 1)]
    if failed:
        lines += ["", "## Failed runs", "", *(f"- {name}: {tail}" for name, tail in failed.items())]
    return "\n".join(lines) + "\n"


def reported_metrics(finished: list[Finished]) -> list[str]:
    """Every metric the first finished run reports at its last round, in its order (empty: no run finished)."""
    if not finished:
        return []
    return list(next(iter(finished[0].results["history"][-1]["metrics"].values())))
