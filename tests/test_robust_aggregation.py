"""Robust aggregation in runs: one hostile site of five, the bound each rule keeps, and the refusals by name.

The stated bound (Yin et al. 2018): with at most one hostile site of five, the
coordinate-wise median and the trimmed mean (trim 0.2: one value dropped at each
end) put every coordinate of the global model between the smallest and the largest
honest reply of that coordinate, whatever the hostile site sends. The mean does not:
a site scaling its update by 100 moves it by about (100 - 1) / 5 of that update.
"""

import pytest
import torch

from medfed.cli import main
from medfed.config import AttackConfig
from medfed.federated.aggregate import Aggregation
from medfed.federated.attack import Attack
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation

HOSTILE = 4


def _run(rule: str, kind: str, rounds: int = 3):
    """FedAvg on five toy sites, site 4 hostile (``kind``), under ``rule``; per round the honest sites' replies and the
    global model the server step made (the norm check off: the rule alone is measured)."""
    loop = build_loop("fedavg", two_group_federation(n_sites=5, n_train=40), seeded(LinearClassifier, 4, 2), update_norm_limit=None)
    loop.server.aggregation = Aggregation(rule, trim=0.2)
    loop.sites.attack = Attack(AttackConfig(sites=[HOSTILE], kind=kind), loop.strategy.coded_keys, seed=0)
    steps = []
    aggregate = loop.server.aggregate

    def recorded(ctx, replies):
        honest = torch.stack([reply["all"] for index, reply in sorted(replies.items()) if index != HOSTILE])
        aggregate(ctx, replies)
        steps.append((honest, loop.server.global_model.clone()))

    loop.server.aggregate = recorded
    loop.fit(rounds)
    return steps


@pytest.mark.parametrize("kind", ["scale", "sign_flip"])
@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_a_robust_rule_keeps_the_global_model_within_the_honest_replies_every_round(rule, kind):
    for honest, model in _run(rule, kind):
        assert bool(((model >= honest.min(dim=0).values) & (model <= honest.max(dim=0).values)).all())


def test_the_mean_follows_a_site_scaling_its_update_by_100_outside_the_honest_replies_every_round():
    # round 1: about 19 times the honest spread outside it; later rounds start from the spoiled model, still outside
    for round_index, (honest, model) in enumerate(_run("mean", "scale"), start=1):
        low, high = honest.min(dim=0).values, honest.max(dim=0).values
        beyond = torch.maximum(low - model, model - high).clamp_min(0)  # how far outside the honest range, per coordinate
        spread = float((high - low).max())
        assert float(beyond.max()) > (10 if round_index == 1 else 1) * spread, round_index


@pytest.mark.parametrize("overrides, message", [
    (["strategy.name=fedamp", "aggregation.name=median"],
     "config key 'aggregation.name' = 'median': strategy 'fedamp' has no average to make robust: its server step combines"),
    (["strategy.name=fedavg", "aggregation.name=trimmed_mean", "privacy.client_dp.noise_multiplier=1"],
     "config key 'aggregation.name' = 'trimmed_mean': a robust rule needs each site's own reply, and client-level DP"),
    (["strategy.name=fedavg", "attack.sites=[5]"], "config key 'attack.sites' = [5]: site 5 is not one of the federation's 5 sites (0 to 4)"),
    (["aggregation.name=krum"], "config key 'aggregation.name' = 'krum': expected one of mean, median, trimmed_mean, norm_bounded"),
    (["aggregation.trim=0.5"], "config key 'aggregation.trim' = 0.5: expected a fraction in [0, 0.5)"),
    (["attack.kind=backdoor"], "config key 'attack.kind' = 'backdoor': expected one of scale, sign_flip, gaussian"),
])
def test_an_aggregation_or_attack_a_run_cannot_have_is_one_line_naming_the_key(tmp_path, capsys, overrides, message):
    command = ["fit", "--config", "clinical_delta1", "--quiet", f"output_dir={tmp_path / 'run'}", "logger.wandb=disabled", *overrides]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"medfed: error: {message}") and error.count("\n") == 1, error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    ("strategy.name=fedavg deploy.secure_aggregation=true aggregation.name=median",
     "config key 'aggregation.name' = 'median': a robust rule needs each site's own reply, which secure aggregation hides"),
    ("strategy.name=fedavg attack.sites=[1]", "config key 'attack.sites' = [1]: simulated hostile sites are for evaluation in the simulator"),
])
def test_a_deployment_refuses_a_robust_rule_under_secure_aggregation_and_any_simulated_attack(tmp_path, overrides, message):
    pytest.importorskip("flwr")
    import re

    from medfed.deploy.server_app import run_settings
    from medfed.errors import ConfigError

    run_config = {"config": "clinical_delta1", "overrides": f"federation.label_ratio=null federation.n_sites=3 {overrides}",
                  "output-dir": str(tmp_path / "out"), "run-name": "refused", "reply-timeout-s": 10.0, "resume": False}
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        run_settings(run_config)
    run_config["overrides"] = "federation.label_ratio=null federation.n_sites=3 strategy.name=fedavg aggregation.name=median"
    assert run_settings(run_config).resolved.run.aggregation.name == "median"  # in the clear, each reply is there to be robust about


def test_a_run_with_a_hostile_site_resumed_gives_the_uninterrupted_runs_numbers(tmp_path):
    # The hostile site's references (what it last received) are not in the checkpoint: a resumed run takes them from
    # the server's delivery of the checkpoint's round, as the uninterrupted run's site received it.
    import json

    common = ["fit", "--config", "clinical_delta1", "--quiet", "logger.wandb=disabled", "strategy.name=fedavg", "trainer.rounds=3",
              "trainer.local_epochs=1", "federation.update_norm_limit=null", "attack.sites=[4]", "aggregation.name=trimmed_mean"]
    assert main([*common, f"output_dir={tmp_path / 'whole'}"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'resumed'}", "trainer.rounds=1"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'resumed'}", "--resume"]) == 0
    whole, resumed = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("whole", "resumed"))
    assert [record["metrics"] for record in resumed["history"]] == [record["metrics"] for record in whole["history"]]
    assert whole["config"]["attack"] == {"sites": [4], "kind": "scale", "factor": 100.0} and whole["config"]["aggregation"]["name"] == "trimmed_mean"


def test_the_robust_doc_holds_the_generated_aggregation_table():
    import re
    from pathlib import Path

    from medfed.components import aggregation_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "robust.md").read_text()
    block = re.search(r"<!-- aggregation-table:[^\n]*-->\n(.*?)\n<!-- /aggregation-table -->", doc, re.S)
    assert block is not None and block.group(1) == aggregation_table(), "regenerate it with: python -m medfed strategies --markdown docs/robust.md"
