"""BraTS reader: every layout round-trips tiny written volumes; every bad input names its file."""

import gzip
import json

import nibabel as nib
import numpy as np
import pytest

from medfed.data.brats import (
    MODALITIES,
    TumourLabel,
    enhancing_tumour,
    find_cases,
    find_unlabelled_cases,
    load_case,
    tumour_core,
    tumour_regions,
    whole_tumour,
)
from medfed.errors import DataError

from brats_files import AFFINE, REAL_MSD_LABELS, REAL_MSD_MODALITY, SHAPE, random_images, write_msd, write_nifti

BRATS_VALUES = np.array([0, 1, 2, 4], dtype=np.uint8)
BRATS_TO_OURS = {0: 0, 1: 1, 2: 2, 4: 3}


def random_brats_seg(rng, shape=SHAPE):
    seg = rng.choice(BRATS_VALUES, size=shape).astype(np.uint8)
    seg.flat[:4] = BRATS_VALUES  # every value present
    return seg


def write_brats_case(folder, rng, *, suffix=".nii.gz", seg_name=None, with_seg=True):
    """``folder/<case>_{flair,t1,t1ce,t2,seg}<suffix>``; returns (images, seg)."""
    case_id = folder.name
    images = random_images(rng)
    for modality, volume in zip(MODALITIES, images):
        write_nifti(folder / f"{case_id}_{modality}{suffix}", volume)
    seg = random_brats_seg(rng)
    if with_seg:
        write_nifti(folder / (seg_name or f"{case_id}_seg{suffix}"), seg)
    return images, seg


def ours(seg):
    return np.vectorize(BRATS_TO_OURS.get)(seg).astype(np.uint8)


def only_case(root):
    (case,) = find_cases(root)
    return case


# --- layouts ----------------------------------------------------------------


def test_brats2017_layout_round_trips_with_label_4_becoming_3(tmp_path):
    rng = np.random.default_rng(0)
    written = {
        "Brats17_TCIA_105_1": ("HGG", write_brats_case(tmp_path / "HGG" / "Brats17_TCIA_105_1", rng)),
        "Brats17_2013_0_1": ("LGG", write_brats_case(tmp_path / "LGG" / "Brats17_2013_0_1", rng)),
    }
    cases = find_cases(tmp_path)
    assert [case.case_id for case in cases] == sorted(written)
    for case in cases:
        grade, (images, seg) = written[case.case_id]
        assert (case.layout, case.grade) == ("brats2017", grade)
        volume = load_case(case)
        assert volume.image.dtype == np.float32 and volume.image.shape == (4, *SHAPE)
        np.testing.assert_array_equal(volume.image, images.astype(np.float32))
        assert volume.label.dtype == np.uint8
        np.testing.assert_array_equal(volume.label, ours(seg))
        assert volume.affine.dtype == np.float64
        np.testing.assert_array_equal(volume.affine, AFFINE)


def test_brats2020_layout_uncompressed_with_misnamed_seg_and_stray_files(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "name_mapping.csv").write_text("BraTS_2020_subject_ID\nBraTS20_Training_001\n")
    (tmp_path / "survival_info.csv").write_text("Brats20ID,Age\n")
    (tmp_path / "__MACOSX").mkdir()
    (tmp_path / "__MACOSX" / "._BraTS20_Training_001").write_bytes(b"\x00\x05\x16\x07")
    normal = write_brats_case(tmp_path / "BraTS20_Training_001", rng, suffix=".nii")
    quirk_folder = tmp_path / "BraTS20_Training_355"
    quirk = write_brats_case(quirk_folder, rng, suffix=".nii", seg_name="W39_1998.09.19_Segm.nii")
    (quirk_folder / "._W39_1998.09.19_Segm.nii").write_bytes(b"\x00\x05\x16\x07")  # macOS resource fork
    cases = find_cases(tmp_path)
    assert [case.case_id for case in cases] == ["BraTS20_Training_001", "BraTS20_Training_355"]
    assert cases[1].label_file == quirk_folder / "W39_1998.09.19_Segm.nii"
    for case, (images, seg) in zip(cases, (normal, quirk)):
        assert (case.layout, case.grade) == ("brats2020", None)
        volume = load_case(case)
        np.testing.assert_array_equal(volume.image, images.astype(np.float32))
        np.testing.assert_array_equal(volume.label, ours(seg))


