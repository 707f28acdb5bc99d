"""The two classification tasks through the CLI on tiny data, every strategy: results.json as for BraTS."""

import json

import pytest

from medfed.cli import main

TINY_LUNA16 = """
data:
  task: luna16
  root: {data}/luna16
  generate: {{series_per_site: 3, nodules_per_series: [2, 3], nodule_diameter_mm: [3.0, 6.0],
             negatives_per_series: 12, matrix_size: 64, z_extent_mm: 20.0, seed: 0}}
federation:
  n_sites: 3
  label_ratio: {{delta: 2.0, spread: 1.5}}
model:
  name: densenet
  init_features: 4
  growth_rate: 4
  block_config: [2, 2]
strategy:
  name: pfednet
  pfednet: {{lam: 0.3, min_sketch_samples: 4}}
trainer: {{rounds: 2, batch_size: 8, seed: 0, num_threads: 1}}
logger: {{wandb: disabled}}
output_dir: {output}
"""

TINY_CLINICAL = """
data:
  task: clinical
  csv: {data}/breast_cancer.csv
federation:
  n_sites: 3
  label_ratio: {{delta: 2.0, spread: 1.5}}
model:
  name: logreg
strategy:
  name: pfednet
  pfednet: {{lam: 0.3, min_sketch_samples: 4}}
trainer: {{rounds: 2, batch_size: 16, seed: 0, num_threads: 1}}
logger: {{wandb: disabled}}
output_dir: {output}
"""

# what experiment.run writes for every task (the BraTS end-to-end test checks the same run)
RESULT_KEYS = {
    "medfed_version", "engine", "strategy", "seed", "num_threads", "federation", "sites", "mean", "failures", "excluded", "communication",
    "compute", "timing", "executor", "execution", "config", "history", "baselines", "integrity",
}
METRICS = ["accuracy", "balanced_accuracy", "auroc"]

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("classification-data")


@pytest.mark.parametrize(
    "task, strategy",
    [
        ("luna16", "local"),
        ("luna16", "fedavg"),
        ("luna16", "pfednet"),
        ("clinical", "local"),
        ("clinical", "fedavg"),
        ("clinical", "pfednet"),  # all-personal model: pFedNet's shared phase has nothing to train
    ],
)
def test_cli_run_writes_results_like_brats(task, strategy, data_dir, tmp_path):
    template, generated = {"luna16": (TINY_LUNA16, True), "clinical": (TINY_CLINICAL, False)}[task]
    config = tmp_path / f"{task}.yaml"
    config.write_text(template.format(data=data_dir, output=tmp_path / "run"))
    code = main(["fit", "--config", str(config), "--quiet", f"strategy.name={strategy}"])
    assert code == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())

    assert set(results) == RESULT_KEYS and results["strategy"] == strategy and results["seed"] == 0
    assert results["executor"] == {"name": "sequential"}  # trainer.executor: auto, on the CPU
    assert results["execution"] == {"device": "cpu", "precision": "32", "compile": False}
    assert results["federation"]["task"] == task and results["federation"]["generated"] is generated
    assert [row["site"] for row in results["sites"]] == ["site0", "site1", "site2"]
    for row, site in zip(results["sites"], results["federation"]["sites"]):
        assert list(row) == ["site", *METRICS, "n_test"] and row["n_test"] == site["n_test"] > 0
        assert all(0.0 <= row[name] <= 1.0 for name in METRICS)
        assert abs(site["n_test_negative"] - site["target_ratio"] * site["n_test_positive"]) <= 0.5
    for name in METRICS:
        assert results["mean"][name] == pytest.approx(sum(row[name] for row in results["sites"]) / 3)
    assert len(results["history"]) == 2
    assert (results["communication"]["bytes_up"] == 0) == (strategy == "local")
