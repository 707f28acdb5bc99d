"""A comparison's tables: comparison.csv (one row per run and site) and comparison.md (methods x settings).

The md's statistics (intervals over seeds, paired differences against a
reference method, average ranks, the best group, plateaus) are
:mod:`medfed.compare_stats`'s.

The validation-selected round of a site (:func:`selected_round`) is the round
whose validation score of the *primary* metric (the first of ``metrics``;
higher is better) is highest, the latest of equal ones; the site's *test*
metrics at that round are reported. The test split never takes part in the
choice. (Of equal scores the latest: a validation split of 12-20 records
scores accuracy in steps of 0.05-0.08, and a site whose validation accuracy
is flat from round 1 would otherwise be reported with its round-1, untrained
model: the clinical tables' "selected" accuracy of .867 beside the last
round's .943 came from that.)

Beside the methods, each table shows the trivial baselines every run
computed on the same split (:mod:`medfed.evaluation.baselines`, results.json
``baselines``): rows ``baseline:<name>`` in comparison.csv, reference rows
in comparison.md, with no rank and no place in the best group.

Every table compares methods at equal compute: each run's training epochs
per site and round (``results.json`` ``compute``,
:mod:`medfed.federated.compute`) are shown beside its metric, and
:func:`unequal_compute` names the runs whose budget differs by more than
:data:`BUDGET_TOLERANCE` from their setting's reference method's run of the same seed (which
``compare`` refuses unless ``--allow-unequal-compute``).
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
from medfed.compare_stats import (
    PLATEAU_ROUNDS,
    PLATEAU_TOLERANCE,
    TIE_TOLERANCE,
    Paired,
    Summary,
    plateau_status,
    seed_values,
    table_statistics,
    validation_curve,
)
from medfed.errors import ConfigError, DataError

RESULTS_KEYS = ("config", "federation", "history", "timing")
"""What the tables read from each run's results.json (and ``compute``, where a run has it)."""
BUDGET_TOLERANCE = 0.05
"""Runs of one setting whose training epochs per site and round differ by more than this fraction are of unequal compute."""


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
    """The round record whose validation ``metric`` of ``site`` is highest (ties: the latest, the most trained model).

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
        if score is not None and math.isfinite(score) and score >= best_score:
            best, best_score = record, score
    if best is None:
        raise ConfigError(f"grid key 'metrics': no round has a validation score of {metric!r} for {site} (the primary metric)")
    return best


def comparison_rows(finished: list[Finished], metrics: list[str]) -> list[dict[str, Any]]:
    """One row per run and site: last-round test metrics, the validation-selected round and its test metrics, cost.

    Columns: ``config, strategy, seed, site, last_<m>..., selected_round,
    validation_<primary>, selected_<m>..., rounds_run, stopped_round,
    training_epochs_per_round, wall_s`` (``rounds_run``: the rounds the run
    ran, fewer than ``trainer.rounds`` when it stopped on a validation plateau,
    whose round is ``stopped_round``, else None; ``training_epochs_per_round``:
    the site's training epochs per round it trained in, None where it trained
    in none or the run has no compute record; ``wall_s``: the run's
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
        compute = item.results.get("compute") or {}
        stopped = item.results.get("stopped") or {}
        for site, scores in last.items():
            chosen = selected_round(history, site, primary)
            trained_in = compute.get("training_rounds", {}).get(site)
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
                    "rounds_run": len(history),
                    "stopped_round": stopped.get("round"),
                    "training_epochs_per_round": compute["training_epochs"][site] / trained_in if trained_in else None,
                    "wall_s": item.results["timing"]["wall_s"],
                }
            )
    return rows


BASELINE_PREFIX = "baseline:"
"""The strategy column of a baseline's rows (``baseline:threshold``): not a method, the trivial predictor of that name."""


def baseline_rows(finished: list[Finished], metrics: list[str], columns: list[str]) -> list[dict[str, Any]]:
    """comparison.csv's rows of the trivial baselines (results.json ``baselines``), one per baseline, setting, seed and site.

    A seed's baselines are its setting's first finished run's (every run of a seed evaluates the same split, so
    they agree); ``last_<m>`` and ``selected_<m>`` are both the baseline's metric (it has no rounds), the other
    ``columns`` None.
    """
    rows, seen = [], set()
    for item in finished:
        key = (item.run.setting, item.run.seed)
        if key in seen or not item.results.get("baselines"):
            continue
        seen.add(key)
        for name, baseline in item.results["baselines"].items():
            for site, scores in baseline["metrics"].items():
                row = dict.fromkeys(columns)
                row.update({"config": item.run.setting, "strategy": BASELINE_PREFIX + name, "seed": item.run.seed, "site": site})
                for metric in metrics:
                    row[f"last_{metric}"] = row[f"selected_{metric}"] = scores.get(metric)
                rows.append(row)
    return rows


