"""LG-FedAvg: only the head (the global model) travels and becomes the sample-weighted mean; each body stays local."""

import torch

from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BodyHeadClassifier, LinearClassifier, build_loop, record_payloads, seeded, two_group_federation


def _trained(loop):
    """Wrap every site half's ``reply``: the returned dict maps (round, site index) to the body and head the site
    trained that round, as it sends its reply."""
    trained = {}
    for site in loop.sites:
        def reply(view, ctx, make=site.strategy.reply):
            trained[(loop.round, view.index)] = (view.get("model", "body"), view.get("model", "head"))
            return make(view, ctx)

        site.strategy.reply = reply
    return trained


def test_only_the_head_travels_and_is_the_sample_weighted_mean_of_the_heads_the_sites_trained():
    federation = two_group_federation(n_sites=4)
    loop = build_loop("lgfedavg", federation, seeded(BodyHeadClassifier, 4, 2), participation=0.5)
    split = loop.sites[0].module.parameter_split
    assert split.size("body") == 25 and split.size("head") == 12  # body Linear(4, 5), head Linear(5, 2)
    sent = record_payloads(loop)
    trained = _trained(loop)
    bodies_before = {site.index: site.module.get_vector("body") for site in loop.sites}
    loop.fit(3)

    for _, direction, payload in sent:  # never a body: up the head and the count, down (the delivery) the head
        assert set(payload) <= ({"head", "num_samples"} if direction == "up" else {"head"})
        assert all(value.numel() in (1, 12) for value in payload.values())
    sizes = {i: float(len(site.train)) for i, site in enumerate(federation.sites)}  # 48, 56, 64, 72
    participants = loop.participants(3)
    assert len(participants) == 2
    heads = torch.stack([trained[(3, i)][1] for i in participants])
    weights = torch.tensor([sizes[i] for i in participants])
    mean = (weights[:, None] * heads).sum(0) / weights.sum()
    torch.testing.assert_close(loop.server.global_model, mean)
    for site in loop.sites:  # every site, participant or not, holds the global head, and its own body
        torch.testing.assert_close(site.module.get_vector("head"), mean)
        last = max((r for r, i in trained if i == site.index), default=None)
        body = bodies_before[site.index] if last is None else trained[(last, site.index)][0]
        assert torch.equal(site.module.get_vector("body"), body)
    bodies = [site.module.get_vector("body") for site in loop.sites]
    assert not torch.allclose(bodies[0], bodies[3])  # each body is its site's own


def test_a_participant_trains_its_body_and_the_head_together():
    loop = build_loop("lgfedavg", two_group_federation(n_sites=2), seeded(BodyHeadClassifier, 4, 2))
    trained = _trained(loop)
    loop.setup()
    before = [(site.module.get_vector("body"), site.module.get_vector("head")) for site in loop.sites]
    loop.fit(1)
    for site in loop.sites:
        body, head = trained[(1, site.index)]
        assert not torch.equal(body, before[site.index][0]) and not torch.equal(head, before[site.index][1])


def _all_head(seed: int = 0) -> LinearClassifier:
    """Softmax regression whose every parameter is the head (as the clinical logistic regression's)."""
    model = seeded(LinearClassifier, 4, 2, seed=seed)
    model.configure_split(personal_patterns=[".*"])
    return model


def test_on_a_model_that_is_all_head_it_is_fedavg_bit_for_bit():
    federation = two_group_federation(n_sites=4)
    runs = {name: build_loop(name, federation, _all_head(), participation=0.75) for name in ("lgfedavg", "fedavg")}
    for loop in runs.values():
        loop.fit(3)
    assert torch.equal(runs["lgfedavg"].server.global_model, runs["fedavg"].server.global_model)
    for lg, fedavg in zip(runs["lgfedavg"].history, runs["fedavg"].history, strict=True):
        assert lg["metrics"] == fedavg["metrics"] and lg["train_loss"] == fedavg["train_loss"] and lg["bytes"] == fedavg["bytes"]
