"""Tiny BraTS-style files written with nibabel, shared by the reader and task tests."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np

from medfed.data.brats import MODALITIES

SHAPE = (8, 8, 6)
AFFINE = np.array([[-1.0, 0, 0, 90], [0, -1.0, 0, 126], [0, 0, 1.0, -72], [0, 0, 0, 1]])


def write_nifti(path, data, affine=AFFINE):
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), path)
    return path


def random_images(rng, shape=SHAPE):
    """int16 (4, X, Y, Z), each modality in its own intensity range so a mix-up shows."""
    return np.stack([rng.integers(1000 * m, 1000 * m + 500, size=shape, dtype=np.int16) for m in range(4)])


MSD_NAMES = {"flair": "FLAIR", "t1": "T1w", "t1ce": "t1gd", "t2": "T2w"}  # as in the real dataset.json
REAL_MSD_MODALITY = {str(channel): MSD_NAMES[m] for channel, m in enumerate(MODALITIES)}
REAL_MSD_LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}


def write_msd(root, rng, *, disk_order=MODALITIES):
    """Two training cases and one test case, channels stored in ``disk_order``.

    Returns {case_id: (images in MODALITIES order, raw MSD label)}.
    """
    written = {}
    training = []
    for number in (2, 1, 3):
        case_id = f"BRATS_{number:03d}"
        images = random_images(rng).astype(np.float32)
        on_disk = np.stack([images[MODALITIES.index(m)] for m in disk_order], axis=-1)
        label = rng.integers(0, 4, size=SHAPE, dtype=np.uint8)
        folder = "imagesTs" if number == 3 else "imagesTr"
        write_nifti(root / folder / f"{case_id}.nii.gz", on_disk)
        (root / folder / f"._{case_id}.nii.gz").write_bytes(b"\x00\x05\x16\x07")
        if number != 3:
            write_nifti(root / "labelsTr" / f"{case_id}.nii.gz", label)
            (root / "labelsTr" / f"._{case_id}.nii.gz").write_bytes(b"\x00\x05\x16\x07")
            training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
        written[case_id] = (images, label)
    spec = {
        "name": "BRATS",
        "tensorImageSize": "4D",
        "modality": {str(channel): MSD_NAMES[m] for channel, m in enumerate(disk_order)},
        "labels": REAL_MSD_LABELS,
        "numTraining": 2,
        "numTest": 1,
        "training": training,
        "test": ["./imagesTs/BRATS_003.nii.gz"],
    }
    (root / "dataset.json").write_text(json.dumps(spec))
    return written
