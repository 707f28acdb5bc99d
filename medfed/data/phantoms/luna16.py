"""Generated chest CT in the LUNA16 layout, with nodule candidates, for 5-site federations.

The data are GENERATED, not patient scans: results on them must say so. The
generator writes exactly what :mod:`medfed.data.luna16` reads:

* ``subset<k>/<seriesuid>.mhd`` + ``.raw``: int16 Hounsfield units, identity
  direction, in-plane spacing ``pixel_spacing_mm``, z spacing = the site's slice
  thickness; series uids in DICOM style (``2.25.<128-bit integer>``, the
  standard root for uids made without a registered prefix); series are dealt
  round-robin over ``subset0`` .. ``subset9`` as in the real data set;
* ``candidates_V2.csv``: every nodule (class 1, centre jittered by at most a
  tenth of its diameter, capped at 1 mm, as detector candidates are) and
  ``negatives_per_series`` non-nodules per series (class 0): a quarter at vessel
  bifurcations, a quarter along vessels, a quarter on the chest wall and
  mediastinum next to the lung, the rest in lung parenchyma;
* ``annotations.csv``: each nodule's exact centre and nominal diameter;
* ``partitioning.csv`` (FeTS format): Partition_ID = acquisition site 1 .. n_sites,
  Subject_ID = series uid;
* ``GENERATED.json``: a plain statement that the data are generated, the
  generator version, every parameter, the seed and each site's acquisition.

Anatomy (a miniature chest: the body fills the field of view of
``matrix_size * pixel_spacing_mm``, 134 mm at the defaults, while nodules and
vessels have real sizes in mm):

* air -1000 HU; an elliptical body, a subcutaneous fat layer (-100 HU) around
  soft tissue (45 HU); a vertebra (300 HU, 700 HU cortex); the descending
  aorta and the heart (40 HU);
* two lungs tapering along z, the left one indented by the heart: parenchyma
  -850 HU +- 30 HU per series (inspiration depth) with a smooth +-15 HU texture;
* vessels (40 HU, contrast-enhanced): every 12 mm along z, two trunks leave each
  lung's hilar side towards the chest wall and fork up to four times into two
  thinner, shorter branches (radius about 2 mm down to 0.35 mm);
* nodules of log-uniform diameter in ``nodule_diameter_mm``, ellipsoidal with a
  random orientation: solid (0 to 100 HU, 60 %), part-solid (a -600 HU
  ground-glass halo around a solid core, 20 %) and ground-glass (-700 to
  -500 HU, 20 %); sub-solid nodules are at least 6 mm.

Acquisition, drawn per site from the seed so that sites differ in every
parameter (each range is cut into n_sites strata, one per site, shuffled):
slice thickness (1 to 2.5 mm, to 0.25 mm), reconstruction-kernel blur (a Gaussian
point-spread function of 0.35 to 1.0 mm sigma; larger = softer kernel),
noise (12 to 45 HU standard deviation, spatially correlated like CT noise),
and a calibration offset (-20 to +20 HU). Stored values are clipped to
[-1024, 3071] HU as a scanner's 12-bit range.

Everything is deterministic from ``seed``: site acquisitions use the stream
``default_rng([seed, 0])``, series ``j`` of site ``s`` the stream
``default_rng([seed, 1, s, j])``. The output is written to a hidden sibling
directory and renamed into place; a ``root`` whose ``GENERATED.json`` records
the same parameters and generator version is returned untouched. While a
``with luna16_phantoms(...)`` block reads it, no other medfed run replaces it
(:func:`medfed.data.phantoms.store.hold`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from scipy import ndimage

from medfed.data.luna16 import ANNOTATIONS_HEADER, CANDIDATES_HEADER
from medfed.data.partition_csv import write_partition_csv
from medfed.data.phantoms.store import hold, write_marker
from medfed.data.phantoms.workers import map_cases

if TYPE_CHECKING:  # SimpleITK is imported where series are written: the other tasks run without it
    import SimpleITK as sitk

GENERATOR_VERSION = 2  # 2: marker written by phantoms.store (with a description)
GENERATOR = __name__
N_SUBSETS = 10  # LUNA16 ships subset0 .. subset9

# Nominal tissue values in Hounsfield units, before the per-site calibration offset.
TISSUE_HU = {
    "air": -1000.0,
    "fat": -100.0,
    "soft_tissue": 45.0,
    "lung": -850.0,
    "vessel": 40.0,
    "heart": 40.0,
    "bone": 300.0,
    "cortical_bone": 700.0,
    "ground_glass": -600.0,
}
LUNG_HU_SPREAD = 30.0  # per-series parenchyma level: lung +- this (inspiration depth)
LUNG_TEXTURE_HU = 15.0  # amplitude of the smooth parenchyma texture
STORED_HU_RANGE = (-1024, 3071)

# Per-site acquisition ranges.
SLICE_THICKNESS_MM = (1.0, 2.5)
KERNEL_SIGMA_MM = (0.35, 1.0)
NOISE_SD_HU = (12.0, 45.0)
HU_OFFSET = (-20.0, 20.0)

NODULE_KIND_PROBABILITIES = {"solid": 0.6, "part_solid": 0.2, "ground_glass": 0.2}
SUBSOLID_MIN_DIAMETER_MM = 6.0
VESSEL_MIN_RADIUS_MM = 0.35
VESSEL_LEVEL_SPACING_MM = 12.0  # z distance between the levels where vessel trees start
NEGATIVE_CLEARANCE_MM = 3.0  # non-nodule candidates lie at least this far outside every nodule


@dataclass(frozen=True)
class SiteAcquisition:
    """How one site's scanner acquires and reconstructs (recorded in GENERATED.json)."""

    site: int  # 1 .. n_sites, the Partition_ID
    slice_thickness_mm: float  # also the z spacing
    kernel_sigma_mm: float  # Gaussian point-spread function; larger = blurrier
    noise_sd_hu: float  # standard deviation of the added noise
    hu_offset: float  # calibration error added to every voxel


