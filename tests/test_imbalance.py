"""A two-class model on strongly imbalanced labels: warned before training, and when it ends predicting one class."""

import csv
import logging

import torch

from medfed.cli import main
from medfed.data.tabular import write_breast_cancer_csv
from medfed.evaluation.imbalance import imbalance_warning, one_class_warning


def test_strong_imbalance_is_named_per_site_unless_the_classes_are_weighed():
    labels = {"site0": torch.tensor([1] + [0] * 19), "site1": torch.tensor([1, 0] * 10), "site2": torch.tensor([1] * 19 + [0])}
    warning = imbalance_warning(labels, None)
    assert warning.startswith("strongly imbalanced training labels (positive share: site0 5.0%, site2 95.0%)")  # site1 is balanced
    assert "model.class_weight=balanced" in warning
    assert imbalance_warning(labels, "balanced") is None
    assert imbalance_warning({"site1": labels["site1"]}, None) is None


def test_a_model_that_predicts_one_class_for_every_test_sample_is_named():
    label = torch.tensor([0, 0, 0, 1])
    scores = {
        "site0": (torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), label),  # all negative: stuck
        "site1": (torch.tensor([0.1, 0.2, 0.3, 0.9], dtype=torch.float64), label),  # both classes predicted
        "site2": (torch.tensor([0.6, 0.7, 0.8, 0.9], dtype=torch.float64), label),  # all positive: stuck
        "site3": (torch.tensor([0.1, 0.2], dtype=torch.float64), torch.tensor([0, 0])),  # one class in the truth: nothing to say
    }
    warning = one_class_warning(scores, None)
    assert warning.startswith("the final model predicts one class for every test sample at site0 (negative), site2 (positive)")
    assert "model.class_weight=balanced" in warning
    assert "ROC curves" in one_class_warning(scores, "balanced")
    assert one_class_warning({"site1": scores["site1"]}, None) is None


def test_a_run_on_five_percent_positives_warns_before_training_and_after(tmp_path, caplog):
    rows = list(csv.DictReader(open(write_breast_cancer_csv(tmp_path / "full.csv"))))
    kept = [row for row in rows if row["diagnosis"] != "malignant"] + [row for row in rows if row["diagnosis"] == "malignant"][:21]
    with open(tmp_path / "rare.csv", "w", newline="") as file:  # 357 benign, 21 malignant: 5.6% positive
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(kept)
    arguments = ["fit", "--config", "clinical_delta1", f"data.csv={tmp_path / 'rare.csv'}", "data.embedded=null", "federation.label_ratio=null",
                 "trainer.rounds=2", "strategy.name=fedavg", "logger.wandb=disabled", f"output_dir={tmp_path / 'run'}", "--quiet"]
    caplog.set_level(logging.WARNING, logger="medfed")
    assert main(arguments) == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(w.startswith("strongly imbalanced training labels (positive share: site0 4.9%") for w in warnings), warnings
    assert any(w.startswith("the final model predicts one class for every test sample at site0 (negative)") for w in warnings)
    caplog.clear()
    assert main([*arguments[:-2], f"output_dir={tmp_path / 'weighed'}", "model.class_weight=balanced", "--quiet"]) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the classes weighed: no warning, both classes predicted
