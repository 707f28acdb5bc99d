"""Site sketches: what a site reveals about its data to build the similarity network.

pFedNet's draft (``pfednet-fast-training-framework-draft.md``, section IV-A)
measures how alike two sites' data distributions are in one of three spaces;
the two that need something from the site's data are computed here, at the
site, from its training split, and reveal no individual sample:

* **data space** (:func:`data_sketch`): a kernel mean embedding. Each
  observation is the vector ``v = [x, onehot(y)]`` of one position (images:
  the C channel intensities of one pixel with that pixel's label, or the
  sample's label for classification; tables: one row and its label). With
  random Fourier features ``phi(v) = sqrt(2/D) cos(W v + b)``, ``W ~
  N(0, I / sigma^2)``, ``b ~ U[0, 2 pi)`` (Rahimi & Recht 2007), the sketch
  is the site's mean ``mu = E[phi(v)]`` and ``||mu_i - mu_j||`` estimates the
  maximum mean discrepancy between the two sites' joint distributions of
  ``(x, y)`` under the Gaussian kernel ``exp(-||v - v'||^2 / (2 sigma^2))``
  (Gretton et al. 2012). Every site draws the same ``W, b`` from the run's
  seed.
* **feature space** (:func:`feature_sketch`): the ``C x C`` covariance of the
  observation vectors ``x``, flattened so that the Euclidean distance between
  two sketches is the Frobenius distance between the covariance matrices.

(The third, **model space**, needs no sketch: the server measures distances
between the sites' locally trained personal parameters, which it receives
anyway.)

A site missing an MRI sequence has a zero channel; a site with a different
label ratio has different label frequencies; a different scanner shifts the
intensities. All three move the sketches.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

from medfed.errors import DataError

#: Observations embedded per chunk (bounds the (chunk, D) feature matrix).
_CHUNK = 65_536


def observations(dataset: TensorDataset, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position observation vectors of a site's ``(x, y)`` samples.

    Args:
        dataset: ``x`` of shape ``(n, C, *spatial)`` (images) or ``(n, C)``
            (tables); ``y`` integer class labels of shape ``(n, *spatial)``
            (segmentation) or ``(n,)`` (one label per sample), or
            ``(n, K, *spatial)`` 0/1 masks of K overlapping labels (e.g. the
            BraTS regions WT, TC, ET).
        num_classes: number of classes of ``y`` (K for masks).

    Returns:
        ``(x_obs, y_obs)``: float64 ``(P, C)`` channel vectors and float64
        ``(P, num_classes)`` one-hot labels (the masks themselves for
        ``(n, K, *spatial)`` targets), ``P`` = samples x positions.
    """
    x, y = dataset.tensors[0], dataset.tensors[1]
    x_obs = channel_vectors(x)
    if y.dim() == x.dim():  # (n, K, *spatial) masks: each position carries its K indicators
        return x_obs, channel_vectors(y)
    labels = y.long()
    if labels.dim() == 1 and x.dim() > 2:  # one label per image: every position carries it
        labels = labels.reshape(-1, *([1] * (x.dim() - 2))).expand(-1, *x.shape[2:])
    y_obs = torch.nn.functional.one_hot(labels.reshape(-1), num_classes).to(torch.float64)
    return x_obs, y_obs


def channel_vectors(x: torch.Tensor) -> torch.Tensor:
    """``(n, C, *spatial)`` or ``(n, C)`` -> float64 ``(P, C)``: one channel vector per position."""
    return x.to(torch.float64).movedim(1, -1).reshape(-1, x.shape[1])


def check_sketch_size(dataset: TensorDataset, minimum: int, site: str) -> None:
    """Refuse a sketch from fewer than ``minimum`` samples (its statistics would be noise).

    Raises:
        DataError: naming the site, the count and the option.
    """
    n = len(dataset)
    if n < minimum:
        raise DataError(
            f"{site}: only {n} training samples for its similarity sketch; "
            f"strategy.pfednet.min_sketch_samples = {minimum} (lower it, or use graph_space=model)"
        )


def data_sketch(
    dataset: TensorDataset, num_classes: int, *, features: int, bandwidth: float | None, seed: int
) -> torch.Tensor:
    """Mean random-Fourier-feature embedding of the observations ``[x, onehot(y)]``.

    Args:
        dataset, num_classes: as :func:`observations`.
        features: number ``D`` of random features (the sketch's length).
        bandwidth: kernel width ``sigma``; ``None`` uses ``sqrt(C + K)``, the
            typical distance between observations of unit-variance features.
        seed: seeds ``W`` and ``b``; equal at every site (the run's seed).

    Returns:
        float64 ``(D,)`` vector ``mean_v phi(v)``.
    """
    x_obs, y_obs = observations(dataset, num_classes)
    dim = x_obs.shape[1] + y_obs.shape[1]
    sigma = math.sqrt(dim) if bandwidth is None else float(bandwidth)
    # Drawn on the CPU (the same numbers on every site's hardware), then moved to the data.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    frequencies = torch.randn(dim, features, generator=generator, dtype=torch.float64, device="cpu").to(x_obs.device) / sigma
    phases = 2 * math.pi * torch.rand(features, generator=generator, dtype=torch.float64, device="cpu").to(x_obs.device)
    total = torch.zeros(features, dtype=torch.float64, device=x_obs.device)
    for start in range(0, x_obs.shape[0], _CHUNK):
        v = torch.cat([x_obs[start : start + _CHUNK], y_obs[start : start + _CHUNK]], dim=1)
        total += torch.cos(v @ frequencies + phases).sum(dim=0)
    return math.sqrt(2.0 / features) * total / x_obs.shape[0]


def feature_sketch(dataset: TensorDataset) -> torch.Tensor:
    """The covariance of the channel vectors, flattened for Frobenius distances.

    Returns:
        float64 ``(C (C + 1) / 2,)``: the upper triangle of the ``C x C``
        covariance ``S``, off-diagonal entries times ``sqrt(2)``, so that
        ``||sketch_i - sketch_j||_2 = ||S_i - S_j||_F``.
    """
    x_obs = channel_vectors(dataset.tensors[0])
    centred = x_obs - x_obs.mean(dim=0)
    covariance = centred.T @ centred / max(x_obs.shape[0] - 1, 1)
    channels = covariance.shape[0]
    rows, cols = torch.triu_indices(channels, channels)
    scale = torch.where(rows == cols, 1.0, math.sqrt(2.0)).to(torch.float64)
    return covariance[rows, cols] * scale
