"""Generated BraTS-like multi-site data: MNI152 anatomy, simulated gliomas, per-site scanners.

:func:`brats_phantoms` writes a data set in the BraTS 2017 layout
(``root/HGG|LGG/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz``, images int16,
segmentations uint8 with the BraTS values {0, 1, 2, 4}) that
:func:`medfed.data.brats.find_cases` reads like the real thing, plus
``partitioning.csv`` (FeTS format: which site each case comes from) and
``GENERATED.json`` (states that the data are generated and records every
parameter, the seed and each site's acquisition parameters).

How a case is made (all in relative signal units, white matter on T1 ~ 0.85):

1. Anatomy: the MNI152 2009 grey/white-matter maps and brain mask shipped in
   nilearn's wheel (CSF = brain mask minus GM minus WM), resampled to the
   requested resolution, then moved by a small random affine per subject
   (scale +-6 %, rotation +-4 degrees, shift +-4 mm).
2. Tumour: nested irregular regions (an ellipsoid whose surface is perturbed by
   smoothed noise) centred in deep white matter: a tumour core inside an oedema
   envelope; in high-grade (HGG) cases the core is an enhancing rim around a
   necrotic centre, in low-grade (LGG) cases it is non-enhancing tumour.
3. Contrast: each tissue and tumour class has a mean signal per modality
   (:data:`CLASS_SIGNAL`), mixed by partial volume.
4. Site: each site's scanner applies its own multiplicative bias field,
   Gaussian blur, Rician or Gaussian noise, and per-modality gain and offset
   (:class:`SiteAcquisition`); background outside the brain is 0
   (skull-stripped, as in BraTS).

Sites thus differ in acquisition while sharing anatomy and tumour biology:
a segmentation task where per-site personalisation matters.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import AbstractContextManager
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from medfed.data.brats import MODALITIES
from medfed.data.partition_csv import write_partition_csv
from medfed.data.phantoms.store import hold, write_marker
from medfed.data.phantoms.workers import map_cases

GENERATOR = "medfed.data.phantoms.brats"
GENERATOR_VERSION = 1
PARTITION_FILE = "partitioning.csv"

TISSUES = ("csf", "gm", "wm")
CLASS_SIGNAL = {
    # class:          flair  t1    t1ce  t2     (relative signal, MODALITIES order)
    "csf": (0.15, 0.25, 0.27, 1.00),
    "gm": (0.62, 0.60, 0.62, 0.55),
    "wm": (0.45, 0.85, 0.86, 0.35),
    "oedema": (0.95, 0.45, 0.47, 0.85),
    "necrosis": (0.40, 0.22, 0.24, 0.95),
    "enhancing": (0.75, 0.55, 1.35, 0.65),
    "non_enhancing": (0.85, 0.42, 0.44, 0.90),
}
"""Mean signal of each tissue/tumour class per modality. T1: WM > GM > CSF;
T2: CSF > GM > WM; FLAIR: CSF suppressed, GM > WM; oedema bright on FLAIR/T2
and dark on T1; the enhancing rim bright on T1ce only; necrosis dark on T1/T1ce
and bright on T2."""

# BraTS segmentation values written to disk.
SEG_NECROTIC, SEG_OEDEMA, SEG_ENHANCING = 1, 2, 4

OEDEMA_FRACTION = 0.75  # oedema signal = 25 % underlying tissue + 75 % oedema class
OEDEMA_MIN_WHITE_MATTER = 0.3  # oedema spreads along white matter, sparing cortex and CSF
SHAPE_IRREGULARITY = 0.3  # amplitude of the noise added to the normalised ellipsoid radius
SHAPE_NOISE_MM = 3.0  # correlation length (Gaussian sigma) of the shape noise
MIN_CORE_RADIUS_VOXELS = 3.0  # keeps necrosis and rim resolvable at coarse resolutions


@dataclasses.dataclass(frozen=True)
class Anatomy:
    """MNI152 tissue maps on a grid of the target resolution (RAS, mm).

    Attributes:
        tissue: float32 ``(3, X, Y, Z)`` partial volumes of :data:`TISSUES`.
        affine: float64 ``(4, 4)`` voxel -> MNI mm.
        centre_mm: float64 ``(3,)`` brain centroid, the centre of subject deformations.
        white_matter_mm: float64 ``(N, 3)`` world position of every voxel with WM > 0.5.
        white_matter_depth_mm: float64 ``(N,)`` their distance to the brain's outside.
    """

    tissue: np.ndarray
    affine: np.ndarray
    centre_mm: np.ndarray
    white_matter_mm: np.ndarray
    white_matter_depth_mm: np.ndarray


@dataclasses.dataclass(frozen=True)
class SiteAcquisition:
    """One site's scanner: how relative signal becomes stored int16 intensities.

    stored = gain * case_gain * modality_gain[m] * (noisy(blur(signal * bias)) + modality_offset[m])
    inside the brain, 0 outside. ``case_gain`` varies a little between subjects
    (log-normal, sigma :data:`CASE_GAIN_SIGMA`).

    Attributes:
        site: site number, 1-based.
        gain: global scanner units per unit of relative signal.
        modality_gain: per-modality factor, MODALITIES order.
        modality_offset: per-modality offset, relative signal units.
        bias_amplitude: largest |log bias| within +-:data:`BIAS_LENGTH_MM` of the
            scanner origin on each axis (about the brain's half width).
        bias_coefficients: coefficients (sum of |c| = 1) of the log-bias polynomial in the
            monomials :data:`BIAS_MONOMIALS` of scanner coordinates / BIAS_LENGTH_MM.
        noise_model: ``"rician"`` (magnitude images) or ``"gaussian"``.
        noise_sigma: noise standard deviation, relative signal units.
        blur_sigma_mm: Gaussian point-spread sigma, mm.
    """

    site: int
    gain: float
    modality_gain: tuple[float, ...]
    modality_offset: tuple[float, ...]
    bias_amplitude: float
    bias_coefficients: tuple[float, ...]
    noise_model: str
    noise_sigma: float
    blur_sigma_mm: float


BIAS_MONOMIALS = ("x", "y", "z", "x*x", "y*y", "z*z", "x*y", "x*z", "y*z")
BIAS_LENGTH_MM = 70.0
CASE_GAIN_SIGMA = 0.05


@dataclasses.dataclass(frozen=True)
class SimulatedCase:
    """One generated subject.

    Attributes:
        image: int16 ``(4, X, Y, Z)``, MODALITIES order, scanner units, 0 outside the brain.
        seg: uint8 ``(X, Y, Z)``, BraTS values {0, 1, 2, 4}.
        tissue: float32 ``(3, X, Y, Z)`` partial volumes of :data:`TISSUES` before the tumour.
        affine: float64 ``(4, 4)`` voxel -> mm.
    """

    image: np.ndarray
    seg: np.ndarray
    tissue: np.ndarray
    affine: np.ndarray


def brats_phantoms(
    root: str | Path,
    *,
    n_sites: int = 5,
    cases_per_site: int = 8,
    seed: int = 0,
    resolution_mm: float = 2.0,
    lgg_fraction: float = 0.25,
    progress: bool = True,
) -> AbstractContextManager[Path]:
    """A generated multi-site BraTS 2017-layout data set at ``root``, written unless it is there, held while a block reads it.

    Args:
        root: output folder. Replaced only if it is missing, empty, or an
            earlier output of this generator.
        n_sites: number of sites (partitions 1..n_sites).
        cases_per_site: subjects per site.
        seed: everything is drawn from it; the same seed gives identical arrays.
        resolution_mm: isotropic voxel size, 1 to 8 mm (BraTS: 1 mm).
        lgg_fraction: share of each site's cases that are low grade (rounded).
        progress: show a tqdm bar over cases.

    Returns:
        A context manager giving ``root`` as a Path; no other medfed run
        replaces the data set until its block ends
        (:func:`~medfed.data.phantoms.store.hold`). If ``root/GENERATED.json``
        records the same parameters and generator version and every file is
        present, nothing is rewritten. Otherwise the data set is written to a
        hidden sibling folder and renamed into place, so ``root`` never holds a
        partial data set.

    Raises:
        ValueError: an argument is out of range (the message names it).
        DataError: ``root`` exists and is not this generator's output (on entering the block).
    """
    parameters = _checked_parameters(n_sites, cases_per_site, seed, resolution_mm, lgg_fraction)
    return hold(root, GENERATOR, GENERATOR_VERSION, parameters, lambda folder: _write_data_set(folder, parameters, progress))


def generate_brats_phantoms(root: str | Path, **settings) -> Path:
    """Write (or reuse) the data set :func:`brats_phantoms` describes and return ``root``, not held (scripts, tests)."""
    with brats_phantoms(root, **settings) as path:
        return path


def draw_site_acquisition(seed: int, site: int) -> SiteAcquisition:
    """Site ``site``'s scanner parameters, drawn from ``seed`` (independent of the number of sites)."""
    rng = np.random.default_rng([seed, 0, site])
    coefficients = rng.standard_normal(len(BIAS_MONOMIALS))
    coefficients /= np.abs(coefficients).sum()
    return SiteAcquisition(
        site=site,
        gain=float(np.exp(rng.uniform(np.log(300.0), np.log(3000.0)))),
        modality_gain=tuple(float(g) for g in rng.uniform(0.7, 1.4, len(MODALITIES))),
        modality_offset=tuple(float(o) for o in rng.uniform(0.0, 0.1, len(MODALITIES))),
        bias_amplitude=float(rng.uniform(0.1, 0.35)),
        bias_coefficients=tuple(float(c) for c in coefficients),
        noise_model=str(rng.choice(["rician", "gaussian"])),
        noise_sigma=float(rng.uniform(0.01, 0.05)),
        blur_sigma_mm=float(rng.uniform(0.0, 1.5)),
    )


@functools.lru_cache(maxsize=2)
def load_anatomy(resolution_mm: float) -> Anatomy:
    """MNI152 CSF/GM/WM partial volumes at ``resolution_mm`` (cached; arrays are read-only).

    The 1 mm maps are low-pass filtered (Gaussian, FWHM ~ the new voxel size)
    before resampling, so coarse grids are not aliased.
    """
    from nilearn import datasets  # a heavy import (pandas, scikit-learn), needed only here

    grey_image = datasets.load_mni152_gm_template(resolution=1)
    grey = np.clip(np.asanyarray(grey_image.dataobj, dtype=np.float32), 0.0, 1.0)
    white = np.clip(np.asanyarray(datasets.load_mni152_wm_template(resolution=1).dataobj, dtype=np.float32), 0.0, 1.0)
    brain = np.asanyarray(datasets.load_mni152_brain_mask(resolution=1).dataobj).astype(np.float32)
    fine = np.stack([np.clip(brain - grey - white, 0.0, 1.0), grey, white])  # TISSUES order

    fine_affine = np.asarray(grey_image.affine, dtype=np.float64)
    scale = resolution_mm / np.abs(np.diag(fine_affine)[:3])
    sigma = np.sqrt(np.maximum(scale**2 - 1.0, 0.0)) / 2.355
    shape = tuple(int(n) for n in np.ceil(np.array(fine.shape[1:]) / scale))
    tissue = np.stack(
        [
            ndimage.affine_transform(
                ndimage.gaussian_filter(volume, sigma), scale, output_shape=shape, order=1
            )
            for volume in fine
        ]
    )
    affine = fine_affine @ np.diag([*scale, 1.0])

    inside = tissue.sum(axis=0) > 0.5
    depth_mm = ndimage.distance_transform_edt(inside, sampling=resolution_mm)
    white_voxels = np.argwhere(tissue[2] > 0.5)
    anatomy = Anatomy(
        tissue=tissue,
        affine=affine,
        centre_mm=_to_world(affine, np.argwhere(inside).mean(axis=0)),
        white_matter_mm=_to_world(affine, white_voxels),
        white_matter_depth_mm=depth_mm[tuple(white_voxels.T)],
    )
    for field in dataclasses.fields(anatomy):
        getattr(anatomy, field.name).flags.writeable = False  # shared by every caller of this cache
    return anatomy


def simulate_case(
    anatomy: Anatomy, acquisition: SiteAcquisition, *, grade: str, rng: np.random.Generator
) -> SimulatedCase:
    """One subject of grade ``"HGG"`` or ``"LGG"`` scanned at ``acquisition``'s site."""
    if grade not in ("HGG", "LGG"):
        raise ValueError(f"grade must be 'HGG' or 'LGG', got {grade!r}")
    resolution_mm = float(abs(anatomy.affine[0, 0]))
    subject_from_template = _random_subject_deformation(anatomy.centre_mm, rng)
    tissue = _warp_tissue(anatomy, subject_from_template)
    brain = tissue.sum(axis=0) > 0.5
    seg, signal = _tumour_and_signal(anatomy, tissue, brain, subject_from_template, grade, rng)
    image = _acquire(signal, brain, anatomy.affine, resolution_mm, acquisition, rng)
    return SimulatedCase(image=image, seg=seg, tissue=tissue, affine=anatomy.affine.copy())


# --- parameters, caching and the atomic swap ---------------------------------


def _checked_parameters(n_sites, cases_per_site, seed, resolution_mm, lgg_fraction) -> dict:
    def is_int(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    if not (is_int(n_sites) and n_sites >= 1):
        raise ValueError(f"n_sites must be an integer >= 1, got {n_sites!r}")
    if not (is_int(cases_per_site) and 1 <= cases_per_site <= 999):
        raise ValueError(f"cases_per_site must be an integer from 1 to 999, got {cases_per_site!r}")
    if not (is_int(seed) and seed >= 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if not 1.0 <= resolution_mm <= 8.0:
        raise ValueError(f"resolution_mm must be between 1 and 8 mm, got {resolution_mm!r}")
    if not 0.0 <= lgg_fraction <= 1.0:
        raise ValueError(f"lgg_fraction must be between 0 and 1, got {lgg_fraction!r}")
    return {
        "n_sites": int(n_sites),
        "cases_per_site": int(cases_per_site),
        "seed": int(seed),
        "resolution_mm": float(resolution_mm),
        "lgg_fraction": float(lgg_fraction),
    }


# --- writing the data set ---------------------------------------------------


def _case_plan(parameters: dict) -> list[tuple[str, int, int, str]]:
    """``(case_id, site, index_at_site, grade)`` for every case; LGG cases drawn per site."""
    cases_per_site = parameters["cases_per_site"]
    n_lgg = int(np.floor(parameters["lgg_fraction"] * cases_per_site + 0.5))
    plan = []
    for site in range(1, parameters["n_sites"] + 1):
        lgg = np.random.default_rng([parameters["seed"], 1, site]).permutation(cases_per_site)[:n_lgg]
        for index in range(cases_per_site):
            grade = "LGG" if index in lgg else "HGG"
            plan.append((f"Brats17_SYN{site}_{index + 1:03d}_1", site, index, grade))
    return plan


def _write_data_set(folder: Path, parameters: dict, progress: bool) -> None:
    anatomy = load_anatomy(parameters["resolution_mm"])
    sites = [draw_site_acquisition(parameters["seed"], site) for site in range(1, parameters["n_sites"] + 1)]
    plan = _case_plan(parameters)
    cases = [(folder, parameters["seed"], sites[site - 1], case_id, index, grade) for case_id, site, index, grade in plan]
    work = len(plan) * (2.0 / parameters["resolution_mm"]) ** 3  # in cases of the default 2 mm grid
    files = [name for written in map_cases(_write_case, cases, anatomy, work, "BraTS phantoms", progress) for name in written]
    write_partition_csv(folder / PARTITION_FILE, {case_id: site for case_id, site, _, _ in plan})
    n_lgg = sum(grade == "LGG" for *_, grade in plan)
    write_marker(
        folder,
        GENERATOR,
        GENERATOR_VERSION,
        parameters,
        description=(
            f"GENERATED BraTS-like data ({GENERATOR} v{GENERATOR_VERSION}): {parameters['n_sites']} sites x "
            f"{parameters['cases_per_site']} cases ({n_lgg} LGG), {parameters['resolution_mm']:g} mm, "
            f"seed {parameters['seed']}"
        ),
        notice=(
            "GENERATED DATA, not patient scans: brain anatomy from the MNI152 2009 template "
            "(nilearn), tumours, MRI contrasts and site scanner effects simulated by medfed. "
            "Label results computed on it as generated."
        ),
        layout="brats2017",
        class_signal=CLASS_SIGNAL,
        bias_monomials=BIAS_MONOMIALS,
        bias_length_mm=BIAS_LENGTH_MM,
        case_gain_sigma=CASE_GAIN_SIGMA,
        sites=[dataclasses.asdict(site) for site in sites],
        cases=[{"case_id": case_id, "site": site, "grade": grade} for case_id, site, _, grade in plan],
        files=[*files, PARTITION_FILE],
    )


def _write_case(anatomy: Anatomy, case: tuple[Path, int, SiteAcquisition, str, int, str]) -> list[str]:
    """Simulate one case (its own stream: seed, 2, site, index) and write its five NIfTI files; their names under the folder."""
    folder, seed, acquisition, case_id, index, grade = case
    rng = np.random.default_rng([seed, 2, acquisition.site, index])
    simulated = simulate_case(anatomy, acquisition, grade=grade, rng=rng)
    case_folder = folder / grade / case_id
    case_folder.mkdir(parents=True)
    files = []
    for kind, volume in [*zip(MODALITIES, simulated.image), ("seg", simulated.seg)]:
        path = case_folder / f"{case_id}_{kind}.nii.gz"
        image = nib.Nifti1Image(volume, simulated.affine)
        image.header.set_xyzt_units("mm")
        nib.save(image, path)
        files.append(path.relative_to(folder).as_posix())
    return files


# --- simulation steps ---------------------------------------------------------


def _to_world(affine: np.ndarray, voxels: np.ndarray) -> np.ndarray:
    """``(..., 3)`` voxel coordinates -> ``(..., 3)`` mm."""
    return voxels @ affine[:3, :3].T + affine[:3, 3]


def _rotation(angles_rad: np.ndarray) -> np.ndarray:
    """``(3, 3)`` rotation about x, then y, then z by the three angles."""
    cx, cy, cz = np.cos(angles_rad)
    sx, sy, sz = np.sin(angles_rad)
    about_x = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    about_y = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    about_z = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return about_z @ about_y @ about_x


def _random_subject_deformation(centre_mm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(4, 4)`` world -> world: scale +-6 %, rotate +-4 degrees about ``centre_mm``, shift +-4 mm."""
    linear = _rotation(np.deg2rad(rng.uniform(-4, 4, 3))) @ np.diag(rng.uniform(0.94, 1.06, 3))
    deformation = np.eye(4)
    deformation[:3, :3] = linear
    deformation[:3, 3] = centre_mm + rng.uniform(-4, 4, 3) - linear @ centre_mm
    return deformation


def _warp_tissue(anatomy: Anatomy, subject_from_template: np.ndarray) -> np.ndarray:
    """Template tissue maps moved into the subject, on the same grid: float32 ``(3, X, Y, Z)``."""
    template_voxel_from_subject_voxel = (
        np.linalg.inv(anatomy.affine) @ np.linalg.inv(subject_from_template) @ anatomy.affine
    )
    matrix, offset = template_voxel_from_subject_voxel[:3, :3], template_voxel_from_subject_voxel[:3, 3]
    return np.stack(
        [ndimage.affine_transform(volume, matrix, offset=offset, order=1, cval=0.0) for volume in anatomy.tissue]
    )


def _tumour_and_signal(
    anatomy: Anatomy,
    tissue: np.ndarray,
    brain: np.ndarray,
    subject_from_template: np.ndarray,
    grade: str,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """BraTS segmentation uint8 ``(X, Y, Z)`` and relative signal float32 ``(4, X, Y, Z)``.

    Regions (bool, inside a box around the tumour): ``whole`` (the core plus
    an oedema envelope restricted to white matter), ``core``, and ``ncr_net``
    (BraTS label 1: the necrotic centre in HGG, the whole non-enhancing core
    in LGG); enhancing = core minus ncr_net.
    """
    resolution_mm = float(abs(anatomy.affine[0, 0]))
    signal = {name: np.array(values, dtype=np.float32) for name, values in CLASS_SIGNAL.items()}
    for name in ("oedema", "necrosis", "enhancing", "non_enhancing"):  # patient-to-patient variation
        signal[name] = signal[name] * np.exp(rng.normal(0.0, 0.08, len(MODALITIES))).astype(np.float32)

    core_radii = np.maximum(rng.uniform(10.0, 20.0, 3), MIN_CORE_RADIUS_VOXELS * resolution_mm)
    envelope_radii = core_radii * (rng.uniform(1.4, 2.2, 3) if grade == "HGG" else rng.uniform(1.2, 1.6, 3))
    centre_vox = _tumour_centre(anatomy, subject_from_template, core_radii.max(), rng)
    half_extent_mm = (1 + SHAPE_IRREGULARITY) * envelope_radii.max()
    box, offsets_mm = _box_around(centre_vox, half_extent_mm, brain.shape, resolution_mm)
    local_mm = np.einsum("ji,j...->i...", _rotation(rng.uniform(0, 2 * np.pi, 3)), offsets_mm)
    core_noise, envelope_noise, rim_noise, texture_noise = _smooth_noise(4, local_mm.shape[1:], resolution_mm, rng)

    core = _irregular_ellipsoid(local_mm, core_radii, core_noise) & brain[box]
    oedema_allowed = brain[box] & (tissue[TISSUES.index("wm")][box] > OEDEMA_MIN_WHITE_MATTER)
    whole = (_irregular_ellipsoid(local_mm, envelope_radii, envelope_noise) & oedema_allowed) | core
    components, _ = ndimage.label(whole)
    whole = np.isin(components, components[core])  # drop oedema islands cut off from the core
    if grade == "HGG":  # an enhancing rim, at least one voxel thick, around a necrotic centre
        depth_mm = ndimage.distance_transform_edt(core, sampling=resolution_mm)
        rim_mm = rng.uniform(0.2, 0.4) * depth_mm.max() * (1 + 0.4 * np.tanh(rim_noise))
        ncr_net = core & (depth_mm > np.maximum(rim_mm, resolution_mm))
        ncr_net_signal = signal["necrosis"]
    else:  # low grade: non-enhancing tumour throughout the core
        ncr_net = core
        ncr_net_signal = signal["non_enhancing"]

    seg = np.zeros(brain.shape, dtype=np.uint8)
    seg_box = seg[box]
    seg_box[whole] = SEG_OEDEMA
    seg_box[core] = SEG_ENHANCING
    seg_box[ncr_net] = SEG_NECROTIC

    # Partial volume at region borders (soft masks) and heterogeneous tumour signal (texture).
    soft_whole, soft_core, soft_ncr_net = (
        ndimage.gaussian_filter(mask.astype(np.float32), 0.5) for mask in (whole, core, ncr_net)
    )
    texture = 1 + 0.08 * texture_noise
    tissue_signal = np.tensordot(np.stack([signal[t] for t in TISSUES], axis=1), tissue, axes=1)
    normal = tissue_signal[(slice(None), *box)]
    oedema = (1 - OEDEMA_FRACTION) * normal + OEDEMA_FRACTION * texture * _per_voxel(signal["oedema"])
    tissue_signal[(slice(None), *box)] = (
        (1 - soft_whole) * normal
        + (soft_whole - soft_core) * oedema
        + (soft_core - soft_ncr_net) * texture * _per_voxel(signal["enhancing"])
        + soft_ncr_net * texture * _per_voxel(ncr_net_signal)
    )
    return seg, tissue_signal


def _per_voxel(per_modality: np.ndarray) -> np.ndarray:
    """``(4,)`` -> ``(4, 1, 1, 1)`` to broadcast over a ``(4, X, Y, Z)`` volume."""
    return per_modality[:, None, None, None]


def _irregular_ellipsoid(local_mm: np.ndarray, radii_mm: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Bool mask: ellipsoid (``local_mm`` ``(3, ...)`` in its own axes) with a noise-perturbed surface.

    Points with normalised radius < 1 - SHAPE_IRREGULARITY are always inside,
    those beyond 1 + SHAPE_IRREGULARITY always outside.
    """
    radius = np.sqrt(np.sum((local_mm / radii_mm[:, None, None, None]) ** 2, axis=0))
    return radius + SHAPE_IRREGULARITY * np.tanh(noise) < 1


def _tumour_centre(
    anatomy: Anatomy, subject_from_template: np.ndarray, core_radius_mm: float, rng: np.random.Generator
) -> np.ndarray:
    """Subject voxel coordinates ``(3,)`` of a white-matter point deep enough to hold the core."""
    needed_depth = 1.1 * (1 + SHAPE_IRREGULARITY) * core_radius_mm  # 1.1: room for the subject's scaling
    deep = np.flatnonzero(anatomy.white_matter_depth_mm >= needed_depth)
    if deep.size:
        template_mm = anatomy.white_matter_mm[rng.choice(deep)]
    else:
        template_mm = anatomy.white_matter_mm[np.argmax(anatomy.white_matter_depth_mm)]
    subject_mm = subject_from_template[:3, :3] @ template_mm + subject_from_template[:3, 3]
    return np.linalg.solve(anatomy.affine[:3, :3], subject_mm - anatomy.affine[:3, 3])


def _box_around(
    centre_vox: np.ndarray, half_extent_mm: float, shape: tuple[int, ...], resolution_mm: float
) -> tuple[tuple[slice, ...], np.ndarray]:
    """Slices of the grid within ``half_extent_mm`` of the centre, and each box voxel's offset
    from the centre in mm: float64 ``(3, bx, by, bz)``."""
    half = int(np.ceil(half_extent_mm / resolution_mm)) + 1
    low = np.maximum(np.round(centre_vox).astype(int) - half, 0)
    high = np.minimum(np.round(centre_vox).astype(int) + half + 1, shape)
    box = tuple(slice(lo, hi) for lo, hi in zip(low, high))
    axes = [(np.arange(lo, hi) - c) * resolution_mm for lo, hi, c in zip(low, high, centre_vox)]
    return box, np.stack(np.meshgrid(*axes, indexing="ij"))


def _smooth_noise(count: int, shape: tuple[int, ...], resolution_mm: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` independent smooth Gaussian fields of unit standard deviation: float32 ``(count, *shape)``."""
    sigma = SHAPE_NOISE_MM / resolution_mm
    fields = ndimage.gaussian_filter(rng.standard_normal((count, *shape), dtype=np.float32), (0, sigma, sigma, sigma))
    return fields / fields.std(axis=(1, 2, 3), keepdims=True)


def _bias_field(affine: np.ndarray, shape: tuple[int, ...], acquisition: SiteAcquisition) -> np.ndarray:
    """Multiplicative bias float32 ``(X, Y, Z)``, fixed in scanner coordinates (axis-aligned ``affine``)."""
    voxel_index = np.ogrid[tuple(slice(0, n) for n in shape)]  # three broadcastable 1-D axes
    x, y, z = ((i * affine[axis, axis] + affine[axis, 3]) / BIAS_LENGTH_MM for axis, i in enumerate(voxel_index))
    monomials = (x, y, z, x * x, y * y, z * z, x * y, x * z, y * z)  # BIAS_MONOMIALS
    log_bias = sum(c * m for c, m in zip(acquisition.bias_coefficients, monomials))
    return np.exp(acquisition.bias_amplitude * np.broadcast_to(log_bias, shape)).astype(np.float32)


def _acquire(
    signal: np.ndarray,
    brain: np.ndarray,
    affine: np.ndarray,
    resolution_mm: float,
    acquisition: SiteAcquisition,
    rng: np.random.Generator,
) -> np.ndarray:
    """Relative signal float32 ``(4, X, Y, Z)`` -> stored int16 image of the same shape."""
    blurred = signal * _bias_field(affine, brain.shape, acquisition)
    sigma = acquisition.blur_sigma_mm / resolution_mm
    blurred = ndimage.gaussian_filter(blurred, (0, sigma, sigma, sigma))
    rician = acquisition.noise_model == "rician"  # magnitude of complex Gaussian noise, else real Gaussian
    noise = acquisition.noise_sigma * rng.standard_normal((2 if rician else 1, *blurred.shape), dtype=np.float32)
    measured = np.hypot(blurred + noise[0], noise[1]) if rician else blurred + noise[0]
    case_gain = np.exp(rng.normal(0.0, CASE_GAIN_SIGMA))
    scale = acquisition.gain * case_gain * np.array(acquisition.modality_gain, dtype=np.float32)
    offset = np.array(acquisition.modality_offset, dtype=np.float32)
    stored = scale[:, None, None, None] * (measured + offset[:, None, None, None]) * brain
    return np.clip(np.rint(stored), 0, np.iinfo(np.int16).max).astype(np.int16)
