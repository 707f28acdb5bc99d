"""DP-SGD at the sites (medfed.federated.privacy): clipping, noise, accounting against Opacus, exactness, resume, config refusals."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from medfed.checkpoint import checkpoints, read_checkpoint
from medfed.cli import main
from medfed.components import privacy_table
from medfed.config import DPConfig
from medfed.federated.privacy import SiteDP, dp_compatible
from toy_federation import LinearClassifier, build_loop, two_group_federation

ROOT = Path(__file__).resolve().parents[1]
CLINICAL = ROOT / "configs" / "clinical_delta2.yaml"
QUIET = ["logger.wandb=disabled", "trainer.num_threads=1"]


def _fit(output: Path, *overrides: str, resume: bool = False) -> dict:
    """A clinical run (real records shipped with scikit-learn, 31-parameter logistic regression) through the CLI."""
    args = ["fit", "--config", str(CLINICAL), "--quiet", *(["--resume"] if resume else []), f"output_dir={output}", *QUIET, *overrides]
    assert main(args) == 0
    return json.loads((output / "results.json").read_text())


def _slots(output: Path) -> dict:
    """Every site's model slots (module and optimiser state) in the run's newest checkpoint."""
    state = read_checkpoint(checkpoints(output / "checkpoints")[-1])
    return [site["slots"] for site in state["sites"]]


def _assert_equal_states(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_states(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------------------- the mechanism on a tiny model
class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 7)
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def _per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The flat gradient of each sample's loss, one backward per sample (the reference Opacus's hooks must match)."""
    flat = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        flat.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return flat


def _dp(noise_multiplier: float = 0.0, max_grad_norm: float = 0.5, n_train: int = 64, batch_size: int = 8) -> SiteDP:
    return SiteDP(DPConfig(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm), "site0", n_train, batch_size, 10, seed=0, index=0)


@pytest.mark.parametrize("batch", [1, 6])
def test_clipping_bounds_every_per_sample_gradient_and_keeps_the_regulariser(batch):
    torch.manual_seed(0)
    model = TwoLayer()
    x, y = torch.randn(batch, 5) * 3, torch.randint(0, 3, (batch,))
    anchor = [p.detach() + 0.3 for p in model.parameters()]  # a proximal term around other parameters
    mu, clip = 0.7, 0.5
    reference = _per_sample_gradients(model, x, y)
    assert min(g.norm() for g in reference) > clip  # every sample is clipped
    dp = _dp(max_grad_norm=clip)
    dp.attach([model])
    model.zero_grad()
    proximal = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor)) * mu / 2
    (nn.functional.cross_entropy(model(x), y) + proximal).backward()
    dp.privatise(list(model.parameters()), torch.Generator().manual_seed(0))
    private = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    regulariser = torch.cat([(mu * (p - a)).detach().reshape(-1) for p, a in zip(model.parameters(), anchor)])
    clipped = [g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in reference]
    assert all(float(c.norm()) <= clip * (1 + 1e-5) for c in clipped)
    torch.testing.assert_close(private, torch.stack(clipped).mean(0) + regulariser, rtol=1e-5, atol=1e-6)
    if batch == 1:  # the data term is the one clipped gradient itself: its norm is at most C
        assert float((private - regulariser).norm()) <= clip * (1 + 1e-5)
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert dp.steps == 1 and dp.accountant.history == [(0.0, 8 / 64, 1)]


def test_noise_has_the_stated_spread_and_is_seeded():
    torch.manual_seed(0)
    model = TwoLayer()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    grads = []
    _dp().attach([model])  # the hooks stay on the model
    for seed in (0, 0, 1):
        dp = _dp(noise_multiplier=2.0, max_grad_norm=1e9)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        dp.privatise(list(model.parameters()), dp.noise_generator(torch.device("cpu"), 1, seed))
        grads.append((torch.cat([p.grad.reshape(-1) for p in model.parameters()]) - exact) * 4)  # B * noise / B
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    noise = torch.cat(grads)
    assert abs(float(noise.std()) / 2e9 - 1) < 0.2  # std sigma * C over (3 x 59) draws


