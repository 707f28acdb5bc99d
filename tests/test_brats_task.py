"""The BraTS federation: "lack k" channel dropping, patient-level seeded splits, patch targets, checks before reading."""

import shutil

import nibabel as nib
import numpy as np
import pytest
import torch

from medfed.config import FederationConfig, MissingChannelConfig
from medfed.data.brats import find_cases
from medfed.data.partition_csv import read_partition_csv, write_partition_csv
from medfed.errors import ConfigError, DataError
from medfed.tasks import brats

from brats_files import write_msd
from holdout_checks import assert_validation_carved_from_training, validation_subjects


def _options(root):
    return brats.Options(root=str(root), generate=None, patch_size=32, tumour_patches_per_case=4, background_patches_per_case=2)


@pytest.mark.parametrize("channel", [0, 3])
def test_channel_k_is_zero_exactly_at_the_configured_sites(tiny_brats_root, channel):
    federation = brats.build_federation(
        _options(tiny_brats_root),
        FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=channel, sites=[1])),
        seed=0,
        progress=False,
    )
    for index, site in enumerate(federation.sites):
        for split in (site.train, site.test):
            x = split.tensors[0]
            assert x.shape[1:] == (4, 32, 32)
            if index == 1:
                assert torch.count_nonzero(x[:, channel]) == 0
            else:
                assert torch.count_nonzero(x[:, channel]) > 0
            others = [c for c in range(4) if c != channel]
            assert all(torch.count_nonzero(x[:, c]) > 0 for c in others)
    assert [s.info["missing_channel"] for s in federation.sites] == [None, brats.MODALITIES[channel], None]


def test_default_missing_sites_are_the_last_ones_and_bad_channels_are_named(tiny_brats_root):
    federation = brats.build_federation(
        _options(tiny_brats_root), FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=2, n_sites_missing=2)), seed=0, progress=False
    )
    assert [s.info["missing_channel"] for s in federation.sites] == [None, "t1ce", "t1ce"]
    with pytest.raises(ConfigError, match="federation.missing_channel.channel"):
        brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=4)), seed=0, progress=False)


def test_splits_are_by_case_seeded_and_targets_are_whole_tumour(tiny_brats_root):
    def build(seed):
        return brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3), seed=seed, progress=False)

    first, again, other = build(0), build(0), build(7)
    for a, b in zip(first.sites, again.sites):
        assert a.info == b.info and torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert any(a.info["test_cases"] != c.info["test_cases"] for a, c in zip(first.sites, other.sites))
    for site in first.sites:
        assert set(site.info["train_cases"]).isdisjoint(site.info["test_cases"])
        assert len(site.train) == 6 * len(site.info["train_cases"]) and len(site.test) == 6 * len(site.info["test_cases"])
        y = site.train.tensors[1]
        assert set(torch.unique(y).tolist()) <= {0, 1}
        tumour_patches = y.flatten(1).any(dim=1)
        assert int(tumour_patches.sum()) == 4 * len(site.info["train_cases"])  # 4 around tumour, 2 tumour-free per case


def test_validation_holdout_splits_training_cases_and_never_reads_test_cases(tiny_brats_root, monkeypatch):
    def build(seed, holdout, validation_fraction=0.5):
        federation = FederationConfig(n_sites=3, holdout=holdout, validation_fraction=validation_fraction if holdout == "validation" else 0.0)
        return brats.build_federation(_options(tiny_brats_root), federation, seed=seed, progress=False)

    on_test = build(0, "test")
    read = []
    real_load_case = brats.load_case
    monkeypatch.setattr(brats, "load_case", lambda case, resample=False: read.append(case.case_id) or real_load_case(case, resample))
    on_validation = build(0, "validation")
    assert_validation_carved_from_training(on_test, on_validation, "cases")
    test_cases = {case for site in on_validation.sites for case in site.info["test_cases"]}
    assert test_cases and test_cases.isdisjoint(read)  # set-aside cases are never read
    for site in on_validation.sites:
        assert len(site.train) == 6 * len(site.info["train_cases"]) and len(site.test) == 6 * len(site.info["validation_cases"])
    assert on_validation.summary()["holdout"] == "validation"
    assert validation_subjects(build(0, "validation"), "cases") == validation_subjects(on_validation, "cases")
    assert any(validation_subjects(build(s, "validation"), "cases") != validation_subjects(on_validation, "cases") for s in (1, 2))


def test_a_validation_split_beside_test_is_carved_from_training_cases_and_keeps_the_test_split(tiny_brats_root):
    def build(**keys):
        return brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3, **keys), seed=0, progress=False)

    plain, validated = build(), build(validation_fraction=0.5)
    summary = validated.summary()
    for a, b, row in zip(plain.sites, validated.sites, summary["sites"]):
        assert a.validation is None and "validation_cases" not in a.info
        assert b.info["test_cases"] == a.info["test_cases"] and torch.equal(a.test.tensors[0], b.test.tensors[0])
        train, validation = set(b.info["train_cases"]), set(b.info["validation_cases"])
        assert train and validation and train.isdisjoint(validation) and train | validation == set(a.info["train_cases"])
        assert len(b.validation) == 6 * len(validation) == row["n_validation"]  # 4 tumour + 2 background patches per case
    assert summary["holdout"] == "test" and "n_test" in summary["sites"][0]


