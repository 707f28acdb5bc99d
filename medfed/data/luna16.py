"""LUNA16 nodule candidates: read the challenge layout and cut 2-D axial patches.

The LUNA16 challenge (https://luna16.grand-challenge.org/Data/) distributes

* ``root/subset0`` ... ``root/subset9``: one MetaImage per CT series,
  ``<seriesuid>.mhd`` (text header) next to the voxel data file it names in its
  ``ElementDataFile`` key (``<seriesuid>.raw``, int16 Hounsfield units);
* ``root/candidates.csv`` or ``root/candidates_V2.csv``: the candidate list of
  the false-positive-reduction track, header ``seriesuid,coordX,coordY,coordZ,class``,
  one row per candidate, centre in world millimetres, ``class`` 1 = nodule;
* optionally ``root/annotations.csv``: the radiologists' nodules,
  header ``seriesuid,coordX,coordY,coordZ,diameter_mm``.

pFedNet (section VI-A) classifies each candidate from a 32 x 32 patch around it.
:func:`select_candidates` reads the CSV and chooses the candidates without
opening a volume (so a task can plan its federation first);
:func:`cut_candidate_patches` then reads every series once through SimpleITK,
maps all of its candidates from world millimetres to voxels with the header's
origin, spacing and direction matrix, and cuts the axial patches of all of them
at once. Patch values are Hounsfield units clipped to [-1000, 400] and scaled to
[0, 1]; the candidate's voxel is the patch pixel ``[patch_size // 2, patch_size // 2]``.

Orientation: a volume whose direction matrix is not the identity is first
reoriented (a permutation and flip of its axes, no resampling: ``sitk.DICOMOrient``
to ``LPS``, ITK's identity orientation), so every patch is axial with columns
running along +x (patient right to left) and rows along +y (anterior to
posterior), whatever axis order the file was stored in. The real LUNA16 files
already have identity directions; other MetaImage data need not.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from medfed.data.csv_rows import read_csv_rows
from medfed.errors import DataError

if TYPE_CHECKING:  # SimpleITK is imported where series are read: the other tasks run without it
    import SimpleITK as sitk

CANDIDATES_HEADER = ("seriesuid", "coordX", "coordY", "coordZ", "class")
ANNOTATIONS_HEADER = ("seriesuid", "coordX", "coordY", "coordZ", "diameter_mm")
CANDIDATES_FILE_NAMES = ("candidates_V2.csv", "candidates.csv")  # first one found is used
HU_WINDOW = (-1000.0, 400.0)  # Hounsfield units mapped to 0 and 1
PAD_HU = -1000  # value of patch pixels beyond the volume's in-plane edge (air)


@dataclass(frozen=True)
class CandidateTable:
    """The rows of a LUNA16 candidates CSV, in file order.

    Attributes:
        series_uids: str (n,), the series each candidate belongs to.
        world_mm: float64 (n, 3), candidate centre (x, y, z) in world millimetres.
        labels: int64 (n,), 1 = nodule, 0 = not a nodule.
    """

    series_uids: np.ndarray
    world_mm: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class NoduleAnnotations:
    """The rows of a LUNA16 annotations CSV, in file order.

    Attributes:
        series_uids: str (n,), the series each nodule belongs to.
        world_mm: float64 (n, 3), nodule centre (x, y, z) in world millimetres.
        diameter_mm: float64 (n,), nodule diameter in millimetres.
    """

    series_uids: np.ndarray
    world_mm: np.ndarray
    diameter_mm: np.ndarray

    def __len__(self) -> int:
        return len(self.diameter_mm)


@dataclass(frozen=True)
class NoduleCandidates:
    """Candidate patches ready for a classifier, in candidates-CSV order.

    Attributes:
        patches: float32 (n, patch_size, patch_size) in [0, 1]: axial slice
            through the candidate, HU clipped to [-1000, 400] and scaled.
        labels: int64 (n,), 1 = nodule, 0 = not a nodule.
        series_uids: str (n,), the series each candidate comes from.
        world_mm: float64 (n, 3), candidate centre (x, y, z) in world millimetres.
    """

    patches: np.ndarray
    labels: np.ndarray
    series_uids: np.ndarray
    world_mm: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def find_series(root: str | Path) -> dict[str, Path]:
    """Map each series uid to its ``.mhd`` header over ``root/subset*/``.

    Raises:
        DataError: ``root`` is not a directory, holds no ``subset*/*.mhd``, or
            two subsets hold the same series uid.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: LUNA16 root directory not found")
    series: dict[str, Path] = {}
    for path in sorted(root.glob("subset*/*.mhd")):
        if path.stem in series:
            raise DataError(f"{root}: series {path.stem} appears twice, in {series[path.stem]} and {path}")
        series[path.stem] = path
    if not series:
        raise DataError(f"{root}: no subset*/<seriesuid>.mhd files found (expected the LUNA16 layout)")
    return series


