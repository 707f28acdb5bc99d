"""Reader for BraTS brain-tumour MRI in the layouts users download.

Four on-disk layouts are recognised (checked in this order):

``msd``
    Medical Segmentation Decathlon ``Task01_BrainTumour``: ``root/dataset.json``
    lists ``imagesTr/*.nii.gz`` (one 4-D file per case, X x Y x Z x 4) with
    ``labelsTr/*.nii.gz``, and ``imagesTs/*.nii.gz`` without labels. The
    channel order and the meaning of the label values are read, by name, from
    dataset.json.
``brats2017``
    BraTS 2017-2019: ``root/HGG|LGG/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz``.
``brats2020``
    BraTS 2020/2021: ``root/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii[.gz]``.
``brats2023``
    BraTS 2023 (and the 2024 releases named the same way):
    ``root/<case>/<case>-{t2f,t1n,t1c,t2w,seg}.nii[.gz]`` with t2f = FLAIR,
    t1n = T1, t1c = T1ce, t2w = T2, and ``<case>`` = ``BraTS-<set>-<id>-<visit>``.

Every visible sub-folder of ``root`` (or of ``HGG``/``LGG``) is a case
folder and must hold its case's files; files at ``root`` such as
``name_mapping.csv`` are ignored, and so are names starting with ``.``
(including macOS ``._*`` resource forks, shipped in the MSD archive) and
``__MACOSX`` folders.

Segmentation values: BraTS 2017-2021 use {0, 1, 2, 4} (4 = enhancing; the
value 3 was retired in 2017 and is rejected). BraTS 2023 renumbered enhancing
to 3: {0, 1, 2, 3} = background, necrotic / non-enhancing tumour core (NCR,
NETC), oedema / surrounding FLAIR hyperintensity (ED, SNFH), enhancing tumour
(ET), the convention of the 2023 glioma (GLI), sub-Saharan Africa (SSA),
meningioma (MEN) and metastasis (MET) sets, which the challenge's own
evaluation shares (whole tumour 1-3, core 1 and 3, enhancing 3). BraTS-PED
files are rejected: the 2023 paediatric release used that convention, the 2024
one numbers ET, NET, CC, ED as 1-4, and both name their files alike.

A case's modalities and segmentation must share one voxel grid (the
commonest silent error in imaging data: a sequence flipped or shifted, a
segmentation drawn on another series). Their affines are compared with
:func:`grid_difference`: with ``T = inv(A_first) @ A_other`` the voxel map
between them, the grids agree when ``T``'s linear part is the identity within
:data:`GRID_DIRECTION_TOLERANCE` (direction and spacing, relative) and its
translation within :data:`GRID_OFFSET_TOLERANCE` voxels. Otherwise
:func:`load_case` refuses the case in one line naming both files and the
difference, or, with ``resample=True`` (``data.resample: true``), resamples the
other file onto the first modality's grid (linear for images, nearest
neighbour for the segmentation).

Every volume's header is checked before its voxels are read: the bytes its
shape and data type claim must fit in the file (for ``.nii.gz``, within
deflate's largest compression ratio of the file's size) and in
:data:`MAX_VOLUME_BYTES`, so a few hundred crafted bytes cannot make the
reader allocate terabytes. ``dataset.json`` is read with bounded size and
nesting.

Every layout is converted to medfed's convention: images are float32
``(4, X, Y, Z)`` in :data:`MODALITIES` order, labels are uint8
:class:`TumourLabel` values. :func:`find_cases` lists the labelled cases, the
ones a federation trains and tests on; :func:`find_unlabelled_cases` lists the
others (MSD ``imagesTs``, validation releases), for prediction.
"""

from __future__ import annotations

import enum
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError

from medfed.errors import DataError

MODALITIES = ("flair", "t1", "t1ce", "t2")
"""Channel order of every image array medfed produces."""


class TumourLabel(enum.IntEnum):
    """Voxel classes of medfed's label arrays."""

    BACKGROUND = 0
    NECROTIC_CORE = 1  # necrotic and non-enhancing tumour core (NCR/NET)
    OEDEMA = 2
    ENHANCING = 3


WHOLE_TUMOUR = (TumourLabel.NECROTIC_CORE, TumourLabel.OEDEMA, TumourLabel.ENHANCING)
TUMOUR_CORE = (TumourLabel.NECROTIC_CORE, TumourLabel.ENHANCING)
ENHANCING_TUMOUR = (TumourLabel.ENHANCING,)