def test_brats_validation_folders_without_any_seg_are_unlabelled_cases_only(tmp_path):
    rng = np.random.default_rng(2)
    images, _ = write_brats_case(tmp_path / "BraTS20_Validation_001", rng, with_seg=False)
    (case,) = find_unlabelled_cases(tmp_path)
    assert case.label_file is None
    volume = load_case(case)
    assert volume.label is None
    np.testing.assert_array_equal(volume.image, images.astype(np.float32))
    with pytest.raises(DataError, match="none of its 1 cases has a segmentation") as info:
        find_cases(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("disk_order", [MODALITIES, ("t2", "t1ce", "flair", "t1")], ids=["real", "permuted"])
def test_msd_layout_maps_channels_and_labels_by_name(tmp_path, disk_order):
    written = write_msd(tmp_path, np.random.default_rng(3), disk_order=disk_order)
    cases = find_cases(tmp_path)
    assert [case.case_id for case in cases] == ["BRATS_001", "BRATS_002"]  # imagesTs (unlabelled) is not among them
    msd_to_ours = np.array(  # MSD values 0 background, 1 edema, 2 non-enhancing tumour, 3 enhancing
        [TumourLabel.BACKGROUND, TumourLabel.OEDEMA, TumourLabel.NECROTIC_CORE, TumourLabel.ENHANCING]
    )
    for case in cases:
        images, label = written[case.case_id]
        volume = load_case(case)
        assert case.layout == "msd"
        np.testing.assert_array_equal(volume.image, images)
        np.testing.assert_array_equal(volume.label, msd_to_ours[label])
    (test_case,) = find_unlabelled_cases(tmp_path)
    assert test_case.case_id == "BRATS_003" and test_case.image_files == (tmp_path / "imagesTs" / "BRATS_003.nii.gz",)
    volume = load_case(test_case)
    assert volume.label is None
    np.testing.assert_array_equal(volume.image, written["BRATS_003"][0])


BRATS2023_KEYS = ("t2f", "t1n", "t1c", "t2w")  # FLAIR, T1, T1ce, T2: MODALITIES order


def write_brats2023_case(folder, label, *, keys=BRATS2023_KEYS):
    """``folder/<case>-<key>.nii.gz`` for ``keys``, modality k (MODALITIES order) 10 (k + 1) but for one brighter voxel at
    the far corner (an image of one value throughout is refused), and ``<case>-seg.nii.gz``."""
    for k, key in enumerate(BRATS2023_KEYS):
        if key in keys:
            image = np.full(SHAPE, 10 * (k + 1), dtype=np.int16)
            image[-1, -1, -1] += 1
            write_nifti(folder / f"{folder.name}-{key}.nii.gz", image)
    write_nifti(folder / f"{folder.name}-seg.nii.gz", label)


def test_brats2023_layout_orders_channels_by_sequence_name_and_keeps_labels_1_to_3(tmp_path):
    label = np.zeros(SHAPE, dtype=np.uint8)
    label[1, :3, 0] = [1, 2, 3]  # NCR/NETC, ED/SNFH, ET
    for case_id in ("BraTS-GLI-00000-000", "BraTS-MEN-00004-000", "BraTS-MET-00001-000", "BraTS-SSA-00002-000"):
        write_brats2023_case(tmp_path / case_id, label)
    (tmp_path / "name_mapping.csv").write_text("BraTS2023,BraTS2021\n")
    cases = find_cases(tmp_path)
    assert [case.case_id for case in cases] == ["BraTS-GLI-00000-000", "BraTS-MEN-00004-000", "BraTS-MET-00001-000", "BraTS-SSA-00002-000"]
    for case in cases:
        assert case.layout == "brats2023"
        assert case.image_files == tuple(tmp_path / case.case_id / f"{case.case_id}-{key}.nii.gz" for key in BRATS2023_KEYS)
        volume = load_case(case)
        assert volume.image[:, 0, 0, 0].tolist() == [10.0, 20.0, 30.0, 40.0]  # flair, t1, t1ce, t2
        assert volume.label[1, :4, 0].tolist() == [TumourLabel.NECROTIC_CORE, TumourLabel.OEDEMA, TumourLabel.ENHANCING, 0]
        assert np.count_nonzero(volume.label) == 3


def test_brats2023_label_4_is_rejected(tmp_path):
    label = np.zeros(SHAPE, dtype=np.uint8)
    label[0, 0, 0] = 4  # enhancing before 2023; resection cavity in the 2024 post-treatment set
    write_brats2023_case(tmp_path / "BraTS-GLI-00001-000", label)
    with pytest.raises(DataError, match=r"label values 4 are not allowed; expected only 0 \(background\), 1 \(necrotic_core\), 2 \(oedema\), 3 \(enhancing\)") as info:
        load_case(only_case(tmp_path))
    assert "BraTS-GLI-00001-000-seg.nii.gz" in str(info.value)


@pytest.mark.parametrize(
    "case_id, message",
    [
        ("BraTS-PED-00002-000", "label convention of BraTS-PED is unsupported: the 2023 paediatric release"),
        ("Patient-7", "does not say which challenge set"),
    ],
)
def test_brats2023_sets_of_unconfirmed_label_convention_are_rejected(tmp_path, case_id, message):
    write_brats2023_case(tmp_path / case_id, np.zeros(SHAPE, dtype=np.uint8))
    with pytest.raises(DataError, match=message) as info:
        find_cases(tmp_path)
    assert str(tmp_path / case_id) in str(info.value)


def test_brats2023_missing_sequence_names_the_case_folder_and_the_file(tmp_path):
    folder = tmp_path / "BraTS-GLI-00000-000"
    write_brats2023_case(folder, np.zeros(SHAPE, dtype=np.uint8), keys=("t2f", "t1n", "t2w"))
    with pytest.raises(DataError, match=r"missing the t1c \(t1ce\) image") as info:
        find_cases(tmp_path)
    assert str(folder / "BraTS-GLI-00000-000-t1c.nii.gz") in str(info.value)


# Regions each raw label value belongs to (WT, TC, ET), written out by hand from the conventions.
BRATS_RAW_REGIONS = {0: (0, 0, 0), 1: (1, 1, 0), 2: (1, 0, 0), 4: (1, 1, 1)}  # NCR/NET, oedema, enhancing
MSD_RAW_REGIONS = {0: (0, 0, 0), 1: (1, 0, 0), 2: (1, 1, 0), 3: (1, 1, 1)}  # edema, non-enhancing, enhancing


def _expected_regions(raw, table):
    return np.stack([np.vectorize(lambda v: table[int(v)][r])(raw) for r in range(3)]).astype(np.uint8)


def test_regions_of_brats_and_msd_labels_follow_each_convention(tmp_path):
    rng = np.random.default_rng(7)
    write_brats_case(tmp_path / "brats" / "BraTS20_Training_001", rng)
    (case,) = find_cases(tmp_path / "brats")
    raw = np.asarray(nib.load(case.label_file).dataobj)
    np.testing.assert_array_equal(tumour_regions(load_case(case).label), _expected_regions(raw, BRATS_RAW_REGIONS))
    write_msd(tmp_path / "msd", rng)
    for case in find_cases(tmp_path / "msd"):
        raw = np.asarray(nib.load(case.label_file).dataobj)
        np.testing.assert_array_equal(tumour_regions(load_case(case).label), _expected_regions(raw, MSD_RAW_REGIONS))


def test_region_masks():
    label = np.array([0, 1, 2, 3], dtype=np.uint8)
    np.testing.assert_array_equal(whole_tumour(label), [False, True, True, True])
    np.testing.assert_array_equal(tumour_core(label), [False, True, False, True])
    np.testing.assert_array_equal(enhancing_tumour(label), [False, False, False, True])


# --- bad input ----------------------------------------------------------------


def test_missing_root(tmp_path):
    with pytest.raises(DataError, match="not found") as info:
        find_cases(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_nothing_matches_lists_the_layouts(tmp_path):
    (tmp_path / "notes.txt").write_text("no images here")
    with pytest.raises(DataError) as info:
        find_cases(tmp_path)
    for layout in ("dataset.json", "HGG|LGG", "BraTS 2020"):
        assert layout in str(info.value)


def test_missing_modality_names_the_modality_and_expected_path(tmp_path):
    folder = tmp_path / "HGG" / "Brats17_A_1"
    write_brats_case(folder, np.random.default_rng(4))
    (folder / "Brats17_A_1_t1ce.nii.gz").unlink()
    with pytest.raises(DataError, match="missing the t1ce image") as info:
        find_cases(tmp_path)
    assert str(folder / "Brats17_A_1_t1ce.nii.gz") in str(info.value)


@pytest.mark.parametrize("content", [None, "notes.txt"], ids=["empty", "no-nifti"])
def test_case_folder_without_case_files_is_named(tmp_path, content):
    rng = np.random.default_rng(16)
    write_brats_case(tmp_path / "BraTS20_Training_001", rng)
    (tmp_path / ".hidden_folder").mkdir()  # hidden names stay ignored
    folder = tmp_path / "BraTS20_Training_002"
    folder.mkdir()
    if content:
        (folder / content).write_text("not an image")
    with pytest.raises(DataError, match="holds no BraTS case files; expected") as info:
        find_cases(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{folder}: ")
    assert "BraTS20_Training_002_{flair,t1,t1ce,t2,seg}.nii[.gz]" in message
    assert "BraTS20_Training_002-{t2f,t1n,t1c,t2w,seg}.nii[.gz]" in message


def test_empty_case_folder_under_hgg_is_named(tmp_path):
    write_brats_case(tmp_path / "HGG" / "Brats17_A_1", np.random.default_rng(17))
    (tmp_path / "LGG" / "Brats17_B_1").mkdir(parents=True)
    with pytest.raises(DataError, match="holds no BraTS case files; expected Brats17_B_1_{flair,t1,t1ce,t2,seg}") as info:
        find_cases(tmp_path)
    assert str(tmp_path / "LGG" / "Brats17_B_1") in str(info.value)


def test_some_cases_without_seg(tmp_path):
    rng = np.random.default_rng(5)
    write_brats_case(tmp_path / "BraTS20_Training_001", rng)
    write_brats_case(tmp_path / "BraTS20_Training_002", rng, with_seg=False)
    with pytest.raises(DataError, match="1 of 2 cases have no segmentation") as info:
        find_cases(tmp_path)
    assert "BraTS20_Training_002" in str(info.value)


def test_modalities_of_different_shapes_are_listed(tmp_path):
    folder = tmp_path / "Case_1"
    write_brats_case(folder, np.random.default_rng(6))
    write_nifti(folder / "Case_1_t2.nii.gz", np.zeros((8, 8, 5), dtype=np.int16))
    with pytest.raises(DataError, match="differ in shape") as info:
        load_case(only_case(tmp_path))
    assert "Case_1_t2.nii.gz: (8, 8, 5)" in str(info.value)
    assert "Case_1_flair.nii.gz: (8, 8, 6)" in str(info.value)


def test_label_shape_differs_from_image(tmp_path):
    folder = tmp_path / "Case_1"
    write_brats_case(folder, np.random.default_rng(7))
    write_nifti(folder / "Case_1_seg.nii.gz", np.zeros((8, 8, 5), dtype=np.uint8))
    with pytest.raises(DataError, match=r"label shape \(8, 8, 5\) differs") as info:
        load_case(only_case(tmp_path))
    assert "Case_1_seg.nii.gz" in str(info.value)


def test_brats_label_3_is_rejected(tmp_path):
    folder = tmp_path / "Case_1"
    _, seg = write_brats_case(folder, np.random.default_rng(8))
    seg[0, 0, 0], seg[1, 0, 0] = 3, 7
    write_nifti(folder / "Case_1_seg.nii.gz", seg)
    with pytest.raises(DataError, match="label values 3, 7 are not allowed") as info:
        load_case(only_case(tmp_path))
    assert "Case_1_seg.nii.gz" in str(info.value)
    assert "4 (enhancing)" in str(info.value)


def test_fractional_label_value_is_rejected(tmp_path):
    folder = tmp_path / "Case_1"
    _, seg = write_brats_case(folder, np.random.default_rng(9))
    seg = seg.astype(np.float32)
    seg[2, 2, 2] = 1.5
    write_nifti(folder / "Case_1_seg.nii.gz", seg)
    with pytest.raises(DataError, match="label values 1.5 are not allowed") as info:
        load_case(only_case(tmp_path))
    assert "Case_1_seg.nii.gz" in str(info.value)


def test_msd_label_outside_dataset_json_is_rejected(tmp_path):
    write_msd(tmp_path, np.random.default_rng(10))
    label = np.zeros(SHAPE, dtype=np.uint8)
    label[0, 0, :2] = 4
    path = write_nifti(tmp_path / "labelsTr" / "BRATS_001.nii.gz", label)
    with pytest.raises(DataError, match="label values 4 are not allowed") as info:
        load_case(find_cases(tmp_path)[0])
    assert str(path) in str(info.value)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, 1e300])
def test_non_finite_voxels_are_counted(tmp_path, bad_value):
    folder = tmp_path / "Case_1"
    images, _ = write_brats_case(folder, np.random.default_rng(11))
    t2 = images[3].astype(np.float64)  # a float64 file: 1e300 is finite there, infinite in float32
    t2[0, 0, :3] = bad_value
    path = write_nifti(folder / "Case_1_t2.nii.gz", t2)
    with pytest.raises(DataError, match="3 voxels are NaN, infinite or beyond float32's range") as info:
        load_case(only_case(tmp_path))
    assert str(path) in str(info.value)


def corrupt_gzip(path):
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(200)))


