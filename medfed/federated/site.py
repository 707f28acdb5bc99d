"""One hospital site: its model, optimiser, data and randomness, kept across rounds.

A site is built once per run and never rebuilt: its LightningModule, its
optimiser state (e.g. Adam moments) and its data-loader RNG survive from
round to round and go into every checkpoint, so a resumed run continues
exactly where the interrupted one stopped. Everything else a site's work
draws at random (dropout, any augmentation: torch's, NumPy's and Python's
global generators) comes from :meth:`Site.global_rng`, seeded afresh from
the run's seed, the site and the round before each piece of work, so it
needs no state: two runs, or a run and its resumed twin, draw the same.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, RandomSampler

from medfed.data.federation import SiteData
from medfed.models.base import FederatedModule


class Site:
    """A site of the federation, driven by the loop through Fabric.

    Args:
        index: 0-based position of the site in the federation.
        data: the site's train and test splits.
        module: the site's model (already moved/wrapped by ``fabric.setup``);
            it first sees ``data`` through ``prepare_for_site``.
        optimizer: its optimiser (wrapped by ``fabric.setup``).
        fabric: the run's Fabric (device placement, backward).
        batch_size: mini-batch size of local training and evaluation.
        seed: the run's seed: seeds the site's shuffling generator (offset
            by ``index``) and its :meth:`global_rng`.
    """

    def __init__(
        self,
        index: int,
        data: SiteData,
        module: FederatedModule,
        optimizer: torch.optim.Optimizer,
        fabric: Fabric,
        batch_size: int,
        seed: int,
    ) -> None:
        self.index = index
        self.name = data.name
        self.data = data
        self.module = module
        module.prepare_for_site(data)  # what the model takes from its own site, e.g. class weights
        self.optimizer = optimizer
        self.fabric = fabric
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        # A training set that draws fresh samples (random crops) brings its own sampler; it draws from the same generator.
        sampler = data.train.sampler(self.generator) if hasattr(data.train, "sampler") else RandomSampler(data.train, generator=self.generator)
        self.train_loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, generator=self.generator)
        self.test_loader = DataLoader(data.test, batch_size=batch_size * 4, shuffle=False)
        self.strategy_state: dict[str, Any] = {}

    @property
    def n_train(self) -> int:
        return len(self.data.train)

    @property
    def n_test(self) -> int:
        return len(self.data.test)

    @property
    def batches_per_epoch(self) -> int:
        """B: mini-batches in one pass over the training split (the last one may be smaller)."""
        return len(self.train_loader)

    def steps(self, epochs: float, after: float = 0.0) -> int:
        """Optimiser steps of ``epochs`` epochs that follow ``after`` epochs of the same round.

        A round's schedule is cut at whole steps::

            steps = max(1, [B (after + epochs)] - [B after]),   [x] = floor(x + 1/2)

        so phases that split a round's epochs between them take together the
        steps one phase with all of them would take (B = 7, two half epochs:
        4 + 3 steps, not 4 + 4), and a whole number of epochs is that many full
        passes.
        """
        if epochs <= 0 or after < 0:
            raise ValueError(f"epochs must be > 0 and after >= 0, got epochs={epochs}, after={after}")
        batches = self.batches_per_epoch
        return max(1, math.floor(batches * (after + epochs) + 0.5) - math.floor(batches * after + 0.5))

    @contextmanager
    def global_rng(self, *stream: int) -> Iterator[None]:
        """Inside the block, torch's (CPU and the site's device), NumPy's and Python's global generators
        are seeded from ``(run seed, site index, *stream)``; outside it they are as they were.

        The loop wraps a site's part of each phase in ``global_rng(round, phase)``.
        """
        seed = int(np.random.SeedSequence([self.seed, self.index, *stream]).generate_state(1)[0])
        device = self.fabric.device
        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)
            try:
                yield
            finally:
                np.random.set_state(numpy_state)
                random.setstate(python_state)

    def train(
        self, epochs: float, part: str | None, step_loss: Callable[[Any], torch.Tensor], after: float = 0.0
    ) -> float | None:
        """Train ``part`` of the module for ``epochs`` (possibly fractional) passes over the training split.

        The number of optimiser steps is :meth:`steps` ``(epochs, after)``.
        The batches come from fresh passes of the site's seeded shuffled
        loader, one after another; the pass in progress when the steps run
        out is dropped, so the next call starts a new pass (a new permutation).
        The generator state between calls is therefore all the data order
        depends on, and it is checkpointed: a resumed run draws the same
        batches. A whole number of epochs is that many complete passes.

        Args:
            epochs: local epochs, > 0 (e.g. 0.5: half the batches of one pass).
            part: ``"all"``, ``"shared"``, ``"personal"`` or ``None`` (no training).
            step_loss: maps a device batch to the scalar loss of one step.
            after: epochs the round trained before this call (its earlier
                phases), which fixes where this call's steps are cut.

        The gradients are freed at the end (``set_to_none``): between rounds
        a site holds its model and optimiser state, not a gradient as well.

        Returns:
            Mean training loss over the steps, or ``None`` if nothing was
            trained (no part, or a part without parameters, e.g. the shared
            part of an all-personal logistic regression).
        """
        if part is None or self.module.parameter_split.size(part) == 0:
            return None
        remaining = self.steps(epochs, after)
        self.module.set_trainable(part)
        self.module.train()
        total = 0.0
        steps = remaining
        while remaining > 0:
            # A fresh pass: whole when the steps cover it (run to its end, as a plain epoch loop
            # does: the sampler draws from the generator once more when it is exhausted),
            # otherwise only its first `remaining` batches, and the rest of it is dropped.
            whole = remaining >= self.batches_per_epoch
            for batch in self.train_loader if whole else itertools.islice(self.train_loader, remaining):
                batch = self.fabric.to_device(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss = step_loss(batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{self.name}: training loss became {loss.item()} (learning rate too high?)")
                self.fabric.backward(loss)
                self.optimizer.step()
                total += loss.item()
                remaining -= 1
        self.optimizer.zero_grad(set_to_none=True)
        self.module.set_trainable("all")
        return total / steps

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The module's metrics over the whole test split."""
        self.module.eval()
        for batch_index, batch in enumerate(self.test_loader):
            self.module.test_step(self.fabric.to_device(batch), batch_index)
        return self.module.test_results()

    def state_dict(self) -> dict[str, Any]:
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "strategy_state": self.strategy_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.strategy_state = state["strategy_state"]
