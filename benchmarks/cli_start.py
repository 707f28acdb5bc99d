"""How fast the command line answers when it trains nothing: each command's median wall time in a fresh interpreter.

Every command runs as ``python -m medfed ...`` in a new process (what a user
waits for, interpreter start included), ``--repeat`` times; the median is
printed. With ``--baseline DIR`` (another checkout, e.g. the main branch's),
the same commands run against it too, interleaved with this checkout's so
that both see the same machine load, and the ratio is printed. Each command's
exit status is checked (0, or 2 for the config errors), so a command that
fails differently is reported instead of timed.

Run from the repository root::

    python benchmarks/cli_start.py [--repeat 5] [--baseline /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
COMMANDS = [
    ("--help", ["--help"], 0),
    ("fit --help", ["fit", "--help"], 0),
    ("strategies", ["strategies"], 0),
    ("fit --print-config", ["fit", "--config", "brats_lack0", "--print-config"], 0),
    ("config error: unknown key", ["fit", "--config", "brats_lack0", "trainer.roundz=3"], 2),
    ("config error: strategy name", ["fit", "--config", "brats_lack0", "strategy.name=pfednett"], 2),
    ("config error: strategy option", ["fit", "--config", "brats_lack0", "strategy.pfednet.lamm=1"], 2),
    ("config error: model option", ["fit", "--config", "brats_lack0", "model.num_res_unitz=1"], 2),
    ("config error: data option", ["fit", "--config", "brats_lack0", "data.patch_size=40"], 2),
]


def wall_time(checkout: Path, arguments: list[str], expected: int, folder: Path) -> float:
    """Seconds ``python -m medfed <arguments>`` takes with ``checkout`` first on the path (run in ``folder``)."""
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "medfed", *arguments], cwd=folder, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != expected:
        raise SystemExit(f"{checkout}: medfed {' '.join(arguments)} exited {done.returncode}, expected {expected}: {done.stderr[-500:]}")
    return seconds


def machine() -> str:
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, Python {platform.python_version()}, load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command per checkout (the median is printed)")
    parser.add_argument("--baseline", type=Path, help="another checkout to time side by side (e.g. the main branch's)")
    args = parser.parse_args()
    checkouts = {"this": REPOSITORY} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    print(f"machine: {machine()} (start)")
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeat):
            for label, arguments, expected in COMMANDS:
                for name, checkout in checkouts.items():
                    times.setdefault((name, label), []).append(wall_time(checkout, arguments, expected, Path(folder)))
    print(f"machine: {machine()} (end)")
    print(f"median wall seconds of {args.repeat} fresh-process runs each" + (f"; baseline: {checkouts['baseline']}" if args.baseline else ""))
    header = f"{'command':<32} {'this':>7}" + (f" {'baseline':>9} {'baseline/this':>14}" if args.baseline else "")
    print(header)
    for label, _, _ in COMMANDS:
        this = statistics.median(times[("this", label)])
        line = f"{label:<32} {this:7.2f}"
        if args.baseline:
            baseline = statistics.median(times[("baseline", label)])
            line += f" {baseline:9.2f} {baseline / this:13.1f}x"
        print(line)


if __name__ == "__main__":
    main()
