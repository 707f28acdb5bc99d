"""Label-imbalance federations: every site's train and test split at the site's own label ratio.

The classification tasks (LUNA16, clinical) evaluate personalisation under
label imbalance delta = n_negative / n_positive (pFedNet, section VI-A). The
task first places its samples at sites and splits each site's samples into
train and test (by CT series, by record: the task's business); this module
then imposes the ratio on *each split separately*, so a site is tested on the
same class mix it trains on and "every site's ratio as specified" holds in
train and in test alike. With ``federation.holdout: validation`` the
validation split is treated exactly as the test split would be, and the
set-aside test samples are in neither pool.

Site s gets the target delta_s = delta * spread ** ((s - c) / c), c = (S - 1) / 2
(:func:`medfed.data.label_ratio.site_ratios`; ``federation.label_ratio``), and
keeps, within each split, the largest subset of its samples with
n_negative = round(delta_s * n_positive) (:func:`partition_by_label_ratio`),
drawn at random with a seed per split. Without ``federation.label_ratio`` every
sample is kept (the data set's natural ratios).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from medfed.config import LabelRatioConfig
from medfed.data.label_ratio import partition_by_label_ratio, site_ratios
from medfed.errors import DataError

@dataclass(frozen=True)
class SiteSamples:
    """The samples one site keeps.

    Attributes:
        train: int64 (n_train,), sorted indices of the site's training samples.
        test: int64 (n_test,), sorted indices of the samples it is evaluated on
            (its test split, or its validation split).
        info: JSON-serialisable counts and ratios: ``target_ratio`` (delta_s,
            None without a label ratio) and, for each split (``train`` and the
            evaluation split's name), ``n_<split>_positive``,
            ``n_<split>_negative`` and ``<split>_ratio`` (realised n_neg / n_pos).
    """

    train: np.ndarray
    test: np.ndarray
    info: dict[str, Any]


def sites_at_label_ratio(
    labels: np.ndarray,
    site_of_sample: np.ndarray,
    in_test: np.ndarray,
    *,
    n_sites: int,
    label_ratio: LabelRatioConfig | None,
    seed: int,
    source: str,
    set_aside: np.ndarray | None = None,
    evaluation_split: str = "test",
) -> list[SiteSamples]:
    """Impose each site's label ratio on its train split and on the split it is evaluated on.

    Args:
        labels: int (n,) 0/1 labels, 1 = positive.
        site_of_sample: int (n,) site index 0 .. n_sites-1 of every sample.
        in_test: bool (n,) whether a sample belongs to its site's evaluation
            split (the test split, or the validation split).
        n_sites: number of sites S.
        label_ratio: the federation's delta and spread; None keeps every sample.
        seed: seeds the draws (one stream per split).
        source: what the samples are (e.g. the data file), for error messages.
        set_aside: bool (n,) samples in neither split (the test samples under
            ``holdout: validation``); None: none.
        evaluation_split: the evaluation split's name (``federation.holdout``),
            used in ``info`` keys and error messages.

    Returns:
        One :class:`SiteSamples` per site, in site order.

    Raises:
        DataError: a site's split lacks the positives, or the negatives, that
            its ratio needs (the message names the site, the split and the counts).
    """
    labels = np.asarray(labels, dtype=np.int64)
    site_of_sample = np.asarray(site_of_sample, dtype=np.int64)
    in_test = np.asarray(in_test, dtype=bool)
    used = np.ones(len(labels), dtype=bool) if set_aside is None else ~np.asarray(set_aside, dtype=bool)
    splits = ("train", evaluation_split)
    kept: dict[str, list[np.ndarray]] = {}
    for number, split in enumerate(splits):
        pool = np.flatnonzero((in_test == (split == evaluation_split)) & used)
        if label_ratio is None:
            kept[split] = [pool[site_of_sample[pool] == site] for site in range(n_sites)]
            continue
        try:
            partition = partition_by_label_ratio(
                labels[pool],
                n_sites=n_sites,
                delta=label_ratio.delta,
                spread=label_ratio.spread,
                seed=int(np.random.SeedSequence([seed, number]).generate_state(1)[0]),
                site_of_sample=site_of_sample[pool],
            )
        except ValueError as error:
            raise DataError(
                f"{source}: cannot impose federation.label_ratio (delta {label_ratio.delta}, spread "
                f"{label_ratio.spread}) on the {split} split: {error}"
            ) from None
        kept[split] = [pool[indices] for indices in partition.site_indices]

    targets = None if label_ratio is None else site_ratios(label_ratio.delta, n_sites, label_ratio.spread)
    sites = []
    for site in range(n_sites):
        info: dict[str, Any] = {"target_ratio": None if targets is None else float(targets[site])}
        for split in splits:
            n_positive = int(labels[kept[split][site]].sum())
            n_negative = len(kept[split][site]) - n_positive
            info[f"n_{split}_positive"] = n_positive
            info[f"n_{split}_negative"] = n_negative
            info[f"{split}_ratio"] = n_negative / n_positive if n_positive else None
        sites.append(SiteSamples(train=kept["train"][site], test=kept[evaluation_split][site], info=info))
    return sites