BRATS_LABEL_CODES = (
    (0, TumourLabel.BACKGROUND),
    (1, TumourLabel.NECROTIC_CORE),
    (2, TumourLabel.OEDEMA),
    (4, TumourLabel.ENHANCING),
)
"""(value in a BraTS 2017-2021 segmentation file, TumourLabel) pairs."""

BRATS2023_LABEL_CODES = (
    (0, TumourLabel.BACKGROUND),
    (1, TumourLabel.NECROTIC_CORE),  # NCR (GLI, SSA) / NETC (MEN, MET)
    (2, TumourLabel.OEDEMA),  # ED (GLI, SSA) / SNFH (MEN, MET)
    (3, TumourLabel.ENHANCING),
)
"""(value in a BraTS 2023 segmentation file, TumourLabel) pairs, for :data:`BRATS2023_SETS`."""

BRATS2023_SETS = ("GLI", "SSA", "MEN", "MET")
"""BraTS 2023 challenge sets (``BraTS-<set>-...`` case names) whose labels are :data:`BRATS2023_LABEL_CODES`."""

_BRATS2023_UNSUPPORTED_SETS = {
    "PED": "the 2023 paediatric release numbers NCR, ED, ET as 1-3 and the 2024 one ET, NET, CC, ED as 1-4 "
    "under the same file names, so the label convention of these files cannot be told",
}

GRID_OFFSET_TOLERANCE = 1e-3
"""Largest shift between two files' grids, in voxels of the first, that still counts as one grid."""
GRID_DIRECTION_TOLERANCE = 1e-4
"""Largest difference of the voxel map's linear part from the identity (direction cosines, relative spacing)."""
MAX_VOLUME_BYTES = 4 << 30
"""Largest volume read (4 GiB; a BraTS case is 4 x 36 MB of float32)."""
DEFLATE_MAX_RATIO = 1032
"""The most a deflate (gzip) stream can expand: a .nii.gz of n bytes holds at most about 1032 n bytes."""
MAX_DATASET_JSON_BYTES = 16 << 20
"""Largest dataset.json read (the MSD BraTS one is about 100 kB)."""

_NIFTI_SUFFIXES = (".nii.gz", ".nii")
_INVALID = 255  # marks label-file values outside a layout's convention in a lookup table

# Names used in MSD dataset.json files, compared after lower-casing and dropping
# everything but letters and digits.
_MSD_MODALITY_NAMES = {
    "flair": "flair",
    "t1": "t1",
    "t1w": "t1",
    "t1gd": "t1ce",
    "t1ce": "t1ce",
    "t1c": "t1ce",
    "t2": "t2",
    "t2w": "t2",
}
_MSD_LABEL_NAMES = {
    "background": TumourLabel.BACKGROUND,
    "edema": TumourLabel.OEDEMA,
    "oedema": TumourLabel.OEDEMA,
    "nonenhancingtumor": TumourLabel.NECROTIC_CORE,
    "nonenhancingtumour": TumourLabel.NECROTIC_CORE,
    "necrosis": TumourLabel.NECROTIC_CORE,
    "necroticcore": TumourLabel.NECROTIC_CORE,
    "enhancingtumor": TumourLabel.ENHANCING,
    "enhancingtumour": TumourLabel.ENHANCING,
}



@dataclass(frozen=True)
class _FileNaming:
    """How a release names a case's files: ``<case><separator><key>.nii[.gz]``, one key per modality."""

    release: str
    separator: str
    keys: tuple[str, ...]  # in MODALITIES order

    def pattern(self, case_id: str) -> str:
        return f"{case_id}{self.separator}{{{','.join(self.keys)},seg}}.nii[.gz] ({self.release})"


_BRATS2017_NAMING = _FileNaming("BraTS 2017-2021", "_", MODALITIES)
_NAMINGS = {
    "brats2017": _BRATS2017_NAMING,
    "brats2020": _BRATS2017_NAMING,
    "brats2023": _FileNaming("BraTS 2023", "-", ("t2f", "t1n", "t1c", "t2w")),
}

_LAYOUTS_LOOKED_FOR = (
    "MSD Task01_BrainTumour (root/dataset.json with imagesTr/, labelsTr/, imagesTs/); "
    "BraTS 2017-2019 (root/HGG|LGG/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz); "
    "BraTS 2020/2021 (root/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii[.gz]); "
    "BraTS 2023 (root/<case>/<case>-{t2f,t1n,t1c,t2w,seg}.nii[.gz])"
)


