"""FPFC: the SCAD / MCP thresholding, the server's pair updates and centres, planted clusters fusing, the lam = 0 limit."""

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from medfed.data.federation import Federation, SiteData
from medfed.errors import ConfigError
from medfed.federated.strategies.solvers.concave_penalty import fusion_prox, penalty_value, shrunk_norm
from medfed.federated.strategies import strategy_from_config
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies.fpfc import FPFC
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, LinearOptions, LinearRegressor, build_loop, regression_federation, seeded, two_group_federation

SCAD = dict(kind="scad", lam=1.0, a=3.7, rho=1.0, smoothing=0.1)
MCP = dict(kind="mcp", lam=1.0, a=3.0, rho=1.0, smoothing=0.1)


@pytest.mark.parametrize(
    "setting, s, expected",
    [
        (SCAD, 0.55, 0.1 * 0.55 / 1.1),  # smoothed: s <= xi + lam/rho = 1.1, t = xi rho s / (xi rho + lam)
        (SCAD, 1.5, 0.5),  # soft threshold: s <= lam (1 + 1/rho) = 2, t = s - lam/rho
        (SCAD, 3.0, 44 / 17),  # concave: s <= a lam = 3.7, t = (s - a lam/((a-1) rho)) / (1 - 1/((a-1) rho)) = (44/27) / (17/27)
        (SCAD, 5.0, 5.0),  # flat: s > a lam, unbiased
        (MCP, 0.5, 0.05 / (0.1 + 1.0 - 0.1 / 3)),  # smoothed: s <= xi + lam/rho - xi/(a rho), t = xi rho s / (xi rho + lam - xi/a)
        (MCP, 2.0, 1.5),  # s <= a lam = 3: t = (s - lam/rho) / (1 - 1/(a rho)) = 1 / (2/3)
        (MCP, 4.0, 4.0),  # flat
    ],
)
def test_the_thresholding_matches_the_closed_form_and_a_brute_force_minimisation(setting, s, expected):
    kind, lam, a, rho, xi = (setting[k] for k in ("kind", "lam", "a", "rho", "smoothing"))
    t = float(shrunk_norm(kind, torch.tensor([s], dtype=torch.float64), lam, a, rho, xi))
    assert t == pytest.approx(expected, rel=1e-12)
    grid = torch.linspace(0.0, 6.0, 600_001, dtype=torch.float64)
    objective = rho / 2 * (grid - s) ** 2 + penalty_value(kind, grid, lam, a, xi)
    assert t == pytest.approx(float(grid[objective.argmin()]), abs=2e-5)
    direction = torch.tensor([[3.0, -4.0, 0.0]], dtype=torch.float64) / 5.0  # the prox keeps a vector's direction
    torch.testing.assert_close(fusion_prox(s * direction, kind, lam, a, rho, xi), t * direction)


@pytest.mark.parametrize("kind", ["scad", "mcp"])
def test_the_penalties_are_continuous_and_the_plain_ones_fuse_exactly(kind):
    a, lam = 3.7, 0.8
    for xi in (0.0, 0.05):
        knots = torch.tensor([xi, lam, a * lam], dtype=torch.float64)
        eps = 1e-9
        torch.testing.assert_close(penalty_value(kind, knots - eps, lam, a, xi), penalty_value(kind, knots + eps, lam, a, xi), atol=1e-8, rtol=0)
    deltas = torch.tensor([[0.3, 0.4], [0.0, 0.0], [3.0, 4.0]])  # norms 0.5 (<= lam / rho), 0, 5 (> a lam)
    fused = fusion_prox(deltas, kind, lam, a, rho=1.0, smoothing=0.0)
    assert torch.equal(fused[:2], torch.zeros(2, 2)) and torch.equal(fused[2], deltas[2])
    assert torch.equal(fusion_prox(deltas, kind, 0.0, a, rho=1.0, smoothing=0.0), deltas)  # lam = 0: identity