def test_batchnorm_becomes_groupnorm_and_the_split_follows():
    from toy_federation import BatchNormClassifier

    model = BatchNormClassifier(4, 2)
    fixed, changes = dp_compatible(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fixed.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in fixed.modules()) and changes and "GroupNorm" in changes[0]
    assert fixed.parameter_split.size("all") == sum(p.numel() for p in fixed.parameters())
    assert dp_compatible(LinearClassifier(4, 2))[1] == []


# ---------------------------------------------------------------------------- accounting
def test_target_epsilon_noise_and_the_budget_stop():
    """sigma is Opacus's for the planned steps; a site trains no step past the target; its epsilon is Opacus's."""
    federation = two_group_federation(n_sites=2, n_train=40)
    loop = build_loop("fedavg", federation, LinearClassifier(4, 2), batch_size=8)
    config = DPConfig(target_epsilon=2.0, delta=1e-5, max_grad_norm=1.0)
    for site in loop.sites:
        site.use_dp(SiteDP(config, site.name, site.n_train, 8, planned_steps=2 * site.batches_per_epoch, seed=0, index=site.index))
    site = loop.sites[0]
    q = 8 / site.n_train
    assert site.privacy.noise_multiplier == get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=q, steps=2 * site.batches_per_epoch, accountant="rdp"
    )
    loop.fit(4)  # twice the planned rounds
    budget = site.privacy.step_budget
    assert budget >= 2 * site.batches_per_epoch and site.privacy.steps == budget < 4 * site.batches_per_epoch
    reference = RDPAccountant()
    reference.history = [(site.privacy.noise_multiplier, q, budget)]
    assert site.privacy.epsilon() == reference.get_epsilon(1e-5) <= 2.0
    reference.history = [(site.privacy.noise_multiplier, q, budget + 1)]
    assert reference.get_epsilon(1e-5) > 2.0  # one more step would have passed the target
    assert "site0" not in loop.history[-1]["train_loss"]  # it trained no more


def test_a_historys_epsilon_is_opacus_to_the_bit_and_sites_sharing_q_and_steps_search_sigma_once(monkeypatch):
    """history_epsilon (one step's RDP cached per (q, sigma), times the steps) gives what Opacus's accountants give for a
    history of several (sigma, q, steps) entries; five sites with one (q, steps) run Opacus's sigma search once."""
    import opacus.accountants.utils

    from medfed.federated.privacy import history_epsilon, noise_multiplier_for

    history = ((1.3, 0.4, 17), (2.0, 0.25, 5), (1.3, 0.4, 3))
    for name, accountant in (("rdp", RDPAccountant()), ("prv", PRVAccountant())):
        accountant.history = list(history)
        assert history_epsilon(name, history, 1e-5) == accountant.get_epsilon(1e-5)
    assert history_epsilon("rdp", history, 1e-5) > history_epsilon("rdp", history[:2], 1e-5) > history_epsilon("rdp", history[:1], 1e-5)

    searches = []

    def counted(**kwargs):
        searches.append(kwargs)
        return get_noise_multiplier(**kwargs)

    monkeypatch.setattr(opacus.accountants.utils, "get_noise_multiplier", counted)
    noise_multiplier_for.cache_clear()
    config = DPConfig(target_epsilon=5.0, delta=1e-5)
    sigmas = {SiteDP(config, f"site{k}", 160, 64, 30, seed=0, index=k).noise_multiplier for k in range(5)}
    assert len(searches) == 1 and sigmas == {get_noise_multiplier(target_epsilon=5.0, target_delta=1e-5, sample_rate=0.4, steps=30)}