REGIONS = ("wt", "tc", "et")
"""The BraTS evaluation regions: whole tumour, tumour core, enhancing tumour."""


def tumour_regions(label: np.ndarray) -> np.ndarray:
    """uint8 ``(3, *label.shape)``: the WT, TC and ET masks of a :class:`TumourLabel` array (nested: ET in TC in WT)."""
    return np.stack([whole_tumour(label), tumour_core(label), enhancing_tumour(label)]).astype(np.uint8)


def whole_tumour(label: np.ndarray) -> np.ndarray:
    """Whole-tumour mask (necrotic core, oedema and enhancing): bool, same shape as ``label``."""
    return np.isin(label, WHOLE_TUMOUR)


def tumour_core(label: np.ndarray) -> np.ndarray:
    """Tumour-core mask (necrotic core and enhancing): bool, same shape as ``label``."""
    return np.isin(label, TUMOUR_CORE)


def enhancing_tumour(label: np.ndarray) -> np.ndarray:
    """Enhancing-tumour mask: bool, same shape as ``label``."""
    return np.isin(label, ENHANCING_TUMOUR)


@dataclass(frozen=True)
class BratsCase:
    """Where one case's files are and how to interpret them.

    Attributes:
        case_id: the case folder name (BraTS) or file name without suffix (MSD).
        layout: ``"brats2017"``, ``"brats2020"``, ``"brats2023"``, ``"msd"`` or ``"files"`` (four files given one by one).
        image_files: four files in :data:`MODALITIES` order, or one 4-D file (MSD).
        label_file: the segmentation, or None where the data set has no labels
            (e.g. MSD ``imagesTs``, BraTS validation releases).
        grade: ``"HGG"`` / ``"LGG"`` for the 2017-2019 layout, else None.
        label_codes: ``(value in label_file, TumourLabel)`` for every allowed value.
        channel_index: for a single 4-D image file, the index along its last
            axis of each modality in :data:`MODALITIES` order; None otherwise.
    """

    case_id: str
    layout: str
    image_files: tuple[Path, ...]
    label_file: Path | None
    grade: str | None
    label_codes: tuple[tuple[int, TumourLabel], ...] = BRATS_LABEL_CODES
    channel_index: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BratsVolume:
    """One case in medfed's convention.

    Attributes:
        case_id: as in :class:`BratsCase`.
        image: float32 ``(4, X, Y, Z)``, :data:`MODALITIES` order, raw scanner intensities.
        label: uint8 ``(X, Y, Z)`` of :class:`TumourLabel` values, or None when
            the case has no label file.
        affine: float64 ``(4, 4)`` voxel index -> world coordinates (mm), from
            the first image file.
    """

    case_id: str
    image: np.ndarray
    label: np.ndarray | None
    affine: np.ndarray


def find_cases(root: str | Path) -> list[BratsCase]:
    """List every labelled case under ``root`` (the cases a federation uses), detecting the layout; sorted by case_id.

    Raises:
        DataError: ``root`` is missing, matches none of the layouts, has no
            labelled case, a case folder lacks its files, a case lacks a
            modality file, dataset.json is malformed or uses unknown names,
            only some BraTS case folders have segmentations, or a BraTS 2023
            case belongs to a set whose label convention is unsupported.
    """
    root = Path(root)
    cases = _find_all_cases(root)
    labelled = [case for case in cases if case.label_file is not None]
    if not labelled:
        raise DataError(
            f"{root}: none of its {len(cases)} cases has a segmentation (a validation or test release?); "
            "a federation needs labelled cases"
        )
    return labelled


def find_unlabelled_cases(root: str | Path) -> list[BratsCase]:
    """List the cases under ``root`` without a segmentation, sorted by case_id (e.g. for prediction).

    These are MSD ``imagesTs`` (dataset.json's "test" list) and BraTS
    validation releases; :func:`load_case` reads them with ``label=None``.

    Raises:
        DataError: as :func:`find_cases`, except that a data set without
            unlabelled cases gives an empty list.
    """
    return [case for case in _find_all_cases(Path(root)) if case.label_file is None]


