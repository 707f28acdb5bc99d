import numpy as np
import pytest
import SimpleITK as sitk

from medfed.data.luna16 import (
    extract_candidate_patches,
    find_series,
    hu_to_unit_interval,
    read_annotations_csv,
    read_candidates_csv,
    world_to_voxel,
)
from medfed.errors import DataError

FLIP_X = (-1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
IDENTITY = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


def write_series(root, uid, volume_zyx, *, origin=(-40.0, -30.0, -100.0), spacing=(0.7, 0.8, 2.0),
                 direction=IDENTITY, subset=0):
    """Write an int16 volume as root/subset<k>/<uid>.mhd + .raw; return the SimpleITK image."""
    image = sitk.GetImageFromArray(np.asarray(volume_zyx, dtype=np.int16))
    image.SetOrigin(origin)
    image.SetSpacing(spacing)
    image.SetDirection(direction)
    folder = root / f"subset{subset}"
    folder.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(folder / f"{uid}.mhd"))
    return image


def write_candidates(path, rows, header="seriesuid,coordX,coordY,coordZ,class"):
    lines = [header] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def world_of_index(image, index_xyz):
    return image.TransformIndexToPhysicalPoint(tuple(int(i) for i in index_xyz))


def brute_force_patch(volume_zyx, voxel_xyz, size):
    """Reference: one pixel at a time, air outside the in-plane edge."""
    x, y, z = voxel_xyz
    patch = np.full((size, size), -1000.0)
    for r in range(size):
        for c in range(size):
            yy, xx = y + r - size // 2, x + c - size // 2
            if 0 <= yy < volume_zyx.shape[1] and 0 <= xx < volume_zyx.shape[2]:
                patch[r, c] = volume_zyx[z, yy, xx]
    return patch


def test_world_to_voxel_matches_simpleitk_for_flipped_and_oblique_directions():
    rng = np.random.default_rng(0)
    angle = 0.3
    oblique = (np.cos(angle), -np.sin(angle), 0.0, np.sin(angle), np.cos(angle), 0.0, 0.0, 0.0, -1.0)
    for direction in (IDENTITY, FLIP_X, oblique):
        image = sitk.Image(20, 30, 10, sitk.sitkInt16)
        image.SetOrigin((12.5, -7.0, 300.0))
        image.SetSpacing((0.6, 0.9, 2.5))
        image.SetDirection(direction)
        points = rng.uniform(-50, 50, size=(7, 3)) + np.array([12.5, -7.0, 300.0])
        expected = np.array([image.TransformPhysicalPointToContinuousIndex(tuple(p)) for p in points])
        got = world_to_voxel(points, image.GetOrigin(), image.GetSpacing(), image.GetDirection())
        np.testing.assert_allclose(got, expected, atol=1e-9)


def test_hu_window():
    hu = np.array([-3000.0, -1000.0, -300.0, 400.0, 2000.0])
    np.testing.assert_allclose(hu_to_unit_interval(hu), [0.0, 0.0, 0.5, 1.0, 1.0])


def test_bright_voxel_lands_at_patch_centre_with_flipped_axis(tmp_path):
    volume = np.zeros((6, 40, 50), dtype=np.int16)  # soft tissue, 0 HU
    bright = (31, 20, 4)  # (x, y, z) index; the patch stays inside the 50 x 40 slice
    volume[bright[2], bright[1], bright[0]] = 400
    image = write_series(tmp_path, "1.2.3", volume, direction=FLIP_X)
    centre = world_of_index(image, bright)
    write_candidates(tmp_path / "candidates.csv", [("1.2.3", *centre, 1)])
    result = extract_candidate_patches(tmp_path, progress=False)
    patch = result.patches[0]
    assert patch.shape == (32, 32) and patch.dtype == np.float32
    assert patch[16, 16] == 1.0
    others = np.delete(patch.ravel(), 16 * 32 + 16)
    np.testing.assert_allclose(others, 1000 / 1400, rtol=1e-6)  # 0 HU everywhere else, no air padding needed
    np.testing.assert_allclose(result.world_mm[0], centre)
    assert result.labels.tolist() == [1] and result.series_uids.tolist() == ["1.2.3"]


