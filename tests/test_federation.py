from dataclasses import dataclass

import numpy as np
import pytest

from medfed.config import FederationConfig
from medfed.data.cache import key_settings
from medfed.data.federation import (
    KEEP_PURPOSE,
    Placement,
    assign_subjects_to_sites,
    min_subjects_per_site,
    partition_site_counts,
    place_subjects,
    site_counts,
    site_seed,
    split_site,
    split_sites,
    split_subjects,
)
from medfed.errors import ConfigError, DataError

SUBJECTS = [f"case{i:03d}" for i in range(23)]


def test_seeded_assignment_covers_every_subject_once():
    sites = assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=5), seed=3)
    flat = [s for site in sites for s in site]
    assert sorted(flat) == SUBJECTS and len(flat) == len(set(flat))
    assert [len(s) for s in sites] == [5, 5, 5, 4, 4]
    assert sites == assign_subjects_to_sites(list(reversed(SUBJECTS)), FederationConfig(n_sites=5), seed=3)  # order of input irrelevant
    assert sites != assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=5), seed=4)


def test_partition_file_places_subjects():
    partition = {s: (10 if i < 8 else 20) for i, s in enumerate(SUBJECTS)}
    sites = assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=2), seed=0, partition=partition)
    assert sites[0] == SUBJECTS[:8] and sites[1] == SUBJECTS[8:]
    with pytest.raises(ConfigError, match="2 partitions"):
        assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=3), seed=0, partition=partition)
    with pytest.raises(DataError, match="does not place"):
        assign_subjects_to_sites(SUBJECTS + ["stray"], FederationConfig(n_sites=2), seed=0, partition=partition)


def test_split_is_disjoint_seeded_and_80_20():
    train, test = split_subjects(SUBJECTS[:10], 0.2, seed=1)
    assert set(train).isdisjoint(test) and sorted(train + test) == SUBJECTS[:10]
    assert len(test) == 2
    assert (train, test) == split_subjects(SUBJECTS[:10], 0.2, seed=1)
    assert any(split_subjects(SUBJECTS[:10], 0.2, seed=s)[1] != test for s in range(2, 6))
    # tiny sites still get one case on each side
    assert [len(part) for part in split_subjects(SUBJECTS[:2], 0.2, seed=0)] == [1, 1]
    with pytest.raises(DataError, match="at least 2"):
        split_subjects(SUBJECTS[:1], 0.2, seed=0)


def _recording_draw(calls):
    """A SplitDraw that records its seeds and draws the last ``round(fraction * n)`` subjects."""

    def draw(subjects, fraction, seed_of):
        calls.append((list(subjects), fraction, seed_of(0), seed_of(1)))
        n = max(1, round(fraction * len(subjects)))
        return list(subjects[:-n]), list(subjects[-n:])

    return draw


def test_split_site_on_test_draws_once_with_the_historic_seeds():
    calls = []
    split = split_site(SUBJECTS[:10], _recording_draw(calls), FederationConfig(test_fraction=0.2), seed=4, site_index=2)
    assert calls == [(SUBJECTS[:10], 0.2, site_seed(4, 2, 1), site_seed(4, 2, 2))]
    assert (split.train, split.evaluation, split.set_aside) == (SUBJECTS[:8], SUBJECTS[8:10], [])
    assert split.info("cases") == {"train_cases": SUBJECTS[:8], "test_cases": SUBJECTS[8:10]}


def test_split_site_on_validation_sets_test_aside_and_draws_again_with_seeds_of_its_own():
    calls = []
    federation = FederationConfig(test_fraction=0.2, holdout="validation", validation_fraction=0.25)
    split = split_site(SUBJECTS[:10], _recording_draw(calls), federation, seed=4, site_index=2)
    assert calls[1][:2] == (SUBJECTS[:8], 0.25)  # the second draw sees only the training subjects
    seeds = {seed for call in calls for seed in call[2:]}
    assert len(seeds) == 4  # test and validation strata all draw with distinct seeds
    assert (split.train, split.evaluation, split.set_aside) == (SUBJECTS[:6], SUBJECTS[6:8], SUBJECTS[8:10])
    assert split.info("series") == {
        "train_series": SUBJECTS[:6], "validation_series": SUBJECTS[6:8], "test_series": SUBJECTS[8:10]
    }
    split_site(SUBJECTS[:10], _recording_draw(calls), federation, seed=4, site_index=3)
    assert calls[3][2] not in seeds  # another site, other seeds


