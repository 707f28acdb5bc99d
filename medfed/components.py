"""The components a run config names, resolved and validated before any data is read.

:func:`load_config` checks the fixed groups (``federation``, ``trainer``,
``logger``, ``codec``); the groups whose keys depend on a choice are checked
here against the options dataclass of the chosen component:

* ``data`` against the task's ``Options`` (``data.task``),
* ``model`` against the model's ``Options`` (``model.name``, default the
  task's model; a model the task cannot feed is refused),
* ``strategy`` against every named strategy's ``Options`` (``strategy.name``
  and one subgroup per strategy),

and the device is checked against the machine. Everything here is cheap: a
config that fails anywhere fails before a single file is opened, and
:attr:`ResolvedRun.config` is the *full* config, every component default
filled in, which ``--print-config`` prints and ``config.json`` stores (and
which loads back as a config that resolves to itself).

This module imports neither torch nor any component: the registered
strategies' names, summaries and references (``python -m medfed
strategies``, the strategy names a config or a grid may use, the generated
tables) come from their registration lines,
:data:`medfed.options.strategies.STRATEGY_SPECS`, and :func:`resolve` checks
every group against the components' options dataclasses, which live in the
torch-free :mod:`medfed.options` package; the component classes themselves
(torch, Lightning, MONAI) are imported only when a run asks
:class:`ResolvedRun` for them (a strategy's class through its spec's
:meth:`~medfed.options.strategies.StrategySpec.load`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from medfed.config import RunConfig, parse_options, to_plain_dict
from medfed.errors import ConfigError
from medfed.options.models import MODEL_OPTIONS
from medfed.options.strategies import STRATEGY_SPECS, parse_strategy_group, strategy_spec
from medfed.options.tasks import task_spec

if TYPE_CHECKING:
    from medfed.federated.protocol import StrategyProtocol
    from medfed.models.base import FederatedModule
    from medfed.tasks import Task


STRATEGY_NAMES: tuple[str, ...] = tuple(spec.name for spec in STRATEGY_SPECS)
"""Every registered strategy's name (``strategy.name``, a grid's ``strategies``), in the registry's order."""


def strategy_table(markdown: bool = False) -> str:
    """The registry as text: one line per strategy (name, summary, reference), or the README's markdown table."""
    if markdown:
        rows = [f"| `{spec.name}` | {spec.summary} | {spec.reference or '—'} |" for spec in STRATEGY_SPECS]
        return "\n".join(["| name | what it does | reference |", "|---|---|---|", *rows])
    width = max(map(len, STRATEGY_NAMES))
    return "\n".join(
        f"{spec.name:<{width}}  {spec.summary}" + (f"\n{'':<{width}}  ({spec.reference})" if spec.reference else "")
        for spec in STRATEGY_SPECS
    )


#: the privacy mechanisms of :func:`privacy_table`: (column, the Strategy attribute declaring it)
PRIVACY_MECHANISMS: tuple[tuple[str, str], ...] = (
    ("DP-SGD at the sites", "dp_sgd_refusal"),
    ("client-level DP", "client_dp_refusal"),
    ("secure aggregation", "secure_aggregation_refusal"),
)


def privacy_table() -> str:
    """docs/privacy.md's markdown table: per registered strategy, each privacy mechanism ``yes`` or ``no (why)``.

    Generated from what each strategy class declares (``dp_sgd_refusal``,
    ``client_dp_refusal``, ``secure_aggregation_refusal``, and ``secure_sums``
    for the last column: what a secure deployment masks); a pFedNet-like
    conditional refusal reads "only with ...".
    """
    def cell(reason: str | None) -> str:
        if reason is None:
            return "yes"
        return reason if reason.startswith("only with") else f"no ({reason})"

    def summed(cls: Any) -> str:
        """What SecAgg+ masks in a deployment (``Strategy.secure_sums``): per phase, the reply's vectors and their weight."""
        return "; ".join(
            f"`{phase}` reply: every vector x `{secure.weight}`" if secure.weight else f"`{phase}` reply: every vector, unweighted"
            for phase, secure in cls.secure_sums.items()
        ) or "—"

    header = "| strategy | " + " | ".join(column for column, _ in PRIVACY_MECHANISMS) + " | securely summed (deploy.secure_aggregation) |"
    rows = [
        f"| `{cls.name}` | " + " | ".join(cell(getattr(cls, attribute)) for _, attribute in PRIVACY_MECHANISMS) + f" | {summed(cls)} |"
        for cls in (spec.load() for spec in STRATEGY_SPECS)  # torch: only for the docs and their sync test
    ]
    return "\n".join([header, "|---" * (len(PRIVACY_MECHANISMS) + 2) + "|", *rows])


def aggregation_table() -> str:
    """docs/robust.md's markdown table: per registered strategy, whether a robust ``aggregation`` applies (``yes``: the
    parts its server averages pass through the rule) or ``no (why)``, from ``Strategy.robust_aggregation_refusal``."""
    rows = [
        f"| `{cls.name}` | " + ("yes" if cls.robust_aggregation_refusal is None else f"no ({cls.robust_aggregation_refusal})") + " |"
        for cls in (spec.load() for spec in STRATEGY_SPECS)  # torch: only for the docs and their sync test
    ]
    return "\n".join(["| strategy | `aggregation.name`: median, trimmed_mean, norm_bounded |", "|---|---|", *rows])