@dataclass(frozen=True)
class _Grid:
    """A volume's voxel centres in local millimetres (0 = the volume centre) and that centre's world position."""

    size_xyz: tuple[int, int, int]
    spacing_xyz: tuple[float, float, float]  # mm
    centre_world: np.ndarray  # float64 (3,) world mm of the volume centre

    def axis(self, k: int) -> np.ndarray:
        """float64 (size_xyz[k],) local mm of the voxel centres along axis k (0 = x, 1 = y, 2 = z)."""
        return (np.arange(self.size_xyz[k]) - (self.size_xyz[k] - 1) / 2) * self.spacing_xyz[k]

    @property
    def shape_zyx(self) -> tuple[int, int, int]:
        return self.size_xyz[::-1]

    @property
    def first_mm(self) -> np.ndarray:
        """(3,) local mm of voxel (0, 0, 0); ``-first_mm`` is the last voxel's."""
        return -(np.array(self.size_xyz) - 1) / 2 * np.array(self.spacing_xyz)

    def inside(self, points: np.ndarray) -> np.ndarray:
        """bool (n,): local (n, 3) points between the first and last voxel centres."""
        return (np.abs(points) <= -self.first_mm).all(axis=1)

    def block(self, low_mm: np.ndarray, high_mm: np.ndarray):
        """Index slices (z, y, x) of the voxels inside a box, and their broadcastable local coordinates x, y, z."""
        slices, coordinates = [], []
        for k in (2, 1, 0):
            values = self.axis(k)
            start = int(np.searchsorted(values, low_mm[k]))
            stop = int(np.searchsorted(values, high_mm[k], side="right"))
            slices.append(slice(start, stop))
            coordinates.append(values[start:stop])
        z, y, x = coordinates
        return tuple(slices), (x[None, None, :], y[None, :, None], z[:, None, None])


@dataclass(frozen=True)
class _Chest:
    """Anatomy of one series in local millimetres (x: patient right -> left, y: anterior -> posterior)."""

    body_semi_axes: np.ndarray  # (2,) x, y
    fat_mm: float
    lung_centres: np.ndarray  # (2, 2) xy of the right and left lung
    lung_semi_axes: np.ndarray  # (2, 2)
    lung_z_centre: float
    lung_z_semi_axis: float
    heart_centre: np.ndarray  # (2,)
    heart_semi_axes: np.ndarray  # (2,)
    spine_centre: np.ndarray  # (2,)
    spine_radius: float
    aorta_centre: np.ndarray  # (2,)
    aorta_radius: float
    lung_hu: float

    def lung_rho(self, x, y, z) -> np.ndarray:
        """Broadcast normalised lung radius: < 1 inside a lung, inf inside the heart."""
        taper = np.sqrt(np.maximum(1.0 - ((z - self.lung_z_centre) / self.lung_z_semi_axis) ** 2, 1e-12))
        rho = np.inf
        for (cx, cy), (ax, ay) in zip(self.lung_centres, self.lung_semi_axes):
            rho = np.minimum(rho, np.sqrt(((x - cx) / (ax * taper)) ** 2 + ((y - cy) / (ay * taper)) ** 2))
        return np.where(self.in_heart(x, y), np.inf, rho)

    def in_heart(self, x, y) -> np.ndarray:
        return _in_ellipse(x, y, self.heart_centre, self.heart_semi_axes)

    def in_soft_tissue(self, x, y) -> np.ndarray:
        """Inside the body, inward of the fat layer."""
        return _in_ellipse(x, y, np.zeros(2), self.body_semi_axes - self.fat_mm)


