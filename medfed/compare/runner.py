"""Running a comparison's runs: each ``medfed fit`` in a process of its own, ``jobs`` at a time.

Each run is a process forked from a *run server* (``multiprocessing``'s
forkserver) that imported medfed, torch, Lightning and MONAI once, so a run
starts in a fraction of a second instead of ~10 s; see :func:`execute`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm.auto import tqdm

from medfed.compare.plan import Run
from medfed.console import one_line_errors, show_warnings
from medfed.errors import INTERRUPTED
from medfed.fit import fit

TAIL_LINES = 5
"""Lines of a failed run's log shown in its report."""
RUN_SERVER_PRELOAD = ("medfed.compare.run_server", "medfed.compare.runner", "medfed.experiment", "medfed.tasks.brats", "medfed.tasks.luna16", "medfed.tasks.clinical")
"""Modules the run server imports once, so a run does not spend ~10 s importing torch, Lightning and MONAI again
(the first makes the server die with compare)."""


def execute(runs: list[Run], jobs: int, progress: bool = True) -> dict[str, str]:
    """Run every run not ``done``, ``jobs`` at a time, each ``medfed fit`` in its own process.

    Each run is a process forked from a *run server* (``multiprocessing``'s
    forkserver) that imported medfed, torch, Lightning and MONAI once: the
    run is as isolated as ``python -m medfed fit`` in a fresh interpreter
    (own memory, seeds, thread count) but starts in a fraction of a second
    instead of ~10 s. torch's threads are each run's ``trainer.num_threads``;
    the libraries that read ``OMP_NUM_THREADS`` once, at import (OpenMP,
    BLAS, numba), read it in the server, which is started with it set to
    the new runs' count (a server already running in this process, from an
    earlier ``execute``, keeps its own). A run's output (stdout and stderr) goes to its ``log``,
    beside the run folders. On Ctrl-C no further run starts, the running
    ones get SIGINT (each checkpoints and stops) and KeyboardInterrupt is
    raised. If this process ends any other way (``kill -9`` included), the
    run server and every run end with it within moments
    (:func:`_die_with_compare`): finished rounds are checkpointed and the
    next ``compare`` resumes them.

    Returns:
        ``{run name: why it failed}`` of the runs that failed (:func:`failure_reason`).
    """
    todo = [run for run in runs if run.action != "done"]
    failed: dict[str, str] = {}
    running: dict[str, multiprocessing.process.BaseProcess] = {}
    lock = threading.Lock()
    stopping = threading.Event()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RUN_SERVER_PRELOAD))
    if todo:
        _start_run_server(min(run.threads for run in todo))
    alive, alive_writer = context.Pipe(duplex=False)  # the writer stays in this process only: the runs see EOF once it ends
    bar = tqdm(total=len(todo), desc="runs", unit="run", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=jobs)
    futures = {pool.submit(_fit, context, run, alive, running, lock, stopping): run for run in todo}
    try:
        for future in as_completed(futures):
            run = futures[future]
            code, tail = future.result()
            if code != 0:
                failed[run.name] = tail
                tqdm.write(f"medfed: run {run.name} failed (exit status {code}): {tail}", file=sys.stderr)
            bar.update()
            bar.set_postfix(failed=len(failed))
    except KeyboardInterrupt:
        stopping.set()
        with lock:
            for process in running.values():
                if process.pid is not None:
                    os.kill(process.pid, signal.SIGINT)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        alive_writer.close()
        alive.close()
    return failed


def _start_run_server(threads: int) -> None:
    """Start the forkserver (if it is not running) with ``OMP_NUM_THREADS=threads`` in its environment; this process's is left as it was.

    The server dies with the thread that starts it (:mod:`medfed.compare.run_server`): call this from the thread
    that runs the whole comparison (the command line's main thread)."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def _fit(
    context: Any, run: Run, alive: Any, running: dict[str, Any], lock: threading.Lock, stopping: threading.Event
) -> tuple[int, str]:
    """One run as a ``fit`` process forked from the run server; ``(exit status, why it failed)``."""
    run.log.parent.mkdir(parents=True, exist_ok=True)
    with lock:
        if stopping.is_set():
            return INTERRUPTED, "not started (interrupted)"
        status_reader, status_writer = context.Pipe(duplex=False)
        process = context.Process(target=_fit_in_run_server_child, args=(run, alive, status_writer), name=run.name)
        process.start()
        status_writer.close()
        running[run.name] = process
    process.join()
    with lock:
        del running[run.name]
    # fit's exit status as the run reported it: the forkserver's own report can be lost (Python 3.11 gave 255 for a run that ended with 0)
    try:
        code = status_reader.recv()
    except EOFError:  # it ended before fit returned (a crash, a signal): the process's own status
        code = process.exitcode
    status_reader.close()
    code = 1 if code is None else 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell reports it
    return code, failure_reason(run.log.read_text(errors="replace").splitlines())


def failure_reason(lines: list[str]) -> str:
    """Why a run failed, from its log's lines: its last ``medfed: error:`` line (what fit said went wrong; the info and
    warning lines before it are not the reason), else (a traceback, a crash) its last :data:`TAIL_LINES` lines."""
    lines = [line for line in lines if line.strip()]
    errors = [line for line in lines if line.startswith("medfed: error: ")]
    return errors[-1] if errors else " | ".join(lines[-TAIL_LINES:])


def _fit_in_run_server_child(run: Run, alive: Any, status: Any) -> None:
    """The run's process: stdout and stderr to its log, then ``medfed fit --quiet``; fit's exit status goes to
    ``status`` (a pipe's end) and is the process's. It ends at once when compare ends (``alive``: :func:`_die_with_compare`)."""
    _die_with_compare(alive)
    descriptor = os.open(run.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    show_warnings()
    try:
        code = one_line_errors(lambda: fit(str(run.config_path), list(run.overrides), resume=run.action == "resume", quiet=True))
    except KeyboardInterrupt:
        code = INTERRUPTED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    status.send(code)
    sys.exit(code)


PR_SET_PDEATHSIG = 1
"""Linux's prctl option: the signal the kernel sends this process when the thread that started it ends."""


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process the moment its parent ends (elsewhere, nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _die_with_compare(alive: Any) -> None:
    """End this run process (SIGKILL) as soon as the compare process ends, however it ends.

    Two guards: the kernel kills it when its parent, the run server, ends
    (:func:`die_with_parent`; the run server dies with compare, see
    :mod:`medfed.compare.run_server`); and a thread waits on ``alive``, the
    read end of a pipe whose only writer is the compare process, and kills
    this process at its EOF: that also covers a compare (or run server) that
    ended before this process started listening, and systems without prctl.
    """
    die_with_parent()

    def wait_for_eof() -> None:
        with contextlib.suppress(EOFError, OSError):
            alive.recv_bytes()  # nothing is ever sent: this returns at EOF
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_eof, name="die-with-compare", daemon=True).start()
