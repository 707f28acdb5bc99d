"""Generated BraTS-like data: layout, labels, contrasts, site effects, determinism, caching."""

import dataclasses
import json

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

import medfed.data.phantoms.brats as phantoms
from medfed.data.brats import MODALITIES, TumourLabel, find_cases, load_case, tumour_core, whole_tumour
from medfed.data.partition_csv import read_partition_csv
from medfed.data.phantoms.store import describe_generated
from medfed.data.phantoms.brats import (
    draw_site_acquisition,
    generate_brats_phantoms,
    load_anatomy,
    simulate_case,
)
from medfed.errors import DataError

TINY = dict(n_sites=3, cases_per_site=2, seed=0, resolution_mm=4.0, lgg_fraction=0.5)
FLAIR, T1, T1CE, T2 = (MODALITIES.index(m) for m in ("flair", "t1", "t1ce", "t2"))
CSF, GM, WM = range(3)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return generate_brats_phantoms(tmp_path_factory.mktemp("phantoms") / "brats", **TINY)


@pytest.fixture(scope="module")
def marker(generated):
    return json.loads((generated / "GENERATED.json").read_text())


def snapshot(root):
    """{relative path: mtime in ns} of every file under root."""
    return {path.relative_to(root): path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()}


def read_arrays(root):
    """{file name: array} of every NIfTI file under root (names, not paths: grade folders may differ)."""
    return {path.name: np.asanyarray(nib.load(path).dataobj) for path in sorted(root.rglob("*.nii.gz"))}


# --- layout and records ---------------------------------------------------------


def test_reads_back_through_the_brats_reader_unchanged(generated, marker):
    cases = find_cases(generated)
    grades = {case["case_id"]: case["grade"] for case in marker["cases"]}
    assert [case.case_id for case in cases] == sorted(grades)
    brats_to_ours = np.array([0, 1, 2, 255, 3], dtype=np.uint8)
    for case in cases:
        assert (case.layout, case.grade) == ("brats2017", grades[case.case_id])
        raw_images = [nib.load(path) for path in case.image_files]
        raw_seg = np.asanyarray(nib.load(case.label_file).dataobj)
        assert all(image.get_data_dtype() == np.int16 for image in raw_images)
        assert raw_seg.dtype == np.uint8 and set(np.unique(raw_seg)) <= {0, 1, 2, 4}
        volume = load_case(case)
        expected = np.stack([np.asanyarray(image.dataobj) for image in raw_images]).astype(np.float32)
        np.testing.assert_array_equal(volume.image, expected)
        np.testing.assert_array_equal(volume.label, brats_to_ours[raw_seg])
        np.testing.assert_allclose(np.diag(volume.affine)[:3], [4.0, 4.0, 4.0])


def test_partition_file_and_marker_record_sites_and_parameters(generated, marker):
    sites = read_partition_csv(generated / "partitioning.csv")
    assert sorted(sites) == sorted(case["case_id"] for case in marker["cases"])
    for case_id, site in sites.items():
        assert case_id.startswith(f"Brats17_SYN{site}_")
    for site in (1, 2, 3):
        site_cases = [case for case in marker["cases"] if case["site"] == site]
        assert [case["grade"] for case in site_cases].count("LGG") == 1  # lgg_fraction 0.5 of 2 cases
    assert marker["generated"] is True and "GENERATED DATA" in marker["notice"]
    assert marker["parameters"] == TINY
    recorded = [json.loads(json.dumps(dataclasses.asdict(draw_site_acquisition(0, site)))) for site in (1, 2, 3)]
    assert marker["sites"] == recorded
    assert all((generated / name).is_file() for name in marker["files"])


def test_describe_generated(generated, tmp_path):
    description = describe_generated(generated)
    assert description.startswith("GENERATED") and "3 sites x 2 cases (3 LGG), 4 mm, seed 0" in description
    assert describe_generated(tmp_path) is None
    (tmp_path / "GENERATED.json").write_text("{not json")
    with pytest.raises(DataError, match="GENERATED.json"):
        describe_generated(tmp_path)


# --- labels and image content ---------------------------------------------------


def test_tumour_regions_are_nested_inside_the_brain(generated):
    for case in find_cases(generated):
        volume = load_case(case)
        whole, core = whole_tumour(volume.label), tumour_core(volume.label)
        necrotic = volume.label == TumourLabel.NECROTIC_CORE
        enhancing = volume.label == TumourLabel.ENHANCING
        brain = volume.image.sum(axis=0) > 0
        assert not np.any(whole & ~brain)
        assert ndimage.label(whole)[1] == 1  # one connected lesion
        assert 5.0 < whole.sum() * 4.0**3 / 1000 < 300.0  # millilitres
        assert core.any() and np.count_nonzero(volume.label == TumourLabel.OEDEMA) > 0
        if case.grade == "HGG":
            assert necrotic.any() and enhancing.any()
            assert not np.any(ndimage.binary_dilation(necrotic) & ~core)  # necrosis enclosed by the enhancing rim
        else:
            assert not enhancing.any() and necrotic.any()


