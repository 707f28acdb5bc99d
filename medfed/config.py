"""Typed, validated run configuration.

A run is described by one YAML file (``configs/*.yaml``) plus optional
``key=value`` overrides from the command line (OmegaConf dot-list syntax).
The top-level groups are fixed dataclasses; the groups whose keys depend on a
choice (``data`` on ``data.task``, ``model`` on ``model.name``, ``strategy``
on ``strategy.name``) are validated against the options dataclass that the
chosen component registers. Any key that no dataclass declares is rejected
with its full dotted name, so a typo never silently falls back to a default.

YAML is read with YAML 1.2 booleans: only ``true``/``false`` are booleans, so
``positive: Yes`` or ``data.positive=no`` stay the strings they look like
(YAML 1.1, PyYAML's and OmegaConf's default, would turn them into True and
False); a typed boolean option still accepts ``yes``/``no``. Duplicate keys
and syntax errors are one-line errors naming the file, line and column.

``--config`` takes a path or the name of a config shipped inside the package
(``brats_lack0`` finds ``medfed/configs/brats_lack0.yaml``), so an installed
medfed runs without a clone of the repository.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from medfed.errors import ConfigError


@dataclass
class MissingChannelConfig:
    """Federation "lack k": some sites have no MRI sequence ``channel``.

    The channel is zero-filled at those sites, as a hospital without that
    sequence would deliver it. ``sites`` are 0-based site indices; ``None``
    means the last ``n_sites_missing`` sites.
    """

    channel: int = 0
    sites: list[int] | None = None
    n_sites_missing: int = 2


@dataclass
class LabelRatioConfig:
    """Label imbalance: site s has n_negative / n_positive = delta_s around ``delta``.

    delta_s = delta * spread ** ((s - (S-1)/2) / ((S-1)/2)); spread = 1 gives
    every site the same ratio. A site losing more than ``max_drop`` of its
    samples to the ratio is named in a warning (a config that drops more by
    design says so with a larger ``max_drop``).
    """

    delta: float = 1.0
    spread: float = 1.5
    max_drop: float = 0.5

    def __post_init__(self) -> None:
        require(0.0 <= self.max_drop <= 1.0, "federation.label_ratio.max_drop", self.max_drop, "a share in [0, 1]")


HOLDOUTS = ("test", "validation")
ON_SITE_FAILURE = ("drop", "stop")


@dataclass
class FederationConfig:
    """How the data set is cut into hospital sites and each site's split.

    ``site_sizes`` says how many subjects each site gets: ``"equal"``, a list
    of ``n_sites`` positive relative weights, or ``"skewed"`` (Zipf-like
    sizes, see :func:`medfed.data.federation.site_counts`). Subjects dealt
    to sites by a seeded shuffle (no partition file, no site column) are
    shared out in those sizes (``equal``: round robin, sizes differ by at
    most one). Subjects placed by a partition file (a FeTS
    ``partitioning.csv``, the generated BraTS and LUNA16 data sets' one
    partition per scanner) keep their sites; ``equal`` keeps every partition
    whole, any other setting keeps a seeded draw of each partition's
    subjects, in the sizes the setting gives the largest number of subjects
    the partitions allow (:func:`medfed.data.federation.partition_site_counts`).
    With a site column any setting but ``equal`` is refused.

    ``validation_fraction`` (0: none) is the share of each site's training
    subjects drawn, after the test split and by subject like it (seeded,
    stratified as the task stratifies), into a validation split; the model is
    trained on the rest. ``holdout`` names the split the run's metrics are on.
    ``"test"``: each site's test split; with a validation split, every site's
    model is also evaluated on it after every round (``validation`` in each
    round's record, to choose a round or hyper-parameters without the test
    split). ``"validation"``: each site's test subjects are set aside unused
    and every metric is on the validation split (which then needs
    ``validation_fraction`` > 0); there is no separate per-round validation.

    A site *fails* in a round when its local training (or reply) raises, when
    its reply holds a NaN or an infinity, or when its update is an outlier:
    its norm exceeds ``update_norm_limit`` times the median update norm of the
    phase's replies (see :mod:`medfed.federated.faults`; null: no such check).
    ``on_site_failure: drop`` leaves the site out of the round's aggregation
    from that phase on and puts it back to its state at the start of the round;
    after ``max_consecutive_failures`` failing rounds in a row (null: never) it
    is excluded from the rest of the run. ``stop`` ends the run at the first
    failure, with the last round's checkpoint intact.
    """

    n_sites: int = 5
    test_fraction: float = 0.2
    holdout: str = "test"
    validation_fraction: float = 0.0
    site_sizes: Any = "equal"
    """``equal``, ``skewed``, or a list of ``n_sites`` positive relative weights (a Union OmegaConf cannot type)."""
    participation: float = 1.0
    missing_channel: MissingChannelConfig | None = None
    label_ratio: LabelRatioConfig | None = None
    on_site_failure: str = "drop"
    update_norm_limit: float | None = 10.0
    max_consecutive_failures: int | None = 3

    def __post_init__(self) -> None:
        require(self.n_sites >= 1, "federation.n_sites", self.n_sites, "an integer >= 1")
        require(0.0 < self.test_fraction < 1.0, "federation.test_fraction", self.test_fraction, "a number in (0, 1)")
        require(self.holdout in HOLDOUTS, "federation.holdout", self.holdout, " or ".join(HOLDOUTS))
        require(
            0.0 <= self.validation_fraction < 1.0,
            "federation.validation_fraction",
            self.validation_fraction,
            "a number in [0, 1) (0: no validation split)",
        )
        require(
            self.holdout != "validation" or self.validation_fraction > 0.0,
            "federation.validation_fraction",
            self.validation_fraction,
            "a number in (0, 1) with federation.holdout=validation, which evaluates on that split (e.g. 0.2)",
        )
        self.site_sizes = _site_sizes(self.site_sizes, self.n_sites)
        require(0.0 < self.participation <= 1.0, "federation.participation", self.participation, "a number in (0, 1]")
        require(self.on_site_failure in ON_SITE_FAILURE, "federation.on_site_failure", self.on_site_failure, "drop or stop")
        require(
            self.update_norm_limit is None or self.update_norm_limit > 1.0,
            "federation.update_norm_limit",
            self.update_norm_limit,
            "null or a factor > 1",
        )
        require(
            self.max_consecutive_failures is None or self.max_consecutive_failures >= 1,
            "federation.max_consecutive_failures",
            self.max_consecutive_failures,
            "null or an integer >= 1",
        )


SITE_SIZES = ("equal", "skewed")


def _site_sizes(value: Any, n_sites: int) -> str | list[float]:
    """``federation.site_sizes`` checked: ``equal``, ``skewed``, or ``n_sites`` positive finite weights (as floats)."""
    if isinstance(value, str):
        require(value in SITE_SIZES, "federation.site_sizes", value, "equal, skewed or a list of relative weights, one per site")
        return value
    weights = list(value) if isinstance(value, (list, tuple, ListConfig)) else None
    require(
        weights is not None and len(weights) == n_sites,
        "federation.site_sizes",
        value,
        f"equal, skewed or a list of {n_sites} relative weights (one per site: federation.n_sites = {n_sites})",
    )
    numeric = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
    require(numeric and all(0 < w < float("inf") for w in weights), "federation.site_sizes", weights, "positive finite weights")
    return [float(w) for w in weights]


DEVICES = ("cpu", "cuda", "gpu", "mps", "auto")


@dataclass
class TrainerConfig:
    """The federated loop: rounds, local work per round, seed and device."""

    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"
    """``cpu``, ``cuda`` (Lightning's alias ``gpu``), ``mps`` or ``auto``; checked against the machine before any data is read."""
    num_threads: int | None = None
    keep_checkpoints: int = 2
    """How many of the newest round checkpoints stay in ``<output_dir>/checkpoints`` (the one before the newest in case that is damaged)."""

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "trainer.rounds", self.rounds, "an integer >= 1")
        require(self.local_epochs >= 1, "trainer.local_epochs", self.local_epochs, "an integer >= 1")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.device in DEVICES, "trainer.device", self.device, f"one of {', '.join(DEVICES)}")
        require(self.num_threads is None or self.num_threads >= 1, "trainer.num_threads", self.num_threads, "null or >= 1")
        require(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")


@dataclass
class EvaluationConfig:
    """Whole-volume evaluation, for tasks whose samples are cut from volumes (BraTS).

    ``volume_every``: evaluate every site's model on its whole evaluation
    volumes every k rounds and at the last round (0: at the last round only;
    null: never). ``volume_batch_size``: sliding windows per forward pass.
    """

    volume_every: int | None = 10
    volume_batch_size: int = 32

    def __post_init__(self) -> None:
        require(self.volume_every is None or self.volume_every >= 0, "evaluation.volume_every", self.volume_every, "null or an integer >= 0")
        require(self.volume_batch_size >= 1, "evaluation.volume_batch_size", self.volume_batch_size, "an integer >= 1")


@dataclass
class LoggerConfig:
    """Experiment tracking. CSV logs are always written; W&B runs offline by default (see :mod:`medfed.tracking`)."""

    wandb: str = "offline"
    project: str = "medfed"
    run_name: str | None = None
    """W&B run name; null: ``<strategy> seed <seed>``."""
    group: str | None = None
    """W&B run group; null: ``<data.task>/<config file name>`` (``<data.task>/<output_dir name>`` without a file)."""
    tags: list[str] = field(default_factory=list)
    """W&B tags beside the task, the strategy, ``seed=<seed>`` and ``generated data``."""
    image_every: int = 5
    """W&B gets segmentation overlays after every ``image_every``-th round and after the last (0: after the last only)."""

    def __post_init__(self) -> None:
        require(self.wandb in ("offline", "online", "disabled"), "logger.wandb", self.wandb, "offline, online or disabled")
        require(self.image_every >= 0, "logger.image_every", self.image_every, "an integer >= 0")


@dataclass
class CodecConfig:
    """What crosses the site boundary, per direction (see :mod:`medfed.compression.codecs`).

    ``up`` (site -> server) and ``down`` (server -> site) each name a codec:
    ``dense`` (float32), ``stc``, ``cer`` or ``cer+stc``. The options apply to
    every codec that takes them: ``gamma`` is CER's weight w = eta * gamma of
    the paper, in the units of the coded update; ``sparsity`` STC's kept
    fraction; ``quant_bits`` CER's run-value quantisation (null = exact).
    """

    up: str = "dense"
    down: str = "dense"
    gamma: float = 0.0
    sparsity: float = 1.0 / 400.0
    quant_bits: int | None = None

    def __post_init__(self) -> None:
        from medfed.compression.codecs import CODEC_NAMES

        for key in ("up", "down"):
            require(getattr(self, key) in CODEC_NAMES, f"codec.{key}", getattr(self, key), f"one of {', '.join(CODEC_NAMES)}")
        require(self.gamma >= 0, "codec.gamma", self.gamma, "a CER weight >= 0")
        require(0 < self.sparsity <= 1, "codec.sparsity", self.sparsity, "a fraction in (0, 1]")

    def spec(self, direction: str) -> dict[str, Any]:
        """``{"name": ..., <the options that codec takes>}`` for ``direction`` ("up" or "down")."""
        from medfed.compression.codecs import codec_options

        name = getattr(self, direction)
        return {"name": name, **{key: getattr(self, key) for key in codec_options(name)}}


@dataclass
class RunConfig:
    """The whole run. ``data``, ``model`` and ``strategy`` are checked by their components."""

    data: dict[str, Any] = field(default_factory=dict)
    federation: FederationConfig = field(default_factory=FederationConfig)
    model: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    output_dir: str = "outputs/run"


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming ``key`` unless ``ok``; options dataclasses call it in ``__post_init__``."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r}: expected {expected}")