def test_a_dp_run_reports_opacus_epsilon_per_site_and_round(tmp_path):
    rounds, batch, sigma = 2, 16, 1.3
    results = _fit(tmp_path / "dp", "strategy.name=fedavg", f"trainer.rounds={rounds}", f"privacy.dp.noise_multiplier={sigma}")
    local_epochs = results["config"]["trainer"]["local_epochs"]
    privacy = results["privacy"]["dp_sgd"]
    assert set(privacy) == {site["name"] for site in results["federation"]["sites"]}
    csv_rows = (next((tmp_path / "dp" / "csv").rglob("metrics.csv"))).read_text().splitlines()
    header = csv_rows[0].split(",")
    for site in results["federation"]["sites"]:
        n = site["n_train"]
        assert local_epochs == int(local_epochs)  # whole epochs: every epoch has the same ceil(n / B) steps
        steps_per_round = int(local_epochs) * math.ceil(n / batch)
        for round_index, record in enumerate(results["history"], start=1):
            accountant = RDPAccountant()
            for _ in range(round_index * steps_per_round):
                accountant.step(noise_multiplier=sigma, sample_rate=batch / n)
            assert record["privacy"][site["name"]]["steps"] == round_index * steps_per_round
            assert record["privacy"][site["name"]]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
        assert privacy[site["name"]]["epsilon"] == results["history"][-1]["privacy"][site["name"]]["epsilon"]
        column = header.index(f"privacy/{site['name']}/epsilon")
        logged = [float(row.split(",")[column]) for row in csv_rows[1:] if row.split(",")[column]]
        assert logged == pytest.approx([r["privacy"][site["name"]]["epsilon"] for r in results["history"]], rel=1e-9)


