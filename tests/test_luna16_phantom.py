import json
import re

import numpy as np
import pytest
import SimpleITK as sitk
from scipy import ndimage

from medfed.data.luna16 import (
    extract_candidate_patches,
    find_series,
    read_annotations_csv,
    read_candidates_csv,
    world_to_voxel,
)
from medfed.data.partition_csv import read_partition_csv
from medfed.data.phantoms.luna16 import LUNG_HU_SPREAD, LUNG_TEXTURE_HU, TISSUE_HU, generate_luna16_phantoms
from medfed.errors import DataError

TINY = dict(
    n_sites=3,
    series_per_site=2,
    matrix_size=64,
    z_extent_mm=20.0,
    nodules_per_series=(2, 3),
    nodule_diameter_mm=(3.0, 6.0),
    negatives_per_series=12,
    progress=False,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = generate_luna16_phantoms(tmp_path_factory.mktemp("phantom") / "luna16", seed=5, **TINY)
    return root, json.loads((root / "GENERATED.json").read_text())


def all_files(root):
    return {p.relative_to(root): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_marker_and_partition(tiny):
    root, marker = tiny
    assert "GENERATED" in marker["notice"] and "not patient scans" in marker["notice"]
    assert marker["generated"] is True and marker["description"].startswith("GENERATED")
    assert marker["parameters"]["seed"] == 5 and marker["parameters"]["matrix_size"] == 64
    series = find_series(root)
    partition = read_partition_csv(root / "partitioning.csv")
    assert set(partition) == set(series) and len(series) == 6
    assert sorted(partition.values()) == [1, 1, 2, 2, 3, 3]
    assert all(re.fullmatch(r"2\.25\.[1-9]\d*", uid) for uid in series)
    assert {path.parent.name for path in series.values()} == {f"subset{k}" for k in range(6)}
    for site in marker["sites"]:
        assert site["n_series"] == 2 and site["n_nodules"] >= 4


def test_candidates_lie_inside_their_volumes_and_match_annotations(tiny):
    root, _ = tiny
    series = find_series(root)
    candidates = read_candidates_csv(root / "candidates_V2.csv")
    annotations = read_annotations_csv(root / "annotations.csv")
    assert candidates.labels.sum() == len(annotations)
    for uid, path in series.items():
        image = sitk.ReadImage(str(path))
        assert image.GetPixelID() == sitk.sitkInt16
        mine = candidates.series_uids == uid
        index = np.rint(world_to_voxel(candidates.world_mm[mine], image.GetOrigin(), image.GetSpacing(),
                                       image.GetDirection()))
        assert np.all(index >= 0) and np.all(index < np.array(image.GetSize()))
        labels = candidates.labels[mine]
        assert 0 < labels.sum() < (labels == 0).sum()  # both classes, more negatives
        # each positive candidate sits within 1 mm of one of this series' annotated nodules
        nodules = annotations.world_mm[annotations.series_uids == uid]
        positives = candidates.world_mm[mine][labels == 1]
        distances = np.linalg.norm(positives[:, None, :] - nodules[None, :, :], axis=2)
        assert np.all(distances.min(axis=1) <= 1.0 + 1e-9)


def test_nodules_are_brighter_than_parenchyma_at_candidate_centres(tiny):
    root, marker = tiny
    partition = read_partition_csv(root / "partitioning.csv")
    data = extract_candidate_patches(root, progress=False)
    offsets = np.array([marker["sites"][partition[uid] - 1]["hu_offset"] for uid in data.series_uids])
    centre_hu = data.patches[:, 15:18, 15:18].mean(axis=(1, 2)) * 1400 - 1000 - offsets
    brightest_parenchyma = TISSUE_HU["lung"] + LUNG_HU_SPREAD + LUNG_TEXTURE_HU
    assert np.all(centre_hu[data.labels == 1] > brightest_parenchyma + 50)


def soft_tissue_noise_estimate(volume):
    """Robust noise sd (up to one constant, the noise correlation) from x-differences inside the
    homogeneous soft tissue (45 HU: chest wall, heart, aorta), away from its edges."""
    smooth = ndimage.uniform_filter(volume.astype(np.float64), size=(1, 7, 7))
    soft_tissue = (smooth > -20) & (smooth < 110)
    differences = np.diff(volume.astype(np.float64), axis=2)[soft_tissue[:, :, 1:] & soft_tissue[:, :, :-1]]
    return 1.4826 * np.median(np.abs(differences - np.median(differences)))


def test_sites_differ_in_noise_and_slice_thickness(tiny):
    root, marker = tiny
    series = find_series(root)
    partition = read_partition_csv(root / "partitioning.csv")
    measured, recorded = [], []
    for site in marker["sites"]:
        estimates = []
        for uid in (u for u, s in partition.items() if s == site["site"]):
            image = sitk.ReadImage(str(series[uid]))
            assert image.GetSpacing()[2] == pytest.approx(site["slice_thickness_mm"])
            estimates.append(soft_tissue_noise_estimate(sitk.GetArrayFromImage(image)))
        measured.append(np.mean(estimates))
        recorded.append(site["noise_sd_hu"])
    measured, recorded = np.array(measured), np.array(recorded)
    assert len(set(recorded)) == len(recorded)
    np.testing.assert_array_equal(np.argsort(measured), np.argsort(recorded))
    ratio = measured / recorded  # one constant (the noise correlation) for every site
    assert ratio.max() / ratio.min() < 1.25


def test_deterministic_and_seeded(tmp_path, tiny):
    root, _ = tiny
    again = generate_luna16_phantoms(tmp_path / "again", seed=5, **TINY)
    first_files, second_files = all_files(root), all_files(again)
    assert first_files.keys() == second_files.keys()
    for name in first_files:
        assert first_files[name].read_bytes() == second_files[name].read_bytes(), name
    other = generate_luna16_phantoms(tmp_path / "other", seed=6, **TINY)
    assert (other / "candidates_V2.csv").read_text() != (root / "candidates_V2.csv").read_text()


def test_cached_when_parameters_match_and_rewritten_when_not(tmp_path):
    root = generate_luna16_phantoms(tmp_path / "data", seed=1, **TINY)
    mtimes = {name: path.stat().st_mtime_ns for name, path in all_files(root).items()}
    generate_luna16_phantoms(root, seed=1, **TINY)
    assert {name: path.stat().st_mtime_ns for name, path in all_files(root).items()} == mtimes

    generate_luna16_phantoms(root, seed=1, **{**TINY, "negatives_per_series": 20})
    marker = json.loads((root / "GENERATED.json").read_text())
    assert marker["parameters"]["negatives_per_series"] == 20
    labels = read_candidates_csv(root / "candidates_V2.csv").labels
    assert (labels == 0).sum() == 20 * 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "data"]  # no staging or retired directories left


def test_failure_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError, match="could not place"):
        generate_luna16_phantoms(tmp_path / "data", seed=0, **{**TINY, "nodule_diameter_mm": (30.0, 30.0)})
    assert [p.name for p in tmp_path.iterdir()] == [".data.lock"]  # the lock file stays, for the next run


