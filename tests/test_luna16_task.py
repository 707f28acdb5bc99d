import shutil
from functools import partial

import numpy as np
import pytest
import torch

import medfed.data.luna16

from medfed.config import FederationConfig, LabelRatioConfig
from medfed.data.label_ratio import site_ratios
from medfed.data.luna16 import extract_candidate_patches
from medfed.data.partition_csv import read_partition_csv
from medfed.errors import ConfigError, DataError
from medfed.data.federation import split_site
from medfed.tasks.luna16 import Options, _draw_series, _split_series, build_federation

from holdout_checks import assert_validation_carved_from_training, validation_subjects

LABEL_RATIO = LabelRatioConfig(delta=2.0, spread=1.5)


def federation_of(root, seed=0, label_ratio=LABEL_RATIO, n_sites=3):
    options = Options(root=str(root), generate=None)
    return build_federation(options, FederationConfig(n_sites=n_sites, label_ratio=label_ratio), seed, progress=False)


def test_samples_are_single_channel_patches_of_binary_labels(tiny_luna_root):
    federation = federation_of(tiny_luna_root)
    assert federation.task == "luna16" and federation.num_classes == 2 and federation.input_shape == (1, 32, 32)
    assert federation.generated and "GENERATED" in federation.description
    for site in federation.sites:
        for split in (site.train, site.test):
            x, y = split.tensors
            assert x.dtype == torch.float32 and x.shape[1:] == (1, 32, 32) and 0 <= x.min() and x.max() <= 1
            assert y.dtype == torch.int64 and set(y.unique().tolist()) == {0, 1}


def test_every_site_has_its_ratio_in_train_and_in_test(tiny_luna_root):
    federation = federation_of(tiny_luna_root)
    targets = site_ratios(LABEL_RATIO.delta, 3, LABEL_RATIO.spread)
    for site, target in zip(federation.sites, targets):
        assert site.info["target_ratio"] == pytest.approx(target)
        for split_name, split in (("train", site.train), ("test", site.test)):
            y = split.tensors[1]
            n_pos, n_neg = int(y.sum()), int((y == 0).sum())
            assert abs(n_neg - target * n_pos) <= 0.5  # n_neg = round(target * n_pos)
            assert site.info[f"n_{split_name}_positive"] == n_pos and site.info[f"n_{split_name}_negative"] == n_neg
            assert site.info[f"{split_name}_ratio"] == pytest.approx(n_neg / n_pos)


def test_sites_follow_the_partition_and_splits_are_disjoint_by_series(tiny_luna_root):
    federation = federation_of(tiny_luna_root)
    partition = read_partition_csv(tiny_luna_root / "partitioning.csv")
    candidates = extract_candidate_patches(tiny_luna_root, progress=False)
    for index, site in enumerate(federation.sites):
        train_series, test_series = set(site.info["train_series"]), set(site.info["test_series"])
        assert train_series and test_series and train_series.isdisjoint(test_series)
        assert {partition[uid] for uid in train_series | test_series} == {index + 1}  # Partition_ID 1 .. 3
        assert len(test_series) == 1  # round(0.2 * 4 series)
        # every patch of a split comes from that split's series (matched against the reader's own patches)
        for split, series in ((site.train, train_series), (site.test, test_series)):
            allowed = {patch.tobytes() for patch in candidates.patches[np.isin(candidates.series_uids, list(series))]}
            assert all(patch.tobytes() in allowed for patch in split.tensors[0][:, 0].numpy())


def test_seeded(tiny_luna_root):
    first, again, other = federation_of(tiny_luna_root, 0), federation_of(tiny_luna_root, 0), federation_of(tiny_luna_root, 7)
    for a, b in zip(first.sites, again.sites):
        assert a.info == b.info and torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert any(
        a.info != c.info or not torch.equal(a.train.tensors[0], c.train.tensors[0]) for a, c in zip(first.sites, other.sites)
    )


def test_without_a_label_ratio_every_candidate_is_kept(tiny_luna_root):
    federation = federation_of(tiny_luna_root, label_ratio=None)
    candidates = extract_candidate_patches(tiny_luna_root, progress=False)
    assert sum(len(s.train) + len(s.test) for s in federation.sites) == len(candidates)
    assert all(s.info["target_ratio"] is None for s in federation.sites)


def fail_on_read(mhd_path):
    raise AssertionError(f"read {mhd_path} before the federation was planned")


