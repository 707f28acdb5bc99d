"""The federated loop: rounds of local training and server steps, on Lightning Fabric.

Lightning 2.x's documented route to a custom loop is Fabric: the loop here
drives the sites (each with its model slots, optimisers and half of the
strategy, kept across rounds, wherever they live: :mod:`medfed.federated.sites`),
calls the server half's hooks and has the sites call theirs by name (see
:mod:`medfed.federated.protocol` for the life cycle), and knows nothing
about any particular algorithm. Every payload crosses a
:class:`~medfed.federated.link.Link`, which turns it into bytes and counts
them. After each round every site takes its strategy half's adapt step (e.g.
fine-tuning a head; seeded from its own stream of the round, its losses in
the record as ``adapt_loss``) and is evaluated on its own test split (its
validation split with ``federation.holdout: validation``), extra callbacks
get ``on_round_end`` (and may add metrics to the round's record, e.g.
whole-volume scores), the record goes to Fabric's loggers, and a checkpoint
is written atomically.

A participant that fails (its work raises, its reply is malformed, late,
not finite, without a key the strategy declares or with one it does not,
over its declared sample count or an update outlier, as the server decoded
it: :mod:`medfed.federated.faults`) is left out of the round from that phase
on and put back to its start-of-round state, or ends the run
(``on_site_failure``); a site failing ``max_consecutive_failures`` rounds in
a row takes no further part (it is still delivered to and evaluated, so every
round's table has every site). A site whose setup reply is refused the same
way is excluded from the start (one warning line); the run goes on with the
others. A site whose adapt step raises fails the round
too (phase ``adapt``), and is evaluated unadapted. A site whose delivery reply
cannot be read (deployed: an error, malformed, or late) fails the round too
(phase ``deliver``): its metrics of the round are NaN (``null`` in
results.json) and the round's ``mean`` is over the sites that were evaluated.
Failures go to the log, to the round's record
(``failures``, ``excluded``) and, as ``<site>/failed`` flags, to the loggers.

Every round's record also carries ``compute``: per site, the samples it
passed forward and backward in each training plan and auxiliary pass, and
forward in its evaluation, in epochs of its training data
(:mod:`medfed.federated.compute`; counted at the sites).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric

from medfed.checkpoint import state_on_device
from medfed.errors import RunFailed, SiteFailure, warn
from medfed.federated.compute import merge, training_epochs
from medfed.federated.faults import refused_replies, reply_fault
from medfed.federated.link import Link
from medfed.federated.privacy import ClientDP
from medfed.federated.site_work import PhaseWork, SiteEvaluation
from medfed.federated.sites import Sites
from medfed.federated.protocol import ADAPT, DELIVER, SETUP, Payload, RoundContext, StrategyProtocol


class FederatedLoop:
    """Runs a strategy over a federation of sites.

    Args:
        fabric: device placement, loggers and callbacks (``on_round_end``).
        strategy: the algorithm (its server half is ``strategy.server``).
        sites: where the sites live and how the loop reaches them (:class:`~medfed.federated.sites.Sites`, with the
            server's ends of their links): :class:`~medfed.federated.sites.InProcessSites` in the simulator, the
            SuperNodes of a deployment (``medfed.deploy``).
        initial: the initial model as vectors ``{"shared", "personal", "all", ...}``
            (every site starts from it), with any vectors the strategy adds
            (``Strategy.initial_values``); the server half's setup gets them.
        local_epochs: the trainer's local epochs per round, which a
            training plan takes its ``share`` of (by default all).
        participation: fraction of sites taking part in each round; the
            participants of round r are a seeded draw from (seed, r).
        seed: the run's seed.
        save_checkpoint: called with the loop's state after every round.
        on_site_failure: ``"drop"`` (leave a failing site out of the round) or
            ``"stop"`` (raise :class:`~medfed.errors.SiteFailure`).
        update_norm_limit: c of the update-outlier check (``None``: no check).
        max_consecutive_failures: rounds in a row a site may fail before it is
            excluded from the rest of the run (``None``: never).
        scratch_dir: where participants' start-of-round states are written
            when they do not fit the memory budget of
            :class:`~medfed.federated.faults.RoundStartStates` (``None``: the
            system's temporary directory); only with ``on_site_failure="drop"``.
        client_dp: client-level DP (:class:`~medfed.federated.privacy.ClientDP`): every phase's
            replies reach the server step as its one clipped, noised average; ``None``: off.
    """

    def __init__(
        self,
        fabric: Fabric,
        strategy: StrategyProtocol,
        sites: Sites,
        initial: Payload,
        local_epochs: int,
        participation: float,
        seed: int,
        save_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        on_site_failure: str = "drop",
        update_norm_limit: float | None = 10.0,
        max_consecutive_failures: int | None = 3,
        scratch_dir: Path | None = None,
        client_dp: ClientDP | None = None,
    ) -> None:
        self.fabric = fabric
        self.sites = sites
        self.strategy = strategy
        self.server = strategy.server
        self.links = sites.links
        self.initial = initial
        self.local_epochs = local_epochs
        self.participation = participation
        self.seed = seed
        self.save_checkpoint = save_checkpoint
        self.on_site_failure = on_site_failure
        self.update_norm_limit = update_norm_limit
        self.max_consecutive_failures = max_consecutive_failures
        self.scratch_dir = scratch_dir
        self.client_dp = client_dp
        self._sent: dict[int, Payload] = {}  # with client_dp: each site's last delivery, what its updates are measured against
        self.site_names = self.sites.names
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.failure_streaks = [0] * len(self.site_names)  # rounds in a row each site has failed
        self.excluded: dict[str, dict[str, Any]] = {}  # site name -> {"round", "reason"}
        self.stop_reason: str | None = None  # set by a round-end callback to end the run after this round

    # ------------------------------------------------------------------ public
    def setup(self) -> None:
        """Round 0: setup payloads up, server setup, first delivery down.

        A site whose setup reply is refused (malformed; other keys than the
        server half's ``reply_keys`` or a value it refuses; more samples than
        the site declared; deployed, also an error or no reply in time) is
        excluded from the run, with one warning line; the server's setup gets
        the other replies. (A setup that raises in this process is the data's
        or the config's fault, not a site's: it ends the run.)

        Raises:
            SiteFailure: a refused setup reply under ``on_site_failure: stop``.
            RunFailed: every site's setup reply was refused.
        """
        ctx = RoundContext(0, SETUP)
        replies, refused = self.sites.setup()
        for index, reply in replies.items():
            reason = reply_fault(reply, self.server, ctx, index, self.sites.declared_samples[index])
            if reason is not None:
                refused[index] = reason
        for index, reason in sorted(refused.items()):
            name = self.site_names[index]
            if self.on_site_failure == "stop":
                raise SiteFailure(f"site {name} at setup: {reason}")
            replies.pop(index, None)
            self.excluded[name] = {"round": 0, "reason": reason}
            warn(f"site {name} excluded from the run at setup: {reason}")
        if not replies:
            raise RunFailed(f"every site's setup reply was refused ({_excluded_summary(self.excluded)}); nothing is left to train")
        self.server.setup(ctx, self.initial, replies)
        self._deliver(evaluate=False)

    def fit(self, rounds: int, progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Run rounds ``self.round + 1 .. rounds``; returns the per-round history."""
        if self.round == 0 and not self.history:
            self.setup()
        if self.on_site_failure == "drop":
            self.sites.open_round_starts(self.scratch_dir)
        try:
            while self.round < rounds:
                self.round += 1
                record = self._run_round(self.round)
                self.history.append(record)
                self.fabric.call("on_round_end", loop=self, record=record)  # callbacks may add to the record
                self.fabric.log_dict(_flatten_for_logging(record), step=self.round)
                if self.save_checkpoint is not None:
                    self.save_checkpoint(self.state_dict())
                if progress is not None:
                    progress(record)
                if self.stop_reason is not None:  # a callback ended the run (e.g. a validation plateau)
                    break
        finally:
            self.sites.close_round_starts()
        return self.history

    def participants(self, round_index: int) -> list[int]:
        """The indices of the sites taking part in ``round_index`` (all of them at participation 1), excluded sites left out.

        The draw is over every site, so excluding one leaves the other sites'
        rounds as they were.
        """
        n, k = len(self.site_names), self.sample_size()
        if k >= n:
            chosen = range(n)
        else:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, round_index, 0x5E1EC7]))
            chosen = sorted(rng.choice(n, size=k, replace=False).tolist())
        return [i for i in chosen if self.site_names[i] not in self.excluded]

    def sample_size(self) -> int:
        """m, the sites drawn for each round: ceil(participation * n), at least 1."""
        return min(len(self.site_names), max(1, math.ceil(self.participation * len(self.site_names) - 1e-9)))

    # ------------------------------------------------------------------ one round
    def _run_round(self, round_index: int) -> dict[str, Any]:
        """One round: every phase, the delivery, the adapt step and evaluation; the round's record."""
        start = time.perf_counter()
        if len(self.excluded) == len(self.site_names):
            raise SiteFailure(f"every site has been excluded ({_excluded_summary(self.excluded)}); nothing is left to train")
        counters_before = [_link_counters(link) for link in self.links]
        round_ = _Round(round_index, self.participants(round_index))
        tic = time.perf_counter()
        self.sites.save_round_start(round_.participants)
        round_.timing["round_start_s"] = time.perf_counter() - tic
        for phase_index, phase in enumerate(self.strategy.phases):
            self._run_phase(round_, phase_index, phase)
        evaluations = self._deliver(evaluate=True, timing=round_.timing)
        for index, name in enumerate(self.site_names):
            evaluation = evaluations[name]
            if evaluation.error is not None:
                self._delivery_failed(index, round_index, evaluation.error, round_.failures)
                continue
            merge(round_.compute.setdefault(name, {}), evaluation.compute)
            for label, loss in evaluation.adapt_losses.items():
                round_.adapt_loss.setdefault(name, {})[ADAPT if label is None else f"{ADAPT}/{label}"] = loss
            if evaluation.adapt_error is not None:
                self._adapt_failed(index, round_index, evaluation.adapt_error, round_.failures)
        newly_excluded = self._count_failures(sorted(set(round_.participants) | set(round_.failures)), round_.failures)
        round_.timing["round_s"] = time.perf_counter() - start
        return self._record(round_, evaluations, counters_before, newly_excluded)

    def _run_phase(self, round_: _Round, phase_index: int, phase: str) -> None:
        """One phase of a round: the server's messages, the sites' work and replies, the checks, the server step."""
        names = self.site_names
        taking_part = [index for index in round_.participants if index not in round_.failures]
        ctx = RoundContext(round_.round, phase)
        messages = {index: self.server.message(ctx, index) for index in taking_part}
        reply_keys = {index: self.server.reply_keys(ctx, index) for index in taking_part}
        results = self.sites.work(PhaseWork(round_.round, phase_index, phase, self.local_epochs, reply_keys), messages, round_.timing)
        fail = functools.partial(self._fail, round_)
        for index in taking_part:
            result = results[index]
            if result.error is not None:
                fail(index, phase, result.error)
                continue
            for label, loss in result.losses.items():
                round_.train_loss.setdefault(names[index], {})[phase if label is None else f"{phase}/{label}"] = loss
            merge(round_.compute.setdefault(names[index], {}), result.compute)
            if result.non_finite:
                fail(index, phase, f"non-finite reply ({', '.join(repr(key) for key in result.non_finite)})")
        replies, malformed = self.sites.replies([index for index in taking_part if index not in round_.failures])
        for index, reason in malformed.items():
            fail(index, phase, reason)
        refused = refused_replies(
            replies, messages, self.server, ctx, self.sites.declared_samples, self.strategy.coded_keys, self.update_norm_limit
        )
        for index, reason in refused.items():
            fail(index, phase, reason)
            del replies[index]
        summed = self._checked_sum(ctx, fail)  # secure aggregation: the replies as one sum, never one by one
        tic = time.perf_counter()
        if summed is not None:
            self.server.aggregate_summed(ctx, summed)
        elif replies:  # a phase no participant came through leaves the server as it was
            if self.client_dp is not None:  # the server step receives only the clipped, noised average
                participants = round_.participants
                sent = {index: {**self._sent.get(index, {}), **messages.get(index, {})} for index in participants}
                replies = self.client_dp.release(ctx, phase_index, replies, sent, participants, self.sample_size() / len(names))
            self.server.aggregate(ctx, replies)
        round_.timing["server_s"] += time.perf_counter() - tic

    def _fail(self, round_: _Round, index: int, phase: str, reason: str) -> None:
        """Leave site ``index`` out of the rest of the round (drop) or end the run (stop)."""
        name = self.site_names[index]
        if self.on_site_failure == "stop":
            raise SiteFailure(f"site {name} failed in round {round_.round} ({phase} phase): {reason}")
        warn(f"round {round_.round}: site {name} left out of the {phase} phase and the rest of the round: {reason}")
        round_.failures[index] = {"round": round_.round, "site": name, "phase": phase, "reason": reason}
        self.sites.restore_round_start(index)

    def _record(
        self, round_: _Round, evaluations: dict[str, SiteEvaluation], counters_before: list[dict[str, float]], newly_excluded: list[str]
    ) -> dict[str, Any]:
        """The round's record (the loop's module docstring): metrics, losses, compute, bytes, timing, failures."""
        names = self.site_names
        evaluated = {name: evaluations[name].metrics for name in names if evaluations[name].error is None}
        metric_names = list(next(iter(evaluated.values()), {}))
        traffic = {
            names[index]: {k: v - counters_before[index][k] for k, v in _link_counters(link).items()}
            for index, link in enumerate(self.links)
        }
        round_.timing["codec_s"] = sum(t.pop("codec_s") for t in traffic.values())
        return {
            "round": round_.round,
            "participants": [names[index] for index in round_.participants],
            "metrics": {name: evaluated.get(name, dict.fromkeys(metric_names, math.nan)) for name in names},
            "mean": {name: float(np.mean([m[name] for m in evaluated.values()])) for name in metric_names},
            "train_loss": round_.train_loss,
            "adapt_loss": round_.adapt_loss,
            "compute": {name: round_.compute[name] for name in names if round_.compute.get(name)},
            "bytes": traffic,
            "server": self.server.metrics(),
            "timing": round_.timing,
            "failures": [round_.failures[index] for index in sorted(round_.failures)],
            "excluded": newly_excluded,
            **({"client_dp": self.client_dp.round_record()} if self.client_dp is not None else {}),
        }

    def _checked_sum(self, ctx: RoundContext, fail: Callable[[int, str, str], None]) -> Payload | None:
        """The sites' summed replies of the phase (secure aggregation), checked as one reply of the server half's
        declared keys holding at most the summed sites' declared samples; None where there is none. A sum that is
        refused fails every site in it (no site can be taken out of a sum)."""
        summed = self.sites.summed_replies()
        if summed is None:
            return None
        declared = sum(self.sites.declared_samples[index] for index in summed.sites)
        reason = reply_fault(summed.reply, self.server, ctx, summed.sites[0], declared)
        if reason is not None:
            for index in summed.sites:
                fail(index, ctx.phase, f"the securely summed reply of sites {summed.sites} is refused: {reason}")
            return None
        return summed.reply

    def _adapt_failed(self, index: int, round_index: int, reason: str, failures: dict[int, dict[str, Any]]) -> None:
        """Site ``index``'s adapt step raised: it fails the round (unless it already had), or the run stops.

        It was put back to what the delivery left and evaluated unadapted;
        nothing of the round's server step depends on it.
        """
        name = self.site_names[index]
        if self.on_site_failure == "stop":
            raise SiteFailure(f"site {name} failed in round {round_index} ({ADAPT} phase): {reason}")
        warn(f"round {round_index}: site {name} failed its {ADAPT} step and is evaluated unadapted: {reason}")
        failures.setdefault(index, {"round": round_index, "site": name, "phase": ADAPT, "reason": reason})

    def _delivery_failed(self, index: int, round_index: int, reason: str, failures: dict[int, dict[str, Any]]) -> None:
        """Site ``index``'s delivery reply could not be read: it fails the round (unless it already had), its
        metrics of the round are NaN; or the run stops. Its state is what its delivery left."""
        name = self.site_names[index]
        if self.on_site_failure == "stop":
            raise SiteFailure(f"site {name} failed in round {round_index} ({DELIVER} phase): {reason}")
        warn(f"round {round_index}: site {name} failed its {DELIVER} phase, its metrics of the round are missing: {reason}")
        failures.setdefault(index, {"round": round_index, "site": name, "phase": DELIVER, "reason": reason})

    def _count_failures(self, participants: list[int], failures: dict[int, dict[str, Any]]) -> list[str]:
        """Update the run of failing rounds of each participant (and each site whose adapt step failed);
        exclude those reaching the limit (returns their names)."""
        newly_excluded = []
        for index in participants:
            if index not in failures:
                self.failure_streaks[index] = 0
                continue
            self.failure_streaks[index] += 1
            streak = self.failure_streaks[index]
            name = self.site_names[index]
            if self.max_consecutive_failures is not None and streak >= self.max_consecutive_failures and name not in self.excluded:
                failure = failures[index]
                self.excluded[name] = {"round": failure["round"], "reason": failure["reason"]}
                newly_excluded.append(name)
                warn(
                    f"round {failure['round']}: site {name} excluded from the rest of the run "
                    f"after failing {streak} rounds in a row"
                )
        return newly_excluded

    def _deliver(self, evaluate: bool, timing: dict[str, float] | None = None) -> dict[str, SiteEvaluation]:
        """Every site receives the server's delivery; with ``evaluate``, each adapts and is evaluated (``timing["eval_s"]``)."""
        ctx = RoundContext(self.round, DELIVER)
        payloads = {index: self.server.deliver(ctx, index) for index in range(len(self.site_names))}
        if self.client_dp is not None:
            self._sent = payloads
        return self.sites.deliver(self.round, payloads, evaluate, timing)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, and the torch thread count it ran with."""
        return {
            "round": self.round,
            "history": self.history,
            "sites": self.sites.state_dict(),
            "links": [link.state_dict() for link in self.links],
            "server": self.server.state_dict(),
            "failure_streaks": list(self.failure_streaks),
            "excluded": dict(self.excluded),
            "num_threads": torch.get_num_threads(),
            **({"client_dp": self.client_dp.state_dict()} if self.client_dp is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; warns if the checkpoint was written with another torch thread count.

        Float reductions split over another number of threads may round
        differently, so the resumed run may then differ in the last bits
        from an uninterrupted one (``trainer.num_threads`` fixes the count).
        """
        if state["num_threads"] != torch.get_num_threads():
            warn(
                f"resuming with {torch.get_num_threads()} torch threads, the checkpoint was written with "
                f"{state['num_threads']}: the results may differ slightly from an uninterrupted run "
                "(set trainer.num_threads to fix the count)"
            )
        self.round = state["round"]
        self.history = list(state["history"])
        self.failure_streaks = list(state["failure_streaks"])
        self.excluded = dict(state["excluded"])
        self.sites.load_state_dict(state["sites"])
        for link, link_state in zip(self.links, state["links"], strict=True):
            link.load_state_dict(link_state)
        self.server.load_state_dict(state_on_device(state["server"], self.fabric.device))
        if self.client_dp is not None:  # its accountant, and the deliveries the next round's updates are measured against
            self.client_dp.load_state_dict(state["client_dp"])
            ctx = RoundContext(self.round, DELIVER)
            self._sent = {index: self.server.deliver(ctx, index) for index in range(len(self.site_names))}


