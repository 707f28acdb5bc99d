"""The BraTS task: federated segmentation of the whole tumour (or the three BraTS regions) on 64x64 axial patches.

Cases are read through :mod:`medfed.data.brats` (BraTS 2017-2019,
2020/2021, 2023 and MSD Task01 layouts, labelled cases only), placed at sites
from a FeTS-style ``partitioning.csv`` when the data set has one (the
generated default does, one partition per simulated scanner) or by a seeded
shuffle otherwise, and split 80/20 *by case* inside each site with a seeded
draw (with ``federation.validation_fraction`` > 0 the training cases are split
again into train and validation; with ``federation.holdout: validation`` the
test cases are then set aside unread). ``federation.site_sizes`` sizes the
sites: shuffled sites get that many cases each, and a partition's sites
(also the generated data set's) keep a seeded draw of that many of their
cases (:func:`~medfed.data.federation.place_subjects`; the rest are never
read). This plan is made, and checked against the federation config, from the file
names alone, before any volume is opened. The federation "lack k" zero-fills
MRI channel k (FLAIR, T1, T1ce, T2 = 0..3) at the configured sites, as a
hospital without that sequence would deliver it.

``data.train_sampling`` chooses the training samples: ``fixed`` (the
paper's protocol, the default) trains on the patches cut once; ``random_crops``
keeps each site's training volumes in memory and cuts fresh, augmented crops
every epoch (:class:`~medfed.data.crops.RandomCrops`, ``data.augment``). The
evaluation split is the fixed patch set in both.

The patches of every site and split, and with ``random_crops`` the training
volumes, are kept in the preprocessed-data cache (:mod:`medfed.data.cache`,
``data.cache``): a second run on the same files with the same options,
federation and seed reads no volume. ``data.augment`` acts on each drawn crop,
not on what is stored, so it is not part of the cache key.

A deployed hospital builds its own site alone from its own case folders
(:func:`build_site`); :func:`site_cases` copies each simulated site's cases
into a folder of its own for a rehearsal on one machine.

A generated data set is held (:func:`~medfed.data.phantoms.store.hold`)
whenever it is read, while the federation is built and while whole volumes
are evaluated, so another run generating other parameters at the same root
waits instead of replacing the files under this one.
"""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset
from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.config import FederationConfig
from medfed.data.brats import MODALITIES, REGIONS, BratsCase, BratsVolume, find_cases, load_case, tumour_regions
from medfed.data.cache import cache_key, key_settings, load_or_build
from medfed.data.crops import RandomCrops, training_volume
from medfed.data.federation import (
    EvaluationVolume,
    Federation,
    SiteData,
    SiteSplit,
    assign_subjects_to_sites,
    place_subjects,
    split_site,
    split_sites,
    split_subjects,
)
from medfed.data.partition_csv import find_partition_csv, read_partition_csv
from medfed.data.patches import extract_axial_patches, sample_centres, tumour_free_centres, zscore_over_brain
from medfed.data.phantoms.brats import brats_phantoms
from medfed.data.phantoms.store import MARKER, describe_generated
from medfed.errors import ConfigError, DataError, warn
from medfed.options.tasks import BratsOptions as Options
from medfed.options.tasks import GeneratedBrats

NAME = "brats"
PREPROCESSING_VERSION = 1
"""Part of the cache key: bump it when a change here changes the tensors a federation holds."""


def build_federation(
    options: Options, federation: FederationConfig, seed: int, progress: bool = True, regions: str = "wt"
) -> Federation:
    """Generate the data if asked, plan sites and splits from the file names, then read and cut (or take the cache's) patches.

    Raises:
        ConfigError: the federation config does not fit the cases found (too
            many sites, site sizes too small for a site's splits, a bad
            missing channel), before any volume is read.
        DataError: bad data (see :mod:`medfed.data.brats`), or a site whose
            cases hold no tumour voxel.
    """
    root = Path(options.root)
    held = _data_set(root, options.generate, federation.n_sites, progress)
    with held():
        return _plan_and_read(root, held, options, federation, seed, progress, regions)


def _data_set(root: Path, generate: GeneratedBrats | None, n_sites: int, progress: bool) -> Callable[[], AbstractContextManager]:
    """What holds the data at ``root`` while a ``with`` block reads them: the generated set (written first if need be), or nothing."""
    if generate is None:
        return nullcontext
    return partial(
        brats_phantoms,
        root,
        n_sites=n_sites,
        cases_per_site=generate.cases_per_site,
        seed=generate.seed,
        resolution_mm=generate.resolution_mm,
        progress=progress,
    )


