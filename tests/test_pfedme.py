"""pFedMe: the inner problem to accuracy nu (against its closed form), the local and server updates by hand."""

import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config
from medfed.federated.protocol import RoundContext
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearOptions, LinearRegressor, build_loop, regression_federation, seeded

ETA = 0.05  # the model's SGD learning rate: the outer step size eta
W = torch.tensor([0.3, -0.2, 0.5])


def _loop(batch_size=4, local_epochs=1, **options):
    model = seeded(LinearRegressor, 3, LinearOptions(lr=ETA))
    return build_loop("pfedme", regression_federation(n_sites=3), model, options, batch_size=batch_size, local_epochs=local_epochs)


def _ready_site(loop, w=W):
    """Site 0 after receiving w^t = ``w``, and one batch of its data."""
    loop.setup()
    site = loop.sites[0]
    site.strategy.receive(site.view, RoundContext(1, "fit"), {"all": w, "buffers": torch.zeros(0)})
    return site, next(site.batches(1))  # a device batch, as Site.train draws it


def _inner_gradient(theta, w, lam, x, y):
    """grad h(theta) = X^T (X theta - y) / n + lam (theta - w), in float64."""
    x, y, theta, w = x.double(), y.double(), theta.double(), w.double()
    return x.T @ (x @ theta - y) / len(y) + lam * (theta - w)


def test_the_inner_problem_is_solved_to_accuracy_nu():
    lam, nu = 2.0, 1e-4
    loop = _loop(lam=lam, inner_lr=0.2, inner_steps=10_000, inner_tolerance=nu)
    site, (x, y) = _ready_site(loop)
    site.strategy.solve_inner_problem(site.view, (x, y), W)
    theta = site.slot("personal").module.get_vector("all")
    assert torch.linalg.vector_norm(_inner_gradient(theta, W, lam, x, y)) <= nu * 1.01  # float32 steps, float64 check
    # independent solution: (X^T X / n + lam I) theta* = X^T y / n + lam w; h is lam-strongly convex,
    # so ||theta - theta*|| <= ||grad h(theta)|| / lam
    x64, y64 = x.double(), y.double()
    optimum = torch.linalg.solve(x64.T @ x64 / len(y) + lam * torch.eye(3, dtype=torch.float64), x64.T @ y64 / len(y) + lam * W.double())
    assert torch.linalg.vector_norm(theta.double() - optimum) <= nu / lam * 1.01
    assert torch.linalg.vector_norm(W.double() - optimum) > 100 * nu / lam  # it had to move


def test_without_a_tolerance_the_inner_solver_takes_exactly_k_gradient_steps_from_the_warm_start():
    lam, step, k = 1.5, 0.1, 4
    loop = _loop(lam=lam, inner_lr=step, inner_steps=k)
    site, (x, y) = _ready_site(loop)
    start = torch.tensor([1.0, 0.0, -1.0])
    site.slot("personal").module.set_vector("all", start)  # the previous batch's theta
    site.strategy.solve_inner_problem(site.view, (x, y), W)
    theta = start.double()
    for _ in range(k):
        theta = theta - step * _inner_gradient(theta, W, lam, x, y)
    torch.testing.assert_close(site.slot("personal").module.get_vector("all").double(), theta, rtol=1e-5, atol=1e-6)

    loop = _loop(lam=lam, inner_lr=step, inner_steps=k, inner_tolerance=1e6)  # already accurate: no step at all
    site, batch = _ready_site(loop)
    site.strategy.solve_inner_problem(site.view, batch, W)
    assert torch.equal(site.slot("personal").module.get_vector("all"), W)


def test_the_local_update_steps_w_along_lam_times_w_minus_theta():
    lam = 3.0
    loop = _loop(lam=lam, inner_lr=0.1, inner_steps=3)
    site, _ = _ready_site(loop)
    half = site.strategy
    site.train(1, "local", "all", lambda batch: half.loss(site.view, RoundContext(1, "fit"), half.plan(RoundContext(1, "fit"))[0], batch))  # one mini-batch, as the loop runs it
    theta = site.slot("personal").module.get_vector("all")
    assert not torch.allclose(theta, W)
    expected = W - ETA * lam * (W - theta)  # w_{i,1} = w_{i,0} - eta lam (w_{i,0} - theta_i)
    torch.testing.assert_close(site.slot("local").module.get_vector("all"), expected)


@pytest.mark.parametrize(
    ("preset", "local_epochs", "inner_steps"),
    [
        ("published", 2, [3, 3]),  # a local round per mini-batch of 2 epochs, K = 3 inner steps each
        ("equal", 4, [3, 1]),  # 4 passes in all: K = 3, then the one left
    ],
)
def test_a_round_by_hand_full_batch_and_the_server_mixes_with_beta(preset, local_epochs, inner_steps):
    # batch_size >= every site's n_train: each local round is one full-batch step, so the whole
    # round can be written down: theta from w^t, the inner steps, then w <- w - eta lam (w - theta), per local round.
    lam, step, k, beta = 2.0, 0.15, 3, 0.5
    loop = _loop(batch_size=64, local_epochs=local_epochs, lam=lam, inner_lr=step, inner_steps=k, beta=beta, preset=preset)
    replies = {}
    aggregate = loop.server.aggregate
    loop.server.aggregate = lambda phase, r: (replies.update(r), aggregate(phase, r))
    loop.fit(1)
    start = loop.initial["all"].double()
    expected_models, sizes = [], []
    for site in loop.sites:
        x, y = site.data.train.tensors
        w, theta = start.clone(), start.clone()
        for steps in inner_steps:
            for _ in range(steps):
                theta = theta - step * _inner_gradient(theta, w, lam, x, y)
            w = w - ETA * lam * (w - theta)
        torch.testing.assert_close(replies[site.index]["all"].double(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(site.module.get_vector("all").double(), theta, rtol=1e-5, atol=1e-6)  # evaluated: theta_i
        assert site.evaluated_slot == "personal"
        expected_models.append(w)
        sizes.append(len(y))
    average = sum(n * w for n, w in zip(sizes, expected_models)) / sum(sizes)
    torch.testing.assert_close(loop.server.global_model.double(), (1 - beta) * start + beta * average, rtol=1e-5, atol=1e-6)


def test_beta_two_extrapolates_past_the_average():
    loop, twin = _loop(beta=2.0, lam=1.0), _loop(beta=1.0, lam=1.0)  # the same round: beta = 1 gives the average
    loop.fit(1)
    twin.fit(1)
    start = loop.initial["all"]
    torch.testing.assert_close(loop.server.global_model, start + 2.0 * (twin.server.global_model - start))


def test_skipping_sites_keep_their_personalised_model_and_nothing_is_delivered():
    loop = _loop(lam=1.0)
    loop.fit(1)
    assert loop.server.deliver(RoundContext(loop.round, "deliver"), 0) == {}
    before = [site.module.get_vector("all") for site in loop.sites]
    loop.participants = lambda r: [0]  # site indices (the loop's executor seam)
    loop.fit(2)
    assert not torch.equal(loop.sites[0].module.get_vector("all"), before[0])
    for site in loop.sites[1:]:
        assert torch.equal(site.module.get_vector("all"), before[site.index])


@pytest.mark.parametrize(
    "key, value", [("lam", 0.0), ("inner_steps", 0), ("inner_tolerance", -1.0), ("inner_lr", 0.0), ("beta", 0.0)]
)
def test_options_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"strategy.pfedme.{key}"):
        strategy_from_config({"name": "pfedme", "pfedme": {key: value}})
