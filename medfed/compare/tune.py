"""``compare --tune``: every method's hyperparameters chosen on the validation split, the same way for every method.

For each setting (config) and method of a grid, :func:`plan_tuning` makes
one *tuning run* per configuration of the method's search space
(:mod:`medfed.options.search`, changed by ``--tune-space``) and tuning seed:
a grid run (:func:`~medfed.compare.plan.plan_runs`, so resumed and skipped
as the grid's are) in ``<output>/tuning/<config>/<method>/<configuration>/seed<k>``
with ``federation.holdout=validation`` after every other override. Such a
run trains on the same training split as the grid's run of its seed (the
test split is drawn first and the validation split from the rest, whatever
the holdout: :func:`medfed.data.federation.split_site`), evaluates every
round on the validation split, and sets the test split aside: no test
sample is loaded, no test metric computed. ``--tune-rounds`` and
``--tune-seeds`` set the tuning runs' rounds and seeds (default: the grid's
rounds and its first seed).

:func:`choose` then picks, per (setting, method), the configuration whose
*validation score* is highest: the last round's primary metric (the first of
the grid's ``metrics``, higher is better), mean over sites, mean over the
tuning seeds; only configurations whose every tuning seed finished compete,
and of equal scores the first in the space's order wins. The grid's runs of
that method and setting (every seed, on the test split) then get the chosen
configuration's overrides; the tables name it and the tuning's cost (runs,
training epochs per site, wall time: :func:`tuning_section`).

**The same budget for every method** (``--tune-budget K``): each method
gets exactly K configurations, whatever the size of its space. A space of
more than K combinations is sampled (:func:`balanced_sample`: seeded, each
value of each key used as evenly as K allows); a smaller one first has its
learning rate's values widened by factors of 3 (:func:`widen_learning_rate`,
alternately above and below) until it holds K. Without a budget every
combination of every method's space is run (3-18 a method by default: the
methods with more keys get more configurations).

**Edges** (``--tune-extend N``): when a method's chosen value of a numeric
key is the largest (or smallest) value tried for it, the space did not
bracket the best: :func:`edge_extensions` tries one configuration one step
further (the chosen one with that key times the ratio of its two outermost
values tried), runs it, chooses again, and repeats, up to N steps per key,
until the chosen value sits inside. A step whose configuration does not
resolve (the key's allowed range ends) ends that key's extension. The
tuning section says, per method, which keys were extended how far, and
names a choice still at an edge after N steps.

Only the validation split takes part in the choice; :func:`collect_trials`
refuses a tuning run whose results were not evaluated on it.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from medfed.compare.grid import Grid, setting_of
from medfed.compare.plan import Run, plan_runs
from medfed.compare.tables import Finished
from medfed.components import resolve
from medfed.config import load_config
from medfed.errors import ConfigError, DataError
from medfed.options.search import default_space

TUNING_FOLDER = "tuning"
"""The tuning runs' folder inside the comparison's output."""
TUNING_COLUMNS = (
    "config", "strategy", "configuration", "overrides", "seeds_finished", "validation_score", "chosen", "training_epochs", "wall_s",
)
"""tuning.csv's columns: one row per (setting, method, configuration)."""


@dataclass(frozen=True)
class TuneSpec:
    """How ``compare --tune`` tunes.

    Attributes:
        space: ``{config key: values}`` replacing those keys' values in every strategy's default space that has
            the key (``model.*``: every strategy; ``strategy.<name>.*``: that one), or adding the key to it;
            values as a config takes them, or ``"x<f>"``: f times the run config's own value (:func:`parse_space`).
        rounds: the tuning runs' ``trainer.rounds`` (None: the grid's).
        seeds: the tuning runs' seeds (None: the grid's first seed).
        budget: configurations per method, the same for every method (None: every combination of its space).
        extend: steps beyond an edge per key (0: none; :func:`edge_extensions`).
    """

    space: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rounds: int | None = None
    seeds: tuple[int, ...] | None = None
    budget: int | None = None
    extend: int = 0


