"""FedBN: everything but the BatchNorm layers is averaged; their parameters and statistics stay local."""

import torch

from medfed.federated.strategies import registered
from medfed.federated.strategies.fedavg import FedAvg
from test_fedavg import by_hand, one_round_recording_replies
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)

STRATEGIES = registered()

BATCHNORM = ("norm.weight", "norm.bias", "norm.running_mean", "norm.running_var")


def test_fedbn_is_registered_and_shares_fedavgs_code():
    assert STRATEGIES["fedbn"].__mro__[1] is FedAvg


def test_sites_share_everything_outside_batchnorm_and_keep_their_own_batchnorm():
    loop, replies, trained = one_round_recording_replies("fedbn")
    split = loop.sites[0].module.parameter_split
    assert set(split.batchnorm) == set(BATCHNORM) | {"norm.num_batches_tracked"}
    assert split.names("all_except_batchnorm") == ("hidden.weight", "hidden.bias", "output.weight", "output.bias")
    assert split.names("buffers_except_batchnorm") == ()
    expected = by_hand(replies, "all_except_batchnorm", loop.sites)
    for site in loop.sites:
        torch.testing.assert_close(site.module.get_vector("all_except_batchnorm").double(), expected, rtol=1e-6, atol=1e-7)
    for name in BATCHNORM:  # what each site trained, kept through the delivery, different at every site
        values = [site.module.state_dict()[name] for site in loop.sites]
        assert all(torch.equal(value, trained[i][name]) for i, value in enumerate(values)), name
        assert not torch.allclose(values[0], values[1]) and not torch.allclose(values[1], values[2]), name


def test_fedbn_sends_no_batchnorm_value():
    loop, replies, _ = one_round_recording_replies("fedbn")
    hidden, output = 3 * 4 + 3, 2 * 3 + 2
    assert replies[0]["all_except_batchnorm"].numel() == hidden + output
    assert replies[0]["buffers_except_batchnorm"].numel() == 0
    assert loop.links[0].dense_bytes["up"] == 4 * (hidden + output + 1)  # the vector and num_samples