def test_msd_as_downloaded_gives_a_federation_of_its_training_cases_only(tmp_path):
    write_msd(tmp_path, np.random.default_rng(0))  # BRATS_001, BRATS_002 in imagesTr/labelsTr; BRATS_003 in imagesTs
    options = brats.Options(root=str(tmp_path), generate=None, patch_size=8, tumour_patches_per_case=3, background_patches_per_case=0)
    federation = brats.build_federation(options, FederationConfig(n_sites=1), seed=0, progress=False)
    (site,) = federation.sites
    assert sorted(site.info["train_cases"] + site.info["test_cases"]) == ["BRATS_001", "BRATS_002"]
    assert (len(site.train), len(site.test)) == (3, 3)


def copy_without_partition(root, destination):
    return shutil.copytree(root, destination, ignore=shutil.ignore_patterns("partitioning.csv"))


def fail_on_read(case, resample=False):
    raise AssertionError(f"read {case.case_id} before the federation config was checked")


@pytest.mark.parametrize("n_sites, holdout, too_small", [(5, "test", "site4 gets 1 of the 9 cases"), (4, "validation", "site1 gets 2 of the 9 cases")])
def test_too_many_sites_for_the_cases_found_is_a_config_error_before_any_volume_is_read(tiny_brats_root, tmp_path, monkeypatch, n_sites, holdout, too_small):
    root = copy_without_partition(tiny_brats_root, tmp_path / "brats")  # 9 cases shuffled onto sites
    monkeypatch.setattr(brats, "load_case", fail_on_read)
    with pytest.raises(ConfigError) as info:
        federation = FederationConfig(n_sites=n_sites, holdout=holdout, validation_fraction=0.2 if holdout == "validation" else 0.0)
        brats.build_federation(_options(root), federation, seed=0, progress=False)
    message = str(info.value)
    assert message.startswith(f"config key 'federation.n_sites' = {n_sites}: too many sites for the 9 cases found ({too_small}): ")


def test_a_partition_too_small_to_split_names_the_partition_file(tiny_brats_root, tmp_path, monkeypatch):
    cases = sorted(case.case_id for case in find_cases(tiny_brats_root))
    partition = tmp_path / "sites.csv"
    write_partition_csv(partition, {case: 1 if case == cases[0] else 2 for case in cases})
    monkeypatch.setattr(brats, "load_case", fail_on_read)
    options = _options(tiny_brats_root)
    options.partition_csv = str(partition)
    with pytest.raises(DataError, match=rf"^{partition}: site0 gets 1 of the 9 cases, too few: "):
        brats.build_federation(options, FederationConfig(n_sites=2), seed=0, progress=False)
    options.partition_csv = str(tmp_path / "missing.csv")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'missing.csv'}: partition file not found$"):
        brats.build_federation(options, FederationConfig(n_sites=2), seed=0, progress=False)


def erase_tumours(root, case_ids):
    for case in find_cases(root):
        if case.case_id in case_ids:
            image = nib.load(case.label_file)
            nib.save(nib.Nifti1Image(np.zeros(image.shape, dtype=np.uint8), image.affine), case.label_file)


@pytest.mark.parametrize("empty_partitions, site", [({1, 2, 3}, "site0"), ({2}, "site1")], ids=["data-set", "one-site"])
def test_sites_without_any_tumour_voxel_are_named(tiny_brats_root, tmp_path, empty_partitions, site):
    root = shutil.copytree(tiny_brats_root, tmp_path / "brats")
    partition = read_partition_csv(root / "partitioning.csv")
    erase_tumours(root, {case for case, partition_id in partition.items() if partition_id in empty_partitions})
    with pytest.raises(DataError) as info:
        brats.build_federation(_options(root), FederationConfig(n_sites=3), seed=0, progress=False)
    assert str(info.value) == (
        f"{root}: {site}: none of its 3 cases has a tumour voxel (all segmentations are background); "
        "whole-tumour segmentation needs tumour at every site"
    )


def test_region_targets_are_nested_masks_whose_whole_tumour_is_the_wt_target(tiny_brats_root):
    federation_config = FederationConfig(n_sites=3)
    wt = brats.build_federation(_options(tiny_brats_root), federation_config, seed=0, progress=False)
    regions = brats.build_federation(_options(tiny_brats_root), federation_config, seed=0, progress=False, regions="brats")
    assert (wt.num_classes, regions.num_classes) == (2, 3)
    for a, b in zip(wt.sites, regions.sites):
        y = b.train.tensors[1]
        assert y.dtype == torch.uint8 and y.shape == (len(b.train), 3, 32, 32)
        torch.testing.assert_close(a.train.tensors[0], b.train.tensors[0])  # the same patches
        assert torch.equal(y[:, 0].long(), a.train.tensors[1])  # WT channel = the wt target
        assert bool((y[:, 1] <= y[:, 0]).all() and (y[:, 2] <= y[:, 1]).all())  # ET in TC in WT
    assert any(site.train.tensors[1][:, 2].any() for site in regions.sites)  # the phantoms do have enhancing tumour


