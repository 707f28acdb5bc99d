"""Data-space sketches: what a site reveals about its data to build the similarity network.

pFedNet links sites whose data look alike (paper section III-A: a KNN graph
over per-site "sketch matrices" in data space). medfed's sketch is a short
vector of aggregate statistics of the site's training split, computed at the
site; it reveals no individual sample:

* the mean and covariance of the per-position channel vectors (images: the
  C-vector of channel intensities at every pixel of every patch; tables: the
  feature vector of each row), i.e. C + C(C+1)/2 numbers;
* the class frequencies of the targets (pixel labels or sample labels).

A site missing an MRI sequence has a zero channel mean and variance; a site
with a different label ratio has different class frequencies; a different
scanner shifts the moments. All three are what the graph should capture.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def data_sketch(dataset: TensorDataset, num_classes: int) -> torch.Tensor:
    """Aggregate statistics of a site's ``(x, y)`` samples.

    Args:
        dataset: ``x`` of shape ``(n, C, *spatial)`` (images) or ``(n, C)``
            (tables); ``y`` integer class labels of shape ``(n, *spatial)``
            or ``(n,)``.
        num_classes: number of classes of ``y``.

    Returns:
        float64 vector ``[mean (C), upper-triangular covariance (C(C+1)/2),
        class frequencies (num_classes)]``.
    """
    x, y = dataset.tensors[0], dataset.tensors[1]
    channels = x.shape[1]
    vectors = x.to(torch.float64).movedim(1, -1).reshape(-1, channels)  # (n * positions, C)
    mean = vectors.mean(dim=0)
    centred = vectors - mean
    covariance = centred.T @ centred / max(vectors.shape[0] - 1, 1)
    rows, cols = torch.triu_indices(channels, channels)
    frequencies = torch.bincount(y.reshape(-1).long(), minlength=num_classes).to(torch.float64) / y.numel()
    return torch.cat([mean, covariance[rows, cols], frequencies])
