"""``python -m medfed compare``: every (config, strategy, seed) of a grid as its own run, then the tables.

A *grid* names run configs (the settings, the tables' columns), strategies
(``all``: every registered one, the tables' rows), seeds, overrides common to
every run, the metrics to tabulate and an output folder; it is a YAML file
(:func:`read_grid`, e.g. ``configs/paper/table3_brats.yaml``) or the same
given on the command line. :func:`compare`

1. plans every run and checks the whole grid before any run starts: each
   config is resolved with its overrides (:func:`medfed.components.resolve`),
   every strategy name is known, each site's round can be chosen on a
   validation split (``federation.validation_fraction`` > 0, ``holdout:
   test``), and a run folder that holds a run of another config is refused;
   any problem is one :class:`~medfed.errors.ConfigError`;
2. runs each (config, strategy, seed) as ``medfed fit`` in a process of its
   own (forked from a run server that imported torch once) with its own ``output_dir``, ``<output>/<config>/<strategy>/seed<k>``,
   ``jobs`` at a time, each with ``trainer.num_threads`` = cores // jobs
   (a resumed run keeps the count it started with); a run whose
   ``results.json`` holds the same config is not run again, one with a
   checkpoint but no results (interrupted, or asked for more rounds) is
   continued with ``--resume``; a failing run is reported with the end of
   its log (``<output>/logs/...``) and the others go on;
3. writes ``comparison.csv`` (one row per run and site), ``comparison.md``
   (methods x settings, ``mean ± std`` over seeds of the mean over sites, per
   metric, for the last round and for the validation-selected round; wall
   times) and ``comparison.png`` from every run that finished.

The validation-selected round of a site (:func:`selected_round`) is the round
whose validation score of the *primary* metric (the first of ``metrics``;
higher is better) is highest, the earliest of equal ones; the site's *test*
metrics at that round are reported. The test split never takes part in the
choice.
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from medfed.atomic import atomic_write
from medfed.checkpoint import FOLDER, checkpoints, config_differences
from medfed.config import BUNDLED_CONFIGS, find_config, load_config, read_yaml_mapping
from medfed.errors import ConfigError

GRID_KEYS = ("configs", "strategies", "seeds", "overrides", "metrics", "output")
BUNDLED_GRIDS = BUNDLED_CONFIGS / "paper"
"""Grids shipped with medfed (``configs/paper`` in the repository): ``--grid table3_brats`` finds them."""
TAIL_LINES = 5
"""Lines of a failed run's log shown in its report."""
NOT_COMPARED = ("trainer.num_threads",)
"""Config keys a finished run may differ in and still count as the grid's run (besides the resumable ones)."""


@dataclass(frozen=True)
class Grid:
    """What to compare.

    Attributes:
        configs: run configs, each a path or a bundled config's name; their
            file names (without ``.yaml``) label the settings.
        strategies: strategy names (``all`` expanded), the tables' rows in this order.
        seeds: ``trainer.seed`` of the runs of every (config, strategy).
        overrides: ``key=value`` overrides given to every run.
        metrics: metrics to tabulate, the first one primary (chooses the
            validation round); empty: every metric the runs report.
        output: the comparison folder.
    """

    configs: list[str]
    strategies: list[str]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    output: Path = Path("outputs/compare")


@dataclass(frozen=True)
class Run:
    """One (config, strategy, seed) of a grid.

    Attributes:
        setting: the config's label (its file name without ``.yaml``).
        config_path: the config file.
        strategy, seed: as run.
        output_dir: the run's own folder.
        overrides: every override ``fit`` gets (the grid's, the run's
            strategy, seed, output_dir and thread count).
        threads: ``trainer.num_threads`` of the run.
        log: where its output goes (``<output>/logs/<config>/<strategy>/seed<k>.log``).
        action: ``"done"`` (finished with this config), ``"resume"``
            (a checkpoint to continue) or ``"new"``.
    """

    setting: str
    config_path: Path
    strategy: str
    seed: int
    output_dir: Path
    overrides: tuple[str, ...]
    threads: int
    log: Path
    action: str

    @property
    def name(self) -> str:
        return f"{self.setting}/{self.strategy}/seed{self.seed}"


