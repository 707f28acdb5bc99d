"""pFedNet's server side on hand-made replies (averaging, the network-lasso limits, delivery), and its phases' local steps."""

import pytest
import torch

from medfed.federated.strategies.pfednet import PFedNet
from medfed.models.split import ParameterSplit
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation

D1, D2, N = 6, 5, 4
SPLIT = ParameterSplit(shared=("a",), personal=("b",), numels={"a": D1, "b": D2})


def _strategy(lam, p="2", knn_k=1):
    strategy = PFedNet(PFedNet.Options(lam=lam, p=p, knn_k=knn_k), SPLIT, N, seed=0)
    # two groups of sites with distinct sketches: {0, 1} and {2, 3} differ in two statistics,
    # sites within a group in one (features are z-scored across sites before the KNN)
    sketches = {i: {"sketch": torch.tensor([float(i >= 2), float(i >= 2), float(i % 2)])} for i in range(N)}
    initial = {"shared": torch.zeros(D1), "personal": torch.zeros(D2), "all": torch.zeros(D1 + D2)}
    strategy.server_setup(initial, sketches)
    return strategy


def _personal_replies(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {i: {"personal": torch.randn(D2, generator=generator)} for i in range(N)}


def test_graph_links_sites_with_similar_sketches():
    assert _strategy(1.0).edges == [(0, 1), (2, 3)]


def test_shared_phase_is_the_sample_weighted_average():
    strategy = _strategy(1.0)
    replies = {i: {"shared": torch.full((D1,), float(i)), "num_samples": torch.tensor([float(i + 1)])} for i in range(N)}
    strategy.server_aggregate("shared", replies)
    # (1*0 + 2*1 + 3*2 + 4*3) / 10 = 2.0
    assert torch.allclose(strategy.shared, torch.full((D1,), 2.0))


def test_lambda_zero_keeps_every_sites_trained_personal_part():
    strategy = _strategy(0.0)
    replies = _personal_replies()
    strategy.server_aggregate("personal", replies)
    for i in range(N):
        assert torch.equal(strategy.personal[:, i], replies[i]["personal"])


@pytest.mark.parametrize("p", ["1", "2", "inf"])
def test_large_lambda_fuses_connected_sites_to_their_mean(p):
    strategy = _strategy(1e4, p=p)
    replies = _personal_replies()
    strategy.server_aggregate("personal", replies)
    for group in ([0, 1], [2, 3]):
        mean = torch.stack([replies[i]["personal"] for i in group]).mean(0)
        for i in group:
            assert torch.allclose(strategy.personal[:, i], mean, atol=1e-4)
    assert not torch.allclose(strategy.personal[:, 0], strategy.personal[:, 2], atol=1e-2)


def test_a_skipping_site_keeps_its_column_as_the_proximal_centre():
    strategy = _strategy(0.0)
    before = strategy.personal[:, 3].clone()
    replies = _personal_replies()
    del replies[3]
    strategy.server_aggregate("personal", replies)
    assert torch.equal(strategy.personal[:, 3], before)


def test_delivery_sends_the_shared_part_only_to_sites_that_lack_it():
    strategy = _strategy(0.5)
    strategy.server_aggregate("shared", {0: {"shared": torch.ones(D1), "num_samples": torch.tensor([1.0])}})
    strategy.server_message("personal", 0)  # site 0 receives x_{t+1} in the personal phase
    strategy.server_aggregate("personal", {0: {"personal": torch.ones(D2)}})
    assert set(strategy.server_deliver(0)) == {"personal"}
    assert set(strategy.server_deliver(1)) == {"personal", "shared"}
    assert torch.equal(strategy.server_deliver(1)["shared"], torch.ones(D1))


def test_server_state_round_trips():
    strategy = _strategy(0.5)
    strategy.server_aggregate("personal", _personal_replies())
    copy = PFedNet(PFedNet.Options(lam=0.5, knn_k=1), SPLIT, N, seed=0)
    copy.load_server_state_dict(strategy.server_state_dict())
    replies = _personal_replies(seed=1)
    strategy.server_aggregate("personal", replies)
    copy.server_aggregate("personal", replies)
    assert torch.equal(copy.personal, strategy.personal)


@pytest.mark.parametrize("full_epoch_per_phase", [False, True])
def test_phases_share_a_rounds_local_steps_unless_each_gets_a_full_epoch(full_epoch_per_phase):
    # site s has 48 + 8 s training samples: with batches of 16, site 1 has B = 4 batches, site 3 B = 5 and site 5 B = 6
    federation = two_group_federation(n_sites=6)
    loop = build_loop(
        "pfednet", federation, seeded(LinearClassifier, 4, 2), {"full_epoch_per_phase": full_epoch_per_phase}, batch_size=16
    )
    steps = {}
    site_loss = loop.strategy.site_loss

    def counting_loss(site, phase, batch):
        steps[(site.index, phase)] = steps.get((site.index, phase), 0) + 1
        return site_loss(site, phase, batch)

    loop.strategy.site_loss = counting_loss
    loop.fit(1)
    for site in loop.sites:
        batches = site.batches_per_epoch
        if full_epoch_per_phase:
            assert steps[(site.index, "shared")] == steps[(site.index, "personal")] == batches
        else:  # half each, the first half rounded up: together one epoch, as a FedAvg round
            assert steps[(site.index, "shared")] == (batches + 1) // 2
            assert steps[(site.index, "shared")] + steps[(site.index, "personal")] == batches
    assert {loop.sites[3].batches_per_epoch, loop.sites[5].batches_per_epoch} == {5, 6}