def test_prv_accountant_is_opacus_prv(tmp_path):
    results = _fit(tmp_path / "prv", "strategy.name=local", "trainer.rounds=1", "privacy.dp.noise_multiplier=1.0", "privacy.dp.accountant=prv")
    site = results["federation"]["sites"][0]
    record = results["privacy"]["dp_sgd"][site["name"]]
    accountant = PRVAccountant()
    accountant.history = [(1.0, 16 / site["n_train"], record["steps"])]
    assert record["accountant"] == "prv" and record["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


# ---------------------------------------------------------------------------- exactness
def test_no_noise_and_no_clipping_reproduce_the_non_private_run_bit_for_bit(tmp_path):
    """FedProx (a proximal term added to every step's loss): sigma = 0, C = inf gives the very same models."""
    common = ["strategy.name=fedprox", "trainer.rounds=2"]
    plain = _fit(tmp_path / "plain", *common)
    private = _fit(tmp_path / "private", *common, "privacy.dp.noise_multiplier=0", "privacy.dp.max_grad_norm=.inf")
    _assert_equal_states(_slots(tmp_path / "plain"), _slots(tmp_path / "private"))
    assert plain["mean"] == private["mean"]
    assert all(record["epsilon"] is None for record in private["privacy"]["dp_sgd"].values())  # infinite: null in JSON
    changed = _fit(tmp_path / "clipped", *common, "privacy.dp.noise_multiplier=0", "privacy.dp.max_grad_norm=0.01")
    with pytest.raises(AssertionError):  # the comparison can fail: clipping changes the models
        _assert_equal_states(_slots(tmp_path / "plain"), _slots(tmp_path / "clipped"))
    assert changed["mean"] != plain["mean"]


def test_a_resumed_dp_run_equals_an_uninterrupted_one(tmp_path):
    dp = ["strategy.name=ditto", "privacy.dp.noise_multiplier=0.8", "privacy.dp.max_grad_norm=0.5"]
    whole = _fit(tmp_path / "whole", *dp, "trainer.rounds=3")
    _fit(tmp_path / "parts", *dp, "trainer.rounds=2")
    resumed = _fit(tmp_path / "parts", *dp, "trainer.rounds=3", resume=True)
    _assert_equal_states(_slots(tmp_path / "whole"), _slots(tmp_path / "parts"))
    assert whole["privacy"] == resumed["privacy"] and whole["mean"] == resumed["mean"]


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["privacy.dp.delta=0"], "privacy.dp.delta"),
        (["privacy.dp.noise_multiplier=-1"], "privacy.dp.noise_multiplier"),
        (["privacy.dp.noise_multiplier=1", "privacy.dp.target_epsilon=3"], "privacy.dp.target_epsilon"),
        (["privacy.dp.target_epsilon=0"], "privacy.dp.target_epsilon"),
        (["privacy.dp.max_grad_norm=0"], "privacy.dp.max_grad_norm"),
        (["privacy.dp.accountant=gdp"], "privacy.dp.accountant"),
        (["privacy.dp.on_budget=pause"], "privacy.dp.on_budget"),
        (["privacy.dp.sigma=1"], "privacy.dp.sigma"),
        (["privacy.dp.noise_multiplier=1"], "privacy.dp"),  # the config's pFedNet compares data sketches: refused
        (["privacy.dp.noise_multiplier=1", "strategy.name=pfedme"], "privacy.dp"),
    ],
)
def test_a_bad_privacy_config_is_one_line_naming_the_key(tmp_path, capsys, overrides, named):
    assert main(["fit", "--config", str(CLINICAL), "--quiet", f"output_dir={tmp_path / 'run'}", *QUIET, *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"'{named}" in error, error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [  # (issue 32, item 5: each was a traceback or a failure of every site after the data were read and files written)
        (["privacy.dp.target_epsilon=0.1"],
         "config key 'privacy.dp.target_epsilon' = 0.1: expected an epsilon above 0.1029, the smallest the rdp accountant "
         "certifies at delta 1e-05 however much noise is added"),
        (["privacy.dp.noise_multiplier=1", "privacy.dp.max_grad_norm=.inf"],
         "config key 'privacy.dp.max_grad_norm' = inf: expected a finite clipping norm where noise is added"),
        (["privacy.dp.target_epsilon=3", "privacy.dp.max_grad_norm=.inf"],
         "config key 'privacy.dp.max_grad_norm' = inf: expected a finite clipping norm where noise is added"),
        (["privacy.dp.noise_multiplier=1e300"], "config key 'privacy.dp.noise_multiplier' = 1e+300: expected null or a number from 0 to 1e+06"),
        (["privacy.client_dp.noise_multiplier=1", "privacy.client_dp.clipping_norm=.inf"],
         "config key 'privacy.client_dp.clipping_norm' = inf: expected a finite clipping norm where noise is added"),
        (["privacy.client_dp.noise_multiplier=1e300"],
         "config key 'privacy.client_dp.noise_multiplier' = 1e+300: expected null (off) or a number from 0 to 1e+06"),
    ],
)
def test_privacy_limits_knowable_from_the_config_are_one_line_before_any_data_is_read(tmp_path, capsys, monkeypatch, overrides, expected):
    import medfed.tasks.clinical

    monkeypatch.setattr(medfed.tasks.clinical, "read_csv_rows", lambda *args: pytest.fail("the data were read"))
    command = ["fit", "--config", str(CLINICAL), "--quiet", f"output_dir={tmp_path / 'run'}", *QUIET, "strategy.name=fedavg", *overrides]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"medfed: error: {expected}") and error.count("\n") == 1, error
    assert not (tmp_path / "run").exists()


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-8])
def test_the_configs_rdp_floor_is_opacus_conversion_of_zero_rdp_and_just_above_it_opacus_finds_a_noise_multiplier(delta):
    import numpy as np
    from opacus.accountants.analysis.rdp import get_privacy_spent

    from medfed.config import RDP_ORDERS, rdp_epsilon_floor

    assert list(RDP_ORDERS) == list(RDPAccountant.DEFAULT_ALPHAS)
    floor = rdp_epsilon_floor(delta)
    assert floor == pytest.approx(get_privacy_spent(orders=RDP_ORDERS, rdp=np.zeros(len(RDP_ORDERS)), delta=delta)[0], rel=1e-12)
    with pytest.raises(ValueError, match="too low"):
        get_noise_multiplier(target_epsilon=floor, target_delta=delta, sample_rate=0.2, steps=20, accountant="rdp")
    assert get_noise_multiplier(target_epsilon=floor * 1.05, target_delta=delta, sample_rate=0.2, steps=20, accountant="rdp") > 0