def _plan_and_read(
    root: Path,
    held: Callable[[], AbstractContextManager],
    options: Options,
    federation: FederationConfig,
    seed: int,
    progress: bool,
    regions: str,
) -> Federation:
    """:func:`build_federation` while the data set at ``root`` is held."""
    cases = {case.case_id: case for case in find_cases(root)}
    partition_file = find_partition_csv(options.partition_csv or None, root)
    partition = read_partition_csv(partition_file) if partition_file is not None else None
    placement = place_subjects(sorted(cases), federation, seed, partition, noun="cases")
    site_splits = split_sites(placement.sites, _draw_cases, federation, seed, noun="cases", partition_file=partition_file)
    missing_sites, missing_channel = missing_channel_sites(federation)
    drops = [missing_channel if index in missing_sites else None for index in range(federation.n_sites)]

    input_files = [path for case in cases.values() for path in (*case.image_files, case.label_file)]
    input_files += [path for path in (partition_file, root / MARKER) if path is not None and path.is_file()]
    settings = {**key_settings(options, federation, seed, not_stored=("augment",), placement=placement), "regions": regions}
    key = cache_key(NAME, PREPROCESSING_VERSION, root, input_files, settings)
    built = load_or_build(
        key,
        lambda: _read_federation(root, cases, site_splits, range(federation.n_sites), drops, options, federation, seed, progress, regions),
        task=NAME,
        enabled=options.cache,
        cache_dir=options.cache_dir,
    )
    built.volumes = BratsVolumes(cases, [split.evaluation for split in site_splits], drops, held, options.resample)
    built.site_sizes = placement.summary(federation, seed, "cases")
    _train_on_random_crops(built, options, regions)
    return built


def _train_on_random_crops(built: Federation, options: Options, regions: str) -> None:
    """With ``train_sampling: random_crops``, each site trains on fresh crops of its kept volumes (:class:`RandomCrops`)."""
    if options.train_sampling != "random_crops":
        return
    for site in built.sites:
        site.train = RandomCrops(
            site.train.tensors,
            site.train_volumes,
            options.tumour_patches_per_case,
            options.background_patches_per_case,
            options.patch_size,
            regions,
            options.augment,
        )


def build_site(
    options: Options, federation: FederationConfig, seed: int, site_index: int, data_root: Path, progress: bool = True,
    regions: str = "wt",
) -> Federation:
    """One site's member alone, from its own cases (a deployed hospital, :mod:`medfed.deploy`).

    Every labelled case under ``data_root`` (in any layout
    :func:`~medfed.data.brats.find_cases` reads) belongs to site
    ``site_index``. The rest is :func:`build_federation`'s for that site: the
    same split draw with the site's own seeds, the same patches (each case's
    draw is seeded by the run's seed and its case id), the same zeroed
    channel where ``federation.missing_channel`` names this site (a rehearsal
    of "lack k"; a hospital without a sequence leaves it out of the config).
    Given the cases the simulator places at the site (:func:`site_cases`),
    the member's tensors are the simulator's. ``data.root``,
    ``data.generate``, ``data.partition_csv`` and the preprocessed-data cache
    are not used, and the member has no whole volumes (a deployment
    evaluates patches only).

    Returns:
        A federation of one site, named ``site<site_index>``.

    Raises:
        ConfigError: a bad ``federation.missing_channel``.
        DataError: the site's data (see :mod:`medfed.data.brats`), too few
            cases for the split, or no tumour voxel in any of its cases.
    """
    root = Path(data_root)
    cases = {case.case_id: case for case in find_cases(root)}
    split = split_site(sorted(cases), _draw_cases, federation, seed, site_index)
    missing_sites, missing_channel = missing_channel_sites(federation)
    drop = missing_channel if site_index in missing_sites else None
    built = _read_federation(root, cases, [split], [site_index], [drop], options, federation, seed, progress, regions)
    _train_on_random_crops(built, options, regions)
    return built