def read_candidates_csv(path: str | Path) -> CandidateTable:
    """Read a LUNA16 ``candidates.csv`` / ``candidates_V2.csv``.

    Raises:
        DataError: the file is missing or empty, its header is not
            ``seriesuid,coordX,coordY,coordZ,class``, a row has another number
            of fields, a coordinate is not a finite number, or a class is not 0 or 1.
    """
    path = Path(path)
    uids, values, line_numbers = _read_uid_and_numbers(path, CANDIDATES_HEADER)
    labels = values[:, 3]
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if bad.size:
        raise DataError(f"{path}, line {line_numbers[bad[0]]}: class must be 0 or 1, found {labels[bad[0]]:g}")
    return CandidateTable(series_uids=uids, world_mm=values[:, :3], labels=labels.astype(np.int64))


def read_annotations_csv(path: str | Path) -> NoduleAnnotations:
    """Read a LUNA16 ``annotations.csv`` (the radiologists' nodules).

    Raises:
        DataError: the file is missing or empty, its header is not
            ``seriesuid,coordX,coordY,coordZ,diameter_mm``, a value is not a
            finite number, or a diameter is not positive.
    """
    path = Path(path)
    uids, values, line_numbers = _read_uid_and_numbers(path, ANNOTATIONS_HEADER)
    diameters = values[:, 3]
    bad = np.flatnonzero(diameters <= 0)
    if bad.size:
        raise DataError(
            f"{path}, line {line_numbers[bad[0]]}: diameter_mm must be positive, found {diameters[bad[0]]:g}"
        )
    return NoduleAnnotations(series_uids=uids, world_mm=values[:, :3], diameter_mm=diameters)


def world_to_voxel(world_xyz, origin, spacing, direction) -> np.ndarray:
    """Continuous voxel indices of world points, as ITK defines the geometry.

    ITK maps an index i = (i_x, i_y, i_z) to the world point
    ``origin + direction @ diag(spacing) @ i``; this inverts that map.

    Args:
        world_xyz: (n, 3) or (3,) world coordinates (x, y, z) in millimetres.
        origin: (3,) world position of voxel (0, 0, 0) in millimetres.
        spacing: (3,) voxel size along the x, y, z index axes in millimetres.
        direction: 9 numbers in row-major order (SimpleITK's ``GetDirection()``)
            or a 3 x 3 matrix whose columns are the index axes in world space.

    Returns:
        float64 (n, 3) continuous indices in SimpleITK's (x, y, z) order;
        ``np.rint`` gives the nearest voxel, and numpy arrays from
        ``sitk.GetArrayFromImage`` are indexed ``[z, y, x]``.
    """
    world = np.atleast_2d(np.asarray(world_xyz, dtype=np.float64))
    origin = np.asarray(origin, dtype=np.float64)
    spacing = np.asarray(spacing, dtype=np.float64)
    matrix = np.asarray(direction, dtype=np.float64).reshape(3, 3)
    # world - origin = direction @ (spacing * index)  =>  index = solve(direction, world - origin) / spacing
    return np.linalg.solve(matrix, (world - origin).T).T / spacing


