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

A YAML (or JSON) document is read with bounds, since configs, grids and a
run folder's ``config.json`` may come from elsewhere: at most
:data:`MAX_YAML_BYTES`, nested at most :data:`MAX_YAML_DEPTH` levels, and at
most :data:`MAX_YAML_NODES` nodes once every alias is expanded (a 1 KB
"billion laughs" alias bomb expands to 10^9 nodes). Each is refused in one
line before anything is built from the document.

An unknown key is named with where it came from (the file, or the command
line override that set it) and the closest known keys ("did you mean").

``--config`` takes a path or the name of a config shipped inside the package
(``brats_lack0`` finds ``medfed/configs/brats_lack0.yaml``), so an installed
medfed runs without a clone of the repository.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import math
import netrc
import os
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
DP_ACCOUNTANTS = ("rdp", "prv")
ON_BUDGET = ("stop_site", "stop_run")
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
"""Opacus's ``RDPAccountant.DEFAULT_ALPHAS``, the orders its RDP accountant converts at (here so that a config is checked
without importing torch; tests/test_privacy.py checks the two agree)."""
MAX_NOISE_MULTIPLIER = 1e6
"""The largest noise multiplier a config may give: Opacus's own search for one (``get_noise_multiplier``) gives up
above it, and noise of 10^6 clipping norms per step leaves nothing of the gradient."""


def rdp_epsilon_floor(delta: float) -> float:
    """The smallest epsilon Opacus's RDP accountant certifies at ``delta``, however much noise: its conversion of zero RDP,
    min over the orders a of log((a - 1) / a) - (log delta + log a) / (a - 1) (``opacus.accountants.analysis.rdp.get_privacy_spent``).

    About 0.103 at delta 1e-5: a smaller ``target_epsilon`` has no noise multiplier (Opacus raises "The privacy budget is too low").
    """
    return min(math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1) for a in RDP_ORDERS)


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
PRECISIONS = ("32", "bf16-mixed")
"""``trainer.precision``: float32 throughout, or bfloat16 autocast of the forward passes (Lightning Fabric's names)."""
#: ``trainer.executor``: how the simulator runs the sites' local training (:mod:`medfed.federated.batched`)
EXECUTORS = ("auto", "sequential", "batched")
CODEC_NAMES = ("dense", "stc", "cer", "cer+stc")
"""The codecs of :mod:`medfed.compression.codecs` by name, here so that a config is checked without importing torch
(tests/test_cli_start.py checks the two agree)."""
MAX_QUANT_BITS = 16
"""The most bits CER's run values may be quantised to (:data:`medfed.compression.piecewise.MAX_QUANT_BITS`, here for
the same reason; the same test checks them)."""


MAX_LOCAL_EPOCHS = 1000
"""The most ``trainer.local_epochs`` a round may have: a round of more passes over a site's data is no longer federated
learning, and each site plans its round's steps (batch orders, dropout keys) before it trains."""
MAX_ROUNDS = 100_000
"""The most ``trainer.rounds`` a run may have (each round is a record in results.json and a loop over every site)."""