def baseline_names(rows: list[dict[str, Any]]) -> list[str]:
    """The baselines' row names (``baseline:<name>``) in the long table, in order of appearance."""
    return list(dict.fromkeys(row["strategy"] for row in rows if str(row["strategy"]).startswith(BASELINE_PREFIX)))


def run_compute(results: dict[str, Any]) -> tuple[float, float, float] | None:
    """A run's (training, auxiliary, forward-only) epochs per site and round it trained in (``results.json``
    ``compute``); None without a record."""
    compute = results.get("compute") or {}
    if "mean_training_epochs_per_round" not in compute:
        return None
    return (
        float(compute["mean_training_epochs_per_round"]),
        float(compute.get("mean_auxiliary_epochs_per_round", 0.0)),
        float(compute.get("mean_forward_epochs_per_round", 0.0)),
    )


def unequal_compute(finished: list[Finished], reference: str) -> list[str]:
    """The runs whose training budget is not their setting's, one phrase each (empty: every table compares equal compute).

    A run's budget is the training epochs per site and round of its
    setting's ``reference`` method's run of the same seed (the same data
    split, so the same cut of a fractional budget at whole mini-batches:
    half an epoch of a small site can be 0.55 on one seed and 0.63 on
    another), else the mean over that method's runs of the setting, else its
    ``trainer.local_epochs`` where that method has no finished run; a run more
    than :data:`BUDGET_TOLERANCE` (relative) from it is named with both
    figures, and so is a run without a compute record (one from before
    medfed counted compute).
    """
    problems = []
    for setting in dict.fromkeys(item.run.setting for item in finished):
        items = [item for item in finished if item.run.setting == setting]
        by_seed = {item.run.seed: run_compute(item.results) for item in items if item.run.strategy == reference}
        by_seed = {seed: spent[0] for seed, spent in by_seed.items() if spent is not None}
        for item in items:
            if item.run.seed in by_seed:
                budget, what = by_seed[item.run.seed], f"{reference}'s {{:.2f}} on the same seed"
            elif by_seed:
                budget, what = float(np.mean(list(by_seed.values()))), f"{reference}'s {{:.2f}} (mean over its seeds)"
            else:
                budget, what = float(item.results["config"].get("trainer", {}).get("local_epochs", 1)), "trainer.local_epochs {:.2f}"
            spent = run_compute(item.results)
            if spent is None:
                problems.append(f"{item.run.name} has no compute record (a run from before medfed counted compute: delete its folder to run it again)")
            elif abs(spent[0] - budget) > BUDGET_TOLERANCE * budget:
                problems.append(f"{item.run.name} trained {spent[0]:.2f} epochs per site and round, {what.format(budget)}")
    return problems


