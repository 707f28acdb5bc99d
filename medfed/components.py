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

This module imports neither torch nor any component: :data:`STRATEGY_CATALOG`
declares the registered strategies' names and one-line descriptions (``python
-m medfed strategies``, the strategy names a config or a grid may use; a test
checks it against the registry, :data:`medfed.federated.strategies.REGISTERED`),
and :func:`resolve` checks every group against the components' options
dataclasses, which live in the torch-free :mod:`medfed.options` package; the
component classes themselves (torch, Lightning, MONAI) are imported only when
a run asks :class:`ResolvedRun` for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from omegaconf import DictConfig, OmegaConf

from medfed.config import RunConfig, parse_options, to_plain_dict
from medfed.errors import ConfigError
from medfed.options.models import MODEL_OPTIONS
from medfed.options.strategies import parse_strategy_group
from medfed.options.tasks import task_spec

if TYPE_CHECKING:
    from medfed.federated.strategies.base import Strategy
    from medfed.models.base import FederatedModule
    from medfed.tasks import Task


class StrategyEntry(NamedTuple):
    """A registered strategy as ``python -m medfed strategies`` lists it (its class's ``name``, ``summary``, ``reference``)."""

    name: str
    summary: str
    reference: str


STRATEGY_CATALOG: tuple[StrategyEntry, ...] = (
    StrategyEntry("local", "every site trains its own model alone; nothing is exchanged (the lower reference)", ""),
    StrategyEntry(
        "fedavg", "one global model, sample-weighted averaging of parameters and buffers",
        "McMahan et al., Communication-efficient learning of deep networks from decentralized data, AISTATS 2017",
    ),
    StrategyEntry(
        "fedbn", "FedAvg with every BatchNorm layer (affine and running statistics) kept at its site",
        "Li et al., FedBN: Federated learning on non-IID features via local batch normalization, ICLR 2021",
    ),
    StrategyEntry(
        "fedprox", "FedAvg whose local objective adds mu/2 ||w - w_global||^2",
        "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, Federated optimization in heterogeneous networks, MLSys 2020",
    ),
    StrategyEntry(
        "fedper", "shared base layers averaged (FedAvg), personalisation layers (the split's personal part) never leave the site",
        "Arivazhagan, Aggarwal, Singh, Choudhary, Federated learning with personalization layers, arXiv:1912.00818, 2019",
    ),
    StrategyEntry(
        "fedrep", "each round trains the personal head (body frozen), then the shared body (head frozen); bodies averaged",
        "Collins, Hassani, Mokhtari, Shakkottai, Exploiting shared representations for personalized federated learning, ICML 2021",
    ),
    StrategyEntry(
        "fedrod", "body + generic head trained with the balanced softmax and averaged; a personal head adds its logits at each site",
        "Chen and Chao, On bridging generic and personalized federated learning for image classification, ICLR 2022",
    ),
    StrategyEntry(
        "fedbabu",
        "body trained and averaged with the head (last layer) frozen at its initialisation; the head fine-tuned at each site to evaluate",
        "Oh, Kim and Yun, FedBABU: Towards enhanced representation for federated image classification, ICLR 2022",
    ),
    StrategyEntry(
        "ditto", "a FedAvg global model, and a personal model per site trained near it (lambda/2 ||v - w||^2)",
        "Li, Hu, Beirami, Smith, Ditto: fair and robust federated learning through personalization, ICML 2021",
    ),
    StrategyEntry(
        "apfl", "each site evaluates alpha v + (1 - alpha) w, its own model mixed with the FedAvg one, alpha learned",
        "Deng, Kamani, Mahdavi, Adaptive personalized federated learning, arXiv 2003.13461 (2020)",
    ),
    StrategyEntry(
        "l2gd", "local models trained alone, then each moved part of the way (theta) towards their mean every round",
        "Hanzely and Richtarik, Federated learning of a mixture of global and local models, arXiv 2002.05516 (2020)",
    ),
    StrategyEntry(
        "pfedme", "personalised models as proximal points of each site's loss (Moreau envelopes) around a global model",
        "Dinh, Tran and Nguyen, Personalized federated learning with Moreau envelopes, NeurIPS 2020",
    ),
    StrategyEntry(
        "superfed", "federated and local models trained as the ends of a low-loss line (random mixtures, orthogonality, proximal term)",
        "Hahn, Jeong and Lee, Connecting low-loss subspace for personalized federated learning, KDD 2022",
    ),
    StrategyEntry(
        "ifca", "k cluster models: each site trains, and is evaluated with, the one with the lowest loss on its data",
        "Ghosh, Chung, Yin and Ramchandran, An efficient framework for clustered federated learning, NeurIPS 2020 / IEEE Trans. Inf. Theory 2022",
    ),
    StrategyEntry(
        "fpfc", "personalised models fused into clusters by a concave (SCAD/MCP) pairwise penalty, ADMM with the pair variables on the server",
        "Yu, Liu, Wang and Sun, Clustered federated learning based on nonconvex pairwise fusion, arXiv 2211.04218",
    ),
    StrategyEntry(
        "fedamp", "attentive message passing: each site trains near a cloud model of similar sites' models",
        "Huang et al., Personalized cross-silo federated learning on non-IID data, AAAI 2021",
    ),
    StrategyEntry(
        "apple", "each site mixes every site's core model with directed relationships it learns",
        "Luo and Wu, Adapt to adaptation: learning personalization for cross-silo federated learning, IJCAI 2022",
    ),
    StrategyEntry(
        "pgfed", "each site adds a first-order estimate of the other sites' risks, weighted by learned a_ij",
        "Luo, Chen, Wu, Zhang, PGFed: personalize each client's global objective for federated learning, ICCV 2023",
    ),
    StrategyEntry(
        "pgfedmo", "PGFed with momentum on each site's auxiliary gradient",
        "Luo, Chen, Wu, Zhang, PGFed: personalize each client's global objective for federated learning, ICCV 2023",
    ),
    StrategyEntry(
        "pfednet", "graph-coupled personalisation: shared part averaged, personal parts fused over a site similarity network",
        "Zhao, Liu, Liu, He, Medical federated model with mixture of personalized and sharing components",
    ),
    StrategyEntry(
        "pooled", "one model trained on every site's training data pooled, evaluated at each site (NOT federated: the centralised upper reference)",
        "the pooled (centralised) baseline of du Terrail et al., FLamby: datasets and benchmarks for cross-silo federated learning in "
        "realistic healthcare settings, NeurIPS 2022",
    ),
)
"""Every registered strategy, in the registry's order (:data:`medfed.federated.strategies.REGISTERED`; tests/test_registry.py
checks that the two agree), declared here so that listing and naming strategies needs no torch."""
STRATEGY_NAMES: tuple[str, ...] = tuple(entry.name for entry in STRATEGY_CATALOG)


