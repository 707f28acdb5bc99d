"""Where the sites' half of a round runs: the seam between the loop's round logic and the sites.

The loop (:mod:`medfed.federated.loop`) decides a round: who takes part,
the server's messages, the fault checks, the aggregation, the delivery and
the record. A :class:`SiteExecutor` carries the messages across the wires
and runs each site's part: receive, train, reply, evaluate.
:class:`InProcessSites` is the simulator's, every site in this process one
after another; ``medfed.deploy`` has one whose sites are Flower SuperNodes.

Both ends of every wire go through a :class:`~medfed.federated.link.Link`
and every message is coded at the moment it would cross the network, so the
bytes, and what each side decodes, are the same either way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from medfed.errors import MessageError, warn
from medfed.federated import batched
from medfed.federated.compute import TRAIN
from medfed.federated.faults import RoundStartStates, non_finite_keys
from medfed.federated.link import Link
from medfed.federated.site import Site
from medfed.federated.site_view import ADAPT, DELIVER, SETUP, RoundContext
from medfed.federated.strategies.base import Payload, TrainingPlan
from medfed.models.dropout import keyed, step_keys



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


@dataclass
class SummedReplies:
    """A phase's replies as the server holds them under secure aggregation: one reply standing for all of them.

    Attributes:
        reply: what :meth:`~medfed.federated.strategies.base.ServerHalf.aggregate_summed` receives (the weighted
            mean of every vector, the total weight: :class:`~medfed.federated.strategies.base.SecureSum`).
        sites: the sites whose replies are in the sum (the server knows who took part, never what each sent).
    """

    reply: Payload
    sites: list[int]


class SiteExecutor(Protocol):
    """The sites' half of the loop (see the module docstring)."""

    names: list[str]
    """The sites' names, index order."""

    declared_samples: list[int]
    """Each site's training-set size as it declared it when it joined: the bound of the sample counts it reports."""

    def setup(self) -> tuple[dict[int, Payload], dict[int, str]]:
        """Every site's setup reply as the server decodes it, and for each site without one why (its reply is
        malformed; deployed, also an error its setup answered with, or none in time)."""
        ...

    def open_round_starts(self, directory: Path | None) -> None:
        """Keep participants' start-of-round states from now on, to put failing sites back (under ``directory``;
        None: the system's temporary directory); until then :meth:`save_round_start` keeps nothing."""
        ...

    def close_round_starts(self) -> None:
        """Drop the start-of-round states."""
        ...

    def save_round_start(self, participants: list[int]) -> None:
        """Record the participants' states at the start of a round."""
        ...

    def restore_round_start(self, index: int) -> None:
        """Put site ``index`` back to its start-of-round state (it failed), and both ends of its link to where they
        stood before its reply of the phase, if one was decoded."""
        ...

    def work(self, work: PhaseWork, messages: dict[int, Payload], timing: dict[str, float]) -> dict[int, SiteResult]:
        """Send each site its message (the server's payload, not yet coded), run its part; its reply waits for :meth:`replies`.

        Adds the sites' training time to ``timing["train_s"]``.
        """
        ...

    def replies(self, candidates: list[int]) -> tuple[dict[int, Payload], dict[int, str]]:
        """The waiting replies of the ``candidates`` as the server decodes them (the others' are dropped).

        Returns:
            The decoded replies, and for each reply the server's end refused
            (:class:`~medfed.errors.MessageError`) the reason; a refused reply
            leaves the server's end of its link as it was.
        """
        ...

    def summed_replies(self) -> SummedReplies | None:
        """The phase's replies summed, where the server may hold them only so (secure aggregation; then
        :meth:`replies` gives none), or None: the server holds each site's reply. Called after :meth:`replies`."""
        ...

    def deliver(
        self, round_index: int, payloads: dict[int, Payload], evaluate: bool, timing: dict[str, float] | None
    ) -> dict[str, SiteEvaluation]:
        """Every site receives its delivery; with ``evaluate``, each adapts (:func:`site_adapt`) and is evaluated:
        ``{site name: SiteEvaluation}`` (the time in ``timing["eval_s"]``)."""
        ...

    def state_dict(self) -> list[dict[str, Any]]:
        """What a checkpoint keeps of the sites (one entry per site, or none where the sites keep their own)."""
        ...

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Put the sites back to :meth:`state_dict`'s (where the sites keep their own: tell each to go back to it)."""
        ...