def case_from_paths(paths: list[Path]) -> BratsCase:
    """One case given as its folder (BraTS 2017-2021 or 2023 naming) or as four files in :data:`MODALITIES` order.

    Used to read a new scan (``medfed predict``); a segmentation in the folder is listed but not needed.

    Raises:
        DataError: a path is missing, the folder holds no BraTS case files, or
            neither one folder nor four files were given.
    """
    paths = [Path(path) for path in paths]
    missing = [path for path in paths if not path.exists()]
    if missing:
        raise DataError(f"{missing[0]}: not found")
    if len(paths) == 1 and paths[0].is_dir():
        return _case_from_folder(paths[0], ("brats2020", "brats2023"), None)
    if len(paths) == len(MODALITIES) and all(path.is_file() for path in paths):
        case_id = paths[0].name.split(".nii")[0]
        return BratsCase(case_id=case_id, layout="files", image_files=tuple(paths), label_file=None, grade=None)
    raise DataError(
        f"{', '.join(map(str, paths))}: expected one case folder or four NIfTI files in the order {', '.join(MODALITIES)}"
    )


def load_case(case: BratsCase, resample: bool = False) -> BratsVolume:
    """Read one case's images and label into medfed's convention.

    Args:
        case: where the files are.
        resample: a modality or segmentation on another grid than the first
            modality's is resampled onto it (linear / nearest neighbour)
            instead of refused.

    Raises:
        DataError: a file is missing or unreadable, its header claims more
            voxels than the file holds, the modalities or the label disagree
            in shape or grid (affine), voxels are NaN/Inf, the label holds
            values outside the layout's convention, or the volume is degenerate
            (:func:`_check_degenerate`). Each message names the file.
    """
    if case.channel_index is None:
        image, affine = _read_modality_files(case.image_files, resample)
    else:
        image, affine = _read_four_d_image(case.image_files[0], case.channel_index)
    _check_degenerate(case, image)
    label = None
    if case.label_file is not None:
        raw_label, label_affine = _read_nifti(case.label_file)
        if _grid_mismatch(case.image_files[0], affine, case.label_file, label_affine, resample):
            raw_label = _resampled(raw_label, label_affine, affine, image.shape[1:], order=0)
        if raw_label.shape != image.shape[1:]:
            raise DataError(
                f"{case.label_file}: label shape {raw_label.shape} differs from the image shape "
                f"{image.shape[1:]} of {case.image_files[0]}"
            )
        label = _to_tumour_labels(raw_label, case.label_codes, case.label_file)
    return BratsVolume(case_id=case.case_id, image=image, label=label, affine=affine)


MIN_VOLUME_SIDE = 4
"""The fewest voxels along each axis of a case: background, brain and a tumour inside it need at least that many; a
smaller volume (1 x 1 x 1) scores Dice 1 and HD95 0 on empty masks and would pass for a perfect result."""


def _check_degenerate(case: BratsCase, image: np.ndarray) -> None:
    """Refuse a volume no scan is: fewer than :data:`MIN_VOLUME_SIDE` voxels along an axis, or every sequence one value
    throughout (no signal; a tumour in its segmentation would be learned from nothing)."""
    shape = image.shape[1:]
    if min(shape) < MIN_VOLUME_SIDE:
        raise DataError(
            f"{case.image_files[0]}: a volume of {' x '.join(map(str, shape))} voxels; expected at least {MIN_VOLUME_SIDE} along "
            "each axis (a brain MRI is about 240 x 240 x 155 at 1 mm)"
        )
    flat = image.reshape(image.shape[0], -1)
    if (flat.max(axis=1) == flat.min(axis=1)).all():
        files = case.image_files[0] if len(case.image_files) == 1 else f"{case.image_files[0]} and the case's other sequences"
        raise DataError(f"{files}: every voxel of every sequence holds {float(flat[0, 0]):g}: images without signal, nothing to segment")


# --- layout detection -------------------------------------------------------


def _find_all_cases(root: Path) -> list[BratsCase]:
    """Every case, labelled or not, sorted by case_id."""
    if not root.is_dir():
        raise DataError(f"{root}: BraTS root folder not found")
    if (root / "dataset.json").is_file():
        cases = _find_msd_cases(root / "dataset.json")
    else:
        cases = _find_brats_cases(root)
    if not cases:
        raise DataError(f"{root}: no BraTS cases found; looked for {_LAYOUTS_LOOKED_FOR}")
    _check_case_ids_unique(root, cases)
    return sorted(cases, key=lambda case: case.case_id)


def _visible(path: Path) -> bool:
    return not path.name.startswith(".")


def _is_nifti(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_NIFTI_SUFFIXES)