def test_a_target_no_noise_reaches_at_a_site_is_a_config_error_naming_the_key_and_the_site(monkeypatch):
    import opacus.accountants.utils

    from medfed.errors import ConfigError

    def too_low(**kwargs):  # as Opacus's search ends above its largest sigma (a prv target of 1e-4 takes ~20 s to get there)
        raise ValueError("The privacy budget is too low.")

    monkeypatch.setattr(opacus.accountants.utils, "get_noise_multiplier", too_low)
    with pytest.raises(ConfigError, match=r"^config key 'privacy\.dp\.target_epsilon' = 0\.0001: no noise multiplier up to 1e\+06 "
                                          r"reaches it at site0 \(20 steps at sampling rate 0\.16, delta 1e-05, accountant prv; "):
        SiteDP(DPConfig(target_epsilon=1e-4, accountant="prv"), "site0", 100, 16, 20, 0, 0)


def test_pfednet_in_model_space_takes_dp(tmp_path):
    results = _fit(tmp_path / "pfednet", "strategy.pfednet.graph_space=model", "trainer.rounds=1", "privacy.dp.noise_multiplier=1")
    assert all(0 < record["epsilon"] < math.inf and record["steps"] > 0 for record in results["privacy"]["dp_sgd"].values())


# ---------------------------------------------------------------------------- the compatibility table
def test_privacy_doc_holds_the_generated_compatibility_table():
    doc = (ROOT / "docs" / "privacy.md").read_text()
    block = re.search(r"<!-- privacy-table:[^\n]*-->\n(.*?)\n<!-- /privacy-table -->", doc, re.S)
    assert block is not None, "docs/privacy.md lost its privacy-table block"
    assert block.group(1) == privacy_table(), "regenerate it with: python -m medfed strategies --markdown docs/privacy.md"


def test_the_table_follows_the_declarations():
    from medfed.federated.strategies import registered

    STRATEGIES = registered()

    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[2:5]] for line in privacy_table().splitlines()[2:]}
    assert rows["fedavg"] == ["yes", "yes", "yes"]
    for name in ("pfednet", "fedamp", "ifca", "fpfc", "apple", "pgfed"):  # the server step needs each site's own vector
        assert rows[name][2].startswith("no (") and STRATEGIES[name].secure_aggregation_refusal
    assert rows["pfedme"][0].startswith("no (") and rows["pfednet"][0].startswith("only with graph_space=model")


def test_stop_run_ends_the_run_after_the_round_a_budget_ran_out():
    from medfed.federated.privacy import PrivacyBudgetSpent, PrivacyRecord

    federation = two_group_federation(n_sites=2, n_train=40)
    loop = build_loop("fedavg", federation, LinearClassifier(4, 2), batch_size=8)
    loop.fabric._callbacks.append(PrivacyRecord("stop_run"))
    config = DPConfig(target_epsilon=2.0, max_grad_norm=1.0, on_budget="stop_run")
    for site in loop.sites:
        site.use_dp(SiteDP(config, site.name, site.n_train, 8, planned_steps=site.batches_per_epoch, seed=0, index=site.index))
    with pytest.raises(PrivacyBudgetSpent, match=r"^site site\d: privacy budget epsilon=2.0 .* the run stops \(privacy.dp.on_budget=stop_run\)$"):
        loop.fit(5)
    spent_round = len(loop.history)
    assert spent_round < 5 and all(r["privacy"]["site0"]["epsilon"] <= 2.0 for r in loop.history)
    assert any(r["spent"] for r in loop.history[-1]["privacy"].values())


