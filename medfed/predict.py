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

* ``model.target: wt``: 1 = whole tumour, 0 = background;
* ``model.target: regions``: BraTS labels, 1 = necrotic/non-enhancing core
  (TC without ET), 2 = oedema (WT without TC), 4 = enhancing tumour.

It is written to a temporary file and renamed, and an existing ``--out`` is
never replaced unless ``--overwrite`` is given.
"""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from medfed.checkpoint import FOLDER, checkpoints, config_differences, read_checkpoint
from medfed.components import resolve
from medfed.config import load_config
from medfed.data.brats import MODALITIES, case_from_paths, load_case
from medfed.data.patches import zscore_over_brain
from medfed.errors import ConfigError, DataError
from medfed.evaluation.volume import segment_volume
from medfed.tasks.brats import missing_channel_sites


def predict(run_dir: Path, site: str, inputs: list[Path], out: Path, *, overwrite: bool = False, batch_size: int = 32) -> Path:
    """Segment the scan ``inputs`` with site ``site``'s model of the run in ``run_dir``; returns ``out``.

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
    state = read_checkpoint(saved[-1])
    changed = config_differences(state["config"], resolved.config)
    if changed:
        raise ConfigError(f"--run {run_dir}: config.json and the checkpoint {saved[-1].name} are of different runs (they differ at {', '.join(changed[:5])})")
    n_sites = len(state["sites"])
    names = [f"site{index}" for index in range(n_sites)]
    if site not in names:
        raise ConfigError(f"--site {site!r}: the run has sites {', '.join(names)}")
    index = names.index(site)

    target = resolved.model_options.target
    model = resolved.model_cls(len(MODALITIES), 2 if target == "wt" else 3, resolved.model_options)
    evaluated = resolved.strategy_cls.evaluated_slot
    resolved.strategy_cls.prepare_slot(evaluated, model)
    slots = state["sites"][index]["slots"]
    if evaluated not in slots:
        raise DataError(f"checkpoint {saved[-1]}: {site} has the model slots {sorted(slots)}, not {evaluated!r} which {resolved.strategy_cls.name} evaluates")
    try:
        model.load_state_dict(slots[evaluated]["module"])  # the model it was evaluated with
    except RuntimeError as error:  # weights of another shape than config.json's model
        raise DataError(f"checkpoint {saved[-1]}: {site}'s weights do not fit the model config.json describes ({_first_line(error)})") from None
    model.eval()

    case = case_from_paths(inputs)
    volume = load_case(case, resolved.data_options.resample)
    image = zscore_over_brain(volume.image)
    lacking, channel = missing_channel_sites(resolved.run.federation)
    if index in lacking:
        image[channel] = 0.0  # as this site's training patches were
    patch_size = resolved.data_options.patch_size
    with torch.no_grad():
        output = segment_volume(model, torch.from_numpy(image), patch_size, batch_size)  # (K, X, Y, Z)
        masks = model.region_masks(output.movedim(-1, 0)).movedim(0, -1).numpy()  # (R, X, Y, Z)
    labels = masks[0].astype(np.uint8) if target == "wt" else _brats_labels(masks)
    reference = nib.load(case.image_files[0])
    written = nib.Nifti1Image(labels, reference.affine, header=reference.header)
    written.set_data_dtype(np.uint8)
    written.header.set_slope_inter(1.0, 0.0)
    write_out(written, out)
    return out


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


def write_out(image: nib.Nifti1Image, out: Path) -> None:
    """Write ``image`` to a hidden temporary file beside ``out`` and rename it into place (an existing ``out`` stays
    whole until then).

    Raises:
        ConfigError: the folder or the file cannot be written (a full disk, permissions changed since the check).
    """
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


def _brats_labels(masks: np.ndarray) -> np.ndarray:
    """WT, TC, ET masks ``(3, X, Y, Z)`` -> BraTS labels: 4 in ET, else 1 in TC, else 2 in WT, else 0."""
    wt, tc, et = masks
    return np.select([et, tc, wt], [4, 1, 2], default=0).astype(np.uint8)
