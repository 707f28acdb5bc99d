import pytest
import torch

from medfed.federated.aggregate import weighted_average


def test_weighted_average_equals_hand_computation():
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0]), torch.tensor([0.0, 10.0])
    # (10*1 + 30*3 + 60*0) / 100 = 1.0 ; (10*2 + 30*-2 + 60*10) / 100 = 5.6
    result = weighted_average([a, b, c], [10, 30, 60])
    assert torch.allclose(result, torch.tensor([1.0, 5.6]))


def test_equal_weights_give_the_plain_mean():
    vectors = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    assert torch.allclose(weighted_average(vectors, [7, 7, 7, 7]), torch.stack(vectors).mean(0), atol=1e-6)


@pytest.mark.parametrize("weights", [[1, -1], [0, 0], [1]])
def test_bad_weights(weights):
    with pytest.raises(ValueError):
        weighted_average([torch.zeros(2), torch.ones(2)], weights)



# --- robust rules (issue 32): against numpy / scipy and a hand computation -----------------------------------------

def _draws(count, d=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=generator, dtype=torch.float64) for _ in range(count)]


@pytest.mark.parametrize("count", [1, 2, 5, 6])
def test_the_coordinate_median_is_numpys_median(count, monkeypatch):
    import numpy as np

    import medfed.federated.aggregate as aggregate
    from medfed.federated.aggregate import coordinate_median

    monkeypatch.setattr(aggregate, "CHUNK", 3)  # several chunks of the 7 coordinates
    vectors = _draws(count)
    expected = np.median(np.stack([v.numpy() for v in vectors]), axis=0)
    np.testing.assert_allclose(coordinate_median(vectors).numpy(), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("count, beta", [(5, 0.2), (6, 0.2), (10, 0.3), (4, 0.2), (3, 0.0)])
def test_the_trimmed_mean_is_scipys_trim_mean(count, beta, monkeypatch):
    import numpy as np
    from scipy import stats

    import medfed.federated.aggregate as aggregate
    from medfed.federated.aggregate import trimmed_mean

    monkeypatch.setattr(aggregate, "CHUNK", 4)
    vectors = _draws(count, seed=count)
    expected = stats.trim_mean(np.stack([v.numpy() for v in vectors]), beta, axis=0)  # drops int(beta * K) at each end
    np.testing.assert_allclose(trimmed_mean(vectors, beta).numpy(), expected, rtol=0, atol=1e-14)


def test_norm_bounding_scales_only_the_updates_over_the_bound_by_hand():
    from medfed.federated.aggregate import norm_bounded_mean

    g = torch.tensor([1.0, 1.0], dtype=torch.float64)
    x = [g + torch.tensor(u, dtype=torch.float64) for u in ([3.0, 4.0], [0.6, 0.8], [0.0, -30.0])]  # update norms 5, 1, 30
    # bound 2: updates (3,4)*2/5 = (1.2, 1.6); (0.6, 0.8) kept; (0,-30)*2/30 = (0, -2); weights 1, 2, 1
    expected = g + (torch.tensor([1.2, 1.6]) + 2 * torch.tensor([0.6, 0.8]) + torch.tensor([0.0, -2.0])).double() / 4
    torch.testing.assert_close(norm_bounded_mean(x, [1, 2, 1], g, 2.0), expected, rtol=0, atol=1e-7)
    # no bound given: the median norm, 5
    expected = g + (torch.tensor([3.0, 4.0]) + 2 * torch.tensor([0.6, 0.8]) + torch.tensor([0.0, -5.0])).double() / 4
    torch.testing.assert_close(norm_bounded_mean(x, [1, 2, 1], g, None), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_one_site_of_five_scaled_by_100_moves_a_robust_rule_at_most_the_honest_spread_and_the_mean_10_times_beyond(rule):
    # The stated bound (Yin et al. 2018): with 1 hostile site of 5 (trim 0.2 drops one value at each end), every coordinate
    # of the median or the trimmed mean lies between the honest sites' smallest and largest value, whatever it sends.
    from medfed.federated.aggregate import Aggregation

    generator = torch.Generator().manual_seed(3)
    g = torch.randn(1000, generator=generator)
    updates = [0.1 * torch.randn(1000, generator=generator) + 0.05 for _ in range(4)]
    replies = [g + update for update in [*updates, 100 * updates[0]]]
    honest = torch.stack(replies[:4])
    low, high = honest.min(dim=0).values, honest.max(dim=0).values
    robust = Aggregation(rule, trim=0.2)(replies, [1.0] * 5, g)
    assert bool(((robust >= low) & (robust <= high)).all())
    mean = Aggregation("mean")(replies, [1.0] * 5, g)
    spread = float((high - low).max())
    assert float((mean - honest.mean(dim=0)).abs().max()) > 10 * spread  # (100 - 1) / 5 of an update: far outside
    assert float(((mean < low) | (mean > high)).float().mean()) > 0.9  # outside the honest range almost everywhere


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_one_sign_flipped_site_of_five_costs_the_mean_two_fifths_of_the_honest_step_and_a_robust_rule_under_a_fifth(rule):
    # Sign-flipped and so norm-matched (norm bounding cannot see it). Honest updates that agree (noise 0.02 about a
    # step of 0.05): the flipped one pulls the mean back by (1 + 1) / 5 of the step; the robust rules by far less.
    # (Where the honest updates disagree as much as they agree, the median is as noisy as they are: no rule helps.)
    from medfed.federated.aggregate import Aggregation

    generator = torch.Generator().manual_seed(0)
    g = torch.randn(1000, generator=generator)
    updates = [0.02 * torch.randn(1000, generator=generator) + 0.05 for _ in range(4)]
    replies = [g + update for update in [*updates, -updates[0]]]
    step = torch.stack(updates).mean(dim=0)

    def off(rule):
        return float((Aggregation(rule, trim=0.2)(replies, [1.0] * 5, g) - g - step).norm() / step.norm())

    assert off(rule) < 0.2 and 0.35 < off("mean") < 0.45
