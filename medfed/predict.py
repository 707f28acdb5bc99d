"""``python -m medfed predict``: one site's personalised model from a finished run, applied to a new scan.

    python -m medfed predict --run outputs/brats_lack0/pfednet --site site3 \\
        --input BraTS2021_00621/ --out pred.nii.gz

The run folder gives everything: ``config.json`` (the model, its target, the
patch size, which sites lacked which MRI sequence) and the newest intact
checkpoint (the site's trained weights; the run must have finished at least
one round). The scan is read by the training reader
(:func:`medfed.data.brats.case_from_paths`: a case folder in BraTS 2017-2021
or 2023 naming, or four files FLAIR, T1, T1ce, T2), z-scored over the brain,
its missing sequence zeroed where the site trained without it, and segmented
slice by slice (:func:`medfed.evaluation.volume.segment_volume`). The output
is a uint8 NIfTI on the input's grid with the input's affine:

* ``task.regions: wt``: 1 = whole tumour, 0 = background;
* ``task.regions: brats``: the BraTS 2017-2021 labels, 1 = necrotic/non-enhancing
  core (TC without ET), 2 = oedema (WT without TC), 4 = enhancing tumour
  (:func:`~medfed.evaluation.volume.tumour_labels`: ET, else TC, else WT).

It is written to a temporary file and renamed, and an existing ``--out`` is
never replaced unless ``--overwrite`` is given.

With ``--truth SEG`` (a segmentation of the scan in the labels of its
release: BraTS 2017-2021 1/2/4, or 1/2/3 for a BraTS 2023 case folder) the
written labels are scored against it per region, as a run's whole-volume
evaluation scores a patient (:func:`~medfed.evaluation.volume.patient_scores`:
Dice, IoU, HD95 and, with ``brats-evaluation`` installed, the official
lesion-wise Dice, NSD and HD95), and the scores are returned.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import sys

from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.checkpoint import FOLDER, checkpoints
from medfed.components import resolve
from medfed.config import load_config
from medfed.errors import ConfigError, DataError

HEAVY_IMPORTS = (("torch", "torch"), ("monai.inferers", "MONAI"), ("medfed.evaluation.volume", "medfed"))
"""What predicting imports once the run folder is checked, with the name its loading bar shows."""


def predict(
    run_dir: Path,
    site: str,
    inputs: list[Path],
    out: Path,
    *,
    overwrite: bool = False,
    batch_size: int = 32,
    truth: Path | None = None,
    progress: bool = False,
) -> dict[str, float] | None:
    """Segment the scan ``inputs`` with site ``site``'s model of the run in ``run_dir`` into ``out``.

    Returns:
        With ``truth``, the scores of the written labels against it (module docstring), else None.

    Raises:
        ConfigError: the run folder, its config or checkpoint, the site, or
            ``--out`` is not usable (one line naming it).
        DataError: the scan cannot be read (the reader's errors).
    """
    config_file = Path(run_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--run {run_dir}: no config.json there (is it a medfed run folder?)")
    check_out(out, overwrite)
    resolved = resolve(load_config(config_file))
    if resolved.task.name != "brats":
        raise ConfigError(f"--run {run_dir}: a {resolved.task.name} run; predict segments BraTS-like MRI only")
    saved = checkpoints(Path(run_dir) / FOLDER)
    if not saved:
        raise ConfigError(f"--run {run_dir}: no checkpoint in {FOLDER}/ (the run finished no round)")
    newest = saved[-1]
    configured = [f"site{index}" for index in range(resolved.run.federation.n_sites)]
    if site not in configured:
        raise ConfigError(f"--site {site!r}: the run has sites {', '.join(configured)}")
    if progress:  # the run folder is checked, within a second of the start: now the waits, each under a labelled bar
        print(f"medfed: predict: {site}'s model of {run_dir} (round {int(newest.stem.split('-')[1])}) on {' '.join(map(str, inputs))}",
              file=sys.stderr, flush=True)
    bar = tqdm(HEAVY_IMPORTS, desc="loading", unit="package", leave=False, disable=not progress)
    for module, name in bar:
        bar.set_description_str(f"loading {name}")
        __import__(module)
    bar.close()
    return _predict_with(resolved, run_dir, newest, site, inputs, out, batch_size, truth, progress)


def _predict_with(
    resolved: Any, run_dir: Path, newest: Path, site: str, inputs: list[Path], out: Path, batch_size: int, truth: Path | None,
    progress: bool,
) -> dict[str, float] | None:
    """:func:`predict` once the run folder, the site and ``--out`` are checked: the checkpoint, the scan, the labels, the scores."""
    import nibabel as nib
    import numpy as np
    import torch

    from medfed.checkpoint import config_differences, read_checkpoint
    from medfed.data.brats import MODALITIES, TumourLabel, case_from_paths, load_case
    from medfed.data.patches import zscore_over_brain
    from medfed.evaluation.volume import patient_scores, segment_volume, tumour_labels
    from medfed.tasks.brats import missing_channel_sites

    steps = tqdm(total=2, desc=f"reading {newest.name}", unit="file", leave=False, disable=not progress)
    state = read_checkpoint(newest)
    steps.update()
    changed = config_differences(state["config"], resolved.config)
    if changed:
        raise ConfigError(f"--run {run_dir}: config.json and the checkpoint {newest.name} are of different runs (they differ at {', '.join(changed[:5])})")
    n_sites = len(state["sites"])
    names = [f"site{index}" for index in range(n_sites)]
    if site not in names:
        raise ConfigError(f"--site {site!r}: the run has sites {', '.join(names)}")
    index = names.index(site)

    regions = resolved.run.task.regions
    model = resolved.model_cls(len(MODALITIES), 2 if regions == "wt" else 3, resolved.model_options, **resolved.task_inputs)
    evaluated = resolved.strategy_cls.evaluated_slot
    resolved.strategy_cls.prepare_slot(evaluated, model)
    slots = state["sites"][index]["slots"]
    if evaluated not in slots:
        raise DataError(f"checkpoint {newest}: {site} has the model slots {sorted(slots)}, not {evaluated!r} which {resolved.strategy_cls.name} evaluates")
    try:
        model.load_state_dict(slots[evaluated]["module"])  # the model it was evaluated with
    except RuntimeError as error:  # weights of another shape than config.json's model
        raise DataError(f"checkpoint {newest}: {site}'s weights do not fit the model config.json describes ({_first_line(error)})") from None
    model.eval()

    steps.set_description_str("reading the scan")
    case = case_from_paths(inputs)
    if truth is not None:
        case = dataclasses.replace(case, label_file=Path(truth))
    volume = load_case(case, resolved.data_options.resample)
    steps.update()
    steps.close()
    image = zscore_over_brain(volume.image)
    lacking, channel = missing_channel_sites(resolved.run.federation)
    if index in lacking:
        image[channel] = 0.0  # as this site's training patches were
    patch_size = resolved.data_options.patch_size
    with torch.no_grad():
        output = segment_volume(model, torch.from_numpy(image), patch_size, batch_size, progress="segmenting" if progress else None)  # (K, X, Y, Z)
        masks = model.region_masks(output.movedim(-1, 0)).movedim(0, -1).numpy()  # (R, X, Y, Z)
    labels = tumour_labels(masks, model.region_names)
    on_disk = labels if regions == "wt" else np.where(labels == TumourLabel.ENHANCING, 4, labels).astype(np.uint8)  # BraTS 2017-2021: ET = 4
    reference = nib.load(case.image_files[0])
    written = nib.Nifti1Image(on_disk, reference.affine, header=reference.header)
    written.set_data_dtype(np.uint8)
    written.header.set_slope_inter(1.0, 0.0)
    write_out(written, out)
    if truth is None:
        return None
    spacing = tuple(float(side) for side in np.linalg.norm(volume.affine[:3, :3], axis=0))
    return patient_scores(labels, volume.label, spacing, model.region_names, resolved.run.evaluation.wants_lesion_wise())


def check_out(out: Path, overwrite: bool) -> None:
    """``--out`` before anything is read: not a folder, a NIfTI file name (``.nii`` or ``.nii.gz``), not an existing
    file unless ``overwrite``, in a folder (or below the nearest existing one) this user can write in.

    Raises:
        ConfigError: one line naming ``--out`` and what is wrong.
    """
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give the mask's file name (e.g. {out / 'prediction.nii.gz'})")
    if not out.name.endswith((".nii", ".nii.gz")):
        raise ConfigError(f"--out {out}: expected a NIfTI file name ending in .nii or .nii.gz (the mask is written as NIfTI)")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out}: exists; pass --overwrite to replace it")
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, expected a folder (or a path that does not exist yet)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: cannot write in {existing} (permission denied)")


def write_out(image: Any, out: Path) -> None:
    """Write ``image`` (a ``nibabel.Nifti1Image``) to a hidden temporary file beside ``out`` and rename it into place
    (an existing ``out`` stays whole until then).

    Raises:
        ConfigError: the folder or the file cannot be written (a full disk, permissions changed since the check).
    """
    import nibabel as nib

    partial = out.with_name(f".{out.name}.partial{''.join(out.suffixes)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        nib.save(image, partial)
        os.replace(partial, out)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"--out {out}: could not be written ({error.strerror or error}); nothing was replaced") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def score_table(scores: dict[str, float], title: str) -> str:
    """``predict --truth``'s scores as text: a row per region, a column per score (HD95 in mm; ``-``: undefined)."""
    from medfed.results import REGION_TITLES, VOLUME_COLUMNS, format_cell, text_grid

    regions = [region for region in REGION_TITLES if f"dice_{region}" in scores]
    columns = [column for column in VOLUME_COLUMNS if f"{column}_{regions[0]}" in scores]
    body = [[REGION_TITLES[region], *(format_cell(scores[f"{column}_{region}"]) for column in columns)] for region in regions]
    note = "dice, iou, hd95: medfed's whole-volume scores; lesion_*: brats-evaluation's lesion-wise scores (a missed lesion: HD95 373 mm)"
    return "\n".join([title, *text_grid(["region", *columns], body), note])
