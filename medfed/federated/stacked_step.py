"""The stacked step: one step of the rule (:mod:`medfed.federated.step`) for S rows at once, a function of tensors.

:class:`StackedState` holds everything a step reads and writes, each tensor
with the rows first (trained parameters flat per optimiser group ``(S, D)``,
optimiser state, per-row hyper-parameters, frozen parameters, buffers, the
half's declared loss state and auxiliary parameters); :class:`StackedStep`
does the rule's lines on it: the rows' gradients by
``vmap(grad_and_value(f))`` over :func:`functional_loss` (the template site's
half's loss, its slot modules under one root, :class:`Slots`, with the row's
tensors swapped in), the functional optimisers
(:mod:`medfed.federated.stacked_optimizers`), the auxiliary steps. A step
state in, a step state out: the batched executor (:mod:`medfed.federated.batched`)
runs it eagerly, the static-shape step (:mod:`medfed.federated.stacked`)
compiles it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from medfed.federated.compute import batch_samples
from medfed.federated.protocol import Auxiliary, RoundContext, TrainingPlan
from medfed.federated.site import Site
from medfed.federated.stacked_optimizers import FlatGroup
from medfed.models.base import unwrap
from medfed.models.dropout import keyed


class Slots(nn.Module):
    """The template site's slot modules under one root, so one ``functional_call`` swaps every slot's tensors.

    ``forward(batch)`` is the template half's loss of one step of the plan ``ctx`` and ``plan`` name (set
    before each plan: a compiled step keeps its wrapper from plan to plan).
    """

    def __init__(self, site: Site, ctx: RoundContext, plan: TrainingPlan) -> None:
        super().__init__()
        self.slots = nn.ModuleDict({name: unwrap(slot.module) for name, slot in site.slots.items()})
        self.site = site
        self.ctx = ctx
        self.plan = plan

    def forward(self, batch: Any) -> torch.Tensor:
        return self.site.strategy.loss(self.site.view, self.ctx, self.plan, batch)


def functional_loss(wrapper: Slots, template: Site) -> Any:
    """One row's loss of one step as a function of its tensors (names without the wrapper's ``slots.``)::

        loss(theta, frozen, buffers, state, aux, batch, key)

    the template half's loss through ``functional_call`` with the row's tensors swapped in, its declared loss
    state and auxiliary attributes set to the row's for the call, its dropout keyed by ``key``, in the run's precision.
    """
    half = template.strategy

    def loss(theta, fixed, buffer, state, extra, batch, key):
        tensors = {f"slots.{name}": t for part in (fixed, buffer, theta) for name, t in part.items()}
        with swapped_attributes(half, {**state, **extra}), keyed(key), template.fabric.autocast():  # the forward in the run's precision
            return torch.func.functional_call(wrapper, tensors, (batch,), strict=True)

    return loss


@contextmanager
def swapped_attributes(obj: Any, values: dict[str, Any]) -> Iterator[None]:
    """Inside the block, ``obj``'s attributes ``values`` names hold those values; after it, what they held before."""
    saved = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """What batches stacked together must share: the structure, and each tensor's shape and dtype."""
    leaves, spec = tree_flatten(batch)
    return (str(spec), *((tuple(leaf.shape), leaf.dtype) for leaf in leaves))