def test_flipped_file_gives_the_same_patches_as_identity_file(tmp_path):
    rng = np.random.default_rng(1)
    volume = rng.integers(-1000, 400, size=(5, 36, 44)).astype(np.int16)
    spacing = (0.7, 0.8, 2.0)
    origin = (-40.0, -30.0, -100.0)
    identity = write_series(tmp_path, "9.1", volume, origin=origin, spacing=spacing)
    # the same world content stored with the x axis reversed
    flipped_origin = (origin[0] + (volume.shape[2] - 1) * spacing[0], origin[1], origin[2])
    write_series(tmp_path, "9.2", volume[:, :, ::-1], origin=flipped_origin, spacing=spacing, direction=FLIP_X)
    points = [world_of_index(identity, index) for index in [(3, 4, 0), (20, 18, 2), (43, 35, 4)]]
    write_candidates(tmp_path / "candidates.csv",
                     [("9.1", *p, 0) for p in points] + [("9.2", *p, 0) for p in points])
    result = extract_candidate_patches(tmp_path, progress=False)
    np.testing.assert_array_equal(result.patches[:3], result.patches[3:])


def test_patches_match_brute_force_including_edges(tmp_path):
    rng = np.random.default_rng(2)
    volume = rng.integers(-1200, 900, size=(4, 30, 40)).astype(np.int16)
    image = write_series(tmp_path, "5.5", volume, subset=3)
    indices = [(0, 0, 0), (39, 29, 3), (20, 15, 1), (5, 28, 2)]
    # off-grid world points round to the nearest voxel
    jitter = np.array([0.3, -0.35, 0.9])
    rows = [("5.5", *(np.array(world_of_index(image, i)) + jitter), 0) for i in indices]
    write_candidates(tmp_path / "candidates_V2.csv", rows)
    result = extract_candidate_patches(tmp_path, patch_size=9, progress=False)
    for patch, index in zip(result.patches, indices):
        np.testing.assert_allclose(patch, hu_to_unit_interval(brute_force_patch(volume, index, 9)))


def test_candidates_v2_is_preferred_and_order_is_kept(tmp_path):
    volume = np.zeros((3, 20, 20), dtype=np.int16)
    a = write_series(tmp_path, "1.1", volume)
    b = write_series(tmp_path, "1.0", volume, subset=1)
    p, q = world_of_index(a, (5, 5, 1)), world_of_index(b, (6, 6, 2))
    write_candidates(tmp_path / "candidates.csv", [("missing.series", *p, 0)])  # would fail if read
    write_candidates(tmp_path / "candidates_V2.csv", [("1.1", *p, 0), ("1.0", *q, 1), ("1.1", *q, 0)])
    result = extract_candidate_patches(tmp_path, progress=False)
    assert result.series_uids.tolist() == ["1.1", "1.0", "1.1"]
    assert result.labels.tolist() == [0, 1, 0]
    assert set(find_series(tmp_path)) == {"1.0", "1.1"}


def test_negative_subsampling_keeps_all_positives_and_is_seeded(tmp_path):
    volume = np.zeros((3, 20, 20), dtype=np.int16)
    rows = []
    for k, uid in enumerate(["2.1", "2.2"]):
        image = write_series(tmp_path, uid, volume, subset=k)
        rows += [(uid, *world_of_index(image, (i, 3, 1)), 0) for i in range(12)]
        rows += [(uid, *world_of_index(image, (i, 9, 1)), 1) for i in range(2)]
    write_candidates(tmp_path / "candidates.csv", rows)

    def draw(seed):
        return extract_candidate_patches(tmp_path, max_negatives_per_series=5, seed=seed, progress=False)

    first, again, other = draw(0), draw(0), draw(1)
    for uid in ["2.1", "2.2"]:
        labels = first.labels[first.series_uids == uid]
        assert (labels == 1).sum() == 2 and (labels == 0).sum() == 5
    np.testing.assert_array_equal(first.world_mm, again.world_mm)
    assert not np.array_equal(first.world_mm, other.world_mm)


