"""A comparison's size, counted and bounded before any config is resolved.

Planning resolves every run's config (a few tenths of a second each on two
busy cores), so a grid of a million tuning configurations would plan for
days and hold every plan in memory. :func:`bound_plan` counts what a
``compare`` will plan from the grid alone: settings x methods x seeds runs
(per budget with ``--budgets``) and, with ``--tune``, each method's
configurations (the product of its space's value counts, :func:`~medfed.compare.tune.space_of`)
x the tuning seeds. Over :data:`MAX_RUNS` runs or :data:`MAX_CONFIGURATIONS`
tuning configurations is one line naming the count and what to cut;
otherwise the count of a plan of :data:`SAID_FROM` runs or more is said on stderr before planning starts.
"""

from __future__ import annotations

import math
import sys

from medfed.compare.grid import Grid
from medfed.compare.tune import TuneSpec, space_of
from medfed.errors import ConfigError

MAX_RUNS = 2000
"""The most runs one ``compare`` plans (every budget's and the tuning's together): 2000 runs plan in about 10 minutes
of two busy cores, and train for days; a larger study is several comparisons."""
MAX_CONFIGURATIONS = 600
"""The most tuning configurations over all (setting, method) cells: every method's default space on four settings is 528."""
SAID_FROM = 16
"""From this many runs the count is said before planning (a few seconds of it); a smaller plan's first line is its own."""


def bound_plan(grid: Grid, budgets: list[float] | None, tune: TuneSpec | None) -> None:
    """Count the runs (and tuning configurations) ``grid`` plans; refuse a plan over the bounds, else say the count.

    Raises:
        ConfigError: more than :data:`MAX_CONFIGURATIONS` tuning configurations or :data:`MAX_RUNS` runs (one line
            with the count and its factors).
    """
    settings, methods, seeds = len(grid.configs), len(grid.strategies), len(grid.seeds)
    per_budget = settings * methods * seeds
    runs = per_budget * (len(budgets) if budgets else 1)
    said = f"{settings} settings x {methods} methods x {seeds} seeds" + (f" x {len(budgets)} budgets" if budgets else "") + f" = {runs} runs"
    if tune is not None:
        sizes = {strategy: math.prod(len(values) for values in space_of(strategy, tune).values()) for strategy in grid.strategies}
        configurations = settings * sum(sizes.values())
        largest = max(sizes, key=sizes.get)
        tuning_seeds = len(tune.seeds or grid.seeds[:1])
        if configurations > MAX_CONFIGURATIONS:
            raise ConfigError(
                f"compare --tune: {configurations} configurations to tune ({settings} settings; {largest} alone has "
                f"{sizes[largest]}: {' x '.join(str(len(values)) for values in space_of(largest, tune).values())} values of "
                f"{', '.join(space_of(largest, tune))}), more than {MAX_CONFIGURATIONS}; give fewer values with --tune-space"
            )
        runs += configurations * tuning_seeds
        said += f", and {configurations} tuning configurations x {tuning_seeds} seeds = {configurations * tuning_seeds} tuning runs"
    if runs > MAX_RUNS:
        raise ConfigError(f"compare: the plan holds {said}: {runs} in all, more than {MAX_RUNS}; "
                          "compare fewer settings, methods, seeds or budgets at once")
    if runs >= SAID_FROM:
        print(f"medfed: compare: planning {said}; resolving each run's config", file=sys.stderr, flush=True)