@dataclass(frozen=True)
class _Segment:
    """A straight vessel piece (local mm)."""

    start: np.ndarray  # (3,)
    end: np.ndarray  # (3,)
    radius: float
    branches: bool  # whether children start at ``end`` (a bifurcation)


@dataclass(frozen=True)
class _Nodule:
    """An ellipsoidal nodule (local mm)."""

    centre: np.ndarray  # (3,)
    semi_axes: np.ndarray  # (3,) along the columns of ``rotation``
    rotation: np.ndarray  # (3, 3) orthonormal
    kind: str  # solid | part_solid | ground_glass
    hu: float  # solid part (solid, part_solid) or the whole (ground_glass)
    core_fraction: float  # part_solid: core semi-axes / nodule semi-axes; else 0
    diameter_mm: float  # nominal diameter (annotations.csv)


@dataclass(frozen=True)
class _Series:
    """One generated series, in world millimetres."""

    image: sitk.Image  # int16 HU
    nodules_world_mm: np.ndarray  # (k, 3) exact nodule centres
    nodule_diameters_mm: list[float]  # (k,)
    candidates_world_mm: np.ndarray  # (n, 3)
    candidate_labels: np.ndarray  # int64 (n,)


def luna16_phantoms(
    root: str | Path,
    *,
    n_sites: int = 5,
    series_per_site: int = 6,
    seed: int = 0,
    matrix_size: int = 192,
    pixel_spacing_mm: float = 0.7,
    z_extent_mm: float = 80.0,
    nodules_per_series: tuple[int, int] = (2, 3),
    nodule_diameter_mm: tuple[float, float] = (3.0, 25.0),
    negatives_per_series: int = 60,
    progress: bool = True,
) -> AbstractContextManager[Path]:
    """A generated LUNA16-layout data set at ``root``, written unless it is there, held while a block reads it.

    Args:
        root: output directory; it must be absent, empty, or a previous output
            of this generator (it is never merged into other data).
        n_sites: acquisition sites (Partition_ID 1 .. n_sites).
        series_per_site: CT series per site.
        seed: seeds everything.
        matrix_size: voxels along x and y.
        pixel_spacing_mm: in-plane voxel size.
        z_extent_mm: scan length along z (slices = z_extent_mm / slice thickness).
        nodules_per_series: inclusive range of nodules per series.
        nodule_diameter_mm: diameter range; must fit the lungs of the field of view.
        negatives_per_series: non-nodule candidates per series.
        progress: show a tqdm bar over series.

    Returns:
        A context manager giving ``root`` as a Path; no other medfed run
        replaces the data set until its block ends.

    Raises:
        ValueError: an impossible parameter (named), e.g. nodules that do not
            fit (on entering the block when only generating finds out).
        DataError: ``root`` holds something that is not this generator's output (on entering the block).
    """
    parameters = dict(
        n_sites=n_sites,
        series_per_site=series_per_site,
        seed=seed,
        matrix_size=matrix_size,
        pixel_spacing_mm=float(pixel_spacing_mm),
        z_extent_mm=float(z_extent_mm),
        nodules_per_series=[int(n) for n in nodules_per_series],
        nodule_diameter_mm=[float(d) for d in nodule_diameter_mm],
        negatives_per_series=negatives_per_series,
    )
    _check_parameters(parameters)
    return hold(root, GENERATOR, GENERATOR_VERSION, parameters, lambda folder: _write_dataset(folder, parameters, progress))


def generate_luna16_phantoms(root: str | Path, **settings) -> Path:
    """Write (or reuse) the data set :func:`luna16_phantoms` describes and return ``root``, not held (scripts, tests)."""
    with luna16_phantoms(root, **settings) as path:
        return path