def region_mean(image, mask):
    assert np.count_nonzero(mask) >= 10
    return image[mask].mean()


@pytest.mark.parametrize("site", [1, 2, 3])
def test_modality_contrasts(site):
    anatomy = load_anatomy(4.0)
    case = simulate_case(anatomy, draw_site_acquisition(7, site), grade="HGG", rng=np.random.default_rng(site))
    image = case.image.astype(np.float64)
    healthy = case.seg == 0
    tissue = {t: healthy & (case.tissue[t] > 0.7) for t in (CSF, GM, WM)}
    mean = {(m, t): region_mean(image[m], tissue[t]) for m in range(4) for t in (CSF, GM, WM)}
    assert mean[T1, WM] > mean[T1, GM] > mean[T1, CSF]
    assert mean[T1CE, WM] > mean[T1CE, GM] > mean[T1CE, CSF]
    assert mean[T2, CSF] > mean[T2, GM] > mean[T2, WM]
    assert mean[FLAIR, GM] > mean[FLAIR, WM] > mean[FLAIR, CSF]

    oedema, necrotic, enhancing = (case.seg == value for value in (2, 1, 4))
    assert region_mean(image[FLAIR], oedema) > 1.3 * mean[FLAIR, WM]
    assert region_mean(image[T2], oedema) > 1.3 * mean[T2, WM]
    assert region_mean(image[T1], oedema) < mean[T1, WM]
    assert region_mean(image[T1], necrotic) < 0.6 * mean[T1, WM]
    assert region_mean(image[T1CE], necrotic) < 0.75 * mean[T1CE, WM]  # partial volume with the rim at 4 mm
    assert region_mean(image[T2], necrotic) > 1.5 * mean[T2, WM]
    enhancement = region_mean(image[T1CE], enhancing) / region_mean(image[T1], enhancing)
    assert enhancement > 1.5 * mean[T1CE, WM] / mean[T1, WM]


def test_low_grade_cases_do_not_enhance():
    case = simulate_case(load_anatomy(4.0), draw_site_acquisition(0, 1), grade="LGG", rng=np.random.default_rng(5))
    assert np.count_nonzero(case.seg == 4) == 0
    assert np.count_nonzero(case.seg == 1) > 0 and np.count_nonzero(case.seg == 2) > 0


def test_sites_differ_more_than_cases_within_a_site(generated):
    sites = read_partition_csv(generated / "partitioning.csv")
    log_medians = {}  # case -> (4,) log median brain intensity per modality
    for case in find_cases(generated):
        volume = load_case(case)
        brain = volume.image.sum(axis=0) > 0
        log_medians[case.case_id] = np.log(np.median(volume.image[:, brain], axis=1))
    per_site = {site: np.array([v for c, v in log_medians.items() if sites[c] == site]) for site in (1, 2, 3)}
    site_means = np.array([values.mean(axis=0) for values in per_site.values()])
    within = np.mean([((values - values.mean(axis=0)) ** 2).sum(axis=1).mean() for values in per_site.values()])
    between = ((site_means - site_means.mean(axis=0)) ** 2).sum(axis=1).mean()
    assert between > 20 * within


# --- determinism, caching, atomic replacement -----------------------------------


def test_same_seed_gives_identical_arrays_and_another_seed_differs(tmp_path):
    settings = dict(n_sites=1, cases_per_site=2, resolution_mm=4.0)
    first = read_arrays(generate_brats_phantoms(tmp_path / "a", seed=3, **settings))
    again = read_arrays(generate_brats_phantoms(tmp_path / "b", seed=3, **settings))
    other = read_arrays(generate_brats_phantoms(tmp_path / "c", seed=4, **settings))
    assert first.keys() == again.keys() == other.keys() and len(first) == 10
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert all(not np.array_equal(first[name], other[name]) for name in first)


def test_second_call_with_same_parameters_rewrites_nothing(tmp_path):
    root = generate_brats_phantoms(tmp_path / "brats", n_sites=1, cases_per_site=1, resolution_mm=4.0)
    before = snapshot(root)
    assert generate_brats_phantoms(tmp_path / "brats", n_sites=1, cases_per_site=1, resolution_mm=4.0) == root
    assert snapshot(root) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [".brats.lock", "brats"]


