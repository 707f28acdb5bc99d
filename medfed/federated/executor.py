"""How in-process sites train (``trainer.executor``): the training interface and its sequential implementation.

The unit of work is a list of :class:`Row` s: ``steps`` steps of a training
plan at a site in a round context, with the steps' dropout keys, the compute
key their passes count under and the site's random stream of the work. An
:class:`Executor` trains a list of rows and returns each row's outcome; it
does not care whether two rows are two sites of one federation or the same
site in two runs. :class:`SequentialExecutor` trains them one at a time, each
in its site's stream, by ``Site.train`` (the step rule,
:mod:`medfed.federated.step`); the stacked implementation is
:class:`medfed.federated.batched.BatchedExecutor`. Both give every row the
same losses, batches, dropout masks and pass counts.

How long a plan runs at a site (:func:`plan_length`) is the site's: the
plan's epochs are cut at whole steps along its budget axis, which every plan
advances.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from medfed.federated.protocol import ADAPT, RoundContext, TrainingPlan
from medfed.federated.site import Site
from medfed.models.dropout import step_keys

#: a row's outcome: its mean loss, None (nothing trained), or ``"<ExceptionType>: <message>"`` (the row's site failed)
Outcome = float | str | None


@dataclass(frozen=True)
class Row:
    """``steps`` steps of ``plan`` at ``site`` in ``ctx``: one unit of training work.

    Attributes:
        site: where the plan trains.
        ctx: the round context of the plan (its loss is the site half's ``loss`` in it).
        plan: the plan, its ``pass_budget`` set where it counts passes (:func:`plan_length`).
        steps: the optimiser steps it takes (>= 1).
        keys: the steps' dropout keys, ``(steps,)`` int64 on the site's device (:func:`dropout_keys`).
        compute: the key the steps' passes are counted under.
        stream: enters the site's global-RNG stream of the work, where the row trains alone.
    """

    site: Site
    ctx: RoundContext
    plan: TrainingPlan
    steps: int
    keys: torch.Tensor
    compute: str
    stream: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext


class Executor(Protocol):
    """Trains rows (module docstring)."""

    def train(self, rows: list[Row]) -> list[Outcome]:
        """Each row trained, in order; its outcome (a site's failure fails that row alone)."""
        ...

    def record(self) -> dict[str, object]:
        """What results.json keeps of the executor (``{"name": ...}`` and what it noted)."""
        ...


class SequentialExecutor:
    """Every row alone, one after another, in its site's stream."""

    name = "sequential"

    def train(self, rows: list[Row]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for row in rows:
            try:
                with row.stream():
                    outcomes.append(train_row(row))
            except Exception as error:  # whatever it is, it happened at the site: the row's site fails
                outcomes.append(f"{type(error).__name__}: {error}")
        return outcomes

    def record(self) -> dict[str, object]:
        return {"name": self.name}


def train_row(row: Row) -> float | None:
    """One row at its site alone, in the caller's random stream: its mean loss, or None (nothing trained)."""
    site, plan = row.site, row.plan
    half = site.strategy
    return site.train(
        row.steps,
        plan.slot,
        plan.part,
        lambda batch: half.loss(site.view, row.ctx, plan, batch),
        data_order=plan.data_order,
        keys=row.keys,
        also_steps=plan.also_steps,
        compute=row.compute,
        data_pass=plan.data_pass,
        auxiliary=half.auxiliary(row.ctx, plan),
    )


def train_plans(site: Site, ctx: RoundContext, plans: tuple[TrainingPlan, ...], local_epochs: float, key: str, stream: tuple[int, ...] = ()) -> dict[str | None, float]:
    """Train one site's ``plans`` in order, alone, in the caller's random stream; each trained plan's mean loss.

    Args:
        local_epochs: the trainer's, which a plan's ``share`` is of.
        key: their passes are counted as ``<key>/<plan label>``.
        stream: the global-RNG stream of the work (the plans' dropout keys are seeded from it, ``()`` outside any).

    Returns:
        ``{label: mean loss}`` of the plans that trained (:func:`phase_label`).
    """
    losses = {}
    for position, plan in enumerate(plans):
        plan, steps = plan_length(site, plan, local_epochs)
        loss = train_row(Row(site, ctx, plan, steps, dropout_keys(site, stream, position, steps), f"{key}/{plan.label}"))
        if loss is not None:
            losses[phase_label(plans, plan)] = loss
    return losses


def phase_label(plans: tuple[TrainingPlan, ...], plan: TrainingPlan) -> str | None:
    """How a phase's losses name ``plan``'s: None where the phase has one plan, else the plan's label."""
    return None if len(plans) == 1 else plan.label


def dropout_keys(site: Site, stream: tuple[int, ...], position: int, steps: int) -> torch.Tensor:
    """The dropout keys of the ``steps`` steps of the ``position``-th plan of the work ``stream`` at ``site``: ``(steps,)``
    int64 on its device (:mod:`medfed.models.dropout`), the same whichever executor trains the plan."""
    return step_keys([site.seed, site.index, *stream, position], steps, site.fabric.device)


def plan_length(site: Site, plan: TrainingPlan, local_epochs: float) -> tuple[TrainingPlan, int]:
    """The optimiser steps ``plan`` takes at ``site`` now (and the plan, told its pass budget where it counts passes).

    A plan given in epochs (or a share of ``local_epochs``) takes the next ``epochs`` of the site's budget
    axis, ``site.budget_epochs`` (the epochs its plans took before: this round's earlier plans, whatever data
    order they drew from, and earlier rounds'), cut at whole steps (:meth:`Site.steps`), and advances it.
    So plans that split a round's budget take together the mini-batches one plan with all of it would, and
    a plan of a fraction of an epoch takes that fraction on average over the rounds (B = 5 batches, half
    an epoch a round: 3, 2, 3, 2, ... steps, not 3 every round).
    """
    plan, steps, epochs = _length_at(site, plan, local_epochs, site.budget_epochs)
    site.budget_epochs += epochs
    return plan, steps


def _length_at(site: Site, plan: TrainingPlan, local_epochs: float, before: float) -> tuple[TrainingPlan, int, float]:
    """``(plan, its steps, its epochs on the budget axis)`` for ``plan`` starting ``before`` epochs along the axis."""
    epochs = plan.epochs_of(local_epochs)
    if epochs is None:
        return plan, plan.steps, 0.0
    steps = site.steps(epochs, before)
    if plan.passes_per_step > 1:  # the length counts passes; the loss is told how many samples (pFedMe)
        plan = dataclasses.replace(plan, pass_budget=round(epochs * site.n_train))
        steps = math.ceil(steps / plan.passes_per_step)
    return plan, steps, epochs


def saved_position(site: Site) -> dict[str, Any]:
    """Where ``site`` stands in its data: its data orders' generator states and the passes counted so far."""
    return {**site.orders.state_dict(), "passes": copy.copy(site.passes.samples)}


def restore_position(site: Site, saved: dict[str, Any]) -> None:
    """Put ``site`` back to :func:`saved_position`'s (a data order first made since starts afresh)."""
    site.orders.load_state_dict(saved)
    site.passes.samples = copy.copy(saved["passes"])


def planned_steps(site: Site, phases: tuple[str, ...], rounds: int, local_epochs: float) -> int:
    """The local steps ``site`` plans over ``rounds`` rounds: its strategy half's round-1 plans of every phase and adapt step.

    Counted as the run counts them (:func:`plan_length`); a strategy whose plans change from round to round
    is planned by its first.
    """
    plans = [plan for phase in phases for plan in site.strategy.plan(RoundContext(1, phase))]
    total, before = 0, 0.0  # the site's budget axis over the run, as the executors keep it (plan_length)
    for _ in range(rounds):
        for plan in plans:
            _, steps, epochs = _length_at(site, plan, local_epochs, before)
            total, before = total + steps, before + epochs
    for plan in site.strategy.adapt(RoundContext(1, ADAPT)):
        total += rounds * (plan.steps if plan.steps is not None else site.steps(plan.epochs))
    return total
