import numpy as np
import pytest

from medfed.data.federation import assign_subjects_to_sites, split_subjects
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
