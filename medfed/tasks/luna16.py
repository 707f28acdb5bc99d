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

A deployed hospital builds its own site alone from its own series
(:func:`build_site`); :func:`site_series` copies each simulated site's series
and candidate rows into a LUNA16-layout folder of its own for a rehearsal on
one machine.
"""

from __future__ import annotations

import csv
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from medfed.config import FederationConfig
from medfed.data.cache import cache_key, key_settings, load_or_build
from medfed.data.federation import (
    Federation,
    SiteData,
    SiteSplit,
    Placement,
    place_subjects,
    split_site,
    split_sites,
    split_subjects,
)
from medfed.data.luna16 import CandidateSelection, NoduleCandidates, cut_candidate_patches, select_candidates, series_files
from medfed.data.partition_csv import find_partition_csv, read_partition_csv
from medfed.data.phantoms.luna16 import luna16_phantoms
from medfed.data.phantoms.store import MARKER, describe_generated
from medfed.errors import ConfigError, DataError
from medfed.options.tasks import Luna16Options as Options
from medfed.tasks.label_imbalance import SiteSamples, refuse_label_ratio, sites_at_label_ratio

NAME = "luna16"
PREPROCESSING_VERSION = 2
"""Part of the cache key: bump it when a change here changes the tensors a federation holds."""


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
    with _data_set(root, options, federation, progress):
        return _plan_and_cut(root, options, federation, seed, progress)


@contextmanager
def _data_set(root: Path, options: Options, federation: FederationConfig, progress: bool) -> Iterator[None]:
    """Holds the data at ``root`` while the ``with`` block reads them: the generated set (written first if need be), or nothing.

    A generated data set stays as it is while it is read, whatever other runs generate.
    """
    with ExitStack() as held:
        if options.generate is not None:
            try:
                held.enter_context(luna16_phantoms(root, n_sites=federation.n_sites, progress=progress, **asdict(options.generate)))
            except ValueError as error:  # the generator names the impossible parameter
                raise ConfigError(f"config key 'data.generate': {error}") from None
        yield


def _select(root: Path, candidates_csv: str | Path | None, options: Options, seed: int) -> CandidateSelection:
    """The candidates of the data set at ``root`` (:func:`~medfed.data.luna16.select_candidates` with the options' subsampling)."""
    return select_candidates(root, candidates_csv=candidates_csv, max_negatives_per_series=options.max_negatives_per_series, seed=seed)


def _plan_and_cut(root: Path, options: Options, federation: FederationConfig, seed: int, progress: bool) -> Federation:
    """:func:`build_federation` once the data set at ``root`` is there."""
    selection = _select(root, options.candidates_csv, options, seed)
    partition_file = find_partition_csv(options.partition_csv or None, root)
    series, has_nodule = _series(selection)
    placement = _place_series(series, federation, seed, partition_file)
    draw = partial(_draw_series, has_nodule=has_nodule)
    splits = split_sites(placement.sites, draw, federation, seed, noun="series", partition_file=partition_file)
    kept = _kept(selection, placement.sites, splits, federation, seed, source=str(root))

    input_files = [*selection.input_files(), *(path for path in (partition_file, root / MARKER) if path is not None and path.is_file())]
    key = cache_key(NAME, PREPROCESSING_VERSION, root, input_files, key_settings(options, federation, seed, placement=placement))
    built = load_or_build(
        key,
        lambda: _cut_federation(root, selection, splits, kept, range(federation.n_sites), options, federation, progress),
        task=NAME,
        enabled=options.cache,
        cache_dir=options.cache_dir,
    )
    built.site_sizes = placement.summary(federation, seed, "series")
    return built


def build_site(
    options: Options, federation: FederationConfig, seed: int, site_index: int, data_root: Path, progress: bool = True
) -> Federation:
    """One site's member alone, from its own series (a deployed hospital, :mod:`medfed.deploy`).

    ``data_root`` is a LUNA16-layout folder holding only the site's series
    (``subset*/<uid>.mhd`` and their voxel files) and its candidates CSV
    (the file name of ``data.candidates_csv``, else ``candidates_V2.csv`` or
    ``candidates.csv``); every series with a candidate there belongs to
    site ``site_index``. The rest is :func:`build_federation`'s for that
    site: the same negative subsampling (each series' draw is seeded by the
    run's seed and its uid), the same stratified train/test (and validation)
    draw with the site's own seeds, the same patches. Given the series and
    candidate rows the simulator places at the site (:func:`site_series`),
    the member's tensors are the simulator's. ``data.root``,
    ``data.generate``, ``data.partition_csv`` and the preprocessed-data
    cache are not used.

    Returns:
        A federation of one site, named ``site<site_index>``.

    Raises:
        ConfigError: ``federation.label_ratio`` is set (its draw runs over
            every site's candidates at once).
        DataError: the site's data (see :mod:`medfed.data.luna16`), or fewer
            than 2 series with a nodule candidate.
    """
    refuse_label_ratio(federation)
    root = Path(data_root)
    selection = _select(root, _site_csv(root, options), options, seed)
    series, has_nodule = _series(selection)
    split = split_site(series, partial(_draw_series, has_nodule=has_nodule), federation, seed, site_index)
    kept = _kept(selection, [series], [split], federation, seed, source=str(root))
    return _cut_federation(root, selection, [split], kept, [site_index], options, federation, progress)


def site_series(options: Options, federation: FederationConfig, seed: int, out_dir: Path, progress: bool = True) -> list[Path]:
    """Copy each site's series, as :func:`build_federation` places them, to ``out_dir/site<i>/`` in the LUNA16 layout (generated first if need be).

    A rehearsal of a deployment on one machine: each site's folder holds its
    series' headers and voxel files at their paths relative to ``data.root``
    (``subset<k>/<uid>.mhd``, ``.raw``), the candidates CSV under its own
    file name restricted to those series' rows, and ``annotations.csv``
    likewise when the data set has one (rows in file order). :func:`build_site`
    builds the simulator's member from it.

    Returns:
        The sites' folders, site order.

    Raises:
        ConfigError, DataError: as :func:`build_federation`'s plan.
    """
    root = Path(options.root)
    with _data_set(root, options, federation, progress):
        selection = _select(root, options.candidates_csv, options, seed)
        partition_file = find_partition_csv(options.partition_csv or None, root)
        folders = []
        for index, uids in enumerate(_place_series(_series(selection)[0], federation, seed, partition_file).sites):
            folder = Path(out_dir) / f"site{index}"
            for uid in uids:
                for path in series_files(selection.series_paths[uid]):
                    target = folder / path.relative_to(root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
            for table in (selection.csv_path, root / "annotations.csv"):
                if table.is_file():
                    _copy_rows(table, folder / table.name, set(uids))
            folders.append(folder)
    return folders


def _site_csv(root: Path, options: Options) -> Path | None:
    """A site's candidates CSV: ``root`` / the file name of ``data.candidates_csv``; None: the default names in ``root``."""
    return None if options.candidates_csv is None else root / Path(options.candidates_csv).name


def _copy_rows(source: Path, target: Path, uids: set[str]) -> None:
    """Write ``source``'s header and its rows whose first field (``seriesuid``) is in ``uids``, cells unchanged, to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, newline="", encoding="utf-8") as read, open(target, "w", newline="", encoding="utf-8") as written:
        rows = csv.reader(read)
        out = csv.writer(written, lineterminator="\n")
        out.writerow(next(rows))
        out.writerows(row for row in rows if row and row[0] in uids)


def _series(selection: CandidateSelection) -> tuple[list[str], dict[str, bool]]:
    """The series with a selected candidate (sorted) and whether each holds a nodule candidate."""
    series, series_of_candidate = np.unique(selection.series_uids, return_inverse=True)
    has_nodule = np.bincount(series_of_candidate, weights=selection.labels, minlength=len(series)) > 0
    return series.tolist(), dict(zip(series.tolist(), has_nodule.tolist()))


def _place_series(series: list[str], federation: FederationConfig, seed: int, partition_file: Path | None) -> Placement:
    """Each site's series (sorted): by the partition file when there is one (each site a seeded draw of its partition unless ``federation.site_sizes`` is equal), else a seeded shuffle."""
    partition = read_partition_csv(partition_file) if partition_file is not None else None
    return place_subjects(series, federation, seed, partition, noun="series")


def _kept(
    selection: CandidateSelection,
    site_series: list[list[str]],
    splits: list[SiteSplit],
    federation: FederationConfig,
    seed: int,
    source: str,
) -> list[SiteSamples]:
    """The candidates each site keeps at its label ratio, split as its series are.

    Args:
        selection: the selected candidates (labels and series in CSV order).
        site_series: each site's series, one list per entry of ``splits``.
        splits: each site's :class:`SiteSplit` of its series.
        federation: the federation config (label ratio, holdout).
        seed: the run's seed.
        source: the data, for error messages.

    Returns:
        Per site, its :class:`SiteSamples` (indices into the selected candidates);
        the candidates of a series no site kept (a partition cut to
        ``federation.site_sizes``) are in no site's split.
    """
    labels, series_uids = selection.labels, selection.series_uids
    site_of = {uid: index for index, uids in enumerate(site_series) for uid in uids}
    roles = {"evaluation": set(), "set_aside": set(), "validation": set()}
    for split in splits:
        for role, members in roles.items():
            members.update(getattr(split, role))
    member = {role: np.isin(series_uids, sorted(members)) for role, members in roles.items()}
    placed = np.isin(series_uids, sorted(site_of))
    return sites_at_label_ratio(
        labels,
        np.array([site_of.get(uid, 0) for uid in series_uids], dtype=np.int64),
        member["evaluation"],
        n_sites=len(splits),
        label_ratio=federation.label_ratio,
        seed=seed,
        source=source,
        set_aside=member["set_aside"] | ~placed,
        evaluation_split=federation.holdout,
        in_validation=member["validation"] if member["validation"].any() else None,
    )


def _cut_federation(
    root: Path,
    selection: CandidateSelection,
    splits: list[SiteSplit],
    kept: list[SiteSamples],
    site_indices: Sequence[int],
    options: Options,
    federation: FederationConfig,
    progress: bool,
) -> Federation:
    """Read every selected series, cut its candidates' patches, and deal them out as planned.

    ``site_indices`` are the sites' indices (their names ``site<i>``), one per split.
    """
    candidates = cut_candidate_patches(selection, patch_size=options.patch_size, progress=progress)
    sites = [
        SiteData(
            name=f"site{index}",
            train=_dataset(candidates, samples.train),
            test=_dataset(candidates, samples.test),
            info={**split.info("series"), **samples.info},
            validation=None if samples.validation is None else _dataset(candidates, samples.validation),
        )
        for index, samples, split in zip(site_indices, kept, splits, strict=True)
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