def _find_brats_cases(root: Path) -> list[BratsCase]:
    """Cases of the 2017-2019 layout (``HGG``/``LGG`` folders) or else of the 2020/2021 or 2023 layout."""
    if (root / "HGG").is_dir() or (root / "LGG").is_dir():
        cases = [
            _case_from_folder(folder, ("brats2017",), grade)
            for grade in ("HGG", "LGG")
            if (root / grade).is_dir()
            for folder in _case_folders(root / grade)
        ]
    else:
        cases = [_case_from_folder(folder, ("brats2020", "brats2023"), None) for folder in _case_folders(root)]
    _check_labels_all_or_none(root, cases)
    return cases


def _case_folders(parent: Path) -> list[Path]:
    """Visible sub-folders of ``parent``, except macOS ``__MACOSX`` archive metadata."""
    return [folder for folder in sorted(parent.iterdir()) if folder.is_dir() and _visible(folder) and folder.name != "__MACOSX"]


def _case_from_folder(folder: Path, layouts: tuple[str, ...], grade: str | None) -> BratsCase:
    """A case folder ``<case>/<case><separator>{<modality keys>,seg}.nii[.gz]`` in the first of ``layouts`` it matches.

    Raises:
        DataError: the folder holds no modality file named as any of ``layouts`` names them, or lacks one.
    """
    case_id = folder.name
    matching = [
        layout
        for layout in layouts
        if any(_named_nifti(folder, f"{case_id}{_NAMINGS[layout].separator}{key}") for key in _NAMINGS[layout].keys)
    ]
    if not matching:
        expected = " or ".join(_NAMINGS[layout].pattern(case_id) for layout in layouts)
        raise DataError(f"{folder}: holds no BraTS case files; expected {expected}")
    layout = matching[0]
    naming = _NAMINGS[layout]
    label_codes = _brats2023_label_codes(folder) if layout == "brats2023" else BRATS_LABEL_CODES
    image_files = tuple(
        _required_nifti(folder, f"{case_id}{naming.separator}{key}", key if key == modality else f"{key} ({modality})")
        for key, modality in zip(naming.keys, MODALITIES)
    )
    seg_stem = f"{case_id}{naming.separator}seg"
    label_file = _named_nifti(folder, seg_stem) or _misnamed_segmentation(folder, image_files, seg_stem)
    return BratsCase(
        case_id=case_id, layout=layout, image_files=image_files, label_file=label_file, grade=grade, label_codes=label_codes
    )


def _brats2023_label_codes(folder: Path) -> tuple[tuple[int, TumourLabel], ...]:
    """The label codes of a BraTS 2023 case, from the challenge set in its name ``BraTS-<set>-...``."""
    parts = folder.name.split("-")
    challenge_set = parts[1] if len(parts) > 2 and parts[0] == "BraTS" else None
    if challenge_set in _BRATS2023_UNSUPPORTED_SETS:
        raise DataError(
            f"{folder}: the label convention of BraTS-{challenge_set} is unsupported: {_BRATS2023_UNSUPPORTED_SETS[challenge_set]}"
        )
    if challenge_set not in BRATS2023_SETS:
        raise DataError(
            f"{folder}: BraTS 2023 file names, but the case name does not say which challenge set (and so which "
            f"label convention) it is from; expected BraTS-<set>-<id>-<visit> with <set> one of {', '.join(BRATS2023_SETS)}"
        )
    return BRATS2023_LABEL_CODES


def _named_nifti(folder: Path, stem: str) -> Path | None:
    """``folder/<stem>.nii.gz`` or ``folder/<stem>.nii``, None when neither exists."""
    present = [path for path in (folder / f"{stem}{suffix}" for suffix in _NIFTI_SUFFIXES) if path.is_file()]
    if len(present) > 1:
        raise DataError(f"{folder}: both {present[0].name} and {present[1].name} exist; keep one")
    return present[0] if present else None


def _required_nifti(folder: Path, stem: str, kind: str) -> Path:
    """:func:`_named_nifti`, or a DataError naming the missing ``kind`` of image and its expected path."""
    path = _named_nifti(folder, stem)
    if path is None:
        raise DataError(f"{folder}: missing the {kind} image; expected {folder / stem}.nii.gz (or {stem}.nii)")
    return path


