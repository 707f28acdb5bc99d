"""Planning a comparison: every (config, strategy, seed) of a grid as a :class:`Run`, checked before any run starts.

:func:`plan_runs` resolves each run's config with its overrides
(:func:`medfed.components.resolve`), checks that each site's round can be
chosen on a validation split, gives each run its folder
(``<output>/<config>/<strategy>/seed<k>``) and thread count, and looks in
that folder (:func:`_inspect`): a run already finished with this config
is ``done``, one with a checkpoint is resumed, a folder holding a run of
another config is refused. Nothing is run or written.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.checkpoint import FOLDER, checkpoints, config_differences
from medfed.compare.grid import Grid, setting_of
from medfed.components import default_config, resolve
from medfed.config import load_config
from medfed.errors import ConfigError, DataError
from medfed.results import results_fault

VALIDATION_SPLIT = "federation.validation_fraction=0.2"
"""The override compare adds to the runs of a config without a validation split (their rounds are chosen on it)."""
NOT_COMPARED = ("trainer.num_threads", "trainer.device", "logger.figures")
"""Config keys a finished run may differ in and still count as the grid's run (besides the resumable ones): where
and on how many threads it ran, and whether it drew its PNGs, not what it ran (a grid started on a GPU machine may
be finished on a CPU; each run's results.json names its device under ``execution``)."""


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
        variant: a tuning run's configuration (:mod:`medfed.compare.tune`), a folder of its own; empty for a grid's run.
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
    variant: str = ""

    @property
    def name(self) -> str:
        return f"{self.setting}/{self.strategy}/{f'{self.variant}/' if self.variant else ''}seed{self.seed}"


def default_jobs() -> int:
    """The cores this process may use (its CPU affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_runs(
    grid: Grid,
    overrides: list[str] | tuple[str, ...] = (),
    jobs: int | None = None,
    announce: bool = True,
    *,
    extra: list[str] | tuple[str, ...] = (),
    variant: str = "",
    holdout: str = "test",
    progress: bool = False,
) -> list[Run]:
    """Every run of ``grid``, each config resolved and its folder inspected; nothing is run or written.

    Args:
        grid: the grid.
        overrides: more ``key=value`` overrides (the command line's), after the grid's.
        jobs: runs at once; a new run gets ``trainer.num_threads`` = cores // jobs (at least 1).
        announce: say on stderr which configs get a validation split (False: the caller said it already).
        extra: overrides after those (a tuned configuration's, :mod:`medfed.compare.tune`).
        variant: a folder between each run's strategy and seed (``<output>/<config>/<strategy>/<variant>/seed<k>``),
            and in its name: a tuning run's configuration.
        holdout: ``"test"`` (a grid's runs) or ``"validation"``: tuning runs, whose every metric is on the
            validation split and whose test split is set aside unread (``federation.holdout=validation``, after
            every other override).
        progress: a labelled bar on stderr while the runs' configs are checked, when that takes over a second
            (a shipped grid of ~200 runs: a minute on two busy cores).

    A config without a validation split (``federation.validation_fraction``
    0) gets one for its runs, :data:`VALIDATION_SPLIT` (recorded in each
    run's config), and one line on stderr says so.

    Raises:
        ConfigError: the first problem, naming the run and the key: a config
            that does not resolve or does not report test metrics, a folder
            holding a run of another config.
        DataError: a run folder's results.json or config.json is damaged (naming it).
    """
    threads = max(1, default_jobs() // (jobs or default_jobs()))
    settings = [setting_of(grid, entry) for entry in grid.configs]
    labels = [label for label, _, _ in settings]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"grid key 'configs': two settings share a name ({', '.join(labels)}); the tables need distinct names")
    runs, without_validation = [], []
    count = len(settings) * len(grid.strategies) * len(grid.seeds)
    bar = tqdm(total=count, desc="compare: checking each run's config", unit="run", leave=False, delay=1.0, disable=not progress)
    for label, path, own in settings:
        for strategy in grid.strategies:
            for seed in grid.seeds:
                bar.update()
                folder = Path(label, strategy, variant) if variant else Path(label, strategy)
                output_dir = grid.output / folder / f"seed{seed}"
                fixed = [*grid.overrides, *own, *overrides, *extra, f"strategy.name={strategy}", f"trainer.seed={seed}", f"output_dir={output_dir}"]
                where = f"{folder}/seed{seed}"
                try:
                    if grid.new_data_per_seed:
                        fixed += data_draw_overrides(load_config(path, fixed), seed, fixed)
                    if not _has_validation_split(load_config(path, fixed)):  # (checked before resolving: trainer.patience needs one)
                        fixed.append(VALIDATION_SPLIT)
                        if label not in without_validation:
                            without_validation.append(label)
                    resolved = resolve(load_config(path, [*fixed, f"trainer.num_threads={threads}"]))
                    _check_selectable(resolved.run.federation)
                    if holdout != "test":
                        fixed.append(f"federation.holdout={holdout}")
                        resolved = resolve(load_config(path, [*fixed, f"trainer.num_threads={threads}"]))
                    action, run_threads = _inspect(output_dir, resolved.config, threads, default_config(resolved))
                except ConfigError as error:
                    raise ConfigError(f"{where}: {error}") from None
                log = grid.output / "logs" / folder / f"seed{seed}.log"
                overrides_of_run = (*fixed, f"trainer.num_threads={run_threads}")
                runs.append(Run(label, path, strategy, seed, output_dir, overrides_of_run, run_threads, log, action, variant))
    bar.close()
    if without_validation and announce:
        print(
            f"medfed: compare: no validation split in {', '.join(without_validation)}: each of its runs chooses its sites' rounds "
            f"on {VALIDATION_SPLIT} of each site's training data (recorded in the run's config)",
            file=sys.stderr,
        )
    return runs


DRAW_FOLDER = "{root}-draw{seed}"
"""Where a seed's own generated data set goes (``new_data_per_seed``): beside the config's ``data.root``."""


def data_draw_overrides(config: Any, seed: int, overrides: list[str]) -> list[str]:
    """With ``new_data_per_seed``: the overrides that give a run of ``seed`` its own draw of the generated data set.

    ``data.generate.seed`` = ``seed`` and ``data.root`` = :data:`DRAW_FOLDER` (runs of different draws never share a
    folder, so two of them side by side do not take turns regenerating one). Nothing for a config that reads data
    rather than generating it (``data.generate`` null): its seed reshuffles the same records.

    Raises:
        ConfigError: an override of ``data.generate.seed`` (the seed sets it).
    """
    data = config.get("data") or {}
    if not data.get("generate"):
        return []
    for override in overrides:
        if override.partition("=")[0].strip() == "data.generate.seed":
            raise ConfigError(f"override {override!r} with new_data_per_seed: each seed's data set is drawn with that seed; drop the override")
    return [f"data.generate.seed={seed}", f"data.root={DRAW_FOLDER.format(root=data.get('root'), seed=seed)}"]


def _has_validation_split(config: Any) -> bool:
    """Whether a loaded (not yet resolved) run config asks for a validation split (``federation.validation_fraction`` > 0)."""
    federation = config.get("federation") or {}
    try:
        return float(federation.get("validation_fraction") or 0) > 0
    except (TypeError, ValueError):
        return True  # not a number: resolving names the key


def _check_selectable(federation: Any) -> None:
    """The runs must report test metrics (a validation split to choose each site's round on is added when missing)."""
    if federation.holdout != "test":
        raise ConfigError(
            f"config key 'federation.holdout' = {federation.holdout!r}: compare reports test metrics and chooses rounds on a "
            "validation split beside them; use holdout test"
        )


def _inspect(output_dir: Path, config: dict[str, Any], threads: int, defaults: dict[str, Any]) -> tuple[str, int]:
    """What a run folder holds for the run of ``config``: ``(action, thread count to run with)``.

    ``done`` when results.json holds this config (the thread count, the
    folder and kept checkpoints aside), or holds it with fewer rounds but
    stopped on its validation plateau; ``resume`` when a checkpoint of it
    (or results of fewer rounds, reaching that cap) is there, with the thread count the run
    started with, which ``--resume`` needs; else ``new``. A key the saved
    config lacks (a run made before medfed had it) counts as equal where
    ``config`` holds its default (``defaults``, :func:`~medfed.components.default_config`),
    and the options of strategies other than the run's (``strategy.<other>.*``) are not compared.

    Raises:
        ConfigError: the folder holds a run of another config, or of more rounds.
        DataError: its results.json or config.json is damaged (naming the file).
    """
    results, started = output_dir / "results.json", output_dir / "config.json"
    source = results if results.is_file() else started if checkpoints(output_dir / FOLDER) and started.is_file() else None
    if source is None:
        return "new", threads
    document = read_run_file(source)
    saved = document.get("config") if source == results else document
    if not isinstance(saved, dict) or not isinstance(saved.get("trainer"), dict) or not isinstance(saved["trainer"].get("rounds"), int):
        raise DataError(f"{source}: holds no run config with trainer.rounds; the file is damaged: delete the run folder {output_dir} to run it again")
    changed = [
        key
        for key in config_differences(saved, config)
        if key not in NOT_COMPARED and not _another_strategys(key, config) and not _added_at_default(key, saved, config, defaults)
    ]
    rounds, saved_rounds = config["trainer"]["rounds"], saved["trainer"]["rounds"]
    if saved_rounds > rounds:
        changed.append(f"trainer.rounds ({saved_rounds} there, {rounds} asked)")
    if changed:
        raise ConfigError(
            f"config key 'output_dir' = '{output_dir}' holds a run of another config (it differs at {', '.join(changed)}); "
            "delete that folder or choose another grid output"
        )
    saved_threads = saved["trainer"].get("num_threads") or threads
    # a run that stopped on its validation plateau reads only its history: under a larger cap it stops at the same round
    stopped_on_plateau = isinstance(document.get("stopped"), dict) and "best_round" in document["stopped"]
    if source == results and (saved_rounds == rounds or stopped_on_plateau):
        return "done", saved_threads
    return "resume", saved_threads


def _another_strategys(key: str, config: dict[str, Any]) -> bool:
    """Whether dotted ``key`` is an option of a strategy other than the run's (``strategy.<other>.*``), which the run never reads."""
    group, _, rest = key.partition(".")
    return group == "strategy" and rest.split(".", 1)[0] not in ("name", config["strategy"]["name"])


def _added_at_default(key: str, saved: dict[str, Any], config: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """Whether dotted ``key`` is missing from ``saved`` and ``config`` holds it at its value in ``defaults``."""
    missing = object()

    def lookup(tree: Any, path: list[str]) -> Any:
        for name in path:
            if not isinstance(tree, dict) or name not in tree:
                return missing
            tree = tree[name]
        return tree

    path = key.split(".")
    default = lookup(defaults, path)
    return lookup(saved, path) is missing and default is not missing and lookup(config, path) == default


def read_run_file(path: Path, key: str | None = None) -> dict[str, Any]:
    """A run's results.json (its integrity trailer checked, :func:`~medfed.results.results_fault`) or config.json
    (or its mapping under ``key``), read as a JSON object.

    Raises:
        DataError: naming the file: unreadable, truncated or corrupt JSON, not an object, without ``key``, or a
            results.json without its trailer or changed since it was written.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path}: not readable as JSON ({error}); the file is damaged: delete its run folder to run it again") from None
    if path.name == "results.json" and isinstance(value, dict):
        fault = results_fault(value)
        if fault is not None:
            raise DataError(f"{path}: {fault}; compare does not count it: restore the file, or delete its run folder to run it again")
    if key is not None:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object{f' with a {key!r} object' if key else ''}; the file is damaged: delete its run folder to run it again")
    return value
