import json
import math

import pytest

from medfed.results import format_table, summarise, write_json_atomic

HISTORY = [
    {"metrics": {"site0": {"iou": 0.1, "label_iou": 0.0}, "site1": {"iou": 0.2, "label_iou": 0.1}}},
    {"metrics": {"site0": {"iou": 0.8, "label_iou": 0.6}, "site1": {"iou": 0.6, "label_iou": 0.4}}},
]


def test_summary_uses_the_last_round_and_the_plain_mean_over_sites():
    summary = summarise(HISTORY, {"site0": 10, "site1": 30})
    assert summary["sites"] == [
        {"site": "site0", "iou": 0.8, "label_iou": 0.6, "n_test": 10},
        {"site": "site1", "iou": 0.6, "label_iou": 0.4, "n_test": 30},
    ]
    assert summary["mean"] == pytest.approx({"iou": 0.7, "label_iou": 0.5})


def test_table_names_the_data_and_lists_every_site():
    results = {**summarise(HISTORY, {"site0": 10, "site1": 30}), "strategy": "fedavg",
               "federation": {"task": "brats", "description": "GENERATED BraTS-like data"}}
    table = format_table(results)
    assert table.splitlines()[0] == "fedavg on brats, data: GENERATED BraTS-like data"
    assert "site0  0.8000     0.6000      10" in table and "mean   0.7000     0.5000      40" in table


def test_results_json_has_no_nan(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"loss": float("nan"), "rows": [{"auroc": float("inf")}, 1.5]})
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text, parse_constant=lambda constant: pytest.fail(constant)) == {"loss": None, "rows": [{"auroc": None}, 1.5]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind


def test_metrics_on_a_validation_split_say_so_in_the_title_and_the_size_column():
    summary = summarise(HISTORY, {"site0": 10, "site1": 30}, "validation")
    assert [row["n_validation"] for row in summary["sites"]] == [10, 30]
    assert all("n_test" not in row for row in summary["sites"])
    results = {**summary, "strategy": "fedavg",
               "federation": {"task": "brats", "description": "GENERATED BraTS-like data", "holdout": "validation"}}
    lines = format_table(results).splitlines()
    assert lines[0] == "fedavg on brats, data: GENERATED BraTS-like data; metrics on the VALIDATION split (test split set aside)"
    assert lines[2].split() == ["site", "iou", "label_iou", "n_validation"]
    assert lines[-1].split() == ["mean", "0.7000", "0.5000", "40"]


def test_classification_table_shows_balanced_accuracy_and_auroc_beside_accuracy():
    history = [{"metrics": {"site0": {"accuracy": 0.955, "balanced_accuracy": 0.5, "auroc": 0.9},
                            "site1": {"accuracy": 0.8, "balanced_accuracy": 0.75, "auroc": 0.7}}}]
    results = {**summarise(history, {"site0": 200, "site1": 100}), "strategy": "pfednet",
               "federation": {"task": "clinical", "description": "clinical records"}}
    lines = format_table(results).splitlines()
    assert lines[2].split() == ["site", "accuracy", "balanced_accuracy", "auroc", "n_test"]
    assert lines[4].split() == ["site0", "0.9550", "0.5000", "0.9000", "200"]  # all-negative: accuracy alone misleads
    assert lines[-1].split() == ["mean", "0.8775", "0.6250", "0.8000", "300"]


def test_an_excluded_site_is_marked_and_the_table_says_when_and_why():
    results = {**summarise(HISTORY, {"site0": 10, "site1": 30}), "strategy": "fedavg",
               "federation": {"task": "brats", "description": "GENERATED BraTS-like data"},
               "excluded": {"site1": {"round": 4, "reason": "RuntimeError: no GPU"}}}
    lines = format_table(results).splitlines()
    assert lines[5].split() == ["site1*", "0.6000", "0.4000", "30"] and lines[4].split()[0] == "site0"
    assert lines[-1] == "* site1: excluded after round 4, its last failure: RuntimeError: no GPU"


def test_whole_volume_scores_are_a_block_per_region_that_says_it_averages_patients_and_which_code_scored():
    history = [{"metrics": {"site0": {"iou": 0.8, "label_iou": 0.6, "dice_wt": 0.7, "hd95_wt": 12.5, "lesion_dice_wt": 0.9,
                                      "dice_et": 0.5, "lesion_dice_et": float("nan")},
                            "site1": {"iou": 0.6, "label_iou": 0.4, "dice_wt": 0.5, "hd95_wt": 20.0, "lesion_dice_wt": 0.7,
                                      "dice_et": 0.3, "lesion_dice_et": 0.2}}}]
    sites = [{"name": "site0", "test_cases": ["a", "b"]}, {"name": "site1", "test_cases": ["c", "d", "e"]}]
    code = {"lesion_wise": {"version": "0.0.10", "panoptica": "2.1.7", "miss_hd95_mm": 373.0}}
    results = {**summarise(history, {"site0": 32, "site1": 48}), "strategy": "fedavg", "volume_metrics": {"code": code},
               "federation": {"task": "brats", "description": "GENERATED BraTS-like data", "sites": sites}}
    lines = format_table(results).splitlines()
    patch_mean = next(line for line in lines if line.startswith("mean"))
    assert patch_mean.split() == ["mean", "0.7000", "0.5000", "80"]  # the patch table holds the patch metrics only
    assert "iou, label_iou: over all test patches of a site (n_test = patches)" in lines
    intro = next(line for line in lines if line.startswith("whole volumes"))
    assert "mean over each site's test patients (2-3 per site); HD95 in mm" in intro
    assert "brats-evaluation 0.0.10 (panoptica 2.1.7), a missed lesion's HD95 = 373 mm" in intro
    wt = lines.index(next(line for line in lines if line.startswith("WT, whole tumour")))
    assert lines[wt].split()[3:] == ["dice", "hd95", "lesion_dice"]
    assert lines[wt + 5].split() == ["mean", "0.6000", "16.2500", "0.8000"]
    et = lines.index(next(line for line in lines if line.startswith("ET, enhancing tumour")))
    assert lines[et + 2].split() == ["site0", "0.5000", "-"]  # undefined (no lesion on either side): shown as such
    assert lines[et + 5].split() == ["mean", "0.4000", "0.2000"]  # the mean over the sites where it is defined


def test_the_final_mean_is_over_the_sites_that_reported_a_metric():
    # a site whose last delivery failed has NaN metrics (docs/running.md): the mean is the others', as the round record's
    history = [{"metrics": {"site0": {"iou": 0.5}, "site1": {"iou": float("nan")}, "site2": {"iou": 0.7}}}]
    summary = summarise(history, {"site0": 3, "site1": 4, "site2": 5})
    assert summary["mean"]["iou"] == pytest.approx(0.6)
    assert math.isnan(summarise([{"metrics": {"site0": {"iou": float("nan")}}}], {"site0": 3})["mean"]["iou"])
