"""Fused runs: the runs of a grid that share a strategy and a model shape, in one process and one stacked step.

A grid's runs of one strategy on one model (seeds, tuning points, budgets,
settings of the same task) train the same kind of stacked group round after
round. :func:`fused_groups` puts them in groups of at most ``limit``; each
group runs in one process (:func:`fit_group`), each run in a thread of its
own (:class:`~medfed.federated.fused.FusedTraining`) running its whole
``medfed fit``: its own data order, initialisation, learning rate, server
step, checkpoints, records, log and results.json, the numbers it gets alone
(to float tolerance: its sites train stacked, rows = runs x sites, with the
other runs' sites of the same key). A run that fails ends alone; an
interrupted group resumes run by run (each from its own checkpoint).

A run is fused only where it can be: a batchable strategy half, no DP-SGD and
no client-level DP, W&B disabled (the grids' default; W&B keeps one run per
process); the others run as today, one process each. ``auto`` fuses the runs
on cuda, where stacking pays for every model; on a CPU it pays for the
clinical model only (benchmarks/throughput.py), so ``auto`` fuses that and
leaves the others one process each; ``on`` fuses wherever it can.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from medfed.compare.plan import Run
from medfed.components import resolve
from medfed.config import load_config
from medfed.options.strategies import strategy_spec

FUSE_OPTIONS = ("auto", "on", "off")
LIMIT = 64
"""The most runs fused in one process."""
ROW_KEYS = (
    "output_dir", "trainer.seed", "trainer.rounds", "trainer.local_epochs", "trainer.num_threads", "model.lr",
    "data.root", "data.generate.seed",
)
"""What fused runs may differ in besides their strategy's options and their federation (each row's own): the
training schedule, and the data draw (``new_data_per_seed``: each seed's own generated data set, read by its run)."""
CPU_FUSED_MODELS = ("logreg",)
"""The models whose stacked step beats training their sites in turn on a CPU (``auto`` fuses them there)."""


def fusion_key(run: Run, fuse: str) -> str | None:
    """What the runs fused with ``run`` share (a JSON text of its resolved config without the rows' keys), or None:
    ``run`` runs alone (``fuse`` off, its strategy not batchable, DP, W&B on, or ``auto`` on a CPU for a model
    whose stacked step is slower there)."""
    if fuse == "off":
        return None
    config = resolve(load_config(run.config_path, list(run.overrides))).config
    strategy = config["strategy"]["name"]
    privacy = config.get("privacy", {})
    if (
        strategy_spec(strategy).load().Site.batchable is not None
        or privacy.get("dp", {}).get("enabled")
        or privacy.get("client_dp", {}).get("enabled")
        or config["logger"]["wandb"] != "disabled"
    ):
        return None
    if fuse == "auto" and config["trainer"]["device"] != "cuda" and config["model"]["name"] not in CPU_FUSED_MODELS:
        return None
    shared = json.loads(json.dumps(config))
    for key in ROW_KEYS:
        *path, name = key.split(".")
        parent = shared
        for part in path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(name, None)
    shared["strategy"] = {"name": strategy}  # its options: each run's own (equal ones stack, the others train apart)
    shared.pop("federation", None)  # each run's own data
    return json.dumps(shared, sort_keys=True)


def fused_groups(runs: list[Run], fuse: str = "auto", limit: int = LIMIT) -> list[list[Run]]:
    """The runs in the processes they run in: groups of runs of equal :func:`fusion_key` (at most ``limit`` each, in
    the runs' order), and every other run alone."""
    groups: list[list[Run]] = []
    open_groups: dict[str, list[Run]] = {}
    for run in runs:
        key = fusion_key(run, fuse)
        if key is None:
            groups.append([run])
            continue
        group = open_groups.get(key)
        if group is None or len(group) >= limit:
            group = open_groups[key] = []
            groups.append(group)
        group.append(run)
    return groups


class _RunOutput(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` of a fused process: what each run's thread writes goes to that run's log."""

    def __init__(self, fallback: TextIO) -> None:
        self.fallback = fallback
        self.files: dict[int, TextIO] = {}

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.files.get(threading.get_ident(), self.fallback).write(text)

    def flush(self) -> None:
        for file in (*self.files.values(), self.fallback):
            file.flush()

    @contextmanager
    def to(self, path: Path) -> Iterator[None]:
        """Inside the block, this thread's writes go to ``path`` (truncated first)."""
        with open(path, "w", encoding="utf-8", buffering=1) as file:
            self.files[threading.get_ident()] = file
            try:
                yield
            finally:
                del self.files[threading.get_ident()]


def fit_group(runs: list[Run], report: Callable[[int, int], None] | None = None) -> list[int]:
    """Fit ``runs`` fused in this process (each its own ``medfed fit --quiet``, output to its own log); their exit
    statuses (130 for a run interrupted by Ctrl-C), each also ``report(index, status)`` as its run ends."""
    from medfed.console import one_line_errors, show_warnings
    from medfed.errors import INTERRUPTED
    from medfed.federated.fused import FusedTraining
    from medfed.fit import fit

    output = _RunOutput(sys.stderr)
    sys.stdout = sys.stderr = output
    show_warnings()
    codes = [INTERRUPTED] * len(runs)

    def body(index: int, run: Run) -> Any:
        def fit_run() -> None:
            run.log.parent.mkdir(parents=True, exist_ok=True)
            with output.to(run.log):
                try:
                    codes[index] = one_line_errors(lambda: fit(str(run.config_path), list(run.overrides), resume=run.action == "resume", quiet=True))
                except Exception:  # as a run process alone: the traceback in its log, exit status 1
                    traceback.print_exc()
                    codes[index] = 1
            if report is not None:
                report(index, codes[index])

        return fit_run

    FusedTraining().run_all([body(index, run) for index, run in enumerate(runs)])
    output.flush()
    return codes
