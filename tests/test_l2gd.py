"""L2GD: the aggregation step by hand, theta = 0 is Local and theta = 1 is FedAvg, bit for bit."""

import json

import pytest
import torch

from medfed.errors import ConfigError
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, LinearClassifier, build_loop, seeded, two_group_federation

PARTS = ("all", "buffers")


def test_the_participants_step_theta_of_the_way_to_their_weighted_mean_and_the_others_stay():
    theta = 0.3
    loop = build_loop("l2gd", two_group_federation(n_sites=4), seeded(BatchNormClassifier, 4, 2), {"mixing": theta}, participation=0.75)
    loop.fit(1)
    sent = {}
    for site in loop.sites:
        reply = site.strategy.reply

        def recording(site, ctx, reply=reply):
            payload = reply(site, ctx)
            if ctx.phase == "fit":
                sent[site.index] = {part: payload[part].clone() for part in PARTS}
            return payload

        site.strategy.reply = recording
    before = {site.index: {part: site.module.get_vector(part) for part in PARTS} for site in loop.sites}
    loop.fit(2)
    assert len(sent) == 3 and loop.history[-1]["participants"] == [loop.sites[i].name for i in sorted(sent)]
    sizes = {i: float(loop.sites[i].n_train) for i in sent}
    for part in PARTS:
        mean = sum(sizes[i] * sent[i][part].double() for i in sent) / sum(sizes.values())
        assert not any(torch.allclose(sent[i][part], mean.float()) for i in sent)  # the step moves every participant
        for site in loop.sites:
            now = site.module.get_vector(part).double()
            if site.index in sent:  # trained (x_i sent), then x_i + theta (x_bar - x_i)
                expected = sent[site.index][part].double() + theta * (mean - sent[site.index][part].double())
                torch.testing.assert_close(now, expected, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(site.module.get_vector(part), before[site.index][part])
    for site in loop.sites:
        assert set(loop.history[-1]["train_loss"].get(site.name, {})) <= {"fit"}  # the mix phase trains nothing


def test_theta_zero_is_local_bit_for_bit():
    federation = two_group_federation(n_sites=4)
    l2gd = build_loop("l2gd", federation, seeded(BatchNormClassifier, 4, 2), {"mixing": 0.0}, participation=0.75)
    local = build_loop("local", federation, seeded(BatchNormClassifier, 4, 2), participation=0.75)
    l2gd.fit(3)
    local.fit(3)
    for key in ("metrics", "train_loss"):
        assert json.dumps([r[key] for r in l2gd.history]) == json.dumps([r[key] for r in local.history]), key
    for a, b in zip(l2gd.sites, local.sites):
        for part in PARTS:
            assert torch.equal(a.module.get_vector(part), b.module.get_vector(part))


def test_theta_one_is_fedavg_bit_for_bit_when_every_site_takes_part():
    federation = two_group_federation(n_sites=4)
    l2gd = build_loop("l2gd", federation, seeded(BatchNormClassifier, 4, 2), {"mixing": 1.0})
    fedavg = build_loop("fedavg", federation, seeded(BatchNormClassifier, 4, 2))
    l2gd.fit(3)
    fedavg.fit(3)
    for key in ("metrics", "train_loss"):
        assert json.dumps([r[key] for r in l2gd.history]) == json.dumps([r[key] for r in fedavg.history]), key
    for a, b in zip(l2gd.sites, fedavg.sites):
        for part in PARTS:
            assert torch.equal(a.module.get_vector(part), b.module.get_vector(part))


def test_theta_outside_zero_one_is_refused_by_name():
    with pytest.raises(ConfigError, match="strategy.l2gd.mixing"):
        build_loop("l2gd", two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2), {"mixing": 1.5})
