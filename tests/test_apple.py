"""APPLE: loss scheduler, download selection (appendix A.2), the eq. 5-7 step, DR grouping, budget and bytes."""

import math

import numpy as np
import pytest
import torch

from medfed.compression.codecs import make_codec
from medfed.federated.executor import train_plans
from medfed.federated.strategies.apple import choose_downloads, loss_scheduler
from medfed.federated.protocol import RoundContext
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, LinearOptions, build_loop, seeded, two_group_federation


def test_loss_schedulers_decrease_from_one_to_zero_at_L():
    L = 4
    assert [loss_scheduler("cosine", r, L, 1e-3) for r in range(6)] == pytest.approx(
        [1.0, (math.sqrt(0.5) + 1) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0, 0.0]
    )
    assert [loss_scheduler("exponential", r, L, 1e-3) for r in range(6)] == pytest.approx(
        [1.0, 1e-3**0.25, 1e-3**0.5, 1e-3**0.75, 0.0, 0.0]
    )


def test_never_downloaded_core_models_come_first_with_random_ties():
    downloads = torch.tensor([0, 1, 0, 3, 1, 2])  # site 0; only core 2 never fetched
    dr = torch.tensor([0.5, 0.1, 0.2, 0.9, 0.0, 0.4])
    picks = [choose_downloads(0, downloads, dr, 2, 5, torch.Generator().manual_seed(s)) for s in range(200)]
    assert all(len(p) == 2 and 2 in p and 0 not in p for p in picks)
    assert {j for p in picks for j in p} == {1, 2, 3, 4, 5}

    fresh = torch.zeros(6, dtype=torch.int64)
    picks = [choose_downloads(0, fresh, dr, 2, 5, torch.Generator().manual_seed(s)) for s in range(500)]
    counts = np.bincount([j for p in picks for j in p], minlength=6)
    assert counts[0] == 0 and all(len(set(p)) == 2 for p in picks)
    np.testing.assert_allclose(counts[1:] / 1000, 0.2, atol=0.05)  # uniform among the never-downloaded
    assert choose_downloads(0, fresh, dr, 5, 0, torch.Generator()) == [1, 2, 3, 4, 5]  # M >= N - 1: all


@pytest.mark.parametrize("completed_rounds, base", [(12, 3.0), (2, 1.5)])
def test_downloaded_core_models_are_drawn_with_probability_b_to_the_dr(completed_rounds, base):
    downloads = torch.tensor([5, 2, 1, 4])  # all seen; b(r) = max(1.5, r M / N) with M = 1, N = 4
    dr = torch.tensor([0.3, -2.0, 0.0, 1.0])  # |p_ij| is the exponent
    generator = torch.Generator().manual_seed(0)
    picks = [choose_downloads(0, downloads, dr, 1, completed_rounds, generator)[0] for _ in range(4000)]
    weights = np.array([base**2.0, base**0.0, base**1.0])
    np.testing.assert_allclose(np.bincount(picks, minlength=4)[1:] / 4000, weights / weights.sum(), atol=0.025)


def test_one_local_step_follows_eqs_5_to_7():
    lr, dr_lr, mu, L = 0.3, 0.2, 0.7, 4
    federation = two_group_federation(n_sites=3, n_train=20)
    loop = build_loop(
        "apple", federation, seeded(LinearClassifier, 4, 2, LinearOptions(lr=lr)), {"dr_lr": dr_lr, "mu": mu, "scheduler_rounds": L},
        batch_size=32,  # one batch: the whole split
    )
    loop.setup()
    site = loop.sites[0]
    half, core = site.strategy, site.slot("core")
    generator = torch.Generator().manual_seed(1)
    cores = torch.randn(3, 10, generator=generator)
    dr = torch.tensor([0.6, 0.3, -0.2])
    half.cores, half.dr = cores.clone(), dr.clone()
    core.module.set_vector("all", cores[0])
    half.receive(site.view, RoundContext(1, "select"), {"completed_rounds": torch.tensor([1.0])})
    (plan,) = half.plan(RoundContext(1, "fit"))
    assert plan.slot == "core" and half.plan(RoundContext(1, "select")) == ()

    x, y = federation.sites[0].train.tensors
    assert train_plans(site, RoundContext(1, "fit"), (plan,), 1.0, "train/fit")  # one step, the loop's: w^(c) and p_i

    personalised = (dr @ cores).requires_grad_(True)  # independent forward pass of w^(p)
    logits = x @ personalised[:8].reshape(2, 4).T + personalised[8:]
    (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y), personalised)
    prior = half.prior
    scheduler = (math.cos(math.pi / L) + 1) / 2
    torch.testing.assert_close(half.dr, dr - dr_lr * (cores @ g + scheduler * mu * (dr - prior)))  # eq. 6 on eq. 7
    torch.testing.assert_close(core.module.get_vector("all"), cores[0] - lr * dr[0] * g)  # eq. 5
    torch.testing.assert_close(prior, torch.tensor([20.0, 28.0, 36.0]) / 84.0)  # p_0 = n_j / n


def test_dr_weights_favour_same_group_sites_and_evaluation_uses_the_personalised_model():
    federation = two_group_federation(n_sites=6)
    loop = build_loop("apple", federation, seeded(LinearClassifier, 4, 2), {"dr_lr": 0.05, "mu": 0.01, "scheduler_rounds": 2})
    loop.fit(8)
    groups = np.array([site.info["group"] for site in federation.sites])
    for site in loop.sites:
        half = site.strategy
        p = half.dr.numpy()
        same = (groups == groups[site.index]) & (np.arange(6) != site.index)
        other = groups != groups[site.index]
        assert p[same].min() > p[other].max(), (site.index, p)
        assert site.evaluated_slot == "personalised"
        torch.testing.assert_close(site.module.get_vector("all"), half.dr @ half.cores)  # w^(p) is evaluated
        torch.testing.assert_close(half.cores[site.index], loop.server.cores[site.index])  # its uploaded core
        torch.testing.assert_close(site.slot("core").module.get_vector("all"), half.cores[site.index])
    assert loop.history[-1]["mean"]["accuracy"] > 0.85  # fedavg cannot fit both label rules (about 0.55)


def test_budget_limits_downloads_counters_update_and_bytes_show_it():
    federation = two_group_federation(n_sites=6)
    runs = {}
    for budget in (2, 4):
        runs[budget] = build_loop("apple", federation, seeded(LinearClassifier, 4, 2), {"download_budget": budget})
        runs[budget].fit(3)
    for site in runs[2].sites:
        downloads = site.strategy.downloads
        assert downloads[site.index] == 0 and int(downloads.sum()) == 2 * 3
        assert bool((np.delete(downloads.numpy(), site.index) >= 1).all())  # never-downloaded first: all 5 seen in 3 rounds
    core_bytes = len(make_codec("dense").encode(torch.zeros(10)))
    for record_2, record_4 in zip(runs[2].history, runs[4].history):
        for name in record_2["bytes"]:
            assert record_4["bytes"][name]["down"] - record_2["bytes"][name]["down"] == 2 * core_bytes
            assert record_4["bytes"][name]["up"] == record_2["bytes"][name]["up"]
