"""FedProx: mu = 0 is FedAvg bit for bit; the proximal term's gradient; a round of local GD on h_k by hand."""

import json

import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.protocol import RoundContext
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import (
    BatchNormClassifier,
    LinearClassifier,
    LinearOptions,
    LinearRegressor,
    build_loop,
    regression_federation,
    seeded,
    two_group_federation,
)

HISTORY_KEYS = ("participants", "metrics", "train_loss", "bytes", "server", "failures")


def test_mu_zero_is_fedavg_bit_for_bit():
    federation = two_group_federation(n_sites=4)
    runs = {
        name: build_loop(name, federation, seeded(BatchNormClassifier, 4, 2), options, participation=0.75)
        for name, options in (("fedavg", None), ("fedprox", {"mu": 0.0}))
    }
    for loop in runs.values():
        loop.fit(4)
    fedavg, fedprox = runs["fedavg"], runs["fedprox"]
    for key in HISTORY_KEYS:
        assert json.dumps([r[key] for r in fedprox.history]) == json.dumps([r[key] for r in fedavg.history]), key
    for a, b in zip(fedprox.sites, fedavg.sites):
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
        assert torch.equal(a.module.get_vector("buffers"), b.module.get_vector("buffers"))
    assert torch.equal(fedprox.server.global_model, fedavg.server.global_model)
    other = build_loop("fedprox", federation, seeded(BatchNormClassifier, 4, 2), {"mu": 0.5}, participation=0.75)
    other.fit(4)
    assert not torch.equal(other.server.global_model, fedavg.server.global_model)  # mu > 0 does change it


def test_proximal_term_and_its_gradient():
    mu = 0.3
    loop = build_loop("fedprox", two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2), {"mu": mu})
    loop.setup()
    site = loop.sites[0]
    half = site.strategy
    anchor = site.module.get_vector("all")
    half.receive(site.view, RoundContext(1, "fit"), {})
    assert torch.equal(half.centre, anchor)  # w^t: the model the round starts from
    w = anchor + torch.linspace(-1.0, 1.0, 10)
    site.module.set_vector("all", w)
    site.module.zero_grad()
    term = half.regularizer(site.view, RoundContext(1, "fit"), half.plan(RoundContext(1, "fit"))[0])
    term.backward()
    gradient = torch.cat([site.module.linear.weight.grad.reshape(-1), site.module.linear.bias.grad])
    torch.testing.assert_close(term, mu / 2 * ((w - anchor) ** 2).sum())
    torch.testing.assert_close(gradient, mu * (w - anchor))


def test_a_round_is_local_gradient_descent_on_the_proximal_objective_then_the_weighted_average():
    # Full batches (batch_size > n): every epoch is one GD step on h_k(w) = f_k(w) + mu/2 ||w - w^t||^2,
    # f_k(w) = mean (<x, w> - y)^2 / 2, gradient X^T (X w - y) / n + mu (w - w^t).
    mu, lr, epochs = 2.0, 0.1, 3
    federation = regression_federation(n_sites=3)

    def loop_with(mu):
        model = seeded(LinearRegressor, 3, LinearOptions(lr=lr))
        return build_loop("fedprox", federation, model, {"mu": mu}, local_epochs=epochs, batch_size=64)

    loop = loop_with(mu)
    loop.fit(1)
    start = loop.server.global_model.double()  # w^1, every site's model after round 1
    loop.fit(2)
    trained, sizes = [], []
    for site_data in federation.sites:
        x, y = (t.double() for t in site_data.train.tensors)
        w = start.clone()
        for _ in range(epochs):
            w = w - lr * (x.T @ (x @ w - y) / len(y) + mu * (w - start))
        trained.append(w)
        sizes.append(len(y))
    expected = sum(n * w for n, w in zip(sizes, trained)) / sum(sizes)
    torch.testing.assert_close(loop.server.global_model.double(), expected, rtol=1e-5, atol=1e-6)
    for site in loop.sites:
        torch.testing.assert_close(site.module.get_vector("all").double(), expected, rtol=1e-5, atol=1e-6)
    without = loop_with(0.0)
    without.fit(2)
    assert (without.server.global_model.double() - expected).abs().max() > 1e-3  # the term mattered


def test_a_negative_mu_is_refused_by_name():
    with pytest.raises(ConfigError, match="strategy.fedprox.mu"):
        build_loop("fedprox", two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2), {"mu": -1.0})
