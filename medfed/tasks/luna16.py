"""The LUNA16 task: federated lung-nodule classification of 32x32 candidate patches under label imbalance.

Candidates are read through :mod:`medfed.data.luna16` (the challenge layout;
the generated default, :mod:`medfed.data.phantoms.luna16`, is written in the
same layout and read back by the same reader). A federation is planned in
three seeded steps from the candidates CSV alone, so a federation config that
does not fit the data fails before any CT volume is read:

1. **Sites.** CT series are placed at sites from a FeTS-style
   ``partitioning.csv`` when the data set has one (the generated default does:
   one partition per simulated scanner) or by a seeded shuffle of the series
   otherwise (:func:`~medfed.data.federation.place_subjects`, with
   ``federation.site_sizes`` series per site; a partition's sites then keep a
   seeded draw of that many of their series, the others' candidates unused).
2. **Train/test by series.** Each site's series are split 80/20 (the
   federation's ``test_fraction``) with a seeded draw per site, so no series
   (patient) has candidates in both splits. The draw is stratified: series
   holding a nodule candidate and series without one are split separately, so
   the test split always has nodules (a site needs at least two series with
   a nodule); a site with a single nodule-free series trains on it. With
   ``federation.validation_fraction`` > 0 the training series are split
   again, by the same stratified draw with seeds of their own, into train
   and validation; with ``federation.holdout: validation`` the test series
   are set aside and the validation split replaces test for the run.
3. **Label ratio.** Within each split, every site keeps candidates at its own
   ratio delta_s = n_negative / n_positive around the federation's delta
   (:mod:`medfed.tasks.label_imbalance`): train, test and validation
   carry the same ratio.

Samples: ``x`` float32 (n, 1, P, P), the axial patch through the candidate with
HU clipped to [-1000, 400] and scaled to [0, 1]; ``y`` int64 (n,), 1 = nodule.
No augmentation of any kind is applied, at training or at test time.
``SiteData.info`` records each site's series per split, target and realised
ratios and class counts; they end up in results.json. The patches are then
cut from the volumes, or taken from the preprocessed-data cache
(:mod:`medfed.data.cache`, ``data.cache``) when the same files, options,
federation and seed were built before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from medfed.config import FederationConfig, require
from medfed.data.cache import cache_key, key_settings, load_or_build
from medfed.data.federation import (
    Federation,
    SiteData,
    SiteSplit,
    Placement,
    place_subjects,
    split_sites,
    split_subjects,
)
from medfed.data.luna16 import CandidateSelection, NoduleCandidates, cut_candidate_patches, select_candidates
from medfed.data.partition_csv import find_partition_csv, read_partition_csv
from medfed.data.phantoms.luna16 import luna16_phantoms
from medfed.data.phantoms.store import MARKER, describe_generated
from medfed.errors import ConfigError, DataError
from medfed.tasks.label_imbalance import SiteSamples, sites_at_label_ratio

NAME = "luna16"
DEFAULT_MODEL = "densenet"
PREPROCESSING_VERSION = 1
"""Part of the cache key: bump it when a change here changes the tensors a federation holds."""


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
class Options:
    """The ``data`` config group of the LUNA16 task."""

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


def build_federation(options: Options, federation: FederationConfig, seed: int, progress: bool = True) -> Federation:
    """Generate the data if asked, plan sites, splits and label ratios from the candidates CSV, then cut (or take the cache's) patches.

    Raises:
        ConfigError: the federation config does not fit the series found
            (too many sites, site sizes too small for a site's splits),
            before any volume is read.
        DataError: bad data (see :mod:`medfed.data.luna16`), or a label ratio
            a site's split cannot meet, also before any volume is read.
    """
    root = Path(options.root)
    with ExitStack() as held:  # a generated data set stays as it is while it is read, whatever other runs generate
        if options.generate is not None:
            try:
                held.enter_context(luna16_phantoms(root, n_sites=federation.n_sites, progress=progress, **asdict(options.generate)))
            except ValueError as error:  # the generator names the impossible parameter
                raise ConfigError(f"config key 'data.generate': {error}") from None
        return _plan_and_cut(root, options, federation, seed, progress)


def _plan_and_cut(root: Path, options: Options, federation: FederationConfig, seed: int, progress: bool) -> Federation:
    """:func:`build_federation` once the data set at ``root`` is there."""
    selection = select_candidates(
        root, candidates_csv=options.candidates_csv, max_negatives_per_series=options.max_negatives_per_series, seed=seed
    )
    partition_file = find_partition_csv(options.partition_csv or None, root)
    placement, splits, kept = _plan(selection.labels, selection.series_uids, federation, seed, partition_file, source=str(root))

    input_files = [*selection.input_files(), *(path for path in (partition_file, root / MARKER) if path is not None and path.is_file())]
    key = cache_key(NAME, PREPROCESSING_VERSION, root, input_files, key_settings(options, federation, seed, placement=placement))
    built = load_or_build(
        key,
        lambda: _cut_federation(root, selection, splits, kept, options, federation, progress),
        task=NAME,
        enabled=options.cache,
        cache_dir=options.cache_dir,
    )
    built.site_sizes = placement.summary(federation, seed, "series")
    return built


def _plan(
    labels: np.ndarray,
    series_uids: np.ndarray,
    federation: FederationConfig,
    seed: int,
    partition_file: Path | None,
    source: str,
) -> tuple[Placement, list[SiteSplit], list[SiteSamples]]:
    """Each site's series, their split and the candidates each site keeps at its label ratio.

    Args:
        labels: int64 (n,), the candidates' labels (1 = nodule).
        series_uids: str (n,), each candidate's series.
        federation: the federation config.
        seed: the run's seed.
        partition_file: places series at sites, or None for a seeded shuffle.
        source: the data, for error messages.

    Returns:
        The series placed at sites (a partition's sites may keep only some of
        theirs: the others' candidates are in no site), and per site its
        :class:`SiteSplit` of series and its :class:`SiteSamples` (indices into ``labels``).
    """
    series, series_of_candidate = np.unique(series_uids, return_inverse=True)
    series_has_nodule = np.bincount(series_of_candidate, weights=labels, minlength=len(series)) > 0
    partition = read_partition_csv(partition_file) if partition_file is not None else None
    placement = place_subjects(series.tolist(), federation, seed, partition, noun="series")
    site_series = placement.sites
    draw = partial(_draw_series, has_nodule=dict(zip(series.tolist(), series_has_nodule)))
    splits = split_sites(site_series, draw, federation, seed, noun="series", partition_file=partition_file)

    position = {uid: i for i, uid in enumerate(series.tolist())}
    site_of_series = np.zeros(len(series), dtype=np.int64)
    series_evaluated = np.zeros(len(series), dtype=bool)
    series_set_aside = np.ones(len(series), dtype=bool)  # a series no site kept stays in no split
    series_validation = np.zeros(len(series), dtype=bool)
    for index, (uids, split) in enumerate(zip(site_series, splits)):
        site_of_series[[position[uid] for uid in uids]] = index
        series_set_aside[[position[uid] for uid in uids]] = False
        series_evaluated[[position[uid] for uid in split.evaluation]] = True
        series_set_aside[[position[uid] for uid in split.set_aside]] = True
        series_validation[[position[uid] for uid in split.validation]] = True

    kept = sites_at_label_ratio(
        labels,
        site_of_series[series_of_candidate],
        series_evaluated[series_of_candidate],
        n_sites=federation.n_sites,
        label_ratio=federation.label_ratio,
        seed=seed,
        source=source,
        set_aside=series_set_aside[series_of_candidate],
        evaluation_split=federation.holdout,
        in_validation=series_validation[series_of_candidate] if series_validation.any() else None,
    )
    return placement, splits, kept


def _cut_federation(
    root: Path,
    selection: CandidateSelection,
    splits: list[SiteSplit],
    kept: list[SiteSamples],
    options: Options,
    federation: FederationConfig,
    progress: bool,
) -> Federation:
    """Read every selected series, cut its candidates' patches, and deal them out as planned."""
    candidates = cut_candidate_patches(selection, patch_size=options.patch_size, progress=progress)
    sites = [
        SiteData(
            name=f"site{index}",
            train=_dataset(candidates, samples.train),
            test=_dataset(candidates, samples.test),
            info={**split.info("series"), **samples.info},
            validation=None if samples.validation is None else _dataset(candidates, samples.validation),
        )
        for index, (samples, split) in enumerate(zip(kept, splits))
    ]
    generated = describe_generated(root)
    return Federation(
        task=NAME,
        sites=sites,
        input_shape=(1, options.patch_size, options.patch_size),
        num_classes=2,
        description=generated if generated is not None else f"LUNA16 candidates read from {root}",
        generated=generated is not None,
        holdout=federation.holdout,
    )


def _draw_series(
    uids: Sequence[str], fraction: float, seed_of: Callable[[int], int], *, has_nodule: dict[str, bool]
) -> tuple[list[str], list[str]]:
    """The LUNA16 :data:`~medfed.data.federation.SplitDraw`: :func:`_split_series` with strata 0 (nodule) and 1 (none)."""
    return _split_series(list(uids), np.array([has_nodule[uid] for uid in uids]), fraction, (seed_of(0), seed_of(1)))


def _split_series(
    uids: list[str], has_nodule: np.ndarray, test_fraction: float, seeds: tuple[int, int]
) -> tuple[list[str], list[str]]:
    """Seeded train/test split of one site's series, stratified by whether a series holds a nodule.

    With ``holdout: validation`` the same draw also splits the training series
    into train and validation (``test_fraction`` is then the validation share).

    Args:
        uids: the site's series.
        has_nodule: bool (len(uids),), whether each series has a nodule candidate.
        test_fraction: share of each stratum that goes to test.
        seeds: seeds of the two strata's draws (with, without a nodule).

    Returns:
        ``(train_uids, test_uids)``, each sorted.

    Raises:
        DataError: fewer than two series with a nodule candidate at the site.
    """
    with_nodule = [uid for uid, has in zip(uids, has_nodule) if has]
    without_nodule = [uid for uid, has in zip(uids, has_nodule) if not has]
    if len(with_nodule) < 2:
        raise DataError(f"a site needs at least 2 series with a nodule candidate (one for each split), found {len(with_nodule)}")
    train, test = split_subjects(with_nodule, test_fraction, seeds[0])
    if len(without_nodule) >= 2:
        more_train, more_test = split_subjects(without_nodule, test_fraction, seeds[1])
        train, test = train + more_train, test + more_test
    else:
        train = train + without_nodule
    return sorted(train), sorted(test)


def _dataset(candidates: NoduleCandidates, indices: np.ndarray) -> TensorDataset:
    """``x`` float32 (n, 1, P, P) patches and ``y`` int64 (n,) labels of the chosen candidates."""
    x = torch.from_numpy(candidates.patches[indices][:, None])
    y = torch.from_numpy(candidates.labels[indices])
    return TensorDataset(x, y)
