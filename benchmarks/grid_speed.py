"""Where a comparison grid's wall time goes: one ``medfed compare`` end to end, its time split by kind of work.

Runs ``python -m medfed compare`` (a grid file, or configs on the command
line, with ``--tune`` the tuning runs first) in a fresh interpreter on a
fresh output folder, timing it from the command's start to its exit, and
reads back every run's ``results.json`` (tuning runs and test runs alike).
The wall time is split into

* ``start``: compare's own start (interpreter, imports, planning every run)
  until its first line; and the time the run slots spent outside the runs'
  own clocks (each run's process start and config resolution, the run
  server's start, waiting): ``jobs x wall`` minus the runs' summed
  ``timing.wall_s`` minus compare's own start and tables;
* ``data``, ``training``, ``server``, ``evaluation`` (patches every round,
  whole volumes where a config evaluates them), ``checkpoints`` (with the
  start-of-round snapshots of the fault handling), ``figures`` (the runs'
  PNGs) and ``logging``: the runs' own timings (``results.json`` ``timing``),
  summed over runs;
* ``tables``: compare writing comparison.csv/md/png (and tuning.csv), from
  its last run's end to its exit;
* ``other in runs``: the rest of the runs' clocks (building models, the
  links and codecs, results.json).

Run seconds are summed over the runs; with ``--jobs`` J > 1 they overlap, so
the split is of ``J x wall`` slot-seconds, each part's share beside it. A
grid run with fused runs (several runs in one process) records each run's
share of its process's time, so the sums stay the grid's.

Run from the repository root (on a shared machine, nice'd, in a slot)::

    PYTHONPATH=$PWD python benchmarks/grid_speed.py --config clinical_delta1 --strategies fedavg fedprox --seeds 0 1 2 --tune
    PYTHONPATH=$PWD python benchmarks/grid_speed.py --grid table5_clinical --strategies fedavg ditto [-- key=value ...]
    PYTHONPATH=$PWD python benchmarks/grid_speed.py --quick [--device cuda]

``--quick``: a CI-sized grid (clinical_delta1, FedAvg and FedProx, 2 seeds,
3 rounds, 2-point tuning of FedProx's learning rate), on ``--device``
(default: cuda where present, else cpu). Extra ``key=value`` arguments go to compare
unchanged (after ``--`` where they follow ``--strategies`` or ``--seeds``, which would take them), ``--compare-args`` to this checkout's only. ``--baseline CHECKOUT`` runs
the same grid with another checkout first (its own ``--baseline-args``), and the
table sets the two splits side by side: main against this branch, or this checkout
against itself, ``--baseline $PWD --baseline-args=--fuse=off``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
QUICK = {
    "config": ["clinical_delta1"],
    "strategies": ["fedavg", "fedprox"],
    "seeds": [0, 1],
    "overrides": ["trainer.rounds=3", "logger.wandb=disabled"],
    "tune_space": ["model.lr=x1,x3", "strategy.fedprox.mu=0.1"],
}
"""The ``--quick`` grid: 2 strategies x 2 seeds of test runs after 2 + 2 tuning runs (seed 0)."""

PARTS = ("start", "data", "training", "server", "evaluation", "checkpoints", "figures", "logging", "tables", "other in runs")
RUN_PARTS = {
    "data": ("data_s",),
    "training": ("train_s",),
    "server": ("server_step_s",),
    "evaluation": ("patch_eval_s", "volume_eval_s"),
    "checkpoints": ("checkpoint_s", "round_start_s"),
    "figures": ("figures_s",),
    "logging": ("logging_s",),
}
"""Each part's keys in a run's results.json ``timing``."""


@dataclass
class Timeline:
    """compare's stderr lines with their times (seconds since its start)."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)


