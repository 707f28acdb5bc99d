"""Two-dimensional axial patches from multi-modal MRI volumes.

The BraTS task trains on 64x64 axial patches (pFedNet, section VI-A), drawn
both around the tumour and from tumour-free brain tissue so that a model
sees healthy anatomy too. Intensities are z-scored per case and modality
over the brain (non-zero voxels), the usual BraTS normalisation; background
stays exactly 0, and so does a missing (zero-filled) sequence.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import maximum_filter


def zscore_over_brain(image: np.ndarray) -> np.ndarray:
    """Z-score each modality over the brain mask.

    Args:
        image: float32 ``(C, X, Y, Z)`` raw intensities; background is 0 in
            every modality (BraTS volumes are skull-stripped).

    Returns:
        float32 ``(C, X, Y, Z)``: inside the brain ``(v - mean_c) / std_c``,
        outside 0. A modality that is constant over the brain maps to 0.
    """
    brain = (image != 0).any(axis=0)
    out = np.zeros_like(image, dtype=np.float32)
    if not brain.any():
        return out
    values = image[:, brain].astype(np.float64)  # (C, n_brain)
    mean = values.mean(axis=1, keepdims=True)
    std = values.std(axis=1, keepdims=True)
    out[:, brain] = np.where(std > 0, (values - mean) / np.where(std > 0, std, 1.0), 0.0).astype(np.float32)
    return out


def sample_centres(candidates: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` voxel indices (without replacement when possible) where ``candidates`` is True.

    Returns:
        int64 ``(n, 3)`` voxel coordinates, or ``(0, 3)`` if there are no candidates.
    """
    coords = np.argwhere(candidates)
    if len(coords) == 0 or n <= 0:
        return np.zeros((0, 3), dtype=np.int64)
    chosen = rng.choice(len(coords), size=n, replace=len(coords) < n)
    return coords[chosen].astype(np.int64)


def tumour_free_centres(brain: np.ndarray, tumour: np.ndarray, patch_size: int) -> np.ndarray:
    """Brain voxels whose ``patch_size`` x ``patch_size`` axial patch contains no tumour.

    Args:
        brain: bool ``(X, Y, Z)`` brain mask.
        tumour: bool ``(X, Y, Z)`` tumour mask.
        patch_size: side of the square patch, voxels.

    Returns:
        bool ``(X, Y, Z)`` mask of valid centres.
    """
    near_tumour = maximum_filter(tumour.astype(np.uint8), size=(patch_size + 1, patch_size + 1, 1), mode="constant") > 0
    return brain & ~near_tumour


def extract_axial_patches(image: np.ndarray, target: np.ndarray, centres: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut square axial patches centred on ``centres`` (zero padding outside the volume).

    Args:
        image: float32 ``(C, X, Y, Z)``.
        target: integer ``(X, Y, Z)``.
        centres: int ``(n, 3)`` voxel coordinates (x, y, z).
        patch_size: side P of the patch, voxels.

    Returns:
        ``x`` float32 ``(n, C, P, P)`` and ``y`` int64 ``(n, P, P)``; patch
        pixel (i, j) is voxel (cx - P//2 + i, cy - P//2 + j, cz).
    """
    half = patch_size // 2
    padded_image = np.pad(image, ((0, 0), (half, half), (half, half), (0, 0)))
    padded_target = np.pad(target, ((half, half), (half, half), (0, 0)))
    offsets = np.arange(patch_size)
    xs = (centres[:, 0, None, None] + offsets[None, :, None])  # (n, P, 1) in padded coordinates
    ys = (centres[:, 1, None, None] + offsets[None, None, :])  # (n, 1, P)
    zs = centres[:, 2, None, None]  # (n, 1, 1)
    x = padded_image[:, xs, ys, zs]  # (C, n, P, P)
    y = padded_target[xs, ys, zs]  # (n, P, P)
    return np.ascontiguousarray(x.transpose(1, 0, 2, 3), dtype=np.float32), y.astype(np.int64)
