"""The ``data`` option groups of every task, and what each task's samples fit: plain dataclasses, no torch.

Each task module takes its ``Options`` from here, so
:func:`medfed.components.resolve` checks a config's ``data`` group, its
``model.name`` and ``task.regions`` against the task, and fills in every
default, before torch is imported. :data:`TASK_SPECS` names the tasks
(``data.task``); :data:`medfed.tasks.TASKS` adds to each spec the functions
that build its federation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medfed.config import REGION_SETS, require
from medfed.errors import ConfigError

TRAIN_SAMPLING = ("fixed", "random_crops")
"""``data.train_sampling`` of BraTS: the patches cut once, or fresh augmented crops every epoch."""
EMBEDDED_TABLES = ("breast_cancer",)
"""``data.embedded`` of the clinical task: the tables shipped with medfed."""
BREAST_CANCER_TARGET = "diagnosis"
"""The embedded breast-cancer table's target column (:func:`medfed.data.tabular.write_breast_cancer_csv`)."""
BREAST_CANCER_POSITIVE = "malignant"
"""Its value meaning the event (label 1)."""


@dataclass
class Augmentation:
    """The ``data.augment`` group: per-crop flips and intensity changes (``train_sampling: random_crops``)."""

    flip_prob: float = 0.5
    """Probability of mirroring each in-plane axis (left-right, anterior-posterior), independently."""
    scale: float = 0.1
    """Non-zero values of each channel times ``1 + f``, ``f ~ U(-scale, scale)``."""
    shift: float = 0.1
    """Then plus ``o ~ U(-shift, shift)`` per channel (z-score units)."""

    def __post_init__(self) -> None:
        require(0.0 <= self.flip_prob <= 1.0, "augment.flip_prob", self.flip_prob, "a probability in [0, 1]")
        require(0.0 <= self.scale < 1.0, "augment.scale", self.scale, "a number in [0, 1)")
        require(self.shift >= 0.0, "augment.shift", self.shift, ">= 0")


@dataclass
class GeneratedBrats:
    """Settings of the generated default data set (one partition per site of the federation)."""

    cases_per_site: int = 8
    seed: int = 0
    resolution_mm: float = 2.0


@dataclass
class BratsOptions:
    """The ``data`` config group of the BraTS task (:mod:`medfed.tasks.brats`)."""

    root: str = "data/generated/brats2017"
    generate: GeneratedBrats | None = field(default_factory=GeneratedBrats)
    partition_csv: str | None = None
    patch_size: int = 64
    tumour_patches_per_case: int = 12
    background_patches_per_case: int = 4
    train_sampling: str = "fixed"
    """``fixed``: train on the patches cut once; ``random_crops``: fresh crops every epoch, as many and as balanced (:mod:`medfed.data.crops`)."""
    augment: Augmentation = field(default_factory=Augmentation)
    """Flips and intensity changes of each crop (``random_crops`` only)."""
    resample: bool = False
    """A case's modality or segmentation on another voxel grid than its first modality's is resampled onto that grid (linear,
    nearest neighbour for the segmentation) instead of refused (:func:`medfed.data.brats.load_case`)."""
    cache: bool = True
    """Keep the built patches in the preprocessed-data cache and reuse them (:mod:`medfed.data.cache`)."""
    cache_dir: str | None = None
    """The cache folder; null: ``$XDG_CACHE_HOME/medfed``, else ``~/.cache/medfed``."""

    def __post_init__(self) -> None:
        require(self.patch_size >= 8 and self.patch_size % 2 == 0, "patch_size", self.patch_size, "an even number >= 8")
        require(self.tumour_patches_per_case >= 0, "tumour_patches_per_case", self.tumour_patches_per_case, ">= 0")
        require(self.background_patches_per_case >= 0, "background_patches_per_case", self.background_patches_per_case, ">= 0")
        require(
            self.tumour_patches_per_case + self.background_patches_per_case > 0,
            "tumour_patches_per_case",
            self.tumour_patches_per_case,
            "at least one patch per case in total",
        )
        require(self.train_sampling in TRAIN_SAMPLING, "train_sampling", self.train_sampling, " or ".join(TRAIN_SAMPLING))


