"""What CSV and W&B hold after real tiny runs: decoded from metrics.csv and the offline ``.wandb`` files."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import confusion_matrix, roc_auc_score, roc_curve
from wandb_records import offline_runs

import medfed.tracking
from medfed.cli import INTERRUPTED, main
from medfed.components import resolve
from medfed.config import load_config
from medfed.federated.loop import FederatedLoop
from medfed.tracking import RUN_ID_FILE

CLASS_LABELS = {"0": "background", "1": "whole tumour"}


@pytest.fixture(autouse=True)
def quiet_offline_wandb(monkeypatch):
    """W&B offline and quiet; Lightning's offline WandbLogger rewrites WANDB_MODE, restored after the test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _csv_rows(run_dir):
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_an_interrupted_and_resumed_brats_run_is_one_wandb_run_with_images_losses_and_the_full_config(
    tiny_run_config, tmp_path, monkeypatch, recwarn
):
    run_dir = tmp_path / "run"
    arguments = ["fit", "--config", str(tiny_run_config), "--quiet", "logger.wandb=offline", "logger.image_every=2"]
    original, csv_steps_when_round_2_began = FederatedLoop._run_round, []

    def ctrl_c_in_round_2(self, round_index):
        if round_index == 2:  # metrics.csv as a process killed now would leave it
            csv_steps_when_round_2_began.extend(row["step"] for row in _csv_rows(run_dir))
            raise KeyboardInterrupt
        return original(self, round_index)

    monkeypatch.setattr(FederatedLoop, "_run_round", ctrl_c_in_round_2)
    assert main(arguments) == INTERRUPTED
    assert csv_steps_when_round_2_began == ["1"]  # on disk after round 1, not after 100 steps
    monkeypatch.setattr(FederatedLoop, "_run_round", original)
    assert main([*arguments, "--resume"]) == 0

    results = json.loads((run_dir / "results.json").read_text())
    history = results["history"]
    rows = _csv_rows(run_dir)
    assert [row["step"] for row in rows] == ["1", "2", "3"]  # one file, every round once
    assert not [w for w in recwarn if "Previous log files" in str(w.message)]  # Lightning's warning of lost CSV logs
    for row, record in zip(rows, history):
        assert float(row["site1/label_iou"]) == pytest.approx(record["metrics"]["site1"]["label_iou"])
        assert float(row["site1/train_loss"]) == pytest.approx(record["train_loss"]["site1"]["joint"])

    first, second = offline_runs(run_dir)
    assert first.run_id == second.run_id == (run_dir / RUN_ID_FILE).read_text().strip()
    assert first.run.run_group == "brats/tiny" and second.run.display_name == "pfednet seed 0"
    assert {"brats", "pfednet", "seed=0", "generated data"} <= set(second.run.tags)
    assert [r.exit.exit_code for r in first.records + second.records if r.HasField("exit")] == [1, 0]
    rounds = [row["trainer/global_step"] for segment in (first, second) for row in segment.rows_with("site0/train_loss")]
    assert rounds == [1, 2, 3]  # the history continues in the same run
    losses = [row["site2/train_loss"] for segment in (first, second) for row in segment.rows_with("site2/train_loss")]
    assert losses == pytest.approx([record["train_loss"]["site2"]["joint"] for record in history])

    full_config = json.loads((run_dir / "config.json").read_text())
    assert full_config == results["config"]
    assert "dropout" not in tiny_run_config.read_text() and full_config["model"]["dropout"] == 0.0
    for segment in (first, second):  # each segment carries the full config, every component default included
        assert {key: value for key, value in segment.config.items() if key != "_wandb"} == full_config

    image_rows = [row for segment in (first, second) for row in segment.rows_with("examples/site0")]
    assert [row["trainer/global_step"] for row in image_rows] == [2, 3]  # every 2nd round and after the last
    labels = second.config["_wandb"]["mask/class_labels"]
    federation = _tiny_federation(tiny_run_config)
    for site in federation.sites:
        key = f"examples/{site.name}"
        assert labels[f"{key}_wandb_delimeter_ground_truth"]["value"] == CLASS_LABELS
        assert labels[f"{key}_wandb_delimeter_prediction"]["value"] == CLASS_LABELS
        images = image_rows[-1][key]
        assert images["_type"] == "images/separated" and images["count"] == 4
        indices = [int(re.fullmatch(rf"{site.name} test patch (\d+): FLAIR", caption).group(1)) for caption in images["captions"]]
        assert indices == [int(re.search(r"patch (\d+)", c).group(1)) for c in image_rows[0][key]["captions"]]  # fixed patches
        for index, masks in zip(indices, images["all_masks"]):
            assert set(masks) == {"ground_truth", "prediction"}
            truth = np.array(Image.open(second.path.parent / "files" / masks["ground_truth"]["path"]))
            assert np.array_equal(truth, np.flipud(site.test.tensors[1][index].numpy().T))  # anterior up, as examples.png
    figures = second.rows_with("figures/examples")[-1]
    assert {"figures/learning_curves", "figures/similarity_graph"} <= set(figures)


def _tiny_federation(config_path):
    resolved = resolve(load_config(config_path))
    trainer = resolved.run.trainer
    return resolved.task.build_federation(resolved.data_options, resolved.run.federation, trainer.seed, progress=False)


