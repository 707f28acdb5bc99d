"""Client-level DP at aggregation (medfed.federated.privacy.ClientDP): clipping, the uniform noised average, accounting, exactness, resume, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch.utils.data import TensorDataset

from medfed.checkpoint import checkpoints, read_checkpoint
from medfed.cli import main
from medfed.config import ClientDPConfig
from medfed.data.federation import Federation, SiteData
from medfed.federated.privacy import ClientDP, clip_update
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies import registered
from toy_federation import BodyHeadClassifier, LinearClassifier, build_loop, seeded, two_group_federation, with_a_body

ROOT = Path(__file__).resolve().parents[1]
CLINICAL = ROOT / "configs" / "clinical_delta2.yaml"
QUIET = ["logger.wandb=disabled", "trainer.num_threads=1"]
FIT = RoundContext(1, "fit")
#: every registered strategy that declares client-level DP (its server step needs only the weighted sum of the replies)
DECLARING_CLIENT_DP = sorted(name for name, cls in registered().items() if cls.client_dp_refusal is None)


def _client_dp(noise_multiplier: float, clipping_norm: float, seed: int = 0) -> ClientDP:
    return ClientDP(ClientDPConfig(noise_multiplier=noise_multiplier, clipping_norm=clipping_norm), seed)


def _reply(vector: torch.Tensor, n: float = 10.0) -> dict[str, torch.Tensor]:
    return {"all": vector, "num_samples": torch.tensor([n])}


def _equal_sized(federation: Federation) -> Federation:
    """``federation`` with every site's training set cut to the smallest one's size (FedAvg's weights then uniform)."""
    n = min(len(site.train) for site in federation.sites)
    sites = [SiteData(site.name, TensorDataset(*(t[:n] for t in site.train.tensors)), site.test, site.info) for site in federation.sites]
    return Federation(federation.task, sites, federation.input_shape, federation.num_classes, federation.description, federation.generated)


# ---------------------------------------------------------------------------- the mechanism
def test_clipping_bounds_every_update_and_keeps_its_direction():
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-3, 0.5, 3.0, 1e3):
        update = {"all": scale * torch.randn(50, generator=generator), "buffers": scale * torch.randn(7, generator=generator)}
        norm = math.sqrt(sum(float(v.square().sum()) for v in update.values()))
        clipped, measured = clip_update(update, 1.0)
        clipped_norm = math.sqrt(sum(float(v.square().sum()) for v in clipped.values()))
        assert measured == pytest.approx(norm, rel=1e-6)
        assert clipped_norm <= 1.0 + 1e-6 and clipped_norm == pytest.approx(min(norm, 1.0), rel=1e-5)
        for key in update:  # the same direction, jointly over the keys
            assert torch.allclose(clipped[key], update[key] * min(1.0, 1.0 / norm), rtol=1e-5, atol=1e-9)
        assert (clipped is update) == (norm <= 1.0)  # within the bound: untouched


def test_the_release_is_the_uniform_mean_over_the_sampled_sites_of_the_clipped_updates():
    """Three sites sampled, two reply (one update clipped, one not), one does not: a zero update; the server gets one reply."""
    sent = torch.tensor([1.0, 2.0, 3.0, 4.0])
    updates = {0: torch.tensor([3.0, 0.0, 4.0, 0.0]), 2: torch.tensor([0.0, 0.6, 0.0, 0.8])}  # norms 5 and 1
    replies = {index: _reply(sent + update, n=10.0 * (index + 1)) for index, update in updates.items()}
    dp = _client_dp(noise_multiplier=0.0, clipping_norm=2.0)
    out = dp.release(FIT, 0, replies, {index: {"all": sent} for index in (0, 1, 2)}, sampled=[0, 1, 2], sample_rate=0.5)
    expected = sent + (updates[0] * 2.0 / 5.0 + updates[2] + torch.zeros(4)) / 3  # uniform over m = 3, sample counts unused
    assert list(out) == [0] and torch.allclose(out[0]["all"], expected, atol=1e-6)
    assert out[0]["num_samples"].item() == 1.0
    record = dp.round_record()
    assert record["clipped"] == 1 and record["sampled"] == 3 and record["replied"] == 2
    assert record["median_update_norm"] == pytest.approx(3.0) and record["releases"] == 1 and record["epsilon"] == math.inf


