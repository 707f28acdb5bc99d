"""A federation: the data of each hospital site, split into train and test.

Task builders (``medfed.tasks``) turn a data set into a :class:`Federation`
with the helpers here: subjects (patients, CT series) are placed at sites
either from a FeTS-style partition file or by a seeded shuffle, and each
site's subjects are split train/test by a seeded draw *per site*, so no
patient contributes to both splits. The split is recorded in ``SiteData.info``
and ends up in the run's ``results.json``.

How many subjects each site gets is ``federation.site_sizes``
(:func:`site_counts`): equal shares dealt round robin (the default), given
relative weights, or a seeded skewed draw. The counts go into the summary.

Where a partition file places the subjects (a FeTS ``partitioning.csv``, or
the generated data sets' one partition per simulated scanner), ``equal``
keeps every partition whole, as it is. Any other setting cuts the
partitions' sites down to sizes that follow it (:func:`partition_site_counts`):
the sites keep the sizes :func:`site_counts` gives a shuffle of T subjects,
for the largest T at which no site needs more subjects than its partition
holds. The sizes are thus relative to the largest the partitions allow, not
to each partition's own size: the site that binds keeps its whole partition
(for equal partitions, the largest weight's site), every other site k keeps
about T w_k / sum(w) subjects, and ``skewed`` means what it means for a
shuffle (every site the minimum its splits need, the rest by Zipf weights
over seeded ranks). Each site keeps a seeded draw of its partition's
subjects (:func:`keep_subjects`: the run's seed, the site's index and
:data:`KEEP_PURPOSE`); a size below what the site's train/test (and
validation) split needs is a ConfigError naming ``federation.site_sizes``,
raised while the federation is planned, before any volume is read. The
partition sizes, the seed and the subjects each site kept go into the
summary (:meth:`Placement.summary`).

With ``federation.validation_fraction`` > 0 (:func:`split_site`) each site's
training subjects are split once more, by the task's own draw with seeds of
their own, into train and validation. With ``federation.holdout: test`` the
validation split is kept beside the test split (``SiteData.validation``,
evaluated every round by :class:`~medfed.evaluation.rounds.ValidationEvaluation`);
with ``federation.holdout: validation`` the test subjects are set aside and
the validation split takes the place of the test split for the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from torch.utils.data import TensorDataset

from medfed.config import FederationConfig
from medfed.errors import ConfigError, DataError


@dataclass
class SiteData:
    """One site's data.

    Attributes:
        name: display name (``site0``, ``site1``, ...).
        train: ``TensorDataset`` of ``(x, y)`` training samples; a subclass
            that draws fresh samples every epoch (BraTS ``random_crops``,
            :class:`~medfed.data.crops.RandomCrops`) brings a ``sampler`` of
            its own and keeps a fixed reference set in ``tensors``.
        test: ``TensorDataset`` of ``(x, y)`` samples the run evaluates on:
            the test split, or the validation split with ``holdout: validation``.
        validation: ``TensorDataset`` of the site's validation split beside
            its test split (``holdout: test`` with ``validation_fraction`` > 0),
            prepared exactly as ``test``; None without one.
        info: JSON-serialisable facts about the site (subjects per split,
            missing channel, label ratio ...), written to results.json.
        train_volumes: the training volumes kept in memory to draw fresh
            samples from (plain tensors, cached with the patches); None for
            a fixed training set.
    """

    name: str
    train: TensorDataset
    test: TensorDataset
    info: dict[str, Any] = field(default_factory=dict)
    train_volumes: list[dict[str, Any]] | None = None
    validation: TensorDataset | None = None


class VolumeSource(Protocol):
    """A site's evaluation volumes, read on demand (whole-volume evaluation, :mod:`medfed.evaluation.volume`)."""

    def site_volumes(self, site: int) -> Iterator[EvaluationVolume]:
        """The volumes of site ``site``'s evaluation split (test, or validation), in case order."""
        ...

    def n_volumes(self, site: int) -> int:
        """How many volumes :meth:`site_volumes` yields for site ``site`` (without reading them)."""
        ...