def test_too_few_training_subjects_for_validation_say_so():
    federation = FederationConfig(holdout="validation", validation_fraction=0.2)
    draw = lambda subjects, fraction, seed_of: split_subjects(list(subjects), fraction, seed_of(0))  # noqa: E731
    with pytest.raises(DataError, match="validation_fraction=0.2 splits site1's training subjects again: .*at least 2"):
        split_site(SUBJECTS[:2], draw, federation, seed=0, site_index=1)


def test_equal_site_sizes_deal_round_robin_as_before():
    order = np.random.default_rng(3).permutation(len(SUBJECTS))
    shuffled = [sorted(SUBJECTS)[i] for i in order]
    historic = [sorted(shuffled[i::5]) for i in range(5)]  # the dealing before site_sizes existed
    assert assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=5), seed=3) == historic
    assert site_counts(23, FederationConfig(n_sites=5), seed=3) is None


def test_weighted_site_sizes_by_largest_remainder():
    # 23 * [2, 2, 3, 4, 5] / 16 = 2.875, 2.875, 4.3125, 5.75, 7.1875: floors 2, 2, 4, 5, 7 (20), +1 to the three largest remainders
    federation = FederationConfig(n_sites=5, site_sizes=[2, 2, 3, 4, 5])
    assert site_counts(23, federation, seed=0) == [3, 3, 4, 6, 7]
    sites = assign_subjects_to_sites(SUBJECTS, federation, seed=1)
    assert [len(site) for site in sites] == [3, 3, 4, 6, 7]
    assert sorted(s for site in sites for s in site) == SUBJECTS
    assert sites == assign_subjects_to_sites(SUBJECTS, federation, seed=1)
    assert sites != assign_subjects_to_sites(SUBJECTS, federation, seed=2)


def test_skewed_site_sizes_follow_zipf_over_seeded_ranks_above_the_minimum():
    # 5 sites of >= 2 subjects, the 90 spare ones by r ** -1.5: 51.12, 18.07, 9.84, 6.39, 4.57 -> 51, 18, 10, 6, 5
    federation = FederationConfig(n_sites=5, site_sizes="skewed")
    counts = {seed: site_counts(100, federation, seed) for seed in range(4)}
    for seed, sizes in counts.items():
        assert sorted(sizes, reverse=True) == [53, 20, 12, 8, 7]
        assert sizes == site_counts(100, federation, seed)
    assert len({tuple(sizes) for sizes in counts.values()}) > 1  # the seed decides which site is large
    assert min(site_counts(10, federation, seed=0)) == 2  # every site keeps what its split needs


def test_minimum_per_site_is_what_the_test_and_validation_draws_need():
    assert min_subjects_per_site(FederationConfig(test_fraction=0.2)) == 2
    assert min_subjects_per_site(FederationConfig(test_fraction=0.2, validation_fraction=0.2)) == 3  # 1 test, 1 validation, 1 train
    assert min_subjects_per_site(FederationConfig(test_fraction=0.5, validation_fraction=0.2)) == 4  # 3 subjects: 2 test, 1 left


@pytest.mark.parametrize(
    "keys, n_subjects, message",
    [
        # 12 * [2, 2, 3, 4, 5] / 16 = 1.5, 1.5, 2.25, 3, 3.75: the tie of remainders .5 goes to site0, so site1 keeps 1
        ({"site_sizes": [2, 2, 3, 4, 5]}, 12, r"'federation\.site_sizes' = \[2\.0, 2\.0, 3\.0, 4\.0, 5\.0\]: site1 would get 1 of the 12"),
        ({"site_sizes": "skewed", "validation_fraction": 0.2}, 14, r"'federation\.site_sizes' = 'skewed': 5 sites of at least 3 .* need 15, only 14"),
    ],
)
def test_site_sizes_the_subjects_cannot_meet_are_config_errors_naming_the_key(keys, n_subjects, message):
    with pytest.raises(ConfigError, match=message) as caught:
        assign_subjects_to_sites(SUBJECTS[:n_subjects], FederationConfig(n_sites=5, **keys), seed=0)
    assert "\n" not in str(caught.value)