def _misnamed_segmentation(folder: Path, image_files: tuple[Path, ...], seg_stem: str) -> Path | None:
    """The single NIfTI file whose name contains "seg" (case-insensitive), if any.

    Accepts known misnamed segmentations such as BraTS 2020 case 355's
    ``W39_1998.09.19_Segm.nii``.
    """
    candidates = [
        path
        for path in sorted(folder.iterdir())
        if _visible(path) and _is_nifti(path) and "seg" in path.name.lower() and path not in image_files
    ]
    if len(candidates) > 1:
        names = ", ".join(path.name for path in candidates)
        raise DataError(f"{folder}: no {seg_stem}.nii[.gz] and several possible segmentations: {names}")
    return candidates[0] if candidates else None


def _find_msd_cases(dataset_json: Path) -> list[BratsCase]:
    """Cases listed in an MSD ``dataset.json`` ("training" with labels, "test" without)."""
    root = dataset_json.parent
    try:
        size = dataset_json.stat().st_size
        if size > MAX_DATASET_JSON_BYTES:
            raise DataError(f"{dataset_json}: {size} bytes, larger than any dataset.json medfed reads ({MAX_DATASET_JSON_BYTES})")
        spec = json.loads(dataset_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{dataset_json}: not a readable JSON file ({error})") from None
    except RecursionError:
        raise DataError(f"{dataset_json}: not a readable JSON file (nested too deeply to be a dataset.json)") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("training"), list):
        raise DataError(f"{dataset_json}: expected a JSON object with a 'training' list")
    channel_index = _msd_channel_index(dataset_json, spec)
    label_codes = _msd_label_codes(dataset_json, spec)
    cases = []
    for entry in spec["training"]:
        if not isinstance(entry, dict) or "image" not in entry or "label" not in entry:
            raise DataError(f"{dataset_json}: each 'training' entry must have 'image' and 'label', found {entry!r}")
        cases.append(_msd_case(dataset_json, root, entry["image"], entry["label"], channel_index, label_codes))
    test = spec.get("test", [])
    if not isinstance(test, list) or not all(isinstance(image, str) for image in test):
        raise DataError(f"{dataset_json}: 'test' must be a list of image paths, found {test!r}")
    for image in test:
        cases.append(_msd_case(dataset_json, root, image, None, channel_index, label_codes))
    return cases


def _msd_case(
    dataset_json: Path,
    root: Path,
    image: str,
    label: str | None,
    channel_index: tuple[int, ...],
    label_codes: tuple[tuple[int, TumourLabel], ...],
) -> BratsCase:
    image_file = root / image
    label_file = None if label is None else root / label
    for path in (image_file, label_file):
        if path is not None and not path.is_file():
            raise DataError(f"{dataset_json}: lists {path}, which does not exist")
    case_id = image_file.name.removesuffix(".gz").removesuffix(".nii")
    return BratsCase(
        case_id=case_id,
        layout="msd",
        image_files=(image_file,),
        label_file=label_file,
        grade=None,
        label_codes=label_codes,
        channel_index=channel_index,
    )


def _normalised_name(name: object) -> str:
    return "".join(character for character in str(name).lower() if character.isalnum())


def _msd_channel_index(dataset_json: Path, spec: dict) -> tuple[int, ...]:
    """Index along the 4-D image's last axis of each of MODALITIES, from dataset.json "modality"."""
    modality = spec.get("modality")
    if not isinstance(modality, dict):
        raise DataError(f"{dataset_json}: expected a 'modality' object such as {{\"0\": \"FLAIR\", ...}}")
    channel_of: dict[str, int] = {}
    for channel, name in modality.items():
        ours = _MSD_MODALITY_NAMES.get(_normalised_name(name))
        if ours is None or not str(channel).isdigit():
            raise DataError(
                f"{dataset_json}: modality {channel!r}: {name!r} is not understood; "
                f"expected integer channels named one of {sorted(_MSD_MODALITY_NAMES)}"
            )
        if ours in channel_of:
            raise DataError(f"{dataset_json}: two channels are {ours}: {channel_of[ours]} and {channel}")
        channel_of[ours] = int(channel)
    if sorted(channel_of.values()) != list(range(len(channel_of))) or set(channel_of) != set(MODALITIES):
        raise DataError(
            f"{dataset_json}: 'modality' must name channels 0..{len(MODALITIES) - 1} as "
            f"{', '.join(MODALITIES)} (in any order), found {modality}"
        )
    return tuple(channel_of[name] for name in MODALITIES)