BUNDLED_CONFIGS = Path(__file__).parent / "configs"
"""The configs shipped inside the package (``configs/`` in the repository points here)."""


def find_config(name: str | Path, bundled: Path = BUNDLED_CONFIGS, kind: str = "config") -> Path:
    """The config file ``name`` names: a path, or a bundled config's name with or without ``.yaml``.

    ``bundled`` and ``kind`` serve other bundled YAML files the same way
    (the grids of :mod:`medfed.compare` in ``configs/paper``).

    Raises:
        ConfigError: neither a file nor a bundled config (the message lists the bundled ones).
    """
    path = Path(name)
    if path.is_file():
        return path
    if len(path.parts) == 1:
        for candidate in (bundled / path.name, bundled / f"{path.name}.yaml"):
            if candidate.is_file():
                return candidate
    names = ", ".join(sorted(p.stem for p in bundled.glob("*.yaml")))
    raise ConfigError(f"{kind} file {path} not found (nor a bundled {kind} of that name: {names})")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Read a YAML config, apply dot-list overrides, and check it against :class:`RunConfig`.

    Args:
        path: YAML file, or the name of a bundled config (:func:`find_config`).
        overrides: ``["trainer.rounds=3", "strategy.lam=0.1", ...]``.

    Returns:
        The merged config (a DictConfig, interpolations resolved). The
        component groups are validated by :func:`medfed.components.resolve`.

    Raises:
        ConfigError: missing file, YAML error, a file that is not a mapping,
            unknown key (named in full), or a value of the wrong type.
    """
    path = find_config(path)
    file_cfg = OmegaConf.create(read_yaml_mapping(path.read_text(encoding="utf-8", errors="replace"), str(path)))
    cli_cfg = OmegaConf.create()
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.strip():
            raise ConfigError(f"override {override!r}: expected key=value, e.g. trainer.rounds=3")
        try:
            OmegaConf.update(cli_cfg, key.strip(), _read_yaml(value, f"override {override!r}"), force_add=True)
        except OmegaConfBaseException as error:
            raise ConfigError(f"override {override!r}: {_first_line(error)}") from None
    schema = OmegaConf.structured(RunConfig)
    try:
        merged = OmegaConf.merge(schema, file_cfg, cli_cfg)
        OmegaConf.resolve(merged)
        OmegaConf.to_object(merged)  # runs the dataclasses' __post_init__ checks
    except ConfigKeyError as error:
        raise ConfigError(f"{path}: unknown config key '{_full_key(error)}'") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: config key '{_full_key(error)}': {_first_line(error)}") from None
    return merged


def read_yaml_mapping(text: str, source: str) -> dict[str, Any]:
    """Parse a YAML document that must be a mapping of config groups (empty = ``{}``).

    Raises:
        ConfigError: a YAML error (with line and column), a duplicate key, or
            a document that is a list or a scalar.
    """
    document = _read_yaml(text, source)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"{source}: expected a mapping of config groups (data:, federation:, model:, strategy:, trainer: ...), "
            f"got a {type(document).__name__}"
        )
    return document


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 booleans and floats, no timestamps, duplicate keys refused."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(  # 1e-3 and 1.0e+5 are floats (YAML 1.1 wants a dot and a signed exponent)
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _read_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or _first_line(error)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def to_yaml(config: dict[str, Any]) -> str:
    """``config`` as YAML that :func:`load_config` reads back to the same values."""
    return OmegaConf.to_yaml(OmegaConf.create(config))


def parse_options(options_cls: type, values: dict[str, Any] | DictConfig, group: str, ignore: tuple[str, ...] = ()) -> Any:
    """Validate one component group against its options dataclass.

    Args:
        options_cls: the component's dataclass (e.g. ``PFedNet.Options``).
        values: the group's mapping from the run config.
        group: the group's name, used in error messages (``"strategy"``).
        ignore: keys that select the component (``name``/``task``) and are
            not options.

    Returns:
        An ``options_cls`` instance.

    Raises:
        ConfigError: naming ``group.key`` for an unknown key or a bad value.
    """
    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values, resolve=True)
    values = {key: value for key, value in (values or {}).items() if key not in ignore}
    known = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key '{group}.{unknown[0]}' for {options_cls.__qualname__} (known keys: {', '.join(sorted(known))})"
        )
    try:
        typed = OmegaConf.merge(OmegaConf.structured(options_cls), values)
        return OmegaConf.to_object(typed)
    except OmegaConfBaseException as error:
        raise ConfigError(f"config key '{group}.{_full_key(error)}': {_first_line(error)}") from None
    except ConfigError as error:
        raise ConfigError(str(error).replace("config key '", f"config key '{group}.", 1)) from None


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python containers (for results.json and checkpoints)."""
    return OmegaConf.to_container(cfg, resolve=True)


def _full_key(error: OmegaConfBaseException) -> str:
    return str(getattr(error, "full_key", None) or getattr(error, "key", None) or "?")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
