"""Ditto: the global model is FedAvg's, lambda = 0 is Local's model, GD on h_k by hand, and the lambda -> infinity limit."""

import json

import pytest
import torch

from medfed.errors import ConfigError
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


@pytest.mark.parametrize(
    ("options", "fedavg_epochs"),
    [({}, 0.5), ({"preset": "published"}, 1)],  # the global plan's budget: half of it, or all of it (the paper's)
)
def test_the_global_model_is_fedavgs_bit_for_bit_whatever_lambda(options, fedavg_epochs):
    # 64 + 8 s samples in batches of 4: an even number of batches B at every site, so that half an epoch is B / 2
    # steps every round for FedAvg too (at an odd B its half epochs alternate [B / 2] + 1 and [B / 2] steps)
    federation = two_group_federation(n_sites=4, n_train=64)
    ditto = build_loop("ditto", federation, seeded(BatchNormClassifier, 4, 2), {"lam": 0.5, **options}, participation=0.75, batch_size=4)
    fedavg = build_loop(
        "fedavg", federation, seeded(BatchNormClassifier, 4, 2), participation=0.75, local_epochs=fedavg_epochs, batch_size=4
    )
    for round_index in range(1, 4):
        ditto.fit(round_index)
        fedavg.fit(round_index)
        assert torch.equal(ditto.server.global_model, fedavg.server.global_model)
        assert torch.equal(ditto.server.global_buffers, fedavg.server.global_buffers)
        for a, b in zip(ditto.sites, fedavg.sites):
            for part in ("all", "buffers"):
                assert torch.equal(a.slot("global").module.get_vector(part), b.module.get_vector(part))
    assert json.dumps([r["bytes"] for r in ditto.history]) == json.dumps([r["bytes"] for r in fedavg.history])
    for site in ditto.sites:  # evaluated with the personal model, which is not the global one
        assert site.evaluated_slot == "personal"
        assert not torch.equal(site.module.get_vector("all"), site.slot("global").module.get_vector("all"))


@pytest.mark.parametrize(
    ("local_epochs", "options", "local_epochs_of_local"),
    [
        (2, {}, 1),  # the equal preset: the personal plan's half of the budget, one whole epoch
        (1, {"personal_epochs": 2.0}, 2),
        (1, {"preset": "published"}, 1),  # the paper's: the personal model trains the whole budget
        (3, {"preset": "published"}, 3),
    ],
)
def test_at_lambda_zero_the_personal_model_is_locals_bit_for_bit(local_epochs, options, local_epochs_of_local):
    federation = two_group_federation(n_sites=4)
    options = {"lam": 0.0, **options}
    ditto = build_loop("ditto", federation, seeded(BatchNormClassifier, 4, 2), options, participation=0.75, local_epochs=local_epochs)
    local = build_loop("local", federation, seeded(BatchNormClassifier, 4, 2), participation=0.75, local_epochs=local_epochs_of_local)
    for round_index in range(1, 4):
        ditto.fit(round_index)
        local.fit(round_index)
        for a, b in zip(ditto.sites, local.sites):
            for part in ("all", "buffers"):
                assert torch.equal(a.module.get_vector(part), b.module.get_vector(part)), (round_index, a.name, part)
    assert json.dumps([r["metrics"] for r in ditto.history]) == json.dumps([r["metrics"] for r in local.history])
    for ours, theirs in zip(ditto.history, local.history):
        assert {site: losses["fit/personal"] for site, losses in ours["train_loss"].items()} == {
            site: losses["fit"] for site, losses in theirs["train_loss"].items()
        }


def _gradient_descent(v, anchor, x, y, lam, lr, steps):
    """``steps`` GD steps on f(v) + lam/2 ||v - anchor||^2, f(v) = mean (<x, v> - y)^2 / 2 (float64)."""
    for _ in range(steps):
        v = v - lr * (x.T @ (x @ v - y) / len(y) + lam * (v - anchor))
    return v


def _regression_loop(lam, lr, **options):
    """Full batches (batch_size > n): every personal step is one GD step on the site's whole training split."""
    model = seeded(LinearRegressor, 3, LinearOptions(lr=lr))
    return build_loop("ditto", regression_federation(n_sites=3), model, {"lam": lam, **options}, batch_size=64)


def test_the_personal_model_takes_gradient_steps_on_h_k_anchored_at_the_global_model_received():
    lam, lr, steps = 0.7, 0.1, 2
    loop = _regression_loop(lam, lr, personal_steps=steps)
    loop.fit(1)
    received = loop.server.global_model.double()  # w^2's starting point: delivered at the end of round 1
    before = [site.module.get_vector("all").double() for site in loop.sites]
    assert not any(torch.allclose(v, received) for v in before)
    loop.fit(2)
    for site, v in zip(loop.sites, before):
        x, y = (t.double() for t in site.data.train.tensors)
        expected = _gradient_descent(v, received, x, y, lam, lr, steps)
        torch.testing.assert_close(site.module.get_vector("all").double(), expected, rtol=1e-5, atol=1e-6)
        # anchored at the global model the site received, not the one it trained this round:
        assert (site.slot("global").module.get_vector("all").double() - received).abs().max() > 1e-3


def test_as_lambda_grows_the_personal_model_becomes_the_global_model_received():
    # Enough steps of size lr = 0.5 / lambda reach the minimiser of f + lambda/2 ||v - w||^2,
    # v* = w - (H + lambda I)^-1 grad f(w), H = X^T X / n: at distance ~ ||grad f(w)|| / lambda from w.
    distances = []
    for lam in (1e2, 1e3, 1e4):
        loop = _regression_loop(lam, 0.5 / lam, personal_steps=60)
        loop.fit(1)
        received = loop.server.global_model.double()
        loop.fit(2)
        for site in loop.sites:
            x, y = (t.double() for t in site.data.train.tensors)
            hessian = x.T @ x / len(y)
            minimiser = received - torch.linalg.solve(hessian + lam * torch.eye(3, dtype=torch.float64), x.T @ (x @ received - y) / len(y))
            v = site.module.get_vector("all").double()
            torch.testing.assert_close(v - received, minimiser - received, rtol=0.02, atol=1e-7)
        distances.append(max(float((site.module.get_vector("all").double() - received).norm()) for site in loop.sites))
    assert distances[0] > 9 * distances[1] > 81 * distances[2]  # ~ 1 / lambda
    assert distances[2] < 1e-3 * float(received.norm())


def test_one_length_for_the_personal_plan_and_a_non_negative_lambda():
    model = seeded(LinearClassifier, 4, 2)
    with pytest.raises(ConfigError, match="strategy.ditto.personal_steps"):
        build_loop("ditto", two_group_federation(n_sites=2), model, {"personal_epochs": 1.0, "personal_steps": 3})
    with pytest.raises(ConfigError, match="strategy.ditto.lam"):
        build_loop("ditto", two_group_federation(n_sites=2), model, {"lam": -0.1})