PARTITIONED = [f"case{i:03d}" for i in range(40)]
EQUAL_PARTITION = {subject: 10 + i // 8 for i, subject in enumerate(PARTITIONED)}  # 5 partitions of 8, ids 10..14


def test_equal_site_sizes_keep_every_partition_whole_as_before():
    placement = place_subjects(PARTITIONED, FederationConfig(n_sites=5), seed=3, partition=EQUAL_PARTITION)
    assert placement == Placement([PARTITIONED[8 * k:8 * k + 8] for k in range(5)])  # partition_sizes None: nothing drawn
    assert placement.summary(FederationConfig(n_sites=5), 3, "cases") == {"setting": "equal", "n_cases": [8] * 5}


def test_weighted_sizes_cut_a_partitions_sites_to_seeded_subsets():
    federation = FederationConfig(n_sites=5, site_sizes=[1, 2, 3, 4, 5])
    # the largest T whose largest-remainder shares fit 8 per site: T = 25, 25 * [1..5] / 15 = 1.67, 3.33, 5, 6.67, 8.33
    # -> floors 1, 3, 5, 6, 8, +1 to the two largest remainders (.67 at site0 and site3): 2, 3, 5, 7, 8 (T = 26 would give site4 9)
    assert partition_site_counts([8] * 5, federation, seed=0) == [2, 3, 5, 7, 8] == site_counts(25, federation, seed=0)
    placement = place_subjects(PARTITIONED, federation, seed=0, partition=EQUAL_PARTITION)
    assert [len(site) for site in placement.sites] == [2, 3, 5, 7, 8] and placement.partition_sizes == [8] * 5
    for k, site in enumerate(placement.sites):
        assert site == sorted(site) and set(site) <= set(PARTITIONED[8 * k:8 * k + 8])  # a subset of the site's own partition
    assert placement.sites[4] == PARTITIONED[32:40]  # the largest weight keeps its whole partition
    again = place_subjects(list(reversed(PARTITIONED)), federation, seed=0, partition=EQUAL_PARTITION)
    assert again == placement  # same seed, same subjects (whatever the input order)
    other = place_subjects(PARTITIONED, federation, seed=1, partition=EQUAL_PARTITION)
    assert [len(site) for site in other.sites] == [2, 3, 5, 7, 8] and other.sites[:4] != placement.sites[:4]  # another draw
    assert assign_subjects_to_sites(PARTITIONED, federation, seed=0, partition=EQUAL_PARTITION) == placement.sites
    # the draw of site k: the first sizes[k] of a permutation seeded by (seed, k, KEEP_PURPOSE)
    order = np.random.default_rng(site_seed(0, 1, KEEP_PURPOSE)).permutation(8)
    assert placement.sites[1] == sorted(PARTITIONED[8 + i] for i in order[:3])


def test_sizes_are_relative_to_the_largest_the_partitions_allow_not_to_each_partition():
    uneven = {f"s{i:02d}": 0 if i < 20 else 1 if i < 26 else 2 for i in range(36)}  # partitions of 20, 6 and 10 subjects
    subjects = sorted(uneven)
    placement = place_subjects(subjects, FederationConfig(n_sites=3, site_sizes=[1, 1, 1]), seed=0, partition=uneven)
    # equal weights: a shuffle's shares of T = 19 (20 would give the 6-subject site 7): sizes differ by at most one
    assert [len(site) for site in placement.sites] == [7, 6, 6] == site_counts(19, FederationConfig(n_sites=3, site_sizes=[1, 1, 1]), 0)
    assert placement.sites[1] == subjects[20:26]  # the binding site keeps its whole partition, the others a draw
    assert partition_site_counts([20, 6, 10], FederationConfig(n_sites=3, site_sizes=[4, 1, 1]), seed=0) == [20, 5, 5]


def test_skewed_sizes_of_a_partition_are_the_shuffles_skewed_sizes_that_fit():
    federation = FederationConfig(n_sites=5, site_sizes="skewed", validation_fraction=0.2)  # every site at least 3
    draws = {}
    for seed in range(6):
        counts = partition_site_counts([12] * 5, federation, seed)
        assert counts == site_counts(sum(counts), federation, seed)  # the same Zipf sizes over the same seeded ranks
        assert sorted(counts, reverse=True) == [12, 6, 5, 4, 4] and min(counts) >= min_subjects_per_site(federation)
        draws[seed] = counts
    assert len({tuple(counts) for counts in draws.values()}) > 1  # the seed decides which site is large
    twelve = {f"c{i:02d}": i // 12 for i in range(60)}
    placement = place_subjects(sorted(twelve), federation, seed=0, partition=twelve)
    largest = int(np.argmax(draws[0]))
    assert placement.sites[largest] == sorted(c for c, p in twelve.items() if p == largest)
    summary = placement.summary(federation, 0, "cases")
    assert summary == {
        "setting": "skewed", "n_cases": draws[0], "n_cases_in_partition": [12] * 5, "seed": 0, "kept_cases": placement.sites,
    }


@pytest.mark.parametrize(
    "sizes, available, message",
    [
        ([1, 1, 1, 1, 4], [8] * 5, r"^config key 'federation\.site_sizes' = \[1\.0, 1\.0, 1\.0, 1\.0, 4\.0\]: site0 would keep 2 of the 8 cases "
         r"its partition holds \(sizes \[2, 2, 2, 2, 8\] of the partitions' \[8, 8, 8, 8, 8\]\), fewer than the 3 its splits need; "),
        ("skewed", [8, 8, 2, 8, 8], r"^config key 'federation\.site_sizes' = 'skewed': site2 would keep 2 of the 2 cases its partition holds "),
    ],
)
def test_a_partitions_site_cut_below_its_splits_needs_is_a_config_error_naming_the_key(sizes, available, message):
    federation = FederationConfig(n_sites=5, site_sizes=sizes, validation_fraction=0.2)
    partition = {f"c{i:02d}": k for k, n in enumerate(available) for i in range(10 * k, 10 * k + n)}
    with pytest.raises(ConfigError, match=message) as caught:
        place_subjects(sorted(partition), federation, seed=0, partition=partition, noun="cases")
    assert "\n" not in str(caught.value)


def test_a_stratified_draw_too_small_for_a_cut_partition_site_names_site_sizes_not_the_file():
    def draw_needing_four(subjects, fraction, seed_of):
        if len(subjects) < 4:
            raise DataError(f"{len(subjects)} subjects, a stratified draw needs 4")
        return split_subjects(list(subjects), fraction, seed_of(0))

    federation = FederationConfig(n_sites=5, site_sizes=[1, 2, 3, 4, 5])
    sites = assign_subjects_to_sites(PARTITIONED, federation, seed=0, partition=EQUAL_PARTITION)  # 2, 3, 5, 7, 8
    with pytest.raises(ConfigError, match=r"^config key 'federation\.site_sizes' = \[1\.0, .*\]: site0 gets 2 of the 25 cases, too few: 2 subjects"):
        split_sites(sites, draw_needing_four, federation, seed=0, noun="cases", partition_file="sites.csv")


def test_the_cache_key_holds_the_subjects_a_cut_partition_kept_and_nothing_new_otherwise():
    @dataclass
    class Options:
        patch_size: int = 32

    plain = FederationConfig(n_sites=5)
    whole = place_subjects(PARTITIONED, plain, seed=0, partition=EQUAL_PARTITION)
    assert key_settings(Options(), plain, 0, placement=whole) == key_settings(Options(), plain, 0)  # equal: the key as before
    skewed = FederationConfig(n_sites=5, site_sizes="skewed")
    cut = place_subjects(PARTITIONED, skewed, seed=0, partition=EQUAL_PARTITION)
    assert key_settings(Options(), skewed, 0, placement=cut)["kept_subjects"] == cut.sites


def test_a_stratified_draw_too_small_for_a_weighted_site_names_site_sizes():
    def draw_needing_four(subjects, fraction, seed_of):
        if len(subjects) < 4:
            raise DataError(f"{len(subjects)} subjects, a stratified draw needs 4")
        return split_subjects(list(subjects), fraction, seed_of(0))

    federation = FederationConfig(n_sites=2, site_sizes=[1, 5])
    sites = assign_subjects_to_sites(SUBJECTS[:18], federation, seed=0)  # 3 and 15 subjects
    with pytest.raises(ConfigError, match=r"'federation\.site_sizes' = \[1\.0, 5\.0\]: site0 gets 3 of the 18 cases, too few: 3 subjects"):
        split_sites(sites, draw_needing_four, federation, seed=0, noun="cases", partition_file=None)


def test_a_validation_split_beside_test_is_carved_from_training_never_from_test_and_seeded():
    draw = lambda subjects, fraction, seed_of: split_subjects(list(subjects), fraction, seed_of(0))  # noqa: E731
    plain = FederationConfig(test_fraction=0.2)
    validated = FederationConfig(test_fraction=0.2, validation_fraction=0.25)
    for seed in range(20):
        without = split_site(SUBJECTS[:20], draw, plain, seed=seed, site_index=1)
        split = split_site(SUBJECTS[:20], draw, validated, seed=seed, site_index=1)
        assert split.holdout == "test" and split.set_aside == [] and without.validation == ()
        assert split.evaluation == without.evaluation  # the same test split, drawn first with the same seeds
        assert set(split.validation).isdisjoint(split.evaluation) and set(split.validation).isdisjoint(split.train)
        assert sorted([*split.train, *split.validation]) == without.train
        assert (len(split.evaluation), len(split.validation)) == (4, 4)  # round(0.2 * 20), round(0.25 * 16)
        assert split.info("cases") == {
            "train_cases": split.train, "test_cases": split.evaluation, "validation_cases": split.validation
        }
        assert split == split_site(SUBJECTS[:20], draw, validated, seed=seed, site_index=1)
    validations = {tuple(split_site(SUBJECTS[:20], draw, validated, seed=s, site_index=1).validation) for s in range(5)}
    assert len(validations) > 1
