"""FedPer: only the base travels, the server holds its sample-weighted mean, heads stay personal."""

import torch

from medfed.models.tabular import LogisticRegression
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BodyHeadClassifier, build_loop, record_payloads, seeded, two_group_federation


def _replies(loop):
    """Wrap every site half's ``reply``: the returned dict maps (round, site index) to the reply as the site
    made it, with the site's head at that moment under ``"head"``."""
    replies = {}
    for site in loop.sites:
        def reply(site_, ctx, make=site.strategy.reply):
            payload = make(site_, ctx)
            replies[(loop.round, site_.index)] = {
                **{key: value.clone() for key, value in payload.items()},
                "head": site_.get("model", "personal"),
            }
            return payload

        site.strategy.reply = reply
    return replies


def test_only_the_base_travels_and_becomes_the_sample_weighted_mean_of_the_sites_bases():
    federation = two_group_federation(n_sites=4)
    loop = build_loop("fedper", federation, seeded(BodyHeadClassifier, 4, 2))
    split = loop.sites[0].module.parameter_split
    sent = record_payloads(loop)
    replies = _replies(loop)
    loop.fit(2)

    heads = {site.index: site.module.get_vector("personal") for site in loop.sites}
    for index, direction, payload in sent:
        assert set(payload) <= ({"body", "num_samples"} if direction == "up" else {"body"})
        assert all(value.numel() in (0, 1, split.size("shared")) for value in payload.values())  # no head (12 values)
        for value in payload.values():
            assert not any(value.numel() == head.numel() and torch.equal(value, head) for head in heads.values())
    assert split.size("shared") == 25 and split.size("personal") == 12

    sizes = torch.tensor([float(len(site.train)) for site in federation.sites])  # 48, 56, 64, 72
    for round_index in (1, 2):
        bases = torch.stack([replies[(round_index, i)]["body"] for i in range(4)])
        assert [float(replies[(round_index, i)]["num_samples"]) for i in range(4)] == sizes.tolist()
        assert not torch.allclose(bases[0], bases[3])  # the sites did train apart
        mean = (sizes[:, None] * bases).sum(0) / sizes.sum()
        if round_index == 2:
            torch.testing.assert_close(loop.server.global_model, mean)
    for site in loop.sites:
        torch.testing.assert_close(site.module.get_vector("shared"), mean)  # delivered: every site holds the mean base
        assert torch.equal(heads[site.index], replies[(2, site.index)]["head"])  # and the head it trained
    assert not torch.allclose(heads[0], heads[3])  # each head is its site's own


def test_heads_learn_what_a_shared_model_cannot():
    # Two groups with opposite label rules: FedAvg's one model is near chance (about 0.5),
    # a shared body under personal heads fits both.
    loop = build_loop("fedper", two_group_federation(n_sites=6), seeded(BodyHeadClassifier, 4, 2))
    loop.fit(10)
    assert loop.history[-1]["mean"]["accuracy"] > 0.9


def test_with_every_parameter_personal_fedper_is_local_training():
    # The clinical logistic regression is all personal: the base is empty and FedPer must be local training exactly.
    federation = two_group_federation(n_sites=3)
    runs = {name: build_loop(name, federation, seeded(LogisticRegression, 4, 2)) for name in ("fedper", "local")}
    sent = record_payloads(runs["fedper"])
    for loop in runs.values():
        loop.fit(3)
    assert runs["fedper"].sites[0].module.parameter_split.size("shared") == 0
    assert len(sent) == 3 * (2 + 3 * 3)  # per site: setup, delivery; then message, reply, delivery each round
    assert all(set(payload) <= {"body", "num_samples"} for _, _, payload in sent)
    assert all(payload["body"].numel() == 0 for _, _, payload in sent if "body" in payload)
    for a, b in zip(runs["fedper"].sites, runs["local"].sites):
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
    assert [r["metrics"] for r in runs["fedper"].history] == [r["metrics"] for r in runs["local"].history]
