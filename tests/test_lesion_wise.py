"""The official lesion-wise scores: medfed's records against the ``brats-evaluation`` package run as the challenge runs it.

The package's own pipeline, not medfed's call of it: the prediction and the
ground truth written as NIfTI files, ``brats_evaluation.evaluate_single_exam``
with the bundled glioma config on the files (spacing from their headers),
``brats_evaluation.parse_seg_results`` turning its JSON into the challenge's
CSV; medfed's numbers must equal that CSV's exactly.
"""

import json
import math

import nibabel as nib
import numpy as np
import pytest
from scipy.ndimage import binary_erosion

from medfed.data.brats import TumourLabel, find_cases, load_case
from medfed.evaluation.lesion_wise import MISS_HD95_MM, lesion_wise_scores, metric_code
from medfed.evaluation.volume import REGION_MASKS, patient_scores, tumour_labels

brats_evaluation = pytest.importorskip("brats_evaluation", reason="the brats extra: pip install -e '.[brats]'")
pd = pytest.importorskip("pandas")

REGIONS = ("wt", "tc", "et")


def _predictions(truth: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Kinds of prediction of one case: each exercises a lesion-wise convention."""
    shifted = np.roll(truth, 2, axis=0)
    eroded = truth.copy()
    eroded[~binary_erosion(truth > 0)] = 0  # the core shrinks, the edges go
    spurious = truth.copy()
    corner = tuple(slice(1, 4) for _ in truth.shape)
    spurious[corner] = TumourLabel.OEDEMA  # a false-positive lesion far from the tumour
    no_et = np.where(truth == TumourLabel.ENHANCING, TumourLabel.NECROTIC_CORE, truth).astype(np.uint8)  # the ET missed
    noisy = truth.copy()
    flips = rng.random(truth.shape) < 0.002
    noisy[flips] = rng.choice([TumourLabel.NECROTIC_CORE, TumourLabel.OEDEMA, TumourLabel.ENHANCING], size=int(flips.sum()))
    return {"perfect": truth, "shifted": shifted, "eroded": eroded, "spurious": spurious, "no_et": no_et, "noisy": noisy,
            "empty": np.zeros_like(truth)}


def test_medfeds_lesion_wise_scores_equal_the_packages_csv_exactly(tiny_brats_root, tmp_path):
    from panoptica import Panoptica_Evaluator

    evaluator = Panoptica_Evaluator.load_from_config(str(brats_evaluation.config_path("gli")))
    rng = np.random.default_rng(0)
    reference, predicted, summary, expected, absent = tmp_path / "ref", tmp_path / "pred", {"metrics": [], "missings": []}, {}, {}
    reference.mkdir()
    predicted.mkdir()
    for number, case in enumerate(find_cases(tiny_brats_root)[:3]):
        volume = load_case(case)
        truth = volume.label.astype(np.uint8)
        spacing = tuple(float(s) for s in np.linalg.norm(volume.affine[:3, :3], axis=0))
        for kind, prediction in _predictions(truth, rng).items():
            subject = f"{number:05d}-{kind}"
            reference_file, prediction_file = reference / f"ref-{subject}.nii.gz", predicted / f"pred-{subject}.nii.gz"
            nib.save(nib.Nifti1Image(truth, volume.affine), reference_file)
            nib.save(nib.Nifti1Image(prediction.astype(np.uint8), volume.affine), prediction_file)
            summary["metrics"].append(
                brats_evaluation.evaluate_single_exam(str(prediction_file), str(reference_file), subject, evaluator)
            )
            expected[subject] = lesion_wise_scores(prediction, truth, spacing, REGIONS)
            absent[subject] = {region: not (REGION_MASKS[region](prediction).any() or REGION_MASKS[region](truth).any()) for region in REGIONS}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    brats_evaluation.parse_seg_results(str(tmp_path / "summary.json"), str(tmp_path / "official.csv"))
    official = pd.read_csv(tmp_path / "official.csv", float_precision="round_trip").set_index("subject_id")  # floats as written

    compared, misses, undefined = 0, 0, 0
    for subject, scores in expected.items():
        for region in REGIONS:
            for ours, theirs in (("lesion_dice", "lesionwise_dsc_mean"), ("lesion_nsd", "lesionwise_nsd_mean"), ("lesion_hd95", "lesionwise_hd95_mean")):
                value = float(official.loc[subject, f"{theirs}_{region}"])
                if ours == "lesion_hd95" and math.isinf(value):
                    value, misses = MISS_HD95_MM, misses + 1  # the package's penalty for a region without a matched lesion
                assert math.isnan(value) == absent[subject][region], (subject, region, ours)  # undefined: no lesion either side
                if math.isnan(value):
                    assert math.isnan(scores[f"{ours}_{region}"]), (subject, region, ours)
                    undefined += 1
                else:
                    assert scores[f"{ours}_{region}"] == value, (subject, region, ours)  # exactly: the same code on the same masks
                compared += 1
    assert compared == 3 * 7 * 3 * 3
    assert misses >= 3 * 2  # the empty prediction misses every region, no_et its ET
    assert official.loc["00000-perfect", "lesionwise_dsc_mean_wt"] == 1.0 and expected["00000-shifted"]["lesion_dice_wt"] < 1.0
    assert expected["00000-spurious"]["lesion_dice_wt"] == 1.0  # a spurious lesion beside a matched one: not in the mean
    assert 0 < undefined < compared  # a generated case without enhancing tumour, predicted without it


def test_a_region_absent_from_both_sides_is_undefined_and_a_miss_is_373_mm():
    truth = np.zeros((20, 20, 12), dtype=np.uint8)
    truth[5:12, 5:12, 3:8] = TumourLabel.OEDEMA  # no core, no enhancing tumour
    scores = lesion_wise_scores(truth, truth, (1.0, 1.0, 2.0), REGIONS)
    assert scores["lesion_dice_wt"] == 1.0 and scores["lesion_hd95_wt"] == 0.0
    assert all(math.isnan(scores[f"{metric}_{region}"]) for metric in ("lesion_dice", "lesion_nsd", "lesion_hd95") for region in ("tc", "et"))
    missed = lesion_wise_scores(np.zeros_like(truth), truth, (1.0, 1.0, 2.0), ("wt",))
    assert missed == {"lesion_dice_wt": 0.0, "lesion_nsd_wt": 0.0, "lesion_hd95_wt": MISS_HD95_MM}


def test_patient_scores_put_the_legacy_and_the_official_scores_side_by_side_and_name_the_code():
    truth = np.zeros((24, 24, 12), dtype=np.uint8)
    truth[4:14, 4:14, 2:8] = TumourLabel.OEDEMA
    truth[6:12, 6:12, 3:7] = TumourLabel.NECROTIC_CORE
    truth[8:10, 8:10, 4:6] = TumourLabel.ENHANCING
    prediction = np.roll(truth, 1, axis=1)
    scores = patient_scores(prediction, truth, (1.0, 1.0, 1.0), REGIONS, lesion_wise=True)
    assert set(scores) == {f"{m}_{r}" for m in ("dice", "iou", "hd95", "lesion_dice", "lesion_nsd", "lesion_hd95") for r in REGIONS}
    assert scores["lesion_dice_wt"] == pytest.approx(scores["dice_wt"])  # one lesion each side: lesion-wise Dice is the Dice
    code = metric_code(True)["lesion_wise"]
    assert code["package"] == "brats-evaluation" and code["version"] and code["panoptica"] and code["miss_hd95_mm"] == 373.0
    assert metric_code(False)["lesion_wise"] is None


def test_three_region_masks_become_one_label_map_whose_regions_are_nested():
    # per voxel (WT, TC, ET): background; oedema; necrotic core; enhancing; a TC voxel outside the predicted WT; ET alone
    masks = np.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 1]], dtype=bool).reshape(3, 6, 1, 1)
    labels = tumour_labels(masks, REGIONS).ravel().tolist()
    assert labels == [0, TumourLabel.OEDEMA, TumourLabel.NECROTIC_CORE, TumourLabel.ENHANCING, TumourLabel.NECROTIC_CORE, TumourLabel.ENHANCING]
    assert tumour_labels(masks[:1], ("wt",)).ravel().tolist() == [0, 1, 1, 1, 0, 0]  # the whole tumour alone: 1