@dataclass
class GeneratedLuna16:
    """Settings of the generated default data set (one acquisition site per site of the federation).

    The keys are those of :func:`~medfed.data.phantoms.luna16.luna16_phantoms`, which checks them.
    """

    series_per_site: int = 10
    nodules_per_series: list[int] = field(default_factory=lambda: [3, 5])
    nodule_diameter_mm: list[float] = field(default_factory=lambda: [3.0, 25.0])
    negatives_per_series: int = 80
    matrix_size: int = 192
    z_extent_mm: float = 80.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("nodules_per_series", "nodule_diameter_mm"):
            require(len(getattr(self, key)) == 2, f"generate.{key}", getattr(self, key), "a [low, high] pair")


@dataclass
class Luna16Options:
    """The ``data`` config group of the LUNA16 task (:mod:`medfed.tasks.luna16`)."""

    root: str = "data/generated/luna16"
    generate: GeneratedLuna16 | None = field(default_factory=GeneratedLuna16)
    candidates_csv: str | None = None
    """Default: ``root/candidates_V2.csv``, else ``root/candidates.csv``."""
    partition_csv: str | None = None
    """Default: ``root/partitioning.csv`` when present, else a seeded shuffle of the series."""
    patch_size: int = 32
    max_negatives_per_series: int | None = None
    """Keep at most this many non-nodule candidates per series, drawn with the run's seed, before
    the federation is built (real LUNA16 has ~620 per series); null keeps all."""
    cache: bool = True
    """Keep the cut patches in the preprocessed-data cache and reuse them (:mod:`medfed.data.cache`)."""
    cache_dir: str | None = None
    """The cache folder; null: ``$XDG_CACHE_HOME/medfed``, else ``~/.cache/medfed``."""

    def __post_init__(self) -> None:
        require(self.patch_size >= 1, "patch_size", self.patch_size, "a positive number of voxels")
        require(
            self.max_negatives_per_series is None or self.max_negatives_per_series >= 0,
            "max_negatives_per_series",
            self.max_negatives_per_series,
            "null or >= 0",
        )


@dataclass
class ClinicalOptions:
    """The ``data`` config group of the clinical task (:mod:`medfed.tasks.clinical`)."""

    csv: str = "data/generated/clinical/breast_cancer.csv"
    embedded: str | None = "breast_cancer"
    """Write this table shipped with an installed package to ``csv`` first (a different file there is
    an error, never overwritten); null reads your own ``csv``."""
    target: str = BREAST_CANCER_TARGET
    positive: str | int | bool = BREAST_CANCER_POSITIVE
    """The target value meaning the event (label 1), compared as text; a bool (an unquoted YAML ``true``)
    matching no cell is an error that says to quote it."""
    site_column: str | None = None
    exclude_columns: list[str] = field(default_factory=list)
    """Columns that are neither features nor target nor site (e.g. a patient id)."""

    def __post_init__(self) -> None:
        require(
            self.embedded is None or self.embedded in EMBEDDED_TABLES,
            "embedded",
            self.embedded,
            f"null or one of {', '.join(EMBEDDED_TABLES)}",
        )


@dataclass(frozen=True)
class TaskSpec:
    """A task as a config names it: its ``data`` group and the models its samples fit.

    Attributes:
        name: the ``data.task`` value.
        Options: the ``data`` group's dataclass.
        default_model: the ``model.name`` used when the config names none.
        regions: the ``task.regions`` values the task can label samples for
            (empty: one fixed target, no choice).
    """

    name: str
    Options: type
    default_model: str
    regions: tuple[str, ...] = ()

    @property
    def models(self) -> tuple[str, ...]:
        """The model names whose input the task's samples fit (``default_model`` first)."""
        return (self.default_model,)


TASK_SPECS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("brats", BratsOptions, "unet", REGION_SETS),
        TaskSpec("luna16", Luna16Options, "densenet"),
        TaskSpec("clinical", ClinicalOptions, "logreg"),
    )
}
"""Every task, by ``data.task``."""


def task_spec(name: str) -> TaskSpec:
    """The task named ``name`` (config key ``data.task``).

    Raises:
        ConfigError: ``name`` is no task.
    """
    if name not in TASK_SPECS:
        raise ConfigError(f"config key 'data.task' = {name!r}: expected one of {', '.join(sorted(TASK_SPECS))}")
    return TASK_SPECS[name]