class InProcessSites:
    """The simulator's executor: every site in this process, one after another.

    Sites would train at the same time; simulated one after another, the
    messages of a phase still cross the links together, before and after
    all local training: coding them back to back keeps CER's two-core solver
    clear of the OpenMP workers PyTorch leaves spinning for milliseconds after
    training. The server checks the replies as it decoded them (sample
    counts, update outliers: :mod:`medfed.federated.faults`); a reply it
    refuses is undone on the link (its state before the reply is kept for
    the phase: references, no copies). Each raw reply is released as it is
    sent, so a phase holds one model-sized vector per reply, raw or
    received, not both.

    With ``executor="batched"`` a phase's training is not run site by site
    but plan by plan: every participant receives its message and plans
    (each in its own seeded stream), then for each plan position the sites
    whose plans can train together (:func:`~medfed.federated.batched.group_key`)
    train it in one stacked, vmapped step (:mod:`medfed.federated.batched`)
    and the others one by one, then every participant replies (its stream
    continued where its receive left it). The results, faults (a site whose
    work raises fails alone: a stacked step that raises puts its group back
    and trains it one site at a time) and timing keys are the sequential ones.

    Args:
        sites: the sites, index order, each holding its half of the strategy.
        links: one link per site (both ends in one object).
        executor: ``"sequential"`` or ``"batched"`` (``trainer.executor`` resolved for the run's device).
    """

    def __init__(self, sites: list[Site], links: list[Link], executor: str = "sequential") -> None:
        if executor not in ("sequential", "batched"):
            raise ValueError(f"executor must be 'sequential' or 'batched', got {executor!r}")
        self.executor = executor
        #: why plans trained one site at a time under the batched executor, ``{"<phase>/<plan label>": reason}``
        self.sequential_plans: dict[str, str] = {}
        self.sites = sites
        self.links = links
        self.names = [site.name for site in sites]
        self.declared_samples = [site.n_train for site in sites]
        self._round_start: RoundStartStates | None = None
        self._waiting: dict[int, Payload] = {}
        self._before_reply: dict[int, dict[str, Any]] = {}  # link states before this phase's replies were sent

    def setup(self) -> tuple[dict[int, Payload], dict[int, str]]:
        received, refused = {}, {}
        for site in self.sites:  # a setup that raises is the data's or the config's fault here: it ends the run
            reply = site_setup(site)
            try:
                received[site.index] = self.links[site.index].send("up", reply)
            except MessageError as error:
                refused[site.index] = f"malformed reply: {error}"
        return received, refused

    def open_round_starts(self, directory: Path | None) -> None:
        self._round_start = RoundStartStates(directory)

    def close_round_starts(self) -> None:
        if self._round_start is not None:
            self._round_start.close()
            self._round_start = None

    def save_round_start(self, participants: list[int]) -> None:
        if self._round_start is not None:
            for index in participants:
                self._round_start.save(self.sites[index])

    def restore_round_start(self, index: int) -> None:
        self._round_start.restore(self.sites[index])
        if index in self._before_reply:
            self.links[index].load_state_dict(self._before_reply.pop(index))

    def work(self, work: PhaseWork, messages: dict[int, Payload], timing: dict[str, float]) -> dict[int, SiteResult]:
        self._before_reply = {}
        received = {index: self.links[index].send("down", payload) for index, payload in messages.items()}
        if self.executor == "batched":
            return self._work_batched(work, received, timing)
        results = {}
        for index in list(received):
            site, message = self.sites[index], received.pop(index)
            try:
                losses, reply, compute = site_phase(site, work, message, timing)
            except Exception as error:  # whatever it is, it happened at the site: the site fails
                results[index] = SiteResult(error=f"{type(error).__name__}: {error}")
                continue
            results[index] = SiteResult(losses=losses, non_finite=non_finite_keys(reply), compute=compute)
            self._waiting[index] = reply
        return results

    def record(self) -> dict[str, Any]:
        """What results.json keeps of the executor: which ran and, batched, each plan trained one site at a time and why."""
        return {"name": self.executor, **({"sequential_plans": dict(self.sequential_plans)} if self.executor == "batched" else {})}

    def _work_batched(self, work: PhaseWork, received: dict[int, Payload], timing: dict[str, float]) -> dict[int, SiteResult]:
        """:meth:`work` with the participants' plans trained together where they can (class docstring)."""
        ctx = RoundContext(work.round_index, work.phase)
        stream = (work.round_index, work.phase_index)
        phases: dict[int, _OpenPhase] = {}
        errors: dict[int, str] = {}  # whatever a site's work raised happened at the site: the site fails
        for index in list(received):
            site, message = self.sites[index], received.pop(index)
            phases[index] = _OpenPhase(site, _Stream(site, stream))
            try:
                phases[index].plans = _receive(site, ctx, message, phases[index].stream)
            except Exception as error:
                errors[index] = f"{type(error).__name__}: {error}"
        tic = time.perf_counter()
        for position in range(max((len(p.plans) for i, p in phases.items() if i not in errors), default=0)):
            groups: dict[Any, list[tuple[int, TrainingPlan, int]]] = {}
            alone: list[tuple[int, TrainingPlan, int]] = []
            for index, phase in phases.items():
                if index in errors or position >= len(phase.plans):
                    continue
                try:
                    plan, steps = plan_length(phase.site, phase.plans[position], work.local_epochs)
                    key = batched.group_key(phase.site, ctx, plan)
                except Exception as error:
                    errors[index] = f"{type(error).__name__}: {error}"
                    continue
                if isinstance(key, str):
                    self._note(f"{work.phase}/{plan.label}", key)
                    alone.append((index, plan, steps))
                elif phase.site.slot(plan.slot).module.parameter_split.size(plan.part) == 0:
                    alone.append((index, plan, steps))  # nothing to train (Site.train says so)
                else:
                    groups.setdefault(key, []).append((index, plan, steps))
            for group in groups.values():
                if len(group) == 1:
                    alone.extend(group)
                    continue
                for index, outcome in self._train_together(work, ctx, position, group, phases).items():
                    if isinstance(outcome, str):
                        errors[index] = outcome
                    elif outcome is not None:
                        phases[index].losses[phase_label(phases[index].plans, group[0][1])] = outcome
            for index, plan, steps in alone:
                phase = phases[index]
                try:
                    with phase.stream.resumed():
                        loss = train_plan(phase.site, ctx, plan, steps, f"{TRAIN}/{work.phase}", stream, position)
                except Exception as error:
                    errors[index] = f"{type(error).__name__}: {error}"
                    continue
                if loss is not None:
                    phase.losses[phase_label(phase.plans, plan)] = loss
        timing["train_s"] = timing.get("train_s", 0.0) + time.perf_counter() - tic
        results = {}
        for index, phase in phases.items():
            site = phase.site
            if index not in errors:
                try:
                    with phase.stream.resumed():
                        reply = site.strategy.reply(site.view, ctx)
                except Exception as error:
                    errors[index] = f"{type(error).__name__}: {error}"
            if index in errors:
                results[index] = SiteResult(error=errors[index])
                continue
            results[index] = SiteResult(losses=phase.losses, non_finite=non_finite_keys(reply), compute=site.passes.take(site.n_train))
            self._waiting[index] = reply
        return results

    def _train_together(
        self, work: PhaseWork, ctx: RoundContext, position: int, group: list[tuple[int, TrainingPlan, int]], phases: dict[int, _OpenPhase]
    ) -> dict[int, float | str | None]:
        """One plan at a group of sites, stacked; where the stacked step raises, one site at a time.

        Returns each site's mean loss (None: nothing trained), or its error (``"<ExceptionType>: <message>"``; a
        non-finite loss is one, naming the site and its first such step, as :meth:`Site.train` does).
        """
        stream = (work.round_index, work.phase_index)
        sites = [phases[index].site for index, _, _ in group]
        plan = group[0][1]
        compute = f"{TRAIN}/{work.phase}"
        saved = [_saved_data_orders(site) for site in sites]
        try:
            keys = [dropout_keys(site, stream, position, steps) for site, (_, _, steps) in zip(sites, group)]
            means = batched.train_group(sites, ctx, plan, [steps for _, _, steps in group], keys, f"{compute}/{plan.label}")
        except Exception as error:  # put the group back, train its sites one at a time: a site's fault fails it alone
            self._note(f"{work.phase}/{plan.label}", f"the stacked step raised ({type(error).__name__}: {error})")
            outcomes: dict[int, float | str | None] = {}
            for site, before, (index, site_plan, steps) in zip(sites, saved, group):
                _restore_data_orders(site, before)
                try:
                    with phases[index].stream.resumed():
                        outcomes[index] = train_plan(site, ctx, site_plan, steps, compute, stream, position)
                except Exception as site_error:
                    outcomes[index] = f"{type(site_error).__name__}: {site_error}"
            return outcomes
        return {
            index: mean
            if bad is None
            else f"FloatingPointError: {site.name}: training loss became {mean} at step {bad} of {steps} (learning rate too high?)"
            for site, (index, _, steps), (mean, bad) in zip(sites, group, means)
        }

    def _note(self, plan: str, reason: str) -> None:
        """Record, and say once per run, why ``plan`` trains one site at a time under the batched executor."""
        if plan not in self.sequential_plans:
            self.sequential_plans[plan] = reason
            warn(f"trainer.executor=batched: plan {plan} trains one site at a time: {reason}")

    def replies(self, candidates: list[int]) -> tuple[dict[int, Payload], dict[int, str]]:
        waiting, self._waiting = self._waiting, {}
        received, refused = {}, {}
        for index in candidates:
            self._before_reply[index] = self.links[index].state_dict()  # K is replaced, never written to: no copy
            try:
                received[index] = self.links[index].send("up", waiting.pop(index))
            except MessageError as error:
                self.links[index].load_state_dict(self._before_reply.pop(index))
                refused[index] = f"malformed reply: {error}"
        return received, refused

    def summed_replies(self) -> None:
        """None: the simulator's server holds every site's reply."""
        return None

    def deliver(
        self, round_index: int, payloads: dict[int, Payload], evaluate: bool, timing: dict[str, float] | None
    ) -> dict[str, SiteEvaluation]:
        for site in self.sites:
            site_receive_delivery(site, round_index, self.links[site.index].send("down", payloads[site.index]))
        if not evaluate:
            return {}
        tic = time.perf_counter()
        evaluations = {site.name: site_evaluation(site, round_index) for site in self.sites}
        if timing is not None:
            timing["eval_s"] = time.perf_counter() - tic
        return evaluations

    def state_dict(self) -> list[dict[str, Any]]:
        return [site.state_dict() for site in self.sites]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        for site, site_state in zip(self.sites, state, strict=True):
            site.load_state_dict(site_state)