def not_nifti(path):
    path.write_bytes(gzip.compress(b"this is a text file, not an image\n" * 20))


def truncated(path):
    """A file large enough that its header survives while the last quarter of the voxel data is gone."""
    write_nifti(path, np.random.default_rng(0).integers(0, 500, size=(48, 48, 48), dtype=np.int16))
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 4])


@pytest.mark.parametrize("damage", [corrupt_gzip, not_nifti, truncated])
@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_unreadable_files_are_wrapped(tmp_path, damage, suffix):
    folder = tmp_path / "Case_1"
    write_brats_case(folder, np.random.default_rng(12), suffix=suffix)
    path = folder / f"Case_1_t1{suffix}"
    damage(path)
    with pytest.raises(DataError, match="cannot be read as NIfTI") as info:
        load_case(only_case(tmp_path))
    assert str(path) in str(info.value)


def test_msd_image_with_wrong_channel_count(tmp_path):
    write_msd(tmp_path, np.random.default_rng(13))
    path = write_nifti(tmp_path / "imagesTr" / "BRATS_002.nii.gz", np.zeros((*SHAPE, 3), dtype=np.float32))
    with pytest.raises(DataError, match=r"X x Y x Z x 4 .* found shape \(8, 8, 6, 3\)") as info:
        load_case(find_cases(tmp_path)[1])
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "modality, labels, message",
    [
        ({**REAL_MSD_MODALITY, "3": "DWI"}, REAL_MSD_LABELS, "modality '3': 'DWI' is not understood"),
        (REAL_MSD_MODALITY, {**REAL_MSD_LABELS, "2": "calcification"}, "label '2': 'calcification' is not understood"),
    ],
)
def test_msd_unknown_names_in_dataset_json(tmp_path, modality, labels, message):
    write_msd(tmp_path, np.random.default_rng(14))
    spec = json.loads((tmp_path / "dataset.json").read_text())
    spec["modality"], spec["labels"] = modality, labels
    (tmp_path / "dataset.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match=message) as info:
        find_cases(tmp_path)
    assert str(tmp_path / "dataset.json") in str(info.value)


def test_msd_listed_file_missing(tmp_path):
    write_msd(tmp_path, np.random.default_rng(15))
    (tmp_path / "labelsTr" / "BRATS_002.nii.gz").unlink()
    with pytest.raises(DataError, match="does not exist") as info:
        find_cases(tmp_path)
    assert str(tmp_path / "labelsTr" / "BRATS_002.nii.gz") in str(info.value)
    assert "dataset.json" in str(info.value)


# --- hostile headers and cases whose files are not on one grid (issue 24) ----------------------------


def crafted_header(shape, dtype=np.float32):
    """The bytes of a valid single-file NIfTI-1 header (352 bytes) claiming ``shape`` voxels of ``dtype``, and no voxels."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    header.set_qform(AFFINE, code=1)
    header["vox_offset"] = 352
    return header.binaryblock + b"\x00" * 4


@pytest.mark.parametrize(
    "name, content, claimed",
    [
        ("Case_1_t1.nii", crafted_header((16384, 16384, 4096)), 4 * 2**40 + 352),  # 352 bytes claiming 4 TiB
        ("Case_1_t1.nii.gz", gzip.compress(crafted_header((1024, 1024, 384)), mtime=0), 1.5 * 2**30 + 352),  # 1.5 GiB
        ("Case_1_t1.nii.gz", gzip.compress(crafted_header((16384, 16384, 4096)), mtime=0), 4 * 2**40 + 352),
    ],
    ids=["4TiB-nii", "1.5GiB-nii.gz", "4TiB-nii.gz"],
)
def test_a_header_claiming_more_voxels_than_its_file_holds_is_refused_before_allocating(tmp_path, name, content, claimed):
    import tracemalloc

    folder = tmp_path / "Case_1"
    write_brats_case(folder, np.random.default_rng(20))
    path = folder / name
    for stale in folder.glob("Case_1_t1.nii*"):
        stale.unlink()
    path.write_bytes(content)
    assert path.stat().st_size < 400
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            load_case(only_case(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(f"{path}: cannot be read as NIfTI: its header claims {int(claimed)} bytes of voxels")
    assert f"{path.stat().st_size}" in message and "\n" not in message
    assert peak < 20 * 2**20


def test_a_volume_whose_file_holds_its_voxels_is_read_with_the_size_check(tmp_path):
    folder = tmp_path / "Case_1"
    images, _ = write_brats_case(folder, np.random.default_rng(21), suffix=".nii")
    np.testing.assert_array_equal(load_case(only_case(tmp_path)).image, images.astype(np.float32))


def moved(affine, *, flip_x=False, shift_mm=(0.0, 0.0, 0.0)):
    changed = affine.copy()
    if flip_x:
        changed[:3, 0] *= -1
    changed[:3, 3] += shift_mm
    return changed


@pytest.mark.parametrize(
    "file, affine, numbers",
    [
        ("Case_1_t1ce.nii.gz", moved(AFFINE, flip_x=True, shift_mm=(40.0, 0.0, 0.0)), ("origins 40 mm apart", "180 degrees")),
        ("Case_1_seg.nii.gz", moved(AFFINE, shift_mm=(0.0, 100.0, 0.0)), ("origins 100 mm apart", "100 voxels apart")),
        ("Case_1_t2.nii.gz", moved(AFFINE, shift_mm=(0.0, 0.0, 0.002)), ("0.002 voxels apart",)),
    ],
)
def test_files_of_a_case_on_different_grids_are_refused_naming_both_and_the_difference(tmp_path, file, affine, numbers):
    folder = tmp_path / "Case_1"
    images, seg = write_brats_case(folder, np.random.default_rng(22))
    write_nifti(folder / file, seg if "seg" in file else images[MODALITIES.index(file[7:-7])], affine)
    with pytest.raises(DataError) as info:
        load_case(only_case(tmp_path))
    message = str(info.value)
    assert message.startswith(f"{folder / file}: its voxel grid differs from Case_1_flair.nii.gz's")
    assert all(number in message for number in numbers), message
    assert "data.resample=true" in message and "\n" not in message


def test_grids_equal_within_the_tolerance_are_one_grid(tmp_path):
    folder = tmp_path / "Case_1"
    images, seg = write_brats_case(folder, np.random.default_rng(23))
    nearly = AFFINE + np.array([[1e-6, 2e-6, 0, 5e-4], [0, 1e-6, 0, -5e-4], [0, 0, 0, 5e-4], [0, 0, 0, 0]])
    write_nifti(folder / "Case_1_t2.nii.gz", images[3], nearly)
    write_nifti(folder / "Case_1_seg.nii.gz", seg, nearly)
    volume = load_case(only_case(tmp_path))
    np.testing.assert_array_equal(volume.image[3], images[3])
    np.testing.assert_array_equal(volume.label, ours(seg))


def test_resample_puts_a_shifted_modality_and_segmentation_on_the_first_modalitys_grid(tmp_path):
    folder = tmp_path / "Case_1"
    images, seg = write_brats_case(folder, np.random.default_rng(24))
    one_voxel_on = AFFINE.copy()
    one_voxel_on[:3, 3] += AFFINE[:3, 0]  # voxel i of these files lies where voxel i + 1 of the flair lies
    write_nifti(folder / "Case_1_t1ce.nii.gz", images[2], one_voxel_on)
    write_nifti(folder / "Case_1_seg.nii.gz", seg, one_voxel_on)
    with pytest.raises(DataError, match="voxel grid differs"):
        load_case(only_case(tmp_path))
    volume = load_case(only_case(tmp_path), resample=True)
    expected_t1ce = np.zeros(SHAPE, dtype=np.float32)
    expected_t1ce[1:] = images[2][:-1]
    np.testing.assert_allclose(volume.image[2], expected_t1ce, atol=1e-3)
    expected_seg = np.zeros(SHAPE, dtype=np.uint8)
    expected_seg[1:] = ours(seg)[:-1]
    np.testing.assert_array_equal(volume.label, expected_seg)
    np.testing.assert_array_equal(volume.image[[0, 1, 3]], images[[0, 1, 3]].astype(np.float32))


def test_deeply_nested_dataset_json_is_one_line_not_a_recursion_error(tmp_path):
    write_msd(tmp_path, np.random.default_rng(25))
    (tmp_path / "dataset.json").write_text('{"training": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match=r"dataset\.json: not a readable JSON file \(nested too deeply"):
        find_cases(tmp_path)


@pytest.mark.parametrize("shape, images, message", [
    # (issue 32, item 8: both were read, the first scoring Dice 1.0 and HD95 0 on its empty masks)
    ((1, 1, 1), lambda rng, shape: random_images(rng, shape), "a volume of 1 x 1 x 1 voxels; expected at least 4 along each axis"),
    (SHAPE, lambda rng, shape: np.zeros((4, *shape), dtype=np.int16),
     "and the case's other sequences: every voxel of every sequence holds 0: images without signal, nothing to segment"),
])
def test_a_degenerate_volume_is_refused_naming_its_file(tmp_path, shape, images, message):
    rng = np.random.default_rng(0)
    folder = tmp_path / "HGG" / "Brats17_TCIA_1_1"
    for modality, volume in zip(MODALITIES, images(rng, shape)):
        write_nifti(folder / f"{folder.name}_{modality}.nii.gz", volume)
    seg = np.zeros(shape, dtype=np.uint8)
    seg[tuple(side // 2 for side in shape)] = 4  # a tumour voxel in the segmentation
    write_nifti(folder / f"{folder.name}_seg.nii.gz", seg)
    with pytest.raises(DataError) as info:
        load_case(only_case(tmp_path))
    assert str(info.value) == f"{folder / f'{folder.name}_flair.nii.gz'}" + (": " if shape == (1, 1, 1) else " ") + message + (
        " (a brain MRI is about 240 x 240 x 155 at 1 mm)" if shape == (1, 1, 1) else ""), info.value
