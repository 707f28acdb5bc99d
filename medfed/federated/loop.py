"""The federated loop: rounds of local training and server steps, on Lightning Fabric.

Lightning 2.x's documented route to a custom loop is Fabric: the loop here
owns the sites (each a LightningModule + optimiser kept across rounds),
calls the strategy's hooks by name (see
:mod:`medfed.federated.strategies.base` for the life cycle) and knows nothing
about any particular algorithm. Every payload crosses a
:class:`~medfed.federated.link.Link`, which turns it into bytes and counts
them. After each round every site is evaluated on its own test split (its
validation split with ``federation.holdout: validation``), the metrics go to
Fabric's loggers, extra callbacks get ``on_round_end``, and a
checkpoint is written atomically. A site's part of each phase runs with the
global generators seeded for it (:meth:`~medfed.federated.site.Site.global_rng`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric

from medfed.errors import warn
from medfed.federated.link import Link
from medfed.federated.site import Site
from medfed.federated.strategies.base import DELIVER, Payload, Strategy


class FederatedLoop:
    """Runs a strategy over a federation of sites.

    Args:
        fabric: device placement, loggers and callbacks (``on_round_end``).
        sites: the sites, index order.
        strategy: the algorithm.
        links: one link per site (same order).
        initial: the initial model as vectors ``{"shared", "personal", "all"}``
            (every site starts from it).
        local_epochs: local epochs per round; a phase trains its
            ``strategy.site_epoch_share(phase)`` of them (by default all).
        participation: fraction of sites taking part in each round; the
            participants of round r are a seeded draw from (seed, r).
        seed: the run's seed.
        save_checkpoint: called with the loop's state after every round.
    """

    def __init__(
        self,
        fabric: Fabric,
        sites: list[Site],
        strategy: Strategy,
        links: list[Link],
        initial: Payload,
        local_epochs: int,
        participation: float,
        seed: int,
        save_checkpoint: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.fabric = fabric
        self.sites = sites
        self.strategy = strategy
        self.links = links
        self.initial = initial
        self.local_epochs = local_epochs
        self.participation = participation
        self.seed = seed
        self.save_checkpoint = save_checkpoint
        self.round = 0
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ public
    def setup(self) -> None:
        """Round 0: setup payloads up, server setup, first delivery down."""
        replies = {site.index: self.links[site.index].send("up", self.strategy.site_setup(site)) for site in self.sites}
        self.strategy.server_setup(self.initial, replies)
        self._deliver()

    def fit(self, rounds: int, progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Run rounds ``self.round + 1 .. rounds``; returns the per-round history."""
        if self.round == 0 and not self.history:
            self.setup()
        while self.round < rounds:
            self.round += 1
            record = self._run_round(self.round)
            self.history.append(record)
            self.fabric.log_dict(_flatten_for_logging(record), step=self.round)
            self.fabric.call("on_round_end", loop=self, record=record)
            if self.save_checkpoint is not None:
                self.save_checkpoint(self.state_dict())
            if progress is not None:
                progress(record)
        return self.history

    def participants(self, round_index: int) -> list[Site]:
        """The sites taking part in ``round_index`` (all of them at participation 1)."""
        n = len(self.sites)
        k = max(1, math.ceil(self.participation * n - 1e-9))
        if k >= n:
            return list(self.sites)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, round_index, 0x5E1EC7]))
        chosen = sorted(rng.choice(n, size=k, replace=False).tolist())
        return [self.sites[i] for i in chosen]

    # ------------------------------------------------------------------ one round
    def _run_round(self, round_index: int) -> dict[str, Any]:
        start = time.perf_counter()
        counters_before = [_link_counters(link) for link in self.links]
        participants = self.participants(round_index)
        timing = {"train_s": 0.0, "server_s": 0.0, "eval_s": 0.0}
        train_loss: dict[str, dict[str, float]] = {}
        epochs_before = 0.0  # epochs of this round's earlier phases
        for phase_index, phase in enumerate(self.strategy.phases):
            epochs = self.local_epochs * self.strategy.site_epoch_share(phase)
            # Sites would train at the same time; simulated one after another,
            # the messages of a phase still cross the links together, before
            # and after all local training: coding them back to back keeps
            # CER's two-core solver clear of the OpenMP workers PyTorch leaves
            # spinning for milliseconds after training. Each message is released
            # as its site receives it, each raw reply as it is sent, so a phase
            # holds one model-sized vector per reply, raw or received, not both.
            messages = {
                site.index: self.links[site.index].send("down", self.strategy.server_message(phase, site.index))
                for site in participants
            }
            outgoing = {}
            for site in participants:
                stream = (round_index, phase_index)
                loss, outgoing[site.index] = self._site_work(site, phase, messages.pop(site.index), epochs, epochs_before, stream, timing)
                if loss is not None:
                    train_loss.setdefault(site.name, {})[phase] = loss
            replies = {index: self.links[index].send("up", outgoing.pop(index)) for index in sorted(outgoing)}
            tic = time.perf_counter()
            self.strategy.server_aggregate(phase, replies)
            timing["server_s"] += time.perf_counter() - tic
            epochs_before += epochs
        self._deliver()
        tic = time.perf_counter()
        metrics = {site.name: site.evaluate() for site in self.sites}
        timing["eval_s"] = time.perf_counter() - tic
        timing["round_s"] = time.perf_counter() - start
        traffic = {
            site.name: {k: v - counters_before[site.index][k] for k, v in _link_counters(self.links[site.index]).items()}
            for site in self.sites
        }
        timing["codec_s"] = sum(t.pop("codec_s") for t in traffic.values())
        names = next(iter(metrics.values())).keys()
        return {
            "round": round_index,
            "participants": [site.name for site in participants],
            "metrics": metrics,
            "mean": {name: float(np.mean([m[name] for m in metrics.values()])) for name in names},
            "train_loss": train_loss,
            "bytes": traffic,
            "server": self.strategy.server_metrics(),
            "timing": timing,
        }

    def _site_work(
        self, site: Site, phase: str, message: Payload, epochs: float, after: float, stream: tuple[int, ...], timing: dict[str, float]
    ) -> tuple[float | None, Payload]:
        """A site's part of a phase, its global generators seeded from ``stream``: receive, train, reply.

        Returns the mean training loss (``None``: nothing trained) and the
        reply; adds the training time to ``timing["train_s"]``.
        """
        with site.global_rng(*stream):
            self.strategy.site_receive(site, phase, message)
            tic = time.perf_counter()
            loss = site.train(
                epochs, self.strategy.site_trainable(phase), lambda batch: self.strategy.site_loss(site, phase, batch), after=after
            )
            timing["train_s"] += time.perf_counter() - tic
            return loss, self.strategy.site_reply(site, phase)

    def _deliver(self) -> None:
        for site in self.sites:
            payload = self.links[site.index].send("down", self.strategy.server_deliver(site.index))
            self.strategy.site_receive(site, DELIVER, payload)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, and the torch thread count it ran with."""
        return {
            "round": self.round,
            "history": self.history,
            "sites": [site.state_dict() for site in self.sites],
            "links": [link.state_dict() for link in self.links],
            "server": self.strategy.server_state_dict(),
            "num_threads": torch.get_num_threads(),
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
        for site, site_state in zip(self.sites, state["sites"], strict=True):
            site.load_state_dict(site_state)
        for link, link_state in zip(self.links, state["links"], strict=True):
            link.load_state_dict(link_state)
        self.strategy.load_server_state_dict(state["server"])


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
    """Round record -> flat ``{"site0/iou": ..., "mean/iou": ..., "bytes/up": ...}`` for loggers."""
    flat: dict[str, float] = {}
    for site, metrics in record["metrics"].items():
        for name, value in metrics.items():
            flat[f"{site}/{name}"] = value
    for name, value in record["mean"].items():
        flat[f"mean/{name}"] = value
    for direction in ("up", "down"):
        sent = float(sum(b[direction] for b in record["bytes"].values()))
        dense = float(sum(b[f"dense_{direction}"] for b in record["bytes"].values()))
        flat[f"bytes/{direction}"] = sent
        if sent:
            flat[f"compression_ratio/{direction}"] = dense / sent
    for site, traffic in record["bytes"].items():
        for direction in ("up", "down"):
            flat[f"{site}/bytes_{direction}"] = float(traffic[direction])
    for name, value in record["server"].items():
        flat[f"server/{name}"] = float(value)
    for name, value in record["timing"].items():
        flat[f"time/{name}"] = value
    return flat
