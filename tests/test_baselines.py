"""medfed.evaluation.baselines: the trivial predictors' rules and scores against hand computations."""

import pytest
import torch
from torch.utils.data import TensorDataset

from medfed.data.federation import SiteData
from medfed.evaluation.baselines import best_threshold, site_baselines
from medfed.models.segmentation import UNetSegmenter
from medfed.models.tabular import LogisticRegression
from medfed.options.models import UNetOptions


def test_best_threshold_finds_the_cut_of_the_highest_iou_in_either_direction():
    # values 1..6, target at 4, 5, 6 except 5: v > 3 predicts 4, 5, 6: TP 2, FP 1, FN 0 -> IoU 2/3
    values = torch.tensor([1.0, 2, 3, 4, 5, 6])
    iou, threshold, sign = best_threshold(values, torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.bool))
    assert (iou, threshold, sign) == pytest.approx((2 / 3, 3.0, 1))
    # the target low: v <= 2 predicts 1, 2, both targets: IoU 1
    assert best_threshold(values, torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool)) == pytest.approx((1.0, 2.0, -1))
    # one value only (a zero-filled channel): the only cuts are all or nothing; all gives IoU = the target share
    assert best_threshold(torch.zeros(4), torch.tensor([1, 0, 0, 0], dtype=torch.bool))[0] == pytest.approx(0.25)


def segmentation_site():
    """Training patches where channel 2 is 1 on the tumour and 0 elsewhere (noise on the others); a test split with a
    known tumour and a channel 2 that marks it with one false-positive pixel and one missed pixel."""
    generator = torch.Generator().manual_seed(0)
    y_train = torch.zeros(4, 8, 8, dtype=torch.int64)
    y_train[:, 2:5, 2:5] = 1
    x_train = torch.rand(4, 4, 8, 8, generator=generator) * 0.5
    x_train[:, 2] = y_train.float()
    y_test = torch.zeros(2, 8, 8, dtype=torch.int64)
    y_test[0, 0:4, 0:4] = 1  # 16 tumour pixels in patch 0, none in patch 1: 16 of 128
    x_test = torch.rand(2, 4, 8, 8, generator=generator) * 0.5
    x_test[:, 2] = y_test.float()
    x_test[1, 2, 7, 7] = 1.0  # a false positive
    x_test[0, 2, 0, 0] = 0.0  # a missed tumour pixel
    return SiteData("site0", TensorDataset(x_train, y_train), TensorDataset(x_test, y_test))


def test_segmentation_baselines_score_the_rules_with_the_models_own_metrics_as_computed_by_hand():
    model = UNetSegmenter(4, 2, UNetOptions(channels=[4, 8], strides=[2], num_res_units=0))
    found = site_baselines(model, [segmentation_site()])
    assert set(found) == {"all_foreground", "threshold"}
    every = found["all_foreground"]["metrics"]["site0"]
    # all foreground: tumour IoU = 16 / 128, background IoU = 0 / 112 = 0
    assert every["label_iou"] == pytest.approx(16 / 128) and every["iou"] == pytest.approx(16 / 128 / 2)
    rule = found["threshold"]
    assert rule["rules"]["site0"].startswith("wt: channel 2 > ")  # training: channel 2 separates perfectly
    scores = rule["metrics"]["site0"]
    # test: TP 15, FP 1, FN 1 -> tumour IoU 15/17; background: 112 pixels, 111 of them called background, and the
    # missed tumour pixel called background too -> 111 / (111 + 1 + 1)
    assert scores["label_iou"] == pytest.approx(15 / 17)
    assert scores["iou"] == pytest.approx((15 / 17 + 111 / 113) / 2)


def test_classification_baselines_are_the_majority_class_and_the_best_single_feature_rule():
    # training: 6 records, 2 positive; feature 1 separates them (positive above 0.5), feature 0 is noise
    x_train = torch.tensor([[0.1, 0.0], [0.9, 0.1], [0.5, 0.2], [0.3, 0.3], [0.2, 0.8], [0.6, 0.9]])
    y_train = torch.tensor([0, 0, 0, 0, 1, 1])
    # test: 5 records, 2 positive; the rule x1 > 0.55 gets 4 right: (0.7, 1) and (0.4, 0) right, (0.6, 0) wrong
    x_test = torch.tensor([[0.0, 0.7], [0.0, 0.4], [0.0, 0.6], [0.0, 0.1], [0.0, 0.05]])
    y_test = torch.tensor([1, 1, 0, 0, 0])
    site = SiteData("site0", TensorDataset(x_train, y_train), TensorDataset(x_test, y_test))
    found = site_baselines(LogisticRegression(2, 2), [site])
    majority = found["majority"]["metrics"]["site0"]
    assert found["majority"]["rules"]["site0"] == "class 0 for every record"
    assert majority == pytest.approx({"accuracy": 3 / 5, "balanced_accuracy": 0.5, "auroc": 0.5})
    rule = found["one_feature"]
    assert rule["rules"]["site0"] == "feature 1 > 0.55 (training accuracy 1.000)"  # midway between 0.3 and 0.8
    scores = rule["metrics"]["site0"]
    # predictions 1, 0, 1, 0, 0: accuracy 3/5; recalls: positives 1/2, negatives 2/3
    assert scores["accuracy"] == pytest.approx(3 / 5) and scores["balanced_accuracy"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    # AUROC of x1 for the test labels: positive (0.7, 0.4) against negative (0.6, 0.1, 0.05): 5 of 6 pairs ordered
    assert scores["auroc"] == pytest.approx(5 / 6)


def test_a_model_of_no_known_kind_has_no_baselines():
    assert site_baselines(torch.nn.Linear(2, 2), []) == {}


def test_region_baselines_score_every_region_with_the_three_output_models_metrics():
    # task.regions=brats: the masks are (n, 3, H, W); here WT is the site's tumour, TC its part left of column 2, ET empty
    def regions(y):
        tc = y.clone()
        tc[:, :, 2:] = 0
        return torch.stack([y, tc, torch.zeros_like(y)], dim=1).to(torch.uint8)

    (x_train, y_train), (x_test, y_test) = segmentation_site().train.tensors, segmentation_site().test.tensors
    site = SiteData("site0", TensorDataset(x_train, regions(y_train)), TensorDataset(x_test, regions(y_test)))
    model = UNetSegmenter(4, 3, UNetOptions(channels=[4, 8], strides=[2], num_res_units=0), regions="brats")
    found = site_baselines(model, [site])
    every = found["all_foreground"]["metrics"]["site0"]
    # all foreground: each region's IoU is its share of the 128 test pixels: WT 16, TC 8 (rows 0-3, columns 0-1), ET 0
    assert (every["label_iou"], every["label_iou_tc"], every["label_iou_et"]) == pytest.approx((16 / 128, 8 / 128, 0.0))
    assert found["threshold"]["rules"]["site0"].startswith("wt: channel 2 > ") and "; tc: " in found["threshold"]["rules"]["site0"]