def read_grid(name: str | Path) -> Grid:
    """Read and check a grid YAML (keys :data:`GRID_KEYS`; ``strategies: all`` expanded).

    Raises:
        ConfigError: naming the file and the key: an unknown key, a missing
            ``configs``, a value of the wrong kind, an unknown strategy.
    """
    path = find_config(name, BUNDLED_GRIDS, "grid")
    values = read_yaml_mapping(path.read_text(encoding="utf-8", errors="replace"), str(path))
    unknown = sorted(set(values) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown grid key '{unknown[0]}' (known keys: {', '.join(GRID_KEYS)})")
    if not values.get("configs"):
        raise ConfigError(f"{path}: grid key 'configs' is required: a list of run configs (paths or bundled names)")
    try:
        return make_grid(
            configs=values["configs"],
            strategies=values.get("strategies", "all"),
            seeds=values.get("seeds", [0]),
            overrides=values.get("overrides") or [],
            metrics=values.get("metrics") or [],
            output=values.get("output") or f"outputs/compare/{path.stem}",
        )
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def make_grid(configs: Any, strategies: Any, seeds: Any, overrides: Any, metrics: Any, output: Any) -> Grid:
    """A checked :class:`Grid` from plain values (a grid file's, or the command line's).

    Raises:
        ConfigError: naming the grid key whose value is of the wrong kind, or an unknown strategy.
    """
    from medfed.federated.strategies import STRATEGIES

    configs, overrides, metrics = (_strings(value, key) for value, key in ((configs, "configs"), (overrides, "overrides"), (metrics, "metrics")))
    bad = [override for override in overrides if "=" not in override]
    if bad:
        raise ConfigError(f"grid key 'overrides': {bad[0]!r} is not key=value")
    strategies = _strings(strategies, "strategies")
    if strategies == ["all"]:
        strategies = list(STRATEGIES)
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise ConfigError(f"grid key 'strategies': unknown strategy {unknown[0]!r}; expected all or names from {', '.join(STRATEGIES)}")
    seeds = seeds if isinstance(seeds, list) else [seeds]
    if not seeds or not all(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 for seed in seeds):
        raise ConfigError(f"grid key 'seeds' = {seeds!r}: expected a list of integers >= 0")
    for key, values in (("configs", configs), ("strategies", strategies), ("seeds", seeds)):
        if not values or len(set(values)) != len(values):
            raise ConfigError(f"grid key '{key}' = {values!r}: expected a non-empty list without repeats")
    return Grid(configs, strategies, seeds, overrides, metrics, Path(output))


def _strings(value: Any, key: str) -> list[str]:
    """``value`` as a list of strings (a single string becomes a one-item list)."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(item, str) and item for item in values):
        raise ConfigError(f"grid key '{key}' = {value!r}: expected a list of strings")
    return values


def default_jobs() -> int:
    """The cores this process may use (its CPU affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_runs(grid: Grid, overrides: list[str] | tuple[str, ...] = (), jobs: int | None = None) -> list[Run]:
    """Every run of ``grid``, each config resolved and its folder inspected; nothing is run or written.

    Args:
        grid: the grid.
        overrides: more ``key=value`` overrides (the command line's), after the grid's.
        jobs: runs at once; a new run gets ``trainer.num_threads`` = cores // jobs (at least 1).

    Raises:
        ConfigError: the first problem, naming the run and the key: a config
            that does not resolve, no validation split to choose rounds on,
            a folder holding a run of another config.
    """
    from medfed.components import resolve

    threads = max(1, default_jobs() // (jobs or default_jobs()))
    paths = {config: find_config(config) for config in grid.configs}
    labels = [path.stem for path in paths.values()]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"grid key 'configs': two configs share a file name ({', '.join(labels)}); the tables need distinct names")
    runs = []
    for config, path in paths.items():
        for strategy in grid.strategies:
            for seed in grid.seeds:
                output_dir = grid.output / path.stem / strategy / f"seed{seed}"
                fixed = [*grid.overrides, *overrides, f"strategy.name={strategy}", f"trainer.seed={seed}", f"output_dir={output_dir}"]
                where = f"{path.stem}/{strategy}/seed{seed}"
                try:
                    resolved = resolve(load_config(path, [*fixed, f"trainer.num_threads={threads}"]))
                    _check_selectable(resolved.run.federation)
                    action, run_threads = _inspect(output_dir, resolved.config, threads)
                except ConfigError as error:
                    raise ConfigError(f"{where}: {error}") from None
                log = grid.output / "logs" / path.stem / strategy / f"seed{seed}.log"
                runs.append(Run(path.stem, path, strategy, seed, output_dir, (*fixed, f"trainer.num_threads={run_threads}"), run_threads, log, action))
    return runs


def _check_selectable(federation: Any) -> None:
    """The runs must report test metrics and a validation split to choose each site's round on."""
    if federation.holdout != "test":
        raise ConfigError(
            f"config key 'federation.holdout' = {federation.holdout!r}: compare reports test metrics and chooses rounds on a "
            "validation split beside them; use holdout test with federation.validation_fraction > 0"
        )
    if federation.validation_fraction <= 0:
        raise ConfigError(
            "config key 'federation.validation_fraction' = 0.0: compare chooses each site's round on its validation split; "
            "set it > 0 (e.g. federation.validation_fraction=0.2 in the grid's overrides)"
        )


def _inspect(output_dir: Path, config: dict[str, Any], threads: int) -> tuple[str, int]:
    """What a run folder holds for the run of ``config``: ``(action, thread count to run with)``.

    ``done`` when results.json holds this config (the thread count, the
    folder and kept checkpoints aside); ``resume`` when a checkpoint of it
    (or results of fewer rounds) is there, with the thread count the run
    started with, which ``--resume`` needs; else ``new``.

    Raises:
        ConfigError: the folder holds a run of another config, or of more rounds.
    """
    results, started = output_dir / "results.json", output_dir / "config.json"
    source = results if results.is_file() else started if checkpoints(output_dir / FOLDER) and started.is_file() else None
    if source is None:
        return "new", threads
    saved = json.loads(source.read_text())["config"] if source == results else json.loads(source.read_text())
    changed = [key for key in config_differences(saved, config) if key not in NOT_COMPARED]
    rounds, saved_rounds = config["trainer"]["rounds"], saved["trainer"]["rounds"]
    if saved_rounds > rounds:
        changed.append(f"trainer.rounds ({saved_rounds} there, {rounds} asked)")
    if changed:
        raise ConfigError(
            f"config key 'output_dir' = '{output_dir}' holds a run of another config (it differs at {', '.join(changed)}); "
            "delete that folder or choose another grid output"
        )
    saved_threads = saved["trainer"]["num_threads"] or threads
    if source == results and saved_rounds == rounds:
        return "done", saved_threads
    return "resume", saved_threads


RUN_SERVER_PRELOAD = ("medfed.cli", "medfed.compare", "medfed.experiment", "medfed.tasks.brats", "medfed.tasks.luna16", "medfed.tasks.clinical")
"""Modules the run server imports once, so a run does not spend ~10 s importing torch, Lightning and MONAI again."""


def execute(runs: list[Run], jobs: int, progress: bool = True) -> dict[str, str]:
    """Run every run not ``done``, ``jobs`` at a time, each ``medfed fit`` in its own process.

    Each run is a process forked from a *run server* (``multiprocessing``'s
    forkserver) that imported medfed, torch, Lightning and MONAI once: the
    run is as isolated as ``python -m medfed fit`` in a fresh interpreter
    (own memory, seeds, thread count) but starts in a fraction of a second
    instead of ~10 s. torch's threads are each run's ``trainer.num_threads``;
    the libraries that read ``OMP_NUM_THREADS`` once, at import (OpenMP,
    BLAS, numba), read it in the server, which is started with it set to
    the new runs' count (a server already running in this process, from an
    earlier ``execute``, keeps its own). A run's output (stdout and stderr) goes to its ``log``,
    beside the run folders. On Ctrl-C no further run starts, the running
    ones get SIGINT (each checkpoints and stops) and KeyboardInterrupt is
    raised.

    Returns:
        ``{run name: the last lines of its log}`` of the runs that failed.
    """
    todo = [run for run in runs if run.action != "done"]
    failed: dict[str, str] = {}
    running: dict[str, multiprocessing.process.BaseProcess] = {}
    lock = threading.Lock()
    stopping = threading.Event()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RUN_SERVER_PRELOAD))
    if todo:
        _start_run_server(min(run.threads for run in todo))
    bar = tqdm(total=len(todo), desc="runs", unit="run", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=jobs)
    futures = {pool.submit(_fit, context, run, running, lock, stopping): run for run in todo}
    try:
        for future in as_completed(futures):
            run = futures[future]
            code, tail = future.result()
            if code != 0:
                failed[run.name] = tail
                tqdm.write(f"medfed: run {run.name} failed (exit status {code}): {tail}", file=sys.stderr)
            bar.update()
            bar.set_postfix(failed=len(failed))
    except KeyboardInterrupt:
        stopping.set()
        with lock:
            for process in running.values():
                if process.pid is not None:
                    os.kill(process.pid, signal.SIGINT)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return failed


