"""FedAvg: parameters and floating-point buffers are the sample-weighted averages of the sites' replies."""

import torch

from medfed.federated.link import Link
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, build_loop, seeded, two_group_federation


def one_round_recording_replies(name, n_sites=3):
    """Run round 1 of ``name`` on BatchNormClassifier sites.

    Returns the loop, each site's reply and each site's ``state_dict`` when
    it replied (its trained values), both by site index.
    """
    loop = build_loop(name, two_group_federation(n_sites=n_sites), seeded(BatchNormClassifier, 4, 2))
    replies, trained = {}, {}
    for site in loop.sites:
        site_reply = site.strategy.reply

        def recording_reply(view, ctx, site_reply=site_reply, site=site):
            replies[site.index] = {key: value.clone() for key, value in site_reply(view, ctx).items()}
            trained[site.index] = {key: value.clone() for key, value in site.module.state_dict().items()}
            return replies[site.index]

        site.strategy.reply = recording_reply
    loop.fit(1)
    return loop, replies, trained


def by_hand(replies, key, sites):
    """sum_i n_i v_i / sum_i n_i in float64, n_i = site i's training-set size."""
    n = {site.index: float(site.n_train) for site in sites}
    return sum(n[i] * replies[i][key].double() for i in replies) / sum(n.values())


def test_every_site_holds_the_weighted_average_of_parameters_and_batchnorm_statistics():
    loop, replies, _ = one_round_recording_replies("fedavg")
    assert set(replies[0]) == {"all", "buffers", "num_samples"}
    assert replies[0]["buffers"].numel() == 2 * 3  # running mean and variance of 3 features
    assert not torch.allclose(replies[0]["buffers"], replies[2]["buffers"])  # trained on different data
    for key in ("all", "buffers"):
        expected = by_hand(replies, key, loop.sites)
        for site in loop.sites:
            torch.testing.assert_close(site.module.get_vector(key).double(), expected, rtol=1e-6, atol=1e-7)
    running_var = loop.sites[1].module.norm.running_var
    torch.testing.assert_close(running_var.double(), by_hand(replies, "buffers", loop.sites)[3:])


def test_integer_buffers_stay_at_their_site():
    loop, _, _ = one_round_recording_replies("fedavg")
    # site s has 48 + 8 s samples: 3, 4 and 4 batches of 16, each one BatchNorm step
    assert [int(site.module.norm.num_batches_tracked) for site in loop.sites] == [3, 4, 4]


def test_buffers_travel_dense_and_the_parameters_through_the_codec():
    loop, replies, _ = one_round_recording_replies("fedavg")
    initial = {"all": torch.zeros_like(replies[0]["all"])}
    lossy = Link({"name": "stc", "sparsity": 0.05}, {"name": "dense"}, loop.strategy.coded_keys, initial, torch.device("cpu"))
    received = lossy.send("up", replies[0])
    assert torch.equal(received["buffers"], replies[0]["buffers"])  # exact: not a coded key
    assert not torch.equal(received["all"], replies[0]["all"])  # sparsified by the codec