@dataclass
class TrainerConfig:
    """The federated loop: rounds, local work per round, seed and device."""

    rounds: int = 20
    local_epochs: float = 1
    """The budget of training passes per site and round, in epochs of the site's training split (> 0; 0.5 = half a
    pass), which every strategy's training plans share (:mod:`medfed.federated.strategies.base`)."""
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"
    """``cpu``, ``cuda`` (Lightning's alias ``gpu``), ``mps`` or ``auto``; checked against the machine before any data is read."""
    num_threads: int | None = None
    precision: str = "32"
    """``32`` (float32 throughout) or ``bf16-mixed`` (forward passes and losses under bfloat16 autocast, float32
    parameters and optimiser state), through Lightning Fabric; recorded in results.json (``execution``)."""
    compile: bool = False
    """torch.compile each model slot's forward (``nn.Module.compile``: the module, its parameters and checkpoints stay
    as they are) and, under the batched executor, each stacked step as one unit (forward, backward and optimiser
    update of every site, on static shapes; on cuda captured as a CUDA graph: :mod:`medfed.federated.stacked`);
    the first steps pay the compilation. Recorded in results.json (``execution``)."""
    executor: str = "auto"
    """How the simulator trains the sites: ``sequential`` (one after another), ``batched`` (the sites of a training plan
    stacked and trained by one vmapped step each, :mod:`medfed.federated.batched`), or ``auto`` (batched on cuda,
    sequential elsewhere). Both give the same models to float tolerance."""
    keep_checkpoints: int = 2
    """How many of the newest round checkpoints stay in ``<output_dir>/checkpoints`` (the one before the newest in case that is damaged)."""
    patience: int | None = None
    """Stop on a validation plateau: after ``patience`` rounds in a row that did not beat the best validation score so far
    by more than ``min_delta`` (the model's first metric, mean over sites; :class:`~medfed.evaluation.rounds.PlateauStop`),
    ``rounds`` then being the cap. null: every round is run. Needs a validation split (``federation.validation_fraction`` > 0)."""
    min_delta: float = 0.0
    """The gain over the best validation score so far that counts as improving (``patience``)."""
    patience_metric: str | None = None
    """The validation metric ``patience`` watches (null: the model's first, e.g. ``iou``, ``accuracy``)."""

    def __post_init__(self) -> None:
        require(1 <= self.rounds <= MAX_ROUNDS, "trainer.rounds", self.rounds, f"an integer from 1 to {MAX_ROUNDS}")
        require(0 < self.local_epochs <= MAX_LOCAL_EPOCHS, "trainer.local_epochs", self.local_epochs,
                f"a number of epochs > 0 and at most {MAX_LOCAL_EPOCHS} (e.g. 0.5)")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(0 <= self.seed < 2**63, "trainer.seed", self.seed, "an integer in [0, 2^63) (torch and numpy seeds are 64-bit)")
        require(self.device in DEVICES, "trainer.device", self.device, f"one of {', '.join(DEVICES)}")
        require(self.num_threads is None or self.num_threads >= 1, "trainer.num_threads", self.num_threads, "null or >= 1")
        require(self.precision in PRECISIONS, "trainer.precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        require(self.executor in EXECUTORS, "trainer.executor", self.executor, f"one of {', '.join(EXECUTORS)}")
        require(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        require(self.patience is None or self.patience >= 1, "trainer.patience", self.patience, "null or an integer >= 1 (rounds)")
        require(self.min_delta >= 0, "trainer.min_delta", self.min_delta, "a number >= 0")


REGION_SETS = ("wt", "brats")
"""``task.regions``: the whole tumour alone (one binary output), or the BraTS challenge's three nested regions."""


@dataclass
class TaskConfig:
    """What a segmentation task's samples are labelled for (``task.regions``).

    ``wt``: the whole tumour, one binary mask (two softmax outputs: the
    pFedNet paper's task, the default). ``brats``: the BraTS challenge's three
    overlapping regions, whole tumour (WT), tumour core (TC) and enhancing
    tumour (ET), as three sigmoid outputs (the challenge practice); every
    metric is then reported per region. Only the BraTS task offers a choice.
    """

    regions: str = "wt"

    def __post_init__(self) -> None:
        require(self.regions in REGION_SETS, "task.regions", self.regions, " or ".join(REGION_SETS))


LESION_WISE_INSTALL = 'pip install -e ".[brats]"'
"""How to install ``brats-evaluation`` (:mod:`medfed.evaluation.lesion_wise`), the optional lesion-wise scorer."""


def lesion_wise_available() -> bool:
    """Whether ``brats-evaluation`` (and so panoptica) can be imported, without importing it."""
    return importlib.util.find_spec("brats_evaluation") is not None and importlib.util.find_spec("panoptica") is not None


@dataclass
class EvaluationConfig:
    """Whole-volume evaluation, for tasks whose samples are cut from volumes (BraTS).

    ``volume_every``: evaluate every site's model on its whole evaluation
    volumes every k rounds and at the last round (0: at the last round only;
    null: never). ``volume_batch_size``: sliding windows per forward pass.
    ``lesion_wise``: add the BraTS challenge's lesion-wise Dice, NSD and HD95
    computed by the ``brats-evaluation`` package (:mod:`medfed.evaluation.lesion_wise`)
    to the whole-volume scores: null, when the package is installed; true,
    always (the run is refused before any data is read without it); false, never.
    """

    volume_every: int | None = 10
    volume_batch_size: int = 32
    lesion_wise: bool | None = None

    def wants_lesion_wise(self) -> bool:
        """Whether whole volumes get the lesion-wise scores (the package checked for, not imported)."""
        if self.lesion_wise is False:
            return False
        present = lesion_wise_available()
        require(present or self.lesion_wise is None, "evaluation.lesion_wise", True,
                f"null or false: the brats-evaluation package is not installed ({LESION_WISE_INSTALL})")
        return present

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
    figures: bool = True
    """Draw the run's PNGs (learning curves, examples, ROC curves, confusion matrices, the strategy's own) into
    ``output_dir`` at the end; about a second or two of a CPU a run, so a grid of hundreds of runs turns them off
    (``logger.figures=false``: its comparison.png stays). Results are the same either way."""

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
        for key in ("up", "down"):
            require(getattr(self, key) in CODEC_NAMES, f"codec.{key}", getattr(self, key), f"one of {', '.join(CODEC_NAMES)}")
        require(math.isfinite(self.gamma) and self.gamma >= 0, "codec.gamma", self.gamma, "a finite CER weight >= 0")
        require(0 < self.sparsity <= 1, "codec.sparsity", self.sparsity, "a fraction in (0, 1]")
        require(
            self.quant_bits is None or 1 <= self.quant_bits <= MAX_QUANT_BITS,
            "codec.quant_bits",
            self.quant_bits,
            f"null (exact float32 run values) or an integer 1..{MAX_QUANT_BITS}",
        )

    def spec(self, direction: str) -> dict[str, Any]:
        """``{"name": ..., <the options that codec takes>}`` for ``direction`` ("up" or "down")."""
        from medfed.compression.codecs import codec_options

        name = getattr(self, direction)
        return {"name": name, **{key: getattr(self, key) for key in codec_options(name)}}


@dataclass
class DPConfig:
    """DP-SGD at every site (:mod:`medfed.federated.privacy`); off unless ``noise_multiplier`` or ``target_epsilon`` is given.

    ``noise_multiplier`` sigma (noise std sigma * max_grad_norm per step), or
    ``target_epsilon``: sigma then follows from the steps each site plans over
    the run, and a site stops training (``on_budget: stop_site``) or the run
    stops (``stop_run``) before epsilon would pass it. ``delta``: the delta
    epsilon is reported at. ``max_grad_norm``: C, the per-sample clipping
    norm (``.inf``: no clipping). ``accountant``: Opacus's ``rdp`` or ``prv``.
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: str = "rdp"
    on_budget: str = "stop_site"

    def __post_init__(self) -> None:
        require(
            self.noise_multiplier is None or self.target_epsilon is None,
            "privacy.dp.target_epsilon",
            self.target_epsilon,
            "null when privacy.dp.noise_multiplier is given (give one of the two)",
        )
        require(
            self.noise_multiplier is None or 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER,
            "privacy.dp.noise_multiplier", self.noise_multiplier, f"null or a number from 0 to {MAX_NOISE_MULTIPLIER:g}",
        )
        require(
            self.target_epsilon is None or (math.isfinite(self.target_epsilon) and self.target_epsilon > 0),
            "privacy.dp.target_epsilon", self.target_epsilon, "null or a finite epsilon > 0",
        )
        require(0 < self.delta < 1, "privacy.dp.delta", self.delta, "a probability in (0, 1), e.g. 1e-5")
        require(self.max_grad_norm > 0, "privacy.dp.max_grad_norm", self.max_grad_norm, "a clipping norm > 0 (.inf: no clipping)")
        require(self.accountant in DP_ACCOUNTANTS, "privacy.dp.accountant", self.accountant, f"one of {', '.join(DP_ACCOUNTANTS)}")
        require(self.on_budget in ON_BUDGET, "privacy.dp.on_budget", self.on_budget, f"one of {', '.join(ON_BUDGET)}")
        noised = self.target_epsilon is not None or (self.noise_multiplier or 0) > 0
        require(not noised or math.isfinite(self.max_grad_norm), "privacy.dp.max_grad_norm", self.max_grad_norm,
                "a finite clipping norm where noise is added (its std is noise_multiplier x max_grad_norm; .inf only with noise 0)")
        if self.target_epsilon is not None and self.accountant == "rdp":
            floor = rdp_epsilon_floor(self.delta)
            require(self.target_epsilon > floor, "privacy.dp.target_epsilon", self.target_epsilon,
                    f"an epsilon above {floor:.4f}, the smallest the rdp accountant certifies at delta {self.delta:g} however much "
                    "noise is added (raise it or privacy.dp.delta, or use privacy.dp.accountant=prv)")

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier is not None or self.target_epsilon is not None


@dataclass
class ClientDPConfig:
    """Client-level DP of what the sites send (:class:`medfed.federated.privacy.ClientDP`); off unless ``noise_multiplier`` is given.

    Each participant's update (its reply minus what the server sent it) is
    clipped to L2 norm ``clipping_norm`` C, the server averages the clipped
    updates uniformly over the m replies and adds N(0, (sigma C / m)^2) noise
    per coordinate (sigma = ``noise_multiplier``); epsilon at ``delta`` is
    Opacus's RDP accountant over the rounds, at the participation rate.
    """

    noise_multiplier: float | None = None
    clipping_norm: float = 1.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        require(
            self.noise_multiplier is None or 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER,
            "privacy.client_dp.noise_multiplier", self.noise_multiplier, f"null (off) or a number from 0 to {MAX_NOISE_MULTIPLIER:g}",
        )
        require(self.clipping_norm > 0, "privacy.client_dp.clipping_norm", self.clipping_norm, "a clipping norm > 0 (.inf: no clipping)")
        require(0 < self.delta < 1, "privacy.client_dp.delta", self.delta, "a probability in (0, 1), e.g. 1e-5")
        require(not (self.noise_multiplier or 0) > 0 or math.isfinite(self.clipping_norm), "privacy.client_dp.clipping_norm",
                self.clipping_norm, "a finite clipping norm where noise is added (its std is noise_multiplier x clipping_norm / m; "
                ".inf only with noise 0)")

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier is not None


AGGREGATIONS = ("mean", "median", "trimmed_mean", "norm_bounded")
"""``aggregation.name``: the rules of :mod:`medfed.federated.aggregate`."""


@dataclass
class AggregationConfig:
    """How the server combines the sites' replies of the parts a strategy averages (:mod:`medfed.federated.aggregate`).

    ``name``: ``mean`` (sample-weighted, the strategies' own rule), ``median`` (coordinate-wise), ``trimmed_mean``
    (coordinate-wise, ``trim`` of the sites dropped at each end) or ``norm_bounded`` (each update scaled to L2 norm at
    most ``norm_bound``; null: the round's median update norm). Each robust rule needs every site's own reply: refused
    with secure aggregation and client-level DP.
    """

    name: str = "mean"
    trim: float = 0.2
    norm_bound: float | None = None

    def __post_init__(self) -> None:
        require(self.name in AGGREGATIONS, "aggregation.name", self.name, f"one of {', '.join(AGGREGATIONS)}")
        require(0 <= self.trim < 0.5, "aggregation.trim", self.trim, "a fraction in [0, 0.5) of the sites dropped at each end")
        require(self.norm_bound is None or (math.isfinite(self.norm_bound) and self.norm_bound > 0), "aggregation.norm_bound",
                self.norm_bound, "null (the round's median update norm) or a finite L2 norm > 0")


ATTACK_KINDS = ("scale", "sign_flip", "gaussian")
"""``attack.kind``: what a simulated hostile site does to its update (:mod:`medfed.federated.attack`)."""


@dataclass
class AttackConfig:
    """FOR EVALUATION ONLY: simulated hostile sites (:mod:`medfed.federated.attack`), to measure an ``aggregation`` rule.

    The sites listed in ``sites`` (indices) send, in place of each model-vector update u (their reply minus what they
    last received under that key), ``factor * u`` (``scale``), ``-u`` (``sign_flip``: the honest norm), or a seeded
    Gaussian direction of u's norm (``gaussian``). The simulator only; a deployment refuses it.
    """

    sites: list[int] = field(default_factory=list)
    kind: str = "scale"
    factor: float = 100.0

    def __post_init__(self) -> None:
        require(all(isinstance(site, int) and site >= 0 for site in self.sites) and len(set(self.sites)) == len(self.sites),
                "attack.sites", self.sites, "a list of distinct site indices >= 0 (empty: no attack)")
        require(self.kind in ATTACK_KINDS, "attack.kind", self.kind, f"one of {', '.join(ATTACK_KINDS)}")
        require(math.isfinite(self.factor) and self.factor > 0, "attack.factor", self.factor, "a finite factor > 0 (attack.kind=scale)")


@dataclass
class PrivacyConfig:
    """Privacy mechanisms of a run (see ``docs/privacy.md``): ``dp``, DP-SGD at every site; ``client_dp``, client-level DP at aggregation."""

    dp: DPConfig = field(default_factory=DPConfig)
    client_dp: ClientDPConfig = field(default_factory=ClientDPConfig)


@dataclass
class DeployConfig:
    """The Flower deployment's settings (``medfed.deploy``, docs/deploy.md): secure aggregation with Flower's SecAgg+.

    ``secure_aggregation``: the server sees each securely summable phase's
    replies only as their weighted sum (the strategy's ``secure_sums``).
    The other keys are SecAgg+'s, named as Flower's ``SecAggPlusWorkflow``
    names them: ``num_shares`` (each site's secrets are split into this many
    shares, one per neighbour, itself included: a fraction in (0, 1] of the
    round's participants, or a count >= 3), ``reconstruction_threshold``
    (shares needed to rebuild a secret: a fraction in (0, 1] of
    ``num_shares``, at least 2, or a count >= 2 below ``num_shares``),
    ``clipping_range`` (every weighted entry n_i / max n * x is clipped to
    [-c, c] before quantisation), ``quantization_range`` (levels of the
    quantisation of [-c, c]) and ``modulus_range`` (the masks' modulus, a
    power of two up to 2^32). The simulator reads none of them.
    """

    secure_aggregation: bool = False
    num_shares: float = 1.0
    reconstruction_threshold: float = 0.5
    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32

    def __post_init__(self) -> None:
        shares, threshold = self.num_shares, self.reconstruction_threshold
        require(0 < shares <= 1 or (shares >= 3 and float(shares).is_integer()), "deploy.num_shares", shares,
                "a fraction in (0, 1] of the round's participants, or a whole count >= 3")
        require(0 < threshold <= 1 or (threshold >= 2 and float(threshold).is_integer()), "deploy.reconstruction_threshold", threshold,
                "a fraction in (0, 1] of deploy.num_shares, or a whole count >= 2")
        require(threshold <= 1 or shares <= 1 or threshold < shares, "deploy.reconstruction_threshold", threshold,
                f"a count below deploy.num_shares = {shares:g}")
        require(math.isfinite(self.clipping_range) and self.clipping_range > 0, "deploy.clipping_range", self.clipping_range, "a finite range > 0")
        require(self.quantization_range >= 2, "deploy.quantization_range", self.quantization_range, "an integer >= 2")
        modulus = self.modulus_range
        require(self.quantization_range < modulus <= 1 << 32 and modulus & (modulus - 1) == 0, "deploy.modulus_range", modulus,
                f"a power of two above deploy.quantization_range = {self.quantization_range} and at most 2^32")


@dataclass
class RunConfig:
    """The whole run. ``data``, ``model`` and ``strategy`` are checked by their components."""

    data: dict[str, Any] = field(default_factory=dict)
    task: TaskConfig = field(default_factory=TaskConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    model: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    output_dir: str = "outputs/run"

    def __post_init__(self) -> None:
        require(
            self.trainer.patience is None or self.federation.validation_fraction > 0,
            "trainer.patience",
            self.trainer.patience,
            "null without a validation split to watch (set federation.validation_fraction > 0, e.g. 0.2)",
        )


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming ``key`` unless ``ok``; options dataclasses call it in ``__post_init__``."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r}: expected {expected}")


def check_wandb_key(mode: str) -> None:
    """``logger.wandb: online`` needs a W&B API key here: ``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes.

    The host is ``WANDB_BASE_URL``'s (default ``api.wandb.ai``); the netrc
    file is ``$NETRC`` or ``~/.netrc``. Checked before any data are read, so a
    run does not train for hours and then fail to log.

    Raises:
        ConfigError: online mode and no key.
    """
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = re.sub(r"^\w+://", "", os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").split("/")[0].split(":")[0]
    with contextlib.suppress(OSError, netrc.NetrcParseError):  # no netrc, or one that cannot be read: no key there
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host):
            return
    raise ConfigError(
        f"config key 'logger.wandb' = 'online': no W&B API key here (WANDB_API_KEY unset and no {host} entry in the netrc file); "
        "run `wandb login`, or set logger.wandb=offline"
    )


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
    file_cfg = OmegaConf.create(read_yaml_mapping(read_yaml_text(path), str(path)))
    cli_cfg = OmegaConf.create()
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.strip():
            raise ConfigError(f"override {override!r}: expected key=value, e.g. trainer.rounds=3")
        if any(character in value for character in "\n\r\x00"):  # YAML would fold a line break into a space: another path
            raise ConfigError(f"override {override!r}: its value holds a line break or NUL; write it YAML-quoted in the config file")
        try:
            OmegaConf.update(cli_cfg, key.strip(), _read_yaml(value, f"override {override!r}"), force_add=True)
        except OmegaConfBaseException as error:
            raise ConfigError(f"override {override!r}: {_first_line(error)}") from None
    schema = OmegaConf.structured(RunConfig)
    merged = _merge(schema, file_cfg, str(path))
    merged = _merge(merged, cli_cfg, "command line", overrides)
    if _interpolated_size(OmegaConf.to_container(merged, resolve=False)) > MAX_YAML_NODES:
        raise ConfigError(
            f"{path}: its interpolations (${{...}}) expand to more than {MAX_YAML_NODES} values (an interpolation bomb?)"
        )
    try:
        OmegaConf.resolve(merged)
        OmegaConf.to_object(merged)  # runs the dataclasses' __post_init__ checks
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: config key '{_full_key(error)}': {_first_line(error)}") from None
    return merged


def _merge(base: DictConfig, layer: DictConfig, source: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``layer`` merged onto ``base``; a key ``base`` lacks or a mistyped value is blamed on ``source``.

    ``source`` is the config file's path, or ``"command line"`` (then the
    message quotes the override that set the key, from ``overrides``).
    """
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as error:
        key = _full_key(error)
        where = source
        if overrides:
            setting = [o for o in overrides if (o.partition("=")[0].strip() + ".").startswith(f"{key}.")]
            where = f"command line override {setting[0]!r}" if setting else "command line"
        if isinstance(error, ConfigKeyError):
            raise ConfigError(f"{where}: unknown config key '{key}'{_did_you_mean(base, key)}") from None
        raise ConfigError(f"{where}: config key '{key}': {_first_line(error)}") from None


def _did_you_mean(base: DictConfig, key: str) -> str:
    """``"; did you mean 'trainer.rounds'?"`` for the known keys of ``key``'s group closest to it (empty if none is close)."""
    parent, _, name = key.rpartition(".")
    group = OmegaConf.select(base, parent) if parent else base
    known = [str(k) for k in group.keys()] if isinstance(group, DictConfig) else []
    return did_you_mean(name, known, f"{parent}." if parent else "")


def did_you_mean(name: str, known: list[str], prefix: str = "") -> str:
    """``"; did you mean 'prefix.close'?"`` for up to three of ``known`` closest to ``name`` (difflib), else ``""``."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(prefix + match) for match in close)}?" if close else ""


MAX_YAML_BYTES = 1 << 20
"""Largest config, grid or config.json read (1 MiB; medfed's configs are a few kB)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists in a YAML document (medfed's configs nest 4 levels)."""
MAX_YAML_NODES = 100_000
"""Most nodes (scalars, lists, mappings) in a YAML document with every alias expanded."""


_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")


def _interpolated_size(root: Any) -> int:
    """Values in ``root`` (plain containers, interpolations unresolved) once every ``${key}`` is resolved, capped.

    Like :func:`_expanded_size` for aliases: each ``${key}`` counts the
    values of the node it names (memoised per node, so the cost is the
    document's size), a string also one per 100 characters; ``${resolver:...}``
    and keys that name nothing count 1, a cycle counts 1 (OmegaConf reports it).
    The result is capped just above :data:`MAX_YAML_NODES`.
    """
    sizes: dict[tuple, int] = {}
    active: set[tuple] = set()

    def lookup(path: tuple) -> Any:
        node = root
        for key in path:
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and str(key).isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node

    def target(reference: str, path: tuple) -> tuple | None:
        if ":" in reference:
            return None  # a resolver's result is not a node of the document
        reference = re.sub(r"\[\s*([^\]]*?)\s*\]", r".\1", reference)  # a[0].b is a.0.b
        dots = len(reference) - len(reference.lstrip("."))
        keys = tuple(key for key in reference.lstrip(".").split(".") if key)
        return (path[: len(path) - dots] if dots else ()) + keys

    def size_at(path: tuple) -> int:
        if path in sizes:
            return sizes[path]
        if path in active:
            return 1
        active.add(path)
        value = lookup(path)
        if isinstance(value, dict):
            total = 1 + sum(size_at((*path, key)) for key in value)
        elif isinstance(value, list):
            total = 1 + sum(size_at((*path, str(index))) for index in range(len(value)))
        elif isinstance(value, str):
            total = 1 + len(value) // 100
            for reference in _INTERPOLATION.findall(value):
                named = target(reference.strip(), path)
                total += 1 if named is None else size_at(named)
                if total > MAX_YAML_NODES:
                    break
        else:
            total = 1
        active.discard(path)
        sizes[path] = min(total, MAX_YAML_NODES + 1)
        return sizes[path]

    return size_at(())


def read_yaml_text(path: Path, kind: str = "config file") -> str:
    """The text of a YAML file of at most :data:`MAX_YAML_BYTES` (undecodable bytes replaced).

    Raises:
        ConfigError: the file is larger (nothing of it is read), or cannot be read.
    """
    try:
        size = os.stat(path).st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: {size} bytes, larger than any {kind} medfed reads ({MAX_YAML_BYTES} bytes)")
        with open(path, "rb") as file:
            return file.read(MAX_YAML_BYTES + 1).decode("utf-8", errors="replace")
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror})") from None


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


class _YamlLimit(yaml.YAMLError):
    """A document over one of the reader's bounds (depth, expanded size)."""

    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 booleans and floats, no timestamps, duplicate keys refused, bounded.

    The composer (PyYAML's node builder, recursive) stops at
    :data:`MAX_YAML_DEPTH` levels; the composed node graph, where an alias is
    the node it names, is measured with every alias expanded before any
    Python object is built from it.
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _YamlLimit(f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_NODES:
            raise _YamlLimit(
                f"more than {MAX_YAML_NODES} values once its aliases (*name) are expanded (an alias bomb?)", node.start_mark
            )
        return node

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


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in ``node``'s tree with every alias expanded; ``sizes`` memoises shared (aliased) nodes, so the cost is the graph's size."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(key, sizes) + _expanded_size(value, sizes) for key, value in node.value)
    else:
        size = 1
    sizes[id(node)] = min(size, MAX_YAML_NODES + 1)  # capped: no huge integers either
    return sizes[id(node)]


def _too_deep_flow(text: str) -> tuple[int, int] | None:
    """``(line, column)`` (0-based) of the first ``[`` or ``{`` nested deeper than :data:`MAX_YAML_DEPTH`, outside
    quotes and comments, or None. PyYAML's pure-Python scanner looks up to 1024 characters ahead for a possible
    key at every flow level, quadratic in the depth (a second for 50,000 ``[`` at load 5): this finds such a
    document first, in one pass."""
    if text.count("[") + text.count("{") <= MAX_YAML_DEPTH:
        return None
    depth, quote, comment, line, start = 0, "", False, 0, 0
    for index, character in enumerate(text):
        if character == "\n":
            line, start, comment = line + 1, index + 1, False
        elif comment or (quote and character != quote):
            continue
        elif character in "'\"":
            quote = "" if quote == character else character if not quote else quote
        elif character == "#" and (index == 0 or text[index - 1] in " \t"):
            comment = True
        elif character in "[{":
            depth += 1
            if depth > MAX_YAML_DEPTH:
                return line, index - start
        elif character in "]}":
            depth -= 1
    return None


def _read_yaml(text: str, source: str) -> Any:
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{source}: {len(text)} characters, more than any config medfed reads ({MAX_YAML_BYTES})")
    deep = _too_deep_flow(text)
    if deep is not None:
        raise ConfigError(f"{source}: not valid YAML at line {deep[0] + 1}, column {deep[1] + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
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
            f"unknown config key '{group}.{unknown[0]}' for {options_cls.__qualname__}"
            f"{did_you_mean(unknown[0], sorted(known), f'{group}.')} (known keys: {', '.join(sorted(known))})"
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