@dataclass(frozen=True)
class Candidate:
    """One configuration of a method's space in one setting.

    Attributes:
        setting, strategy: the cell.
        shown: ``(name, value)`` per key, the key shortened to its last name where that is unambiguous.
        overrides: the ``key=value`` overrides it gives a run (relative values already multiplied).
    """

    setting: str
    strategy: str
    shown: tuple[tuple[str, str], ...]
    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        """``mu=0.1_lr=0.003``: its folder name."""
        return "_".join(f"{name}={value}" for name, value in self.shown)

    @property
    def values(self) -> str:
        """``mu=0.1 lr=0.003``: the configuration as the tables show it."""
        return " ".join(f"{name}={value}" for name, value in self.shown)


@dataclass(frozen=True)
class Trial:
    """A candidate's tuning runs, once run.

    Attributes:
        candidate: the configuration.
        scores: per finished tuning seed, its validation score (the last round's primary metric, mean over sites).
        planned: tuning runs planned (one per tuning seed).
        training_epochs: training epochs per site its finished runs took (sum over runs of the mean over sites).
        wall_s: their wall time (``timing.wall_s``; a resumed run's counts its last part only).
    """

    candidate: Candidate
    scores: dict[int, float]
    planned: int
    training_epochs: float
    wall_s: float

    @property
    def score(self) -> float | None:
        """The mean validation score over the tuning seeds; None unless every planned seed finished with a finite score."""
        finite = [value for value in self.scores.values() if math.isfinite(value)]
        return float(np.mean(finite)) if finite and len(finite) == self.planned else None


def check_tune(spec: TuneSpec, strategies: list[str], overrides: list[str] | tuple[str, ...], budgets: list[float] | None) -> None:
    """Refuse a tuning the grid cannot run: a space key no option names (:func:`parse_space` checks the spelling),
    a strategy's key for a strategy not in the grid, an override of a tuned key, tuning beside ``--budgets``,
    bad rounds or seeds.

    Raises:
        ConfigError: one line naming the key, override or flag.
    """
    if budgets is not None:
        raise ConfigError("--tune with --budgets: tune at one budget (drop --budgets), then run the frontier with the chosen values as overrides")
    for key in spec.space:
        parts = key.split(".")
        if parts[0] == "strategy" and parts[1] not in strategies:
            raise ConfigError(f"--tune-space {key!r}: {parts[1]} is not among the grid's strategies ({', '.join(strategies)})")
    tuned = {key for strategy in strategies for key in space_of(strategy, spec)}
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in tuned:
            raise ConfigError(
                f"override {override!r} with --tune: --tune chooses {key} on the validation split; drop the override, "
                f"or give its values as --tune-space {key}=V1,V2,..."
            )
    if spec.rounds is not None and spec.rounds < 1:
        raise ConfigError(f"--tune-rounds {spec.rounds}: expected an integer >= 1 (the tuning runs' trainer.rounds)")
    if spec.seeds is not None and (not spec.seeds or len(set(spec.seeds)) != len(spec.seeds) or min(spec.seeds) < 0):
        raise ConfigError(f"--tune-seeds {' '.join(map(str, spec.seeds))}: expected seeds >= 0 without repeats")
    if spec.budget is not None and spec.budget < 1:
        raise ConfigError(f"--tune-budget {spec.budget}: expected an integer >= 1 (configurations per method)")
    if spec.extend < 0:
        raise ConfigError(f"--tune-extend {spec.extend}: expected an integer >= 0 (steps beyond an edge per key)")


