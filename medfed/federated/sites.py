"""Where the federation's sites live: the seam between the loop's round logic and the sites.

The loop (:mod:`medfed.federated.loop`) decides a round: who takes part,
the server's messages, the fault checks, the aggregation, the delivery and
the record. Its :class:`Sites` carry the messages across the wires and run
each site's part: receive, train, reply, evaluate
(:mod:`medfed.federated.site_work`). :class:`InProcessSites` is the
simulator's, every site in this process; ``medfed.deploy`` has one whose
sites are Flower SuperNodes. How in-process sites train, one at a time or
stacked, is their :class:`~medfed.federated.executor.Executor`
(``trainer.executor``).

Both ends of every wire go through a :class:`~medfed.federated.link.Link`
and every message is coded at the moment it would cross the network, so the
bytes, and what each side decodes, are the same either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from medfed.errors import MessageError, warn
from medfed.federated.attack import Attack
from medfed.federated.batched import BatchedExecutor
from medfed.federated.stacked_evaluation import evaluate_group, evaluation_key
from medfed.federated.compute import EVALUATION, batch_samples
from medfed.federated.executor import Executor, SequentialExecutor
from medfed.federated.faults import RoundStartStates
from medfed.federated.fused import FusedExecutor, FusedTraining
from medfed.federated.link import Link
from medfed.federated.protocol import Payload
from medfed.federated.site import Site
from medfed.federated.site_work import (
    PhaseWork, SiteEvaluation, SiteResult, close_phase, open_phase, site_adapt, site_delivery, site_evaluation, site_setup, train_phases,
)


@dataclass
class SummedReplies:
    """A phase's replies as the server holds them under secure aggregation: one reply standing for all of them.

    Attributes:
        reply: what :meth:`~medfed.federated.protocol.ServerHalfProtocol.aggregate_summed` receives (the weighted
            mean of every vector, the total weight: :class:`~medfed.federated.protocol.SecureSum`).
        sites: the sites whose replies are in the sum (the server knows who took part, never what each sent).
    """

    reply: Payload
    sites: list[int]


class Sites(Protocol):
    """Where the federation's sites live, as the loop reaches them (see the module docstring)."""

    names: list[str]
    """The sites' names, index order."""

    declared_samples: list[int]
    """Each site's training-set size as it declared it when it joined: the bound of the sample counts it reports."""

    links: list[Link]
    """The server's end of each site's link, index order (the loop counts their bytes and checkpoints them)."""

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
        """Every site takes its delivery; with ``evaluate``, each adapts (:func:`~medfed.federated.site_work.site_adapt`) and is evaluated:
        ``{site name: SiteEvaluation}`` (the time in ``timing["eval_s"]``)."""
        ...

    def state_dict(self) -> list[dict[str, Any]]:
        """What a checkpoint keeps of the sites (one entry per site, or none where the sites keep their own)."""
        ...

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Put the sites back to :meth:`state_dict`'s (where the sites keep their own: tell each to go back to it)."""
        ...


