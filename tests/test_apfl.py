"""APFL: one local step of w, v and alpha by hand (projection included), the limits alpha = 0 and 1, the evaluated mixture."""

import json

import pytest
import torch

from medfed.federated.executor import train_plans
from medfed.federated.protocol import RoundContext
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, LinearClassifier, LinearOptions, build_loop, seeded, two_group_federation


def _logits(theta, x):
    """LinearClassifier's forward pass from its flat parameter vector (weight (2, 4) row-major, then bias (2,))."""
    return x @ theta[:8].reshape(2, 4).T + theta[8:]


def _gradient(theta, x, y):
    theta = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(_logits(theta, x), y), theta)
    return g


@pytest.mark.parametrize(("alpha_lr", "alpha"), [(0.2, 0.4), (50.0, 0.4), (50.0, 0.9)])
def test_one_local_step_by_hand(alpha_lr, alpha):
    lr = 0.3
    federation = two_group_federation(n_sites=3, n_train=20)
    model = seeded(LinearClassifier, 4, 2, LinearOptions(lr=lr))
    loop = build_loop("apfl", federation, model, {"alpha": alpha, "alpha_lr": alpha_lr}, batch_size=32)  # one batch: the whole split
    loop.setup()
    site = loop.sites[0]
    half, global_slot, local_slot = site.strategy, site.slot("global"), site.slot("local")
    generator = torch.Generator().manual_seed(3)
    w, v = torch.randn(10, generator=generator), torch.randn(10, generator=generator)
    global_slot.module.set_vector("all", w)
    local_slot.module.set_vector("all", v)
    half.receive(site.view, RoundContext(1, "fit"), {})  # FedAvg's round message: empty (eta_alpha is read here)
    (plan,) = half.plan(RoundContext(1, "fit"))
    assert plan.slot == "global"

    x, y = federation.sites[0].train.tensors
    assert train_plans(site, RoundContext(1, "fit"), (plan,), 1.0, "train/fit")  # one step (half an epoch of one batch)
    assert site.passes.take(site.n_train) == {"train/fit/global": 2.0}  # two passes of the split: w's and v_bar's

    mixed = alpha * v + (1 - alpha) * w
    g_mixed = _gradient(mixed, x, y)
    unprojected = alpha - alpha_lr * torch.dot(v - w, g_mixed)
    torch.testing.assert_close(half.alpha, unprojected.clamp(0.0, 1.0))
    if alpha_lr > 1:
        assert not 0.0 < float(unprojected) < 1.0 and float(half.alpha) in (0.0, 1.0)  # the projection acted
    torch.testing.assert_close(local_slot.module.get_vector("all"), v - lr * alpha * g_mixed)  # grad_v f(v_bar) = alpha grad f(v_bar)
    torch.testing.assert_close(global_slot.module.get_vector("all"), w - lr * _gradient(w, x, y))
    assert all(p.grad is None for p in local_slot.module.parameters())  # v's gradient freed after its step


#: (APFL options, the budget of the FedAvg or Local run its w or v follows): the equal preset's steps take half the
#: budget (two passes each), the published preset's a step per mini-batch of the whole budget
PRESETS = [({}, 0.5), ({"preset": "published"}, 1)]


@pytest.mark.parametrize(("options", "budget"), PRESETS)
def test_the_global_model_is_fedavgs_bit_for_bit(options, budget):
    federation = two_group_federation(n_sites=4)
    apfl = build_loop("apfl", federation, seeded(BatchNormClassifier, 4, 2), options, participation=0.75)
    fedavg = build_loop("fedavg", federation, seeded(BatchNormClassifier, 4, 2), participation=0.75, local_epochs=budget)
    apfl.fit(3)
    fedavg.fit(3)
    assert json.dumps([r["train_loss"] for r in apfl.history]) == json.dumps([r["train_loss"] for r in fedavg.history])
    for a, b in zip(apfl.sites, fedavg.sites):
        for part in ("all", "buffers"):
            assert torch.equal(a.slot("global").module.get_vector(part), b.module.get_vector(part))


@pytest.mark.parametrize(("options", "budget"), PRESETS)
def test_alpha_fixed_at_one_is_local_training_of_v(options, budget):
    federation = two_group_federation(n_sites=4)
    options = {"alpha": 1.0, "adaptive": False, **options}
    apfl = build_loop("apfl", federation, seeded(BatchNormClassifier, 4, 2), options, participation=0.75)
    local = build_loop("local", federation, seeded(BatchNormClassifier, 4, 2), participation=0.75, local_epochs=budget)
    apfl.fit(3)
    local.fit(3)
    for a, b in zip(apfl.sites, local.sites):
        for part in ("all", "buffers"):
            assert torch.equal(a.slot("local").module.get_vector(part), b.module.get_vector(part))
            assert torch.equal(a.module.get_vector(part), b.module.get_vector(part))  # the evaluated mixture is v
    assert json.dumps([r["metrics"] for r in apfl.history]) == json.dumps([r["metrics"] for r in local.history])


@pytest.mark.parametrize(("options", "budget"), PRESETS)
def test_alpha_fixed_at_zero_evaluates_the_global_model(options, budget):
    federation = two_group_federation(n_sites=4)
    options = {"alpha": 0.0, "adaptive": False, **options}
    apfl = build_loop("apfl", federation, seeded(LinearClassifier, 4, 2), options, participation=0.75)
    fedavg = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2), participation=0.75, local_epochs=budget)
    apfl.fit(3)
    fedavg.fit(3)
    assert json.dumps([r["metrics"] for r in apfl.history]) == json.dumps([r["metrics"] for r in fedavg.history])


def test_each_site_is_evaluated_with_its_mixture_and_learns_to_lean_on_its_own_model():
    # The two groups' label rules are opposite: the global model suits neither, so alpha rises. Both runs at the same budget.
    loop = build_loop("apfl", two_group_federation(n_sites=6), seeded(BatchNormClassifier, 4, 2), {"alpha_lr": 0.05}, local_epochs=2)
    loop.fit(6)
    for site in loop.sites:
        alpha = site.strategy.alpha
        local, global_ = site.slot("local").module, site.slot("global").module
        torch.testing.assert_close(global_.get_vector("all"), loop.server.global_model)  # the delivered global model
        expected = alpha * local.get_vector("all") + (1 - alpha) * loop.server.global_model
        torch.testing.assert_close(site.module.get_vector("all"), expected)
        assert torch.equal(site.module.get_vector("buffers"), local.get_vector("buffers"))
        assert 0.5 < float(alpha) <= 1.0, (site.name, float(alpha))
    fedavg = build_loop("fedavg", two_group_federation(n_sites=6), seeded(BatchNormClassifier, 4, 2), local_epochs=2)
    fedavg.fit(6)
    assert loop.history[-1]["mean"]["accuracy"] > fedavg.history[-1]["mean"]["accuracy"] + 0.2