def _msd_label_codes(dataset_json: Path, spec: dict) -> tuple[tuple[int, TumourLabel], ...]:
    """(file value, TumourLabel) pairs from dataset.json "labels", matched by name."""
    labels = spec.get("labels")
    if not isinstance(labels, dict):
        raise DataError(f"{dataset_json}: expected a 'labels' object such as {{\"0\": \"background\", ...}}")
    codes = []
    for value, name in labels.items():
        ours = _MSD_LABEL_NAMES.get(_normalised_name(name))
        if ours is None or not str(value).isdigit():
            raise DataError(
                f"{dataset_json}: label {value!r}: {name!r} is not understood; "
                f"expected integer values named one of {sorted(_MSD_LABEL_NAMES)}"
            )
        codes.append((int(value), ours))
    return tuple(sorted(codes))


def _check_case_ids_unique(root: Path, cases: list[BratsCase]) -> None:
    seen: dict[str, BratsCase] = {}
    for case in cases:
        if case.case_id in seen:
            raise DataError(
                f"{root}: case {case.case_id!r} appears twice: {seen[case.case_id].image_files[0]} "
                f"and {case.image_files[0]}"
            )
        seen[case.case_id] = case


def _check_labels_all_or_none(root: Path, cases: list[BratsCase]) -> None:
    """BraTS folders are either training data (all labelled) or validation data (none)."""
    unlabelled = [case.case_id for case in cases if case.label_file is None]
    if 0 < len(unlabelled) < len(cases):
        shown = ", ".join(unlabelled[:5]) + (" ..." if len(unlabelled) > 5 else "")
        raise DataError(
            f"{root}: {len(unlabelled)} of {len(cases)} cases have no segmentation "
            f"(<case>_seg.nii[.gz] or <case>-seg.nii[.gz]): {shown}"
        )


# --- reading ----------------------------------------------------------------


def _read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The voxel array (file dtype, scaling applied) and float64 (4, 4) affine of a NIfTI file, its size checked first."""
    try:
        image = nib.load(path)
        _check_claimed_size(path, image)
        data = np.asanyarray(image.dataobj)
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (ImageFileError, OSError, EOFError, zlib.error, ValueError) as error:
        raise DataError(f"{path}: cannot be read as NIfTI: {error}") from error
    return data, np.asarray(image.affine, dtype=np.float64)


def _check_claimed_size(path: Path, image: nib.Nifti1Image) -> None:
    """Refuse a header whose shape and data type claim more bytes than ``path`` can hold, before they are allocated."""
    header = image.header
    shape = header.get_data_shape()
    if any(side < 0 for side in shape):
        raise DataError(f"{path}: its header claims the shape {shape}")
    claimed = getattr(image.dataobj, "offset", 0) + math.prod(shape) * header.get_data_dtype().itemsize  # the image's header copy has offset 0
    size = path.stat().st_size
    compressed = path.name.endswith(".gz")
    room = size * DEFLATE_MAX_RATIO if compressed else size
    if claimed > min(room, MAX_VOLUME_BYTES):
        holds = f"a {size}-byte gzip file holds at most {room} bytes" if compressed else f"the file has {size} bytes"
        raise DataError(
            f"{path}: cannot be read as NIfTI: its header claims {claimed} bytes of voxels (shape {shape}, {header.get_data_dtype()}) but {holds}"
            + (f" (and medfed reads at most {MAX_VOLUME_BYTES})" if claimed > MAX_VOLUME_BYTES else "")
            + "; a damaged or crafted header"
        )


def grid_difference(affine: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """How far ``other``'s voxel grid is from ``affine``'s: (largest shift in voxels of ``affine``, largest linear deviation).

    With ``T = inv(affine) @ other`` (``other``'s voxel indices -> ``affine``'s),
    the shift is ``max |T[:3, 3]|`` and the linear deviation ``max |T[:3, :3] - I|``
    (direction cosines and relative spacing); both are 0 for one grid.
    """
    voxel_map = np.linalg.solve(affine, other)
    return float(np.abs(voxel_map[:3, 3]).max()), float(np.abs(voxel_map[:3, :3] - np.eye(3)).max())


def _grid_mismatch(first: Path, affine: np.ndarray, path: Path, other: np.ndarray, resample: bool) -> bool:
    """True when ``path`` (affine ``other``) must be resampled onto ``first``'s grid; DataError when it differs and ``resample`` is off."""
    shift, linear = grid_difference(affine, other)
    if shift <= GRID_OFFSET_TOLERANCE and linear <= GRID_DIRECTION_TOLERANCE:
        return False  # one grid (a shape difference is the shape checks')
    if resample:
        return True
    offset_mm = np.linalg.norm(other[:3, 3] - affine[:3, 3])
    axes = [_angle_degrees(affine[:3, k], other[:3, k]) for k in range(3)]
    raise DataError(
        f"{path}: its voxel grid differs from {first.name}'s (origins {offset_mm:.3g} mm apart, axes turned by up to "
        f"{max(axes):.3g} degrees, grids {shift:.3g} voxels apart; tolerance {GRID_OFFSET_TOLERANCE} voxel and "
        f"{GRID_DIRECTION_TOLERANCE} in direction); register the files, or set data.resample=true to resample onto {first.name}'s grid"
    )


