"""Typed, validated run configuration.

A run is described by one YAML file (``configs/*.yaml``) plus optional
``key=value`` overrides from the command line (OmegaConf dot-list syntax).
The top-level groups are fixed dataclasses; the groups whose keys depend on a
choice (``data`` on ``data.task``, ``model`` on ``model.name``, ``strategy``
on ``strategy.name``) are validated against the options dataclass that the
chosen component registers. Any key that no dataclass declares is rejected
with its full dotted name, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
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
    every site the same ratio.
    """

    delta: float = 1.0
    spread: float = 1.5


HOLDOUTS = ("test", "validation")


@dataclass
class FederationConfig:
    """How the data set is cut into hospital sites and each site's split.

    ``holdout`` names the split the run evaluates on. ``"test"``: each site's
    test split. ``"validation"``: each site's test subjects are set aside
    unused, its training subjects are split again (``validation_fraction`` of
    them to validation, seeded and stratified like the test split) and every
    metric is on that validation split, so hyper-parameters can be chosen
    without looking at the test split.
    """

    n_sites: int = 5
    test_fraction: float = 0.2
    holdout: str = "test"
    validation_fraction: float = 0.2
    participation: float = 1.0
    missing_channel: MissingChannelConfig | None = None
    label_ratio: LabelRatioConfig | None = None

    def __post_init__(self) -> None:
        require(self.n_sites >= 1, "federation.n_sites", self.n_sites, "an integer >= 1")
        require(0.0 < self.test_fraction < 1.0, "federation.test_fraction", self.test_fraction, "a number in (0, 1)")
        require(self.holdout in HOLDOUTS, "federation.holdout", self.holdout, " or ".join(HOLDOUTS))
        require(
            0.0 < self.validation_fraction < 1.0,
            "federation.validation_fraction",
            self.validation_fraction,
            "a number in (0, 1)",
        )
        require(0.0 < self.participation <= 1.0, "federation.participation", self.participation, "a number in (0, 1]")


@dataclass
class TrainerConfig:
    """The federated loop: rounds, local work per round, seed and device."""

    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "trainer.rounds", self.rounds, "an integer >= 1")
        require(self.local_epochs >= 1, "trainer.local_epochs", self.local_epochs, "an integer >= 1")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.device in ("cpu", "cuda", "mps", "auto"), "trainer.device", self.device, "one of cpu, cuda, mps, auto")
        require(self.num_threads is None or self.num_threads >= 1, "trainer.num_threads", self.num_threads, "null or >= 1")


@dataclass
class LoggerConfig:
    """Experiment tracking. CSV logs are always written; W&B runs offline by default."""

    wandb: str = "offline"
    project: str = "medfed"
    run_name: str | None = None

    def __post_init__(self) -> None:
        require(self.wandb in ("offline", "online", "disabled"), "logger.wandb", self.wandb, "offline, online or disabled")


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
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    output_dir: str = "outputs/run"


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming ``key`` unless ``ok``; options dataclasses call it in ``__post_init__``."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r}: expected {expected}")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Read a YAML config, apply dot-list overrides, and check it against :class:`RunConfig`.

    Args:
        path: YAML file.
        overrides: ``["trainer.rounds=3", "strategy.lam=0.1", ...]``.

    Returns:
        The merged config (a DictConfig, interpolations resolved). The
        component groups are validated later by :func:`parse_options`.

    Raises:
        ConfigError: missing file, YAML error, unknown key (named in full), or
            a value of the wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        file_cfg = OmegaConf.load(path)
        cli_cfg = OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, ValueError) as error:
        raise ConfigError(f"{path}: cannot parse the config or its overrides: {error}") from None
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