@dataclass(frozen=True)
class EvaluationVolume:
    """One patient's whole volume, prepared exactly as the site's training patches were.

    Attributes:
        case_id: the patient.
        image: float32 ``(C, X, Y, Z)``, normalised (and a missing channel zeroed) as in training.
        label: ``(X, Y, Z)`` integer class labels (e.g. :class:`~medfed.data.brats.TumourLabel`).
        spacing_mm: voxel size along X, Y, Z.
    """

    case_id: str
    image: np.ndarray
    label: np.ndarray
    spacing_mm: tuple[float, float, float]


@dataclass
class Federation:
    """All sites of one task.

    Attributes:
        task: task name (``brats``, ``luna16``, ``clinical``).
        sites: the sites, in index order.
        input_shape: shape of one sample ``x`` (e.g. ``(4, 64, 64)``).
        num_classes: number of target classes.
        description: one line saying what the data are; generated data say
            so ("GENERATED ...") so every table built from it is labelled.
        generated: whether the data were generated by medfed.
        holdout: the split in ``SiteData.test`` and so in every metric:
            ``"test"`` or ``"validation"`` (``federation.holdout``).
        features: JSON-serialisable account of how a tabular task made its
            input features from the data (names, encoding); None for images.
        cache: where the preprocessed tensors came from
            (:mod:`medfed.data.cache`): ``{"key", "file", "hit"}``, ``hit``
            True when they were read from the cache file; None when the task
            was built without the cache.
        volumes: the whole evaluation volumes of each site, for tasks whose
            samples are cut from volumes (:class:`VolumeSource`); None otherwise.
            Not cached: the volumes are read when evaluated.
        site_sizes: how subjects were dealt to sites (:func:`site_sizes_summary`):
            the ``federation.site_sizes`` setting and each site's subject count;
            None when a task does not record it.
    """

    task: str
    sites: list[SiteData]
    input_shape: tuple[int, ...]
    num_classes: int
    description: str
    generated: bool
    holdout: str = "test"
    features: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None
    volumes: VolumeSource | None = None
    site_sizes: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable description for results.json (``n_validation`` per site where a validation split sits beside the test split)."""
        return {
            "task": self.task,
            "description": self.description,
            "generated": self.generated,
            "holdout": self.holdout,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "features": self.features,
            "cache": self.cache,
            "site_sizes": self.site_sizes,
            "sites": [
                {
                    "name": s.name,
                    "n_train": len(s.train),
                    f"n_{self.holdout}": len(s.test),
                    **({} if s.validation is None else {"n_validation": len(s.validation)}),
                    **s.info,
                }
                for s in self.sites
            ],
        }


@dataclass(frozen=True)
class Placement:
    """Subjects placed at sites (:func:`place_subjects`).

    Attributes:
        sites: each site's subjects (those it keeps), sorted, in site order.
        partition_sizes: where a partition file placed the subjects and
            ``federation.site_sizes`` cut its sites down, how many subjects
            each site's partition holds (each site kept a seeded draw of
            them); None otherwise (every placed subject is kept).
    """

    sites: list[list[str]]
    partition_sizes: list[int] | None = None

    def summary(self, federation: FederationConfig, seed: int, noun: str) -> dict[str, Any]:
        """:func:`site_sizes_summary` of the sites' sizes; for a cut partition also ``n_<noun>_in_partition``,
        the ``seed`` of the draw and the ``kept_<noun>`` of every site."""
        summary = site_sizes_summary(federation, [len(site) for site in self.sites], noun)
        if self.partition_sizes is not None:
            summary.update({f"n_{noun}_in_partition": list(self.partition_sizes), "seed": seed, f"kept_{noun}": self.sites})
        return summary


def assign_subjects_to_sites(
    subjects: list[str], federation: FederationConfig, seed: int, partition: dict[str, int] | None = None
) -> list[list[str]]:
    """Each site's subjects: :attr:`Placement.sites` of :func:`place_subjects`."""
    return place_subjects(subjects, federation, seed, partition).sites