def parse_space(entries: list[str]) -> dict[str, tuple[str, ...]]:
    """``--tune-space`` entries (``KEY=V1,V2,...``) as ``{key: values}``, each key checked against the options it names.

    A key is ``model.<option>`` (an option of any model) or ``strategy.<name>.<option>``; values are non-empty,
    without repeats; ``x<f>`` (f > 0) is f times the run config's value.

    Raises:
        ConfigError: one line naming the entry: not KEY=VALUES, an unknown key, an empty, repeated or bad relative value.
    """
    from medfed.options.models import MODEL_OPTIONS
    from medfed.options.strategies import STRATEGY_OPTIONS

    space: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        key, equals, text = entry.partition("=")
        key = key.strip()
        values = tuple(value.strip() for value in text.split(","))
        if not equals or not key:
            raise ConfigError(f"--tune-space {entry!r}: expected KEY=V1,V2,... (e.g. strategy.fedprox.mu=0.01,0.1,1)")
        parts = key.split(".")
        if parts[0] == "model" and len(parts) == 2:
            known = sorted({f.name for options in MODEL_OPTIONS.values() for f in fields(options)} - {"personal_patterns", "shared_patterns"})
            if parts[1] not in known:
                raise ConfigError(f"--tune-space {entry!r}: unknown key {key!r} (model options: {', '.join(known)})")
        elif parts[0] == "strategy" and len(parts) == 3 and parts[1] in STRATEGY_OPTIONS:
            known = sorted(f.name for f in fields(STRATEGY_OPTIONS[parts[1]]))
            if parts[2] not in known:
                raise ConfigError(
                    f"--tune-space {entry!r}: unknown key {key!r} (strategy.{parts[1]} options: {', '.join(known) or 'none'})"
                )
        else:
            raise ConfigError(f"--tune-space {entry!r}: unknown key {key!r} (expected model.<option> or strategy.<name>.<option>)")
        if not all(values) or len(set(values)) != len(values):
            raise ConfigError(f"--tune-space {entry!r}: expected one or more values, comma-separated, none empty or repeated")
        for value in values:
            if value.startswith("x") and not _is_factor(value[1:]):
                raise ConfigError(f"--tune-space {entry!r}: {value!r} is no relative value (x<f>, f > 0: f times the config's value)")
        if key in space:
            raise ConfigError(f"--tune-space {key!r} is given twice")
        space[key] = values
    return space


