"""A deployed site builds its own member from its own data alone (clinical records, BraTS cases, LUNA16 series): the simulator's member, tensor for tensor."""

import shutil

import pytest
import torch

from medfed.config import FederationConfig, MissingChannelConfig
from medfed.data.brats import find_cases
from medfed.data.luna16 import find_series, read_candidates_csv
from medfed.errors import ConfigError
from medfed.tasks import brats, clinical, luna16


@pytest.mark.parametrize("holdout,validation_fraction", [("test", 0.0), ("test", 0.25), ("validation", 0.25)])
def test_a_site_built_from_its_own_records_is_the_simulators_member(tmp_path, holdout, validation_fraction):
    options = clinical.Options(csv=str(tmp_path / "all" / "breast_cancer.csv"))
    federation = FederationConfig(n_sites=3, holdout=holdout, validation_fraction=validation_fraction)
    whole = clinical.build_federation(options, federation, seed=4)
    files = clinical.site_records(options, federation, 4, tmp_path / "sites")
    assert [f.parent.name for f in files] == ["site0", "site1", "site2"]
    assert sum(len(f.read_text().splitlines()) - 1 for f in files) == 569  # every record at exactly one site
    for index, simulated in enumerate(whole.sites):
        alone = clinical.build_site(options, federation, 4, index, files[index].parent)
        assert len(alone.sites) == 1 and alone.sites[0].name == simulated.name
        assert alone.input_shape == whole.input_shape
        assert (alone.sites[0].validation is None) == (simulated.validation is None)
        for split in ("train", "test", "validation")[: 2 if simulated.validation is None else 3]:
            mine, theirs = getattr(alone.sites[0], split).tensors, getattr(simulated, split).tensors
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (index, split)


def test_a_label_ratio_cannot_be_imposed_by_one_site(tmp_path):
    options = clinical.Options(csv=str(tmp_path / "breast_cancer.csv"))
    federation = FederationConfig(n_sites=3, label_ratio={"delta": 1.0, "spread": 1.5})
    with pytest.raises(ConfigError, match="federation.label_ratio"):
        clinical.build_site(options, federation, 0, 0, tmp_path)


@pytest.mark.parametrize("regions", ["wt", "brats"])
def test_a_brats_site_built_from_its_own_cases_is_the_simulators_member(tmp_path, tiny_brats_root, regions):
    options = brats.Options(
        root=str(tiny_brats_root), generate=None, patch_size=32, tumour_patches_per_case=4, background_patches_per_case=2,
        cache=False,
    )
    federation = FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=1, sites=[2]))
    whole = brats.build_federation(options, federation, seed=0, progress=False, regions=regions)
    folders = brats.site_cases(options, federation, 0, tmp_path / "sites", progress=False)
    assert [folder.name for folder in folders] == ["site0", "site1", "site2"]
    found = [sorted(case.case_id for case in find_cases(folder)) for folder in folders]
    assert sorted(sum(found, [])) == sorted(case.case_id for case in find_cases(tiny_brats_root))  # each case at one site
    for index, simulated in enumerate(whole.sites):
        alone = brats.build_site(options, federation, 0, index, folders[index], progress=False, regions=regions)
        assert len(alone.sites) == 1 and alone.sites[0].name == simulated.name
        assert (alone.input_shape, alone.num_classes) == (whole.input_shape, whole.num_classes)
        assert alone.sites[0].info == simulated.info
        for split in ("train", "test"):
            mine, theirs = getattr(alone.sites[0], split).tensors, getattr(simulated, split).tensors
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (index, split)
    assert float(alone.sites[0].train.tensors[0][:, 1].abs().sum()) == 0  # site 2 lacks channel 1, as in the simulator


@pytest.mark.parametrize(
    "holdout,validation_fraction,max_negatives,partitioned",
    [("test", 0.0, None, True), ("test", 0.25, 5, True), ("validation", 0.25, 5, False)],
)
def test_a_luna16_site_built_from_its_own_series_is_the_simulators_member(
    tmp_path, tiny_luna_root, holdout, validation_fraction, max_negatives, partitioned
):
    root = tiny_luna_root
    if not partitioned:  # series shuffled onto the sites by the run's seed
        root = shutil.copytree(tiny_luna_root, tmp_path / "luna16", ignore=shutil.ignore_patterns("partitioning.csv"))
    options = luna16.Options(root=str(root), generate=None, max_negatives_per_series=max_negatives, cache=False)
    federation = FederationConfig(n_sites=3, label_ratio=None, holdout=holdout, validation_fraction=validation_fraction)
    whole = luna16.build_federation(options, federation, seed=3, progress=False)
    folders = luna16.site_series(options, federation, 3, tmp_path / "sites", progress=False)
    assert [folder.name for folder in folders] == ["site0", "site1", "site2"]
    found = [sorted(find_series(folder)) for folder in folders]
    assert sorted(sum(found, [])) == sorted(find_series(root))  # each series at one site, in the LUNA16 layout
    for folder, series in zip(folders, found):  # the site's candidate and nodule rows, and only those
        for table in ("candidates_V2.csv", "annotations.csv"):
            uids = {line.split(",")[0] for line in (folder / table).read_text().splitlines()[1:]}
            assert uids == set(series), table
    rows = sum(len(read_candidates_csv(folder / "candidates_V2.csv")) for folder in folders)
    assert rows == len(read_candidates_csv(root / "candidates_V2.csv"))
    for index, simulated in enumerate(whole.sites):
        alone = luna16.build_site(options, federation, 3, index, folders[index], progress=False)
        assert len(alone.sites) == 1 and alone.sites[0].name == simulated.name
        assert (alone.input_shape, alone.num_classes) == (whole.input_shape, whole.num_classes)
        assert alone.sites[0].info == simulated.info
        assert (alone.sites[0].validation is None) == (simulated.validation is None)
        for split in ("train", "test", "validation")[: 2 if simulated.validation is None else 3]:
            mine, theirs = getattr(alone.sites[0], split).tensors, getattr(simulated, split).tensors
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (index, split)


def test_a_luna16_site_refuses_a_label_ratio(tmp_path):
    federation = FederationConfig(n_sites=3, label_ratio={"delta": 1.0, "spread": 1.5})
    with pytest.raises(ConfigError, match="federation.label_ratio"):
        luna16.build_site(luna16.Options(generate=None), federation, 0, 0, tmp_path)
