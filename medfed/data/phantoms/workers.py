"""A generator's cases on the machine's cores: each case in a worker process, the results in the cases' order.

Every generated case (a BraTS subject, a LUNA16 series) is drawn from its own
seeded stream, so cases made in any order, by any process, are the cases one
process makes in turn: :func:`map_cases` only changes how long it takes.
Workers are forked where the system can (Linux: nothing is imported again,
and a caller's script without a ``__main__`` guard is not run again in each
worker, as a spawned one would be; a case needs only NumPy, SciPy and the
image writers, none of the caller's torch threads), spawned elsewhere; each
is given the generator's shared inputs once (``shared``: e.g. the anatomy
maps, computed once by the caller) and then as many cases as it can take. A generation too small to repay the workers'
start (``work`` below :data:`PARALLEL_WORK`) runs in this process.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm

PARALLEL_WORK = 20.0
"""The least work (in cases of the default size, about a second each) worth starting worker processes for (each
takes a second or two to start and import the generator)."""

_shared: Any = None  # a worker's copy of the caller's shared inputs


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_cases(
    make: Callable[[Any, Any], Any], cases: list[Any], shared: Any, work: float, description: str, progress: bool
) -> list[Any]:
    """``[make(shared, case) for case in cases]``, the cases spread over the available cores where ``work`` repays it.

    Args:
        make: makes (and writes) one case; a module-level function (workers import it by name).
        cases: what tells ``make`` which case to make (picklable).
        shared: every case's common input (picklable), sent to each worker once.
        work: the generation's size in cases of the default size (:data:`PARALLEL_WORK`).
        description: the progress bar's label.
        progress: show a progress bar over the cases.

    Returns:
        ``make``'s results, in the order of ``cases``.
    """
    workers = min(available_cores(), len(cases)) if work >= PARALLEL_WORK else 1
    bar = tqdm(total=len(cases), desc=description, unit="case", disable=not progress)
    try:
        if workers <= 1:
            results = []
            for case in cases:
                results.append(make(shared, case))
                bar.update()
            return results
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_receive, initargs=(shared,)) as pool:
            futures = [pool.submit(_make, make, case) for case in cases]
            for _ in as_completed(futures):
                bar.update()
            return [future.result() for future in futures]
    finally:
        bar.close()


def _receive(shared: Any) -> None:
    global _shared
    _shared = shared


def _make(make: Callable[[Any, Any], Any], case: Any) -> Any:
    return make(_shared, case)