@dataclass
class GridTiming:
    """One compare, timed: its wall seconds, the runs' results, compare's stderr timeline, its exit status."""

    wall_s: float
    jobs: int
    results: list[dict]
    timeline: Timeline
    returncode: int
    command: list[str]
    last_result_s: float
    """When the last run's results.json was written (seconds since compare's start): the tables follow."""

    def parts(self) -> dict[str, float]:
        """Seconds of each of :data:`PARTS` (slot-seconds: ``jobs x wall`` in all; module docstring)."""
        timings = [result["timing"] for result in self.results]
        parts = {name: sum(t.get(key, 0.0) for t in timings for key in keys) for name, keys in RUN_PARTS.items()}
        # a fused run's clock runs beside its group's other runs' (one process): its share is its wall time / the runs
        runs_wall = sum(result["timing"].get("wall_s", 0.0) / _fused_runs(result) for result in self.results)
        parts["other in runs"] = max(0.0, runs_wall - sum(parts.values()))
        parts["tables"] = max(0.0, self.wall_s - self.last_result_s)
        parts["start"] = max(0.0, self.jobs * self.wall_s - runs_wall - parts["tables"])
        parts["start_compare"] = self.timeline.first("medfed: compare:") or 0.0
        return parts


def _fused_runs(results: dict) -> int:
    """How many runs shared the run's process (1: it ran alone)."""
    fused = results.get("executor", {}).get("fused")
    return fused["runs"] if isinstance(fused, dict) else 1


def run_compare(arguments: list[str], jobs: int, output: Path, environment: dict[str, str]) -> GridTiming:
    """``python -m medfed compare <arguments> --output <output> --jobs <jobs> --quiet``, timed, its stderr timestamped."""
    command = [sys.executable, "-m", "medfed", "compare", *arguments, "--output", str(output), "--jobs", str(jobs), "--quiet"]
    timeline = Timeline()
    epoch = time.time()
    start = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=environment, cwd=output.parent)

    def read() -> None:
        for line in process.stderr:
            timeline.lines.append((time.perf_counter() - start, line.rstrip()))
            print(f"  [{time.perf_counter() - start:7.1f} s] {line.rstrip()}", file=sys.stderr)

    reader = threading.Thread(target=read)
    reader.start()
    code = process.wait()
    wall = time.perf_counter() - start
    reader.join()
    results, last = [], 0.0
    for path in sorted(output.rglob("results.json")):
        try:
            results.append(json.loads(path.read_text()))
            last = max(last, path.stat().st_mtime - epoch)
        except (OSError, ValueError):
            print(f"  note: {path} unreadable, left out", file=sys.stderr)
    return GridTiming(wall, jobs, results, timeline, code, command, last or wall)


def table(timing: GridTiming, baseline: GridTiming | None = None) -> str:
    """The split as a Markdown table: seconds and share of the slot-seconds (with ``baseline``: its split beside,
    and baseline / this)."""
    parts = timing.parts()
    slots = timing.jobs * timing.wall_s
    if baseline is None:
        lines = ["| part | seconds | share |", "|---|---:|---:|"]
        for name in PARTS:
            note = f" (compare's own: {parts['start_compare']:.1f} s)" if name == "start" else ""
            lines.append(f"| {name}{note} | {parts[name]:.1f} | {parts[name] / slots:.0%} |")
        lines.append(f"| **wall, end to end** | **{timing.wall_s:.1f}** | {timing.jobs} slot(s) |")
        return "\n".join(lines)
    before = baseline.parts()
    before_slots = baseline.jobs * baseline.wall_s
    lines = ["| part | baseline s | share | this s | share | baseline / this |", "|---|---:|---:|---:|---:|---:|"]
    for name in PARTS:
        ratio = f"{before[name] / parts[name]:.1f}" if parts[name] > 0.05 else "-"
        lines.append(f"| {name} | {before[name]:.1f} | {before[name] / before_slots:.0%} | {parts[name]:.1f} | {parts[name] / slots:.0%} | {ratio} |")
    lines.append(f"| **wall, end to end** | **{baseline.wall_s:.1f}** | | **{timing.wall_s:.1f}** | | **{baseline.wall_s / timing.wall_s:.2f}** |")
    return "\n".join(lines)


def machine() -> str:
    """The machine and its load, in one line."""
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    line = f"{platform.machine()}, {os.cpu_count()} cores, load average {load}, Python {platform.python_version()}"
    try:
        import torch

        line += f", torch {torch.__version__}"
        if torch.cuda.is_available():
            line += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return line


