"""A site's data orders: its training split in seeded, shuffled mini-batches, cut into steps.

A data order is a generator seeded from the run's seed and the site and a
loader that shuffles the training split with it. Steps take fresh passes of
the loader one after another; the pass in progress when the steps run out is
dropped, so the next call starts a new pass (a new permutation), and the
generator's state between calls is all a data order depends on (it is
checkpointed: a resumed run draws the same batches). A training plan may
name a data order of its own (``TrainingPlan.data_order``), seeded as the
site's is and continued only by the plans naming it.

A training split of plain tensors that fits on the device is moved there
once, and each step's batch is cut from it on the device by the indices the
loader draws (the loader runs over the sample indices, so it draws exactly
as it would over the samples: the same batches in the same order). A split
that draws fresh samples (random crops) goes through its DataLoader.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

#: a training split is kept on a CUDA device when it takes at most this share of the device's free memory
RESIDENT_SHARE = 0.25


class DataOrders:
    """The site's own data order and the named ones its training plans ask for.

    Args:
        train: the site's training split.
        seed, index: the run's seed and the site's index (every data order's generator starts from them).
        batch_size: the mini-batch size.
        device: where batches are placed.
        to_device: moves a batch its DataLoader drew to ``device`` (Fabric's ``to_device``).

    Attributes:
        resident: the split's tensors on the device (batches are cut from them there), or None: the DataLoader's batches.
        generator: the site's own data order's generator; ``train_loader`` its loader.
        named: the named data orders, ``{name: (generator, loader)}``, each made at its first use.
    """

    def __init__(
        self, train: Dataset, seed: int, index: int, batch_size: int, device: torch.device, to_device: Callable[[Any], Any]
    ) -> None:
        self.train, self.seed, self.index, self.batch_size = train, seed, index, batch_size
        self.device, self.to_device = device, to_device
        self.resident = resident_tensors(train, device)
        self.generator = self._new_generator()
        self.train_loader = self._shuffled_loader(self.generator)
        self.named: dict[str, tuple[torch.Generator, DataLoader]] = {}

    def _new_generator(self) -> torch.Generator:
        """A data-order generator seeded from the run's seed and the site's index (every data order starts alike)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.index)

    def _shuffled_loader(self, generator: torch.Generator) -> DataLoader:
        """The training split in mini-batches, shuffled by ``generator`` (device-resident: the mini-batches of sample indices)."""
        train = self.train
        # A training set that draws fresh samples (random crops) brings its own sampler; it draws from the same generator.
        sampler = train.sampler(generator) if hasattr(train, "sampler") else RandomSampler(train, generator=generator)
        # Over range(n) the loader draws from the generator exactly as over the samples: the batches are their indices.
        samples = train if self.resident is None else range(len(train))
        return DataLoader(samples, batch_size=self.batch_size, sampler=sampler, generator=generator)

    def batches(self, steps: int, name: str | None = None) -> Iterator[Any]:
        """The device batches of ``steps`` training steps from data order ``name`` (None: the site's own): whole
        passes, then the first batches of a fresh one.

        Run it out: after a whole pass's last batch the loader's sampler
        draws from the generator once more, as a plain epoch loop's does.
        """
        loader = self.loader(name)
        remaining = steps
        while remaining > 0:
            # A fresh pass: whole when the steps cover it, otherwise only its first `remaining` batches (the rest dropped).
            whole = remaining >= self.batches_per_epoch
            for drawn in loader if whole else itertools.islice(loader, remaining):
                yield self._device_batch(drawn)
                remaining -= 1

    def _device_batch(self, drawn: Any) -> Any:
        """What the shuffled loader drew as a batch on the device: the samples cut from the resident split, or moved there."""
        if self.resident is None:
            return self.to_device(drawn)
        indices = drawn.to(self.device, non_blocking=True)
        return [tensor[indices] for tensor in self.resident]  # a list, as the DataLoader collates a TensorDataset's samples

    def loader(self, name: str | None) -> DataLoader:
        """The shuffled loader of the data order named ``name`` (``None``: the site's own), made at its first use."""
        if name is None:
            return self.train_loader
        if name not in self.named:
            generator = self._new_generator()
            self.named[name] = (generator, self._shuffled_loader(generator))
        return self.named[name][1]

    @property
    def batches_per_epoch(self) -> int:
        """B: mini-batches in one pass over the training split (the last one may be smaller)."""
        return len(self.train_loader)

    def steps(self, epochs: float, after: float = 0.0) -> int:
        """Optimiser steps of ``epochs`` epochs that follow ``after`` epochs of the site's budget axis.

        The axis (the run's training budget, ``Site.budget_epochs``) is cut at whole steps::

            steps = max(1, [B (after + epochs)] - [B after]),   [x] = floor(x + 1/2)

        so plans that split a round's epochs between them take together the
        steps one plan with all of them would take (B = 7, two half epochs:
        4 + 3 steps, not 4 + 4), a whole number of epochs is that many full
        passes, and half an epoch a round at B = 5 is 3, 2, 3, 2, ... steps.
        """
        if epochs <= 0 or after < 0:
            raise ValueError(f"epochs must be > 0 and after >= 0, got epochs={epochs}, after={after}")
        batches = self.batches_per_epoch
        return max(1, math.floor(batches * (after + epochs) + 0.5) - math.floor(batches * after + 0.5))

    def state_dict(self) -> dict[str, Any]:
        """The generators' states: the site's own (``generator``) and each named one's (``data_orders``)."""
        return {
            "generator": self.generator.get_state(),
            "data_orders": {name: generator.get_state() for name, (generator, _) in self.named.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to :meth:`state_dict`'s; a named data order first used after it was taken starts afresh."""
        self.generator.set_state(state["generator"])
        self.named = {name: order for name, order in self.named.items() if name in state["data_orders"]}
        for name, generator_state in state["data_orders"].items():
            self.loader(name)
            self.named[name][0].set_state(generator_state)


def resident_tensors(train: Any, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a training split kept on ``device`` for the run, or None where its DataLoader serves it.

    A split of plain tensors (a ``TensorDataset`` without its own sampler) is
    kept: on the CPU as it is (no copy), on a CUDA device when it takes at
    most :data:`RESIDENT_SHARE` of the device's free memory. A split that
    draws fresh samples (random crops bring their own sampler), any other
    dataset and any other device keep the DataLoader.
    """
    if not isinstance(train, TensorDataset) or hasattr(train, "sampler"):
        return None
    if device.type == "cpu":
        return tuple(train.tensors)
    if device.type != "cuda":
        return None
    size = sum(tensor.numel() * tensor.element_size() for tensor in train.tensors)
    free, _ = torch.cuda.mem_get_info(device)
    return tuple(tensor.to(device) for tensor in train.tensors) if size <= RESIDENT_SHARE * free else None
