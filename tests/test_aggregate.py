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