def _check_parameters(p: dict) -> None:
    low_n, high_n = p["nodules_per_series"]
    low_d, high_d = p["nodule_diameter_mm"]
    problems = {
        "n_sites": p["n_sites"] >= 1,
        "series_per_site": p["series_per_site"] >= 1,
        "matrix_size": p["matrix_size"] >= 32,
        "pixel_spacing_mm": p["pixel_spacing_mm"] > 0,
        "z_extent_mm": p["z_extent_mm"] >= 4 * SLICE_THICKNESS_MM[1],
        "nodules_per_series": 1 <= low_n <= high_n,
        "nodule_diameter_mm": 0 < low_d <= high_d,
        "negatives_per_series": p["negatives_per_series"] >= 0,
    }
    expected = {
        "n_sites": ">= 1",
        "series_per_site": ">= 1",
        "matrix_size": ">= 32 voxels",
        "pixel_spacing_mm": "> 0",
        "z_extent_mm": f">= {4 * SLICE_THICKNESS_MM[1]} mm (four of the thickest slices)",
        "nodules_per_series": "(low, high) with 1 <= low <= high",
        "nodule_diameter_mm": "(low, high) with 0 < low <= high",
        "negatives_per_series": ">= 0",
    }
    for name, ok in problems.items():
        if not ok:
            raise ValueError(f"generate_luna16_phantoms: {name} must be {expected[name]}, got {p[name]}")


def _write_dataset(out: Path, p: dict, progress: bool) -> None:
    acquisitions = _site_acquisitions(p["n_sites"], np.random.default_rng([p["seed"], 0]))
    candidate_rows, annotation_rows, partition = [], [], {}
    site_summaries = [dict(asdict(a), n_series=0, n_nodules=0, n_candidates=0) for a in acquisitions]
    jobs = [(a, j) for j in range(p["series_per_site"]) for a in acquisitions]  # interleave sites over subsets
    work = len(jobs) * (p["matrix_size"] / 192) ** 2 * p["z_extent_mm"] / 80.0  # in series of the default size
    written = map_cases(_write_series, [(out, acquisition, index, number) for number, (acquisition, index) in enumerate(jobs)], p, work, "LUNA16 phantoms", progress)
    for (acquisition, _), (uid, candidates, annotations) in zip(jobs, written):
        candidate_rows += candidates
        annotation_rows += annotations
        partition[uid] = acquisition.site
        summary = site_summaries[acquisition.site - 1]
        summary["n_series"] += 1
        summary["n_nodules"] += len(annotations)
        summary["n_candidates"] += len(candidates)

    _write_csv(out / "candidates_V2.csv", CANDIDATES_HEADER, candidate_rows)
    _write_csv(out / "annotations.csv", ANNOTATIONS_HEADER, annotation_rows)
    write_partition_csv(out / "partitioning.csv", partition)
    n_nodules = sum(summary["n_nodules"] for summary in site_summaries)
    write_marker(
        out,
        GENERATOR,
        GENERATOR_VERSION,
        p,
        description=(
            f"GENERATED chest CT in the LUNA16 layout ({GENERATOR} v{GENERATOR_VERSION}): {p['n_sites']} sites x "
            f"{p['series_per_site']} series, {n_nodules} nodules, seed {p['seed']}"
        ),
        notice="GENERATED data: synthetic chest CT phantoms written in the LUNA16 layout by medfed. "
        "They are not patient scans; results computed on them must be labelled as generated.",
        tissue_hu=TISSUE_HU,
        sites=site_summaries,
    )


def _write_series(p: dict, job: tuple[Path, SiteAcquisition, int, int]) -> tuple[str, list[list[str]], list[list[str]]]:
    """Generate one series (its own stream: seed, 1, site, index) into subset ``number % N_SUBSETS``; its UID and
    its candidates' and nodules' CSV rows."""
    import SimpleITK as sitk

    out, acquisition, index, number = job
    rng = np.random.default_rng([p["seed"], 1, acquisition.site, index])
    uid = _series_uid(rng)
    series = _generate_series(rng, acquisition, p)
    subset = out / f"subset{number % N_SUBSETS}"
    subset.mkdir(exist_ok=True)
    sitk.WriteImage(series.image, str(subset / f"{uid}.mhd"))
    candidates = [[uid, *map(repr, world.tolist()), str(label)] for world, label in zip(series.candidates_world_mm, series.candidate_labels)]
    annotations = [[uid, *map(repr, world.tolist()), repr(diameter)] for world, diameter in zip(series.nodules_world_mm, series.nodule_diameters_mm)]
    return uid, candidates, annotations