def place_subjects(
    subjects: list[str], federation: FederationConfig, seed: int, partition: dict[str, int] | None = None, noun: str = "subjects"
) -> Placement:
    """Place subjects at sites.

    Args:
        subjects: subject ids (case ids, series uids).
        federation: its ``n_sites`` and ``site_sizes``: without a partition
            the sizes of the shuffled sites (:func:`site_of_positions`); with
            one, ``equal`` keeps every partition whole and any other setting
            keeps :func:`partition_site_counts` subjects of each.
        seed: seeds the shuffle used when there is no partition, and with one
            the draw of the subjects each site keeps (:func:`keep_subjects`).
        partition: ``{subject: partition_id}`` from a partition file; its
            distinct ids, sorted, become sites 0..P-1 (P must equal n_sites).
        noun: what the subjects are (``"cases"``, ``"series"``), for messages.

    Raises:
        ConfigError: P != n_sites, fewer subjects than sites, or site sizes
            the subjects (or the partitions) cannot meet.
        DataError: a subject missing from the partition.
    """
    n_sites = federation.n_sites
    if partition is not None:
        sites = _partition_sites(subjects, federation, partition)
        if federation.site_sizes == "equal":
            return Placement(sites)
        available = [len(site) for site in sites]
        counts = partition_site_counts(available, federation, seed, noun)
        return Placement([keep_subjects(site, count, seed, index) for index, (site, count) in enumerate(zip(sites, counts))], available)
    if len(subjects) < n_sites:
        raise ConfigError(f"config key 'federation.n_sites' = {n_sites}: only {len(subjects)} subjects to share out")
    order = np.random.default_rng(seed).permutation(len(subjects))
    ordered = sorted(subjects)
    site_of = site_of_positions(len(subjects), federation, seed)
    shuffled: list[list[str]] = [[] for _ in range(n_sites)]
    for position, index in enumerate(order):
        shuffled[site_of[position]].append(ordered[index])
    return Placement([sorted(s) for s in shuffled])


def _partition_sites(subjects: list[str], federation: FederationConfig, partition: dict[str, int]) -> list[list[str]]:
    """Every subject at the site of its partition (partition ids sorted: sites 0..P-1), each site sorted."""
    n_sites = federation.n_sites
    missing = sorted(set(subjects) - set(partition))
    if missing:
        raise DataError(f"partition file does not place {len(missing)} subject(s), e.g. {missing[:3]}")
    ids = sorted({partition[s] for s in subjects})
    if len(ids) != n_sites:
        raise ConfigError(
            f"config key 'federation.n_sites' = {n_sites}: the partition file has {len(ids)} partitions {ids}; set them equal"
        )
    position = {pid: i for i, pid in enumerate(ids)}
    sites: list[list[str]] = [[] for _ in range(n_sites)]
    for subject in subjects:
        sites[position[partition[subject]]].append(subject)
    return [sorted(s) for s in sites]


ZIPF_EXPONENT = 1.5
"""``site_sizes: skewed``: the site of rank r (1 = largest) weighs r ** -ZIPF_EXPONENT."""

SKEW_PURPOSE = 7
"""Seeds (with the run's seed) the draw of which site gets which rank under ``site_sizes: skewed``."""


def site_of_positions(n_subjects: int, federation: FederationConfig, seed: int) -> np.ndarray:
    """The site of each position of a seeded shuffle of ``n_subjects`` subjects.

    ``equal``: position p goes to site p mod n_sites (round robin: the sizes
    differ by at most one). Otherwise site k gets the k-th run of
    :func:`site_counts` consecutive positions.

    Returns:
        int64 ``(n_subjects,)`` site indices.
    """
    counts = site_counts(n_subjects, federation, seed)
    if counts is None:
        return np.arange(n_subjects, dtype=np.int64) % federation.n_sites
    return np.repeat(np.arange(federation.n_sites, dtype=np.int64), counts)