def _angle_degrees(a: np.ndarray, b: np.ndarray) -> float:
    cosine = np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.degrees(np.arccos(np.clip(cosine, -1.0, 1.0))))


def _resampled(data: np.ndarray, affine: np.ndarray, target_affine: np.ndarray, target_shape: tuple[int, ...], order: int) -> np.ndarray:
    """``data`` (grid ``affine``) resampled onto ``target_affine``/``target_shape`` (order 0: nearest neighbour, 1: linear; 0 outside)."""
    from nibabel.processing import resample_from_to

    source = nib.Nifti1Image(np.asarray(data, dtype=np.float32 if order else data.dtype), affine)
    resampled = resample_from_to(source, (tuple(target_shape), target_affine), order=order, mode="constant", cval=0.0)
    return np.asarray(resampled.dataobj).astype(data.dtype if order == 0 else np.float32)


def _finite_float32(data: np.ndarray, path: Path) -> np.ndarray:
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf and is counted below
        array = np.asarray(data, dtype=np.float32)
    bad = array.size - np.count_nonzero(np.isfinite(array))
    if bad:
        raise DataError(f"{path}: {bad} voxels are NaN, infinite or beyond float32's range (|x| > 3.4e38)")
    return array


def _read_modality_files(files: tuple[Path, ...], resample: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Four 3-D files -> float32 (4, X, Y, Z) on the first file's grid, and its affine."""
    volumes = []
    affines = []
    for path in files:
        data, affine = _read_nifti(path)
        if data.ndim != 3:
            raise DataError(f"{path}: expected a 3-D image, found shape {data.shape}")
        volume = _finite_float32(data, path)
        if affines and _grid_mismatch(files[0], affines[0], path, affine, resample):
            volume = _resampled(volume, affine, affines[0], volumes[0].shape, order=1)
        volumes.append(volume)
        affines.append(affine)
    if len({volume.shape for volume in volumes}) > 1:
        listing = "; ".join(f"{path.name}: {volume.shape}" for path, volume in zip(files, volumes))
        raise DataError(f"{files[0].parent}: modalities differ in shape ({listing})")
    return np.stack(volumes), affines[0]


def _read_four_d_image(path: Path, channel_index: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One X x Y x Z x C file -> float32 (4, X, Y, Z) reordered to MODALITIES, and its affine."""
    data, affine = _read_nifti(path)
    if data.ndim != 4 or data.shape[-1] != len(channel_index):
        raise DataError(
            f"{path}: expected a 4-D image X x Y x Z x {len(channel_index)} "
            f"(one channel per modality in dataset.json), found shape {data.shape}"
        )
    channels_first = np.moveaxis(data, -1, 0)[list(channel_index)]
    return np.ascontiguousarray(_finite_float32(channels_first, path)), affine


def _to_tumour_labels(raw: np.ndarray, codes: tuple[tuple[int, TumourLabel], ...], path: Path) -> np.ndarray:
    """Map label-file values to uint8 TumourLabel values through a lookup table."""
    if raw.ndim != 3:
        raise DataError(f"{path}: expected a 3-D label volume, found shape {raw.shape}")
    if np.issubdtype(raw.dtype, np.floating):
        _finite_float32(raw, path)
    values = raw.astype(np.int64)
    lut = np.full(max(code for code, _ in codes) + 1, _INVALID, dtype=np.uint8)
    for code, label in codes:
        lut[code] = label
    in_range = (values >= 0) & (values < lut.size)
    mapped = lut[np.where(in_range, values, 0)]
    invalid = ~in_range | (mapped == _INVALID) | (values != raw)
    if invalid.any():
        bad = np.unique(raw[invalid])
        shown = ", ".join(f"{value:g}" for value in bad[:10]) + (" ..." if bad.size > 10 else "")
        allowed = ", ".join(f"{code} ({label.name.lower()})" for code, label in codes)
        raise DataError(f"{path}: label values {shown} are not allowed; expected only {allowed}")
    return mapped
