"""The pooled (centralised) reference: every site's training data in one training set.

FLamby's "pooled" row trains one model on the union of the sites' training
sets, as if they were one hospital's, and evaluates it on each site's own
test split: the upper reference a federated method is measured against. It
breaks the federated rule *at the data level*, deliberately and only for a
strategy that declares ``pools_data`` (:class:`~medfed.federated.strategies.base.Strategy`):
:func:`pool_training_data` gives the site ``POOL_SITE`` the union of every
site's training split (site order), which it trains on; the other sites keep
their own splits, which nothing trains on, and are evaluated as usual.

The union is a :class:`torch.utils.data.ConcatDataset` (no copy of the
samples). A union of training sets that draw fresh samples
(:class:`~medfed.data.crops.RandomCrops`, BraTS ``random_crops``) draws them
too: :class:`PooledCrops` brings a sampler of the union's slots (one
permutation of all of them and a crop seed per slot each pass, from the pool
site's generator) and cuts each crop at the site the slot belongs to.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
from torch.utils.data import ConcatDataset, Dataset

from medfed.data.crops import CropSampler
from medfed.data.federation import SiteData

#: the site that holds the pooled training set (and so trains)
POOL_SITE = 0


class PooledSamples(ConcatDataset):
    """The union of fixed training sets; ``tensors`` is their tensors concatenated (built when read).

    Items are those of the parts, in site order; whatever reads a training
    split as a whole (e.g. balanced class weights from its labels) reads the
    union's ``tensors``.
    """

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.cat(columns) for columns in zip(*(part.tensors for part in self.datasets)))


class PooledCrops(PooledSamples):
    """The union of :class:`~medfed.data.crops.RandomCrops` training sets: fresh crops over all their slots.

    ``dataset[(slot, seed)]`` is the crop of the union's slot ``slot`` (the
    parts' slots one after another) for ``seed``; ``dataset[slot]`` its
    reference patch.
    """

    def sampler(self, generator: torch.Generator) -> CropSampler:
        """Per pass a permutation of all the union's slots and a crop seed for each, from ``generator``."""
        return CropSampler(len(self), generator)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(key, tuple):
            slot, seed = key
            part = bisect.bisect_right(self.cumulative_sizes, slot)
            first = self.cumulative_sizes[part - 1] if part else 0
            return self.datasets[part].crop(slot - first, seed)
        return super().__getitem__(key)


def pooled_training_set(parts: list[Dataset]) -> PooledSamples:
    """The union of the sites' training splits: :class:`PooledCrops` if they all draw fresh crops, else :class:`PooledSamples`."""
    draw_fresh = [hasattr(part, "sampler") for part in parts]
    if any(draw_fresh) and not all(draw_fresh):
        raise ValueError("cannot pool training sets of which only some draw fresh samples (random crops)")
    return PooledCrops(parts) if all(draw_fresh) else PooledSamples(parts)


def pool_training_data(sites: list[SiteData]) -> list[SiteData]:
    """The sites with site ``POOL_SITE``'s training split replaced by the union of all of theirs (the others unchanged)."""
    union = pooled_training_set([site.train for site in sites])
    return [dataclasses.replace(site, train=union) if index == POOL_SITE else site for index, site in enumerate(sites)]


def pooled_reference(sites: list[SiteData]) -> dict[str, object]:
    """What results.json records about a pooled run: that it is the centralised reference, and the pool."""
    return {
        "reference": (
            "POOLED (centralised) reference, not a federated method: one model trained on the union of every site's "
            "training data, evaluated on each site's own split"
        ),
        "pool_site": sites[POOL_SITE].name,
        "n_train": sum(len(site.train) for site in sites),
    }
