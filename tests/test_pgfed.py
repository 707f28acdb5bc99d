"""PGFed / PGFedMo against Algorithm 1 computed by hand on least squares (analytic gradients)."""

import numpy as np
import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config
from medfed.federated.strategies.pgfed import PGFed, PGFedMo, training_risk
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, LinearClassifier, LinearOptions, LinearRegressor, build_loop, regression_federation, seeded, two_group_federation

LR, MU, ALPHA_LR, EPOCHS, ROUNDS = 0.1, 0.5, 0.05, 2, 4


def algorithm_1_by_hand(federation, theta0, participants, beta):
    """Algorithm 1 of the paper, literally, in float64 with f_s(theta) = |X theta - y|^2 / (2 n).

    Every site's data fit in one batch, so each local epoch is one step.
    Returns the final A, theta_glob, per-site theta and the auxiliary
    gradients each participant downloaded, per round.
    """
    data = [(site.train.tensors[0].double().numpy(), site.train.tensors[1].double().numpy()) for site in federation.sites]
    n = np.array([len(y) for _, y in data], dtype=float)

    def gradient(s, theta):
        x, y = data[s]
        return x.T @ (x @ theta - y) / len(y)

    def risk(s, theta):
        x, y = data[s]
        return 0.5 * np.mean((x @ theta - y) ** 2)

    n_sites = len(data)
    theta_glob = theta0.copy()
    theta = {s: theta0.copy() for s in range(n_sites)}
    own_aux = {}  # g~_i kept at site i (momentum)
    A, previous = None, None  # previous = (S_{t-1}, {j: grad}, {j: g1})
    downloaded = []
    for S in participants:
        results, downloaded_now = {}, {}
        for i in S:
            th = theta_glob.copy()
            a_i = None
            if previous is None:
                for _ in range(EPOCHS):
                    th -= LR * gradient(i, th)
            else:
                S_prev, grads, g1 = previous
                g_tilde = MU * sum(A[i, j] * grads[j] for j in S_prev)
                g_bar = MU / len(S_prev) * sum(grads[j] for j in S_prev)
                downloaded_now[i] = g_tilde
                own_aux[i] = g_tilde if i not in own_aux else (1 - beta) * g_tilde + beta * own_aux[i]
                a_i = A[i].copy()
                for _ in range(EPOCHS):
                    th -= LR * (gradient(i, th) + own_aux[i])  # line 8
                    g2 = g_bar @ th  # line 9, with the updated theta
                    for j in S_prev:  # line 10 (projected onto a >= 0)
                        a_i[j] = max(0.0, a_i[j] - ALPHA_LR * (g1[j] + g2))
            theta[i] = th
            grad = gradient(i, th)
            results[i] = (th, grad, MU * (risk(i, th) - grad @ th), a_i)
        if A is None:
            A = np.full((n_sites, n_sites), 1.0 / len(S))
        for i, (_, _, _, a_i) in results.items():
            if a_i is not None:
                A[i] = a_i
        theta_glob = sum(n[i] * results[i][0] for i in S) / n[S].sum()
        previous = (S, {i: results[i][1] for i in S}, {i: results[i][2] for i in S})
        downloaded.append(downloaded_now)
    return A, theta_glob, theta, downloaded