def site_counts(n_subjects: int, federation: FederationConfig, seed: int) -> list[int] | None:
    """How many of ``n_subjects`` shuffled subjects each site gets (``federation.site_sizes``); None for ``equal``.

    Every site needs at least m = :func:`min_subjects_per_site` subjects.

    * weights w_k: site k gets n w_k / sum(w), rounded by largest remainder
      (the counts sum to n; ties go to the lower site index).
    * ``skewed``: each site gets m, and the n - S m others are shared by
      Zipf weights r ** -1.5 over the ranks r = 1..S, ranks drawn at random
      (seeded by ``seed``) to sites, again by largest remainder: for 5 sites
      the shares of the spare subjects are 57, 20, 11, 7 and 5%, for 10 sites
      the two largest hold 68% of them.

    Raises:
        ConfigError: naming ``federation.site_sizes``: a weighted site below m,
            or fewer than S m subjects for ``skewed``.
    """
    sizes = federation.site_sizes
    if sizes == "equal":
        return None
    n_sites, minimum = federation.n_sites, min_subjects_per_site(federation)
    key = f"config key 'federation.site_sizes' = {sizes!r}"
    counts = _shares(n_subjects, federation, _size_weights(federation, seed), minimum)
    if counts is None:
        raise ConfigError(
            f"{key}: {n_sites} sites of at least {minimum} subjects (what each site's splits need) "
            f"need {n_sites * minimum}, only {n_subjects} found"
        )
    small = np.flatnonzero(counts < minimum)
    if len(small):
        site = int(small[0])
        raise ConfigError(
            f"{key}: site{site} would get {counts[site]} of the {n_subjects} subjects, "
            f"fewer than the {minimum} its splits need; raise its weight"
        )
    return counts.tolist()


def partition_site_counts(available: Sequence[int], federation: FederationConfig, seed: int, noun: str = "subjects") -> list[int]:
    """How many of its partition's ``available[k]`` subjects site k keeps under ``federation.site_sizes`` (not ``equal``).

    The sizes :func:`site_counts` gives a shuffle of T subjects (the same
    weights, or the same skewed ranks for ``seed``), for the largest T at
    which every site's size is at most its partition's: the sizes follow the
    setting, as large as the partitions allow.

    Raises:
        ConfigError: naming ``federation.site_sizes``, when a site would keep
            fewer than :func:`min_subjects_per_site` subjects (``skewed``: a
            partition holds fewer than that).
    """
    key = f"config key 'federation.site_sizes' = {federation.site_sizes!r}"
    minimum, weights = min_subjects_per_site(federation), _size_weights(federation, seed)
    room = np.asarray(available, dtype=np.int64)
    for total in range(int(room.sum()), 0, -1):
        counts = _shares(total, federation, weights, minimum)
        if counts is not None and np.all(counts <= room):
            break
    else:  # skewed: some partition cannot give every site the minimum
        counts = np.minimum(room, minimum)
    small = np.flatnonzero(counts < minimum)
    if len(small):
        site = int(small[0])
        raise ConfigError(
            f"{key}: site{site} would keep {counts[site]} of the {room[site]} {noun} its partition holds "
            f"(sizes {counts.tolist()} of the partitions' {room.tolist()}), fewer than the {minimum} its splits need; "
            f"raise its weight or give every partition more {noun}"
        )
    return counts.tolist()


def _size_weights(federation: FederationConfig, seed: int) -> np.ndarray:
    """float64 (n_sites,) relative site sizes: the given weights, or for ``skewed`` r ** -ZIPF_EXPONENT over seeded ranks r."""
    if federation.site_sizes == "skewed":
        ranks = np.random.default_rng(np.random.SeedSequence([seed, SKEW_PURPOSE])).permutation(federation.n_sites) + 1
        return ranks ** -ZIPF_EXPONENT
    return np.asarray(federation.site_sizes, dtype=np.float64)


def _shares(n_subjects: int, federation: FederationConfig, weights: np.ndarray, minimum: int) -> np.ndarray | None:
    """int64 site sizes summing to ``n_subjects``: by ``weights`` (largest remainder); ``skewed``: ``minimum``
    each and the spare subjects by ``weights``, None when there are fewer than n_sites * minimum."""
    if federation.site_sizes != "skewed":
        return _largest_remainder(n_subjects, weights)
    spare = n_subjects - federation.n_sites * minimum
    return None if spare < 0 else minimum + _largest_remainder(spare, weights)


KEEP_PURPOSE = 201
"""``site_seed`` purpose of the draw of the subjects a site keeps of its partition (after :data:`SPLIT_PURPOSES`' 1..200)."""


def keep_subjects(subjects: Sequence[str], count: int, seed: int, site_index: int) -> list[str]:
    """A seeded draw of ``count`` of a site's sorted ``subjects`` (seed: ``site_seed(seed, site_index, KEEP_PURPOSE)``), sorted."""
    order = np.random.default_rng(site_seed(seed, site_index, KEEP_PURPOSE)).permutation(len(subjects))
    return sorted(subjects[i] for i in order[:count])


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """int64 counts summing to ``total``, proportional to ``weights``: floors, then +1 to the largest remainders (ties: lower index)."""
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts


def min_subjects_per_site(federation: FederationConfig) -> int:
    """Fewest subjects a site needs so that its test draw, and its validation draw if any, leave at least one on each side.

    Counted for an unstratified draw (:func:`split_subjects`); a stratified
    task may need more, and says so, naming the key, when it splits.
    """
    n = 2
    while federation.validation_fraction > 0 and n - n_drawn(n, federation.test_fraction) < 2:
        n += 1
    return n


def refuse_site_sizes(federation: FederationConfig, placed_by: str) -> None:
    """ConfigError naming ``federation.site_sizes`` unless it is ``equal``: ``placed_by`` already decides the sites (a site column)."""
    if federation.site_sizes != "equal":
        raise ConfigError(
            f"config key 'federation.site_sizes' = {federation.site_sizes!r}: {placed_by}; "
            "site sizes apply only when subjects are shuffled onto sites or placed by a partition file (set it to equal)"
        )


def site_too_small(federation: FederationConfig, site: str, error: DataError) -> ConfigError:
    """The error naming ``federation.site_sizes`` for a site it sized (``site`` says which and its size) too small for its draws."""
    return ConfigError(f"config key 'federation.site_sizes' = {federation.site_sizes!r}: {site}, too few: {error}")


def site_sizes_summary(federation: FederationConfig, counts: Sequence[int], noun: str) -> dict[str, Any]:
    """``{"setting": federation.site_sizes, "n_<noun>": counts}`` (subjects placed at each site) for :attr:`Federation.site_sizes`."""
    return {"setting": federation.site_sizes, f"n_{noun}": [int(count) for count in counts]}


def n_drawn(n: int, fraction: float) -> int:
    """Subjects a draw of ``fraction`` of ``n`` takes: round(fraction n), at least 1 and at most n - 1."""
    return min(max(1, round(fraction * n)), n - 1)