def executor_for(option: str, device: torch.device, dp_sgd: bool) -> str:
    """The executor ``trainer.executor`` = ``option`` runs on ``device``: ``auto`` is batched on cuda, else sequential;
    DP-SGD (``dp_sgd``) trains one site at a time whatever the option (said once, where it would have been batched)."""
    wanted = ("batched" if device.type == "cuda" else "sequential") if option == "auto" else option
    if wanted == "batched" and dp_sgd:
        warn(f"trainer.executor={option}: DP-SGD clips and noises per-sample gradients one site at a time; the sites train sequentially")
        return "sequential"
    return wanted


def site_setup(site: Site) -> Payload:
    """The site half's setup reply (round 0, phase ``"setup"``); passes it makes are in no round's count."""
    reply = site.strategy.setup(site.view, RoundContext(0, SETUP))
    site.passes.take(site.n_train)
    return reply


def site_receive_delivery(site: Site, round_index: int, payload: Payload) -> None:
    """The site half receives the end of round ``round_index``'s delivery (0: the first, before round 1)."""
    site.strategy.receive(site.view, RoundContext(round_index, DELIVER), payload)


def site_evaluation(site: Site, round_index: int) -> SiteEvaluation:
    """The site's adapt step of the round, then its evaluation; the samples both passed."""
    site.passes.take(site.n_train)
    adapt_losses, adapt_error = site_adapt(site, round_index)
    metrics = site.evaluate()
    return SiteEvaluation(metrics, site.passes.take(site.n_train), adapt_losses, adapt_error)


