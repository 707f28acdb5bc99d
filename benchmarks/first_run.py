"""The default job's wall time and where it goes: ``python -m medfed fit --config configs/brats_lack0.yaml``.

Runs the default command (with any ``key=value`` overrides given) as a new
process, so that the imports count, and prints its wall time, its CPU
seconds (user + system, from ``resource.getrusage`` of the child) and the
split of the wall time the run records in ``results.json`` ("timing"):
data (building the federation: reading the volumes, cutting the patches),
train (local training), patch eval (each round's test patches), volume eval
(whole-volume Dice/HD95), round start (start-of-round states), checkpoint,
logging (CSV, W&B), figures, and the rest (imports, models, the strategy's
setup, server steps and codecs). A run of older code whose results.json
lacks a part shows "n/a" there; its train and patch-eval times come from the
per-round records (``history[*].timing``), which it has.

With ``--baseline REPO`` the same command runs first with REPO's code (e.g.
a clone of the main branch) and then with this checkout's, one after the
other, and the ratios are printed: baseline / this. Both read the same data
set, generated once before either is timed (its generation time is printed
apart: a first run on a fresh machine pays it once), and each starts with an
empty preprocessed-data cache, so neither inherits the other's patches. With
``--cold`` each run generates its own data set instead, inside its timed run:
what a user's very first command costs. The load average (1 min) is printed
before and after each run: the machine may be shared. "written" is what the
run wrote to the file system (``ru_oublock`` of the child, 512-byte blocks:
checkpoints, logs, figures, data), not what is left at its end.

    python benchmarks/first_run.py [--baseline /path/to/main] [--cold] [--config configs/brats_lack0.yaml]
        [--out outputs/bench_first_run] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = (
    ("data", "data_s"),
    ("train", "train_s"),
    ("patch eval", "patch_eval_s"),
    ("volume eval", "volume_eval_s"),
    ("round start", "round_start_s"),
    ("checkpoint", "checkpoint_s"),
    ("logging", "logging_s"),
    ("figures", "figures_s"),
)


def generate_data(config: Path, overrides: list[str], root: Path) -> float:
    """Write the config's generated data set under ``root`` (with this checkout's generator); returns the seconds it took."""
    sys.path.insert(0, str(REPO))
    from medfed.config import load_config
    from medfed.data.phantoms.brats import generate_brats_phantoms

    cfg = load_config(str(config), overrides)
    tic = time.perf_counter()
    generate_brats_phantoms(root, n_sites=cfg.federation.n_sites, progress=False, **dict(cfg.data.generate))
    return time.perf_counter() - tic


def timed_run(code: Path, config: str, overrides: list[str], out: Path, cache: Path) -> dict[str, Any]:
    """One ``fit`` of ``config`` (a path relative to ``code``: each checkout's own config) with ``code``'s medfed
    in a new process; wall and CPU seconds, load, the run's timing."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    environment = {**os.environ, "PYTHONPATH": str(code), "XDG_CACHE_HOME": str(cache)}
    command = [sys.executable, "-m", "medfed", "fit", "--config", str(config), f"output_dir={out}", "--quiet", *overrides]
    load_before = os.getloadavg()[0]
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tic = time.perf_counter()
    finished = subprocess.run(command, cwd=code, env=environment, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} (in {code}) failed with status {finished.returncode}:\n{finished.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    return {
        "code": str(code),
        "wall_s": wall,
        "cpu_s": (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime),
        "written_mb": (usage.ru_oublock - usage_before.ru_oublock) * 512 / 1e6,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "threads": results.get("num_threads"),
        "rounds": len(results["history"]),
        "left_mb": sum(path.stat().st_size for path in out.rglob("*") if path.is_file()) / 1e6,
        "label_iou": results["mean"].get("label_iou"),
        "split": split(results),
    }


def split(results: dict[str, Any]) -> dict[str, float | None]:
    """Seconds per part of the run (``None`` where the run did not record it)."""
    timing, history = results["timing"], results["history"]
    parts: dict[str, float | None] = {key: timing.get(key) for _, key in PARTS}
    if parts["train_s"] is None:
        parts["train_s"] = sum(record["timing"]["train_s"] for record in history)
    if parts["patch_eval_s"] is None:
        parts["patch_eval_s"] = sum(record["timing"]["eval_s"] for record in history)
    if parts["round_start_s"] is None:
        parts["round_start_s"] = sum(record["timing"].get("round_start_s", 0.0) for record in history)
    return parts


def report(runs: list[dict[str, Any]], generation_s: float | None) -> str:
    """The runs side by side: wall, CPU, the split, and baseline / this (for times) where there are two."""
    names = ["baseline", "this checkout"] if len(runs) == 2 else ["this checkout"]
    width = 16
    data = (
        "each run generated its data set (in 'data')" if generation_s is None
        else f"data generated once before the runs, untimed in them: {generation_s:.1f} s"
    )
    lines = [
        f"machine: {platform.machine()} {platform.processor() or ''}, {len(os.sched_getaffinity(0))} cores usable (shared: see the loads)",
        data,
        "",
        f"{'':<22}" + "".join(f"{name:>{width}}" for name in names) + (f"{'ratio':>{width}}" if len(runs) == 2 else ""),
    ]

    def row(label: str, values: list[float | None], fmt: str = "{:.1f}", ratio_column: bool = True) -> None:
        cells = "".join(f"{('n/a' if v is None else fmt.format(v)):>{width}}" for v in values)
        ratio = ""
        if ratio_column and len(values) == 2 and None not in values and values[1]:
            ratio = f"{values[0] / values[1]:>{width - 1}.2f}x"
        lines.append(f"{label:<22}{cells}{ratio}")

    row("wall (s)", [run["wall_s"] for run in runs])
    row("CPU user+sys (s)", [run["cpu_s"] for run in runs])
    for label, key in PARTS:
        row(f"  {label} (s)", [run["split"][key] for run in runs])
    row("  other (s)", [run["wall_s"] - sum(v for v in run["split"].values() if v is not None) for run in runs])
    row("written (MB)", [run["written_mb"] for run in runs], "{:.0f}")
    row("left in output (MB)", [run["left_mb"] for run in runs], "{:.0f}", ratio_column=False)
    row("rounds", [run["rounds"] for run in runs], "{:d}", ratio_column=False)
    row("torch threads", [run["threads"] for run in runs], "{:d}", ratio_column=False)
    row("label IoU (mean)", [run["label_iou"] for run in runs], "{:.3f}", ratio_column=False)
    row("load before", [run["load_before"] for run in runs], "{:.2f}", ratio_column=False)
    row("load after", [run["load_after"] for run in runs], "{:.2f}", ratio_column=False)
    lines.append("")
    lines.append("'other' = wall minus the parts: imports, models, the strategy's setup, server steps, codecs "
                 "(and, where a part is n/a, that part). 'written' counts what the run wrote to the file system "
                 "(checkpoints, start-of-round states, logs, figures); 'left' what its output folder holds at the end.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/brats_lack0.yaml", help="relative to each checkout: its own version of the config")
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout whose code (and config) runs the same command first")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_first_run")
    parser.add_argument("--cold", action="store_true", help="each run generates its own data set, timed: a user's very first run")
    args, overrides = parser.parse_known_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    generation_s = None
    if not args.cold:
        data_root = args.out / "data" / "brats2017"
        shared = [f"data.root={data_root}"]
        generation_s = generate_data(REPO / args.config, [*shared, *overrides], data_root)
    runs = []
    for name, code in ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this", REPO)]:
        data = shared if not args.cold else [f"data.root={args.out / f'data-{name}' / 'brats2017'}"]
        if args.cold:
            shutil.rmtree(args.out / f"data-{name}", ignore_errors=True)
        runs.append(timed_run(code, args.config, [*data, *overrides], args.out / name, args.out / f"cache-{name}"))
        print(f"{name}: {runs[-1]['wall_s']:.1f} s wall", file=sys.stderr)
    text = report(runs, generation_s)
    (args.out / "first_run.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