def hu_to_unit_interval(hu: np.ndarray) -> np.ndarray:
    """Clip Hounsfield units to [-1000, 400] and scale them to float32 [0, 1]."""
    low, high = HU_WINDOW
    return ((np.clip(hu, low, high) - low) / (high - low)).astype(np.float32)


@dataclass(frozen=True)
class CandidateSelection:
    """The candidates to cut, chosen from the CSV and the file names before any volume is read.

    Attributes:
        csv_path: the candidates CSV.
        table: every row of it.
        keep: bool (n,), the rows that are cut: every nodule, and the
            non-nodules left by the per-series subsampling.
        series_paths: ``{series uid: .mhd header}`` of every series with a kept candidate.
    """

    csv_path: Path
    table: CandidateTable
    keep: np.ndarray
    series_paths: dict[str, Path]

    @property
    def labels(self) -> np.ndarray:
        """int64 (n_kept,), the kept candidates' labels, in CSV order (as :class:`NoduleCandidates` will hold them)."""
        return self.table.labels[self.keep]

    @property
    def series_uids(self) -> np.ndarray:
        """str (n_kept,), the kept candidates' series, in CSV order."""
        return self.table.series_uids[self.keep]

    def input_files(self) -> list[Path]:
        """The files the patches are cut from: the CSV, and each series' header and voxel data file."""
        return [self.csv_path, *(path for header in self.series_paths.values() for path in series_files(header))]


def series_files(mhd_path: Path) -> list[Path]:
    """A series' files: its ``.mhd`` header and, when the header names one, its voxel data file (``ElementDataFile``)."""
    data_file = _element_data_file(mhd_path)
    return [mhd_path] if data_file is None else [mhd_path, data_file]


def select_candidates(
    root: str | Path,
    *,
    candidates_csv: str | Path | None = None,
    max_negatives_per_series: int | None = None,
    seed: int = 0,
) -> CandidateSelection:
    """Read the candidates CSV, check its series exist, and choose the candidates to cut; reads no volume.

    Args:
        root: directory holding ``subset*/`` and the candidates CSV.
        candidates_csv: candidates file; default ``root/candidates_V2.csv``,
            else ``root/candidates.csv``.
        max_negatives_per_series: keep at most this many class-0 candidates
            per series, drawn uniformly with a seed of the series' own (from
            ``seed`` and its uid: a series keeps the same candidates whatever
            other series the data set holds); all positives are kept;
            ``None`` keeps every candidate. Real LUNA16 has 551k candidates
            (2.3 GB of float32 32 x 32 patches), 1.2k of them nodules.
        seed: seed of the negative subsampling.

    Raises:
        DataError: naming the file, for a missing or malformed CSV, or a
            candidate of a series not found under ``subset*/``.
    """
    if max_negatives_per_series is not None and max_negatives_per_series < 0:
        raise ValueError(f"max_negatives_per_series must be >= 0 or None, got {max_negatives_per_series}")
    root = Path(root)
    csv_path = _candidates_csv_path(root, candidates_csv)
    table = read_candidates_csv(csv_path)
    series_paths = find_series(root)
    unknown = sorted(set(table.series_uids.tolist()) - series_paths.keys())
    if unknown:
        raise DataError(
            f"{csv_path}: {len(unknown)} candidate series not found under {root}/subset*/, e.g. {unknown[0]}"
        )
    keep = _keep_mask(table.labels, *_rows_by_series(table), max_negatives_per_series, seed)
    kept_series = sorted(set(table.series_uids[keep].tolist()))
    return CandidateSelection(csv_path, table, keep, {uid: series_paths[uid] for uid in kept_series})


