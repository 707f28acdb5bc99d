import math

import numpy as np
import pytest

from medfed.data.label_ratio import partition_by_label_ratio, site_ratios


def imbalanced_labels(n_pos=60, n_neg=400, seed=0):
    labels = np.array([1] * n_pos + [0] * n_neg)
    return np.random.default_rng(seed).permutation(labels)


def test_site_ratios_by_hand():
    np.testing.assert_allclose(
        site_ratios(2.0, 5, 1.5), [2 / 1.5, 2 / math.sqrt(1.5), 2.0, 2 * math.sqrt(1.5), 3.0]
    )
    np.testing.assert_allclose(site_ratios(3.0, 2, 2.0), [1.5, 6.0])
    np.testing.assert_allclose(site_ratios(4.0, 1, 3.0), [4.0])
    np.testing.assert_allclose(site_ratios(4.0, 4, 1.0), [4.0] * 4)


@pytest.mark.parametrize("delta, spread", [(1.0, 1.5), (3.0, 2.0), (7.0, 1.0), (2.5, 1.3)])
def test_realised_ratios_match_targets_and_sites_are_disjoint(delta, spread):
    labels = imbalanced_labels()
    part = partition_by_label_ratio(labels, n_sites=5, delta=delta, spread=spread, seed=3)
    np.testing.assert_allclose(part.target_ratios, site_ratios(delta, 5, spread))
    for indices, n_pos, n_neg, target, realised in zip(
        part.site_indices, part.n_positive, part.n_negative, part.target_ratios, part.realised_ratios
    ):
        assert (labels[indices] == 1).sum() == n_pos and (labels[indices] == 0).sum() == n_neg
        assert abs(n_neg - target * n_pos) <= 0.5  # ratio exact up to rounding one negative
        assert realised == n_neg / n_pos
        assert np.all(np.diff(indices) > 0)
    everything = np.concatenate(part.site_indices)
    assert len(np.unique(everything)) == len(everything)


def test_each_site_keeps_the_largest_subset_its_pool_allows():
    labels = imbalanced_labels(n_pos=23, n_neg=90, seed=1)
    site_of_sample = np.random.default_rng(2).integers(0, 3, size=len(labels))
    part = partition_by_label_ratio(labels, n_sites=3, delta=2.0, spread=2.0, seed=0, site_of_sample=site_of_sample)
    for site, (indices, ratio) in enumerate(zip(part.site_indices, part.target_ratios)):
        assert np.all(site_of_sample[indices] == site)
        pool_pos = int(((site_of_sample == site) & (labels == 1)).sum())
        pool_neg = int(((site_of_sample == site) & (labels == 0)).sum())
        # brute force: the biggest p whose rounded negative count fits the pool
        best = max(p for p in range(pool_pos + 1) if math.floor(ratio * p + 0.5) <= pool_neg)
        assert part.n_positive[site] == best
        assert part.n_negative[site] == math.floor(ratio * best + 0.5)


def test_stratified_assignment_spreads_positives_evenly():
    labels = imbalanced_labels(n_pos=50, n_neg=1000)
    part = partition_by_label_ratio(labels, n_sites=5, delta=1.0, spread=1.0, seed=0)
    np.testing.assert_array_equal(part.n_positive, [10] * 5)  # every site has 10 positives, enough negatives
    np.testing.assert_array_equal(part.n_negative, [10] * 5)


def test_seeded():
    labels = imbalanced_labels()
    first = partition_by_label_ratio(labels, n_sites=4, delta=3.0, seed=7)
    again = partition_by_label_ratio(labels, n_sites=4, delta=3.0, seed=7)
    other = partition_by_label_ratio(labels, n_sites=4, delta=3.0, seed=8)
    for a, b in zip(first.site_indices, again.site_indices):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first.site_indices, other.site_indices))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(delta=0.0, spread=1.5), "delta"),
        (dict(delta=2.0, spread=0.9), "spread must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        partition_by_label_ratio(imbalanced_labels(), n_sites=3, seed=0, **kwargs)


def test_site_without_enough_negatives_says_what_it_has_and_needs():
    labels = np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    sites = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="site 0 has 1 positives and 1 negatives; its ratio 3 needs .* 3 negatives"):
        partition_by_label_ratio(labels, n_sites=2, delta=3.0, spread=1.0, seed=0, site_of_sample=sites)
    sites_no_positive = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="site 1 has 0 positives"):
        partition_by_label_ratio(labels, n_sites=2, delta=1.0, spread=1.0, seed=0, site_of_sample=sites_no_positive)


def test_bad_labels_and_site_ids():
    with pytest.raises(ValueError, match="0 \\(negative\\) and 1"):
        partition_by_label_ratio([0, 2, 1], n_sites=1, delta=1.0, seed=0)
    with pytest.raises(ValueError, match="site ids 0 .. 1"):
        partition_by_label_ratio([0, 1, 1], n_sites=2, delta=1.0, seed=0, site_of_sample=[0, 1, 2])
