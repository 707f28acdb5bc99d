"""``task.regions: brats``: three sigmoid outputs trained end to end, every region reported, predict writing BraTS labels.

One 2-round run of the tiny config with the three regions (FedAvg, so the
model every site evaluates is one file's); predict applies a site's model to
one of its own test cases and, given the case's segmentation, must score it
exactly as the run's whole-volume evaluation recorded that patient.
"""

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from medfed.checkpoint import checkpoints, read_checkpoint
from medfed.cli import main
from medfed.data.brats import find_cases
from medfed.config import lesion_wise_available as available

REGIONS = ("wt", "tc", "et")


@pytest.fixture(scope="module")
def regions_run(tmp_path_factory, tiny_brats_root):
    from conftest import TINY_RUN

    folder = tmp_path_factory.mktemp("regions")
    config = folder / "tiny.yaml"
    config.write_text(TINY_RUN.format(root=tiny_brats_root, output=folder / "run"))
    assert main(["fit", "--config", str(config), "--quiet", "trainer.rounds=2", "strategy.name=fedavg", "task.regions=brats"]) == 0
    return folder / "run"


def test_a_two_round_brats_regions_run_trains_three_outputs_and_reports_every_region(regions_run):
    results = json.loads((regions_run / "results.json").read_text())
    assert results["config"]["task"] == {"regions": "brats"} and results["federation"]["num_classes"] == 3
    state = read_checkpoint(checkpoints(regions_run / "checkpoints")[-1])
    outputs = {name: tensor.shape[1] for name, tensor in state["sites"][0]["slots"]["model"]["module"].items()
               if name.endswith("weight") and tensor.ndim == 4}
    assert list(outputs.values())[-1] == 3  # the last (transposed) convolution makes one logit map per region

    lesion = ("lesion_dice", "lesion_nsd", "lesion_hd95") if available() else ()
    expected = {"label_iou", "label_iou_tc", "label_iou_et", *(f"{m}_{r}" for m in ("dice", "iou", "hd95", *lesion) for r in REGIONS)}
    for row in results["sites"]:
        assert expected <= set(row)
        assert all(0.0 <= row[name] <= 1.0 for name in ("label_iou", "label_iou_tc", "label_iou_et", "dice_wt", "dice_tc", "dice_et"))
    assert expected <= set(results["mean"])
    patients = results["volume_metrics"]["patients"]
    for site in results["federation"]["sites"]:  # every test patient of every site, with every region's scores
        assert set(patients[site["name"]]) == set(site["test_cases"])
        for scores in patients[site["name"]].values():
            assert {f"{m}_{r}" for m in ("dice", "hd95", *lesion) for r in REGIONS} <= set(scores)
    code = results["volume_metrics"]["code"]
    assert "medfed.evaluation.volume" in code["legacy"]
    if available():
        assert code["lesion_wise"]["package"] == "brats-evaluation" and code["lesion_wise"]["miss_hd95_mm"] == 373.0
    else:
        assert code["lesion_wise"] is None and "not installed" in code["lesion_wise_note"]


def test_predict_writes_brats_labels_on_the_input_grid_and_scores_a_patient_as_the_run_did(regions_run, tiny_brats_root, tmp_path, capsys):
    results = json.loads((regions_run / "results.json").read_text())
    site = results["federation"]["sites"][0]
    case = next(case for case in find_cases(tiny_brats_root) if case.case_id == site["test_cases"][0])
    out = tmp_path / "pred.nii.gz"
    arguments = ["predict", "--run", str(regions_run), "--site", site["name"], "--input", str(case.image_files[0].parent),
                 "--out", str(out), "--truth", str(case.label_file)]
    assert main(arguments) == 0
    written, reference = nib.load(out), nib.load(case.image_files[0])
    assert written.shape == reference.shape
    np.testing.assert_array_equal(written.affine, reference.affine)
    labels = np.asarray(written.dataobj)
    assert labels.dtype == np.uint8 and set(np.unique(labels).tolist()) <= {0, 1, 2, 4}
    assert {1, 2, 4} & set(np.unique(labels).tolist())  # some tumour labelled, ET as BraTS 2017-2021 writes it (4, not 3)

    table = capsys.readouterr().out
    recorded = results["volume_metrics"]["patients"][site["name"]][case.case_id]
    lines = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith(("WT,", "TC,", "ET,"))}
    columns = next(line for line in table.splitlines() if line.startswith("region")).split()[1:]
    for region in REGIONS:
        printed = lines[f"{region.upper()},"][-len(columns):]
        for column, value in zip(columns, printed):
            expected = recorded[f"{column}_{region}"]
            assert value == ("-" if expected is None else f"{expected:.4f}"), (region, column)


