"""Site sketches: the data-space kernel embedding estimates MMD, the feature space is Frobenius."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from medfed.errors import DataError
from medfed.federated.strategies.solvers.sketch import check_sketch_size, data_sketch, feature_sketch, observations


def _dataset(n, seed, shift=0.0, positive=0.3, channels=2):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, 3, 3, generator=generator) + shift
    y = (torch.rand(n, 3, 3, generator=generator) < positive).long()
    return TensorDataset(x, y)


def _exact_mmd(a: np.ndarray, b: np.ndarray, sigma: float) -> float:
    """Biased (V-statistic) MMD under exp(-||u - v||^2 / (2 sigma^2)), by brute force."""

    def mean_kernel(u, v):
        squared = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
        return np.exp(-squared / (2 * sigma**2)).mean()

    return math.sqrt(max(mean_kernel(a, a) + mean_kernel(b, b) - 2 * mean_kernel(a, b), 0.0))


def test_observations_pair_every_position_with_its_label():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # 2 samples, 3 channels, 2 positions
    y = torch.tensor([1, 0])  # one label per sample
    x_obs, y_obs = observations(TensorDataset(x, y), num_classes=2)
    assert x_obs.tolist() == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert y_obs.tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]]


def test_kernel_sketch_distance_estimates_the_exact_mmd():
    first, second = _dataset(12, 0), _dataset(12, 1, shift=0.7, positive=0.6)
    sigma = 2.0
    reference = _exact_mmd(
        torch.cat(observations(first, 2), 1).numpy(), torch.cat(observations(second, 2), 1).numpy(), sigma
    )
    options = dict(features=20_000, bandwidth=sigma, seed=5)
    estimate = float(torch.linalg.vector_norm(data_sketch(first, 2, **options) - data_sketch(second, 2, **options)))
    assert estimate == pytest.approx(reference, rel=0.05)


def test_sites_with_alike_data_are_closer_in_data_space():
    options = dict(features=512, bandwidth=None, seed=0)
    same = [data_sketch(_dataset(40, s), 2, **options) for s in (0, 1)]
    shifted = data_sketch(_dataset(40, 2, shift=1.0), 2, **options)
    imbalanced = data_sketch(_dataset(40, 3, positive=0.9), 2, **options)
    near = float(torch.linalg.vector_norm(same[0] - same[1]))
    assert near < float(torch.linalg.vector_norm(same[0] - shifted))
    assert near < float(torch.linalg.vector_norm(same[0] - imbalanced))


def test_every_site_draws_the_same_features_from_the_seed():
    data = _dataset(10, 0)
    options = dict(features=32, bandwidth=1.0)
    assert torch.equal(data_sketch(data, 2, seed=4, **options), data_sketch(data, 2, seed=4, **options))
    assert not torch.equal(data_sketch(data, 2, seed=4, **options), data_sketch(data, 2, seed=5, **options))


def test_feature_sketch_distance_is_the_frobenius_distance_of_covariances():
    first, second = _dataset(30, 0, channels=3), _dataset(30, 1, channels=3)

    def covariance(dataset):
        return np.cov(dataset.tensors[0].double().movedim(1, -1).reshape(-1, 3).numpy(), rowvar=False)

    expected = np.linalg.norm(covariance(first) - covariance(second), "fro")
    distance = float(torch.linalg.vector_norm(feature_sketch(first) - feature_sketch(second)))
    assert distance == pytest.approx(expected, rel=1e-7)


def test_a_missing_channel_moves_the_feature_sketch():
    data = _dataset(30, 0, channels=3)
    missing = TensorDataset(data.tensors[0].clone(), data.tensors[1])
    missing.tensors[0][:, 0] = 0.0
    sketch = feature_sketch(missing)
    assert sketch[0] == 0.0 and sketch[1] == 0.0 and sketch[2] == 0.0  # variance and covariances of channel 0
    assert float(torch.linalg.vector_norm(sketch - feature_sketch(data))) > 0.5


def test_sketch_size_guard_names_the_site():
    check_sketch_size(_dataset(16, 0), 16, "site1")
    with pytest.raises(DataError, match="^site2: only 3 training samples"):
        check_sketch_size(_dataset(3, 0), 16, "site2")