#: the markdown tables generated from the registry, by the name of the block that holds each in the docs
GENERATED_TABLES: dict[str, Any] = {
    "strategies": lambda: strategy_table(markdown=True), "privacy-table": privacy_table, "aggregation-table": aggregation_table,
}
#: a generated block in a markdown file: ``<!-- name: how it is made -->``, the table, ``<!-- /name -->``
_BLOCK = re.compile(r"(<!-- (?P<name>[\w-]+): generated by [^\n]*-->\n)(?P<body>.*?)(\n<!-- /(?P=name) -->)", re.S)


def generated_markdown() -> str:
    """Every table of :data:`GENERATED_TABLES` in its block, as README.md and docs/privacy.md hold them (imports torch)."""
    return "\n\n".join(
        f"<!-- {name}: generated by `python -m medfed strategies --markdown` -->\n{make()}\n<!-- /{name} -->"
        for name, make in GENERATED_TABLES.items()
    )


def regenerate_tables(text: str) -> tuple[str, list[str]]:
    """``text`` (a markdown file) with every generated block's table made afresh, and the names of the blocks it holds."""
    found: list[str] = []

    def fresh(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATED_TABLES:
            return match.group(0)
        found.append(name)
        return match.group(1) + GENERATED_TABLES[name]() + match.group(4)

    return _BLOCK.sub(fresh, text), found


@dataclass(frozen=True)
class ResolvedRun:
    """A validated run: the typed groups, the chosen components' names and their options.

    Resolving imports no torch; the component classes (``task``,
    ``model_cls``, ``strategy_cls``) are imported on first use, by the run
    that builds them.

    Attributes:
        config: the full resolved config as plain containers (every default
            of every component filled in).
        run: the typed fixed groups (``run.data`` etc. are the raw mappings).
        task_name, model_name, strategy_name: ``data.task``, ``model.name``
            (default: the task's model) and ``strategy.name``.
        data_options: the task's ``Options`` instance.
        model_options: the model's ``Options`` instance.
        strategy_options: the strategy's ``Options`` instance.
    """

    config: dict[str, Any]
    run: RunConfig
    task_name: str
    data_options: Any
    model_name: str
    model_options: Any
    strategy_name: str
    strategy_options: Any

    @property
    def task(self) -> Task:
        """The ``data.task`` component (imports torch)."""
        from medfed.tasks import get_task

        return get_task(self.task_name)

    @property
    def model_cls(self) -> type[FederatedModule]:
        """The ``model.name`` class (imports torch, Lightning, MONAI)."""
        from medfed.models import model_class

        return model_class(self.model_name)

    @property
    def strategy_cls(self) -> type[StrategyProtocol]:
        """The ``strategy.name`` class (imports torch)."""
        return strategy_spec(self.strategy_name).load()

    @property
    def task_inputs(self) -> dict[str, Any]:
        """Keyword arguments of ``task.build_federation`` and of the model that ``task.regions`` decides (where the task offers a choice)."""
        return {"regions": self.run.task.regions} if task_spec(self.task_name).regions else {}


def _require_opacus(key: str, mechanism: str) -> None:
    """A one-line ConfigError naming ``key`` unless Opacus can be imported."""
    import importlib.util

    if importlib.util.find_spec("opacus") is None:
        raise ConfigError(f"config key '{key}': {mechanism} needs Opacus, which is not installed (pip install -e \".[privacy]\")")


def resolve(cfg: DictConfig) -> ResolvedRun:
    """Validate every component group of ``cfg`` and the device; fill in every default (no torch imported).

    Raises:
        ConfigError: naming the key: an unknown task, model or strategy, an
            unknown or bad option of any of them, a model the task cannot use,
            a device this machine does not have.
    """
    config = to_plain_dict(cfg)
    run: RunConfig = OmegaConf.to_object(cfg)
    strategy_name, strategy_options, given_strategy_options = parse_strategy_group(config["strategy"])
    task = task_spec(_required(config["data"], "task", "data"))
    data_options = parse_options(task.Options, config["data"], "data", ignore=("task",))
    model_name = config["model"].get("name") or task.default_model
    if model_name not in MODEL_OPTIONS:
        raise ConfigError(f"config key 'model.name' = {model_name!r}: expected one of {', '.join(sorted(MODEL_OPTIONS))}")
    if model_name not in task.models:
        raise ConfigError(
            f"config key 'model.name' = {model_name!r}: the {task.name} task's samples fit {', '.join(task.models)} only"
        )
    if "target" in config["model"] and model_name == "unet":  # renamed: say where it went
        raise ConfigError("config key 'model.target' is now 'task.regions': wt (the whole tumour) or brats (WT, TC and ET)")
    model_options = parse_options(MODEL_OPTIONS[model_name], config["model"], "model", ignore=("name",))
    check_input_size = getattr(model_options, "check_input_size", None)  # a model whose layers constrain the patch size
    if check_input_size is not None and hasattr(data_options, "patch_size"):
        check_input_size(data_options.patch_size, "data.patch_size")
    regions = run.task.regions
    if regions != "wt" and regions not in task.regions:
        raise ConfigError(
            f"config key 'task.regions' = {regions!r}: the {task.name} task has one fixed target (tumour regions are the brats task's)"
        )
    if run.privacy.dp.enabled:  # a DP run: Opacus present, and the strategy's own refusal (its class imports torch)
        _require_opacus("privacy.dp", "DP-SGD")
        strategy_cls = strategy_spec(strategy_name).load()
        refusal = strategy_cls.dp_sgd_refused(strategy_options)
        if refusal is not None:
            raise ConfigError(f"config key 'privacy.dp': DP-SGD does not fit strategy {strategy_cls.name!r}: {refusal} (docs/privacy.md)")
    if run.privacy.client_dp.enabled:  # Opacus (its accountant) present, and the strategy's own refusal
        _require_opacus("privacy.client_dp", "client-level DP")
        refusal = strategy_spec(strategy_name).load().client_dp_refusal
        if refusal is not None:
            raise ConfigError(f"config key 'privacy.client_dp': client-level DP does not fit strategy {strategy_name!r}: {refusal} (docs/privacy.md)")
    _check_aggregation(run, strategy_name)
    if run.evaluation.lesion_wise:  # required: the package must be here before any data is read
        run.evaluation.wants_lesion_wise()
    check_device(run.trainer.device)
    full = {
        **config,
        "data": {"task": task.name, **dataclasses.asdict(data_options)},
        "model": {"name": model_name, **dataclasses.asdict(model_options)},
        "strategy": {
            "name": strategy_name,
            **{name: dataclasses.asdict(options) for name, options in given_strategy_options.items()},
            strategy_name: dataclasses.asdict(strategy_options),
        },
    }
    return ResolvedRun(full, run, task.name, data_options, model_name, model_options, strategy_name, strategy_options)


def _check_aggregation(run: RunConfig, strategy_name: str) -> None:
    """Refuse hostile sites the federation does not have, and a robust ``aggregation`` the strategy or the run's
    privacy cannot take (:mod:`medfed.federated.aggregate`, docs/robust.md).

    Raises:
        ConfigError: naming ``attack.sites`` or ``aggregation.name``.
    """
    outside = [site for site in run.attack.sites if site >= run.federation.n_sites]
    if outside:
        raise ConfigError(f"config key 'attack.sites' = {run.attack.sites}: site {outside[0]} is not one of the "
                          f"federation's {run.federation.n_sites} sites (0 to {run.federation.n_sites - 1})")
    name = run.aggregation.name
    if name == "mean":
        return
    refusal = strategy_spec(strategy_name).load().robust_aggregation_refusal
    if refusal is not None:
        raise ConfigError(f"config key 'aggregation.name' = {name!r}: strategy {strategy_name!r} has no average to make robust: "
                          f"{refusal} (docs/robust.md)")
    if run.privacy.client_dp.enabled:
        raise ConfigError(f"config key 'aggregation.name' = {name!r}: a robust rule needs each site's own reply, and client-level DP "
                          "hands the server step only their clipped, noised average (privacy.client_dp); use one of the two")


def default_config(resolved: ResolvedRun) -> dict[str, Any]:
    """The resolved config of a run of ``resolved``'s task, model and strategy with every other key at its default.

    What a key added to medfed after a run was made reads as in that run: a
    new key's default keeps the behaviour older versions had, so a run whose
    saved config lacks a key it now has at this value is the same run (compare
    resumes grids over several sittings and medfed versions).
    """
    defaults = dataclasses.asdict(RunConfig())
    defaults["data"] = {"task": resolved.task_name, **dataclasses.asdict(type(resolved.data_options)())}
    defaults["model"] = {"name": resolved.model_name, **dataclasses.asdict(type(resolved.model_options)())}
    defaults["strategy"] = {"name": resolved.strategy_name, resolved.strategy_name: dataclasses.asdict(type(resolved.strategy_options)())}
    return defaults


def check_device(device: str) -> None:
    """Refuse ``trainer.device`` values this machine cannot run (``cuda``/``gpu`` without CUDA, ``mps`` without MPS)."""
    if device not in ("cuda", "gpu", "mps"):
        return  # cpu and auto run anywhere: no torch to import
    import torch  # only a GPU device needs it

    if device in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ConfigError(
            f"config key 'trainer.device' = {device!r}: this machine has no CUDA GPU that torch "
            f"{torch.__version__} can use; set trainer.device=cpu (or auto)"
        )
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("config key 'trainer.device' = 'mps': Apple MPS is not available here; set trainer.device=cpu (or auto)")


def _required(group: dict[str, Any], key: str, name: str) -> Any:
    if key not in group or group[key] in (None, ""):
        raise ConfigError(f"config key '{name}.{key}' is required")
    return group[key]
