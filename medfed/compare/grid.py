"""A comparison's grid: which run configs (the settings), strategies and seeds, with which overrides, metrics and output.

A grid is a YAML file (:func:`read_grid`, e.g. ``configs/paper/table3_brats.yaml``,
keys :data:`GRID_KEYS`) or the same given on the command line
(:func:`make_grid`); either is checked here, before anything is planned.

A setting is a config (a path or a bundled name, labelled by its file name)
or, in a grid file, a mapping ``{name: <label>, config: <config>, overrides:
[...]}``: the config under a label of its own with overrides of its own
(after the grid's, before the command line's), so one grid can put variants
of one config side by side as columns (``configs/ablation/pfednet_brats.yaml``).

``new_data_per_seed: true`` (``--new-data-per-seed``) makes the generated
data set part of the replication unit: each seed's runs of a setting whose
config generates its data (``data.generate``) train and test on a data set
drawn with that seed (``data.generate.seed`` = the seed, in a folder of its
own, ``<data.root>-draw<seed>``), so the seeds' intervals cover new patients,
not a reshuffle of the same ones (:func:`~medfed.compare.plan.data_draw_overrides`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medfed.components import STRATEGY_NAMES
from medfed.config import BUNDLED_CONFIGS, find_config, read_yaml_mapping, read_yaml_text
from medfed.errors import ConfigError

GRID_KEYS = ("configs", "strategies", "seeds", "overrides", "metrics", "output", "new_data_per_seed")
BUNDLED_GRIDS = BUNDLED_CONFIGS / "paper"
"""Grids shipped with medfed (``configs/paper`` in the repository): ``--grid table3_brats`` finds them."""
SET_BY_COMPARE = {
    "output_dir": "each run's folder is <output>/<config>/<strategy>/seed<k>; choose <output> with --output or the grid's output",
    "strategy.name": "the runs' strategies are the grid's strategies (--strategies)",
    "trainer.seed": "the runs' seeds are the grid's seeds (--seeds)",
    "trainer.num_threads": "each new run gets cores // --jobs threads",
}
"""Config keys compare sets for each run itself, and how to choose them instead: an override of one is refused."""


@dataclass(frozen=True)
class Setting:
    """A setting given as a mapping: a config under a label, with overrides of its own.

    Attributes:
        config: the run config (a path or a bundled name).
        overrides: ``key=value`` overrides of this setting's runs (after the grid's, before the command line's).
    """

    config: str
    overrides: tuple[str, ...] = ()


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
        settings: ``{label: Setting}`` for the entries of ``configs`` that are labels of mappings.
        new_data_per_seed: each seed draws its own generated data set (the module's docstring).
    """

    configs: list[str]
    strategies: list[str]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    output: Path = Path("outputs/compare")
    settings: dict[str, Setting] = field(default_factory=dict)
    new_data_per_seed: bool = False


def setting_of(grid: Grid, entry: str) -> tuple[str, Path, tuple[str, ...]]:
    """``(label, config file, the setting's own overrides)`` of an entry of ``grid.configs``.

    Raises:
        ConfigError: the config is not found (:func:`~medfed.config.find_config`).
    """
    if entry in grid.settings:
        return entry, find_config(grid.settings[entry].config), grid.settings[entry].overrides
    path = find_config(entry)
    return path.stem, path, ()


