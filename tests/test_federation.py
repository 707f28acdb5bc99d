import numpy as np
import pytest

from medfed.config import FederationConfig
from medfed.data.federation import (
    assign_subjects_to_sites,
    min_subjects_per_site,
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


def test_a_partition_file_refuses_site_sizes():
    partition = {s: i % 2 for i, s in enumerate(SUBJECTS)}
    with pytest.raises(ConfigError, match=r"'federation\.site_sizes' = 'skewed': a partition file places the subjects"):
        assign_subjects_to_sites(SUBJECTS, FederationConfig(n_sites=2, site_sizes="skewed"), seed=0, partition=partition)


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