@pytest.mark.parametrize("name, options, beta", [("pgfed", {}, 0.0), ("pgfedmo", {"beta": 0.5}, 0.5)])
def test_rounds_follow_algorithm_1(name, options, beta):
    federation = regression_federation(n_sites=3)
    model = seeded(LinearRegressor, 3, LinearOptions(lr=LR))
    loop = build_loop(
        name, federation, model, {"mu": MU, "alpha_lr": ALPHA_LR, **options}, participation=2 / 3, local_epochs=EPOCHS, batch_size=64
    )
    received = []
    for site in loop.sites:
        original_receive = site.strategy.receive

        def recording_receive(site, ctx, payload, original_receive=original_receive):
            if "aux_gradient" in payload:
                received.append((loop.round, site.index, payload["aux_gradient"].double().numpy()))
            original_receive(site, ctx, payload)

        site.strategy.receive = recording_receive
    loop.fit(ROUNDS)
    participants = [loop.participants(t) for t in range(1, ROUNDS + 1)]
    assert any(participants[t] != participants[t - 1] for t in range(1, ROUNDS)), "S_t should change so S_{t-1} bookkeeping matters"

    theta0 = model.get_vector("all").double().numpy()
    A, theta_glob, theta, downloaded = algorithm_1_by_hand(federation, theta0, participants, beta)

    tol = dict(rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(loop.server.alpha.double().numpy(), A, **tol)
    assert not np.allclose(A, 1.0 / 2), "the a_ij should have moved from 1/M"
    np.testing.assert_allclose(loop.server.global_model.double().numpy(), theta_glob, **tol)
    for site in loop.sites:
        np.testing.assert_allclose(site.module.get_vector("all").double().numpy(), theta[site.index], **tol)
    expected = [(t + 1, i, g) for t, per_site in enumerate(downloaded) for i, g in sorted(per_site.items())]
    assert [(t, i) for t, i, _ in received] == [(t, i) for t, i, _ in expected]
    for (_, _, got), (_, _, want) in zip(received, expected):
        np.testing.assert_allclose(got, want, **tol)


def test_training_risk_is_the_full_split_mean_over_uneven_batches():
    federation = regression_federation(n_sites=3)  # site 2 holds 10 samples: batches of 4, 4, 2
    loop = build_loop("pgfed", federation, seeded(LinearRegressor, 3), batch_size=4)
    site = loop.sites[2]
    risk, gradient = training_risk(site.view)
    x, y = (t.double() for t in federation.sites[2].train.tensors)
    theta = site.module.get_vector("all").double()
    assert risk == pytest.approx(0.5 * float(((x @ theta - y) ** 2).mean()), rel=1e-6)
    torch.testing.assert_close(gradient.double(), x.T @ (x @ theta - y) / len(y), rtol=1e-5, atol=1e-7)


def test_pgfedmo_with_beta_zero_is_pgfed_bit_for_bit():
    federation = two_group_federation(n_sites=4)
    loops = {}
    for name, options in (("pgfed", {}), ("pgfedmo", {"beta": 0.0})):
        loops[name] = build_loop(name, federation, seeded(LinearClassifier, 4, 2), options, participation=0.5)
        loops[name].fit(4)
    plain, momentum = loops["pgfed"], loops["pgfedmo"]
    assert [r["metrics"] for r in plain.history] == [r["metrics"] for r in momentum.history]
    assert [r["train_loss"] for r in plain.history] == [r["train_loss"] for r in momentum.history]
    assert torch.equal(plain.server.alpha, momentum.server.alpha)
    for a, b in zip(plain.sites, momentum.sites):
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))

    with_momentum = build_loop("pgfedmo", federation, seeded(LinearClassifier, 4, 2), {"beta": 0.5}, participation=0.5)
    with_momentum.fit(4)
    assert not torch.equal(plain.sites[0].module.get_vector("all"), with_momentum.sites[0].module.get_vector("all"))


def test_beta_is_reachable_from_the_config_and_validated():
    cls, options = strategy_from_config({"name": "pgfedmo", "pgfedmo": {"beta": 0.8, "mu": 0.05}})
    assert cls is PGFedMo and options.beta == 0.8 and options.mu == 0.05
    cls, options = strategy_from_config({"name": "pgfed"})
    assert cls is PGFed and not hasattr(options, "beta")
    with pytest.raises(ConfigError, match="strategy.pgfedmo.beta"):
        strategy_from_config({"name": "pgfedmo", "pgfedmo": {"beta": 1.0}})
    with pytest.raises(ConfigError, match="strategy.pgfed.beta"):
        strategy_from_config({"name": "pgfed", "pgfed": {"beta": 0.5}})


def test_training_risk_leaves_batchnorm_statistics_alone_and_uses_batch_statistics():
    loop = build_loop("pgfed", two_group_federation(n_sites=2), seeded(BatchNormClassifier, 4, 2), batch_size=16)
    site = loop.sites[0]
    site.train(site.steps(1), "model", "all", lambda batch: site.module.training_step(batch, 0))  # running statistics away from 0 and 1
    before = {name: buffer.clone() for name, buffer in site.module.named_buffers()}
    risk, _ = training_risk(site.view)
    for name, buffer in site.module.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert site.module.training  # as local training leaves it
    # by hand: the sample-weighted mean of the batch losses, each batch normalised with its own statistics
    x, y = site.data.train.tensors
    losses = [(len(yb), site.module.training_step((xb, yb), 0).item()) for xb, yb in zip(x.split(16), y.split(16))]
    for name, buffer in site.module.named_buffers():
        buffer.copy_(before[name])
    assert risk == pytest.approx(sum(n * loss for n, loss in losses) / len(y), rel=1e-6)