def test_a_ratio_the_test_split_cannot_meet_names_the_split(tiny_luna_root, monkeypatch):
    monkeypatch.setattr(medfed.data.luna16, "_read_axial_image", fail_on_read)
    with pytest.raises(DataError, match="test split"):
        federation_of(tiny_luna_root, label_ratio=LabelRatioConfig(delta=20.0, spread=1.0))


def test_series_split_is_stratified_by_nodule_presence():
    uids = [f"s{i}" for i in range(10)]
    has_nodule = np.array([True] * 5 + [False] * 5)
    train, test = _split_series(uids, has_nodule, 0.2, (3, 4))
    assert sorted(train + test) == uids and set(train).isdisjoint(test)
    assert sum(u in test for u in uids[:5]) == 1 and sum(u in test for u in uids[5:]) == 1
    train, test = _split_series(uids[:3], has_nodule[:3], 0.2, (3, 4))
    assert len(test) == 1
    train, test = _split_series(uids[:3] + ["lone"], np.array([True, True, True, False]), 0.2, (3, 4))
    assert "lone" in train  # a single nodule-free series trains
    with pytest.raises(DataError, match="a site needs at least 2 series with a nodule"):
        _split_series(uids[4:], has_nodule[4:], 0.2, (3, 4))


def test_options_are_checked():
    with pytest.raises(ConfigError, match="patch_size"):
        Options(patch_size=0)
    with pytest.raises(ConfigError, match="max_negatives_per_series"):
        Options(max_negatives_per_series=-1)


def test_validation_holdout_splits_training_series_stratified_and_seeded(tiny_luna_root):
    def build(seed, holdout):
        options = Options(root=str(tiny_luna_root), generate=None)
        federation = FederationConfig(n_sites=3, label_ratio=LABEL_RATIO, holdout=holdout,
                                      validation_fraction=0.2 if holdout == "validation" else 0.0)
        return build_federation(options, federation, seed, progress=False)

    on_test, on_validation = build(0, "test"), build(0, "validation")
    assert_validation_carved_from_training(on_test, on_validation, "series")
    candidates = extract_candidate_patches(tiny_luna_root, progress=False)
    targets = site_ratios(LABEL_RATIO.delta, 3, LABEL_RATIO.spread)
    for site, target in zip(on_validation.sites, targets):
        # every evaluated patch comes from a validation series; none from a set-aside test series
        allowed = {p.tobytes() for p in candidates.patches[np.isin(candidates.series_uids, site.info["validation_series"])]}
        assert all(patch.tobytes() in allowed for patch in site.test.tensors[0][:, 0].numpy())
        # the label ratio is imposed on validation as it is on test, and recorded under its name
        y = site.test.tensors[1]
        n_pos, n_neg = int(y.sum()), int((y == 0).sum())
        assert n_pos >= 1 and abs(n_neg - target * n_pos) <= 0.5
        assert (site.info["n_validation_positive"], site.info["n_validation_negative"]) == (n_pos, n_neg)
        assert "n_test_positive" not in site.info
    assert validation_subjects(build(0, "validation"), "series") == validation_subjects(on_validation, "series")
    assert validation_subjects(build(7, "validation"), "series") != validation_subjects(on_validation, "series")


def test_validation_draw_is_stratified_by_nodule_presence():
    uids = [f"s{i}" for i in range(10)]
    has_nodule = {uid: i < 5 for i, uid in enumerate(uids)}
    federation = FederationConfig(test_fraction=0.2, holdout="validation", validation_fraction=0.25)
    split = split_site(uids, partial(_draw_series, has_nodule=has_nodule), federation, seed=0, site_index=0)
    for subjects in (split.set_aside, split.evaluation):  # test and validation: one series of each stratum
        assert sorted(has_nodule[uid] for uid in subjects) == [False, True]
    assert len(split.train) == 6


@pytest.mark.parametrize("n_sites", [4, 7])
def test_too_many_sites_is_a_config_error_before_any_volume_is_read(tiny_luna_root, tmp_path, monkeypatch, n_sites):
    monkeypatch.setattr(medfed.data.luna16, "_read_axial_image", fail_on_read)
    with pytest.raises(ConfigError, match=rf"^config key 'federation.n_sites' = {n_sites}: the partition file has 3 partitions"):
        federation_of(tiny_luna_root, n_sites=n_sites)
    shuffled = shutil.copytree(tiny_luna_root, tmp_path / "luna16", ignore=shutil.ignore_patterns("partitioning.csv"))
    if n_sites == 7:  # 12 series shuffled onto 7 sites: five sites get 2 series, but site5 and site6 get 1
        with pytest.raises(ConfigError) as info:
            federation_of(shuffled, n_sites=n_sites)
        assert str(info.value) == (
            "config key 'federation.n_sites' = 7: too many sites for the 12 series found (site5 gets 1 of the 12 series): "
            "a site needs at least 2 series with a nodule candidate (one for each split), found 1"
        )


