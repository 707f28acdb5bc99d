"""``compare --fuse``: a grid's runs fused (one process a strategy, rows = runs x sites) give each run its numbers alone,
and a fused grid interrupted and resumed gives the uninterrupted grid's."""

import json
import math
import shutil
from pathlib import Path

import pytest

from medfed.cli import main
from medfed.compare.fused import fused_groups, fusion_key
from medfed.compare.grid import make_grid, read_grid
from medfed.compare.plan import plan_runs
from test_compare import TINY_CLINICAL

GRID = """
configs:
  - {{name: lr_small, config: {config}, overrides: [model.lr=0.02]}}
  - {{name: lr_large, config: {config}, overrides: [model.lr=0.1]}}
strategies: [fedavg, fedprox]
seeds: [0, 1]
overrides: [trainer.rounds=3, logger.figures=false]
metrics: [auroc, balanced_accuracy]
output: {output}
"""
RUNS = [(setting, strategy, seed) for setting in ("lr_small", "lr_large") for strategy in ("fedavg", "fedprox") for seed in (0, 1)]


def _grid(folder: Path, output: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "tiny_clinical.yaml"
    config.write_text(TINY_CLINICAL.format(data=folder))
    grid = folder / "grid.yaml"
    grid.write_text(GRID.format(config=config, output=output))
    return grid


def _results(output: Path) -> dict:
    return {run: json.loads((output / run[0] / run[1] / f"seed{run[2]}" / "results.json").read_text()) for run in RUNS}


def _assert_same_numbers(a: dict, b: dict, exact_rounds: int = 0) -> None:
    """Every run's every round: metrics and validation scores to float tolerance, the same compute."""
    for run in RUNS:
        assert len(a[run]["history"]) == len(b[run]["history"]) == 3, run
        for first, second in zip(a[run]["history"], b[run]["history"]):
            for key in ("metrics", "validation"):
                for site, values in first[key].items():
                    for name, value in values.items():
                        assert math.isclose(value, second[key][site][name], rel_tol=1e-4, abs_tol=1e-5), (run, first["round"], key, site, name)
            assert first["compute"] == second["compute"], run


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    """The grid run fused and one process per run: ``(grid file, fused output, unfused output)``."""
    folder = tmp_path_factory.mktemp("fused")
    outputs = {}
    for fuse in ("on", "off"):
        grid = _grid(folder, folder / fuse)
        assert main(["compare", "--grid", str(grid), "--quiet", "--jobs", "1", "--fuse", fuse]) == 0
        outputs[fuse] = folder / fuse
    return grid, outputs["on"], outputs["off"]


def test_the_runs_of_a_strategy_fuse_into_one_process_and_the_others_run_alone(tmp_path):
    grid = read_grid(_grid(tmp_path, tmp_path / "out"))
    runs = plan_runs(grid)
    groups = fused_groups(runs, "on")
    assert [[(run.setting, run.strategy, run.seed) for run in group] for group in groups] == [
        [("lr_small", "fedavg", 0), ("lr_small", "fedavg", 1), ("lr_large", "fedavg", 0), ("lr_large", "fedavg", 1)],
        [("lr_small", "fedprox", 0), ("lr_small", "fedprox", 1), ("lr_large", "fedprox", 0), ("lr_large", "fedprox", 1)],
    ]
    assert all(len(group) == 1 for group in fused_groups(runs, "off"))
    assert fusion_key(runs[0], "auto") is not None  # the clinical model fuses on a CPU by default
    assert [len(group) for group in fused_groups(runs, "on", limit=3)] == [3, 3, 1, 1]


@pytest.mark.slow
def test_a_fused_grid_gives_every_run_the_numbers_it_gets_alone(grids):
    _, fused, alone = grids
    fused_results, alone_results = _results(fused), _results(alone)
    for run in RUNS:
        assert fused_results[run]["executor"]["fused"] == {"runs": 4}
        assert alone_results[run]["executor"] == {"name": "sequential"}
        assert fused_results[run]["config"]["model"]["lr"] == (0.02 if run[0] == "lr_small" else 0.1)
        assert not (fused / run[0] / run[1] / f"seed{run[2]}" / "learning_curves.png").exists()  # logger.figures=false
    _assert_same_numbers(fused_results, alone_results)
    assert (fused / "logs" / "lr_small" / "fedavg" / "seed1.log").read_text().count("label_ratio") == 1  # each run its own log


@pytest.mark.slow
def test_a_fused_grid_interrupted_after_round_two_resumes_to_the_uninterrupted_grid(grids, tmp_path):
    grid, fused, _ = grids
    copy = shutil.copytree(fused, tmp_path / "interrupted")
    interrupted = RUNS[1:6]
    for setting, strategy, seed in interrupted:  # as a kill after round 2's checkpoint leaves them
        folder = copy / setting / strategy / f"seed{seed}"
        (folder / "results.json").unlink()
        (folder / "checkpoints" / "round-3.ckpt").unlink()
    assert main(["compare", "--grid", str(grid), "--output", str(copy), "--quiet", "--jobs", "1", "--fuse", "on"]) == 0
    resumed = _results(copy)
    for run in interrupted:
        assert resumed[run]["executor"]["fused"] == {"runs": 3 if run[1] == "fedavg" else 2}  # the resumed runs of each strategy
    _assert_same_numbers(resumed, _results(fused))


def test_the_seeds_of_new_data_draws_fuse_and_a_different_model_shape_does_not(tmp_path):
    """``new_data_per_seed`` gives each seed its own data set (``data.root``, ``data.generate.seed``): each run reads
    its own, so the seeds still share one process; a key outside the rows (the U-Net's widths) splits the group."""
    grid = make_grid(["brats_lack0"], ["fedavg"], [0, 1, 2], ["logger.wandb=disabled"], [], tmp_path / "out", new_data_per_seed=True)
    runs = plan_runs(grid)
    assert len({run.overrides for run in runs}) == 3  # three data draws
    assert [[run.seed for run in group] for group in fused_groups(runs, "on")] == [[0, 1, 2]]
    assert fused_groups(runs, "auto") == [[run] for run in runs]  # the U-Net's stacked step does not pay on a CPU
    wider = plan_runs(grid, ["model.channels=[8,16,32,64,128]"])
    assert len(fused_groups([*runs, *wider], "on")) == 2
