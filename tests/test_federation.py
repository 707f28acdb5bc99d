import numpy as np
import pytest

from medfed.config import FederationConfig
from medfed.data.federation import assign_subjects_to_sites, site_seed, split_site, split_subjects
from medfed.errors import ConfigError, DataError

SUBJECTS = [f"case{i:03d}" for i in range(23)]


def test_seeded_assignment_covers_every_subject_once():
    sites = assign_subjects_to_sites(SUBJECTS, 5, seed=3)
    flat = [s for site in sites for s in site]
    assert sorted(flat) == SUBJECTS and len(flat) == len(set(flat))
    assert [len(s) for s in sites] == [5, 5, 5, 4, 4]
    assert sites == assign_subjects_to_sites(list(reversed(SUBJECTS)), 5, seed=3)  # order of input irrelevant
    assert sites != assign_subjects_to_sites(SUBJECTS, 5, seed=4)


def test_partition_file_places_subjects():
    partition = {s: (10 if i < 8 else 20) for i, s in enumerate(SUBJECTS)}
    sites = assign_subjects_to_sites(SUBJECTS, 2, seed=0, partition=partition)
    assert sites[0] == SUBJECTS[:8] and sites[1] == SUBJECTS[8:]
    with pytest.raises(ConfigError, match="2 partitions"):
        assign_subjects_to_sites(SUBJECTS, 3, seed=0, partition=partition)
    with pytest.raises(DataError, match="does not place"):
        assign_subjects_to_sites(SUBJECTS + ["stray"], 2, seed=0, partition=partition)


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
    federation = FederationConfig(holdout="validation")
    draw = lambda subjects, fraction, seed_of: split_subjects(list(subjects), fraction, seed_of(0))  # noqa: E731
    with pytest.raises(DataError, match="holdout=validation splits site1's training subjects again: .*at least 2"):
        split_site(SUBJECTS[:2], draw, federation, seed=0, site_index=1)