def test_the_server_updates_the_pairs_of_participants_and_sends_each_site_its_centre():
    model = seeded(LinearClassifier, 1, 2)
    model.configure_split([r"^linear\.bias$"])  # personal: the 2 biases; shared: the 2 weights
    options = FPFC.Options(lam=1.0, a=3.7, rho=2.0, smoothing=0.0)
    server = FPFC(options, model.parameter_split, n_sites=3, seed=0).server
    server.setup(RoundContext(0, "setup"), {part: model.get_vector(part) for part in ("shared", "personal", "all", "buffers")}, {})
    w = torch.tensor([[0.0, 0.0], [0.24, 0.32], [3.0, 4.0]])
    server.models = w.clone()
    server.fusion[2], server.duals[2] = w[1] - w[2], torch.tensor([0.2, 0.0])  # pair (1, 2), from an earlier round
    reply = {"shared": torch.tensor([1.0, 2.0]), "personal": torch.tensor([0.0, 0.0]), "num_samples": torch.tensor([5.0])}
    server.aggregate(RoundContext(1, "fit"), {0: reply})  # site 0 alone takes part: pairs (0, 1) and (0, 2), not (1, 2)
    rho, lam, a = 2.0, 1.0, 3.7
    for p, (i, j) in enumerate(server.pairs):
        if (i, j) == (1, 2):
            assert torch.equal(server.fusion[p], w[1] - w[2]) and torch.equal(server.duals[p], torch.tensor([0.2, 0.0]))
            continue
        delta = w[i] - w[j]  # the old duals are 0
        s = float(delta.norm())
        t = 0.0 if s <= lam / rho else (s - lam / rho if s <= lam + lam / rho else (s if s > a * lam else None))
        torch.testing.assert_close(server.fusion[p], t / s * delta)
        torch.testing.assert_close(server.duals[p], rho * (delta - server.fusion[p]))
    assert torch.equal(server.shared, reply["shared"])
    zeta = {pair: server.fusion[p] for p, pair in enumerate(server.pairs)}
    v = {pair: server.duals[p] for p, pair in enumerate(server.pairs)}
    for i in range(3):  # u_i = (1/N) sum_j (w_j + zeta_ij - v_ij / rho), zeta_ji = -zeta_ij
        terms = [w[j] + (zeta[(i, j)] - v[(i, j)] / rho if i < j else -(zeta[(j, i)] - v[(j, i)] / rho)) for j in range(3) if j != i]
        torch.testing.assert_close(server.message(RoundContext(1, "fit"), i)["personal"], (w[i] + sum(terms)) / 3)
    assert server.metrics()["fused_pairs"] == 1.0 and server.metrics()["clusters"] == 2.0  # (0, 1) fused; 2 apart


def _two_group_regression(n_sites=6, n_features=3, gap=4.0, seed=0):
    """Least-squares sites in two groups: y = <x, theta_g> + noise, ||theta_1 - theta_0|| = gap."""
    rng = np.random.default_rng(seed)
    step = rng.normal(size=n_features)
    truths = [rng.normal(size=n_features)]
    truths.append(truths[0] + gap * step / np.linalg.norm(step))
    sites = []
    for s in range(n_sites):
        group = int(s >= n_sites // 2)

        def draw(count):
            x = rng.normal(size=(count, n_features))
            y = x @ truths[group] + 0.1 * rng.normal(size=count)
            return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))

        sites.append(SiteData(f"site{s}", draw(24 + 4 * s), draw(8), {"group": group}))
    return Federation("toy", sites, (n_features,), 1, "GENERATED two-group least squares", True)


def _all_personal(model):
    model.configure_split([".*"])
    return model


def _fused_solution(sites):
    """argmin_w sum_i f_i(w), f_i(w) = mean_k (<x_k, w> - y_k)^2 / 2 over site i's training split (float64)."""
    gram = sum(site.data.train.tensors[0].double().T @ site.data.train.tensors[0].double() / site.n_train for site in sites)
    moment = sum(site.data.train.tensors[0].double().T @ site.data.train.tensors[1].double() / site.n_train for site in sites)
    return torch.linalg.solve(gram, moment)


