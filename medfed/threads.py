"""How many torch threads a run computes with when ``trainer.num_threads`` is unset: the cores actually free.

torch's default takes every core the process may run on. On a machine doing
other work that oversubscribes the cores: torch's OpenMP workers wait for
one another while the other work holds a core, and a round of brats_lack0 on
a busy 2-core machine took 22.8-70.8 s of training with 2 threads against
3.2-4.4 s with 1, same metrics (issue 23). So the count is

    threads = min(cores, max(1, floor(cores - load + 1/4)))

with ``cores`` the CPUs this process may run on (``os.sched_getaffinity``)
and ``load`` the system's 1-minute load average (runnable processes; the run
has not started computing when it is read): every core a thread only on an
idle machine (a 2-core machine gets 2 threads at a load up to 0.25, else 1),
and 1 where the load cannot be read. A resumed run takes the count its
checkpoint was written with, so it continues bit for bit (float reductions
split over another number of threads round differently).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and, in words, why (printed in the run's first lines, kept in results.json)."""

    threads: int
    reason: str


def choose_threads(configured: int | None, checkpoint_threads: int | None = None) -> ThreadChoice:
    """The run's torch thread count: ``configured`` if set, else the checkpoint's, else the free cores (module docstring).

    Args:
        configured: ``trainer.num_threads`` (``None``: unset).
        checkpoint_threads: the count the resumed checkpoint was written with (``None``: a new run).
    """
    if configured is not None:
        return ThreadChoice(configured, "trainer.num_threads")
    if checkpoint_threads is not None:
        return ThreadChoice(checkpoint_threads, "as the resumed checkpoint was written; set trainer.num_threads to change")
    cores = _usable_cores()
    try:
        load = os.getloadavg()[0]
    except OSError:  # the system does not say: one thread cannot oversubscribe
        return ThreadChoice(1, f"{cores} core(s), load unknown; set trainer.num_threads to change")
    threads = min(cores, max(1, math.floor(cores - load + 0.25)))
    return ThreadChoice(threads, f"{cores} core(s), load average {load:.2f}; set trainer.num_threads to change")


def _usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