def _is_factor(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def space_of(strategy: str, spec: TuneSpec) -> dict[str, tuple[Any, ...]]:
    """``strategy``'s search space: its default (:func:`~medfed.options.search.default_space`) with ``spec``'s keys that apply
    to it (``model.*`` and ``strategy.<strategy>.*``) replacing or joining it."""
    space = dict(default_space(strategy))
    for key, values in spec.space.items():
        parts = key.split(".")
        if parts[0] == "model" or parts[1] == strategy:
            space[key] = values
    return space


def config_value(config: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a resolved config (``config.json``'s mapping).

    Raises:
        ConfigError: the config has no such key (e.g. a model option of another model).
    """
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"--tune-space key {key!r}: the run config has no such key (is it an option of another model?)")
        value = value[part]
    return value


def format_value(value: Any) -> str:
    """A value as an override writes it (``0.001``, ``true``, ``model``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def candidates(setting: str, strategy: str, space: dict[str, tuple[Any, ...]], config: dict[str, Any]) -> list[Candidate]:
    """Every combination of ``space``'s values (the first key varying slowest), relative values multiplied by ``config``'s."""
    short = [key.rsplit(".", 1)[1] for key in space]
    names = short if len(set(short)) == len(short) else list(space)
    resolved_values = []
    for key, values in space.items():
        row = []
        for value in values:
            if isinstance(value, str) and value.startswith("x") and _is_factor(value[1:]):
                base = config_value(config, key)
                if not isinstance(base, (int, float)) or isinstance(base, bool):
                    raise ConfigError(f"--tune-space {key}={value}: a relative value needs a number, and {key} is {base!r}")
                value = float(value[1:]) * base
            row.append(format_value(value))
        resolved_values.append(list(dict.fromkeys(row)))  # x1 of a config at 0.1 and 0.1 given beside it: once
    found = []
    for combination in itertools.product(*resolved_values):
        shown = tuple(zip(names, combination))
        found.append(Candidate(setting, strategy, shown, tuple(f"{key}={value}" for key, value in zip(space, combination))))
    return found


LEARNING_RATE_KEY = "model.lr"
"""The key :func:`widen_learning_rate` widens to fill a budget."""


def widen_learning_rate(space: dict[str, tuple[Any, ...]], budget: int) -> dict[str, tuple[Any, ...]]:
    """``space`` with ``model.lr``'s values widened by factors of 3 until it holds ``budget`` combinations.

    Relative values (``x<f>``) stay relative; absolute ones stay absolute. A step adds the largest value x 3,
    the next the smallest / 3, and so on. A space without ``model.lr``, or whose lr holds one value (pinned on
    purpose), is left as it is.
    """
    values = list(space.get(LEARNING_RATE_KEY, ()))
    if len(values) < 2:
        return space
    others = math.prod(len(v) for key, v in space.items() if key != LEARNING_RATE_KEY)
    relative = all(isinstance(v, str) and v.startswith("x") for v in values)
    numbers = sorted(float(v[1:]) if relative else float(v) for v in values)
    upward = True
    while others * len(numbers) < budget:
        numbers = [*numbers, numbers[-1] * 3] if upward else [numbers[0] / 3, *numbers]
        upward = not upward
    return {**space, LEARNING_RATE_KEY: tuple(f"x{n:.6g}" if relative else n for n in numbers)}


def balanced_sample(found: list[Candidate], budget: int, seed: int, attempts: int = 200) -> list[Candidate]:
    """``budget`` of the configurations ``found`` (all of them when there are no more), each value of each key used as
    evenly as the budget allows (at most ceil(budget / its key's values) times).

    One at a time, among the configurations that keep every value within that cap, one of those whose values are the
    least used so far (a seeded draw); a draw that runs out of such configurations starts again (up to ``attempts``
    times; the last draw is kept). The result keeps ``found``'s order.
    """
    if len(found) <= budget:
        return list(found)
    rng = np.random.default_rng(seed)
    keys = {override.partition("=")[0] for candidate in found for override in candidate.overrides}
    values = {key: {o for c in found for o in c.overrides if o.partition("=")[0] == key} for key in keys}
    cap = {key: math.ceil(budget / len(v)) for key, v in values.items()}
    chosen: list[Candidate] = []
    for _ in range(attempts):
        used: dict[str, int] = {}
        left, chosen = list(found), []
        while len(chosen) < budget:
            allowed = [c for c in left if all(used.get(o, 0) < cap[o.partition("=")[0]] for o in c.overrides)]
            if not allowed:
                break
            load = [sum(used.get(o, 0) for o in c.overrides) for c in allowed]
            lightest = [c for c, weight in zip(allowed, load) if weight == min(load)]
            pick = lightest[int(rng.integers(len(lightest)))]
            left.remove(pick)
            chosen.append(pick)
            for override in pick.overrides:
                used[override] = used.get(override, 0) + 1
        if len(chosen) == budget:
            break
    return [candidate for candidate in found if candidate in chosen]


def budget_seed(setting: str, strategy: str) -> int:
    """The seed of a (setting, method)'s sample: a stable function of their names (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(f"{setting}/{strategy}".encode()).digest()[:8], "little")


def plan_tuning(
    grid: Grid, overrides: list[str] | tuple[str, ...], spec: TuneSpec, jobs: int | None
) -> tuple[list[Candidate], list[Run]]:
    """Every tuning run of ``grid`` (a grid run on the validation split, :func:`~medfed.compare.plan.plan_runs`), checked.

    Each (setting, method)'s configurations are its space's combinations (:func:`candidates`), or with
    ``spec.budget`` that many of them (:func:`widen_learning_rate`, :func:`balanced_sample`).

    Returns:
        ``(candidates, runs)``: each (setting, method)'s configurations in order, and their runs
        (``<output>/tuning/<config>/<method>/<label>/seed<k>``, ``variant`` = the label).

    Raises:
        ConfigError: a configuration that does not resolve (naming the run and key), as :func:`plan_runs` does.
    """
    found = []
    for config in grid.configs:
        label, path, own = setting_of(grid, config)
        for strategy in grid.strategies:
            base = resolve(load_config(path, [*grid.overrides, *own, *overrides, f"strategy.name={strategy}"])).config
            space = space_of(strategy, spec)
            found_here = candidates(label, strategy, space if spec.budget is None else widen_learning_rate(space, spec.budget), base)
            if spec.budget is not None:
                found_here = balanced_sample(found_here, spec.budget, budget_seed(label, strategy))
            found += found_here
    return found, plan_candidates(grid, overrides, spec, jobs, found)


def plan_candidates(grid: Grid, overrides: list[str] | tuple[str, ...], spec: TuneSpec, jobs: int | None, found: list[Candidate]) -> list[Run]:
    """The tuning runs of the configurations ``found`` (one per tuning seed), as :func:`plan_tuning` plans them."""
    tuning = replace(grid, output=grid.output / TUNING_FOLDER, seeds=list(spec.seeds or grid.seeds[:1]))
    rounds = [f"trainer.rounds={spec.rounds}"] if spec.rounds is not None else []
    entries = {setting_of(grid, config)[0]: config for config in grid.configs}
    runs = []
    for candidate in found:
        one = replace(tuning, configs=[entries[candidate.setting]], strategies=[candidate.strategy])
        runs += plan_runs(one, overrides, jobs, announce=False, extra=[*candidate.overrides, *rounds], variant=candidate.label, holdout="validation")
    return runs


def run_values(finished: Finished, metric: str) -> float:
    """A tuning run's validation score: its last round's ``metric``, mean over sites (nan where no site has a finite one).

    Raises:
        DataError: the run was not evaluated on the validation split (``federation.holdout`` in its results),
            or does not report ``metric``.
    """
    results = finished.results
    holdout = results["config"].get("federation", {}).get("holdout")
    if holdout != "validation":
        raise DataError(f"{finished.run.output_dir / 'results.json'}: a tuning run evaluated on {holdout!r}, not 'validation'; delete it")
    scores = [site.get(metric) for site in results["history"][-1]["metrics"].values()]
    if all(score is None for score in scores):
        raise ConfigError(f"grid key 'metrics': {metric!r} is not reported by tuning run {finished.run.name}")
    finite = [float(score) for score in scores if score is not None and math.isfinite(score)]
    return float(np.mean(finite)) if finite else math.nan


def is_continuous(key: str) -> bool:
    """Whether dotted ``key`` (``model.<option>``, ``strategy.<name>.<option>``) is an option declared ``float``."""
    from medfed.options.models import MODEL_OPTIONS
    from medfed.options.strategies import STRATEGY_OPTIONS

    parts = key.split(".")
    if parts[0] == "model" and len(parts) == 2:
        groups = list(MODEL_OPTIONS.values())
    elif parts[0] == "strategy" and len(parts) == 3 and parts[1] in STRATEGY_OPTIONS:
        groups = [STRATEGY_OPTIONS[parts[1]]]
    else:
        return False
    return any(f.name == parts[-1] and str(f.type).split(" |")[0] in ("float", "<class 'float'>") for group in groups for f in fields(group))


def numeric_values(candidate: Candidate) -> dict[str, float]:
    """The candidate's values of continuous keys (:func:`is_continuous`: lr, mu, lam ...; counts and words are not extended)."""
    values = {}
    for override in candidate.overrides:
        key, _, text = override.partition("=")
        if is_continuous(key):
            try:
                values[key] = float(text)
            except ValueError:
                continue
    return values


def edge_extensions(trials: list[Trial], chosen: dict[tuple[str, str], Trial | None], steps_taken: dict[tuple[str, str, str], int],
                    limit: int) -> list[tuple[Candidate, str]]:
    """One configuration beyond the edge for every (setting, method) whose chosen value of a float key is the largest
    or smallest value of that key tried, while that key has taken fewer than ``limit`` steps.

    The step: the chosen configuration with the key's value times (or over) the ratio of the two outermost values
    tried on that side (a geometric grid goes on as it was; ``steps_taken`` counts per (setting, method, key) and is
    updated). A configuration already tried is not proposed again. Returns ``(configuration, the key it moves)`` pairs.
    """
    tried: dict[tuple[str, str], list[Candidate]] = {}
    for trial in trials:
        tried.setdefault((trial.candidate.setting, trial.candidate.strategy), []).append(trial.candidate)
    extensions = []
    for key, trial in chosen.items():
        if trial is None:
            continue
        best = trial.candidate
        known = {tuple(c.overrides) for c in tried[key]}
        for name, value in numeric_values(best).items():
            seen = sorted({numeric_values(c).get(name) for c in tried[key]} - {None})
            if len(seen) < 2 or steps_taken.get((*key, name), 0) >= limit or value not in (seen[0], seen[-1]):
                continue
            if value <= 0 or seen[0] <= 0:
                continue
            step = seen[-1] / seen[-2] if value == seen[-1] else seen[0] / seen[1]
            new_value = format_value(value * step)
            overrides = tuple(f"{name}={new_value}" if o.partition("=")[0] == name else o for o in best.overrides)
            if overrides in known:
                continue
            short = name.rsplit(".", 1)[1]
            shown = tuple((n, new_value) if n in (short, name) else (n, v) for n, v in best.shown)
            extensions.append((Candidate(best.setting, best.strategy, shown, overrides), name))
            steps_taken[(*key, name)] = steps_taken.get((*key, name), 0) + 1
            known.add(overrides)
    return extensions


def at_an_edge(trial: Trial, trials: list[Trial]) -> list[str]:
    """The float keys whose chosen value is the largest or smallest tried for its (setting, method)."""
    mine = [t.candidate for t in trials if (t.candidate.setting, t.candidate.strategy) == (trial.candidate.setting, trial.candidate.strategy)]
    edges = []
    for name, value in numeric_values(trial.candidate).items():
        seen = sorted({numeric_values(c).get(name) for c in mine} - {None})
        if len(seen) > 1 and value in (seen[0], seen[-1]):
            edges.append(f"{name.rsplit('.', 1)[1]}={format_value(value)} ({'top' if value == seen[-1] else 'bottom'})")
    return edges


def collect_trials(found: list[Candidate], runs: list[Run], finished: list[Finished], metric: str) -> list[Trial]:
    """Each candidate's :class:`Trial` from its finished tuning runs (``metric``: the primary one)."""
    by_key = {(item.run.setting, item.run.strategy, item.run.variant, item.run.seed): item for item in finished}
    planned: dict[tuple[str, str, str], list[int]] = {}
    for run in runs:
        planned.setdefault((run.setting, run.strategy, run.variant), []).append(run.seed)
    trials = []
    for candidate in found:
        key = (candidate.setting, candidate.strategy, candidate.label)
        done = [by_key[(*key, seed)] for seed in planned[key] if (*key, seed) in by_key]
        epochs = [np.mean(list((item.results.get("compute") or {}).get("training_epochs", {}).values()) or [math.nan]) for item in done]
        trials.append(
            Trial(
                candidate,
                {item.run.seed: run_values(item, metric) for item in done},
                len(planned[key]),
                float(np.nansum(epochs)) if epochs else 0.0,
                float(sum(item.results["timing"]["wall_s"] for item in done)),
            )
        )
    return trials


def choose(trials: list[Trial]) -> dict[tuple[str, str], Trial | None]:
    """Per (setting, method), the trial of the highest :attr:`Trial.score` (of equal ones the first); None where none has one."""
    chosen: dict[tuple[str, str], Trial | None] = {}
    for trial in trials:
        key = (trial.candidate.setting, trial.candidate.strategy)
        best = chosen.setdefault(key, None)
        if trial.score is not None and (best is None or trial.score > best.score):
            chosen[key] = trial
    return chosen


def tuning_rows(trials: list[Trial], chosen: dict[tuple[str, str], Trial | None]) -> list[dict[str, Any]]:
    """tuning.csv: one row per candidate (:data:`TUNING_COLUMNS`)."""
    return [
        {
            "config": trial.candidate.setting,
            "strategy": trial.candidate.strategy,
            "configuration": trial.candidate.label,
            "overrides": " ".join(trial.candidate.overrides),
            "seeds_finished": f"{len(trial.scores)}/{trial.planned}",
            "validation_score": trial.score,
            "chosen": chosen.get((trial.candidate.setting, trial.candidate.strategy)) is trial,
            "training_epochs": trial.training_epochs,
            "wall_s": trial.wall_s,
        }
        for trial in trials
    ]


def tuning_section(
    trials: list[Trial], chosen: dict[tuple[str, str], Trial | None], settings: list[str], strategies: list[str], metric: str, spec: TuneSpec,
    seeds: list[int], rounds: str, steps_taken: dict[tuple[str, str, str], int] | None = None,
) -> list[str]:
    """comparison.md's section on the tuning: how it chose, then per method and setting the chosen values and the cost
    (``steps_taken``: the steps beyond an edge per (setting, method, key), :func:`edge_extensions`)."""
    steps_taken = steps_taken or {}
    cost: dict[tuple[str, str], list[Trial]] = {}
    for trial in trials:
        cost.setdefault((trial.candidate.setting, trial.candidate.strategy), []).append(trial)

    def cell(setting: str, strategy: str) -> str:
        spent = cost.get((setting, strategy), [])
        runs = sum(len(trial.scores) for trial in spent)
        planned = sum(trial.planned for trial in spent)
        price = (
            f"{len(spent)} configurations, {runs}/{planned} runs, {sum(t.training_epochs for t in spent):.0f} epochs, "
            f"{sum(t.wall_s for t in spent):.0f} s"
        )
        extended = [f"{key.rsplit('.', 1)[1]} {n} step{'s' * (n > 1)}" for (s_, m, key), n in steps_taken.items() if (s_, m) == (setting, strategy)]
        if extended:
            price += f"; beyond an edge: {', '.join(extended)}"
        trial = chosen.get((setting, strategy))
        if trial is None:
            return f"the config's values (no configuration finished every tuning seed; {price})"
        edges = at_an_edge(trial, trials)
        still = f"; **still at an edge: {', '.join(edges)}**" if edges else ""
        return f"{trial.candidate.values} (validation {trial.score:.4f}; {price}{still})"

    lines = [
        "## Hyperparameters, chosen on the validation split (compare --tune)",
        "",
        f"Every method's search space (medfed/options/search.py{', changed by --tune-space' if spec.space else ''}) was run on "
        f"each setting's validation split only (federation.holdout=validation: the test split set aside, unread) with seeds "
        f"{seeds} and {rounds} rounds; the configuration with the highest last-round validation {metric} (mean over sites, "
        "then over the tuning seeds) was run on the test split for every seed of the tables above. "
        + (f"Every method got the same budget of {spec.budget} configurations (a larger space sampled evenly, a smaller "
           "one's learning rates widened by factors of 3). " if spec.budget is not None else "")
        + (f"Where a chosen value was the largest or smallest of its key tried, one more configuration one step beyond was "
           f"run and the choice made again, up to {spec.extend} steps per key (listed as beyond an edge; a choice still at "
           "an edge after them is named). " if spec.extend else "")
        + "Each cell: the chosen values (validation score) and the tuning's cost: configurations, tuning runs "
        "finished/planned, training epochs per site summed over them, wall time (summed over runs; a resumed run's counts "
        "its last part only). Every tuning run's score is in tuning.csv.",
        "",
        "| method | " + " | ".join(settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    lines += [f"| {strategy} | " + " | ".join(cell(s, strategy) for s in settings) + " |" for strategy in strategies]
    return lines


def chosen_overrides(chosen: dict[tuple[str, str], Trial | None]) -> dict[tuple[str, str], tuple[str, ...]]:
    """``{(setting, method): the chosen configuration's overrides}`` (empty where none was chosen)."""
    return {key: (trial.candidate.overrides if trial is not None else ()) for key, trial in chosen.items()}