def cut_candidate_patches(selection: CandidateSelection, *, patch_size: int = 32, progress: bool = True) -> NoduleCandidates:
    """Cut an axial patch around every selected candidate.

    Each series is read once; all of its candidates are located and cut
    together. Patch pixels beyond the volume's in-plane edge are air
    (-1000 HU); a candidate whose centre lies outside the volume is an error.

    Args:
        selection: from :func:`select_candidates`.
        patch_size: patch side in voxels (pFedNet: 32).
        progress: show a tqdm bar over series.

    Returns:
        The kept candidates in candidates-CSV order.

    Raises:
        DataError: naming the file, for a candidate outside its volume, a
            missing voxel data file, or an unreadable MetaImage.
    """
    import SimpleITK as sitk

    if patch_size < 1:
        raise ValueError(f"patch_size must be a positive number of voxels, got {patch_size}")
    table, keep = selection.table, selection.keep
    output_position = np.cumsum(keep) - 1
    patches = np.empty((int(keep.sum()), patch_size, patch_size), dtype=np.float32)
    for uid, rows in tqdm(list(zip(*_rows_by_series(table))), desc="LUNA16 series", unit="series", disable=not progress):
        kept = keep[rows]
        if not kept.any():
            continue
        mhd_path = selection.series_paths[uid]
        image = _read_axial_image(mhd_path)
        # every candidate of a series that is read is checked, also negatives left out by the subsampling
        voxels = _nearest_voxels_inside(image, table.world_mm[rows], mhd_path, selection.csv_path)
        volume = sitk.GetArrayViewFromImage(image)  # (z, y, x)
        patches[output_position[rows[kept]]] = hu_to_unit_interval(_axial_patches(volume, voxels[kept], patch_size))

    return NoduleCandidates(
        patches=patches,
        labels=table.labels[keep],
        series_uids=table.series_uids[keep],
        world_mm=table.world_mm[keep],
    )