def test_second_build_reads_no_volume_and_gives_the_same_tensors(tiny_luna_root, tmp_path, monkeypatch):
    def build():
        options = Options(root=str(tiny_luna_root), generate=None, cache_dir=str(tmp_path))
        return build_federation(options, FederationConfig(n_sites=3, label_ratio=LABEL_RATIO), 0, progress=False)

    first = build()
    monkeypatch.setattr(medfed.data.luna16, "_read_axial_image", fail_on_read)
    second = build()
    assert (first.cache["hit"], second.cache["hit"]) == (False, True) and first.cache["key"] == second.cache["key"]
    assert first.summary()["sites"] == second.summary()["sites"]
    for a, b in zip(first.sites, second.sites, strict=True):
        assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and torch.equal(a.test.tensors[1], b.test.tensors[1])


def test_a_validation_split_beside_test_keeps_the_test_series_and_gets_the_label_ratio(tiny_luna_root):
    options = Options(root=str(tiny_luna_root), generate=None)
    plain = build_federation(options, FederationConfig(n_sites=3, label_ratio=LABEL_RATIO), 0, progress=False)
    federation = FederationConfig(n_sites=3, label_ratio=LABEL_RATIO, validation_fraction=0.3)
    validated = build_federation(options, federation, 0, progress=False)
    assert validated.summary()["site_sizes"] == {"setting": "equal", "n_series": [4, 4, 4]}
    for a, b, target in zip(plain.sites, validated.sites, site_ratios(LABEL_RATIO.delta, 3, LABEL_RATIO.spread)):
        assert b.info["test_series"] == a.info["test_series"] and torch.equal(a.test.tensors[0], b.test.tensors[0])
        train, validation = set(b.info["train_series"]), set(b.info["validation_series"])
        assert train and validation and train.isdisjoint(validation) and train | validation == set(a.info["train_series"])
        y = b.validation.tensors[1]
        n_pos, n_neg = int(y.sum()), int((y == 0).sum())
        assert n_pos >= 1 and abs(n_neg - target * n_pos) <= 0.5
        assert (b.info["n_validation_positive"], b.info["n_validation_negative"]) == (n_pos, n_neg)


def test_site_sizes_cut_the_partitions_sites_and_drop_the_other_series_candidates(tiny_luna_root, monkeypatch):
    from medfed.data.luna16 import select_candidates

    selection = select_candidates(tiny_luna_root)
    candidates_of = {uid: int((selection.series_uids == uid).sum()) for uid in np.unique(selection.series_uids)}
    partition = read_partition_csv(tiny_luna_root / "partitioning.csv")
    options = Options(root=str(tiny_luna_root), generate=None)
    federation = FederationConfig(n_sites=3, site_sizes=[1, 1, 2], label_ratio=None)  # 8 * [1, 1, 2] / 4: 2, 2, 4 series
    built = build_federation(options, federation, 0, progress=False)
    kept = built.site_sizes["kept_series"]
    assert built.site_sizes["n_series"] == [2, 2, 4] and built.site_sizes["n_series_in_partition"] == [4, 4, 4]
    for index, (site, uids) in enumerate(zip(built.sites, kept)):
        assert {partition[uid] for uid in uids} == {sorted(set(partition.values()))[index]}  # the site's own partition
        assert sorted(site.info["train_series"] + site.info["test_series"]) == uids
        assert len(site.train) + len(site.test) == sum(candidates_of[uid] for uid in uids)  # no candidate of a dropped series
    assert build_federation(options, federation, 0, progress=False).site_sizes == built.site_sizes
    monkeypatch.setattr(medfed.data.luna16, "_read_axial_image", fail_on_read)
    with pytest.raises(ConfigError, match=r"^config key 'federation\.site_sizes' = \[1\.0, 1\.0, 4\.0\]: site0 would keep 1 of the 4 series"):
        build_federation(options, FederationConfig(n_sites=3, site_sizes=[1, 1, 4]), 0, progress=False)
