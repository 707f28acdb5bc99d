"""Submit a run to a deployment and exit with its outcome: ``python -m medfed deploy submit <app-dir> <superlink> [--run-config ...]``.

``flwr run --stream`` exits 0 whether or not the run failed (a ServerApp
that refuses its config only marks the run failed); a consortium's script
needs the outcome in the exit status. This command

1. fuses the app's run config (``[tool.flwr.app.config]`` of
   ``<app-dir>/pyproject.toml``) with the ``--run-config`` overrides, with
   Flower's own code (as the SuperLink fuses them), and checks it with the
   ServerApp's own check (:func:`medfed.deploy.server_app.run_settings`):
   a bad key or value is one line ``medfed: error: ...`` naming it, exit
   status 2, and the SuperLink is never contacted. The medfed config file
   the run config names must be readable here too (as it must be by the
   ServerApp);
2. runs ``flwr run <app-dir> <superlink> --stream --run-config ...`` with
   this Python's Flower CLI, its output passed through (the run's log);
3. once the log stream ends, reads the run's status (``flwr ls <superlink>
   --run-id N --format json``) and exits 0 when the run finished
   (``finished:completed``), 1 otherwise, after one line ``medfed: error:
   run N ...`` with Flower's status and its reason (the ServerApp's error).

Ctrl-C stops following the run, not the run: one line says how to stop it
(``flwr stop``), exit status 130. ``<superlink>`` is the name of a SuperLink
connection in the ``flwr`` CLI's config (``$FLWR_HOME/config.toml``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from medfed.deploy.server_app import run_settings
from medfed.errors import INTERRUPTED, ConfigError

FLWR = [sys.executable, "-m", "flwr.cli.app"]
"""The ``flwr`` CLI of this Python (the ``deploy`` extra's Flower)."""
STARTED = re.compile(r"Successfully started run (\d+)")
"""The line of ``flwr run`` that gives the new run's id."""
COMPLETED = "finished:completed"
"""Flower's status of a run that ended well (``flwr ls``)."""
STATUS_WAIT_S = 30.0
"""How long the run may take, once its log stream has ended, to be marked finished."""


def submit(app_dir: Path, superlink: str, run_config: list[str]) -> int:
    """Check the run config, submit the run, follow its log; the exit status of its outcome.

    Args:
        app_dir: the Flower app's folder (medfed's repository: its pyproject.toml).
        superlink: the name of a SuperLink connection of the ``flwr`` CLI.
        run_config: ``flwr run --run-config`` values (``key=value`` pairs, or one .toml file).

    Returns:
        0: the run finished; 1: it failed, was stopped, or could not be
        submitted (Flower's own message above); 130: Ctrl-C (the run goes on).

    Raises:
        ConfigError: a bad run config key or value, or a bad medfed config
            (before anything is submitted).
    """
    check_run_config(app_dir, run_config)
    command = [*FLWR, "run", str(app_dir), superlink, "--stream", *(arg for value in run_config for arg in ("--run-config", value))]
    run_id = None
    popen = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        for line in popen.stdout:
            print(line, end="", flush=True)
            found = STARTED.search(line)
            if found and run_id is None:
                run_id = int(found.group(1))
        returncode = popen.wait()
        if run_id is None:
            print(f"medfed: error: flwr run submitted no run (exit status {returncode}; its output is above)", file=sys.stderr)
            return 1
        status, details = wait_for_status(superlink, run_id)
    except KeyboardInterrupt:
        popen.terminate()
        popen.wait()
        if run_id is None:
            print(f"medfed: interrupted before flwr run named a run; flwr ls {superlink} lists the SuperLink's runs", file=sys.stderr)
        else:
            print(f"medfed: interrupted; run {run_id} goes on; stop it with: flwr stop {run_id} {superlink}", file=sys.stderr)
        return INTERRUPTED
    if status == COMPLETED:
        print(f"medfed: run {run_id} {status}", file=sys.stderr)
        return 0
    reason = " ".join(details.split()) or "no reason given"
    print(f"medfed: error: run {run_id} {status}: {reason}", file=sys.stderr)
    return 1


def check_run_config(app_dir: Path, run_config: list[str]) -> dict[str, Any]:
    """The run config the SuperLink will give the ServerApp, checked as the ServerApp checks it.

    Returns:
        The fused run config (``{key: value}``).

    Raises:
        ConfigError: no ``pyproject.toml`` in ``app_dir``, ``--run-config``
            text Flower cannot parse, a key the app's run config does not
            have, or what :func:`~medfed.deploy.server_app.run_settings` refuses.
    """
    if not (Path(app_dir) / "pyproject.toml").is_file():
        raise ConfigError(f"app folder {app_dir}: no pyproject.toml (expected medfed's repository, the Flower app)")
    try:
        overrides = parse_config_args(run_config)
    except (click.ClickException, ValueError, OSError) as error:
        raise ConfigError(f"--run-config {' '.join(run_config)!r}: {_message(error)}") from None
    defaults = get_fused_config_from_dir(Path(app_dir), {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigError(f"run config key {unknown[0]!r}: unknown; expected one of {', '.join(sorted(defaults))} (--run-config)")
    fused = dict(get_fused_config_from_dir(Path(app_dir), overrides))
    run_settings(fused)
    return fused


def wait_for_status(superlink: str, run_id: int) -> tuple[str, str]:
    """The run's Flower status and its details once it is finished, or as it is after :data:`STATUS_WAIT_S`."""
    deadline = time.monotonic() + STATUS_WAIT_S
    while True:
        status, details = run_status(superlink, run_id)
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def run_status(superlink: str, run_id: int) -> tuple[str, str]:
    """``(status, status-details)`` of run ``run_id`` from ``flwr ls --run-id N --format json`` (``finished:failed``, ...).

    A ``flwr ls`` that fails gives ``("unknown", <its message>)``.
    """
    listed = subprocess.run([*FLWR, "ls", superlink, "--run-id", str(run_id), "--format", "json"], capture_output=True, text=True)
    try:
        runs = json.loads(listed.stdout)["runs"]
        run = next(run for run in runs if int(run["run-id"]) == run_id)
    except (ValueError, KeyError, StopIteration, TypeError):
        reason = " ".join((listed.stdout + listed.stderr).split())[-300:]
        return "unknown", f"flwr ls gave no status for it (exit status {listed.returncode}: {reason})"
    return str(run["status"]), str(run.get("status-details", ""))


def _message(error: Exception) -> str:
    """The one-line text of a parse error (a ClickException keeps it in ``message``)."""
    return " ".join(str(getattr(error, "message", error)).split())