def stack_batches(batches: list[Any]) -> Any:
    """Device batches of one signature stacked leaf by leaf, ``(S, *leaf shape)``."""
    flat = [tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    return tree_unflatten([torch.stack(leaves) for leaves in zip(*(leaves for leaves, _ in flat))], spec)


@dataclass
class StackedState:
    """What a stacked step reads and writes: each tensor with the rows first.

    Attributes:
        flat: per :class:`~medfed.federated.stacked_optimizers.FlatGroup`, its trained parameters ``(S, D)``.
        optimizer: per group, its optimiser state (``(S, D)`` moments, ``(S,)`` step counts).
        hyper: per group, each row's optimiser options ``(S,)`` float64 (read only).
        frozen: the parameters not trained, ``"<slot>.<name>"`` (read only).
        buffers: the slots' buffers (a forward in training mode updates BatchNorm statistics in place).
        loss_state: the half's declared loss state (read only).
        auxiliary: the half's auxiliary parameters.
    """

    flat: list[torch.Tensor]
    optimizer: list[dict[str, torch.Tensor]]
    hyper: list[dict[str, torch.Tensor]]
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    loss_state: dict[str, torch.Tensor]
    auxiliary: dict[str, torch.Tensor]

    def rows(self, index: torch.Tensor) -> StackedState:
        """The rows ``index`` (copies)."""
        take = lambda tensors: {name: value[index] for name, value in tensors.items()}  # noqa: E731
        return StackedState(
            [flat[index] for flat in self.flat], [take(state) for state in self.optimizer], [take(hyper) for hyper in self.hyper],
            take(self.frozen), take(self.buffers), take(self.loss_state), take(self.auxiliary),
        )

    def put(self, index: torch.Tensor, rows: StackedState) -> None:
        """Write what a step of the rows ``index`` changed (:meth:`rows`' result, stepped) back into these tensors."""
        for flat, state, new_flat, new_state in zip(self.flat, self.optimizer, rows.flat, rows.optimizer, strict=True):
            flat[index] = new_flat
            for key, value in new_state.items():
                state[key][index] = value
        for mine, theirs in ((self.buffers, rows.buffers), (self.auxiliary, rows.auxiliary)):
            for name, value in theirs.items():
                mine[name][index] = value


class StackedStep:
    """The step rule's lines (:mod:`medfed.federated.step`) on stacked rows: ``torch.func`` and functional optimisers.

    Args:
        template: the site whose half's loss and slot modules run every row's step.
        ctx, plan: the rows' round context and plan.
        groups: the trained parameters' layout (:func:`~medfed.federated.stacked_optimizers.flat_groups`).
        auxiliary: the half's auxiliary parameters' rules.
    """

    def __init__(self, template: Site, ctx: RoundContext, plan: TrainingPlan, groups: list[FlatGroup], auxiliary: dict[str, Auxiliary]) -> None:
        self.plan, self.groups, self.auxiliary = plan, groups, auxiliary
        #: the sites of the rows the next step counts passes for (set by the caller per step and batch shape)
        self.counted: list[Site] = []
        self.compute: str | None = None
        row_loss = functional_loss(Slots(template, ctx, plan), template)
        self._differentiate = torch.func.vmap(torch.func.grad_and_value(row_loss, argnums=(0, 4)), randomness="error")

    def gradients(self, state: StackedState, batch: Any, key: torch.Tensor) -> tuple[torch.Tensor, Any]:
        theta = {name: view for group, flat in zip(self.groups, state.flat, strict=True) for name, view in group.views(flat).items()}
        (grads, aux_grads), loss = self._differentiate(theta, state.frozen, state.buffers, state.loss_state, state.auxiliary, batch, key)
        return loss, (grads, aux_grads)

    def privatise(self, gradients: Any) -> Any:
        return gradients  # DP-SGD trains one site at a time (group_key)

    def count(self, batch: Any) -> None:
        if self.compute is not None:
            samples = self.plan.data_pass * batch_samples(tree_flatten(batch)[0][0][0])  # one row's batch
            for site in self.counted:
                site.passes.add(self.compute, samples)

    def optimise(self, state: StackedState, gradients: Any) -> StackedState:
        grads = gradients[0]
        stepped = [
            group.step(flat, optimizer, hyper, {name: grads[name] for name in group.names})
            for group, flat, optimizer, hyper in zip(self.groups, state.flat, state.optimizer, state.hyper, strict=True)
        ]
        return dataclasses.replace(state, flat=[flat for flat, _ in stepped], optimizer=[optimizer for _, optimizer in stepped])

    def auxiliaries(self, state: StackedState, gradients: Any) -> StackedState:
        aux_grads = gradients[1]
        stepped = {name: torch.func.vmap(rule.step)(state.auxiliary[name], aux_grads[name]) for name, rule in self.auxiliary.items()}
        return dataclasses.replace(state, auxiliary={**state.auxiliary, **stepped})