def compare_arguments(args: argparse.Namespace) -> list[str]:
    """compare's arguments for ``args`` (``--quick``: :data:`QUICK`)."""
    if args.quick:
        device = args.device or ("cuda" if _cuda() else "cpu")
        quick = QUICK
        return [
            "--config", *quick["config"], "--strategies", *quick["strategies"], "--seeds", *map(str, quick["seeds"]),
            "--tune", *(f"--tune-space={entry}" for entry in quick["tune_space"]), *quick["overrides"], f"trainer.device={device}", *args.compare_args,
        ]
    source = ["--grid", args.grid] if args.grid else ["--config", *args.config]
    arguments = [*source]
    if args.strategies:
        arguments += ["--strategies", *args.strategies]
    if args.seeds:
        arguments += ["--seeds", *map(str, args.seeds)]
    if args.tune:
        arguments.append("--tune")
        arguments += [f"--tune-space={entry}" for entry in args.tune_space]
        if args.tune_rounds:
            arguments += ["--tune-rounds", str(args.tune_rounds)]
    if args.device:
        arguments.append(f"trainer.device={args.device}")
    return [*arguments, *args.overrides, *args.compare_args]


def _environment(checkout: Path) -> dict[str, str]:
    """This process's environment with ``checkout`` first on the Python path (and W&B off unless set)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    environment.setdefault("WANDB_MODE", "disabled")
    return environment


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> GridTiming:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--grid", help="a grid file or bundled grid name")
    source.add_argument("--config", nargs="+", help="run configs (paths or bundled names)")
    source.add_argument("--quick", action="store_true", help="a CI-sized grid (module docstring)")
    parser.add_argument("--strategies", nargs="+")
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--tune", action="store_true", help="compare --tune: the tuning runs first")
    parser.add_argument("--tune-space", nargs="+", default=[])
    parser.add_argument("--tune-rounds", type=int)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="trainer.device of every run (default: the configs')")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: the cores)")
    parser.add_argument("--output", type=Path, help="the comparison folder (default: a fresh temporary one, removed after); with --baseline, the baseline's "
        "is kept beside it as OUTPUT-baseline")
    parser.add_argument("--compare-args", action="append", default=[], help="one more argument for compare, as it is (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the split and the run's conditions to this JSON file")
    parser.add_argument(
        "--baseline", type=Path,
        help="another checkout (e.g. main's): the same grid run with it first, in the same sitting, its split beside this one's "
        "(--compare-args go to this checkout only)",
    )
    parser.add_argument("--baseline-args", action="append", default=[], help="one more argument for the baseline's compare only (repeatable)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for compare; after -- where they follow --strategies or --seeds")
    args = parser.parse_args(argv)
    if not (args.quick or args.grid or args.config):
        parser.error("give --grid, --config or --quick")
    jobs = args.jobs or len(os.sched_getaffinity(0))
    arguments = compare_arguments(args)
    print(f"# {machine()} (start)")
    print(f"# medfed compare {shlex.join(arguments)} --jobs {jobs}")
    baseline = None
    with tempfile.TemporaryDirectory(prefix="grid_speed-") as scratch:
        if args.baseline is not None:
            plain = [argument for argument in arguments if argument not in args.compare_args] + args.baseline_args
            kept = args.output.with_name(args.output.name + "-baseline") if args.output else None
            if kept is not None:
                kept.parent.mkdir(parents=True, exist_ok=True)
            baseline = run_compare(plain, jobs, kept or Path(scratch) / "baseline", _environment(args.baseline.resolve()))
            print(f"# baseline {args.baseline}: {len(baseline.results)} runs in {baseline.wall_s:.1f} s; {machine()}")
        output = args.output or Path(scratch) / "grid"
        output.parent.mkdir(parents=True, exist_ok=True)
        timing = run_compare(arguments, jobs, output, _environment(REPOSITORY))
    print(f"# {machine()} (end)")
    if timing.returncode != 0:
        print(f"# compare exited {timing.returncode}: the split covers the runs that finished", file=sys.stderr)
    runs = len(timing.results)
    print(f"\n{runs} runs finished in {timing.wall_s:.1f} s end to end ({timing.wall_s / max(runs, 1):.2f} s a run), {jobs} job(s)\n")
    print(table(timing, baseline))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine(), "command": timing.command, "wall_s": timing.wall_s, "jobs": jobs, "runs": runs,
            "returncode": timing.returncode, "parts": timing.parts(),
            **({"baseline": {"checkout": str(args.baseline), "wall_s": baseline.wall_s, "runs": len(baseline.results), "parts": baseline.parts()}} if baseline else {}),
        }, indent=2) + "\n")
    return timing


if __name__ == "__main__":
    main()
