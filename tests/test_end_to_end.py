"""The main job through the CLI on tiny generated data: outputs, errors, resume."""

import json

import pytest

from medfed.checkpoint import checkpoints
from medfed.cli import INTERRUPTED, main
from medfed.federated.loop import FederatedLoop
from medfed.federated.site import Site
from medfed.results import format_table


def _results(path):
    return json.loads((path / "results.json").read_text())


@pytest.mark.parametrize("strategy", ["local", "fedavg", "pfednet"])
def test_cli_run_writes_results(tiny_run_config, tmp_path, strategy):
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", f"strategy.name={strategy}"]) == 0
    results = _results(tmp_path / "run")
    assert results["strategy"] == strategy and results["seed"] == 0
    assert results["federation"]["generated"] is True and "generated" in results["federation"]["description"].lower()
    assert [row["site"] for row in results["sites"]] == ["site0", "site1", "site2"]
    for row in results["sites"]:
        assert 0.0 <= row["label_iou"] <= 1.0 and 0.0 <= row["iou"] <= 1.0
        assert row["n_test"] > 0
        assert 0.0 <= row["dice_wt"] <= 1.0 and 0.0 <= row["iou_wt"] <= row["dice_wt"] and row["hd95_wt"] >= 0.0
    # whole-volume scores: evaluation.volume_every (10) exceeds the 3 rounds, so on the last round only
    assert "dice_wt" not in results["history"][0]["mean"] and "dice_wt" in results["history"][-1]["mean"]
    mean_iou = sum(row["iou"] for row in results["sites"]) / 3
    assert results["mean"]["iou"] == pytest.approx(mean_iou)
    assert len(results["history"]) == 3 and results["config"]["strategy"]["name"] == strategy
    sites = results["federation"]["sites"]
    assert sites[2]["missing_channel"] == "t1" and sites[0]["missing_channel"] is None
    for site in sites:  # split by case, seeded, recorded
        assert set(site["train_cases"]).isdisjoint(site["test_cases"])
    bytes_up = results["communication"]["bytes_up"]
    if strategy == "local":
        assert bytes_up == 0
    else:
        assert bytes_up > 0 and results["communication"]["compression_ratio_up"] == pytest.approx(1.0, rel=0.01)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["round-2.ckpt", "round-3.ckpt"]  # the newest 2
    assert list((tmp_path / "run" / "csv").rglob("metrics.csv"))
    assert (tmp_path / "run" / "similarity_graph.png").is_file() == (strategy == "pfednet")
    if strategy == "pfednet":  # the server step's effect and the graph, every round
        for record in results["history"]:
            assert 0.0 <= record["server"]["spread_removed"] <= 1.0
            assert record["server"]["graph_edges"] >= 1


def test_unknown_key_and_existing_output_are_refused(tiny_run_config, tmp_path, capsys):
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.epochs=3"]) == 2
    assert "trainer.epochs" in capsys.readouterr().err
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "strategy.pfednet.lamda=3"]) == 2
    assert "strategy.pfednet.lamda" in capsys.readouterr().err
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.rounds=1"]) == 0
    before = (tmp_path / "run" / "results.json").read_bytes()
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.rounds=1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "run" / "results.json").read_bytes() == before


def test_interrupted_or_stopped_run_resumes_to_the_same_metrics(tiny_run_config, tmp_path, monkeypatch, capsys):
    # With dropout: its masks come from generators seeded per site and round, not from the process's state.
    fit = ["fit", "--config", str(tiny_run_config), "--quiet", "model.dropout=0.2"]
    full = tmp_path / "full"
    assert main([*fit, f"output_dir={full}"]) == 0
    uninterrupted = _results(full)
    assert uninterrupted["num_threads"] == 1 and uninterrupted["failures"] == [] and uninterrupted["excluded"] == {}

    interrupted = tmp_path / "interrupted"
    original = FederatedLoop._run_round
    started = []

    def crash_in_round_3(self, round_index):
        if round_index == 3:
            raise KeyboardInterrupt("simulated interruption")
        return original(self, round_index)

    monkeypatch.setattr(FederatedLoop, "_run_round", crash_in_round_3)
    assert main([*fit, f"output_dir={interrupted}"]) == INTERRUPTED
    assert not (interrupted / "results.json").exists()

    stopped = tmp_path / "stopped"  # site1's training raises in round 2, and the run is told to stop
    train = Site.train

    def round_2_fails_at_site1(site, *args, **kwargs):
        if site.index == 1 and started[-1] == 2:
            raise RuntimeError("scanner archive unreachable")
        return train(site, *args, **kwargs)

    monkeypatch.setattr(FederatedLoop, "_run_round", lambda self, r: (started.append(r), original(self, r))[1])
    monkeypatch.setattr(Site, "train", round_2_fails_at_site1)
    capsys.readouterr()
    assert main([*fit, "federation.on_site_failure=stop", f"output_dir={stopped}"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("medfed: error: site site1 failed in round 2 (joint phase): RuntimeError: scanner archive unreachable; ")
    assert error.endswith("federation.on_site_failure=stop output_dir=" + str(stopped) + " --resume")
    assert [path.name for path in checkpoints(stopped / "checkpoints")] == ["round-1.ckpt"]  # the last good round
    monkeypatch.undo()

    assert main([*fit, "--resume", f"output_dir={interrupted}"]) == 0
    assert main([*fit, "federation.on_site_failure=stop", "--resume", f"output_dir={stopped}"]) == 0
    for resumed in (_results(interrupted), _results(stopped)):
        assert resumed["sites"] == uninterrupted["sites"]
        assert [r["metrics"] for r in resumed["history"]] == [r["metrics"] for r in uninterrupted["history"]]
        assert resumed["communication"] == uninterrupted["communication"]


def test_validation_holdout_run_reports_metrics_on_validation_and_never_uses_test_cases(tiny_run_config, tmp_path):
    overrides = ["--quiet", "federation.holdout=validation", "federation.validation_fraction=0.2", "trainer.rounds=1", "strategy.name=local"]
    assert main(["fit", "--config", str(tiny_run_config), *overrides]) == 0
    results = _results(tmp_path / "run")
    assert results["federation"]["holdout"] == "validation"
    assert "VALIDATION split" in format_table(results).splitlines()[0]
    for row, site in zip(results["sites"], results["federation"]["sites"]):
        assert row["n_validation"] == site["n_validation"] > 0 and "n_test" not in row
        train, validation, test = (set(site[f"{split}_cases"]) for split in ("train", "validation", "test"))
        assert train and validation and test
        assert train.isdisjoint(validation) and test.isdisjoint(train | validation)


def test_a_bf16_mixed_run_on_the_cpu_records_its_precision(tiny_run_config, tmp_path):
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.rounds=1", "trainer.precision=bf16-mixed"]) == 0
    results = _results(tmp_path / "run")
    assert results["execution"] == {"device": "cpu", "precision": "bf16-mixed", "compile": False}
    assert results["config"]["trainer"]["precision"] == "bf16-mixed"
    losses = [loss for site in results["history"][0]["train_loss"].values() for loss in site.values()]
    assert losses and all(0.0 < loss < 10.0 for loss in losses)  # trained, finite
    assert all(0.0 <= row["iou"] <= 1.0 for row in results["sites"])
