"""FedAMP: attention weights against a direct computation, the proximal gradient, grouping of sites."""

import numpy as np
import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies.fedamp import FedAMP, exponential_attention, heuristic_attention
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, LinearOptions, build_loop, seeded, two_group_federation


def _models(seed=0):
    """5 models of 7 parameters with norm ~80, two of them ~0.03 apart (cancellation in the Gram matrix)."""
    rng = np.random.default_rng(seed)
    models = 30.0 * rng.normal(size=(5, 7))
    models[3] = models[1] + 1e-2 * rng.normal(size=7)
    return models


def test_exponential_attention_matches_the_definition():
    models = _models()
    alpha, sigma = 2.5e-4, 1e-3  # alpha (N - 1) / sigma = 1: xi_ii may reach 0, never below
    xi = exponential_attention(torch.tensor(models), alpha, sigma).numpy()
    expected = np.zeros((5, 5))
    for i in range(5):
        for j in range(5):
            if i != j:
                expected[i, j] = alpha * np.exp(-np.sum((models[i] - models[j]) ** 2) / sigma) / sigma
        expected[i, i] = 1.0 - expected[i].sum()
    np.testing.assert_allclose(xi, expected, rtol=1e-7, atol=1e-12)
    assert 0.01 < xi[1, 3] < alpha / sigma and xi[0, 1] == 0.0  # only the close pair attend to each other
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)


def test_heuristic_attention_matches_the_definition():
    models = _models()
    self_weight, scale = 0.3, 4.0
    xi = heuristic_attention(torch.tensor(models), self_weight, scale).numpy()
    expected = np.zeros((5, 5))
    for i in range(5):
        cos = {j: models[i] @ models[j] / np.linalg.norm(models[i]) / np.linalg.norm(models[j]) for j in range(5) if j != i}
        total = sum(np.exp(scale * c) for c in cos.values())
        for j, c in cos.items():
            expected[i, j] = (1 - self_weight) * np.exp(scale * c) / total
        expected[i, i] = self_weight
    np.testing.assert_allclose(xi, expected, rtol=1e-12)
    np.testing.assert_allclose(heuristic_attention(torch.ones(1, 4), 0.3, 4.0).numpy(), [[1.0]])


def test_a_step_that_would_make_xi_ii_negative_is_refused():
    split = seeded(LinearClassifier, 4, 2).parameter_split
    with pytest.raises(ConfigError, match="strategy.fedamp.alpha"):
        FedAMP(FedAMP.Options(alpha=1.0, sigma=1.0), split, n_sites=3, seed=0)
    FedAMP(FedAMP.Options(alpha=0.5, sigma=1.0), split, n_sites=3, seed=0)  # alpha (N-1)/sigma = 1: allowed
    FedAMP(FedAMP.Options(variant="heuristic", alpha=1.0, sigma=1.0), split, n_sites=3, seed=0)  # xi_ii is fixed there


def test_proximal_term_has_the_real_gradient():
    lam, alpha = 0.3, 0.2
    loop = build_loop("fedamp", two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2), {"lam": lam, "alpha": alpha})
    loop.setup()
    site = loop.sites[0]
    w = site.module.get_vector("all") + torch.linspace(-1.0, 1.0, 10)
    site.module.set_vector("all", w)
    cloud = torch.arange(10.0) / 10.0
    site.strategy.centre = cloud
    site.module.zero_grad()
    term = site.strategy.regularizer(site.view, RoundContext(1, "fit"), site.strategy.plan(RoundContext(1, "fit"))[0])
    term.backward()
    gradient = torch.cat([site.module.linear.weight.grad.reshape(-1), site.module.linear.bias.grad])
    torch.testing.assert_close(gradient, lam / alpha * (w - cloud))
    torch.testing.assert_close(term, lam / (2 * alpha) * ((w - cloud) ** 2).sum())


def test_sites_train_from_their_cloud_model():
    loop = build_loop("fedamp", two_group_federation(n_sites=4), seeded(LinearClassifier, 4, 2), {"lam": 0.01, "alpha": 0.5, "sigma": 5.0})
    loop.fit(2)
    first_step = {}
    for site in loop.sites:
        original = site.strategy.regularizer

        def recording(view, ctx, plan, original=original, site=site):
            first_step.setdefault(site.index, (site.module.get_vector("all"), site.strategy.centre.clone()))
            return original(view, ctx, plan)

        site.strategy.regularizer = recording
    expected = {i: (loop.server.attention[i].float() @ loop.server.models) for i in range(4)}
    loop.fit(3)
    for i, (w, cloud) in first_step.items():
        torch.testing.assert_close(cloud, expected[i])
        torch.testing.assert_close(w, cloud)


@pytest.mark.parametrize("options", [{"variant": "exponential", "alpha": 0.5, "sigma": 5.0}, {"variant": "heuristic", "self_weight": 0.5}])
def test_attention_concentrates_inside_each_group(options):
    federation = two_group_federation(n_sites=6)
    loop = build_loop("fedamp", federation, seeded(LinearClassifier, 4, 2, LinearOptions(lr=0.5)), {"lam": 0.01, **options})
    loop.setup()
    groups = np.array([site.info["group"] for site in federation.sites])
    same = groups[:, None] == groups[None, :]
    off_diagonal = ~np.eye(6, dtype=bool)

    def in_group_share(xi):
        return (xi * (same & off_diagonal)).sum(axis=1) / (xi * off_diagonal).sum(axis=1)

    np.testing.assert_allclose(in_group_share(loop.server.attention.numpy()), 2 / 5)  # all models equal: uniform
    loop.fit(6)
    xi = loop.server.attention.numpy()
    assert in_group_share(xi).min() > 0.8, xi
    assert np.all(xi >= 0) and np.allclose(xi.sum(axis=1), 1.0)
