"""One hospital site: its models, optimisers, data and randomness, kept across rounds.

A site is built once per run and never rebuilt: its model slots (each a
LightningModule with its optimiser state, e.g. Adam moments), its half of
the strategy and its data orders (:mod:`medfed.federated.data_order`) survive
from round to round and go into every checkpoint, so a resumed run continues
exactly where the interrupted one stopped. Everything else a site's work
draws at random (dropout, any augmentation: torch's, NumPy's and Python's
global generators) comes from :meth:`Site.global_rng`, seeded afresh from
the run's seed, the site and the round before each piece of work, so it
needs no state: two runs, or a run and its resumed twin, draw the same.

The site trains by the step rule (:mod:`medfed.federated.step`, through
its :class:`~medfed.federated.step.SiteStep`); a training step never waits for the device: the plan's
losses are kept on it and read once, at the plan's end. A site's strategy
half sees it only through :attr:`Site.view`, a
:class:`~medfed.federated.protocol.SiteView`; the site counts the samples it
passes, per training plan, auxiliary pass and evaluation
(:mod:`medfed.federated.compute`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from medfed.checkpoint import state_on_device
from medfed.data.federation import SiteData
from medfed.federated.compute import AUX, EVALUATION, FORWARD, PassCounter, batch_samples
from medfed.federated.data_order import DataOrders
from medfed.federated.privacy import SiteDP
from medfed.federated.protocol import Auxiliary, SiteHalfProtocol, SiteView
from medfed.federated.step import SiteStep, step
from medfed.models.base import FederatedModule


@dataclass
class Slot:
    """One named model of a site: the module (wrapped by ``fabric.setup``) and its optimiser."""

    module: FederatedModule
    optimizer: torch.optim.Optimizer


class Site:
    """A site of the federation, driven by the loop through Fabric.

    Args:
        index: 0-based position of the site in the federation.
        data: the site's train and test splits.
        slots: the site's models by name (each already moved/wrapped by
            ``fabric.setup``); each first sees ``data`` through ``prepare_for_site``.
        evaluated_slot: the slot evaluated (and ``module``).
        strategy: the site's half of the strategy (its state is checkpointed with the site).
        fabric: the run's Fabric (device placement, backward).
        batch_size: mini-batch size of local training and evaluation.
        seed: the run's seed: seeds the site's shuffling generator (offset
            by ``index``) and its :meth:`global_rng`.
    """

    def __init__(
        self,
        index: int,
        data: SiteData,
        slots: dict[str, Slot],
        evaluated_slot: str,
        strategy: SiteHalfProtocol,
        fabric: Fabric,
        batch_size: int,
        seed: int,
    ) -> None:
        self.index = index
        self.name = data.name
        self.data = data
        if evaluated_slot not in slots:
            raise ValueError(f"evaluated slot {evaluated_slot!r} is not among the slots {sorted(slots)}")
        self.slots = slots
        self.evaluated_slot = evaluated_slot
        for slot in slots.values():
            slot.module.prepare_for_site(data)  # what the model takes from its own site, e.g. class weights
        self.strategy = strategy
        self.fabric = fabric
        self.seed = seed
        self.batch_size = batch_size
        #: the site's own data order and those its training plans name (``TrainingPlan.data_order``)
        self.orders = DataOrders(data.train, seed, index, batch_size, fabric.device, fabric.to_device)
        #: the epochs of the run's training budget this site's plans have taken so far (its *budget axis*, which
        #: :func:`~medfed.federated.executor.plan_length` cuts at whole steps and advances)
        self.budget_epochs = 0.0
        self.test_loader = DataLoader(data.test, batch_size=batch_size * 4, shuffle=False)
        #: samples passed since the executor last took the count (:mod:`medfed.federated.compute`)
        self.passes = PassCounter()
        #: the compute key of the training plan in progress (its steps' passes count under it), or None
        self.plan_key: str | None = None
        #: what the strategy half sees of the site
        self.view = View(self)
        #: DP-SGD of every local step (:meth:`use_dp`), or None
        self.privacy: SiteDP | None = None
        #: the stream of the global_rng block in progress, and the training calls so far in it (each seeds its DP noise)
        self.rng_stream: tuple[int, ...] = ()
        self.train_calls = 0

    def use_dp(self, privacy: SiteDP) -> None:
        """Make every later local step a DP-SGD step (:mod:`medfed.federated.privacy`)."""
        self.privacy = privacy

    def slot(self, name: str) -> Slot:
        """The model slot ``name``."""
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"{self.name} has no model slot {name!r} (it has {', '.join(self.slots)})") from None

    @property
    def module(self) -> FederatedModule:
        """The module of the evaluated slot: the model this site is evaluated with."""
        return self.slots[self.evaluated_slot].module

    @property
    def n_train(self) -> int:
        return len(self.data.train)

    @property
    def n_test(self) -> int:
        return len(self.data.test)

    def batches(self, steps: int, data_order: str | None = None) -> Iterator[Any]:
        """The device batches of ``steps`` steps from data order ``data_order`` (:meth:`DataOrders.batches`)."""
        return self.orders.batches(steps, data_order)

    @property
    def batches_per_epoch(self) -> int:
        """B: mini-batches in one pass over the training split (the last one may be smaller)."""
        return self.orders.batches_per_epoch

    def steps(self, epochs: float, after: float = 0.0) -> int:
        """Optimiser steps of ``epochs`` epochs after ``after`` epochs of the budget axis (:meth:`DataOrders.steps`)."""
        return self.orders.steps(epochs, after)

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
            outer = self.rng_stream, self.train_calls
            self.rng_stream, self.train_calls = stream, 0
            try:
                yield
            finally:
                self.rng_stream, self.train_calls = outer
                np.random.set_state(numpy_state)
                random.setstate(python_state)

    def train(
        self,
        steps: int,
        slot: str,
        part: str,
        step_loss: Callable[[Any], torch.Tensor],
        data_order: str | None = None,
        *,
        keys: torch.Tensor | None = None,
        also_steps: tuple[str, ...] = (),
        compute: str | None = None,
        data_pass: int = 1,
        auxiliary: dict[str, Auxiliary] | None = None,
    ) -> float | None:
        """Train ``part`` of the model in ``slot`` for ``steps`` steps of the step rule (:mod:`medfed.federated.step`).

        Args:
            steps: optimiser steps, >= 1 (e.g. :meth:`steps` of some epochs).
            slot: the model slot trained (its own optimiser steps it).
            part: a trainable part (``"all"``, ``"shared"``, ``"personal"``, ``"body"``, ``"head"``).
            step_loss: maps a device batch to the scalar loss of one step.
            data_order: the data order the batches come from (None: the site's own).
            keys: the steps' dropout keys, ``(steps,)`` int64 (:mod:`medfed.models.dropout`); None: unkeyed.
            also_steps: other slots whose optimisers step after ``slot``'s on
                every step, on the gradients the same loss gives them.
            compute: the key the plan's passes are counted under (None: not counted).
            data_pass: how many times each step's loss passes its batch
                forward and backward itself (counted per step; APFL: twice);
                0 where the loss's passes are the half's own :meth:`View.step` calls.
            auxiliary: the strategy half's auxiliary parameters the steps
                train (``SiteHalf.auxiliary``), stepped after the optimisers.

        With DP-SGD on (:meth:`use_dp`) each step's gradients are clipped per
        sample and noised, the noise seeded from the global-RNG stream of the
        work and the call's rank in it, and a site whose privacy budget is
        spent trains no more. The gradients are freed at the end.

        Returns:
            Mean training loss over the steps, or ``None`` if nothing was
            trained (a part without parameters, e.g. the shared part of an
            all-personal logistic regression, or a spent privacy budget).

        Raises:
            FloatingPointError: a step's loss was not finite (read at the
                plan's end; the error names the site and the first such step).
        """
        if self.slot(slot).module.parameter_split.size(part) == 0:
            return None
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        privacy = self.privacy
        self.train_calls += 1
        if privacy is not None and privacy.spent:
            privacy.note_spent()
            return None
        ops = SiteStep(self, slot, part, step_loss, also_steps, compute, data_pass, auxiliary or {})
        device = self.fabric.device
        losses = torch.empty(steps, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)  # read at the end
        done = 0
        with ops.prepared():
            for batch in self.batches(steps, data_order):
                if privacy is not None and privacy.spent:  # host-side accounting: no wait for the device
                    privacy.note_spent()
                    break
                loss, _ = step(ops, None, batch, None if keys is None else keys[done])
                losses[done] = loss.detach()
                done += 1
        return self._mean_loss(losses[:done]) if done else None

    def _mean_loss(self, losses: torch.Tensor) -> float:
        """The mean of a plan's step losses ``(steps,)`` float64, read from the device at once.

        Summed in step order in float64, as a running sum of each step's
        ``loss.item()`` would be.

        Raises:
            FloatingPointError: a loss is not finite (naming the site and the first such step).
        """
        values = losses.tolist()
        for number, value in enumerate(values, start=1):
            if not math.isfinite(value):
                raise FloatingPointError(
                    f"{self.name}: training loss became {value} at step {number} of {len(values)} (learning rate too high?)"
                )
        total = 0.0
        for value in values:  # a running sum (not sum(): Python 3.12's compensates), as the steps' losses came
            total += value
        return total / len(values)

    @torch.no_grad()
    def evaluate(self, loader: DataLoader | None = None) -> dict[str, float]:
        """The evaluated slot's metrics over the whole test split (or over ``loader``), in the run's precision.

        The round's evaluation (no ``loader``) is counted as ``evaluation`` passes.
        """
        self.module.eval()
        for batch_index, batch in enumerate(self.test_loader if loader is None else loader):
            with self.fabric.autocast():
                self.module.test_step(self.fabric.to_device(batch), batch_index)
            if loader is None:
                self.passes.add(EVALUATION, batch_samples(batch))
        return self.module.test_results()

    def state_dict(self) -> dict[str, Any]:
        """Every slot's module and optimiser state, the data-order generators and the strategy half's state."""
        return {
            "slots": {name: {"module": s.module.state_dict(), "optimizer": s.optimizer.state_dict()} for name, s in self.slots.items()},
            **self.orders.state_dict(),
            "budget_epochs": self.budget_epochs,
            "strategy": self.strategy.state_dict(),
            **({"privacy": self.privacy.state_dict()} if self.privacy is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["slots"]) != set(self.slots):
            raise ValueError(f"{self.name}: the state holds the model slots {sorted(state['slots'])}, the site {sorted(self.slots)}")
        for name, slot in self.slots.items():
            slot.module.load_state_dict(state["slots"][name]["module"])
            slot.optimizer.load_state_dict(state["slots"][name]["optimizer"])
        self.orders.load_state_dict(state)
        self.budget_epochs = float(state.get("budget_epochs", 0.0))  # absent in checkpoints of medfed before the run-long axis
        self.strategy.load_state_dict(state_on_device(state["strategy"], self.fabric.device))
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])


class View(SiteView):
    """The :class:`~medfed.federated.protocol.SiteView` of a :class:`Site`: all its strategy half sees of it."""

    def __init__(self, site: Site) -> None:
        self._site = site
        self.index = site.index
        self.name = site.name
        self.data = site.data

    @property
    def n_train(self) -> int:
        return self._site.n_train

    @property
    def n_test(self) -> int:
        return self._site.n_test

    @property
    def batch_size(self) -> int:
        return self._site.batch_size

    @property
    def eval_batch_size(self) -> int:
        return self._site.test_loader.batch_size

    def module(self, slot: str) -> FederatedModule:
        return self._site.slot(slot).module

    def get(self, slot: str, part: str) -> torch.Tensor:
        return self._site.slot(slot).module.get_vector(part)

    def set(self, slot: str, part: str, vector: torch.Tensor) -> None:
        self._site.slot(slot).module.set_vector(part, vector)

    def learning_rate(self, slot: str) -> float:
        return self._site.slot(slot).optimizer.param_groups[0]["lr"]

    def step(
        self,
        slot: str,
        loss: torch.Tensor,
        batch: Any,
        optimizer: torch.optim.Optimizer | None = None,
        stop_if: Callable[[], bool] | None = None,
    ) -> bool:
        site = self._site
        if site.privacy is not None:  # refused before the run for the strategies that step here (docs/privacy.md)
            raise RuntimeError(f"{site.name}: a strategy half's own steps (SiteView.step) are not DP-SGD steps")
        optimizer = site.slot(slot).optimizer if optimizer is None else optimizer
        optimizer.zero_grad(set_to_none=True)
        site.fabric.backward(loss)
        site.passes.add(site.plan_key or f"{AUX}/step", batch_samples(batch))
        stepped = stop_if is None or not stop_if()
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def full_pass(self, split: str, name: str, backward: bool, batch_size: int | None = None) -> Iterator[tuple[Any, int]]:
        site = self._site
        data = split_of(site.data, split)
        size = site.batch_size if batch_size is None else batch_size
        key = f"{AUX if backward else FORWARD}/{name}"
        # its own generator: a loader draws a seed from it when it starts, which must not move the global one
        for batch in DataLoader(data, batch_size=size, shuffle=False, generator=torch.Generator()):
            samples = batch_samples(batch)
            site.passes.add(key, samples)
            yield site.fabric.to_device(batch), samples

    def global_rng(self, *stream: int) -> Any:
        return self._site.global_rng(*stream)


def split_of(data: SiteData, split: str) -> Dataset:
    """``data``'s split named ``split`` (``"train"``, ``"test"`` or ``"validation"``)."""
    if split not in ("train", "test", "validation") or getattr(data, split) is None:
        raise ValueError(f"{data.name} has no {split!r} split")
    return getattr(data, split)
