"""SuPerFed: the mixture's forward pass and gradients, the regularisers, both optimiser steps, the schedule, the evaluated mixture."""

import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config
from medfed.federated.protocol import RoundContext, TrainingPlan
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, LinearOptions, build_loop, seeded, two_group_federation

LR = 0.3


def _loop(**options):
    model = seeded(LinearClassifier, 4, 2, LinearOptions(lr=LR))
    return build_loop("superfed", two_group_federation(n_sites=3, n_train=20), model, options, batch_size=8)


def _site_at_round(loop, round_index, global_model=None):
    """Site 0 after setup and the message of ``round_index`` (its federated model = ``global_model``), and one batch."""
    loop.setup()
    site = loop.sites[0]
    global_model = loop.initial["all"] if global_model is None else global_model
    message = {"all": global_model, "buffers": torch.zeros(0), "round": torch.tensor([float(round_index)])}
    site.strategy.receive(site.view, RoundContext(1, "fit"), message)
    return site, next(site.batches(1))  # a device batch, as Site.train draws it


def _vectors(site):
    return site.slot("federated").module.get_vector("all"), site.slot("local").module.get_vector("all")


def _plain_model_with(vector):
    """A plain LinearClassifier holding ``vector`` as its parameters."""
    model = LinearClassifier(4, 2)
    model.set_vector("all", vector)
    return model


def test_the_mixed_forward_pass_is_the_interpolation_of_the_two_slots_and_each_gets_its_share_of_the_gradient():
    lam = 0.3
    loop = _loop(mu=0.0, nu=0.0, start_round=1)
    site, batch = _site_at_round(loop, 1)
    f, l = _vectors(site)
    assert not torch.allclose(f, l)  # the local model was drawn independently
    loss = site.strategy.mixture_loss(site.view, batch, lam)

    mixed = _plain_model_with((1 - lam) * f + lam * l)
    expected = mixed.training_step(batch, 0)
    torch.testing.assert_close(loss, expected)
    expected.backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in mixed.parameters()])

    loss.backward()
    federated_gradient = torch.cat([p.grad.reshape(-1) for p in site.slot("federated").module.parameters()])
    local_gradient = torch.cat([p.grad.reshape(-1) for p in site.slot("local").module.parameters()])
    torch.testing.assert_close(federated_gradient, (1 - lam) * gradient)
    torch.testing.assert_close(local_gradient, lam * gradient)


def test_the_proximal_and_cosine_terms_and_their_gradients_by_hand():
    lam, mu, nu = 0.6, 0.05, 1.5
    loop = _loop(mu=mu, nu=nu, start_round=1)
    received = torch.linspace(-0.5, 0.5, 10)
    site, batch = _site_at_round(loop, 1, received)
    site.slot("federated").module.set_vector("all", received + 0.1 * torch.cos(torch.arange(10.0)))  # w^f away from w^g
    f, l = _vectors(site)
    loss = site.strategy.mixture_loss(site.view, batch, lam)
    loss.backward()

    mixed = _plain_model_with((1 - lam) * f + lam * l)
    data_loss = mixed.training_step(batch, 0)
    data_loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in mixed.parameters()]).double()
    f64, l64, w_g = f.double(), l.double(), received.double()
    norm_f, norm_l = f64.norm(), l64.norm()
    cos = f64 @ l64 / (norm_f * norm_l)
    value = data_loss.double() + mu * (f64 - w_g).square().sum() + nu * cos**2
    d_cos_df = l64 / (norm_f * norm_l) - cos * f64 / norm_f**2
    d_cos_dl = f64 / (norm_f * norm_l) - cos * l64 / norm_l**2
    expected_f = (1 - lam) * g + 2 * mu * (f64 - w_g) + nu * 2 * cos * d_cos_df
    expected_l = lam * g + nu * 2 * cos * d_cos_dl

    torch.testing.assert_close(loss.double(), value, rtol=1e-5, atol=1e-6)
    grads = {name: torch.cat([p.grad.reshape(-1) for p in site.slot(name).module.parameters()]).double() for name in ("federated", "local")}
    torch.testing.assert_close(grads["federated"], expected_f, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["local"], expected_l, rtol=1e-4, atol=1e-6)


