"""A comparison's grid: which run configs (the settings), strategies and seeds, with which overrides, metrics and output.

A grid is a YAML file (:func:`read_grid`, e.g. ``configs/paper/table3_brats.yaml``,
keys :data:`GRID_KEYS`) or the same given on the command line
(:func:`make_grid`); either is checked here, before anything is planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medfed.components import STRATEGY_NAMES
from medfed.config import BUNDLED_CONFIGS, find_config, read_yaml_mapping, read_yaml_text
from medfed.errors import ConfigError

GRID_KEYS = ("configs", "strategies", "seeds", "overrides", "metrics", "output")
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
    return Grid(configs, strategies, seeds, overrides, metrics, Path(output))


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
