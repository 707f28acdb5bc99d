"""trainer.patience: a run stops on its validation plateau (medfed.evaluation.rounds.PlateauStop), trainer.rounds the cap."""

import json
import types

import pytest

from medfed.cli import main
from medfed.compare_stats import validation_curve
from medfed.errors import ConfigError
from medfed.evaluation.rounds import PlateauStop


def loop_with(curve):
    """A stand-in loop whose history has ``curve`` as its validation AUROC (two sites, mean = the value)."""
    history = [{"round": r, "validation": {"a": {"auroc": v - 0.1}, "b": {"auroc": v + 0.1}}} for r, v in enumerate(curve, start=1)]
    return types.SimpleNamespace(history=history, stop_reason=None)


@pytest.mark.parametrize(
    "curve, patience, min_delta, stops, best",
    [
        ([0.5, 0.6, 0.7, 0.7, 0.7], 2, 0.0, True, 3),  # two rounds after round 3 without a gain
        ([0.5, 0.6, 0.7, 0.7, 0.71], 2, 0.0, False, 5),  # round 5 gains 0.01
        ([0.5, 0.6, 0.7, 0.7, 0.71], 2, 0.02, True, 3),  # ... which min_delta 0.02 does not count
        ([0.5, 0.6, 0.7, 0.69], 2, 0.0, False, 3),  # one round after the best: not yet
        ([0.7, 0.6, 0.5, 0.4], 3, 0.0, True, 1),  # getting worse from round 1
    ],
)
def test_the_run_stops_patience_rounds_after_the_last_round_that_beat_the_best_by_more_than_min_delta(curve, patience, min_delta, stops, best):
    loop = loop_with(curve)
    stop = PlateauStop("auroc", patience, min_delta)
    record = loop.history[-1]
    stop.on_round_end(loop, record)
    assert stop.best_round(validation_curve(loop.history, "auroc")) == best
    assert (loop.stop_reason is not None) == stops
    if stops:
        assert record["stopped"]["best_round"] == best and f"round {best}'s" in loop.stop_reason


def test_patience_without_a_validation_split_is_refused_by_its_key(capsys):
    assert main(["fit", "--config", "clinical_delta2", "trainer.patience=3", "--print-config"]) == 2
    assert "config key 'trainer.patience' = 3: expected null without a validation split" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="trainer.patience"):
        from medfed.config import TrainerConfig

        TrainerConfig(patience=0)


def test_a_clinical_run_stops_on_its_plateau_before_the_cap_and_says_so(tmp_path, capsys):
    output = tmp_path / "run"
    arguments = [
        "fit", "--config", "clinical_delta2", "strategy.name=fedavg", "trainer.rounds=200", "trainer.patience=4",
        "federation.validation_fraction=0.2", "logger.wandb=disabled", f"output_dir={output}",
    ]
    assert main(arguments) == 0
    results = json.loads((output / "results.json").read_text())
    history = results["history"]
    curve = validation_curve(history, "accuracy")
    best = PlateauStop("accuracy", 4).best_round(curve)
    assert len(history) < 200 and len(history) == best + 4  # stopped exactly patience rounds after its best
    assert max(curve[best:]) <= curve[best - 1]
    assert results["stopped"] == {"round": len(history), **history[-1]["stopped"]} and results["stopped"]["best_round"] == best
    assert f"stopped after round {len(history)} of at most 200" in capsys.readouterr().err


def test_the_watched_metric_may_be_any_of_the_models_and_an_unknown_one_is_refused_before_any_round(tmp_path, capsys):
    arguments = [
        "fit", "--config", "clinical_delta2", "strategy.name=local", "trainer.rounds=60", "trainer.patience=3",
        "federation.validation_fraction=0.2", "logger.wandb=disabled",
    ]
    assert main([*arguments, "trainer.patience_metric=dice", f"output_dir={tmp_path / 'bad'}"]) == 2
    assert "config key 'trainer.patience_metric' = 'dice': expected one of the model's metrics (accuracy, balanced_accuracy, auroc)" in capsys.readouterr().err
    assert not any((tmp_path / "bad").rglob("*.*"))  # nothing written in the run folder
    assert main([*arguments, "trainer.patience_metric=auroc", f"output_dir={tmp_path / 'run'}"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    curve = validation_curve(results["history"], "auroc")
    assert "validation auroc plateaued" in results["stopped"]["reason"]
    assert len(curve) == PlateauStop("auroc", 3).best_round(curve) + 3


def test_a_tuning_run_on_the_validation_split_stops_on_its_own_scores(tmp_path):
    output = tmp_path / "run"
    arguments = [
        "fit", "--config", "clinical_delta2", "strategy.name=fedavg", "trainer.rounds=200", "trainer.patience=4",
        "federation.validation_fraction=0.2", "federation.holdout=validation", "logger.wandb=disabled", f"output_dir={output}",
    ]
    assert main(arguments) == 0
    results = json.loads((output / "results.json").read_text())
    curve = validation_curve(results["history"], "accuracy", "metrics")  # the evaluated split is the validation split
    assert "validation" not in results["history"][0] and len(curve) < 200
    assert len(curve) == PlateauStop("accuracy", 4).best_round(curve) + 4 and results["stopped"]["round"] == len(curve)


def test_a_raised_cap_extends_the_runs_that_reached_the_old_one_and_leaves_the_plateaued_ones_done(tmp_path):
    """compare with a larger ``trainer.rounds``: a run that stopped on its plateau would stop at the same round (the
    stop reads only its history), so it is done; a run that reached the old cap resumes."""
    from medfed.compare.grid import make_grid
    from medfed.compare.plan import plan_runs
    from medfed.fit import fit

    grid = make_grid(
        ["clinical_delta2"], ["fedavg", "local"], [0],
        ["federation.validation_fraction=0.2", "trainer.patience=4", "logger.wandb=disabled", "logger.figures=false"], [],
        tmp_path / "out",
    )
    stops, capped = plan_runs(grid, ["trainer.rounds=200"])[0], plan_runs(grid, ["trainer.rounds=3"])[1]
    for run in (stops, capped):
        assert run.action == "new" and fit(str(run.config_path), list(run.overrides), quiet=True) == 0
    stopped = json.loads((tmp_path / "out" / "clinical_delta2" / "fedavg" / "seed0" / "results.json").read_text())
    assert len(stopped["history"]) < 200 and "best_round" in stopped["stopped"]
    actions = {run.strategy: run.action for run in plan_runs(grid, ["trainer.rounds=400"])}
    assert actions == {"fedavg": "done", "local": "resume"}