class InProcessSites:
    """The simulator's sites: every site in this process (indexed and iterated as a list), its training by ``executor``.

    Sites would train at the same time; simulated, the messages of a phase
    still cross the links together, before and after all local training:
    coding them back to back keeps CER's two-core solver clear of the OpenMP
    workers PyTorch leaves spinning for milliseconds after training. A
    phase opens at every participant (its message received, its plans made,
    each in its own seeded stream), trains the plans position by position
    as rows of the executor, and closes (every participant replies, its
    stream continued where its receive left it). The server checks the
    replies as it decoded them (sample counts, update outliers:
    :mod:`medfed.federated.faults`); a reply it refuses is undone on the link
    (its state before the reply is kept for the phase: references, no
    copies). Each raw reply is released as it is sent, so a phase holds one
    model-sized vector per reply, raw or received, not both.

    Args:
        sites: the sites, index order, each holding its half of the strategy.
        links: one link per site (both ends in one object).
        executor: how the sites train (default: one at a time).
        attack: simulated hostile sites, for evaluation (:mod:`medfed.federated.attack`): what they receive is
            noted, what they reply altered before it crosses its link. None: every site is honest.
    """

    def __init__(self, sites: list[Site], links: list[Link], executor: Executor | None = None, attack: Attack | None = None) -> None:
        self.sites = sites
        self.links = links
        self.executor = executor or SequentialExecutor()
        self.attack = attack
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
        if self.attack is not None:
            for index, payload in received.items():
                self.attack.receive(index, payload)
        phases = {index: open_phase(self.sites[index], work, received.pop(index)) for index in list(received)}
        tic = time.perf_counter()
        train_phases(self.executor, list(phases.values()))
        # a fused run's executor waits for the other runs: only its share of the stacked steps is its training time
        waited = self.executor.take_waited() if isinstance(self.executor, FusedExecutor) else 0.0
        timing["train_s"] = timing.get("train_s", 0.0) + time.perf_counter() - tic - waited
        results = {}
        for index, phase in phases.items():
            results[index], reply = close_phase(phase)
            if reply is not None:
                self._waiting[index] = reply if self.attack is None else self.attack.reply(index, work.round_index, work.phase_index, reply)
        return results

    def record(self) -> dict[str, Any]:
        """What results.json keeps of how the sites trained (:meth:`Executor.record`)."""
        return self.executor.record()

    def __getitem__(self, index: int | slice) -> Any:
        return self.sites[index]

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

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
            delivered = self.links[site.index].send("down", payloads[site.index])
            if self.attack is not None:
                self.attack.receive(site.index, delivered)
            site_delivery(site, round_index, delivered)
        if not evaluate:
            return {}
        tic = time.perf_counter()
        if self.executor.name == "batched":
            evaluations = self._evaluate_stacked(round_index)
        else:
            evaluations = {site.name: site_evaluation(site, round_index) for site in self.sites}
        if timing is not None:
            timing["eval_s"] = time.perf_counter() - tic
        return evaluations

    def _evaluate_stacked(self, round_index: int) -> dict[str, SiteEvaluation]:
        """:func:`~medfed.federated.site_work.site_evaluation` of every site, the adapt steps one site at a time, the
        evaluations' forward passes stacked over the sites of equal evaluation key (:func:`~medfed.federated.stacked_evaluation.evaluate_group`)."""
        adapted = {}
        for site in self.sites:
            site.passes.take(site.n_train)
            adapted[site.index] = site_adapt(site, round_index)
        groups: dict[Any, list[Site]] = {}
        for site in self.sites:
            groups.setdefault(evaluation_key(site), []).append(site)
        metrics = {}
        for group in groups.values():
            if len(group) == 1:
                metrics[group[0].index] = group[0].evaluate()
                continue
            counted = lambda site, batch: site.passes.add(EVALUATION, batch_samples(batch))  # noqa: E731
            for site, values in zip(group, evaluate_group(group, counted)):
                metrics[site.index] = values
        return {site.name: SiteEvaluation(metrics[site.index], site.passes.take(site.n_train), *adapted[site.index]) for site in self.sites}

    def state_dict(self) -> list[dict[str, Any]]:
        return [site.state_dict() for site in self.sites]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        for site, site_state in zip(self.sites, state, strict=True):
            site.load_state_dict(site_state)


def executor_for(option: str, device: torch.device, dp_sgd: bool, compile: bool = False, fused: FusedTraining | None = None) -> Executor:
    """The executor ``trainer.executor`` = ``option`` runs on ``device``: ``auto`` is batched on cuda, else sequential;
    DP-SGD (``dp_sgd``) trains one site at a time whatever the option (said once, where it would have been batched).

    ``compile`` (``trainer.compile``): batched, by the compiled static-shape step (:mod:`medfed.federated.stacked`).
    ``fused``: the run is fused with others (:mod:`medfed.federated.fused`): batched, its rows stacked with theirs,
    whatever the option (DP-SGD aside)."""
    if fused is not None and not dp_sgd:
        return FusedExecutor(fused, compile)
    wanted = ("batched" if device.type == "cuda" else "sequential") if option == "auto" else option
    if wanted == "batched" and dp_sgd:
        warn(f"trainer.executor={option}: DP-SGD clips and noises per-sample gradients one site at a time; the sites train sequentially")
        wanted = "sequential"
    if wanted not in ("sequential", "batched"):
        raise ValueError(f"executor must be 'sequential' or 'batched', got {wanted!r}")
    return BatchedExecutor(compile) if wanted == "batched" else SequentialExecutor()
