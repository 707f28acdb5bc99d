"""Runs fused into one process: each run's loop in a thread of its own, their training rows stacked as one.

Runs of a grid that share a strategy and a model shape (seeds, tuning
points, budgets) train the same kind of rows round after round.
:class:`FusedTraining` runs them side by side: every run is a thread
(:meth:`FusedTraining.run_all`) that runs its whole ``fit`` (data, loop,
server steps, evaluation, checkpoints, results.json) as it would alone; its
executor is a :class:`FusedExecutor`, which hands each list of rows
(:class:`~medfed.federated.executor.Row`) to the coordinator and waits.
Once every live run waits, the coordinator trains all the waiting rows with
one :class:`~medfed.federated.batched.BatchedExecutor`: rows of the same
round context and strategy options (which the loss reads as plain numbers)
go to it together, and it stacks those of equal group key (strategy half,
plan, model shapes and modes), rows = runs x sites, each row keeping its
own parameters, optimiser state and learning rate, loss state, data order,
dropout keys and number of steps. Each run then goes on with its own rows'
outcomes.

One run's thread runs at a time (a baton passed only while a run waits, and
the rows trained while every run waits), so nothing a run draws from the
global generators, inside its sites' seeded streams, can be interleaved
with another's: each run computes what it would alone, its stacked steps to
float tolerance (as the batched executor alone). The rows are trained by the
coordinator's thread, always the same one (on CUDA a captured graph is
replayed, never recorded again by another thread); a stacked step that
raises trains its rows one at a time (the batched executor's own fallback),
and a run whose code raises ends its thread while the others go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from medfed.federated.batched import BatchedExecutor
from medfed.federated.executor import Outcome, Row

_local = threading.local()


def current() -> FusedTraining | None:
    """The coordinator of the run this thread runs (None: a run alone)."""
    return getattr(_local, "coordinator", None)


@dataclass
class _Request:
    """One run's rows, waiting to be trained: their outcomes and the run's share of the training time, once trained."""

    rows: list[Row]
    compile: bool
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class FusedTraining:
    """The coordinator of a process's fused runs (module docstring)."""

    def __init__(self) -> None:
        self._baton = threading.Lock()  # held by the run thread that runs
        self._changed = threading.Condition()  # a run waits, or ends
        self._alive = 0
        self._pending: list[_Request] = []
        #: the executors that train the waiting rows, by trainer.compile (their compiled steps kept from round to round)
        self.executors: dict[bool, BatchedExecutor] = {}
        #: the runs fused (:meth:`run_all`)
        self.runs = 0

    def run_all(self, bodies: list[Callable[[], Any]]) -> list[BaseException | None]:
        """Run every body (a run's whole fit) in a thread of its own, fused; each one's exception, or None.

        Every run is registered before any starts, so the first rows already wait for all of them. This thread
        trains the waiting rows whenever every live run waits.
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
            self._train(pending)
        for started in threads:
            started.join()
        return errors

    def train(self, rows: list[Row], compile: bool) -> tuple[list[Outcome], float]:
        """Hand a run's rows to the coordinator (from that run's thread), wait until they are trained with every
        waiting run's: their outcomes, and the run's share of the training time (its rows' share)."""
        request = _Request(rows, compile)
        with self._changed:
            self._pending.append(request)
            self._changed.notify()
        self._baton.release()
        request.done.wait()
        self._baton.acquire()
        return request.outcomes, request.seconds

    def _train(self, pending: list[_Request]) -> None:
        """Train the waiting runs' rows, those of one round context, strategy options and compile flag together, and
        wake every waiting run."""
        try:
            together: dict[Any, list[tuple[_Request, int]]] = {}
            for request in pending:
                request.outcomes = [None] * len(request.rows)
                for index, row in enumerate(request.rows):
                    key = (request.compile, row.ctx, repr(getattr(row.site.strategy, "options", None)))
                    together.setdefault(key, []).append((request, index))
            for (compile, *_), members in together.items():
                executor = self.executors.setdefault(compile, BatchedExecutor(compile))
                tic = time.perf_counter()
                outcomes = executor.train([request.rows[index] for request, index in members])
                share = (time.perf_counter() - tic) / len(members)
                for (request, index), outcome in zip(members, outcomes, strict=True):
                    request.outcomes[index] = outcome
                    request.seconds += share
        except Exception as error:  # whatever happened, it fails the rows it reached, and no run waits for ever
            for request in pending:
                request.outcomes = [f"{type(error).__name__}: {error}" if outcome is None else outcome for outcome in request.outcomes]
        finally:
            for request in pending:
                request.done.set()

    def sequential_plans(self) -> dict[str, str]:
        """Which plans the coordinator's executors trained one row at a time, and why."""
        return {plan: reason for executor in self.executors.values() for plan, reason in executor.sequential_plans.items()}


class FusedExecutor:
    """A fused run's executor (:class:`~medfed.federated.executor.Executor`): its rows trained by the coordinator.

    Args:
        coordinator: the process's :class:`FusedTraining`.
        compile: ``trainer.compile`` (the compiled static-shape step, :mod:`medfed.federated.stacked`).
    """

    name = "batched"

    def __init__(self, coordinator: FusedTraining, compile: bool = False) -> None:
        self.coordinator = coordinator
        self.compile = compile
        self._waited = 0.0

    def train(self, rows: list[Row]) -> list[Outcome]:
        tic = time.perf_counter()
        outcomes, seconds = self.coordinator.train(rows, self.compile)
        self._waited += time.perf_counter() - tic - seconds
        return outcomes

    def take_waited(self) -> float:
        """Seconds spent waiting for the other runs since the last call (less this run's share of the training)."""
        waited, self._waited = self._waited, 0.0
        return waited

    def record(self) -> dict[str, object]:
        return {"name": self.name, "sequential_plans": self.coordinator.sequential_plans(), "fused": {"runs": self.coordinator.runs}}
