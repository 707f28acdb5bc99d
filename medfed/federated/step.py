"""The step rule: what one local training step does, written once for every executor.

A step of a training plan, at one site or at a stack of rows (rows: sites of
one federation, or the same site in several runs; the rule cannot tell)::

    l, g = the step's loss and its gradients:                    StepOps.gradients
           zero the gradients of the stepped slots; l = half.loss(view, ctx, plan, batch) under the run's
           precision, dropout keyed by the step's key (medfed.models.dropout); g = dl/d(theta, a), theta the
           plan's part of its slot and every parameter of its also_steps slots, a the half's auxiliary parameters
    g <- g clipped per sample and noised                         StepOps.privatise (DP-SGD; else g)
    count data_pass x |batch| samples as the plan's passes       StepOps.count (host side: batch shapes only)
    theta <- the plan slot's optimiser step on g, then each also_steps slot's    StepOps.optimise
    a <- project(a - lr_a g_a) for every auxiliary parameter     StepOps.auxiliaries (Auxiliary.step)

:func:`step` is that rule. How each line is done is a :class:`StepOps`:
one site's modules, autograd, torch.optim and Opacus (:class:`SiteStep`,
which ``Site.train`` runs), or the rows' stacked tensors, ``torch.func`` and
functional optimisers
(:class:`medfed.federated.stacked_step.StackedStep`), whose ``step`` is a
function of tensors only: (state, batch, keys) -> (losses, state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch
from lightning.fabric import Fabric
from torch import nn

from medfed.federated.compute import PassCounter, batch_samples
from medfed.federated.protocol import Auxiliary, SiteHalfProtocol
from medfed.models.dropout import keyed

State = TypeVar("State")


class StepOps(Protocol[State]):
    """How each line of the rule (module docstring) is done; ``State`` is what the step reads and writes."""

    def gradients(self, state: State, batch: Any, key: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The step's loss (a scalar, or one per row) and its gradients in the trained and auxiliary parameters."""
        ...

    def privatise(self, gradients: Any) -> Any:
        """The gradients as DP-SGD releases them (clipped per sample, noised), or as they are."""
        ...

    def count(self, batch: Any) -> None:
        """Count the step's passes of ``batch`` under the plan's compute key."""
        ...

    def optimise(self, state: State, gradients: Any) -> State:
        """The plan slot's optimiser step, then each ``also_steps`` slot's."""
        ...

    def auxiliaries(self, state: State, gradients: Any) -> State:
        """Every auxiliary parameter stepped by its :class:`~medfed.federated.protocol.Auxiliary`, after the optimisers."""
        ...


def step(ops: StepOps[State], state: State, batch: Any, key: torch.Tensor) -> tuple[torch.Tensor, State]:
    """One local step by the rule (module docstring): the step's loss, kept on the device, and the state after it."""
    loss, gradients = ops.gradients(state, batch, key)
    gradients = ops.privatise(gradients)
    ops.count(batch)
    return loss, ops.auxiliaries(ops.optimise(state, gradients), gradients)


class Trainee(Protocol):
    """What a step at one site reads and writes of it (a :class:`~medfed.federated.site.Site`)."""

    fabric: Fabric
    strategy: SiteHalfProtocol
    privacy: Any  # medfed.federated.privacy.SiteDP, or None
    passes: PassCounter
    plan_key: str | None
    rng_stream: tuple[int, ...]
    train_calls: int

    def slot(self, name: str) -> Any:
        """The model slot ``name`` (its ``module`` and ``optimizer``)."""
        ...


class SiteStep:
    """The rule's lines at one site (``Site.train``): its modules, autograd, torch.optim, Opacus.

    The rule's state is the site itself (``None``): the slots' parameters and
    optimisers and the half's auxiliary attributes are stepped in place, the
    gradients live in ``.grad``.
    """

    def __init__(
        self, site: Trainee, slot: str, part: str, step_loss: Callable[[Any], torch.Tensor], also_steps: tuple[str, ...],
        compute: str | None, data_pass: int, auxiliary: dict[str, Auxiliary],
    ) -> None:
        self.site, self.part, self.step_loss = site, part, step_loss
        self.module, self.optimizer = site.slot(slot).module, site.slot(slot).optimizer
        self.others = [site.slot(name).optimizer for name in also_steps]
        self.stepped = [self.module, *(site.slot(name).module for name in also_steps)]
        self.compute, self.data_pass, self.auxiliary = compute, data_pass, auxiliary
        self.parameters: list[nn.Parameter] = []
        self.noise: torch.Generator | None = None

    @contextmanager
    def prepared(self) -> Iterator[None]:
        """Inside the block: only ``part`` of the slot trainable, the stepped modules in training mode, the plan's
        compute key on the site, DP hooks attached, the auxiliary parameters differentiable leaves. After it: hooks,
        key and leaves undone; then, where the steps ran through, the gradients freed and every parameter trainable."""
        site, half, privacy = self.site, self.site.strategy, self.site.privacy
        self.module.set_trainable(self.part)
        for module in self.stepped:
            module.train()
        self.parameters = [p for m in self.stepped for p in m.parameters() if p.requires_grad]
        self.noise = None if privacy is None else privacy.noise_generator(site.fabric.device, *site.rng_stream, site.train_calls)
        hooked = [] if privacy is None else privacy.attach(self.stepped)
        site.plan_key = self.compute
        for name in self.auxiliary:
            setattr(half, name, getattr(half, name).detach().requires_grad_(True))
        try:
            yield
        finally:
            site.plan_key = None
            for name in self.auxiliary:
                setattr(half, name, getattr(half, name).detach())
            if privacy is not None:
                privacy.detach(hooked)
        self.optimizer.zero_grad(set_to_none=True)
        self.module.set_trainable("all")

    def gradients(self, state: None, batch: Any, key: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        for optimizer in (self.optimizer, *self.others):
            optimizer.zero_grad(set_to_none=True)
        with self.site.fabric.autocast(), keyed(key):
            loss = self.step_loss(batch)
        self.site.fabric.backward(loss)
        return loss, None

    def privatise(self, gradients: None) -> None:
        if self.site.privacy is not None:
            self.site.privacy.privatise(self.parameters, self.noise)

    def count(self, batch: Any) -> None:
        if self.compute is not None and self.data_pass:
            self.site.passes.add(self.compute, self.data_pass * batch_samples(batch))

    def optimise(self, state: None, gradients: None) -> None:
        self.optimizer.step()
        for other in self.others:
            other.step()
            other.zero_grad(set_to_none=True)

    def auxiliaries(self, state: None, gradients: None) -> None:
        half = self.site.strategy
        for name, rule in self.auxiliary.items():
            value = getattr(half, name)
            if value.grad is not None:
                setattr(half, name, rule.step(value, value.grad).requires_grad_(True))