def test_one_loop_step_moves_both_models_with_their_own_optimisers():
    loop = _loop(mu=0.1, nu=0.5, start_round=1)
    site, _ = _site_at_round(loop, 1)
    half = site.strategy
    f, l = _vectors(site)
    draws = []
    mixture_loss = half.mixture_loss

    def recorded(site, batch, lam):
        draws.append((batch, lam))
        return mixture_loss(site, batch, lam)

    half.mixture_loss = recorded
    (plan,) = half.plan(RoundContext(1, "fit"))  # w^f's steps, w^l's optimiser stepping after each
    site.train(1, plan.slot, plan.part, lambda batch: half.loss(site.view, RoundContext(1, "fit"), plan, batch), also_steps=plan.also_steps)
    (batch, lam), = draws
    assert 0.0 <= lam < 1.0
    # the same step by hand: SGD on both from the same point, on the same batch and lambda
    twin, _ = _site_at_round(_loop(mu=0.1, nu=0.5, start_round=1), 1)
    twin.strategy.mixture_loss(twin.view, batch, lam).backward()
    for name, before in (("federated", f), ("local", l)):
        gradient = torch.cat([p.grad.reshape(-1) for p in twin.slot(name).module.parameters()])
        torch.testing.assert_close(site.slot(name).module.get_vector("all"), before - LR * gradient)
    assert all(p.grad is None for p in site.slot("local").module.parameters())  # freed after its step


def test_before_start_round_only_the_federated_model_trains_with_the_proximal_term_and_is_evaluated():
    mu = 0.2
    loop = _loop(mu=mu, nu=1.0, start_round=3)
    site, batch = _site_at_round(loop, 2, loop.initial["all"] + 0.05)
    f, l = _vectors(site)
    loss = site.strategy.loss(site.view, RoundContext(1, "fit"), TrainingPlan(slot="federated"), batch)
    expected = _plain_model_with(f).training_step(batch, 0) + mu * (f - (loop.initial["all"] + 0.05)).square().sum()
    torch.testing.assert_close(loss, expected)

    loop = _loop(mu=mu, nu=1.0, start_round=3)
    loop.fit(2)
    fresh = _loop(mu=mu, nu=1.0, start_round=3)
    fresh.setup()
    for site, twin in zip(loop.sites, fresh.sites):
        f, l = _vectors(site)
        assert not torch.equal(f, loop.initial["all"])
        assert torch.equal(site.module.get_vector("all"), f)  # evaluated with w^f
        assert torch.equal(l, twin.slot("local").module.get_vector("all"))  # still its initial draw


def test_the_evaluated_model_is_the_chosen_mixture_of_the_sites_own_models_once_personalising():
    loop = _loop(start_round=2, eval_lambda=0.25)
    loop.fit(1)
    for site in loop.sites:
        assert torch.equal(site.module.get_vector("all"), _vectors(site)[0])
    locals_before = [_vectors(site)[1] for site in loop.sites]
    loop.fit(2)
    for site, before in zip(loop.sites, locals_before):
        f, l = _vectors(site)
        assert not torch.equal(l, before)  # the local model trains from round 2 on
        torch.testing.assert_close(site.module.get_vector("all"), 0.75 * f + 0.25 * l)
    assert loop.server.deliver(RoundContext(loop.round, "deliver"), 0) == {}


def test_local_models_are_drawn_per_site_seeded_and_apart_from_the_federated_model():
    first, second = _loop(), _loop()
    first.setup()
    second.setup()
    locals_ = [site.slot("local").module.get_vector("all") for site in first.sites]
    assert all(torch.equal(a, b.slot("local").module.get_vector("all")) for a, b in zip(locals_, second.sites))
    assert not torch.equal(locals_[0], locals_[1])
    assert all(not torch.allclose(local, first.initial["all"]) for local in locals_)


def test_the_mixing_weights_are_drawn_afresh_every_step_and_the_same_in_a_second_run():
    def draws_of_a_run():
        loop = _loop(start_round=1)
        drawn = []
        for site in loop.sites:
            original = site.strategy.mixture_loss
            site.strategy.mixture_loss = lambda site, batch, lam, original=original: (drawn.append((site.index, lam)), original(site, batch, lam))[1]
        loop.fit(2)
        return drawn

    first = draws_of_a_run()
    assert first == draws_of_a_run()
    lams = [lam for _, lam in first]
    assert len(lams) >= 6 and len(set(lams)) == len(lams) and all(0.0 <= lam < 1.0 for lam in lams)


@pytest.mark.parametrize("key, value", [("mu", -1.0), ("nu", -0.1), ("start_round", 0), ("eval_lambda", 1.5)])
def test_options_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"strategy.superfed.{key}"):
        strategy_from_config({"name": "superfed", "superfed": {key: value}})