def test_missing_file_or_new_parameters_regenerate_in_place(tmp_path):
    root = generate_brats_phantoms(tmp_path / "brats", n_sites=1, cases_per_site=1, resolution_mm=4.0)
    (root / "partitioning.csv").unlink()
    generate_brats_phantoms(root, n_sites=1, cases_per_site=1, resolution_mm=4.0)
    assert (root / "partitioning.csv").is_file()

    old_arrays = read_arrays(root)
    generate_brats_phantoms(root, n_sites=1, cases_per_site=1, resolution_mm=4.0, seed=1)
    assert json.loads((root / "GENERATED.json").read_text())["parameters"]["seed"] == 1
    assert not np.array_equal(old_arrays[next(iter(old_arrays))], read_arrays(root)[next(iter(old_arrays))])
    assert sorted(path.name for path in tmp_path.iterdir()) == [".brats.lock", "brats"]  # no staging or retired folders left


def test_failure_while_writing_leaves_the_previous_data_set(tmp_path, monkeypatch):
    root = generate_brats_phantoms(tmp_path / "brats", n_sites=1, cases_per_site=2, resolution_mm=4.0)
    before = snapshot(root)
    calls = []

    def failing_on_second_case(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return simulate_case(*args, **kwargs)

    monkeypatch.setattr(phantoms, "simulate_case", failing_on_second_case)
    with pytest.raises(RuntimeError, match="disk full"):
        generate_brats_phantoms(root, n_sites=1, cases_per_site=2, resolution_mm=4.0, seed=1)
    assert snapshot(root) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [".brats.lock", "brats"]


def test_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(DataError, match="refusing to replace") as info:
        generate_brats_phantoms(tmp_path / "mine", n_sites=1, cases_per_site=1, resolution_mm=4.0)
    assert str(tmp_path / "mine") in str(info.value)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize(
    "argument, value",
    [("n_sites", 0), ("cases_per_site", 1000), ("seed", -1), ("resolution_mm", 0.5), ("lgg_fraction", 1.5)],
)
def test_bad_arguments_name_the_argument(tmp_path, argument, value):
    with pytest.raises(ValueError, match=argument):
        generate_brats_phantoms(tmp_path / "brats", **{argument: value})
    assert not (tmp_path / "brats").exists()


def test_scanner_bias_noise_and_blur_act_as_documented():
    anatomy = load_anatomy(4.0)
    ideal = dataclasses.replace(
        draw_site_acquisition(0, 1), noise_model="gaussian", noise_sigma=0.0, blur_sigma_mm=0.0, bias_amplitude=0.0
    )

    def scan(**changes):
        acquisition = dataclasses.replace(ideal, **changes)
        return simulate_case(anatomy, acquisition, grade="HGG", rng=np.random.default_rng(0)).image.astype(np.float64)

    reference = scan()
    brain = reference.min(axis=0) > 0
    world_mm = nib.affines.apply_affine(anatomy.affine, np.moveaxis(np.indices(brain.shape), 0, -1))
    near_origin = brain & np.all(np.abs(world_mm) <= phantoms.BIAS_LENGTH_MM, axis=-1)
    log_bias = np.log(scan(bias_amplitude=0.2)[:, near_origin] / reference[:, near_origin])
    assert np.abs(log_bias).max() < 0.2 + 0.03  # bounded by the amplitude (+ int16 rounding)
    assert np.ptp(log_bias) > 0.1  # and not a constant gain

    noise_std = [np.std(scan(noise_sigma=sigma)[:, brain] - reference[:, brain]) for sigma in (0.02, 0.04)]
    np.testing.assert_allclose(noise_std[1] / noise_std[0], 2.0, rtol=0.02)

    def roughness(image):
        return np.abs(ndimage.laplace(image[T1])[brain]).mean()

    assert roughness(scan(blur_sigma_mm=3.0)) < 0.8 * roughness(reference)


def test_cases_made_on_worker_processes_are_the_cases_made_in_turn(tmp_path, monkeypatch):
    settings = dict(n_sites=2, cases_per_site=2, seed=3, resolution_mm=8.0, progress=False)
    in_turn = generate_brats_phantoms(tmp_path / "in_turn", **settings)
    monkeypatch.setattr("medfed.data.phantoms.workers.PARALLEL_WORK", 0.0)  # workers even for a tiny data set
    monkeypatch.setattr("medfed.data.phantoms.workers.available_cores", lambda: 2)
    spread = generate_brats_phantoms(tmp_path / "spread", **settings)
    first, second = read_arrays(in_turn), read_arrays(spread)
    assert first.keys() == second.keys() and len(first) == 20
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert json.loads((in_turn / "GENERATED.json").read_text()) == json.loads((spread / "GENERATED.json").read_text())
