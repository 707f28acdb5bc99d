"""A Flower federation on this machine: one SuperLink, and per site a SuperNode and its runner, as child processes.

This is the rehearsal of a deployment (docs/deploy.md), used by the
integration tests and ``benchmarks/bench_deploy.py``: the same executables
(``flower-superlink``, ``flower-supernode --isolation process``, medfed's
resident ClientApp runner :mod:`medfed.deploy.runner`, ``flwr run``) a
hospital and the coordinating server run on their own machines, here on
loopback addresses with free ports and without TLS (``--insecure``). Each
process gets its own ``FLWR_HOME`` under the federation's work folder (Flower
keeps installed app bundles and its CLI config there) and writes its log
there. The SuperLink's SuperExec looks for a new ServerApp to start every
0.2 s instead of Flower's 1 s (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``).

Every process is started in a session of its own and stopped by its process
id (its group, whose id is that process id), SIGTERM first and SIGKILL after
``stop_timeout_s``. Flower starts the SuperLink's SuperExec, and the
SuperExec each run's ServerApp, in sessions of their own; they would exit
once their parent is gone (Flower watches it every 0.2 s), but they are not
left to that: their process ids are read (``/proc``) before the SuperLink
is stopped and each still running afterwards is stopped by its id too.
:meth:`LocalFederation.close` (or leaving the ``with`` block) stops whatever
is still running, whatever happened.

No flwr import here: the executables come from the ``deploy`` extra.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
CONNECTION = "medfed-local"
"""The name of the SuperLink connection written to the ``flwr`` CLI's config."""
SUPEREXEC_POLL_S = "0.2"
"""Seconds between the SuperLink's SuperExec's looks for a ServerApp to start (Flower's default: 1)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _listening(port: int) -> bool:
    """Whether something accepts connections on ``LOOPBACK:port``."""
    try:
        socket.create_connection((LOOPBACK, port), timeout=0.5).close()
    except OSError:
        return False
    return True


@dataclass
class Process:
    """A started child: its name (``superlink``, ``supernode-1``, ``runner-1``), process, log file and the port it serves or uses."""

    name: str
    popen: subprocess.Popen
    log: Path
    port: int

    @property
    def pid(self) -> int:
        """Its process id (also its process group's)."""
        return self.popen.pid

    def running(self) -> bool:
        """Whether it has not exited yet."""
        return self.popen.returncode is None and not _exited(self.pid)


class LocalFederation:
    """A SuperLink, SuperNodes and their runners on 127.0.0.1, started and stopped by process id.

    Args:
        work_dir: where each process's ``FLWR_HOME`` and log go (created).
        env: extra environment for every process (e.g. ``OMP_NUM_THREADS``).
        start_timeout_s: seconds a process may take to listen on its port.
        stop_timeout_s: seconds between SIGTERM and SIGKILL when stopping.

    Raises:
        FileNotFoundError: (on start) the Flower executables are not installed
            (``pip install medfed[deploy]``).
        RuntimeError: a process exited, or did not listen within ``start_timeout_s``
            (the message ends with its log's last lines).
    """

    def __init__(
        self, work_dir: Path, env: dict[str, str] | None = None, start_timeout_s: float = 120.0, stop_timeout_s: float = 15.0
    ) -> None:
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": SUPEREXEC_POLL_S, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.superlink: Process | None = None
        self.supernodes: dict[int, Process] = {}
        self.runners: dict[int, Process] = {}
        self.submitted: list[Process] = []
        self._started: dict[str, int] = {}

    # ------------------------------------------------------------------ processes
    def start_superlink(self) -> Process:
        """``flower-superlink --insecure`` on a free port (its one HTTP API: Fleet, Control and ServerApp runtime).

        Runtime dependency installation is off: the app runs in this
        environment, with medfed and torch already installed.
        """
        port = free_port()
        self.superlink = self._start(
            "superlink",
            [
                "flower-superlink", "--insecure", "--host", LOOPBACK, "--port", str(port),
                "--disable-runtime-dependency-installation",
            ],
            port,
        )
        return self.superlink

    def start_supernode(self, site_index: int, data_root: Path, **node_config: Any) -> Process:
        """One site's ``flower-supernode --isolation process`` and its runner (:mod:`medfed.deploy.runner`).

        The SuperNode's ``--node-config`` gives ``site-index`` and
        ``data-root``; ``node_config`` adds further keys (underscores become
        hyphens, e.g. ``state_dir=...`` -> ``state-dir``). Its Runtime API
        listens on a free port, where the runner claims its messages.

        Returns:
            The SuperNode's process (the runner's is ``runners[site_index]``).

        Raises:
            RuntimeError: no SuperLink was started first.
        """
        if self.superlink is None:
            raise RuntimeError("start the SuperLink before its SuperNodes")
        port = free_port()
        config = {"site-index": site_index, "data-root": str(data_root), **{k.replace("_", "-"): v for k, v in node_config.items()}}
        node = self._start(
            self._name(f"supernode-{site_index}"),
            [
                "flower-supernode", "--insecure", "--superlink", f"{LOOPBACK}:{self.superlink.port}", "--isolation", "process",
                "--host", LOOPBACK, "--port", str(port), "--node-config", _node_config(config),
            ],
            port,
        )
        self.supernodes[site_index] = node
        self.start_runner(site_index)
        return node

    def start_runner(self, site_index: int, command: list[str] | None = None) -> Process:
        """Start the process claiming site ``site_index``'s SuperNode's tasks (after :meth:`stop_runner`, a new one).

        Args:
            site_index: a site whose SuperNode this federation started.
            command: the runner's command line before its ``--runtime-api-address``
                and ``--insecure`` options; None: medfed's runner
                (``python -m medfed.deploy.runner``). Another runner (e.g. a
                test's, wrapping medfed's ClientApp) must take the same options.
        """
        port = self.supernodes[site_index].port
        command = [sys.executable, "-m", "medfed.deploy.runner"] if command is None else command
        self.runners[site_index] = self._start(
            self._name(f"runner-{site_index}"), [*command, "--runtime-api-address", f"{LOOPBACK}:{port}", "--insecure"], port, listens=False
        )
        return self.runners[site_index]

    def stop_runner(self, site_index: int) -> None:
        """Stop site ``site_index``'s runner (SIGTERM: it finishes a task under way), leaving its SuperNode running."""
        self._stop([self.runners[site_index]], signal.SIGTERM)

    def stop_supernode(self, site_index: int, kill: bool = True) -> None:
        """Stop site ``site_index``'s SuperNode and runner: SIGKILL (a crash, ``kill=True``) or SIGTERM (a shutdown)."""
        self._stop([self.runners[site_index], self.supernodes[site_index]], signal.SIGKILL if kill else signal.SIGTERM)

    def close(self) -> None:
        """Stop every process still running, each by its process id: submitted runs, runners and SuperNodes together, then the SuperLink."""
        self._stop([*self.submitted, *self.runners.values(), *self.supernodes.values()], signal.SIGTERM)
        if self.superlink is not None:
            self._stop([self.superlink], signal.SIGTERM)

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def flwr_home(self) -> Path:
        """The ``flwr`` CLI's ``FLWR_HOME``, its config naming this SuperLink as :data:`CONNECTION` (default)."""
        if self.superlink is None:
            raise RuntimeError("start the SuperLink before submitting a run")
        home = self.work_dir / "cli"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{LOOPBACK}:{self.superlink.port}"\ninsecure = true\n',
            encoding="utf-8",
        )
        return home

    def submit(self, app_dir: Path, run_config: dict[str, Any]) -> Process:
        """``flwr run <app_dir> medfed-local --stream --run-config ...`` in the background.

        Submits the run and follows its ServerApp's log into
        ``flwr-run-<n>.log`` in the work folder (the process's ``log``) until
        the run ends; :meth:`wait` for it, :meth:`close` stops it if it is
        still following.
        """
        overrides = run_config_text(run_config)
        command = ["flwr", "run", str(app_dir), CONNECTION, "--stream", *(["--run-config", overrides] if overrides else [])]
        process = self._start(f"flwr-run-{len(self.submitted)}", command, 0, listens=False, home=self.flwr_home())
        self.submitted.append(process)
        return process

    def wait(self, submitted: Process, timeout_s: float) -> str:
        """Wait until a submitted run has ended; returns its log (``flwr run`` exits 0 whether or not the run failed).

        Raises:
            subprocess.TimeoutExpired: the run took longer than ``timeout_s``
                (the ``flwr`` process is stopped first).
        """
        try:
            submitted.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._stop([submitted], signal.SIGTERM)
            raise
        return submitted.log.read_text(encoding="utf-8", errors="replace")

    def run(self, app_dir: Path, run_config: dict[str, Any], timeout_s: float) -> str:
        """:meth:`submit` and :meth:`wait`: the run's log once it has ended."""
        return self.wait(self.submit(app_dir, run_config), timeout_s)

    # ------------------------------------------------------------------ internals
    def _name(self, base: str) -> str:
        """``base``, then ``base-restart1``, ``base-restart2``... for the same site's later processes."""
        count = self._started.get(base, 0)
        self._started[base] = count + 1
        return base if count == 0 else f"{base}-restart{count}"

    def _start(self, name: str, command: list[str], port: int, listens: bool = True, home: Path | None = None) -> Process:
        """Start ``command`` as ``name`` (``FLWR_HOME``: ``home``, else a folder of its own); with ``listens``, wait until it listens on ``port``."""
        if home is None:
            home = self.work_dir / name
            home.mkdir(exist_ok=True)
        log = self.work_dir / f"{name}.log"
        executable = shutil.which(command[0])
        if executable is None:
            raise FileNotFoundError(f"{command[0]} not found: install the deploy extra (pip install medfed[deploy])")
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [executable, *command[1:]], env={**self.env, "FLWR_HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = Process(name, popen, log, port)
        deadline = time.monotonic() + self.start_timeout_s
        while listens and not _listening(port):
            if not process.running() or time.monotonic() > deadline:
                self._stop([process], signal.SIGKILL)
                tail = log.read_text(encoding="utf-8", errors="replace")[-1500:]
                raise RuntimeError(f"{name} did not start listening on {LOOPBACK}:{port}:\n{tail}")
            time.sleep(0.2)
        return process

    def _stop(self, processes: list[Process], first: signal.Signals) -> None:
        """Signal each process's group (id = its pid) at once, SIGKILL those whose leader outlives ``stop_timeout_s``; reap them.

        A leader is reaped only after a last SIGKILL to its group (children
        that outlived it): until then its pid, and so the group id, cannot be
        reused by another process. Processes Flower detached from a group
        (:func:`_descendants`, read before the first signal) are stopped by
        their ids after it.
        """
        running = [process for process in processes if process.popen.returncode is None]
        detached = [child for process in running for child in _descendants(process.pid)]
        for process in running:
            _signal_group(process.pid, first)
        deadline = time.monotonic() + self.stop_timeout_s
        while any(not _exited(process.pid) for process in running):
            if time.monotonic() > deadline:
                for process in running:
                    _signal_group(process.pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        for process in running:
            _signal_group(process.pid, signal.SIGKILL)
        self._stop_detached(detached, first)
        for process in processes:
            process.popen.wait()

    def _stop_detached(self, processes: list[tuple[int, str]], first: signal.Signals) -> None:
        """Stop each of ``processes`` (pid, start time) still running: ``first``, then SIGKILL after ``stop_timeout_s``.

        The start time tells a process from a later one given the same pid.
        """

        def alive() -> list[int]:
            return [pid for pid, started in processes if _start_time(pid) == started]

        for pid in alive():
            _signal_pid(pid, first)
        deadline = time.monotonic() + self.stop_timeout_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in alive():
            _signal_pid(pid, signal.SIGKILL)


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, leaving it unreaped (a zombie keeps its pid taken)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid`` if it still has a member."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ..., start time), None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), None if it is gone or a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process descending from ``pid`` now (``/proc``; none where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop()
        started = _start_time(child)
        if started is not None:
            found.append((child, started))
        queue.extend(children.get(child, []))
    return found


def run_config_text(run_config: dict[str, Any]) -> str:
    """``flwr run --run-config``'s text (also ``python -m medfed deploy submit``'s): ``key=value`` pairs, strings quoted as TOML strings."""
    return " ".join(f"{key}={_toml_value(value)}" for key, value in run_config.items())


def _node_config(config: dict[str, Any]) -> str:
    """``--node-config``'s text: ``key=value`` pairs, as :func:`run_config_text`'s."""
    return run_config_text(config)


def _toml_value(value: Any) -> str:
    """One TOML value: a bool, int, float or (quoted) string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