def test_the_budget_left_after_a_resume_counts_the_restored_history():
    federation = two_group_federation(n_sites=2, n_train=40)
    loop = build_loop("fedavg", federation, LinearClassifier(4, 2), batch_size=8)
    config = DPConfig(target_epsilon=2.0, max_grad_norm=1.0)
    site = loop.sites[0]
    site.use_dp(SiteDP(config, site.name, site.n_train, 8, planned_steps=10, seed=0, index=0))
    other = SiteDP(config, site.name, site.n_train, 8, planned_steps=40, seed=0, index=0)  # planned for a longer run: less noise per step
    for _ in range(3):
        site.privacy.accountant.step(noise_multiplier=site.privacy.noise_multiplier, sample_rate=site.privacy.sample_rate)
    site.privacy.steps = 3
    other.load_state_dict(site.privacy.state_dict())
    accountant = RDPAccountant()
    accountant.history = [*site.privacy.accountant.history, (other.noise_multiplier, other.sample_rate, other.step_budget - 3)]
    assert accountant.get_epsilon(1e-5) <= 2.0
    accountant.history[-1] = (other.noise_multiplier, other.sample_rate, other.step_budget - 2)
    assert accountant.get_epsilon(1e-5) > 2.0


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("fedavg", None), ("fedprox", {"mu": 0.0}), ("ditto", {"lam": 0.0}), ("fedper", None), ("fedrep", None), ("fedbabu", None),
     ("l2gd", None), ("fedrod", None), ("superfed", {"mu": 0.0, "nu": 0.0, "start_round": 1})],
)
def test_opacus_per_sample_gradients_add_up_to_the_step_gradient(strategy, options, monkeypatch):
    """Without a regulariser, the mean of the per-sample gradients is the step's gradient: the clipping sees the real data term.

    Where it is not (FedRoD passes each batch twice; SuPerFed runs its layers with mixed parameter tensors),
    Opacus's hooks misattribute the per-sample gradients, and DP-SGD refuses the strategy (docs/privacy.md).
    """
    from medfed.federated.strategies import registered

    STRATEGIES = registered()
    from toy_federation import BodyHeadClassifier, with_a_body

    torch.manual_seed(0)
    model = with_a_body(strategy, BodyHeadClassifier)(4, 2)
    loop = build_loop(strategy, two_group_federation(n_sites=2, n_train=24), model, options, batch_size=8)
    for site in loop.sites:
        site.use_dp(SiteDP(DPConfig(noise_multiplier=0.0, max_grad_norm=math.inf), site.name, site.n_train, 8, 1, 0, site.index))
    gaps = []
    original = SiteDP.privatise

    def checked(self, parameters, generator):
        for p in parameters:
            if p.grad is not None and getattr(p, "grad_sample", None) is not None:
                gaps.append(float((p.grad_sample.mean(0) - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)))
        original(self, parameters, generator)

    monkeypatch.setattr(SiteDP, "privatise", checked)
    loop.fit(1)
    if STRATEGIES[strategy].dp_sgd_refusal is None:
        assert gaps and max(gaps) < 1e-5 and not loop.history[-1]["failures"]
    else:  # the hooks fail outright, or their per-sample gradients do not add up
        assert loop.history[-1]["failures"] or max(gaps) > 1e-3



def test_a_deployment_asked_for_dp_is_refused_before_any_site_is_contacted(tmp_path):
    from medfed.deploy import server_app
    from medfed.errors import ConfigError

    run_config = {
        "config": str(CLINICAL), "overrides": "strategy.name=fedavg federation.label_ratio=null privacy.dp.noise_multiplier=1",
        "run-name": "dp", "output-dir": str(tmp_path), "reply-timeout-s": 60.0, "resume": False,
    }
    with pytest.raises(ConfigError, match=r"^config key 'privacy.dp': DP-SGD runs in the simulator only"):
        server_app.run_settings(run_config)
    assert server_app.run_settings({**run_config, "overrides": "strategy.name=fedavg federation.label_ratio=null"}).resolved