def read_grid(name: str | Path) -> Grid:
    """Read and check a grid YAML (keys :data:`GRID_KEYS`; ``strategies: all`` expanded).

    Raises:
        ConfigError: naming the file and the key: an unknown key, a missing
            ``configs``, a value of the wrong kind, an unknown strategy; or a
            file too large for a grid (:func:`~medfed.config.read_yaml_text`), unreadable, or not valid YAML.
    """
    path = find_config(name, BUNDLED_GRIDS, "grid")
    values = read_yaml_mapping(read_yaml_text(path, "grid file"), str(path))  # its size checked before it is read
    unknown = sorted(set(values) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown grid key '{unknown[0]}' (known keys: {', '.join(GRID_KEYS)})")
    if not values.get("configs"):
        raise ConfigError(f"{path}: grid key 'configs' is required: a list of run configs (paths or bundled names)")
    try:
        configs, settings = _settings(values["configs"])
        return make_grid(
            configs=configs,
            strategies=values.get("strategies", "all"),
            seeds=values.get("seeds", [0]),
            overrides=values.get("overrides") or [],
            metrics=values.get("metrics") or [],
            output=values.get("output") or f"outputs/compare/{path.stem}",
            settings=settings,
            new_data_per_seed=values.get("new_data_per_seed", False),
        )
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def _settings(entries: Any) -> tuple[Any, dict[str, Setting]]:
    """A grid file's ``configs``: each mapping entry replaced by its label, and ``{label: Setting}`` of them."""
    if not isinstance(entries, list):
        return entries, {}
    configs, settings = [], {}
    for entry in entries:
        if not isinstance(entry, dict):
            configs.append(entry)
            continue
        unknown = sorted(set(entry) - {"name", "config", "overrides"})
        name, config, overrides = entry.get("name"), entry.get("config"), entry.get("overrides") or []
        if unknown or not isinstance(name, str) or not name or not isinstance(config, str) or not config:
            raise ConfigError(f"grid key 'configs': {entry!r}: expected a config, or a mapping with name, config and overrides (a list)")
        overrides = _strings(overrides, f"configs: {name}: overrides") if overrides else []
        check_overrides(overrides, f"grid key 'configs': {name}: ")
        configs.append(name)
        settings[name] = Setting(config, tuple(overrides))
    return configs, settings


def make_grid(
    configs: Any, strategies: Any, seeds: Any, overrides: Any, metrics: Any, output: Any, settings: dict[str, Setting] | None = None,
    new_data_per_seed: Any = False,
) -> Grid:
    """A checked :class:`Grid` from plain values (a grid file's, or the command line's; ``settings``: its labelled ones).

    Raises:
        ConfigError: naming the grid key whose value is of the wrong kind, or an unknown strategy.
    """
    configs, overrides, metrics = (_strings(value, key) for value, key in ((configs, "configs"), (overrides, "overrides"), (metrics, "metrics")))
    check_overrides(overrides, "grid key 'overrides': ")
    strategies = [name.strip() for item in _strings(strategies, "strategies") for name in item.split(",")]  # "a,b" as well as a b
    if strategies == ["all"]:
        strategies = list(STRATEGY_NAMES)
    unknown = [name for name in strategies if name not in STRATEGY_NAMES]
    if unknown:
        raise ConfigError(f"grid key 'strategies': unknown strategy {unknown[0]!r}; expected all or names from {', '.join(STRATEGY_NAMES)}")
    seeds = seeds if isinstance(seeds, list) else [seeds]
    if not seeds or not all(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 for seed in seeds):
        raise ConfigError(f"grid key 'seeds' = {seeds!r}: expected a list of integers >= 0")
    for key, values in (("configs", configs), ("strategies", strategies), ("seeds", seeds)):
        if not values or len(set(values)) != len(values):
            raise ConfigError(f"grid key '{key}' = {values!r}: expected a non-empty list without repeats")
    if not isinstance(new_data_per_seed, bool):
        raise ConfigError(f"grid key 'new_data_per_seed' = {new_data_per_seed!r}: expected true or false")
    return Grid(configs, strategies, seeds, overrides, metrics, Path(output), dict(settings or {}), new_data_per_seed)


def check_overrides(overrides: list[str] | tuple[str, ...], where: str = "") -> None:
    """Refuse an override that is not ``key=value`` or that sets a key of :data:`SET_BY_COMPARE`.

    Raises:
        ConfigError: naming the override (prefixed by ``where``) and what to use instead.
    """
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals:
            raise ConfigError(f"{where}{override!r} is not key=value")
        if key.strip() in SET_BY_COMPARE:
            raise ConfigError(f"{where}override {override!r}: compare sets {key.strip()} itself ({SET_BY_COMPARE[key.strip()]})")


def _strings(value: Any, key: str) -> list[str]:
    """``value`` as a list of strings (a single string becomes a one-item list)."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(item, str) and item for item in values):
        raise ConfigError(f"grid key '{key}' = {value!r}: expected a list of strings")
    return values