def test_evaluation_volumes_are_the_evaluation_cases_prepared_like_the_patches(tiny_brats_root):
    federation = brats.build_federation(
        _options(tiny_brats_root), FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=2, sites=[1])), seed=0, progress=False
    )
    for index, site in enumerate(federation.sites):
        volumes = list(federation.volumes.site_volumes(index))
        assert [v.case_id for v in volumes] == site.info["test_cases"]
        for volume in volumes:
            assert volume.image.shape[0] == 4 and volume.image.shape[1:] == volume.label.shape
            assert volume.spacing_mm == pytest.approx((4.0, 4.0, 4.0))
            assert (not volume.image[2].any()) == (index == 1)  # the missing channel is zero there, as in training


def test_site_sizes_cut_the_partitions_sites_to_seeded_subsets_and_read_only_those(tiny_brats_root, monkeypatch):
    partition = read_partition_csv(tiny_brats_root / "partitioning.csv")  # 3 partitions of 3 cases
    own = [sorted(case for case, pid in partition.items() if pid == partition_id) for partition_id in sorted(set(partition.values()))]
    read = []
    real_load_case = brats.load_case
    monkeypatch.setattr(brats, "load_case", lambda case, resample=False: read.append(case.case_id) or real_load_case(case, resample))
    federation = FederationConfig(n_sites=3, site_sizes=[2, 2, 3])  # 7 * [2, 2, 3] / 7: sizes 2, 2, 3 fit the partitions
    built = brats.build_federation(_options(tiny_brats_root), federation, seed=0, progress=False)
    kept = built.site_sizes["kept_cases"]
    assert built.site_sizes == {"setting": [2.0, 2.0, 3.0], "n_cases": [2, 2, 3], "n_cases_in_partition": [3, 3, 3], "seed": 0, "kept_cases": kept}
    assert kept[2] == own[2]  # the largest weight keeps its whole partition
    for site, cases, partition_cases in zip(built.sites, kept, own):
        assert set(cases) <= set(partition_cases)  # a subset of the site's own partition
        assert sorted(site.info["train_cases"] + site.info["test_cases"]) == cases
        assert len(site.train) == 6 * len(site.info["train_cases"])
    assert sorted(read) == sorted(case for cases in kept for case in cases)  # the dropped cases are never read
    assert built.summary()["site_sizes"] == built.site_sizes
    again = brats.build_federation(_options(tiny_brats_root), federation, seed=0, progress=False)
    assert again.site_sizes == built.site_sizes and torch.equal(again.sites[0].train.tensors[0], built.sites[0].train.tensors[0])
    draws = {tuple(map(tuple, brats.build_federation(_options(tiny_brats_root), federation, seed=s, progress=False).site_sizes["kept_cases"])) for s in range(4)}
    assert len(draws) > 1  # another seed, another draw


def test_site_sizes_too_small_for_a_cut_site_are_a_config_error_before_any_volume_is_read(tiny_brats_root, monkeypatch):
    monkeypatch.setattr(brats, "load_case", fail_on_read)
    with pytest.raises(ConfigError) as info:  # [1, 1, 3]: sizes 1, 1, 3 fit 3 cases per site; a split needs 2
        brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3, site_sizes=[1, 1, 3]), seed=0, progress=False)
    assert str(info.value) == (
        "config key 'federation.site_sizes' = [1.0, 1.0, 3.0]: site0 would keep 1 of the 3 cases its partition holds "
        "(sizes [1, 1, 3] of the partitions' [3, 3, 3]), fewer than the 2 its splits need; raise its weight or give every partition more cases"
    )


def test_equal_site_sizes_keep_the_generated_partitions_whole(tiny_brats_root):
    built = brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3), seed=0, progress=False)
    assert built.site_sizes == {"setting": "equal", "n_cases": [3, 3, 3]}


def test_weights_that_keep_every_case_give_the_equal_federations_tensors(tiny_brats_root):
    equal = brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3), seed=0, progress=False)
    kept_all = brats.build_federation(_options(tiny_brats_root), FederationConfig(n_sites=3, site_sizes=[1, 1, 1]), seed=0, progress=False)
    assert kept_all.site_sizes["n_cases"] == [3, 3, 3] and kept_all.cache["key"] != equal.cache["key"]
    for a, b in zip(equal.sites, kept_all.sites, strict=True):  # the same cases, the same splits and patches as equal
        assert a.info == b.info
        for x, y in zip([*a.train.tensors, *a.test.tensors], [*b.train.tensors, *b.test.tensors], strict=True):
            assert torch.equal(x, y)