def extract_candidate_patches(
    root: str | Path,
    *,
    candidates_csv: str | Path | None = None,
    patch_size: int = 32,
    max_negatives_per_series: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> NoduleCandidates:
    """:func:`select_candidates` then :func:`cut_candidate_patches` (see them for the arguments and errors)."""
    selection = select_candidates(
        root, candidates_csv=candidates_csv, max_negatives_per_series=max_negatives_per_series, seed=seed
    )
    return cut_candidate_patches(selection, patch_size=patch_size, progress=progress)


def _rows_by_series(table: CandidateTable) -> tuple[np.ndarray, list[np.ndarray]]:
    """The series uids in sorted order, and for each the indices of its rows (in file order)."""
    order = np.argsort(table.series_uids, kind="stable")
    uids_in_order, starts = np.unique(table.series_uids[order], return_index=True)
    return uids_in_order, np.split(order, starts[1:])


def _read_uid_and_numbers(path: Path, header: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of a LUNA16 CSV: str (n,) series uids, float64 (n, columns - 1) finite numbers, int (n,) line numbers."""
    found, numbered_rows = read_csv_rows(path)
    if found is None or tuple(field.strip() for field in found) != header:
        raise DataError(f"{path}: expected the header {','.join(header)}, found {found}")
    if not numbered_rows:
        raise DataError(f"{path}: no rows after the header")
    for line_number, row in numbered_rows:
        if len(row) != len(header):
            raise DataError(f"{path}, line {line_number}: expected {len(header)} fields, found {row}")
    line_numbers, rows = zip(*numbered_rows)
    columns = list(zip(*rows))
    values = np.empty((len(rows), len(header) - 1))
    for k, column in enumerate(columns[1:]):
        try:
            values[:, k] = np.fromiter(map(float, column), dtype=np.float64, count=len(column))
            bad = np.flatnonzero(~np.isfinite(values[:, k]))
        except ValueError:
            bad = [next(i for i, cell in enumerate(column) if not _is_number(cell))]
        if len(bad):
            raise DataError(
                f"{path}, line {line_numbers[bad[0]]}: {header[k + 1]} must be a finite number, "
                f"found {column[bad[0]].strip()!r}"
            )
    uids = np.array([uid.strip() for uid in columns[0]], dtype=str)
    return uids, values, np.array(line_numbers)


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _candidates_csv_path(root: Path, candidates_csv: str | Path | None) -> Path:
    if candidates_csv is not None:
        return Path(candidates_csv)
    for name in CANDIDATES_FILE_NAMES:
        if (root / name).is_file():
            return root / name
    raise DataError(f"{root}: no candidates file, expected one of {', '.join(CANDIDATES_FILE_NAMES)}")


def _keep_mask(
    labels: np.ndarray, uids: np.ndarray, rows_by_series: list[np.ndarray], max_negatives: int | None, seed: int
) -> np.ndarray:
    """bool (n,): every positive, and per series at most ``max_negatives`` negatives.

    Series ``uids[k]`` (rows ``rows_by_series[k]``, in file order) draws its
    negatives with a generator seeded by ``seed`` and its uid, so what it
    keeps depends neither on the file's order nor on the other series (a
    deployed site holding only its own series keeps what the simulator keeps).
    """
    if max_negatives is None:
        return np.ones(len(labels), dtype=bool)
    keep = labels == 1
    for uid, rows in zip(uids, rows_by_series, strict=True):
        negatives = rows[labels[rows] == 0]
        if negatives.size > max_negatives:
            rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(str(uid).encode())]))
            negatives = rng.choice(negatives, size=max_negatives, replace=False)
        keep[negatives] = True
    return keep


def _read_axial_image(mhd_path: Path) -> sitk.Image:
    """The series as a 3-D SimpleITK image in ITK's identity (LPS) axis orientation.

    The header is read first: the voxel bytes it claims must fit in the data
    file (:func:`_check_claimed_size`); after reading, a floating-point volume
    must be finite.
    """
    import SimpleITK as sitk

    try:
        reader = sitk.ImageFileReader()
        reader.SetFileName(str(mhd_path))
        reader.ReadImageInformation()
        if reader.GetDimension() == 3 and reader.GetNumberOfComponents() == 1:
            _check_claimed_size(mhd_path, reader)
        image = reader.Execute()
    except RuntimeError as error:
        data_file = _element_data_file(mhd_path)
        if data_file is not None and not data_file.is_file():
            raise DataError(f"{mhd_path}: its voxel data file {data_file} (ElementDataFile) does not exist") from None
        reason = " ".join(str(error).split())
        raise DataError(f"{mhd_path}: unreadable or corrupt MetaImage (SimpleITK: {reason})") from None
    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise DataError(
            f"{mhd_path}: expected a 3-D single-channel CT volume, found {image.GetDimension()}-D "
            f"with {image.GetNumberOfComponentsPerPixel()} components per voxel"
        )
    volume = sitk.GetArrayViewFromImage(image)
    if np.issubdtype(volume.dtype, np.floating):
        bad = volume.size - np.count_nonzero(np.isfinite(volume))
        if bad:
            raise DataError(f"{mhd_path}: {bad} of its {volume.size} voxels are NaN or infinite")
    if not np.allclose(image.GetDirection(), np.eye(3).ravel()):
        image = sitk.DICOMOrient(image, "LPS")
    return image


MAX_VOLUME_BYTES = 4 << 30
"""Largest CT volume read (4 GiB; a LUNA16 series is about 512 x 512 x 300 int16 voxels, 150 MiB)."""
DEFLATE_MAX_RATIO = 1032
"""The most a zlib stream expands: ``CompressedData = True`` data of n bytes hold at most about 1032 n bytes."""


def _check_claimed_size(mhd_path: Path, reader: sitk.ImageFileReader) -> None:
    """Refuse a MetaImage header whose size and element type claim more bytes than its data file holds, before reading them,
    or fewer than an uncompressed data file of its own holds (SimpleITK would read its first part as the whole volume)."""
    import SimpleITK as sitk

    itemsize = sitk.GetArrayViewFromImage(sitk.Image([1, 1, 1], reader.GetPixelID())).itemsize
    claimed = math.prod(reader.GetSize()) * itemsize
    data_file = _element_data_file(mhd_path) or mhd_path  # LOCAL: the voxels follow the header in the same file
    if not data_file.is_file():
        return  # SimpleITK's error is reported with the missing file named
    size = data_file.stat().st_size
    compressed = _header_value(mhd_path, "CompressedData").lower() == "true"
    room = size * DEFLATE_MAX_RATIO if compressed else size
    if claimed > min(room, MAX_VOLUME_BYTES):
        holds = f"its {size} compressed bytes hold at most {room}" if compressed else f"it has {size} bytes"
        raise DataError(
            f"{mhd_path}: unreadable or corrupt MetaImage: its header claims {claimed} bytes of voxels (size {tuple(reader.GetSize())}, "
            f"{sitk.GetPixelIDValueAsString(reader.GetPixelID())}) in {data_file.name}, but {holds}"
            + (f" (and medfed reads at most {MAX_VOLUME_BYTES})" if claimed > MAX_VOLUME_BYTES else "")
            + "; a damaged or crafted header"
        )
    header_size = _header_value(mhd_path, "HeaderSize")
    if compressed or data_file == mhd_path or header_size == "-1":
        return  # a compressed stream's size, or where the voxels begin, is not known from the header
    skipped = int(header_size) if header_size.isdigit() else 0
    if claimed + skipped < size:
        raise DataError(
            f"{mhd_path}: its header claims {claimed} bytes of voxels (DimSize {tuple(reader.GetSize())}, "
            f"{sitk.GetPixelIDValueAsString(reader.GetPixelID())}{f', HeaderSize {skipped}' if skipped else ''}) but {data_file.name} "
            f"has {size} bytes: a DimSize smaller than its data would read part of it as the whole volume; a damaged header, "
            "or the header of another file"
        )


def _header_value(mhd_path: Path, key: str) -> str:
    """The value of ``key = value`` in a MetaImage header ("" when absent)."""
    try:
        with open(mhd_path, "rb") as file:
            lines = file.read(1 << 16).decode("utf-8", errors="replace").splitlines()  # a header is a few hundred bytes
    except OSError:
        return ""
    for line in lines:
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    return ""


def _element_data_file(mhd_path: Path) -> Path | None:
    """The voxel data file a MetaImage header names, or None when it names none (``LOCAL``, lists, patterns)."""
    value = _header_value(mhd_path, "ElementDataFile")
    if value in ("", "LOCAL") or value.startswith("LIST") or "%" in value:
        return None
    return mhd_path.parent / value


def _nearest_voxels_inside(image: sitk.Image, world_mm: np.ndarray, mhd_path: Path, csv_path: Path) -> np.ndarray:
    """int64 (n, 3) nearest voxel (x, y, z) of each world point; DataError if one lies outside the volume."""
    index = world_to_voxel(world_mm, image.GetOrigin(), image.GetSpacing(), image.GetDirection())
    voxels = np.rint(index).astype(np.int64)
    size = np.array(image.GetSize())
    outside = np.flatnonzero(((voxels < 0) | (voxels >= size)).any(axis=1))
    if outside.size:
        first = outside[0]
        raise DataError(
            f"{csv_path}: {outside.size} candidate(s) lie outside the volume {mhd_path}, e.g. world "
            f"{tuple(np.round(world_mm[first], 2))} mm -> voxel {tuple(voxels[first])}, volume size {tuple(size)}"
        )
    return voxels


def _axial_patches(volume_zyx: np.ndarray, voxels_xyz: np.ndarray, patch_size: int) -> np.ndarray:
    """(n, patch_size, patch_size) HU of the axial slices through each voxel, air beyond the in-plane edge.

    Patch pixel [r, c] is volume[z, y + r - patch_size // 2, x + c - patch_size // 2].
    """
    depth, height, width = volume_zyx.shape
    offsets = np.arange(patch_size) - patch_size // 2
    rows = voxels_xyz[:, 1, None] + offsets  # (n, p)
    columns = voxels_xyz[:, 0, None] + offsets  # (n, p)
    inside = ((rows >= 0) & (rows < height))[:, :, None] & ((columns >= 0) & (columns < width))[:, None, :]
    patches = volume_zyx[
        voxels_xyz[:, 2, None, None],
        np.clip(rows, 0, height - 1)[:, :, None],
        np.clip(columns, 0, width - 1)[:, None, :],
    ]
    return np.where(inside, patches, PAD_HU)