def test_planted_clusters_fuse_within_groups_and_stay_apart_between():
    # Full-batch local steps, so the ADMM converges: within a group the models fuse exactly, to the minimiser of
    # the group's summed losses (the duals cancel in the sum); the groups, farther apart than a lam, stay unbiased.
    federation = _two_group_regression()
    model = _all_personal(seeded(LinearRegressor, 3, LinearOptions(lr=0.3)))
    runs = {}
    for lam in (0.0, 0.5):
        loop = build_loop("fpfc", federation, model, {"lam": lam, "smoothing": 0.0}, local_epochs=5, batch_size=64, update_norm_limit=None)
        loop.fit(40)
        runs[lam] = loop
    groups = ([0, 1, 2], [3, 4, 5])

    def distances(loop):
        w = torch.stack([site.module.get_vector("all").double() for site in loop.sites])
        within = max(float((w[i] - w[j]).norm()) for group in groups for i, j in itertools.combinations(group, 2))
        between = min(float((w[i] - w[j]).norm()) for i in groups[0] for j in groups[1])
        return w, within, between

    w, within, between = distances(runs[0.5])
    _, within_alone, _ = distances(runs[0.0])
    assert within < 1e-5 < 0.01 < within_alone and between > 3.5 > 3.7 * 0.5
    for group in groups:
        torch.testing.assert_close(w[group], _fused_solution([runs[0.5].sites[i] for i in group]).expand(3, -1), rtol=0, atol=1e-5)
    server = runs[0.5].history[-1]["server"]
    assert server["fused_pairs"] == 6.0 and server["clusters"] == 2.0 and server["residual"] < 1e-5


def test_planted_classification_groups_are_found_as_the_fused_pairs():
    loop = build_loop("fpfc", two_group_federation(n_sites=6), _all_personal(seeded(LinearClassifier, 4, 2)), {"lam": 0.5})
    loop.fit(20)
    fused = {pair for p, pair in enumerate(loop.server.pairs) if float(loop.server.fusion[p].norm()) <= 1e-6}
    assert fused == {pair for group in ([0, 1, 2], [3, 4, 5]) for pair in itertools.combinations(group, 2)}


def test_with_lam_zero_each_site_trains_its_own_model_with_a_proximal_damping():
    # lam = 0: the prox is the identity, so v = 0, zeta_ij = w_i - w_j and u_i = w_i: site i runs gradient
    # descent on f_i(w) + rho/2 ||w - w_i^t||^2 from its own model (one full batch per epoch here).
    rho, lr, epochs = 0.5, 0.1, 3
    federation = regression_federation()
    loop = build_loop("fpfc", federation, _all_personal(seeded(LinearRegressor, 3, LinearOptions(lr=lr))), {"lam": 0.0, "rho": rho}, local_epochs=epochs)
    expected = [site.module.get_vector("all").double() for site in loop.sites]
    for round_index in range(1, 4):
        loop.fit(round_index)
        for site in loop.sites:
            x, y = (t.double() for t in site.data.train.tensors)
            start = w = expected[site.index]
            for _ in range(epochs):
                w = w - lr * (x.T @ (x @ w - y) / site.n_train + rho * (w - start))
            expected[site.index] = w
            torch.testing.assert_close(site.module.get_vector("all").double(), w, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loop.server.message(RoundContext(1, "fit"), site.index)["personal"], site.module.get_vector("personal"), rtol=1e-5, atol=1e-6)
    assert not loop.server.duals.any()


def test_with_lam_zero_and_a_vanishing_rho_it_is_local_training():
    runs = {}
    for name, options in (("fpfc", {"lam": 0.0, "rho": 1e-9}), ("local", None)):
        loop = build_loop(name, two_group_federation(n_sites=4), _all_personal(seeded(LinearClassifier, 4, 2)), options, participation=0.5)
        loop.fit(3)
        runs[name] = loop
    for a, b in zip(runs["fpfc"].sites, runs["local"].sites):
        torch.testing.assert_close(a.module.get_vector("all"), b.module.get_vector("all"), rtol=1e-6, atol=1e-7)


def test_options_are_checked():
    for options, key in (
        ({"lam": -1.0}, "lam"),
        ({"penalty": "lasso"}, "penalty"),
        ({"a": 2.0}, "a"),  # SCAD needs a > 1 + 1/rho = 2
        ({"penalty": "mcp", "a": 0.5, "rho": 1.0}, "a"),
        ({"lam": 0.1, "smoothing": 0.1}, "smoothing"),
        ({"rho": 0.0}, "rho"),
    ):
        with pytest.raises(ConfigError, match=f"strategy.fpfc.{key}"):
            strategy_from_config({"name": "fpfc", "fpfc": options})
    strategy_from_config({"name": "fpfc", "fpfc": {"lam": 0.0, "a": 1.0}})  # lam = 0: the prox is the identity
