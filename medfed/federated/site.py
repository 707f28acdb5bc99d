"""One hospital site: its models, optimisers, data and randomness, kept across rounds.

A site is built once per run and never rebuilt: its model slots (each a
LightningModule with its optimiser state, e.g. Adam moments), its half of
the strategy and its data-loader RNG survive from round to round and go into
every checkpoint, so a resumed run continues exactly where the interrupted
one stopped. Everything else a site's work
draws at random (dropout, any augmentation: torch's, NumPy's and Python's
global generators) comes from :meth:`Site.global_rng`, seeded afresh from
the run's seed, the site and the round before each piece of work, so it
needs no state: two runs, or a run and its resumed twin, draw the same.

A training split of plain tensors that fits on the device is moved there
once, when the site is built, and each step's batch is cut from it on the
device by the indices the seeded shuffled loader draws (the loader runs over
the sample indices, so it draws exactly as it would over the samples: the
same batches in the same order). A split that draws fresh samples (random
crops) goes through its DataLoader. A training step never waits for the
device: the plan's losses are kept on it and read once, at the plan's end.

A site's strategy half sees it only through :attr:`Site.view`, a
:class:`~medfed.federated.protocol.SiteView`; the site counts the samples
it passes, per training plan, auxiliary pass and evaluation
(:mod:`medfed.federated.compute`).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from medfed.checkpoint import state_on_device
from medfed.data.federation import SiteData
from medfed.federated.compute import AUX, EVALUATION, FORWARD, PassCounter, batch_samples
from medfed.federated.privacy import SiteDP
from medfed.federated.protocol import Auxiliary, SiteHalfProtocol, SiteView
from medfed.models.base import FederatedModule

#: a training split is kept on a CUDA device when it takes at most this share of the device's free memory
RESIDENT_SHARE = 0.25


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
        #: the training split's tensors on the device (batches are cut from them there), or None: its DataLoader's batches
        self.resident = resident_tensors(data.train, fabric.device)
        self.generator = self._new_generator()
        #: the site's own data order: its shuffled loader (of the samples, or device-resident of their indices: :meth:`batches`)
        self.train_loader = self._shuffled_loader(self.generator)
        #: the data orders training plans name (``TrainingPlan.data_order``): {name: (generator, loader)}
        self.data_orders: dict[str, tuple[torch.Generator, DataLoader]] = {}
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
        self._rng_stream: tuple[int, ...] = ()  # the stream of the global_rng block in progress
        self._train_calls = 0  # training calls so far in that block (each seeds its own noise)

    def use_dp(self, privacy: SiteDP) -> None:
        """Make every later local step a DP-SGD step (:mod:`medfed.federated.privacy`)."""
        self.privacy = privacy

    def _new_generator(self) -> torch.Generator:
        """A data-order generator seeded from the run's seed and the site's index (every data order starts alike)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.index)

    def _shuffled_loader(self, generator: torch.Generator) -> DataLoader:
        """The training split in mini-batches, shuffled by ``generator`` (device-resident: the mini-batches of sample indices)."""
        train = self.data.train
        # A training set that draws fresh samples (random crops) brings its own sampler; it draws from the same generator.
        sampler = train.sampler(generator) if hasattr(train, "sampler") else RandomSampler(train, generator=generator)
        # Over range(n) the loader draws from the generator exactly as over the samples: the batches are their indices.
        samples = train if self.resident is None else range(len(train))
        return DataLoader(samples, batch_size=self.batch_size, sampler=sampler, generator=generator)

    def batches(self, steps: int, data_order: str | None = None) -> Iterator[Any]:
        """The device batches of ``steps`` training steps, drawn as :meth:`train` describes (whole passes, then a cut one).

        Run it out: after a whole pass's last batch the loader's sampler
        draws from the generator once more, as a plain epoch loop's does.
        """
        loader = self._loader(data_order)
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
            return self.fabric.to_device(drawn)
        indices = drawn.to(self.fabric.device, non_blocking=True)
        return [tensor[indices] for tensor in self.resident]  # a list, as the DataLoader collates a TensorDataset's samples

    def _loader(self, data_order: str | None) -> DataLoader:
        """The shuffled loader of the data order named ``data_order`` (``None``: the site's own), made at its first use."""
        if data_order is None:
            return self.train_loader
        if data_order not in self.data_orders:
            generator = self._new_generator()
            self.data_orders[data_order] = (generator, self._shuffled_loader(generator))
        return self.data_orders[data_order][1]

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

    @property
    def batches_per_epoch(self) -> int:
        """B: mini-batches in one pass over the training split (the last one may be smaller)."""
        return len(self.train_loader)

    def steps(self, epochs: float, after: float = 0.0) -> int:
        """Optimiser steps of ``epochs`` epochs that follow ``after`` epochs of the site's budget axis.

        The axis (the run's training budget, :attr:`budget_epochs`) is cut at whole steps::

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
            outer = self._rng_stream, self._train_calls
            self._rng_stream, self._train_calls = stream, 0
            try:
                yield
            finally:
                self._rng_stream, self._train_calls = outer
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
        also_steps: tuple[str, ...] = (),
        compute: str | None = None,
        data_pass: int = 1,
        auxiliary: dict[str, Auxiliary] | None = None,
    ) -> float | None:
        """Train ``part`` of the model in ``slot`` for ``steps`` optimiser steps (e.g. :meth:`steps` of some epochs).

        The batches come from fresh passes of the site's seeded shuffled
        loader, one after another; the pass in progress when the steps run
        out is dropped, so the next call starts a new pass (a new permutation).
        The generator state between calls is therefore all the data order
        depends on, and it is checkpointed: a resumed run draws the same
        batches. A whole number of epochs is that many complete passes.

        Args:
            steps: optimiser steps, >= 1.
            slot: the model slot trained (its own optimiser steps it).
            part: ``"all"``, ``"shared"`` or ``"personal"``.
            step_loss: maps a device batch to the scalar loss of one step.
            data_order: the data order the batches come from (``None``: the
                site's own; a name: that data order's generator, made at its
                first use and then kept and checkpointed like the site's own).
            also_steps: other slots whose optimisers step after ``slot``'s on
                every step, on the gradients the same loss gives them.
            compute: the key the plan's passes are counted under (None: not counted).
            data_pass: how many times each step's loss passes its batch
                forward and backward itself (counted per step; True: once,
                APFL: twice); 0 / False where the loss's passes are the
                half's own :meth:`View.step` calls.
            auxiliary: the strategy half's auxiliary parameters the steps
                train (``SiteHalf.auxiliary``): each step's loss is
                differentiated in them too, and after the optimisers they
                step by ``Auxiliary.step``; they are detached again at the end.

        The gradients are freed at the end (``set_to_none``): between rounds
        a site holds its model and optimiser state, not a gradient as well.

        With DP-SGD on (:meth:`use_dp`) each step's gradients of the trained
        slot and of ``also_steps`` are clipped per sample and noised before
        the optimisers step (:meth:`SiteDP.privatise`; the noise seeded from
        the global-RNG stream of the work and the call's rank in it), and a
        site whose privacy budget is spent trains no more (returns ``None``).

        Each step's loss is computed under the run's precision
        (``fabric.autocast``) and kept on the device; no step waits for it.
        The plan's losses are read once, at its end.

        Returns:
            Mean training loss over the steps, or ``None`` if nothing was
            trained (a part without parameters, e.g. the shared part of an
            all-personal logistic regression).

        Raises:
            FloatingPointError: a step's loss was not finite (read at the
                plan's end; the error names the site and the first such step).
        """
        module, optimizer = self.slot(slot).module, self.slot(slot).optimizer
        others = [self.slot(name).optimizer for name in also_steps]
        if module.parameter_split.size(part) == 0:
            return None
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        privacy = self.privacy
        self._train_calls += 1
        if privacy is not None and privacy.spent:
            privacy.note_spent()
            return None
        module.set_trainable(part)
        module.train()
        stepped = [module, *(self.slot(name).module for name in also_steps)]
        for other in stepped[1:]:
            other.train()
        parameters = [p for m in stepped for p in m.parameters() if p.requires_grad]
        noise = None if privacy is None else privacy.noise_generator(self.fabric.device, *self._rng_stream, self._train_calls)
        hooked = [] if privacy is None else privacy.attach(stepped)
        device = self.fabric.device
        losses = torch.empty(steps, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)  # read at the end
        done = 0
        self.plan_key = compute
        half, auxiliary = self.strategy, auxiliary or {}
        for name in auxiliary:  # differentiable leaves while the plan runs
            setattr(half, name, getattr(half, name).detach().requires_grad_(True))
        try:
            for batch in self.batches(steps, data_order):
                if privacy is not None and privacy.spent:  # host-side accounting: no wait for the device
                    privacy.note_spent()
                    break
                optimizer.zero_grad(set_to_none=True)
                for other in others:
                    other.zero_grad(set_to_none=True)
                with self.fabric.autocast():
                    loss = step_loss(batch)
                self.fabric.backward(loss)
                if privacy is not None:
                    privacy.privatise(parameters, noise)
                if compute is not None and data_pass:
                    self.passes.add(compute, data_pass * batch_samples(batch))
                optimizer.step()
                for other in others:
                    other.step()
                    other.zero_grad(set_to_none=True)
                for name, rule in auxiliary.items():
                    value = getattr(half, name)
                    if value.grad is not None:
                        setattr(half, name, rule.step(value, value.grad).requires_grad_(True))
                losses[done] = loss.detach()
                done += 1
        finally:
            self.plan_key = None
            for name in auxiliary:
                setattr(half, name, getattr(half, name).detach())
            if privacy is not None:
                privacy.detach(hooked)
        optimizer.zero_grad(set_to_none=True)
        module.set_trainable("all")
        return self._mean_loss(losses[:done]) if done else None

    def _mean_loss(self, losses: torch.Tensor) -> float:
        """The mean of a plan's step losses ``(steps,)`` float64, read from the device at once.

        Summed in step order in float64, as a running sum of each step's
        ``loss.item()`` would be.

        Raises:
            FloatingPointError: a loss is not finite (naming the site and the first such step).
        """
        values = losses.tolist()
        for step, value in enumerate(values, start=1):
            if not math.isfinite(value):
                raise FloatingPointError(
                    f"{self.name}: training loss became {value} at step {step} of {len(values)} (learning rate too high?)"
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
            "generator": self.generator.get_state(),
            "data_orders": {name: generator.get_state() for name, (generator, _) in self.data_orders.items()},
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
        self.generator.set_state(state["generator"])
        self.data_orders = {}  # a data order first used after ``state`` was taken starts afresh
        for name, generator_state in state["data_orders"].items():
            self._loader(name)
            self.data_orders[name][0].set_state(generator_state)
        self.budget_epochs = float(state.get("budget_epochs", 0.0))  # absent in checkpoints of medfed before the run-long axis
        self.strategy.load_state_dict(state_on_device(state["strategy"], self.fabric.device))
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])


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