def compute_cells(finished: list[Finished]) -> dict[tuple[str, str], str]:
    """``{(setting, method): "t"}``, ``"t +a aux"``, ``"t +f fwd"``: training, auxiliary (forward and backward) and
    forward-only epochs per site and round, mean over the cell's runs, then ``· w s``: wall seconds per run, mean
    over them (``?`` for runs without a compute record)."""
    spent: dict[tuple[str, str], list[tuple[float, float, float] | None]] = {}
    wall: dict[tuple[str, str], list[float]] = {}
    for item in finished:
        key = (item.run.setting, item.run.strategy)
        spent.setdefault(key, []).append(run_compute(item.results))
        wall.setdefault(key, []).append(float(item.results["timing"]["wall_s"]))
    cells = {}
    for key, values in spent.items():
        known = [value for value in values if value is not None]
        seconds = f" · {np.mean(wall[key]):.0f} s"
        if not known:
            cells[key] = "?" + seconds
            continue
        training, auxiliary, forward = np.mean(known, axis=0)
        cell = f"{training:.2f}" + (f" +{auxiliary:.2f} aux" if auxiliary > 0 else "") + (f" +{forward:.2f} fwd" if forward > 0 else "")
        cell += seconds
        cells[key] = cell if len(known) == len(values) else f"{cell} ({len(known)}/{len(values)} runs)"
    return cells


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as CSV (header from the first row's keys; None as an empty cell), written atomically."""
    with atomic_write(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["config", "strategy", "seed", "site"])
        writer.writeheader()
        writer.writerows(rows)


def format_cell(values: list[float], n_seeds: int, digits: int = 3) -> str:
    """``mean ± std`` (sample std, ddof 1) over seeds, the mean alone for one seed; ``(k/n)`` when only k of the
    grid's n seeds finished; ``—`` for none."""
    if not values:
        return "—"
    cell = f"{np.mean(values):.{digits}f}" + (f" ± {np.std(values, ddof=1):.{digits}f}" if len(values) > 1 else "")
    return cell if len(values) == n_seeds else f"{cell} ({len(values)}/{n_seeds})"


def resolve_reference(reference: str | None, strategies: list[str]) -> str:
    """The method every other is paired against: ``reference``, else fedavg, else the grid's first strategy.

    Raises:
        ConfigError: ``reference`` is not one of ``strategies``.
    """
    if reference is None:
        return "fedavg" if "fedavg" in strategies else strategies[0]
    if reference not in strategies:
        raise ConfigError(f"--reference {reference!r}: not one of the grid's strategies ({', '.join(strategies)})")
    return reference


def plateaus(finished: list[Finished], primary: str) -> dict[tuple[str, str], list[str]]:
    """``{(setting, method): [per run: plateau status]}``: ``plateaued`` for a run that stopped on its validation
    plateau (``trainer.patience``), else :func:`plateau_status` of its validation curve of ``primary``."""
    statuses: dict[tuple[str, str], list[str]] = {}
    for item in finished:
        curve = validation_curve(item.results["history"], primary)
        status = "plateaued" if item.results.get("stopped") else plateau_status(curve)
        statuses.setdefault((item.run.setting, item.run.strategy), []).append(status)
    return statuses


def snapshot_tag(finished: list[Finished], primary: str) -> str:
    """`` — early-training snapshot`` when every run is early (:func:`plateau_status`), for a figure's title; else empty."""
    statuses = [status for values in plateaus(finished, primary).values() for status in values]
    return " — early-training snapshot" if statuses and all(status == "early" for status in statuses) else ""


def format_plateaus(statuses: list[str]) -> str:
    """``p/n plateaued`` (with the improving and early runs counted), ``early-training snapshot`` when every run is early, ``—`` for none."""
    if not statuses:
        return "—"
    if all(status == "early" for status in statuses):
        return "early-training snapshot"
    counts = {status: statuses.count(status) for status in ("plateaued", "improving", "early")}
    extra = "".join(f", {counts[status]} {status}" for status in ("improving", "early") if counts[status])
    return f"{counts['plateaued']}/{len(statuses)} plateaued{extra}"


def training_caption(statuses: list[str], stopped: int = 0) -> str:
    """One sentence on where the runs stopped (:func:`plateaus`): an early-training snapshot, plateaued, or a mix;
    ``stopped``: how many of them ended on a validation plateau (``trainer.patience``)."""
    if not statuses:
        return "*Training status: no finished run.*"
    counts = {status: statuses.count(status) for status in ("plateaued", "improving", "early")}
    on_plateau = f" ({stopped} of them stopped there by trainer.patience)" if stopped else ""
    if counts["early"] == len(statuses):
        return (
            f"*Early-training snapshot: every run stopped after fewer than {PLATEAU_ROUNDS + 1} rounds, before a plateau "
            "could be seen; these tables measure how fast the methods learn, not where they end (pass more trainer.rounds).*"
        )
    if counts["plateaued"] == len(statuses):
        return f"*Plateaued: every run's validation curve had stopped improving by its last round{on_plateau}.*"
    return (
        f"*Training status: {counts['plateaued']}/{len(statuses)} runs plateaued{on_plateau}, {counts['improving']} still improving, "
        f"{counts['early']} early; the improving and early ones are snapshots before their end (per setting: the last row of each table).*"
    )


def format_summary(summary: Summary, n_seeds: int, with_best: bool = False, digits: int = 3) -> str:
    """``mean [low, high]`` over seeds (the mean alone for one seed), ``(k/n)`` for k of n seeds, bold in the best group, ``—`` for none."""
    if summary.n == 0:
        return "—"
    cell = f"{summary.mean:.{digits}f}"
    if summary.n > 1:
        cell += f" [{summary.low:.{digits}f}, {summary.high:.{digits}f}]"
    cell = f"**{cell}**" if with_best else cell
    return cell if summary.n == n_seeds else f"{cell} ({summary.n}/{n_seeds})"


def format_paired(paired: Paired | None, is_reference: bool, digits: int = 3) -> str:
    """``+mean [low, high] W/T/L`` of a method against the reference (interval over seeds); ``reference`` on its own row;
    ``—`` without pairs."""
    if is_reference:
        return "reference"
    if paired is None or paired.n == 0:
        return "—"
    interval = f" [{paired.low:+.{digits}f}, {paired.high:+.{digits}f}]" if paired.n > 1 else " (1 seed)"
    return f"{paired.mean:+.{digits}f}{interval} {paired.wins}/{paired.ties}/{paired.losses}"


def split_sizes(finished: list[Finished]) -> dict[str, str]:
    """``{setting: "train 8, validation 4, test 4 patients per site ..."}``: each split's subjects per site (the
    range over sites and runs), from the runs' ``federation.sites`` (``<split>_<noun>`` lists), and whether the
    seeds drew new data (``data.generate.seed`` following the seed)."""
    sizes: dict[str, dict[str, list[int]]] = {}
    nouns: dict[str, str] = {}
    draws: dict[str, set[Any]] = {}
    for item in finished:
        per_split = sizes.setdefault(item.run.setting, {})
        for site in item.results["federation"].get("sites", []):
            for key, value in site.items():
                split, _, noun = key.partition("_")
                if split in ("train", "validation", "test") and noun and isinstance(value, list):
                    per_split.setdefault(split, []).append(len(value))
                    nouns[item.run.setting] = noun
        generate = (item.results["config"].get("data") or {}).get("generate")
        draws.setdefault(item.run.setting, set()).add(generate.get("seed") if isinstance(generate, dict) else None)
    text = {}
    for setting, per_split in sizes.items():
        if not per_split:
            continue
        parts = [
            f"{split} {min(n)}" + (f"-{max(n)}" if max(n) != min(n) else "")
            for split in ("train", "validation", "test") if (n := per_split.get(split))
        ]
        seeds = draws[setting] - {None}
        data = (
            f"; {len(seeds)} data draws (data.generate.seed {', '.join(map(str, sorted(seeds)))})" if len(seeds) > 1
            else "; one data draw for every seed (the seeds reshuffle its patients)" if seeds
            else ""
        )
        text[setting] = f"{', '.join(parts)} {nouns[setting]} per site{data}"
    return text


def markdown(
    grid: Grid,
    source: str,
    settings: list[str],
    rows: list[dict[str, Any]],
    finished: list[Finished],
    failed: dict[str, str],
    metrics: list[str],
    reference: str | None = None,
    tuning: list[str] | None = None,
) -> str:
    """comparison.md: provenance, one methods x settings table per metric and round choice, training status, wall times, failures.

    The training status (:func:`training_caption`) is said once, under the title. Each metric table
    (:func:`medfed.compare_stats.table_statistics`) has per setting a cell over seeds (mean [95% t interval over
    seeds], bold when indistinguishable from the setting's best after Holm's correction), the worst site, the
    paired difference against ``reference`` (95% interval over seeds, W/T/L over (seed, site) pairs) and the
    cost (epochs per site and round, wall seconds per run); then the average rank over settings; under the
    methods the trivial baselines (rows ``baseline:<name>`` of ``rows``), then the plateau status of each
    setting's runs.

    Args:
        grid, source: what was compared and where the grid came from.
        settings: the configs' labels, the tables' columns in this order.
        rows: :func:`comparison_rows` (and :func:`baseline_rows`).
        finished: the runs with results (their data descriptions, rounds, validation curves).
        failed: ``{run name: end of its log}``.
        metrics: the tabulated metrics, the first primary (chooses the validation round, and its curve the plateau status).
        reference: the method the others are paired against (:func:`resolve_reference`).
        tuning: with ``compare --tune``, the section naming the chosen hyperparameters and the tuning's cost
            (:func:`medfed.compare.tune.tuning_section`); None: the configs' own values, said so.
    """
    reference = resolve_reference(reference, grid.strategies)
    descriptions = {item.run.setting: item.results["federation"]["description"] for item in finished}
    sizes = split_sizes(finished)
    generated = any(item.results["federation"]["generated"] for item in finished)
    rounds = sorted({item.results["config"]["trainer"]["rounds"] for item in finished})
    stopped = sum(bool(item.results.get("stopped")) for item in finished)
    tag = " (GENERATED data)" if generated else ""
    n_seeds = len(grid.seeds)
    primary = metrics[0] if metrics else "(primary metric)"
    statuses = plateaus(finished, metrics[0]) if metrics else {}
    compute = compute_cells(finished)
    unequal = unequal_compute(finished, reference)
    baselines = baseline_names(rows)
    by_setting = {s: [status for m in grid.strategies for status in statuses.get((s, m), [])] for s in settings}
    caption = training_caption([status for s in settings for status in by_setting[s]], stopped)

    def statistics_table(column: str) -> list[str]:
        table = table_statistics(rows, column, settings, grid.strategies, reference, extra=baselines)
        header = "".join(f" {setting} | worst site | Δ vs {reference} | epochs · wall |" for setting in settings)
        lines = [f"| method |{header} average rank |", "|---|" + "---|---|---|---|" * len(settings) + "---|"]
        cells = table.cells
        for strategy in [*grid.strategies, *baselines]:
            pairs = "".join(
                f" {format_summary(cells[(s, strategy)].summary, n_seeds, cells[(s, strategy)].with_best)} |"
                f" {format_summary(cells[(s, strategy)].worst, n_seeds)} |"
                f" {format_paired(cells[(s, strategy)].versus_reference, strategy == reference)} |"
                f" {compute.get((s, strategy), '—')} |"
                for s in settings
            )
            if strategy in baselines:
                lines.append(f"| *{strategy}* |{pairs} — |")
                continue
            rank = table.ranks[strategy]
            lines.append(f"| {strategy} |{pairs} {'—' if math.isnan(rank) else f'{rank:.2f}'} |")
        lines.append("| *runs' validation curves* |" + "".join(f" {format_plateaus(by_setting[s])} | | | |" for s in settings) + " |")
        if table.ranked != settings:
            lines += ["", f"Average rank over {', '.join(table.ranked) or 'no setting'} (the settings where every method has a value)."]
        return lines

    def wall_table() -> list[str]:
        means = seed_values(rows, "wall_s")
        lines = ["| method | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
        for strategy in grid.strategies:
            lines.append(f"| {strategy} | " + " | ".join(format_cell(list(means.get((s, strategy), {}).values()), n_seeds, 1) for s in settings) + " |")
        return lines

    lines = [
        f"# Method comparison{tag}",
        "",
        caption,
        "",
        f"Grid: {source}; {len(grid.strategies)} methods x {len(settings)} settings x seeds {grid.seeds}; "
        f"rounds: {', '.join(map(str, rounds)) or '?'}"
        + (" (the cap: a run stops earlier on a validation plateau, trainer.patience)" if any(
            item.results["config"]["trainer"].get("patience") for item in finished) else "")
        + f"; overrides: {' '.join(grid.overrides) or 'none'}; hyperparameters: "
        + ("chosen on the validation split (compare --tune, section below)." if tuning else "the configs' own (not tuned; compare --tune tunes them)."),
        "",
        *(f"- {setting}: {text}" + (f". Patients per split: {sizes[setting]}." if setting in sizes else "") for setting, text in descriptions.items()),
        "",
        "How to read the tables (95% intervals are Student t intervals over seeds, the unit of replication; higher is better, "
        "but for HD95 and losses, where lower is: their best, ranks, worst site and wins go the other way):",
        "",
        "- Each setting's first column: the mean over seeds of each seed's mean over sites of the site's TEST metric, and "
        f"[a 95% t interval for it over the seeds] (the mean alone for one seed); (k/{n_seeds}) marks a cell with only k of "
        f"the {n_seeds} seeds finished. Worst site: the same over seeds of each seed's lowest site.",
        "- **Bold**: indistinguishable from the setting's best method (the highest mean): the paired t test of method − best "
        "over the seeds (each seed's mean over the sites both have) is not rejected at 5% after Holm's correction for the "
        "methods tested against the best.",
        f"- Δ vs {reference}: the mean over seeds of each seed's mean over sites of the method's value minus {reference}'s "
        "on the same seed and site, [a 95% t interval over the seeds] (one comparison: not corrected for the others), and "
        f"wins/ties/losses over the (seed, site) pairs (tie: |Δ| <= {TIE_TOLERANCE}; a description, not a test).",
        "- Average rank: each setting ranks the methods by their mean (1 = best, equal means share their average rank), "
        "averaged over the settings.",
        f"- Last round: the run's last round (where it stopped on a validation plateau, else trainer.rounds). "
        f"Validation-selected: for each site, the round with the highest VALIDATION {primary} (ties: the latest round), and "
        "that site's test metric at that round.",
        f"- Runs' validation curves: a run has *plateaued* when it stopped on a validation plateau (trainer.patience) or the "
        f"best of its last {PLATEAU_ROUNDS} rounds' validation {primary} (mean over sites) is at most {PLATEAU_TOLERANCE} "
        f"above its best before them, else it is *improving*; with fewer than {PLATEAU_ROUNDS + 1} rounds it is *early*.",
        "- Epochs · wall: the compute each method got, training epochs per site and round (passes of its training plans "
        "over the site's training split, mean over the cell's runs; `trainer.local_epochs` is the budget every method "
        "shares), after + the auxiliary forward-and-backward epochs outside its plans (PGFed's gradient estimate, "
        "FedBABU's fine-tuning before each evaluation) and the forward-only epochs (IFCA's cluster choice), not charged "
        "to the budget; then the wall seconds per run (mean over its seeds; runs side by side on one machine).",
    ]
    if baselines:
        lines.append(
            "- *baseline:...* rows: trivial predictors on each seed's same test split (medfed.evaluation.baselines; "
            "all_foreground / majority: one answer everywhere; threshold / one_feature: one input channel or feature "
            "and one threshold per site, chosen on the site's training data). No rank, never in the best group."
        )
    if unequal:
        lines += [
            "",
            f"**Unequal compute** (tabulated with --allow-unequal-compute; tolerance {BUDGET_TOLERANCE:.0%}): "
            + "; ".join(unequal) + ".",
        ]
    if tuning:
        lines += ["", *tuning]
    for metric in metrics:
        for when, column in (("last round", f"last_{metric}"), ("validation-selected round", f"selected_{metric}")):
            lines += ["", f"## {metric}, {when}{tag}", "", *statistics_table(column)]
    if metrics:
        lines += [
            "",
            f"## Runs' validation curves ({metrics[0]}, last {PLATEAU_ROUNDS} rounds against the earlier best)",
            "",
            "| method | " + " | ".join(settings) + " |",
            "|---|" + "---|" * len(settings),
            *(f"| {m} | " + " | ".join(format_plateaus(statuses.get((s, m), [])) for s in settings) + " |" for m in grid.strategies),
        ]
    lines += ["", "## Wall time per run, seconds (timing.wall_s; a resumed run's counts its last part only)", "", *wall_table()]
    if failed:
        lines += ["", "## Failed runs", "", *(f"- {name}: {tail}" for name, tail in failed.items())]
    return "\n".join(lines) + "\n"


def terminal_table(rows: list[dict[str, Any]], settings: list[str], strategies: list[str], metric: str, reference: str) -> str:
    """The main table for the terminal: ``metric`` at the last round, per setting the mean over seeds [95% interval],
    ``*`` in the best group, and the average rank; methods by rank, then the baselines."""
    baselines = baseline_names(rows)
    table = table_statistics(rows, f"last_{metric}", settings, strategies, reference, extra=baselines)
    ordered = sorted(strategies, key=lambda m: (math.isnan(table.ranks[m]), table.ranks[m]))
    header = ["method", *settings, "rank"]
    body = []
    for strategy in [*ordered, *baselines]:
        cells = []
        for s in settings:
            cell = table.cells[(s, strategy)]
            text = format_summary(cell.summary, cell.summary.n).replace("**", "")
            cells.append(text + (" *" if cell.with_best and strategy not in baselines else "  "))
        rank = table.ranks.get(strategy, math.nan)
        body.append([strategy, *cells, "—" if math.isnan(rank) else f"{rank:.1f}"])
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda line: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(line, widths)))  # noqa: E731
    rule = "-" * len(fmt(header))
    notes = f"{metric}, last round, test: mean over seeds [95% t interval over seeds]; * indistinguishable from the best (Holm)"
    return "\n".join([notes, rule, fmt(header), rule, *(fmt(line) for line in body), rule])


def reported_metrics(finished: list[Finished]) -> list[str]:
    """Every metric the first finished run reports at its last round, in its order (empty: no run finished)."""
    if not finished:
        return []
    return list(next(iter(finished[0].results["history"][-1]["metrics"].values())))