def _write_csv(path: Path, header: tuple[str, ...], rows: list[list[str]]) -> None:
    lines = [",".join(header)] + [",".join(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def _stratified(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    """n values in [low, high], one from the middle half of each of n equal strata, in random order."""
    return low + (high - low) * (rng.permutation(n) + rng.uniform(0.25, 0.75, size=n)) / n


def _site_acquisitions(n_sites: int, rng: np.random.Generator) -> list[SiteAcquisition]:
    thickness = np.round(_stratified(rng, n_sites, *SLICE_THICKNESS_MM) * 4) / 4
    kernel = _stratified(rng, n_sites, *KERNEL_SIGMA_MM)
    noise = _stratified(rng, n_sites, *NOISE_SD_HU)
    offset = _stratified(rng, n_sites, *HU_OFFSET)
    return [
        SiteAcquisition(
            site=s + 1,
            slice_thickness_mm=float(thickness[s]),
            kernel_sigma_mm=round(float(kernel[s]), 3),
            noise_sd_hu=round(float(noise[s]), 2),
            hu_offset=round(float(offset[s]), 2),
        )
        for s in range(n_sites)
    ]


def _series_uid(rng: np.random.Generator) -> str:
    """A DICOM uid under the 2.25 root (a 128-bit integer), drawn from ``rng``."""
    return "2.25." + str(int.from_bytes(rng.bytes(16), "big"))


def _generate_series(rng: np.random.Generator, acquisition: SiteAcquisition, p: dict) -> _Series:
    """Draw the anatomy, nodules and candidates of one series and acquire it at the site."""
    import SimpleITK as sitk

    grid = _make_grid(rng, p["matrix_size"], p["pixel_spacing_mm"], p["z_extent_mm"], acquisition.slice_thickness_mm)
    chest = _draw_chest(rng, grid)
    segments = _draw_vessel_trees(rng, chest, grid)
    n_nodules = int(rng.integers(p["nodules_per_series"][0], p["nodules_per_series"][1] + 1))
    nodules = _draw_nodules(rng, chest, grid, n_nodules, p["nodule_diameter_mm"])

    hu = _render_anatomy(rng, chest, grid)
    _paint_vessels(hu, chest, grid, segments)
    _paint_nodules(hu, grid, nodules)
    volume = _acquire(rng, hu, grid, acquisition)

    image = sitk.GetImageFromArray(volume)
    image.SetSpacing(grid.spacing_xyz)
    image.SetOrigin(tuple(grid.centre_world + grid.first_mm))
    candidates_mm, labels = _draw_candidates(rng, chest, grid, segments, nodules, p["negatives_per_series"])
    return _Series(
        image=image,
        nodules_world_mm=np.array([n.centre for n in nodules]).reshape(-1, 3) + grid.centre_world,
        nodule_diameters_mm=[n.diameter_mm for n in nodules],
        candidates_world_mm=candidates_mm + grid.centre_world,
        candidate_labels=labels,
    )


def _make_grid(rng, matrix_size: int, spacing: float, z_extent: float, thickness: float) -> _Grid:
    # world position of the volume centre, near typical LUNA16 values
    centre_world = np.array([rng.uniform(-20, 20), rng.uniform(-20, 20), rng.uniform(-250, -100)])
    return _Grid(
        size_xyz=(matrix_size, matrix_size, int(round(z_extent / thickness))),
        spacing_xyz=(spacing, spacing, thickness),
        centre_world=centre_world,
    )


def _draw_chest(rng, grid: _Grid) -> _Chest:
    """Anatomy scaled to the field of view (body 86-94 % of its width), lungs through the whole z range."""
    half_fov_x, half_fov_y, half_z = -grid.first_mm
    body = np.array([half_fov_x * rng.uniform(0.86, 0.94), half_fov_y * rng.uniform(0.62, 0.72)])
    bx, by = body
    lung_semi = np.array([bx * rng.uniform(0.33, 0.38), by * rng.uniform(0.66, 0.74)])
    lung_x = bx * rng.uniform(0.42, 0.47)
    return _Chest(
        body_semi_axes=body,
        fat_mm=bx * rng.uniform(0.05, 0.08),
        lung_centres=np.array([[-lung_x, by * 0.05], [lung_x, by * 0.05]]),
        lung_semi_axes=lung_semi * rng.uniform(0.95, 1.05, size=(2, 2)),
        lung_z_centre=rng.uniform(-0.1, 0.1) * half_z,
        lung_z_semi_axis=half_z * rng.uniform(1.15, 1.4),
        heart_centre=np.array([bx * rng.uniform(0.1, 0.18), -by * rng.uniform(0.2, 0.3)]),
        heart_semi_axes=np.array([bx * rng.uniform(0.26, 0.32), by * rng.uniform(0.3, 0.36)]),
        spine_centre=np.array([0.0, by * 0.66]),
        spine_radius=by * 0.17,
        aorta_centre=np.array([bx * 0.16, by * 0.42]),
        aorta_radius=by * 0.11,
        lung_hu=TISSUE_HU["lung"] + rng.uniform(-LUNG_HU_SPREAD, LUNG_HU_SPREAD),
    )


def _draw_vessel_trees(rng, chest: _Chest, grid: _Grid, generations: int = 4) -> list[_Segment]:
    """Branching vessel trees filling each lung: every ~12 mm along z, two trunks leave the lung's
    medial (hilar) side towards the chest wall, and each segment forks into two thinner, shorter ones."""
    segments = []
    half_z = -grid.first_mm[2]
    n_levels = max(2, int(np.ceil(2 * half_z / VESSEL_LEVEL_SPACING_MM)))
    scale = min(1.0, chest.lung_semi_axes.min() / 12.0)  # thinner vessels in small lungs
    for (cx, cy), (ax, ay) in zip(chest.lung_centres, chest.lung_semi_axes):
        lateral = np.sign(cx)
        for level_z in np.linspace(-half_z, half_z, n_levels):
            hilum = np.array([cx - lateral * 0.6 * ax, cy + rng.uniform(-0.3, 0.3) * ay, level_z + rng.uniform(-3, 3)])
            stack = []  # segments still to draw: (start, direction, length, radius, generation)
            for _ in range(2):
                direction = _unit(np.array([lateral, rng.uniform(-0.6, 0.6), rng.uniform(-0.8, 0.8)]))
                stack.append((hilum, direction, 0.6 * ax, rng.uniform(1.4, 2.2) * scale, 0))
            while stack:
                start, direction, length, radius, generation = stack.pop()
                end = start + direction * length
                branches = generation < generations and radius * 0.8 >= VESSEL_MIN_RADIUS_MM
                segments.append(_Segment(start=start, end=end, radius=radius, branches=branches))
                if branches:
                    normal = _unit(np.cross(direction, rng.normal(size=3)))
                    for side in (1.0, -1.0):
                        angle = np.deg2rad(rng.uniform(25, 45))
                        child = _unit(np.cos(angle) * direction + side * np.sin(angle) * normal)
                        child_length = length * rng.uniform(0.65, 0.85)
                        stack.append((end, child, child_length, radius * rng.uniform(0.65, 0.8), generation + 1))
    return segments


def _draw_nodules(rng, chest: _Chest, grid: _Grid, n: int, diameter_range) -> list[_Nodule]:
    """``n`` non-overlapping nodules, centres in the lungs, mostly inside them (pleural contact allowed)."""
    kinds = list(NODULE_KIND_PROBABILITIES)
    nodules: list[_Nodule] = []
    for _ in range(n):
        kind = kinds[rng.choice(len(kinds), p=list(NODULE_KIND_PROBABILITIES.values()))]
        low, high = diameter_range
        if kind != "solid":
            if high < SUBSOLID_MIN_DIAMETER_MM:
                kind = "solid"
            else:
                low = max(low, SUBSOLID_MIN_DIAMETER_MM)
        diameter = float(np.exp(rng.uniform(np.log(low), np.log(high))))
        semi_axes = diameter / 2 * rng.uniform(0.88, 1.12, size=3)
        rotation, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        centre = _place_nodule(rng, chest, grid, rotation * semi_axes, nodules)
        if centre is None:
            raise ValueError(
                f"generate_luna16_phantoms: could not place a {diameter:.1f} mm nodule in lungs of semi-axes "
                f"{np.round(chest.lung_semi_axes.min(axis=0), 1)} mm; lower nodule_diameter_mm or raise matrix_size"
            )
        nodules.append(
            _Nodule(
                centre=centre,
                semi_axes=semi_axes,
                rotation=rotation,
                kind=kind,
                hu=float(rng.uniform(-700, -500) if kind == "ground_glass" else rng.uniform(0, 100)),
                core_fraction=float(rng.uniform(0.35, 0.6)) if kind == "part_solid" else 0.0,
                diameter_mm=round(diameter, 2),
            )
        )
    return nodules


def _place_nodule(rng, chest: _Chest, grid: _Grid, axes: np.ndarray, placed: list[_Nodule], tries: int = 2000):
    """A centre whose ellipsoid (columns of ``axes``) lies in a lung up to 5 % of its radius, or None."""
    radius = np.linalg.norm(axes, axis=0).max()
    extremes = np.concatenate([axes.T, -axes.T])  # (6, 3) offsets to the ellipsoid's axis ends
    high = -grid.first_mm - [0, 0, radius]  # the whole nodule within the scanned z range
    low = -high
    if np.any(low > high):
        return None
    centres = rng.uniform(low, high, size=(tries, 3))
    points = centres[:, None, :] + extremes[None, :, :]  # (tries, 6, 3)
    fits = (chest.lung_rho(*centres.T) < 0.9) & (chest.lung_rho(*points.transpose(2, 0, 1)) < 1.05).all(axis=1)
    for other in placed:
        clearance = radius + other.semi_axes.max() + 2.0
        fits &= np.linalg.norm(centres - other.centre, axis=1) > clearance
    found = np.flatnonzero(fits)
    return centres[found[0]] if found.size else None


def _render_anatomy(rng, chest: _Chest, grid: _Grid) -> np.ndarray:
    """float32 (nz, ny, nx) nominal HU of body, fat, heart, spine, aorta and textured lungs."""
    x, y, z = grid.axis(0), grid.axis(1), grid.axis(2)
    axial = np.full((len(y), len(x)), TISSUE_HU["air"], dtype=np.float32)
    x, y = x[None, :], y[:, None]
    axial[_in_ellipse(x, y, np.zeros(2), chest.body_semi_axes)] = TISSUE_HU["fat"]
    axial[chest.in_soft_tissue(x, y)] = TISSUE_HU["soft_tissue"]
    axial[chest.in_heart(x, y)] = TISSUE_HU["heart"]
    axial[_in_ellipse(x, y, chest.aorta_centre, np.full(2, chest.aorta_radius))] = TISSUE_HU["vessel"]
    axial[_in_ellipse(x, y, chest.spine_centre, np.full(2, chest.spine_radius))] = TISSUE_HU["cortical_bone"]
    axial[_in_ellipse(x, y, chest.spine_centre, np.full(2, chest.spine_radius * 0.85))] = TISSUE_HU["bone"]
    hu = np.broadcast_to(axial, grid.shape_zyx).copy()

    lung = chest.lung_rho(x[None], y[None], z[:, None, None]) < 1.0
    coarse = rng.standard_normal(size=[max(2, n // 8) for n in grid.shape_zyx]).astype(np.float32)
    texture = ndimage.zoom(coarse, [n / c for n, c in zip(grid.shape_zyx, coarse.shape)], order=1)
    hu[lung] = chest.lung_hu + LUNG_TEXTURE_HU * texture[lung]
    return hu


def _paint_vessels(hu: np.ndarray, chest: _Chest, grid: _Grid, segments: list[_Segment]) -> None:
    """Blend vessels (anti-aliased capsules) into the lung voxels of ``hu`` in place."""
    edge = grid.spacing_xyz[0]
    for segment in segments:
        margin = segment.radius + edge
        block, (x, y, z) = grid.block(np.minimum(segment.start, segment.end) - margin,
                                      np.maximum(segment.start, segment.end) + margin)
        axis = segment.end - segment.start
        rel = (x - segment.start[0], y - segment.start[1], z - segment.start[2])
        t = np.clip((rel[0] * axis[0] + rel[1] * axis[1] + rel[2] * axis[2]) / (axis @ axis), 0.0, 1.0)
        distance = np.sqrt(sum((r - t * a) ** 2 for r, a in zip(rel, axis)))
        fraction = np.clip(0.5 - (distance - segment.radius) / edge, 0.0, 1.0)
        fraction = fraction * (chest.lung_rho(x, y, z) < 1.0)
        region = hu[block]
        region += (fraction * (TISSUE_HU["vessel"] - region)).astype(np.float32)


def _paint_nodules(hu: np.ndarray, grid: _Grid, nodules: list[_Nodule]) -> None:
    """Blend nodules (anti-aliased ellipsoids; part-solid = halo then core) into ``hu`` in place."""
    edge = grid.spacing_xyz[0]
    for nodule in nodules:
        reach = nodule.semi_axes.max() + edge
        block, (x, y, z) = grid.block(nodule.centre - reach, nodule.centre + reach)
        rel = (x - nodule.centre[0], y - nodule.centre[1], z - nodule.centre[2])
        along_axes = [sum(r * nodule.rotation[i, k] for i, r in enumerate(rel)) for k in range(3)]
        # ellipsoid norm q: 1 on the surface; (q - 1) * mean semi-axis approximates the signed distance in mm
        q = np.sqrt(sum((u / a) ** 2 for u, a in zip(along_axes, nodule.semi_axes)))
        mean_radius = nodule.semi_axes.mean()
        region = hu[block]
        if nodule.kind == "part_solid":  # (HU, size relative to the nodule), painted in order
            layers = [(TISSUE_HU["ground_glass"], 1.0), (nodule.hu, nodule.core_fraction)]
        else:
            layers = [(nodule.hu, 1.0)]
        for value, size in layers:
            fraction = np.clip(0.5 - (q / size - 1.0) * mean_radius * size / edge, 0.0, 1.0)
            region += (fraction * (value - region)).astype(np.float32)


def _acquire(rng, hu: np.ndarray, grid: _Grid, acquisition: SiteAcquisition) -> np.ndarray:
    """int16 (nz, ny, nx) stored HU: point-spread blur, correlated noise, calibration offset, 12-bit clip."""
    sx, sy, sz = grid.spacing_xyz
    kernel = acquisition.kernel_sigma_mm
    sigma_z_mm = max(kernel, 0.35 * sz)  # slice sensitivity profile
    blurred = ndimage.gaussian_filter(hu, (sigma_z_mm / sz, kernel / sy, kernel / sx))
    noise = ndimage.gaussian_filter(rng.standard_normal(size=hu.shape, dtype=np.float32), (0.0, 0.6, 0.6))
    noise *= acquisition.noise_sd_hu / noise.std()
    stored = np.rint(blurred + noise + acquisition.hu_offset)
    return np.clip(stored, *STORED_HU_RANGE).astype(np.int16)


def _draw_candidates(
    rng, chest: _Chest, grid: _Grid, segments: list[_Segment], nodules: list[_Nodule], n_negatives: int
) -> tuple[np.ndarray, np.ndarray]:
    """Candidates of one series in random order: local mm float64 (n, 3) and labels int64 (n,)."""
    positives = np.array([nodule.centre + _jitter(rng, min(0.1 * nodule.diameter_mm, 1.0)) for nodule in nodules])

    def acceptable(points, rho_low, rho_high):
        rho = chest.lung_rho(*points.T)
        keep = grid.inside(points) & (rho >= rho_low) & (rho < rho_high)
        for nodule in nodules:
            keep &= np.linalg.norm(points - nodule.centre, axis=1) > nodule.semi_axes.max() + NEGATIVE_CLEARANCE_MM
        return points[keep]

    uniform = rng.uniform(grid.first_mm, -grid.first_mm, size=(max(2000, 40 * n_negatives), 3))
    starts = np.array([s.start for s in segments])
    ends = np.array([s.end for s in segments])
    lengths = np.linalg.norm(ends - starts, axis=1)
    pick = rng.choice(len(segments), size=max(200, 4 * n_negatives), p=lengths / lengths.sum())
    along = starts[pick] + rng.uniform(0, 1, size=(len(pick), 1)) * (ends[pick] - starts[pick])
    bifurcations = np.array([s.end for s in segments if s.branches])
    wall = uniform[chest.in_soft_tissue(uniform[:, 0], uniform[:, 1])]

    quarter = n_negatives // 4
    pools = [  # (points, how many wanted); a pool's shortfall falls to the parenchyma
        (rng.permutation(acceptable(bifurcations, 0.0, 0.97)), quarter),
        (acceptable(along, 0.0, 0.97), quarter),
        (acceptable(wall, 1.03, 1.25), quarter),
    ]
    chosen = [points[:wanted] for points, wanted in pools]
    parenchyma = acceptable(uniform, 0.0, 0.9)
    still_needed = n_negatives - sum(len(c) for c in chosen)
    if len(parenchyma) < still_needed:
        raise ValueError(
            f"generate_luna16_phantoms: only {len(parenchyma)} lung points for {still_needed} negative "
            "candidates; lower negatives_per_series or raise matrix_size / z_extent_mm"
        )
    negatives = np.concatenate(chosen + [parenchyma[:still_needed]]).reshape(-1, 3)
    points = np.concatenate([positives.reshape(-1, 3), negatives])
    labels = np.concatenate([np.ones(len(positives), np.int64), np.zeros(len(negatives), np.int64)])
    order = rng.permutation(len(labels))
    return points[order], labels[order]


def _jitter(rng, max_mm: float) -> np.ndarray:
    """A point drawn uniformly from the ball of radius ``max_mm``."""
    direction = _unit(rng.normal(size=3))
    return direction * max_mm * rng.uniform() ** (1 / 3)


def _in_ellipse(x, y, centre, semi_axes) -> np.ndarray:
    return ((x - centre[0]) / semi_axes[0]) ** 2 + ((y - centre[1]) / semi_axes[1]) ** 2 < 1.0


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)
