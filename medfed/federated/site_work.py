"""A site's part of each piece of a round, the same in the simulator and at a deployed site.

* setup: the half's setup reply (:func:`site_setup`);
* a phase: :func:`open_phase` (the message received, the plans made),
  :func:`train_phases` (the plans trained, position by position, as rows of an
  :class:`~medfed.federated.executor.Executor`), :func:`close_phase` (the
  reply); :func:`site_phase` is the three for one site;
* the delivery (:func:`site_delivery`), then the adapt step and the
  evaluation (:func:`site_evaluation`).

A phase runs in the site's global-RNG stream (round, phase index),
:meth:`~medfed.federated.site.Site.global_rng`, entered for each piece and
resumed where the last piece left it (:class:`Stream`), so a site draws the
same whichever executor trains it and however the sites' pieces interleave.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from medfed.federated.compute import TRAIN
from medfed.federated.executor import (
    Executor, Row, SequentialExecutor, dropout_keys, phase_label, plan_length, restore_position, saved_position, train_plans,
)
from medfed.federated.faults import non_finite_keys
from medfed.federated.protocol import ADAPT, DELIVER, SETUP, Payload, RoundContext, TrainingPlan
from medfed.federated.site import Site

#: the stream of :meth:`~medfed.federated.site.Site.global_rng` round r's adapt step runs in: (r, ADAPT_STREAM),
#: apart from the phases' (r, phase index)
ADAPT_STREAM = 1 << 16


@dataclass(frozen=True)
class PhaseWork:
    """What every site taking part in one phase does.

    Attributes:
        round_index: the round (1-based).
        phase_index: the phase's position in ``strategy.phases``.
        phase: its name.
        local_epochs: the trainer's local epochs per round, which each
            training plan takes its share of.
        reply_keys: per site, the key sets its reply may hold (the server half's
            ``reply_keys``): a deployment checks each site's securely summed reply
            against them before the sum, where no reply is seen alone.
    """

    round_index: int
    phase_index: int
    phase: str
    local_epochs: float
    reply_keys: dict[int, tuple[frozenset[str], ...]] = field(default_factory=dict)


@dataclass
class SiteResult:
    """One site's outcome of a phase, before its reply crosses the wire.

    Attributes:
        losses: mean training loss of each plan that trained, keyed by the
            plan's label (``None`` when the phase has one plan).
        non_finite: payload keys of the reply holding a NaN or an infinity (the site's own refusal to send it).
        compute: the samples the site passed in the phase, ``{key: epochs}`` (:mod:`medfed.federated.compute`).
        error: ``"<ExceptionType>: <message>"`` when the site's work raised; then nothing else counts.
    """

    losses: dict[str | None, float] = field(default_factory=dict)
    non_finite: list[str] = field(default_factory=list)
    compute: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class SiteEvaluation:
    """One site's end of a round: its adapt step and its evaluation.

    Attributes:
        metrics: the evaluated slot's metrics on the site's evaluated split.
        compute: the samples its adapt step and evaluation passed, ``{key: epochs}``.
        adapt_losses: mean loss of each adapt plan that trained (keyed as a phase's losses).
        adapt_error: ``"<ExceptionType>: <message>"`` when the adapt step raised (the site was evaluated unadapted).
        error: why the server could not read the site's delivery reply (deployed: an error, malformed, or
            none within the reply timeout); then ``metrics`` is empty and nothing else counts.
    """

    metrics: dict[str, float]
    compute: dict[str, float] = field(default_factory=dict)
    adapt_losses: dict[str | None, float] = field(default_factory=dict)
    adapt_error: str | None = None
    error: str | None = None


class Stream:
    """A site's global-RNG stream of one piece of work, entered several times, each time where the last entry left it.

    Torch's (CPU and the site's device), NumPy's and Python's generators and
    the site's count of training calls in the stream (which seeds its DP
    noise) are kept between the entries, so a receive, trainings and a reply
    apart draw what they would draw in one ``site.global_rng(*stream)`` block.
    """

    def __init__(self, site: Site, stream: tuple[int, ...]) -> None:
        self.site = site
        self.stream = stream
        self.state: tuple[Any, ...] | None = None

    @contextlib.contextmanager
    def resumed(self) -> Iterator[None]:
        site, device = self.site, self.site.fabric.device
        accelerator = None if device.type == "cpu" else torch.get_device_module(device.type)
        with site.global_rng(*self.stream):
            if self.state is not None:
                cpu, on_device, numpy_state, python_state, site.train_calls = self.state
                torch.set_rng_state(cpu)
                if accelerator is not None:
                    accelerator.set_rng_state(on_device, device)
                np.random.set_state(numpy_state)
                random.setstate(python_state)
            try:
                yield
            finally:
                on_device = None if accelerator is None else accelerator.get_rng_state(device)
                self.state = (torch.get_rng_state(), on_device, np.random.get_state(), random.getstate(), site.train_calls)


@dataclass
class OpenPhase:
    """A site's phase in progress: the work, its stream, its plans and losses so far, or the error that ended it."""

    site: Site
    work: PhaseWork
    stream: Stream
    plans: tuple[TrainingPlan, ...] = ()
    losses: dict[str | None, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ctx(self) -> RoundContext:
        return RoundContext(self.work.round_index, self.work.phase)


def open_phase(site: Site, work: PhaseWork, message: Payload) -> OpenPhase:
    """The start of a site's phase: its pass count taken afresh, then its half receives ``message`` and plans."""
    phase = OpenPhase(site, work, Stream(site, (work.round_index, work.phase_index)))
    site.passes.take(site.n_train)  # (what a phase that raised had passed is not counted)
    try:
        with phase.stream.resumed():
            site.strategy.receive(site.view, phase.ctx, message)
            phase.plans = site.strategy.plan(phase.ctx)
    except Exception as error:  # whatever it is, it happened at the site: the site fails
        phase.error = f"{type(error).__name__}: {error}"
    return phase


def train_phases(executor: Executor, phases: list[OpenPhase]) -> None:
    """Train the open phases' plans, position by position: each position's plans as one list of rows."""
    for position in range(max((len(phase.plans) for phase in phases if phase.error is None), default=0)):
        rows, owners = [], []
        for phase in phases:
            if phase.error is not None or position >= len(phase.plans):
                continue
            site, work = phase.site, phase.work
            try:
                plan, steps = plan_length(site, phase.plans[position], work.local_epochs)
                keys = dropout_keys(site, phase.stream.stream, position, steps)
            except Exception as error:
                phase.error = f"{type(error).__name__}: {error}"
                continue
            rows.append(Row(site, phase.ctx, plan, steps, keys, f"{TRAIN}/{work.phase}/{plan.label}", phase.stream.resumed))
            owners.append(phase)
        for phase, row, outcome in zip(owners, rows, executor.train(rows), strict=True):
            if isinstance(outcome, str):
                phase.error = outcome
            elif outcome is not None:
                phase.losses[phase_label(phase.plans, row.plan)] = outcome


def close_phase(phase: OpenPhase) -> tuple[SiteResult, Payload | None]:
    """The end of a site's phase: its half's reply (None where the phase failed), and the phase's result."""
    site = phase.site
    if phase.error is None:
        try:
            with phase.stream.resumed():
                reply = site.strategy.reply(site.view, phase.ctx)
        except Exception as error:
            phase.error = f"{type(error).__name__}: {error}"
    if phase.error is not None:
        return SiteResult(error=phase.error), None
    return SiteResult(losses=phase.losses, non_finite=non_finite_keys(reply), compute=site.passes.take(site.n_train)), reply


def site_phase(
    site: Site, work: PhaseWork, message: Payload, timing: dict[str, float], executor: Executor | None = None
) -> tuple[SiteResult, Payload | None]:
    """One site's part of a phase: receive, train its plans (``executor``; None: one at a time), reply.

    Adds the training time to ``timing["train_s"]``. Returns the result and the reply (None where it failed).
    """
    phase = open_phase(site, work, message)
    tic = time.perf_counter()
    train_phases(executor or SequentialExecutor(), [phase])
    timing["train_s"] = timing.get("train_s", 0.0) + time.perf_counter() - tic
    return close_phase(phase)


def site_setup(site: Site) -> Payload:
    """The site half's setup reply (round 0, phase ``"setup"``); passes it makes are in no round's count."""
    reply = site.strategy.setup(site.view, RoundContext(0, SETUP))
    site.passes.take(site.n_train)
    return reply


def site_delivery(site: Site, round_index: int, payload: Payload) -> None:
    """The site half takes the end of round ``round_index``'s delivery (0: the first, before round 1)."""
    site.strategy.deliver(site.view, RoundContext(round_index, DELIVER), payload)


def site_evaluation(site: Site, round_index: int) -> SiteEvaluation:
    """The site's adapt step of the round, then its evaluation; the samples both passed."""
    site.passes.take(site.n_train)
    adapt_losses, adapt_error = site_adapt(site, round_index)
    metrics = site.evaluate()
    return SiteEvaluation(metrics, site.passes.take(site.n_train), adapt_losses, adapt_error)


def site_adapt(site: Site, round_index: int) -> tuple[dict[str | None, float], str | None]:
    """The site half's adapt step of round ``round_index`` (after the delivery, before the evaluation).

    Its plans train as a phase's do, with the site's global generators seeded
    from ``(round, ADAPT_STREAM)`` and their passes counted as ``adapt/<label>``.
    Whatever raises puts the plans' slots (modules, optimisers) and data
    orders back to what they were, and is returned instead of the losses.

    Returns:
        The mean loss of each plan that trained (keyed as a phase's), and
        ``"<ExceptionType>: <message>"`` or None.
    """
    ctx = RoundContext(round_index, ADAPT)
    try:
        plans = site.strategy.adapt(ctx)
        if not plans:
            return {}, None
        if any(plan.steps is None and plan.epochs is None for plan in plans):
            raise ValueError(f"an adapt plan gives its length in epochs or steps, got {plans}")
        names = {name for plan in plans for name in (plan.slot, *plan.also_steps)}
        saved = {name: copy.deepcopy((site.slot(name).module.state_dict(), site.slot(name).optimizer.state_dict())) for name in names}
        position = saved_position(site)
    except Exception as error:  # the half's own hook raised: nothing was trained yet
        return {}, f"{type(error).__name__}: {error}"
    try:
        with site.global_rng(round_index, ADAPT_STREAM):
            return train_plans(site, ctx, plans, 0.0, ADAPT, (round_index, ADAPT_STREAM)), None
    except Exception as error:  # whatever it is, it happened at the site: the site fails, unadapted
        for name, (module, optimizer) in saved.items():
            site.slot(name).module.load_state_dict(module)
            site.slot(name).optimizer.load_state_dict(optimizer)
            site.slot(name).optimizer.zero_grad(set_to_none=True)
        restore_position(site, position)
        site.passes.take(site.n_train)
        return {}, f"{type(error).__name__}: {error}"