def test_read_annotations(tmp_path):
    path = tmp_path / "annotations.csv"
    path.write_text("seriesuid,coordX,coordY,coordZ,diameter_mm\n1.2,-1.5,2,3.25,5.5\n")
    annotations = read_annotations_csv(path)
    assert annotations.series_uids.tolist() == ["1.2"]
    np.testing.assert_array_equal(annotations.world_mm, [[-1.5, 2.0, 3.25]])
    np.testing.assert_array_equal(annotations.diameter_mm, [5.5])
    path.write_text("seriesuid,coordX,coordY,coordZ,diameter_mm\n1.2,-1.5,2,3.25,0\n")
    with pytest.raises(DataError, match="diameter_mm must be positive"):
        read_annotations_csv(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("seriesuid,x,y,z,class\n1.2,0,0,0,1\n", "expected the header"),
        ("seriesuid,coordX,coordY,coordZ,class\n1.2,abc,0,0,1\n", "line 2: coordX must be a finite number, found 'abc"),
        ("seriesuid,coordX,coordY,coordZ,class\n1.2,0,0,0,1\n1.2,0,0,nan,1\n", "line 3: coordZ must be a finite"),
        ("seriesuid,coordX,coordY,coordZ,class\n1.2,0,0,0,2\n", "class must be 0 or 1, found 2"),
        ("seriesuid,coordX,coordY,coordZ,class\n1.2,0,0,0\n", "expected 5 fields"),
        ("seriesuid,coordX,coordY,coordZ,class\n", "no rows"),
    ],
)
def test_bad_candidates_csv_names_the_file(tmp_path, text, message):
    path = tmp_path / "candidates.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as info:
        read_candidates_csv(path)
    assert str(path) in str(info.value)


@pytest.fixture
def one_series(tmp_path):
    image = write_series(tmp_path, "7.7", np.zeros((3, 20, 20), dtype=np.int16))
    return tmp_path, image


def test_unknown_series_is_an_error(one_series):
    root, image = one_series
    write_candidates(root / "candidates.csv", [("7.8", *world_of_index(image, (1, 1, 1)), 0)])
    with pytest.raises(DataError, match="not found under .*e.g. 7.8") as info:
        extract_candidate_patches(root, progress=False)
    assert str(root / "candidates.csv") in str(info.value)


def test_candidate_outside_volume_is_an_error(one_series):
    root, image = one_series
    outside = np.array(world_of_index(image, (1, 1, 2))) + np.array([0.0, 0.0, 2.0])  # one slice past the end
    write_candidates(root / "candidates.csv", [("7.7", *outside, 0)])
    with pytest.raises(DataError, match="outside the volume") as info:
        extract_candidate_patches(root, progress=False)
    assert "7.7.mhd" in str(info.value)
    # also when negative subsampling would drop the bad candidate
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 1), ("7.7", *outside, 0)])
    with pytest.raises(DataError, match="outside the volume"):
        extract_candidate_patches(root, max_negatives_per_series=0, progress=False)


def test_missing_raw_names_the_data_file(one_series):
    root, image = one_series
    (root / "subset0" / "7.7.raw").unlink()
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    with pytest.raises(DataError, match=r"7\.7\.raw \(ElementDataFile\) does not exist"):
        extract_candidate_patches(root, progress=False)


def test_truncated_raw_is_an_error(one_series):
    root, image = one_series
    raw = root / "subset0" / "7.7.raw"
    raw.write_bytes(raw.read_bytes()[:100])
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    with pytest.raises(DataError, match="unreadable or corrupt MetaImage") as info:
        extract_candidate_patches(root, progress=False)
    assert "7.7.mhd" in str(info.value)


def test_missing_layout_and_candidates_are_errors(tmp_path):
    with pytest.raises(DataError, match="no subset"):
        find_series(tmp_path)
    with pytest.raises(DataError, match="not found"):
        find_series(tmp_path / "absent")
    write_series(tmp_path, "3.3", np.zeros((2, 4, 4), dtype=np.int16))
    with pytest.raises(DataError, match="no candidates file"):
        extract_candidate_patches(tmp_path, progress=False)


# --- hostile headers and volumes (issue 24) -----------------------------------------------------------


