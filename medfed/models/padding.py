"""Padded batches: which samples of a training step's batch are real, so that a padded sample changes nothing.

A compiled, graph-captured step (:mod:`medfed.federated.stacked`) runs every
step on tensors of one shape. The last batch of a pass is often smaller (a
site of 44 samples at batch 16: 16, 16, 12), so it is padded to the full
batch and the step is told which samples are real: inside :func:`real_samples`
a model's training loss is the mean over the real samples only::

    loss = sum_i m_i l_i / sum_i m_i,     m_i = 1 for a real sample, 0 for a padded one

where l_i is sample i's loss. For a loss that is a mean of per-sample terms
(plus terms of the parameters alone, e.g. a proximal term) this is the loss
of the unpadded batch, and a padded sample's gradient is exactly zero. A
model says it computes its loss this way with ``pads = True``
(:attr:`~medfed.models.base.FederatedModule.pads`) and :func:`sample_mean`
in its ``training_step``; outside :func:`real_samples` that ``training_step``
computes what it always did. A layer that mixes the samples of a batch
(BatchNorm's batch statistics) would let padded samples in, so a model with
one is never padded (:func:`can_pad`).

The mask is a tensor, so ``torch.func.vmap`` runs :func:`real_samples`
over a stack of sites (each its own mask) and ``torch.compile`` traces it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class _Mask:
    """The real-sample mask of the step in progress (``(B,)``), or None: every sample is real."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # an instance attribute from the start: a compiled step guards on it


_current = _Mask()


@contextmanager
def real_samples(mask: torch.Tensor) -> Iterator[None]:
    """Inside the block, :func:`sample_mean` averages over the samples ``mask`` ``(B,)`` (bool or 0/1) marks."""
    outer = _current.mask
    _current.mask = mask
    try:
        yield
    finally:
        _current.mask = outer


def padded() -> bool:
    """Whether a padded batch's mask is in effect (inside :func:`real_samples`)."""
    return _current.mask is not None


def sample_mean(losses: torch.Tensor) -> torch.Tensor:
    """The mean over the batch's real samples of ``losses`` ``(B, ...)`` (each sample's terms averaged first).

    Outside :func:`real_samples`: every sample is real. A batch with no real sample (a stacked row that takes
    no step) gives 0.
    """
    per_sample = losses.reshape(losses.shape[0], -1).mean(dim=1)
    mask = _current.mask
    if mask is None:
        return per_sample.mean()
    weights = mask.to(per_sample.dtype)
    return (per_sample * weights).sum() / weights.sum().clamp_min(1)


def can_pad(module: nn.Module) -> bool:
    """Whether ``module``'s training loss may be computed on a padded batch: it declares ``pads`` and has no
    layer that mixes a batch's samples (BatchNorm in training)."""
    return bool(getattr(module, "pads", False)) and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def pad_to(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` ``(b, ...)`` with its samples repeated in turn up to ``(size, ...)`` (a padded sample is a real
    one's copy: whatever the model computes of it is finite where the real sample's is)."""
    b = tensor.shape[0]
    if b == size:
        return tensor
    index = torch.arange(size, device=tensor.device) % b
    return tensor.index_select(0, index)
