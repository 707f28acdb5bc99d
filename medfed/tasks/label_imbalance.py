"""Label-imbalance federations: every site's train and test split at the site's own label ratio.

The classification tasks (LUNA16, clinical) evaluate personalisation under
label imbalance delta = n_negative / n_positive (pFedNet, section VI-A). The
task first places its samples at sites and splits each site's samples into
train and test (by CT series, by record: the task's business); this module
then imposes the ratio on *each split separately*, so a site is tested on the
same class mix it trains on and "every site's ratio as specified" holds in
train and in test alike. With ``federation.holdout: validation`` the
validation split is treated exactly as the test split would be, and the
set-aside test samples are in neither pool; a validation split beside the
test split (``holdout: test``, ``validation_fraction`` > 0) is a third split
at the same ratio.

Site s gets the target delta_s = delta * spread ** ((s - c) / c), c = (S - 1) / 2
(:func:`medfed.data.label_ratio.site_ratios`; ``federation.label_ratio``), and
keeps, within each split, the largest subset of its samples with
n_negative = round(delta_s * n_positive) (:func:`partition_by_label_ratio`),
drawn at random with a seed per split. Without ``federation.label_ratio`` every
sample is kept (the data set's natural ratios).

A ratio far from a site's own ratio drops many of its samples: delta_s = 2 at
a site with 6% positives keeps all its positives and twice as many negatives,
18% of its samples. The samples kept and dropped per site and split go into
``info`` and one log line per run, and every site that loses more than half of
its samples is named in a warning (:func:`medfed.errors.warn`) that says which
config key to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from medfed.config import FederationConfig, LabelRatioConfig
from medfed.data.label_ratio import partition_by_label_ratio, site_ratios
from medfed.errors import ConfigError, DataError, warn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SiteSamples:
    """The samples one site keeps.

    Attributes:
        train: int64 (n_train,), sorted indices of the site's training samples.
        test: int64 (n_test,), sorted indices of the samples it is evaluated on
            (its test split, or its validation split).
        validation: int64 (n_validation,), sorted indices of its validation
            split beside the test split; None without one.
        info: JSON-serialisable counts and ratios: ``target_ratio`` (delta_s,
            None without a label ratio) and, for each split (``train`` and the
            evaluation split's name), ``n_<split>_positive``,
            ``n_<split>_negative``, ``<split>_ratio`` (realised n_neg / n_pos)
            and ``n_<split>_dropped`` (the split's samples at the site that
            the ratio left out; 0 without a label ratio).
    """

    train: np.ndarray
    test: np.ndarray
    info: dict[str, Any]
    validation: np.ndarray | None = None


def refuse_label_ratio(federation: FederationConfig) -> None:
    """ConfigError naming ``federation.label_ratio`` unless it is null: a deployed site (:mod:`medfed.deploy`) cannot impose it.

    The draw runs over every site's samples at once (:func:`sites_at_label_ratio`),
    which no site built from its own data alone holds.
    """
    if federation.label_ratio is not None:
        raise ConfigError(
            "config key 'federation.label_ratio': its draw runs over every site's samples at once, which a deployed "
            "site does not hold; set federation.label_ratio=null (each hospital keeps its own ratio)"
        )


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
    noun: str = "samples",
    in_validation: np.ndarray | None = None,
) -> list[SiteSamples]:
    """Impose each site's label ratio on its train split, on the split it is evaluated on and on a validation split.

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
        noun: what the samples are, plural (``records``), for the log line and the warning.
        in_validation: bool (n,) samples of the site's validation split beside
            its test split (``holdout: test``); None: no such split. Its draw
            has a seed of its own, so the other splits draw as without it.

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
    member = {evaluation_split: in_test & used}
    splits: tuple[str, ...] = ("train", evaluation_split)
    if in_validation is not None:
        member["validation"] = np.asarray(in_validation, dtype=bool) & used
        splits += ("validation",)
    member["train"] = used & ~np.any([member[split] for split in splits[1:]], axis=0)
    pools, kept = _draw_splits(labels, site_of_sample, member, splits, n_sites, label_ratio, seed, source)

    targets = None if label_ratio is None else site_ratios(label_ratio.delta, n_sites, label_ratio.spread)
    sites = []
    for site in range(n_sites):
        info: dict[str, Any] = {"target_ratio": None if targets is None else float(targets[site])}
        for split in splits:
            info.update(_split_counts(split, labels[kept[split][site]], int((site_of_sample[pools[split]] == site).sum())))
        validation = kept["validation"][site] if in_validation is not None else None
        sites.append(SiteSamples(train=kept["train"][site], test=kept[evaluation_split][site], info=info, validation=validation))
    if label_ratio is not None:
        _report_drops(sites, site_of_sample[used], labels[used], splits, label_ratio, noun)
    return sites


def _draw_splits(
    labels: np.ndarray, site_of_sample: np.ndarray, member: dict[str, np.ndarray], splits: tuple[str, ...], n_sites: int,
    label_ratio: LabelRatioConfig | None, seed: int, source: str,
) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """Each split's pool (the indices of its members) and each site's kept indices of it: the split's samples at
    that site, or (with ``label_ratio``) a draw at the site's ratio, seeded per split (:func:`sites_at_label_ratio`)."""
    pools: dict[str, np.ndarray] = {}
    kept: dict[str, list[np.ndarray]] = {}
    for number, split in enumerate(splits):  # the seed's stream number: train 0, evaluation 1, validation 2
        pool = pools[split] = np.flatnonzero(member[split])
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
    return pools, kept


def _split_counts(split: str, kept_labels: np.ndarray, available: int) -> dict[str, Any]:
    """A site's ``info`` entries of one split: positives and negatives kept (``kept_labels``, 0/1), their ratio
    negatives / positives (None without positives), and how many of the ``available`` samples were dropped."""
    n_positive = int(kept_labels.sum())
    n_negative = len(kept_labels) - n_positive
    return {
        f"n_{split}_positive": n_positive,
        f"n_{split}_negative": n_negative,
        f"{split}_ratio": n_negative / n_positive if n_positive else None,
        f"n_{split}_dropped": available - len(kept_labels),
    }


def _report_drops(
    sites: list[SiteSamples],
    site_of_sample: np.ndarray,
    labels: np.ndarray,
    splits: tuple[str, ...],
    label_ratio: LabelRatioConfig,
    noun: str,
) -> None:
    """Log the samples each site kept per split; warn naming every site that lost more than ``label_ratio.max_drop`` of its samples.

    Args:
        sites: the sites' kept samples, ``info`` holding ``n_<split>_dropped``.
        site_of_sample, labels: site and 0/1 label of every sample in either split (set-aside ones excluded).
        splits: ``("train", <evaluation split>)``, and ``"validation"`` when the sites have one beside it.
        label_ratio: the imposed delta and spread, for the messages.
        noun: what the samples are, plural.
    """
    setting = f"federation.label_ratio (delta {label_ratio.delta:g}, spread {label_ratio.spread:g})"
    kept = [[len(site.train), len(site.test), *([] if site.validation is None else [len(site.validation)])] for site in sites]
    dropped = [[site.info[f"n_{split}_dropped"] for split in splits] for site in sites]
    per_site = "; ".join(
        f"site{index} " + ", ".join(f"{split} {k} of {k + d}" for split, k, d in zip(splits, counts, lost))
        for index, (counts, lost) in enumerate(zip(kept, dropped))
    )
    n_kept, n_dropped = sum(map(sum, kept)), sum(map(sum, dropped))
    logger.info(f"{setting} kept {n_kept} of {n_kept + n_dropped} {noun}: {per_site}")
    losers = []
    for index in range(len(sites)):
        if sum(dropped[index]) > label_ratio.max_drop * (sum(dropped[index]) + sum(kept[index])):
            n_positive = int(labels[site_of_sample == index].sum())
            n_negative = int((site_of_sample == index).sum()) - n_positive
            own_ratio = n_negative / n_positive if n_positive else float("inf")
            losers.append(
                f"site{index} ({sum(dropped[index])} of {sum(dropped[index]) + sum(kept[index])} dropped, "
                f"its own ratio {own_ratio:.3g})"
            )
    if losers:
        share = "half" if label_ratio.max_drop == 0.5 else f"{label_ratio.max_drop:.0%}"
        warn(
            f"{setting} drops more than {share} of the {noun} of {', '.join(losers)}: set federation.label_ratio.delta "
            f"nearer the sites' own ratios, federation.label_ratio=null to keep all {noun}, or "
            f"federation.label_ratio.max_drop above the share dropped if it is what you mean"
        )
