"""The shipped protocol and ablation grids resolve to what their comments promise; SGD with momentum steps as torch's
definition says; a grid's labelled settings (a config with overrides of its own) plan as columns of their own."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from medfed.compare.grid import read_grid
from medfed.compare.plan import plan_runs
from medfed.components import resolve
from medfed.config import ConfigError, load_config
from medfed.models.tabular import LogisticRegression

REPOSITORY = Path(__file__).resolve().parents[1]


def _resolved(run):
    return resolve(load_config(run.config_path, list(run.overrides))).config


def test_the_protocol_grid_trains_every_method_50_rounds_of_10_epochs_with_sgd_and_pfednets_absolute_lambda():
    grid = read_grid("protocol_brats")
    runs = plan_runs(replace(grid, seeds=[0]), ["trainer.device=cpu"])  # every strategy and setting resolves
    assert len(runs) == len(grid.strategies) * 4 and {run.setting for run in runs} == {f"brats_lack{i}" for i in range(4)}
    config = _resolved(next(run for run in runs if run.strategy == "pfednet"))
    assert config["trainer"]["rounds"] == 50 and config["trainer"]["local_epochs"] == 10
    assert (config["model"]["optimizer"], config["model"]["lr"], config["model"]["momentum"]) == ("sgd", 0.001, 0.9)
    assert config["data"]["patch_size"] == 64
    pfednet = config["strategy"]["pfednet"]
    assert (pfednet["lam"], pfednet["lam_scale"], pfednet["admm_max_iter"], pfednet["preset"]) == (72, "absolute", 200, "equal")


def test_sgd_with_momentum_steps_as_its_definition_and_momentum_needs_sgd():
    from medfed.options.models import LogisticRegressionOptions

    torch.manual_seed(0)
    model = LogisticRegression(3, 2, LogisticRegressionOptions(lr=0.1, optimizer="sgd", momentum=0.9))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    theta = [p.detach().clone() for p in model.parameters()]
    velocity = [torch.zeros_like(p) for p in theta]
    for _ in range(2):  # v <- 0.9 v + g; theta <- theta - lr v (torch's SGD, dampening 0)
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y.float())
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
        velocity = [0.9 * v + g for v, g in zip(velocity, grads)]
        theta = [t - 0.1 * v for t, v in zip(theta, velocity)]
    for parameter, expected in zip(model.parameters(), theta):
        assert torch.allclose(parameter, expected, atol=1e-6)
    assert isinstance(LogisticRegression(3, 2).configure_optimizers(), torch.optim.Adam)  # the default is unchanged
    with pytest.raises(ConfigError, match="'momentum'"):
        LogisticRegressionOptions(momentum=0.9)  # Adam takes no momentum
    with pytest.raises(ConfigError, match="'optimizer'"):
        LogisticRegressionOptions(optimizer="adagrad")


def test_the_pfednet_ablation_grid_puts_each_variant_of_brats_lack0_in_a_column_of_its_own():
    grid = read_grid(REPOSITORY / "configs" / "ablation" / "pfednet_brats.yaml")
    assert grid.configs == ["alternating", "joint", "lam0", "joint-lam0", "lam1", "model-graph", "feature-graph", "60-rounds"]
    runs = plan_runs(replace(grid, seeds=[0]))
    assert len(runs) == 8 * 2
    expected = {
        "alternating": ("alternating", 0.1, "data", 30), "joint": ("joint", 0.1, "data", 30), "lam0": ("alternating", 0.0, "data", 30),
        "joint-lam0": ("joint", 0.0, "data", 30), "lam1": ("alternating", 1.0, "data", 30),
        "model-graph": ("alternating", 0.1, "model", 30), "feature-graph": ("alternating", 0.1, "feature", 30),
        "60-rounds": ("alternating", 0.1, "data", 60),
    }
    for run in runs:
        config = _resolved(run)
        pfednet = config["strategy"]["pfednet"]
        assert (pfednet["schedule"], pfednet["lam"], pfednet["graph_space"], config["trainer"]["rounds"]) == expected[run.setting]
        assert config["trainer"]["local_epochs"] == 1 and run.output_dir.parts[-3:-1] == (run.setting, run.strategy)


def test_a_labelled_setting_without_a_config_is_refused_naming_the_grid_key(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("configs:\n  - {name: joint, overrides: [strategy.pfednet.schedule=joint]}\n")
    with pytest.raises(ConfigError, match=r"grid\.yaml: grid key 'configs': .*expected a config, or a mapping with name, config and overrides"):
        read_grid(grid)
    grid.write_text("configs:\n  - {name: a, config: brats_lack0, overrides: [output_dir=x]}\n")
    with pytest.raises(ConfigError, match="compare sets output_dir itself"):
        read_grid(grid)