def site_cases(options: Options, federation: FederationConfig, seed: int, out_dir: Path, progress: bool = True) -> list[Path]:
    """Copy each site's cases, as :func:`build_federation` places them, to ``out_dir/site<i>/`` (generated first if need be).

    A rehearsal of a deployment on one machine: each SuperNode's data root
    then holds only its own hospital's case folders (at their paths relative
    to ``data.root``, e.g. ``HGG/<case>``), and :func:`build_site` builds the
    simulator's member from them.

    Returns:
        The sites' folders, site order.

    Raises:
        ConfigError, DataError: as :func:`build_federation`'s plan; DataError
            for a data set in the MSD layout (one ``dataset.json`` for all
            cases: its cases are not folders of their own).
    """
    root = Path(options.root)
    with _data_set(root, options.generate, federation.n_sites, progress)():
        cases = {case.case_id: case for case in find_cases(root)}
        partition_file = find_partition_csv(options.partition_csv or None, root)
        partition = read_partition_csv(partition_file) if partition_file is not None else None
        folders = []
        for index, ids in enumerate(assign_subjects_to_sites(sorted(cases), federation, seed, partition)):
            folder = Path(out_dir) / f"site{index}"
            for case_id in ids:
                case = cases[case_id]
                if case.layout == "msd":
                    raise DataError(f"{root}: an MSD data set (dataset.json) cannot be split into per-site folders; use the BraTS layout")
                source = case.image_files[0].parent
                shutil.copytree(source, folder / source.relative_to(root), dirs_exist_ok=True)
            folders.append(folder)
    return folders


@dataclass(frozen=True)
class BratsVolumes:
    """Each site's evaluation cases as whole volumes (:class:`~medfed.data.federation.VolumeSource`).

    A volume is read when evaluated, z-scored over the brain and its missing
    channel zeroed exactly as the site's training patches were; labels are
    :class:`~medfed.data.brats.TumourLabel` values.
    """

    cases: dict[str, BratsCase]
    evaluation_cases: list[list[str]]
    drops: list[int | None]
    held: Callable[[], AbstractContextManager]
    """Holds the data set while volumes are read (another run may have generated other data there meanwhile)."""
    resample: bool = False
    """As ``data.resample``: files on another grid than the first modality's are resampled onto it."""

    def n_volumes(self, site: int) -> int:
        return len(self.evaluation_cases[site])

    def site_volumes(self, site: int) -> Iterator[EvaluationVolume]:
        with self.held():
            for case_id in self.evaluation_cases[site]:
                volume = load_case(self.cases[case_id], self.resample)
                image = _normalised(volume, self.drops[site])
                spacing = tuple(float(s) for s in np.linalg.norm(volume.affine[:3, :3], axis=0))
                yield EvaluationVolume(case_id, image, volume.label, spacing)


def _read_federation(
    root: Path,
    cases: dict[str, BratsCase],
    site_splits: list[SiteSplit],
    site_indices: Sequence[int],
    drops: list[int | None],
    options: Options,
    federation: FederationConfig,
    seed: int,
    progress: bool,
    regions: str,
) -> Federation:
    """Read every train, evaluation and validation case of the plan and cut its patches (set-aside cases are never read).

    ``site_indices`` are the sites' indices (their names ``site<i>``), one per split.

    With ``train_sampling: random_crops`` each site's training cases are also
    kept, as :func:`~medfed.data.crops.training_volume` records, in ``SiteData.train_volumes``.
    """
    sites = []
    n_read = sum(len(split.train) + len(split.evaluation) + len(split.validation) for split in site_splits)
    bar = tqdm(total=n_read, desc="reading cases", unit="case", disable=not progress, leave=False)
    for index, split, drop in zip(site_indices, site_splits, drops, strict=True):
        splits, tumour_voxels, train_volumes = {}, {}, []
        parts = (("train", split.train), ("evaluation", split.evaluation), ("validation", split.validation))
        for split_name, ids in (part for part in parts if len(part[1])):
            xs, ys = [], []
            tumour_voxels[split_name] = 0
            for case_id in ids:
                volume = load_case(cases[case_id], options.resample)  # labelled: find_cases lists only labelled cases
                rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(case_id.encode())]))
                image = _normalised(volume, drop)
                tumour = volume.label > 0
                background = tumour_free_centres((volume.image != 0).any(axis=0), tumour, options.patch_size)
                x, y = _case_patches(image, volume.label, tumour, background, options, rng, regions)
                xs.append(x)
                ys.append(y)
                if split_name == "train" and options.train_sampling == "random_crops":
                    train_volumes.append(training_volume(image, volume.label, tumour, background))
                tumour_voxels[split_name] += int(np.count_nonzero(volume.label))
                bar.update()
            splits[split_name] = TensorDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)))
        _check_tumour(root, f"site{index}", split, tumour_voxels)
        info = {**split.info("cases"), "missing_channel": None if drop is None else MODALITIES[drop]}
        sites.append(
            SiteData(
                name=f"site{index}",
                train=splits["train"],
                test=splits["evaluation"],
                info=info,
                train_volumes=train_volumes if options.train_sampling == "random_crops" else None,
                validation=splits.get("validation"),
            )
        )
    bar.close()

    generated = describe_generated(root)
    return Federation(
        task=NAME,
        sites=sites,
        input_shape=(len(MODALITIES), options.patch_size, options.patch_size),
        num_classes=2 if regions == "wt" else len(REGIONS),
        description=generated if generated is not None else f"BraTS data read from {root}",
        generated=generated is not None,
        holdout=federation.holdout,
    )