def _start_run_server(threads: int) -> None:
    """Start the forkserver (if it is not running) with ``OMP_NUM_THREADS=threads`` in its environment; this process's is left as it was."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def _fit(context: Any, run: Run, running: dict[str, Any], lock: threading.Lock, stopping: threading.Event) -> tuple[int, str]:
    """One run as a ``fit`` process forked from the run server; ``(exit status, last lines of its log)``."""
    run.log.parent.mkdir(parents=True, exist_ok=True)
    argv = ["fit", "--config", str(run.config_path), "--quiet", *run.overrides]
    if run.action == "resume":
        argv.append("--resume")
    with lock:
        if stopping.is_set():
            return 130, "not started (interrupted)"
        status_reader, status_writer = context.Pipe(duplex=False)
        process = context.Process(target=_fit_in_run_server_child, args=(argv, str(run.log), status_writer), name=run.name)
        process.start()
        status_writer.close()
        running[run.name] = process
    process.join()
    with lock:
        del running[run.name]
    # fit's exit status as the run reported it: the forkserver's own report can be lost (Python 3.11 gave 255 for a run that ended with 0)
    try:
        code = status_reader.recv()
    except EOFError:  # it ended before fit returned (a crash, a signal): the process's own status
        code = process.exitcode
    status_reader.close()
    code = 1 if code is None else 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell reports it
    lines = [line for line in run.log.read_text(errors="replace").splitlines() if line.strip()]
    return code, " | ".join(lines[-TAIL_LINES:])


def _fit_in_run_server_child(argv: list[str], log: str, status: Any) -> None:
    """The run's process: stdout and stderr to ``log``, then ``medfed fit``; fit's exit status goes to ``status`` (a pipe's end) and is the process's."""
    from medfed.cli import main

    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    try:
        code = main(argv)
    except KeyboardInterrupt:
        code = 130
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    status.send(code)
    sys.exit(code)


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
    """The runs whose results.json is there (failed ones are left out)."""
    finished = []
    for run in runs:
        path = run.output_dir / "results.json"
        if path.is_file():
            finished.append(Finished(run, json.loads(path.read_text())))
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


def compare(
    grid: Grid,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    jobs: int | None = None,
    source: str = "command line",
    progress: bool = True,
) -> dict[str, str]:
    """Plan and check the whole grid, run what is not done, write comparison.csv, comparison.md and comparison.png.

    Args:
        grid: what to compare.
        overrides: more ``key=value`` overrides for every run.
        jobs: runs at once (default: the cores available).
        source: where the grid came from, for the md.
        progress: show a progress bar over the runs.

    Returns:
        ``{run name: the end of its log}`` of the failed runs (empty: all finished).

    Raises:
        ConfigError: a bad grid (before any run starts), or a metric no run reports.
    """
    from medfed.viz.plots import plot_comparison, save_figure

    jobs = jobs or default_jobs()
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: expected an integer >= 1")
    runs = plan_runs(grid, overrides, jobs)
    done = sum(run.action == "done" for run in runs)
    print(
        f"medfed: compare: {len(runs)} runs, {done} already finished, {sum(run.action == 'resume' for run in runs)} to resume; "
        f"{jobs} at a time in {grid.output}",
        file=sys.stderr,
    )
    failed = execute(runs, jobs, progress)
    finished = collect(runs)
    metrics = grid.metrics or _reported_metrics(finished)
    rows = comparison_rows(finished, metrics) if metrics else []
    settings = list(dict.fromkeys(run.setting for run in runs))
    grid.output.mkdir(parents=True, exist_ok=True)
    write_csv(rows, grid.output / "comparison.csv")
    with atomic_write(grid.output / "comparison.md") as handle:
        handle.write(markdown(replace(grid, overrides=[*grid.overrides, *overrides]), source, settings, rows, finished, failed, metrics))
    if rows:
        generated = any(item.results["federation"]["generated"] for item in finished)
        figure = plot_comparison(
            {column: run_means(rows, column) for metric in metrics for column in (f"last_{metric}", f"selected_{metric}")},
            metrics,
            settings,
            grid.strategies,
            title=f"{source}: mean ± std over seeds of the mean over sites" + (" (GENERATED data)" if generated else ""),
        )
        save_figure(figure, grid.output / "comparison.png")
    print(f"medfed: compare: wrote {grid.output / 'comparison.md'}, comparison.csv and comparison.png", file=sys.stderr)
    return failed


def _reported_metrics(finished: list[Finished]) -> list[str]:
    """Every metric the first finished run reports at its last round, in its order (empty: no run finished)."""
    if not finished:
        return []
    return list(next(iter(finished[0].results["history"][-1]["metrics"].values())))