def test_refuses_to_overwrite_other_data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "scan.mhd").write_text("mine")
    with pytest.raises(DataError, match="refusing to replace"):
        generate_luna16_phantoms(tmp_path / "data", **TINY)
    assert (tmp_path / "data" / "scan.mhd").read_text() == "mine"


@pytest.mark.parametrize(
    "change, name",
    [({"n_sites": 0}, "n_sites"), ({"nodules_per_series": (3, 2)}, "nodules_per_series"),
     ({"nodule_diameter_mm": (0.0, 5.0)}, "nodule_diameter_mm"), ({"z_extent_mm": 5.0}, "z_extent_mm")],
)
def test_bad_parameters_are_named(tmp_path, change, name):
    with pytest.raises(ValueError, match=name):
        generate_luna16_phantoms(tmp_path / "data", **{**TINY, **change})


def test_series_made_on_worker_processes_are_the_series_made_in_turn(tmp_path, tiny, monkeypatch):
    root, _ = tiny
    monkeypatch.setattr("medfed.data.phantoms.workers.PARALLEL_WORK", 0.0)  # workers even for a tiny data set
    monkeypatch.setattr("medfed.data.phantoms.workers.available_cores", lambda: 2)
    spread = generate_luna16_phantoms(tmp_path / "spread", seed=5, **TINY)
    first_files, second_files = all_files(root), all_files(spread)
    assert first_files.keys() == second_files.keys()
    for name in first_files:
        assert first_files[name].read_bytes() == second_files[name].read_bytes(), name