def test_the_noise_has_std_sigma_c_over_m_and_is_seeded():
    d, m, sigma, clip = 20_000, 4, 1.5, 0.7
    sent = torch.zeros(d)
    replies = {index: _reply(sent.clone()) for index in range(m)}  # zero updates: the release is the noise
    dp = _client_dp(sigma, clip, seed=3)
    draws = torch.stack([
        dp.release(RoundContext(round_index, "fit"), 0, replies, {i: {"all": sent} for i in range(m)}, list(range(m)), 1.0)[0]["all"]
        for round_index in range(1, 21)
    ])  # (20, d): 400,000 draws over 20 rounds
    std = sigma * clip / m
    assert float(draws.std()) == pytest.approx(std, rel=0.01)  # the std's standard error is std / sqrt(2 * 400000) = 0.1%
    assert abs(float(draws.mean())) < 5 * std / math.sqrt(draws.numel())
    assert float(torch.corrcoef(draws[:2])[0, 1]) < 0.05  # rounds draw independently
    again = _client_dp(sigma, clip, seed=3).release(RoundContext(1, "fit"), 0, replies, {i: {"all": sent} for i in range(m)}, list(range(m)), 1.0)
    assert torch.equal(again[0]["all"], draws[0])  # (seed, round, phase) fixes the draw
    generator = torch.Generator().manual_seed(dp.noise_seed(1, 0))
    assert torch.equal(torch.normal(0.0, std, (d,), generator=generator), draws[0])  # the recorded seed reproduces the noise
    other = _client_dp(sigma, clip, seed=4).release(RoundContext(1, "fit"), 0, replies, {i: {"all": sent} for i in range(m)}, list(range(m)), 1.0)
    assert not torch.equal(other[0]["all"], draws[0])


def test_an_update_the_server_did_not_send_a_vector_for_is_an_error():
    from medfed.errors import RunFailed

    with pytest.raises(RunFailed, match="privacy.client_dp: the server sent site 0 no 'all' vector"):
        _client_dp(1.0, 1.0).release(FIT, 0, {0: _reply(torch.ones(3))}, {0: {}}, [0], 1.0)


# ---------------------------------------------------------------------------- in the loop
def test_epsilon_is_opacus_rdp_over_the_rounds_at_the_participation_rate():
    sigma, rounds = 1.1, 3
    loop = build_loop("fedavg", two_group_federation(n_sites=6), seeded(LinearClassifier, 4, 2), participation=0.5,
                      client_dp=_client_dp(sigma, 0.5))
    loop.fit(rounds)
    for round_index, record in enumerate(loop.history, start=1):
        accountant = RDPAccountant()
        accountant.history = [(sigma, 3 / 6, round_index)]
        assert record["client_dp"]["releases"] == round_index and record["client_dp"]["sample_rate"] == 0.5
        assert record["client_dp"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
        assert record["client_dp"]["sampled"] == 3 and record["client_dp"]["noise_std"] == pytest.approx(sigma * 0.5 / 3)


def test_no_noise_and_no_clipping_reproduce_fedavg_bit_for_bit():
    """Equal-sized sites (FedAvg's sample weights then uniform): sigma = 0, C = inf gives the very same models; a small C does not."""
    federation = _equal_sized(two_group_federation(n_sites=4))
    plain = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2))
    private = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2), client_dp=_client_dp(0.0, math.inf))
    clipped = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2), client_dp=_client_dp(0.0, 1e-3))
    for loop in (plain, private, clipped):
        loop.fit(3)
    assert torch.equal(plain.server.global_model, private.server.global_model)
    for a, b in zip(plain.sites, private.sites):
        assert torch.equal(a.view.get("model", "all"), b.view.get("model", "all"))
    assert plain.history[-1]["mean"] == private.history[-1]["mean"]
    assert not torch.equal(plain.server.global_model, clipped.server.global_model)  # the comparison can fail
    assert clipped.history[-1]["client_dp"]["clipped"] == 4


