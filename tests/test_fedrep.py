"""FedRep: head plan then body plan of the configured lengths, each with the other part frozen; only bodies travel."""

import math

import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config
from medfed.models.tabular import LogisticRegression
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BodyHeadClassifier, build_loop, record_payloads, seeded, two_group_federation


def _record_training(loop):
    """Wrap every site's ``train``: the returned list fills with (round, site index, steps, part, body before,
    body after, head before, head after)."""
    calls = []
    for site in loop.sites:
        def train(steps, slot, part, step_loss, site=site, site_train=site.train, **kwargs):
            before = site.module.get_vector("shared"), site.module.get_vector("personal")
            loss = site_train(steps, slot, part, step_loss, **kwargs)
            after = site.module.get_vector("shared"), site.module.get_vector("personal")
            calls.append((loop.round, site.index, steps, part, before[0], after[0], before[1], after[1]))
            return loss

        site.train = train
    return calls


@pytest.mark.parametrize("options", [{"head_share": 1.5, "body_share": 0.5}, {"head_steps": 3, "body_steps": 2}])
def test_the_head_trains_first_then_the_body_for_the_configured_lengths(options):
    federation = two_group_federation(n_sites=3)
    loop = build_loop("fedrep", federation, seeded(BodyHeadClassifier, 4, 2), options, batch_size=16)
    calls = _record_training(loop)
    loop.fit(2)
    order = [(r, i, part) for r in (1, 2) for i in range(3) for part in ("head", "body")]
    assert [(r, i, part) for r, i, _, part, *_ in calls] == order
    for _, index, steps, part, *_ in calls:
        if "head_steps" in options:
            assert steps == (3 if part == "head" else 2)
        else:  # B = ceil(n / 16) batches; the head takes round(1.5 B) steps, the body the rest of round(2 B)
            batches = math.ceil(len(federation.sites[index].train) / 16)  # 3, 4, 4
            head = math.floor(1.5 * batches + 0.5)
            assert steps == (head if part == "head" else math.floor(2 * batches + 0.5) - head)


def test_the_body_is_frozen_while_the_head_trains_and_the_head_while_the_body_trains():
    loop = build_loop("fedrep", two_group_federation(n_sites=3), seeded(BodyHeadClassifier, 4, 2))
    calls = _record_training(loop)
    loop.fit(2)
    assert len(calls) == 2 * 3 * 2
    for _, _, _, part, body_before, body_after, head_before, head_after in calls:
        if part == "head":
            assert torch.equal(body_after, body_before) and not torch.equal(head_after, head_before)
        else:
            assert torch.equal(head_after, head_before) and not torch.equal(body_after, body_before)


def test_heads_never_travel_and_the_body_is_the_sample_weighted_mean():
    federation = two_group_federation(n_sites=4)
    loop = build_loop("fedrep", federation, seeded(BodyHeadClassifier, 4, 2))
    sent = record_payloads(loop)
    calls = _record_training(loop)
    loop.fit(2)
    split = loop.sites[0].module.parameter_split
    for _, direction, payload in sent:
        assert set(payload) <= ({"body", "num_samples"} if direction == "up" else {"body"})
        assert all(value.numel() in (0, 1, split.size("shared")) for value in payload.values())  # a head has 12 values
    replies = [payload for _, direction, payload in sent[-8:-4]]  # round 2: 4 messages down, 4 replies up, 4 deliveries
    assert all(set(payload) == {"body", "num_samples"} for payload in replies)
    trained = {index: body_after for round_index, index, _, part, _, body_after, _, _ in calls if round_index == 2 and part == "body"}
    sizes = torch.tensor([float(len(site.train)) for site in federation.sites])
    for index, payload in enumerate(replies):
        assert torch.equal(payload["body"], trained[index]) and float(payload["num_samples"]) == sizes[index]
    mean = sum(n * trained[i] for i, n in enumerate(sizes)) / sizes.sum()
    torch.testing.assert_close(loop.server.global_model, mean)
    heads = {index: head_after for round_index, index, _, part, _, _, _, head_after in calls if round_index == 2 and part == "head"}
    for site in loop.sites:
        torch.testing.assert_close(site.module.get_vector("shared"), mean)
        assert torch.equal(site.module.get_vector("personal"), heads[site.index])  # the delivery leaves the head alone


@pytest.mark.parametrize("options", [{}, {"preset": "published", "head_share": 1.0}])
def test_with_every_parameter_personal_fedrep_is_local_training_of_the_budget(options):
    """The equal preset gives the empty body's share to the head; the published one trains the head its own share."""
    federation = two_group_federation(n_sites=3)
    fedrep = build_loop("fedrep", federation, seeded(LogisticRegression, 4, 2), options)
    local = build_loop("local", federation, seeded(LogisticRegression, 4, 2))
    fedrep.fit(3)
    local.fit(3)
    for a, b in zip(fedrep.sites, local.sites):
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
    assert [r["metrics"] for r in fedrep.history] == [r["metrics"] for r in local.history]


def test_options_are_validated_with_the_key_named():
    equal = strategy_from_config({"name": "fedrep"})[1]
    published = strategy_from_config({"name": "fedrep", "fedrep": {"preset": "published"}})[1]
    assert (equal.head_share, equal.body_share) == (2 / 3, 1 / 3)  # the authors' 2:1, within the budget
    assert (published.head_share, published.body_share) == (2.0, 1.0)  # the authors' 10:5 epochs, as 2 E + E
    assert strategy_from_config({"name": "fedrep", "fedrep": {"preset": "published", "head_share": 1.0}})[1].head_share == 1.0
    with pytest.raises(ConfigError, match=r"^config key 'strategy\.fedrep\.preset' = 'paper': expected one of equal, published"):
        strategy_from_config({"name": "fedrep", "fedrep": {"preset": "paper"}})
    for key, value in (("head_share", 0.0), ("body_share", -1.0), ("head_steps", 0), ("body_steps", 0)):
        with pytest.raises(ConfigError, match=rf"^config key 'strategy\.fedrep\.{key}' = "):
            strategy_from_config({"name": "fedrep", "fedrep": {key: value}})