def site_phase(
    site: Site,
    work: PhaseWork,
    message: Payload,
    timing: dict[str, float],
) -> tuple[dict[str | None, float], Payload, dict[str, float]]:
    """A site's part of a phase, its global generators seeded from (round, phase): receive, train its plans, reply.

    The same function runs in the simulator and at a deployed site. The
    strategy half sees the site's view and ``RoundContext(round, phase)``.

    Args:
        site: the site (holding its half of the strategy).
        work: the phase.
        message: the server's message as the site decoded it.
        timing: ``timing["train_s"]`` gets the training time added.

    Returns:
        The mean training loss of each plan that trained, keyed by its label
        (``None`` when the phase has one plan); the reply; and the samples
        the site passed in the phase, ``{key: epochs}``
        (:mod:`medfed.federated.compute`).
    """
    half, view, ctx = site.strategy, site.view, RoundContext(work.round_index, work.phase)
    stream = (work.round_index, work.phase_index)
    with site.global_rng(*stream):
        plans = _receive(site, ctx, message, None)
        tic = time.perf_counter()
        losses = train_plans(site, ctx, plans, work.local_epochs, f"{TRAIN}/{work.phase}", stream)
        timing["train_s"] = timing.get("train_s", 0.0) + time.perf_counter() - tic
        reply = half.reply(view, ctx)
        return losses, reply, site.passes.take(site.n_train)