def split_subjects(subjects: list[str], test_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded train/test split of one site's subjects (at least one in each).

    Returns:
        ``(train_subjects, test_subjects)``, each sorted.
    """
    if len(subjects) < 2:
        raise DataError(f"a site needs at least 2 subjects for a train/test split, got {subjects}")
    n_test = n_drawn(len(subjects), test_fraction)
    order = np.random.default_rng(seed).permutation(len(subjects))
    ordered = sorted(subjects)
    test = sorted(ordered[i] for i in order[:n_test])
    train = sorted(ordered[i] for i in order[n_test:])
    return train, test


def site_seed(seed: int, site_index: int, purpose: int) -> int:
    """A distinct, reproducible seed for one site and one purpose (split, sampling, ...)."""
    return int(np.random.SeedSequence([seed, site_index, purpose]).generate_state(1)[0])


SPLIT_PURPOSES = {"test": 1, "validation": 101}
"""``site_seed`` purpose of the first stratum of each draw; stratum k draws with purpose + k (k < 100)."""

SplitDraw = Callable[[Sequence[Any], float, Callable[[int], int]], tuple[Sequence[Any], Sequence[Any]]]
"""A task's seeded split ``draw(subjects, fraction, seed_of) -> (kept, drawn)``.

``drawn`` holds about ``fraction`` of ``subjects`` (stratified as the task
stratifies), ``kept`` the rest; ``seed_of(k)`` is the seed of stratum k."""


@dataclass(frozen=True)
class SiteSplit:
    """One site's subjects by role.

    Attributes:
        holdout: ``"test"`` or ``"validation"``, the split the run evaluates on.
        train: the training subjects.
        evaluation: the subjects the run evaluates on (test or validation).
        set_aside: with ``holdout: validation``, the test subjects, never used;
            empty otherwise.
        validation: with ``holdout: test`` and a validation fraction, the
            validation subjects beside the test split; empty otherwise.
    """

    holdout: str
    train: Sequence[Any]
    evaluation: Sequence[Any]
    set_aside: Sequence[Any]
    validation: Sequence[Any] = ()

    @property
    def n_subjects(self) -> int:
        """All the site's subjects, in whichever role."""
        return len(self.train) + len(self.evaluation) + len(self.set_aside) + len(self.validation)

    def info(self, noun: str) -> dict[str, list[Any]]:
        """``{"train_<noun>", "<holdout>_<noun>"}`` and the ``"validation_<noun>"`` beside it, or with a validation
        holdout the set-aside ``"test_<noun>"``."""
        info = {f"train_{noun}": list(self.train), f"{self.holdout}_{noun}": list(self.evaluation)}
        if self.holdout == "validation":
            info[f"test_{noun}"] = list(self.set_aside)
        elif len(self.validation):
            info[f"validation_{noun}"] = list(self.validation)
        return info


def split_site(
    subjects: Sequence[Any], draw: SplitDraw, federation: FederationConfig, seed: int, site_index: int
) -> SiteSplit:
    """Split one site's subjects into train, the split the run evaluates on, and a validation split.

    The test split is drawn first, the same way for either holdout. With a
    ``validation_fraction`` > 0 the remaining subjects are drawn again by the
    same ``draw`` (so by subject and with the task's stratification) with
    seeds of their own into train and validation: never a test subject in
    it. With ``holdout == "validation"`` the test split is then set aside and
    the validation split is evaluated instead; with ``"test"`` it stays
    beside the test split (:attr:`SiteSplit.validation`).

    Args:
        subjects: the site's subjects (case ids, series uids, record positions).
        draw: the task's seeded split (:data:`SplitDraw`).
        federation: its ``holdout``, ``test_fraction`` (share of the subjects
            drawn for test) and ``validation_fraction`` (share of the
            remaining, training subjects drawn for validation; 0: none).
        seed: the run's seed.
        site_index: the site's index (each site draws with its own seeds).

    Raises:
        DataError: from ``draw`` (e.g. too few subjects); for the validation
            draw the message says so.
    """

    def seed_of(split: str) -> Callable[[int], int]:
        return lambda stratum: site_seed(seed, site_index, SPLIT_PURPOSES[split] + stratum)

    train, test = draw(subjects, federation.test_fraction, seed_of("test"))
    if federation.validation_fraction == 0.0:  # (holdout: validation has a fraction > 0)
        return SiteSplit("test", train, test, set_aside=[])
    try:
        train, validation = draw(train, federation.validation_fraction, seed_of("validation"))
    except DataError as error:
        raise DataError(
            f"federation.validation_fraction={federation.validation_fraction:g} splits site{site_index}'s training subjects again: {error}"
        ) from None
    if federation.holdout == "validation":
        return SiteSplit("validation", train, validation, set_aside=test)
    return SiteSplit("test", train, test, set_aside=[], validation=validation)


def split_sites(
    site_subjects: Sequence[Sequence[Any]],
    draw: SplitDraw,
    federation: FederationConfig,
    seed: int,
    *,
    noun: str,
    partition_file: Path | None,
) -> list[SiteSplit]:
    """:func:`split_site` for every site: the whole split plan, checked before any data is read.

    Args:
        site_subjects: each site's subjects, from :func:`assign_subjects_to_sites`.
        draw, federation, seed: as for :func:`split_site`.
        noun: what the subjects are (``"cases"``, ``"series"``), for messages.
        partition_file: the partition file that placed the subjects, or None
            when they were shuffled onto ``federation.n_sites`` sites.

    Raises:
        ConfigError: when a site is too small for its draws: naming
            ``federation.site_sizes`` when that is not ``equal`` (a shuffled
            site, or a partition's site cut down), else for a shuffled site
            ``federation.n_sites``, and how many subjects were found.
        DataError: naming the partition file, when one of its whole partitions is.
    """
    n_found = sum(len(subjects) for subjects in site_subjects)
    splits = []
    for index, subjects in enumerate(site_subjects):
        try:
            splits.append(split_site(subjects, draw, federation, seed, index))
        except DataError as error:
            site = f"site{index} gets {len(subjects)} of the {n_found} {noun}"
            if federation.site_sizes != "equal":  # the setting chose the size, also of a partition's site
                raise site_too_small(federation, site, error) from None
            if partition_file is not None:
                raise DataError(f"{partition_file}: {site}, too few: {error}") from None
            raise ConfigError(
                f"config key 'federation.n_sites' = {federation.n_sites}: too many sites for the {n_found} {noun} found "
                f"({site}): {error}"
            ) from None
    return splits