def test_task_regions_is_refused_where_the_task_has_one_target_and_model_target_points_to_it(tmp_path, capsys):
    assert main(["fit", "--config", "clinical_delta1", "--print-config", "task.regions=brats"]) == 2
    assert "config key 'task.regions' = 'brats': the clinical task has one fixed target" in capsys.readouterr().err
    assert main(["fit", "--config", "brats_lack0", "--print-config", "task.regions=regions"]) == 2
    assert "config key 'task.regions' = 'regions': expected wt or brats" in capsys.readouterr().err
    assert main(["fit", "--config", "brats_lack0", "--print-config", "model.target=regions"]) == 2
    assert "'model.target' is now 'task.regions'" in capsys.readouterr().err


def test_a_three_region_model_is_a_sigmoid_per_region_whose_masks_may_overlap():
    from medfed.models.segmentation import UNetSegmenter

    model = UNetSegmenter(4, 3, UNetSegmenter.Options(channels=[4, 8], strides=[2], num_res_units=0), regions="brats")
    logits = torch.tensor([3.0, 2.0, -1.0]).reshape(1, 3, 1, 1).expand(1, 3, 2, 2)
    assert model.region_masks(logits)[0, :, 0, 0].tolist() == [True, True, False]  # WT and TC at once: not a softmax
    assert model.region_names == REGIONS and model.metric_names == ("label_iou", "label_iou_tc", "label_iou_et")


def test_wandb_overlays_give_each_region_a_mask_and_a_colour_of_its_own():
    from types import SimpleNamespace

    from medfed.models.segmentation import UNetSegmenter
    from medfed.tracking import REGION_LABELS, segmentation_overlays

    model = UNetSegmenter(4, 3, UNetSegmenter.Options(channels=[4, 8], strides=[2], num_res_units=0), regions="brats")
    x = torch.randn(5, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(5, 3, 16, 16, dtype=torch.uint8)
    y[:, 0, 2:12, 2:12] = y[:, 1, 4:10, 4:10] = y[:, 2, 6:8, 6:8] = 1
    site = SimpleNamespace(name="site0", n_test=5, data=SimpleNamespace(test=SimpleNamespace(tensors=(x, y))), module=model,
                           fabric=SimpleNamespace(to_device=lambda t: t))
    overlays = segmentation_overlays(site, ("FLAIR", "T1", "T1ce", "T2"), REGION_LABELS)
    assert len(overlays) == 4  # the fixed example patches
    with torch.no_grad():
        predicted = model.region_masks(model(x))
    for image in overlays:
        index = int(image._caption.split("patch ")[1].split(":")[0])
        masks = {key: mask._val["mask_data"] for key, mask in image._masks.items()}
        assert set(masks) == {f"{kind} {region}" for kind in ("truth", "prediction") for region in ("WT", "TC", "ET")}
        for r, region in enumerate(("WT", "TC", "ET")):  # region r is class r + 1: its own colour, WT/TC/ET named
            assert set(np.unique(masks[f"truth {region}"])) == {0, r + 1}
            np.testing.assert_array_equal(masks[f"truth {region}"], np.flipud(y[index, r].numpy().T) * (r + 1))
            np.testing.assert_array_equal(masks[f"prediction {region}"], np.flipud(predicted[index, r].numpy().T).astype(np.uint8) * (r + 1))
        assert image._masks["truth TC"]._val["class_labels"][2] == "tumour core (TC)"