def strategy_table(markdown: bool = False) -> str:
    """The catalog as text: one line per strategy (name, summary, reference), or the README's markdown table."""
    if markdown:
        rows = [f"| `{entry.name}` | {entry.summary} | {entry.reference or '—'} |" for entry in STRATEGY_CATALOG]
        return "\n".join(["| name | what it does | reference |", "|---|---|---|", *rows])
    width = max(map(len, STRATEGY_NAMES))
    return "\n".join(
        f"{entry.name:<{width}}  {entry.summary}" + (f"\n{'':<{width}}  ({entry.reference})" if entry.reference else "")
        for entry in STRATEGY_CATALOG
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
    from medfed.federated.strategies import REGISTERED  # torch: only for the docs and their sync test

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
        for cls in REGISTERED
    ]
    return "\n".join([header, "|---" * (len(PRIVACY_MECHANISMS) + 2) + "|", *rows])


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
    def strategy_cls(self) -> type[Strategy]:
        """The ``strategy.name`` class (imports torch)."""
        from medfed.federated.strategies import STRATEGIES

        return STRATEGIES[self.strategy_name]

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
        from medfed.federated.strategies import STRATEGIES

        strategy_cls = STRATEGIES[strategy_name]
        refusal = strategy_cls.dp_sgd_refused(strategy_options)
        if refusal is not None:
            raise ConfigError(f"config key 'privacy.dp': DP-SGD does not fit strategy {strategy_cls.name!r}: {refusal} (docs/privacy.md)")
    if run.privacy.client_dp.enabled:  # Opacus (its accountant) present, and the strategy's own refusal
        _require_opacus("privacy.client_dp", "client-level DP")
        from medfed.federated.strategies import STRATEGIES

        refusal = STRATEGIES[strategy_name].client_dp_refusal
        if refusal is not None:
            raise ConfigError(f"config key 'privacy.client_dp': client-level DP does not fit strategy {strategy_name!r}: {refusal} (docs/privacy.md)")
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
