"""The BraTS task: federated whole-tumour segmentation on 64x64 axial patches.

Cases are read through :mod:`medfed.data.brats` (BraTS 2017-2019,
2020/2021 and MSD Task01 layouts), placed at sites from a FeTS-style
``partitioning.csv`` when the data set has one (the generated default does,
one partition per simulated scanner) or by a seeded shuffle otherwise, and
split 80/20 *by case* inside each site with a seeded draw (with
``federation.holdout: validation`` the test cases are set aside unread and the
training cases are split again into train and validation). The federation
"lack k" zero-fills MRI channel k (FLAIR, T1, T1ce, T2 = 0..3) at the
configured sites, as a hospital without that sequence would deliver it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from medfed.config import FederationConfig, require
from medfed.data.brats import MODALITIES, find_cases, load_case
from medfed.data.federation import Federation, SiteData, assign_subjects_to_sites, split_site, split_subjects
from medfed.data.partition_csv import read_partition_csv
from medfed.data.patches import extract_axial_patches, sample_centres, tumour_free_centres, zscore_over_brain
from medfed.data.phantoms.brats import brats_phantoms
from medfed.data.phantoms.store import describe_generated
from medfed.errors import ConfigError, DataError

NAME = "brats"
DEFAULT_MODEL = "unet"


@dataclass
class GeneratedBrats:
    """Settings of the generated default data set (one partition per site of the federation)."""

    cases_per_site: int = 8
    seed: int = 0
    resolution_mm: float = 2.0


@dataclass
class Options:
    """The ``data`` config group of the BraTS task."""

    root: str = "data/generated/brats2017"
    generate: GeneratedBrats | None = field(default_factory=GeneratedBrats)
    partition_csv: str | None = None
    patch_size: int = 64
    tumour_patches_per_case: int = 12
    background_patches_per_case: int = 4

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


def build_federation(options: Options, federation: FederationConfig, seed: int, progress: bool = True) -> Federation:
    """Read (or generate) the data, place cases at sites, split, cut patches, drop channels."""
    root = Path(options.root)
    with ExitStack() as held:  # a generated data set stays as it is while it is read, whatever other runs generate
        if options.generate is not None:
            held.enter_context(
                brats_phantoms(
                    root,
                    n_sites=federation.n_sites,
                    cases_per_site=options.generate.cases_per_site,
                    seed=options.generate.seed,
                    resolution_mm=options.generate.resolution_mm,
                    progress=progress,
                )
            )
        return _read_federation(root, options, federation, seed, progress)


def _read_federation(root: Path, options: Options, federation: FederationConfig, seed: int, progress: bool) -> Federation:
    """:func:`build_federation` once the data set at ``root`` is there."""
    cases = {case.case_id: case for case in find_cases(root)}
    partition_file = Path(options.partition_csv) if options.partition_csv else root / "partitioning.csv"
    partition = read_partition_csv(partition_file) if partition_file.is_file() else None
    site_cases = assign_subjects_to_sites(sorted(cases), federation.n_sites, seed, partition)
    missing_sites, missing_channel = _missing_channel_sites(federation)

    site_splits = [split_site(subjects, _draw_cases, federation, seed, index) for index, subjects in enumerate(site_cases)]

    sites = []
    n_read = sum(len(split.train) + len(split.evaluation) for split in site_splits)  # set-aside cases are never read
    bar = tqdm(total=n_read, desc="reading cases", unit="case", disable=not progress, leave=False)
    for index, split in enumerate(site_splits):
        drop = missing_channel if index in missing_sites else None
        splits = {}
        for split_name, ids in (("train", split.train), ("evaluation", split.evaluation)):
            xs, ys = [], []
            for case_id in ids:
                rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(case_id.encode())]))
                x, y = _case_patches(cases[case_id], options, rng, drop)
                xs.append(x)
                ys.append(y)
                bar.update()
            splits[split_name] = TensorDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)))
        info = {**split.info("cases"), "missing_channel": None if drop is None else MODALITIES[drop]}
        sites.append(SiteData(name=f"site{index}", train=splits["train"], test=splits["evaluation"], info=info))
    bar.close()

    generated = describe_generated(root)
    description = generated if generated is not None else f"BraTS data read from {root}"
    return Federation(
        task=NAME,
        sites=sites,
        input_shape=(len(MODALITIES), options.patch_size, options.patch_size),
        num_classes=2,
        description=description,
        generated=generated is not None,
        holdout=federation.holdout,
    )


def _draw_cases(cases: Sequence[str], fraction: float, seed_of: Callable[[int], int]) -> tuple[list[str], list[str]]:
    """The BraTS :data:`~medfed.data.federation.SplitDraw`: a seeded draw of ``fraction`` of the cases (one stratum)."""
    return split_subjects(list(cases), fraction, seed_of(0))


def _missing_channel_sites(federation: FederationConfig) -> tuple[set[int], int | None]:
    """Sites lacking a channel and which channel (``(set(), None)`` without "lack k")."""
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


def _case_patches(case, options: Options, rng: np.random.Generator, drop_channel: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Patches of one case: ``x`` float32 (n, 4, P, P), ``y`` int64 (n, P, P) whole tumour vs background."""
    volume = load_case(case)
    if volume.label is None:
        raise DataError(f"case {case.case_id} has no segmentation; training and testing need labelled cases")
    image = zscore_over_brain(volume.image)
    if drop_channel is not None:
        image[drop_channel] = 0.0
    tumour = volume.label > 0
    brain = (volume.image != 0).any(axis=0)
    centres = np.concatenate(
        [
            sample_centres(tumour, options.tumour_patches_per_case, rng),
            sample_centres(tumour_free_centres(brain, tumour, options.patch_size), options.background_patches_per_case, rng),
        ]
    )
    return extract_axial_patches(image, tumour.astype(np.int64), centres, options.patch_size)