def _receive(site: Site, ctx: RoundContext, message: Payload, stream: _Stream | None) -> tuple[TrainingPlan, ...]:
    """The start of a site's phase: its pass count taken afresh, then its half receives ``message`` and plans.

    ``stream``: the site's resumable stream of the work to run in (None: the caller's ``global_rng`` block is open).
    """
    site.passes.take(site.n_train)  # (what a phase that raised had passed is not counted)
    with contextlib.nullcontext() if stream is None else stream.resumed():
        site.strategy.receive(site.view, ctx, message)
        return site.strategy.plan(ctx)


@dataclass
class _OpenPhase:
    """A site's phase in progress under the batched executor: its plans, its stream and its losses so far."""

    site: Site
    stream: _Stream
    plans: tuple[TrainingPlan, ...] = ()
    losses: dict[str | None, float] = field(default_factory=dict)


class _Stream:
    """A site's global-RNG stream of one piece of work, entered several times, each time where the last entry left it.

    Torch's (CPU and the site's device), NumPy's and Python's generators are
    kept between the entries, so a receive, a training and a reply apart draw
    what they would draw in one ``site.global_rng(*stream)`` block.
    """

    def __init__(self, site: Site, stream: tuple[int, ...]) -> None:
        self.site = site
        self.stream = stream
        self.state: tuple[Any, ...] | None = None

    @contextmanager
    def resumed(self) -> Iterator[None]:
        device = self.site.fabric.device
        accelerator = None if device.type == "cpu" else torch.get_device_module(device.type)
        with self.site.global_rng(*self.stream):
            if self.state is not None:
                cpu, on_device, numpy_state, python_state = self.state
                torch.set_rng_state(cpu)
                if accelerator is not None:
                    accelerator.set_rng_state(on_device, device)
                np.random.set_state(numpy_state)
                random.setstate(python_state)
            try:
                yield
            finally:
                on_device = None if accelerator is None else accelerator.get_rng_state(device)
                self.state = (torch.get_rng_state(), on_device, np.random.get_state(), random.getstate())


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
        saved = _saved_slots(site, plans)
    except Exception as error:  # the half's own hook raised: nothing was trained yet
        return {}, f"{type(error).__name__}: {error}"
    try:
        with site.global_rng(round_index, ADAPT_STREAM):
            return train_plans(site, ctx, plans, 0.0, ADAPT, (round_index, ADAPT_STREAM)), None
    except Exception as error:  # whatever it is, it happened at the site: the site fails, unadapted
        _restore_slots(site, saved)
        return {}, f"{type(error).__name__}: {error}"