def test_a_clinical_run_draws_each_sites_roc_curve_and_confusion_matrix_as_sklearn_computes_them(tmp_path, monkeypatch):
    scores, figures = {}, {}

    def recording(function, store):
        def wrapper(*args, **kwargs):
            store[function.__name__] = function(*args, **kwargs)
            return store[function.__name__]

        return wrapper

    monkeypatch.setattr(medfed.tracking, "plot_roc_curves", recording(medfed.tracking.plot_roc_curves, figures))
    monkeypatch.setattr(medfed.tracking, "plot_confusion_matrices", recording(medfed.tracking.plot_confusion_matrices, figures))
    test_scores = medfed.tracking.test_scores
    monkeypatch.setattr(medfed.tracking, "test_scores", lambda site: scores.setdefault(site.name, test_scores(site)))
    run_dir = tmp_path / "clinical"
    overrides = ["trainer.rounds=2", f"data.csv={tmp_path / 'records.csv'}", f"output_dir={run_dir}", "logger.wandb=offline"]
    assert main(["fit", "--config", "clinical_delta2", "--quiet", *overrides]) == 0

    results = json.loads((run_dir / "results.json").read_text())
    roc_axis = figures["plot_roc_curves"].axes[0]
    curves = {line.get_label().split(" ")[0]: line for line in roc_axis.get_lines()}
    confusion_axes = {axis.get_title(): axis for axis in figures["plot_confusion_matrices"].axes}
    assert [row["site"] for row in results["sites"]] == list(scores) == list(confusion_axes)
    for row in results["sites"]:
        probability, label = (tensor.numpy() for tensor in scores[row["site"]])
        assert len(label) == row["n_test"] and probability.dtype == np.float64
        auroc = roc_auc_score(label, probability)
        assert auroc == pytest.approx(row["auroc"], abs=1e-6)  # the scores the run's (float32) AUROC was computed on
        fpr, tpr, _ = roc_curve(label, probability, drop_intermediate=False)
        line = curves[row["site"]]
        assert line.get_label() == f"{row['site']} (AUROC {auroc:.3f})"
        np.testing.assert_allclose(line.get_xdata(), fpr, atol=1e-7)
        np.testing.assert_allclose(line.get_ydata(), tpr, atol=1e-7)
        expected = confusion_matrix(label, probability > 0.5, labels=[0, 1])
        axis = confusion_axes[row["site"]]
        drawn = [int(text.get_text().split("\n")[0]) for text in axis.texts]
        assert drawn == expected.ravel().tolist()
        np.testing.assert_allclose(axis.images[0].get_array(), expected / expected.sum(axis=1, keepdims=True))
        assert expected.trace() / expected.sum() == pytest.approx(row["accuracy"])
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["not malignant", "malignant"]
    for name in ("roc_curves", "confusion_matrices"):
        assert (run_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (segment,) = offline_runs(run_dir)
    final = segment.rows_with("figures/roc_curves")[-1]
    assert final["figures/roc_curves"]["_type"] == final["figures/confusion_matrices"]["_type"] == "image-file"
    assert "site0/train_loss" in _csv_rows(run_dir)[0]  # one training phase: no phase in the key
    assert not any(key.startswith("examples/") for row in segment.history for key in row)  # no overlays without images


def _fit_output(config, *arguments):
    """stdout and stderr of ``python -m medfed fit`` in a fresh process, W&B offline and left to its own output settings."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    environment.update({"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "WANDB_MODE": "offline"})
    command = [sys.executable, "-m", "medfed", "fit", "--config", str(config), "trainer.rounds=1", "logger.wandb=offline", *arguments]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_quiet_prints_nothing_and_a_normal_run_says_what_it_runs_first_and_its_results_folder_last(tiny_run_config, tmp_path):
    stdout, stderr = _fit_output(tiny_run_config, "--quiet", f"output_dir={tmp_path / 'quiet'}")
    assert stdout == stderr == ""  # W&B's ~30 lines included
    assert (tmp_path / "quiet" / "results.json").is_file() and list((tmp_path / "quiet" / "wandb").glob("offline-run-*"))
    stdout, stderr = _fit_output(tiny_run_config, f"output_dir={tmp_path / 'loud'}")
    lines = [line.rsplit("\r", 1)[-1] for line in stderr.splitlines()]  # what a terminal shows once the bars are redrawn
    assert lines[0] == "medfed: fit tiny: pfednet on brats, 1 rounds, seed 0 (config checked)"
    assert f"medfed: 1 torch thread(s) (trainer.num_threads); results go to {tmp_path / 'loud'}" in lines
    assert "anonymous" not in stderr  # W&B's warning about a setting medfed never sets
    assert not [line for line in lines if line.startswith("wandb:")]  # offline: no W&B start lines, no run summary
    (segment,) = (tmp_path / "loud" / "wandb").glob("offline-run-*")
    assert f"medfed: W&B run (offline) in {segment}; upload it with: wandb sync {segment}" in lines
    assert stderr.splitlines()[-1].startswith(f"medfed: results in {tmp_path / 'loud'}: results.json, learning_curves.png")
    assert "site2" in stdout and "mean" in stdout


def test_quiet_silences_medfeds_info_lines_but_not_its_warnings(tmp_path):
    config = Path(__file__).resolve().parents[1] / "configs" / "clinical_delta1.yaml"
    data = f"data.csv={tmp_path / 'breast_cancer.csv'}"
    stdout, stderr = _fit_output(config, data, f"output_dir={tmp_path / 'loud'}", "logger.wandb=disabled")
    assert "medfed: info: federation.label_ratio (delta 1, spread 1.5) kept" in stderr
    stdout, stderr = _fit_output(config, data, f"output_dir={tmp_path / 'quiet'}", "logger.wandb=disabled", "--quiet")
    assert stdout == stderr == ""
    stdout, stderr = _fit_output(
        config, data, f"output_dir={tmp_path / 'drops'}", "logger.wandb=disabled", "--quiet", "federation.label_ratio.max_drop=0.01"
    )
    assert stdout == "" and stderr.startswith("medfed: warning: federation.label_ratio (delta 1, spread 1.5) drops more than 1% of")
