"""``python -m medfed compare``: every (config, strategy, seed) of a grid as its own run, then the tables.

A *grid* names run configs (the settings, the tables' columns), strategies
(``all``: every registered one, the tables' rows), seeds, overrides common to
every run, the metrics to tabulate and an output folder; it is a YAML file
(:func:`~medfed.compare.grid.read_grid`, e.g. ``configs/paper/table3_brats.yaml``) or the same
given on the command line (:mod:`medfed.compare.grid`). :func:`compare`

1. plans every run (:mod:`medfed.compare.plan`) and checks the whole grid before any run starts: each
   config is resolved with its overrides (:func:`medfed.components.resolve`),
   every strategy name is known, the runs report test metrics
   (``holdout: test``), an override of a key compare sets itself
   (``output_dir``, ``strategy.name``, ``trainer.seed``,
   ``trainer.num_threads``) is refused, and a run folder that holds a run of
   another config is refused; any problem is one
   :class:`~medfed.errors.ConfigError` (a damaged results.json, one
   :class:`~medfed.errors.DataError` naming it). A config without a
   validation split gets one (``federation.validation_fraction=0.2``, said in
   one line and recorded in each run's config) to choose each site's round on;
2. holds the grid's output for this process (``<output>.lock``, :func:`~medfed.output_dir.hold_output_dir`: a
   second compare on it is refused in one line naming the holder, before it plans or runs anything), then
   runs each (config, strategy, seed) (:mod:`medfed.compare.runner`) as ``medfed fit`` in a process of its
   own (forked from a run server that imported torch once) with its own ``output_dir``, ``<output>/<config>/<strategy>/seed<k>``,
   ``jobs`` at a time, each with ``trainer.num_threads`` = cores // jobs
   (a resumed run keeps the count it started with); runs that share a strategy and a model shape are fused:
   one process, each run a thread of it, their sites stacked in one step (:mod:`medfed.compare.fused`, ``--fuse``); a run whose
   ``results.json`` holds the same config is not run again, one with a
   checkpoint but no results (interrupted, or asked for more rounds) is
   continued with ``--resume``; a failing run is reported with the end of
   its log (``<output>/logs/...``) and the others go on;
3. refuses runs of unequal compute in one table (each run's training epochs per site and round against its
   setting's reference method's, :func:`~medfed.compare.tables.unequal_compute`), naming them, unless
   ``allow_unequal_compute`` (``--allow-unequal-compute``);
4. writes (:mod:`medfed.compare.tables`) ``comparison.csv`` (one row per run and site), ``comparison.md``
   (methods x settings per metric, for the last round and for the
   validation-selected round: the mean over seeds of the mean over sites with
   a 95% interval over seeds, the worst site, the paired difference against a
   reference method (interval over seeds) with wins/ties/losses, the compute
   and wall time each method got, the average rank, the methods
   indistinguishable from the best in bold (Holm-corrected), the trivial
   baselines as reference rows, whether the runs had plateaued; wall times),
   ``comparison.png`` (each method's mean and interval and every site's value,
   on axes fitted to the data) from every run that finished, and prints the main
   table (the primary metric at the last round, ranked) on stdout;
5. with ``tune`` (``--tune``, :mod:`medfed.compare.tune`), first runs every method's search space on the
   validation split only (tuning runs in ``<output>/tuning/``, the test split set aside unread), picks each
   (setting, method)'s configuration of the highest validation score, then runs the grid with it (every seed,
   on the test split) and writes ``tuning.csv`` and a section of comparison.md naming the chosen values and
   the tuning's cost;
6. with ``budgets`` (``--budgets 1 2 4``, :mod:`medfed.compare.frontier`), does 1-4 once per budget ``B`` in
   ``<output>/budget-<B>/`` with ``trainer.local_epochs=B`` in every run (all budgets planned and checked
   first), then writes ``frontier.csv`` and ``frontier.png``: each method's last-round metric against its
   measured training epochs per site and round, with 95% t intervals over seeds.

The validation-selected round of a site (:func:`~medfed.compare.tables.selected_round`) is the round
whose validation score of the *primary* metric (the first of ``metrics``;
higher is better) is highest, the latest of equal ones; the site's *test*
metrics at that round are reported. The test split never takes part in the
choice.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from medfed.atomic import atomic_write
from medfed.compare.bounds import bound_plan
from medfed.compare.frontier import check_budgets, frontier_rows, plan_budgets
from medfed.compare.fused import FUSE_OPTIONS
from medfed.compare.grid import Grid, check_overrides, setting_of
from medfed.compare.plan import Run, default_jobs, plan_runs
from medfed.compare.runner import execute
from medfed.compare.tables import (
    BUDGET_TOLERANCE, Finished, baseline_rows, collect, comparison_rows, markdown, reported_metrics, resolve_reference, snapshot_tag,
    terminal_table, unequal_compute, write_csv,
)
from medfed.compare.tune import (
    TuneSpec, check_tune, choose, chosen_overrides, collect_trials, edge_extensions, plan_candidates, plan_tuning, tuning_rows, tuning_section,
)
from medfed.errors import ConfigError
from medfed.output_dir import hold_output_dir


def compare(
    grid: Grid,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    jobs: int | None = None,
    source: str = "command line",
    progress: bool = True,
    reference: str | None = None,
    allow_unequal_compute: bool = False,
    budgets: list[float] | None = None,
    tune: TuneSpec | None = None,
    fuse: str = "auto",
) -> dict[str, str]:
    """Plan and check the whole grid, run what is not done, write comparison.csv, comparison.md and comparison.png.

    Args:
        grid: what to compare.
        overrides: more ``key=value`` overrides for every run.
        jobs: runs at once (default: the cores available).
        source: where the grid came from, for the md.
        progress: show a progress bar over the runs.
        reference: the method the tables pair every other against (default: fedavg if in the grid, else its first strategy).
        allow_unequal_compute: tabulate runs of unequal compute (:func:`~medfed.compare.tables.unequal_compute`),
            named in the md, instead of refusing them.
        budgets: the compute frontier (:mod:`medfed.compare.frontier`): the whole grid once per budget ``B``, in
            ``<output>/budget-<B>/`` with ``trainer.local_epochs=B`` in every run (each budget's tables as above;
            every budget's runs planned and checked before any starts), then ``frontier.csv`` and ``frontier.png``
            in ``<output>``. None: one comparison at the configs' own budget.
        tune: choose every method's hyperparameters on the validation split first (:mod:`medfed.compare.tune`);
            None: the configs' own values.
        fuse: ``auto``, ``on`` or ``off``: run the runs that share a strategy and model shape fused, in one
            process and one stacked step (:mod:`medfed.compare.fused`; ``auto``: where stacking pays).

    Returns:
        ``{run name: the end of its log}`` of the failed runs (empty: all finished).

    Raises:
        ConfigError: a bad grid (before any run starts), a metric no run reports, or runs of unequal compute
            (after the runs, before any table is written; the runs are kept, so the same command with
            ``--allow-unequal-compute`` only tabulates); with ``budgets``, a ``trainer.local_epochs`` override
            or a budget that is not a number > 0; with ``tune``, a bad space (:func:`~medfed.compare.tune.check_tune`).
    """
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: expected an integer >= 1 (runs at once; leave it out for one per core)")
    if fuse not in FUSE_OPTIONS:
        raise ConfigError(f"--fuse {fuse}: expected one of {', '.join(FUSE_OPTIONS)}")
    check_overrides(overrides)
    reference = resolve_reference(reference, grid.strategies)
    if tune is not None:
        check_tune(tune, grid.strategies, [*grid.overrides, *overrides], budgets)
    if budgets is not None:
        check_budgets(budgets, [*grid.overrides, *overrides])
    bound_plan(grid, budgets, tune)  # counted from the grid alone, before any config is resolved
    with hold_output_dir(grid.output, f"compare's output {str(grid.output)!r}", "compare", "give this one another --output"):
        if tune is not None:
            return _tune_and_compare(grid, overrides, tune, jobs, source, progress, reference, allow_unequal_compute, fuse)
        if budgets is None:
            runs = plan_runs(grid, overrides, jobs, progress=progress)
            return _run_and_tabulate(grid, overrides, runs, jobs, source, progress, reference, allow_unequal_compute, fuse=fuse)[0]
        return _compare_budgets(grid, overrides, budgets, jobs, source, progress, reference, allow_unequal_compute, fuse)


def _compare_budgets(
    grid: Grid,
    overrides: list[str] | tuple[str, ...],
    budgets: list[float],
    jobs: int,
    source: str,
    progress: bool,
    reference: str,
    allow_unequal_compute: bool,
    fuse: str,
) -> dict[str, str]:
    """``compare --budgets``: every budget's runs planned, then run and tabulated in turn, then the frontier."""
    failed: dict[str, str] = {}
    per_budget = []
    for budget, one, budget_overrides, runs in plan_budgets(grid, overrides, budgets, jobs):  # every budget checked first
        print(f"medfed: compare: budget {budget:g} ({budget_overrides[-1]})", file=sys.stderr)
        failed_here, finished, rows, metrics = _run_and_tabulate(
            one, budget_overrides, runs, jobs, f"{source}, {budget_overrides[-1]}", progress, reference, allow_unequal_compute, fuse=fuse
        )
        failed.update({f"budget-{budget:g}/{name}": tail for name, tail in failed_here.items()})
        per_budget.append((budget, finished, rows, metrics))
    _write_frontier(grid, source, per_budget)
    return failed


def _tune_and_compare(
    grid: Grid,
    overrides: list[str] | tuple[str, ...],
    tune: TuneSpec,
    jobs: int,
    source: str,
    progress: bool,
    reference: str,
    allow_unequal_compute: bool,
    fuse: str,
) -> dict[str, str]:
    """``compare --tune``: the tuning runs (validation split only), the choice, then the grid with the chosen values."""
    found, tuning_runs = plan_tuning(grid, overrides, tune, jobs)  # every configuration resolved before any run starts
    seeds = sorted({run.seed for run in tuning_runs})
    print(
        f"medfed: compare: tuning on the validation split: {len(found)} configurations, {len(tuning_runs)} runs, "
        f"{sum(run.action == 'done' for run in tuning_runs)} already finished, in {grid.output / 'tuning'}",
        file=sys.stderr,
    )
    failed = {f"tuning/{name}": tail for name, tail in execute(tuning_runs, jobs, progress, fuse).items()}
    finished = collect(tuning_runs)
    metric = (grid.metrics or reported_metrics(finished) or [None])[0]
    if metric is None:
        raise ConfigError("compare --tune: no tuning run finished, nothing to choose from (their logs are in the tuning folder's logs/)")
    trials = collect_trials(found, tuning_runs, finished, metric)
    chosen = choose(trials)
    steps: dict[tuple[str, str, str], int] = {}
    while tune.extend:  # the chosen value at an edge of what was tried: one step beyond, and choose again
        more, more_runs = [], []
        for candidate, key in edge_extensions(trials, chosen, steps, tune.extend):
            try:
                more_runs += plan_candidates(grid, overrides, tune, jobs, [candidate])
                more.append(candidate)
            except ConfigError:  # the key's allowed range ends here
                steps[(candidate.setting, candidate.strategy, key)] = tune.extend
        if not more:
            break
        print(f"medfed: compare: {len(more)} configurations one step beyond the edge of their space", file=sys.stderr)
        failed.update({f"tuning/{name}": tail for name, tail in execute(more_runs, jobs, progress).items()})
        found, tuning_runs = [*found, *more], [*tuning_runs, *more_runs]
        finished = collect(tuning_runs)
        trials = collect_trials(found, tuning_runs, finished, metric)
        chosen = choose(trials)
    grid.output.mkdir(parents=True, exist_ok=True)
    write_csv(tuning_rows(trials, chosen), grid.output / "tuning.csv")
    extra = chosen_overrides(chosen)
    runs = []
    for config in grid.configs:
        setting = setting_of(grid, config)[0]
        for strategy in grid.strategies:
            one = replace(grid, configs=[config], strategies=[strategy])
            runs += plan_runs(one, overrides, jobs, announce=strategy == grid.strategies[0], extra=extra[(setting, strategy)])
    settings = list(dict.fromkeys(run.setting for run in runs))
    rounds = ", ".join(str(value) for value in sorted({item.results["config"]["trainer"]["rounds"] for item in finished}))
    section = tuning_section(trials, chosen, settings, grid.strategies, metric, tune, seeds, rounds, steps)
    cells = {key: (trial.candidate.values if trial is not None else "config's values") for key, trial in chosen.items()}
    failed.update(_run_and_tabulate(grid, overrides, runs, jobs, source, progress, reference, allow_unequal_compute, (section, cells), fuse)[0])
    return failed


def _run_and_tabulate(
    grid: Grid,
    overrides: list[str] | tuple[str, ...],
    runs: list[Run],
    jobs: int,
    source: str,
    progress: bool,
    reference: str,
    allow_unequal_compute: bool,
    tuning: tuple[list[str], dict[tuple[str, str], str]] | None = None,
    fuse: str = "auto",
) -> tuple[dict[str, str], list[Finished], list[dict[str, Any]], list[str]]:
    """Run the planned ``runs`` of ``grid`` and write its tables: ``(failed runs, finished runs, comparison rows, metrics)``.

    ``tuning``: with ``--tune``, comparison.md's tuning section and ``{(setting, method): the chosen values}``,
    comparison.csv's ``tuned`` column."""
    from medfed.viz.plots import plot_comparison, save_figure

    done = sum(run.action == "done" for run in runs)
    print(
        f"medfed: compare: {len(runs)} runs, {done} already finished, {sum(run.action == 'resume' for run in runs)} to resume; "
        f"{jobs} at a time in {grid.output}",
        file=sys.stderr,
    )
    failed = execute(runs, jobs, progress, fuse)
    finished = collect(runs)
    unequal = unequal_compute(finished, reference)
    if unequal and not allow_unequal_compute:
        raise ConfigError(
            f"compare: runs of unequal compute in one table (training epochs per site and round, tolerance {BUDGET_TOLERANCE:.0%}): "
            + "; ".join(unequal)
            + ". Give every method the same trainer.local_epochs (and its equal preset), or pass --allow-unequal-compute"
        )
    metrics = grid.metrics or reported_metrics(finished)
    rows = comparison_rows(finished, metrics) if metrics else []
    if rows:
        rows += baseline_rows(finished, metrics, list(rows[0]))
    if tuning is not None:
        rows = [{**row, "tuned": tuning[1].get((row["config"], row["strategy"]), "")} for row in rows]
    settings = list(dict.fromkeys(run.setting for run in runs))
    grid.output.mkdir(parents=True, exist_ok=True)
    write_csv(rows, grid.output / "comparison.csv")
    with atomic_write(grid.output / "comparison.md") as handle:
        handle.write(
            markdown(
                replace(grid, overrides=[*grid.overrides, *overrides]), source, settings, rows, finished, failed, metrics, reference,
                tuning=None if tuning is None else tuning[0],
            )
        )
    if rows:
        figure = plot_comparison(rows, metrics, settings, grid.strategies, title=source + generated_tag(finished) + snapshot_tag(finished, metrics[0]))
        save_figure(figure, grid.output / "comparison.png")
    if rows:
        print(terminal_table(rows, settings, grid.strategies, metrics[0], reference) + generated_tag(finished))
    print(f"medfed: compare: wrote {grid.output / 'comparison.md'}, comparison.csv and comparison.png", file=sys.stderr)
    return failed, finished, rows, metrics


def generated_tag(finished: list[Finished]) -> str:
    """`` (GENERATED data)`` when any of the runs trained on generated data, else empty."""
    return " (GENERATED data)" if any(item.results["federation"]["generated"] for item in finished) else ""


def _write_frontier(grid: Grid, source: str, per_budget: list[tuple[float, list[Finished], list[dict[str, Any]], list[str]]]) -> None:
    """frontier.csv and frontier.png in ``grid.output`` from every budget's finished runs (:mod:`medfed.compare.frontier`)."""
    from medfed.viz.plots import plot_frontier, save_figure

    metrics = list(dict.fromkeys(metric for *_, metrics in per_budget for metric in metrics))
    finished = [item for _, runs, *_ in per_budget for item in runs]
    settings = list(dict.fromkeys(item.run.setting for item in finished))
    rows = frontier_rows([(budget, runs, rows) for budget, runs, rows, _ in per_budget], metrics, settings, grid.strategies)
    if not rows:
        print("medfed: compare: no finished run: no frontier.csv or frontier.png written", file=sys.stderr)
        return
    write_csv(rows, grid.output / "frontier.csv")
    title = f"{source}: the compute frontier, last round{generated_tag(finished)}"
    save_figure(plot_frontier(rows, metrics, settings, grid.strategies, title=title), grid.output / "frontier.png")
    print(f"medfed: compare: wrote {grid.output / 'frontier.csv'} and frontier.png", file=sys.stderr)