@pytest.mark.parametrize(
    "dim_size, compressed, claimed",
    [("100000 100000 100000", False, 2 * 10**15), ("1024 1024 768", True, 1024 * 1024 * 768 * 2)],
    ids=["2PB-raw", "1.5GiB-compressed"],
)
def test_a_metaimage_header_claiming_more_than_its_data_file_is_refused_before_reading(one_series, dim_size, compressed, claimed):
    import tracemalloc
    import zlib

    root, image = one_series
    mhd = root / "subset0" / "7.7.mhd"
    raw = root / "subset0" / "7.7.raw"
    text = mhd.read_text()
    lines = [line for line in text.splitlines() if not line.startswith(("DimSize", "CompressedData", "CompressedDataSize"))]
    lines.insert(-1, f"DimSize = {dim_size}")
    if compressed:
        raw.write_bytes(zlib.compress(b"\x00" * 1000))
        lines.insert(-1, "CompressedData = True")
        lines.insert(-1, f"CompressedDataSize = {raw.stat().st_size}")
    mhd.write_text("\n".join(lines) + "\n")
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            extract_candidate_patches(root, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(f"{mhd}: unreadable or corrupt MetaImage: its header claims {claimed} bytes of voxels")
    assert f"7.7.raw, but it{'s' if compressed else ''} " in message and f"{raw.stat().st_size}" in message
    assert peak < 20 * 2**20


def test_a_float_volume_of_nan_is_refused_naming_the_file(tmp_path):
    volume = np.zeros((3, 20, 20), dtype=np.float32)
    volume[1, 5:9, 5:9] = np.nan
    image = sitk.GetImageFromArray(volume)
    (tmp_path / "subset0").mkdir()
    sitk.WriteImage(image, str(tmp_path / "subset0" / "7.7.mhd"))
    write_candidates(tmp_path / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    with pytest.raises(DataError, match=r"7\.7\.mhd: 16 of its 1200 voxels are NaN or infinite"):
        extract_candidate_patches(tmp_path, progress=False)


def test_a_finite_float_volume_is_read(tmp_path):
    volume = np.full((3, 20, 20), -500.0, dtype=np.float32)
    image = sitk.GetImageFromArray(volume)
    (tmp_path / "subset0").mkdir()
    sitk.WriteImage(image, str(tmp_path / "subset0" / "7.7.mhd"))
    write_candidates(tmp_path / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    patches = extract_candidate_patches(tmp_path, progress=False).patches
    np.testing.assert_allclose(patches[0, 16:20, 16:20], hu_to_unit_interval(np.array(-500.0)))


def test_candidates_csv_with_a_byte_order_mark_reads_as_without(one_series):
    root, image = one_series
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 1)])
    plain = extract_candidate_patches(root, progress=False)
    (root / "candidates.csv").write_bytes(b"\xef\xbb\xbf" + (root / "candidates.csv").read_bytes())
    with_bom = extract_candidate_patches(root, progress=False)
    np.testing.assert_array_equal(plain.patches, with_bom.patches)
    assert list(with_bom.series_uids) == ["7.7"] and list(with_bom.labels) == [1]


def test_a_metaimage_dim_size_smaller_than_its_raw_file_is_refused_not_read_as_a_part(one_series):
    # (issue 32, item 8: a DimSize smaller than its .raw was read silently, its first bytes taken as the whole volume)
    root, image = one_series
    mhd = root / "subset0" / "7.7.mhd"
    raw = root / "subset0" / "7.7.raw"
    size = image.GetSize()
    smaller = f"{size[0]} {size[1]} {size[2] - 1}"
    mhd.write_text("\n".join(f"DimSize = {smaller}" if line.startswith("DimSize") else line for line in mhd.read_text().splitlines()) + "\n")
    write_candidates(root / "candidates.csv", [("7.7", *world_of_index(image, (1, 1, 1)), 0)])
    with pytest.raises(DataError) as info:
        extract_candidate_patches(root, progress=False)
    claimed = size[0] * size[1] * (size[2] - 1) * 2
    assert str(info.value) == (
        f"{mhd}: its header claims {claimed} bytes of voxels (DimSize ({smaller.replace(' ', ', ')}), 16-bit signed integer) but 7.7.raw "
        f"has {raw.stat().st_size} bytes: a DimSize smaller than its data would read part of it as the whole volume; a damaged header, "
        "or the header of another file"
    )