@pytest.mark.parametrize("strategy", DECLARING_CLIENT_DP)
def test_every_strategy_that_declares_client_dp_gives_the_server_only_the_noised_average(strategy, monkeypatch):
    model = seeded(with_a_body(strategy, BodyHeadClassifier), 4, 2)
    loop = build_loop(strategy, two_group_federation(n_sites=4), model, update_norm_limit=None, client_dp=_client_dp(0.5, 1.0))
    seen = []
    aggregate = loop.server.aggregate
    monkeypatch.setattr(loop.server, "aggregate", lambda ctx, replies: (seen.append(replies), aggregate(ctx, replies))[1])
    loop.fit(2)
    assert not loop.history[-1]["failures"]
    vector_phases = [replies for replies in seen if set(next(iter(replies.values()))) - {"num_samples"}]
    assert vector_phases and all(len(replies) == 1 for replies in vector_phases)  # one release, no site's own vector
    assert loop.history[-1]["client_dp"]["releases"] == len(vector_phases) and 0 < loop.history[-1]["client_dp"]["epsilon"] < math.inf


def test_the_strategies_whose_server_step_is_a_weighted_sum_declare_client_dp():
    """The parametrisation above (every registered strategy declaring client-level DP) holds at least these."""
    assert {"fedavg", "fedprox", "fedper", "fedrep", "fedbabu", "ditto", "apfl", "fedbn", "fedrod", "pfedme", "superfed"} <= set(DECLARING_CLIENT_DP)


# ---------------------------------------------------------------------------- through the CLI
def _fit(output: Path, *overrides: str, resume: bool = False) -> dict:
    args = ["fit", "--config", str(CLINICAL), "--quiet", *(["--resume"] if resume else []), f"output_dir={output}", *QUIET, *overrides]
    assert main(args) == 0
    return json.loads((output / "results.json").read_text())


def test_a_resumed_run_equals_an_uninterrupted_one_and_reports_epsilon(tmp_path):
    dp = ["strategy.name=fedavg", "federation.participation=0.6", "privacy.client_dp.noise_multiplier=0.8", "privacy.client_dp.clipping_norm=0.3"]
    whole = _fit(tmp_path / "whole", *dp, "trainer.rounds=3")
    _fit(tmp_path / "parts", *dp, "trainer.rounds=2")
    resumed = _fit(tmp_path / "parts", *dp, "trainer.rounds=3", resume=True)
    server = [read_checkpoint(checkpoints(tmp_path / run / "checkpoints")[-1])["server"] for run in ("whole", "parts")]
    assert torch.equal(server[0]["global_model"], server[1]["global_model"])
    assert whole["privacy"] == resumed["privacy"] and whole["mean"] == resumed["mean"]
    accountant = RDPAccountant()
    accountant.history = [(0.8, 3 / 5, 3)]
    assert resumed["privacy"]["client_dp"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    header = next((tmp_path / "whole" / "csv").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert "privacy/client_dp/epsilon" in header


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["privacy.client_dp.noise_multiplier=-1"], "privacy.client_dp.noise_multiplier"),
        (["privacy.client_dp.noise_multiplier=1", "privacy.client_dp.clipping_norm=0"], "privacy.client_dp.clipping_norm"),
        (["privacy.client_dp.noise_multiplier=1", "privacy.client_dp.delta=1"], "privacy.client_dp.delta"),
        (["privacy.client_dp.sigma=1"], "privacy.client_dp.sigma"),
        (["privacy.client_dp.noise_multiplier=1"], "privacy.client_dp"),  # the config's pFedNet fuses sites pair by pair
        (["privacy.client_dp.noise_multiplier=1", "strategy.name=l2gd"], "privacy.client_dp"),
        (["privacy.client_dp.noise_multiplier=1", "strategy.name=local"], "privacy.client_dp"),
    ],
)
def test_a_bad_or_refused_client_dp_config_is_one_line_naming_the_key(tmp_path, capsys, overrides, named):
    assert main(["fit", "--config", str(CLINICAL), "--quiet", f"output_dir={tmp_path / 'run'}", *QUIET, *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"'{named}" in error, error
    assert not (tmp_path / "run").exists()


def test_a_deployment_asked_for_client_dp_is_refused_before_any_site_is_contacted(tmp_path):
    from medfed.deploy import server_app
    from medfed.errors import ConfigError

    run_config = {
        "config": str(CLINICAL), "overrides": "strategy.name=fedavg federation.label_ratio=null privacy.client_dp.noise_multiplier=1",
        "run-name": "client-dp", "output-dir": str(tmp_path), "reply-timeout-s": 60.0, "resume": False,
    }
    with pytest.raises(ConfigError, match=r"^config key 'privacy.client_dp': client-level DP runs in the simulator only"):
        server_app.run_settings(run_config)