def train_plans(
    site: Site,
    ctx: RoundContext,
    plans: tuple[TrainingPlan, ...],
    local_epochs: float,
    key: str,
    stream: tuple[int, ...] = (),
) -> dict[str | None, float]:
    """Train ``plans`` in order on the half's loss; the mean loss of each that trained (None: the only plan).

    Args:
        local_epochs: the trainer's, which a plan's ``share`` is of.
        key: their passes are counted as ``<key>/<plan label>``.
        stream: the global-RNG stream of the work (the plans' dropout keys are seeded from it: :func:`dropout_keys`;
            the executors name it, ``()`` outside any).
    """
    losses = {}
    for position, plan in enumerate(plans):
        plan, steps = plan_length(site, plan, local_epochs)
        loss = train_plan(site, ctx, plan, steps, key, stream, position)
        if loss is not None:
            losses[phase_label(plans, plan)] = loss
    return losses


def phase_label(plans: tuple[TrainingPlan, ...], plan: TrainingPlan) -> str | None:
    """How a phase's losses name ``plan``'s: None where the phase has one plan, else the plan's label."""
    return None if len(plans) == 1 else plan.label


def train_plan(site: Site, ctx: RoundContext, plan: TrainingPlan, steps: int, key: str, stream: tuple[int, ...], position: int) -> float | None:
    """``steps`` steps of ``plan``, the ``position``-th plan of the work ``stream``, at ``site`` alone: its mean loss, or None."""
    return site.train(
        steps,
        plan.slot,
        plan.part,
        _step_loss(site, ctx, plan, dropout_keys(site, stream, position, steps)),
        data_order=plan.data_order,
        also_steps=plan.also_steps,
        compute=f"{key}/{plan.label}",
        data_pass=plan.data_pass,
        auxiliary=site.strategy.auxiliary(ctx, plan),
    )


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


def _saved_slots(site: Site, plans: tuple[TrainingPlan, ...]) -> dict[str, Any]:
    """Copies of the states ``plans`` change: their slots' modules and optimisers, the site's data orders."""
    slots = {name for plan in plans for name in (plan.slot, *plan.also_steps)}
    return {
        "slots": {name: copy.deepcopy((site.slot(name).module.state_dict(), site.slot(name).optimizer.state_dict())) for name in slots},
        **_saved_data_orders(site),
    }


def _restore_slots(site: Site, saved: dict[str, Any]) -> None:
    """Put back what :func:`_saved_slots` copied (a data order first made by the failed plans starts afresh)."""
    for name, (module, optimizer) in saved["slots"].items():
        site.slot(name).module.load_state_dict(module)
        site.slot(name).optimizer.load_state_dict(optimizer)
        site.slot(name).optimizer.zero_grad(set_to_none=True)
    _restore_data_orders(site, saved)
    site.passes.take(site.n_train)


def _saved_data_orders(site: Site) -> dict[str, Any]:
    """The states of the site's data-order generators, and its passes counted so far."""
    return {
        "generator": site.generator.get_state(),
        "data_orders": {name: generator.get_state() for name, (generator, _) in site.data_orders.items()},
        "passes": copy.copy(site.passes.samples),
    }


def _restore_data_orders(site: Site, saved: dict[str, Any]) -> None:
    """Put back what :func:`_saved_data_orders` kept (a data order first made since starts afresh)."""
    site.generator.set_state(saved["generator"])
    site.data_orders = {name: order for name, order in site.data_orders.items() if name in saved["data_orders"]}
    for name, state in saved["data_orders"].items():
        site.data_orders[name][0].set_state(state)
    site.passes.samples = copy.copy(saved["passes"])


def _step_loss(site: Site, ctx: RoundContext, plan: TrainingPlan, keys: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Maps a device batch to the loss of one step of ``plan`` (the site half's ``loss``), step t's dropout keyed by ``keys[t]``."""
    step_key = iter(keys)

    def loss(batch: Any) -> torch.Tensor:
        with keyed(next(step_key)):
            return site.strategy.loss(site.view, ctx, plan, batch)

    return loss


def planned_steps(site: Site, phases: tuple[str, ...], rounds: int, local_epochs: float) -> int:
    """The local steps ``site`` plans over ``rounds`` rounds: its strategy half's round-1 plans of every phase and adapt step.

    Counted as the run counts them (:func:`medfed.federated.executor.train_plans`);
    a strategy whose plans change from round to round is planned by its first.
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
