"""Runs fused into one process: each run's loop in a thread of its own, their stacked groups trained as one step.

Runs of a grid that share a strategy and a model shape (seeds, tuning
points, budgets) train the same kind of stacked group round after round.
:class:`FusedTraining` runs them side by side: every run is a thread
(:meth:`FusedTraining.run`) that runs its whole ``fit`` (data, loop, server
steps, evaluation, checkpoints, results.json) as it would alone, and where
its batched executor would train a stacked group
(:meth:`~medfed.federated.executor.InProcessSites.work`) it hands the group
to the coordinator (:meth:`FusedTraining.train`) and waits. Once every
live run waits, the groups are merged: groups of equal key (strategy half,
plan, round context, model shapes and modes, options; each row keeps its own
parameters, optimiser state and learning rate, loss state, data order,
dropout keys and number of steps) train as one stacked group, rows = runs x
sites (:func:`~medfed.federated.batched.train_group`); the others as they
would alone. Each run then goes on with its own results.

One run's thread runs at a time (a baton passed only while a run waits, and
the merged groups trained while every run waits), so nothing a run draws from
the global generators, inside its sites' seeded streams, can be interleaved
with another's: each run computes what it would
alone, the stacked steps to float tolerance (as the batched executor alone).
A group no other run's shares, and a merged group whose step raises (put back
first), trains in its own run's thread as it would alone (its own fallback to
one site at a time included); a run whose code raises ends its thread, and the
others go on without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_local = threading.local()


def current() -> FusedTraining | None:
    """The coordinator of the run this thread runs (None: a run alone)."""
    return getattr(_local, "coordinator", None)


@dataclass
class Request:
    """One run's stacked group, waiting to be trained.

    Attributes:
        key: what the groups merged with it share (the executor's merge key).
        sites, ctx, plan, steps, keys, compute: the group, as :func:`~medfed.federated.batched.train_group` takes it.
        indices: the sites' indices in their run.
        compile: train it by the compiled static-shape step.
        alone: trains the group as the run alone would (with its fallbacks); its outcomes.
        outcome: a site's outcome of its mean loss, ``outcome(site, mean)`` (a non-finite mean: its error).
        outcomes: ``{index: outcome}``, once trained.
        seconds: the run's share of the training time (its rows' share of a merged group's).
    """

    key: Any
    sites: list[Any]
    ctx: Any
    plan: Any
    steps: list[int]
    keys: list[Any]
    compute: str | None
    indices: list[int]
    compile: bool
    alone: Callable[[], dict[int, Any]]
    outcome: Callable[[Any, float], Any]
    outcomes: dict[int, Any] | None = None
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class FusedTraining:
    """The coordinator of a process's fused runs (module docstring)."""

    def __init__(self) -> None:
        self._baton = threading.Lock()  # held by the run thread that runs
        self._changed = threading.Condition()  # a run waits, or ends
        self._alive = 0
        self._pending: list[Request] = []
        self._compiled: dict[Any, Any] = {}  # merged groups' compiled steps, kept from round to round
        #: the runs fused (:meth:`run_all`)
        self.runs = 0
        #: stacked groups trained merged (and their rows) and alone: how much fused
        self.stats = {"merged_groups": 0, "merged_rows": 0, "alone_groups": 0}

    def run_all(self, bodies: list[Callable[[], Any]]) -> list[BaseException | None]:
        """Run every body (a run's whole fit) in a thread of its own, fused; each one's exception, or None.

        Every run is registered before any starts, so the first groups already wait for all of them. This
        thread trains the merged groups whenever every live run waits (one thread: on CUDA its captured graphs
        are replayed, never recorded again by another thread).
        """
        errors: list[BaseException | None] = [None] * len(bodies)
        self._alive = self.runs = len(bodies)

        def thread(index: int) -> None:
            _local.coordinator = self
            self._baton.acquire()
            try:
                bodies[index]()
            except BaseException as error:  # the run ends; the others go on
                errors[index] = error
            finally:
                _local.coordinator = None
                with self._changed:
                    self._alive -= 1
                    self._changed.notify()
                self._baton.release()

        threads = [threading.Thread(target=thread, args=(index,), name=f"medfed-fused-run-{index}", daemon=True) for index in range(len(bodies))]
        for started in threads:
            started.start()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._alive == 0 or len(self._pending) == self._alive)
                if self._alive == 0:
                    break
                pending, self._pending = self._pending, []
            self._fire(pending)
        for started in threads:
            started.join()
        return errors

    def train(self, request: Request) -> Request:
        """Hand a run's group to the coordinator (from that run's thread) and wait until it is trained: merged with
        other runs' groups, or, where none shares its key (or the merged step raised), by the run itself, alone."""
        with self._changed:
            self._pending.append(request)
            self._changed.notify()
        self._baton.release()
        request.done.wait()
        self._baton.acquire()
        if request.outcomes is None:  # in the run's own thread: what it says goes to its own log
            tic = time.perf_counter()
            request.outcomes = request.alone()
            request.seconds = time.perf_counter() - tic
            self.stats["alone_groups"] += 1
        return request

    def _fire(self, pending: list[Request]) -> None:
        """Train the waiting groups that share a key as one, and wake every waiting run (the others train alone)."""
        try:
            by_key: dict[Any, list[Request]] = {}
            for request in pending:
                by_key.setdefault(request.key, []).append(request)
            for requests in by_key.values():
                if len(requests) > 1:
                    self._train_merged(requests)
        finally:  # whatever happened, no run waits for ever
            for request in pending:
                request.done.set()

    def _train_merged(self, requests: list[Request]) -> bool:
        """Train the requests' groups as one; False (their sites as they were) where the merged step raised."""
        from medfed.federated.batched import train_group
        from medfed.federated.executor import _restore_data_orders, _saved_data_orders

        first = requests[0]
        sites = [site for request in requests for site in request.sites]
        saved = [_saved_data_orders(site) for site in sites]
        tic = time.perf_counter()
        try:
            means = train_group(
                sites, first.ctx, first.plan, [n for r in requests for n in r.steps], [k for r in requests for k in r.keys], first.compute,
                self._compiled if first.compile else None,
            )
        except Exception:
            for site, before in zip(sites, saved):
                _restore_data_orders(site, before)
            return False
        seconds = time.perf_counter() - tic
        start = 0
        for request in requests:
            count = len(request.sites)
            request.outcomes = {index: request.outcome(site, mean) for index, site, mean in zip(request.indices, request.sites, means[start : start + count])}
            request.seconds = seconds * count / len(sites)
            start += count
        self.stats["merged_groups"] += 1
        self.stats["merged_rows"] += len(sites)
        return True