def _check_tumour(root: Path, site: str, split: SiteSplit, tumour_voxels: dict[str, int]) -> None:
    """A site without any tumour voxel is an error (its label IoU would be 0); a split without one is a warning."""
    if not any(tumour_voxels.values()):
        n_cases = len(split.train) + len(split.evaluation) + len(split.validation)
        raise DataError(
            f"{root}: {site}: none of its {n_cases} cases has a tumour voxel (all segmentations are background); "
            "whole-tumour segmentation needs tumour at every site"
        )
    names = {"train": "train", "evaluation": split.holdout, "validation": "validation"}
    for split_name, count in tumour_voxels.items():
        if count == 0:
            warn(f"{root}: {site}: its {names[split_name]} cases have no tumour voxel; its tumour metrics there will be 0")


def _draw_cases(cases: Sequence[str], fraction: float, seed_of: Callable[[int], int]) -> tuple[list[str], list[str]]:
    """The BraTS :data:`~medfed.data.federation.SplitDraw`: a seeded draw of ``fraction`` of the cases (one stratum)."""
    return split_subjects(list(cases), fraction, seed_of(0))


def missing_channel_sites(federation: FederationConfig) -> tuple[set[int], int | None]:
    """Sites lacking a channel and which channel (``(set(), None)`` without "lack k"); ``predict`` zeroes it too."""
    lack = federation.missing_channel
    if lack is None:
        return set(), None
    if not 0 <= lack.channel < len(MODALITIES):
        raise ConfigError(
            f"config key 'federation.missing_channel.channel' = {lack.channel}: expected 0..{len(MODALITIES) - 1} ({', '.join(MODALITIES)})"
        )
    n = federation.n_sites
    sites = list(range(n - lack.n_sites_missing, n)) if lack.sites is None else list(lack.sites)
    bad = [s for s in sites if not 0 <= s < n]
    if bad or lack.n_sites_missing < 0 or lack.n_sites_missing > n:
        raise ConfigError(f"config key 'federation.missing_channel.sites' = {sites}: expected site indices in 0..{n - 1}")
    return set(sites), lack.channel


def _normalised(volume: BratsVolume, drop_channel: int | None) -> np.ndarray:
    """float32 ``(4, X, Y, Z)``: the case z-scored over its brain, channel ``drop_channel`` zeroed ("lack k")."""
    image = zscore_over_brain(volume.image)
    if drop_channel is not None:
        image[drop_channel] = 0.0
    return image


def _case_patches(
    image: np.ndarray,
    label: np.ndarray,
    tumour: np.ndarray,
    background: np.ndarray,
    options: Options,
    rng: np.random.Generator,
    regions: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Patches of one labelled case: ``x`` float32 (n, 4, P, P) and its targets.

    ``tumour_patches_per_case`` centres drawn from the ``tumour`` mask, then
    ``background_patches_per_case`` from the ``background`` mask (tumour-free
    crops), none of a kind whose mask is empty. Targets (``regions``): ``wt``: int64
    (n, P, P), 1 = whole tumour; ``brats``: uint8 (n, 3, P, P) masks of WT,
    TC, ET (:func:`~medfed.data.brats.tumour_regions`).
    """
    centres = np.concatenate(
        [
            sample_centres(tumour, options.tumour_patches_per_case, rng),
            sample_centres(background, options.background_patches_per_case, rng),
        ]
    )
    if regions == "wt":
        return extract_axial_patches(image, tumour.astype(np.int64), centres, options.patch_size)
    x, labels = extract_axial_patches(image, label.astype(np.int64), centres, options.patch_size)
    return x, np.moveaxis(tumour_regions(labels), 0, 1)