@dataclass
class _Round:
    """A round in progress: who takes part, and what its record gathers (losses, compute, failures, timing)."""

    round: int
    participants: list[int]
    timing: dict[str, float] = field(default_factory=lambda: {"train_s": 0.0, "server_s": 0.0, "eval_s": 0.0, "round_start_s": 0.0})
    train_loss: dict[str, dict[str, float]] = field(default_factory=dict)
    adapt_loss: dict[str, dict[str, float]] = field(default_factory=dict)
    compute: dict[str, dict[str, float]] = field(default_factory=dict)  # site name -> {key: epochs}
    failures: dict[int, dict[str, Any]] = field(default_factory=dict)  # site index -> {"round", "site", "phase", "reason"}


def _link_counters(link: Link) -> dict[str, float]:
    """A link's running totals: bytes sent and their dense float32 size per direction, codec time."""
    return {
        "up": link.bytes_sent["up"],
        "down": link.bytes_sent["down"],
        "dense_up": link.dense_bytes["up"],
        "dense_down": link.dense_bytes["down"],
        "codec_s": link.codec_seconds,
    }


def _flatten_for_logging(record: dict[str, Any]) -> dict[str, float]:
    """Round record -> flat ``{"site0/iou": ..., "site0/train_loss": ..., "mean/iou": ..., "bytes/up": ...}`` for loggers.

    A site's mean training loss is ``site/train_loss``, or
    ``site/train_loss/<phase>`` per phase when it trained in several.
    """
    flat: dict[str, float] = {}
    for site, metrics in record["metrics"].items():
        for name, value in metrics.items():
            flat[f"{site}/{name}"] = value
    for site, losses in record["train_loss"].items():
        for phase, loss in losses.items():
            flat[f"{site}/train_loss" if len(losses) == 1 else f"{site}/train_loss/{phase}"] = loss
    for name, value in record["mean"].items():
        flat[f"mean/{name}"] = value
    for direction in ("up", "down"):
        sent = float(sum(b[direction] for b in record["bytes"].values()))
        dense = float(sum(b[f"dense_{direction}"] for b in record["bytes"].values()))
        flat[f"bytes/{direction}"] = sent
        if sent:
            flat[f"compression_ratio/{direction}"] = dense / sent
    for site, losses in record.get("adapt_loss", {}).items():
        for label, loss in losses.items():
            flat[f"{site}/adapt_loss" if label == ADAPT else f"{site}/adapt_loss/{label.split('/', 1)[1]}"] = loss
    for site, counts in record.get("compute", {}).items():
        for key, epochs in counts.items():
            flat[f"{site}/compute/{key}"] = epochs
        flat[f"{site}/compute/training_epochs"] = training_epochs(counts)
    for site, traffic in record["bytes"].items():
        for direction in ("up", "down"):
            flat[f"{site}/bytes_{direction}"] = float(traffic[direction])
    for name, value in record["server"].items():
        flat[f"server/{name}"] = float(value)
    for name, value in record["timing"].items():
        flat[f"time/{name}"] = value
    for site, privacy in record.get("privacy", {}).items():  # DP-SGD (medfed.federated.privacy)
        flat[f"privacy/{site}/epsilon"] = float(privacy["epsilon"])
    if "client_dp" in record:  # client-level DP (medfed.federated.privacy.ClientDP)
        flat["privacy/client_dp/epsilon"] = float(record["client_dp"]["epsilon"])
    failed = {failure["site"] for failure in record["failures"]}
    for site in record["metrics"]:
        flat[f"{site}/failed"] = float(site in failed)
    return flat


def _excluded_summary(excluded: dict[str, dict[str, Any]]) -> str:
    """``site1 after round 3: <reason>; ...``."""
    return "; ".join(f"{site} after round {info['round']}: {info['reason']}" for site, info in excluded.items())
