"""Utility against privacy: DP-SGD at each site (``privacy.dp``) at epsilon about 1, 3 and 8, against no DP.

For each setting (clinical_delta2 as shipped; brats_lack0 reduced so that
the grid fits a shared 2-core CPU: 2D patches of 32 instead of 64, 6 tumour
and 2 background patches per case instead of 12 and 4, 8 rounds instead of
20, no whole-volume evaluation) and each privacy level, one
``python -m medfed compare`` grid of the methods and seeds in
``<out>/<setting>/<level>`` (``level``: ``nodp``, ``eps1``, ``eps3``,
``eps8``), so the same command resumes an interrupted sitting (finished runs
are not run again; their checkpoints are deleted to save disk). A level
``epsK`` sets ``privacy.dp.target_epsilon=K`` (delta 1e-5, C = 1): each
site's noise multiplier is Opacus's ``get_noise_multiplier`` for the steps
it plans over the run, so epsilon is about K at the run's end (the reached
value is read back from each run's results.json). pFedNet builds its graph
in model space in every level (the setting DP-SGD fits; docs/privacy.md).

The seeds are the outer loop, so a sitting cut short still has every level
of its first seeds. Then ``--report`` (or the end of a full sitting) reads
every finished run and writes into ``<out>``:

* ``dp_utility.csv``: one row per run: setting, level, method, seed, the
  last round's test metrics (mean over sites), epsilon reached (the largest
  over sites), the mean noise multiplier over sites, wall time;
* ``dp_utility.md``: per setting and metric, methods as rows and levels as
  columns, ``mean ± half-width`` of the 95% t interval over seeds, and the
  epsilon reached;
* ``dp_utility.png``: per setting, its first metric against epsilon reached
  (log axis), one line per method with its 95% interval over seeds as a
  band; no DP at the right, a point with its interval per method.

    python benchmarks/dp_utility.py --out bench_out/dp_utility            # run (resumes), then report
    python benchmarks/dp_utility.py --out bench_out/dp_utility --report   # tables and figure from finished runs
    python benchmarks/dp_utility.py --out bench_out/dp_utility --report --docs   # and into docs/privacy.md, README.md
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from medfed.compare_stats import summarise

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["fedavg", "fedper", "ditto", "pfednet", "local"]
SEEDS = [0, 1, 2]
#: level name -> target epsilon (None: no DP)
LEVELS = {"nodp": None, "eps8": 8.0, "eps3": 3.0, "eps1": 1.0}
DELTA = 1e-5
COMMON = [
    "federation.validation_fraction=0.2",  # compare needs a validation split (model selection is not used here: last round)
    "strategy.pfednet.graph_space=model",  # the DP-compatible pFedNet (its data-space sketches are computed on raw data)
    "logger.wandb=disabled",
    "trainer.keep_checkpoints=1",
]
#: setting -> (config, its reductions, the metrics tabulated)
SETTINGS = {
    "clinical_delta2": ("clinical_delta2", [], ["accuracy", "balanced_accuracy"]),
    "brats_lack0": (
        "brats_lack0",
        [
            "data.patch_size=32",
            "data.tumour_patches_per_case=6",
            "data.background_patches_per_case=2",
            "trainer.rounds=8",
            "evaluation.volume_every=null",
        ],
        ["label_iou"],
    ),
}
NO_DP_X = "no DP"


def level_overrides(level: str) -> list[str]:
    epsilon = LEVELS[level]
    return [] if epsilon is None else [f"privacy.dp.target_epsilon={epsilon:g}", f"privacy.dp.delta={DELTA:g}", "privacy.dp.max_grad_norm=1.0"]


def run_grid(out: Path, settings: list[str], seeds: list[int], jobs: int) -> None:
    """Every (setting, seed, level) as a compare grid, seeds outer; finished runs are skipped by compare itself."""
    for setting in settings:
        config, reductions, metrics = SETTINGS[setting]
        for seed in seeds:
            for level in LEVELS:
                folder = out / setting / level
                if all((folder / config / method / f"seed{seed}" / "results.json").is_file() for method in METHODS):
                    continue  # finished in an earlier sitting (compare would also skip it, unless medfed's config keys changed since)
                command = [
                    sys.executable, "-m", "medfed", "compare", "--config", config, "--strategies", *METHODS,
                    "--seeds", str(seed), "--output", str(folder), "--jobs", str(jobs), "--quiet", "--metrics", *metrics,
                    *COMMON, *reductions, *level_overrides(level),
                ]
                print(f"dp_utility: {setting} seed {seed} {level}", flush=True)
                code = subprocess.call(command, cwd=ROOT)
                if code != 0:
                    print(f"dp_utility: compare exited with {code} ({setting} seed {seed} {level}); going on", flush=True)
                for results in folder.glob(f"{config}/*/seed*/results.json"):  # finished: the tables read results.json only
                    shutil.rmtree(results.parent / "checkpoints", ignore_errors=True)


def collect(out: Path) -> list[dict]:
    """One row per finished run under ``out``."""
    rows = []
    for setting, (config, _, metrics) in SETTINGS.items():
        for level in LEVELS:
            for path in sorted((out / setting / level).glob(f"{config}/*/seed*/results.json")):
                results = json.loads(path.read_text())
                dp = results.get("privacy", {}).get("dp_sgd", {})
                epsilons = [site["epsilon"] if site["epsilon"] is not None else math.inf for site in dp.values()]
                rows.append({
                    "setting": setting,
                    "level": level,
                    "target_epsilon": LEVELS[level] if LEVELS[level] is not None else "",
                    "method": results["strategy"],
                    "seed": results["seed"],
                    **{metric: results["mean"].get(metric, math.nan) for metric in metrics},
                    "epsilon": max(epsilons) if epsilons else "",
                    "noise_multiplier": float(np.mean([site["noise_multiplier"] for site in dp.values()])) if dp else "",
                    "dp_steps": int(np.mean([site["steps"] for site in dp.values()])) if dp else "",
                    "rounds": len(results["history"]),
                    "epochs_per_round": results["compute"]["mean_training_epochs_per_round"],
                    "wall_s": results["timing"]["wall_s"],
                    "data": results["federation"]["description"],
                })
    return rows


def cell(rows: list[dict], metric: str) -> tuple[float, float, float, int]:
    """(mean, low, high, n) over the seeds of ``rows``' ``metric``."""
    summary = summarise([row[metric] for row in rows])
    return summary.mean, summary.low, summary.high, summary.n


def tables(rows: list[dict], heading: str = "##") -> str:
    """Per setting: its metrics (methods x levels) and the epsilon reached with sigma, under ``heading`` titles."""
    lines = []
    for setting, (_, reductions, metrics) in SETTINGS.items():
        mine = [row for row in rows if row["setting"] == setting]
        if not mine:
            continue
        lines += [f"{heading} {setting}", "", f"Data: {mine[0]['data']}.", ""]
        if reductions:
            lines += [f"Reduced: {' '.join(reductions)}.", ""]
        levels = [level for level in LEVELS if any(row["level"] == level for row in mine)]
        for metric in metrics:
            header = ["method", *[(f"eps {LEVELS[level]:g}" if LEVELS[level] else "no DP") for level in levels]]
            lines += [f"{metric}, last round, test (mean over sites; mean ± 95% t half-width over seeds, seeds):", ""]
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for method in METHODS:
                cells = []
                for level in levels:
                    runs = [row for row in mine if row["method"] == method and row["level"] == level]
                    mean, low, high, n = cell(runs, metric)
                    half = "" if math.isnan(low) else f" ± {(high - low) / 2:.3f}"
                    cells.append("–" if n == 0 else f"{mean:.3f}{half} ({n})")
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
        epochs = {method: np.mean([r["epochs_per_round"] for r in mine if r["method"] == method]) for method in METHODS if any(r["method"] == method for r in mine)}
        lines += [
            "Training epochs per site and round (measured, mean over runs; the budget is whole mini-batches, so a method whose "
            "plans split an epoch may pass more samples): " + ", ".join(f"{method} {value:.2f}" for method, value in epochs.items()) + ".",
            "",
        ]
        lines += ["epsilon reached (delta 1e-5; largest over sites, mean over seeds) and noise multiplier sigma (mean over sites and seeds):", ""]
        private = [level for level in levels if LEVELS[level] is not None]
        lines += ["| method | " + " | ".join(f"eps {LEVELS[level]:g}: reached, sigma" for level in private) + " |", "|" + "---|" * (len(private) + 1)]
        for method in METHODS:
            cells = []
            for level in private:
                runs = [row for row in mine if row["method"] == method and row["level"] == level]
                cells.append("–" if not runs else f"{np.mean([r['epsilon'] for r in runs]):.2f}, {np.mean([r['noise_multiplier'] for r in runs]):.2f}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def summary(rows: list[dict]) -> str:
    """The README's table: per method, each setting's first metric at no DP, eps 8, 3, 1 (means over seeds)."""
    order = ["nodp", *sorted((level for level in LEVELS if LEVELS[level] is not None), key=lambda level: -LEVELS[level])]
    settings = [(setting, metrics[0]) for setting, (_, _, metrics) in SETTINGS.items() if any(r["setting"] == setting for r in rows)]
    header = ["method", *[f"{setting} {metric}: no DP / eps 8 / 3 / 1" for setting, metric in settings]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in METHODS:
        cells = []
        for setting, metric in settings:
            values = []
            for level in order:
                runs = [r for r in rows if r["setting"] == setting and r["method"] == method and r["level"] == level]
                values.append(f"{cell(runs, metric)[0]:.2f}" if runs else "–")
            cells.append(" / ".join(values))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_block(path: Path, name: str, text: str) -> None:
    """Put ``text`` between ``<!-- name: ... -->`` and ``<!-- /name -->`` in ``path``."""
    document = path.read_text()
    pattern = re.compile(rf"(<!-- {name}:[^\n]*-->\n)(?:.*?\n)?(<!-- /{name} -->)", re.S)
    if not pattern.search(document):
        raise SystemExit(f"dp_utility: {path} has no <!-- {name}: ... --> block")
    path.write_text(pattern.sub(lambda match: f"{match.group(1)}{text}\n{match.group(2)}", document))


def write_figure(rows: list[dict], out: Path) -> None:
    """Per setting: its first metric vs epsilon reached, one line and 95% band per method; no DP as a point with its interval at the right."""
    panels = [(setting, metrics[0]) for setting, (_, _, metrics) in SETTINGS.items() if any(r["setting"] == setting for r in rows)]
    figure = Figure(figsize=(5.5 * len(panels), 4.4))
    private_levels = sorted((level for level in LEVELS if LEVELS[level] is not None), key=lambda level: LEVELS[level])
    no_dp_x = 20.0  # where "no DP" is drawn on the log axis
    for k, (setting, metric) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), k + 1)
        mine = [row for row in rows if row["setting"] == setting]
        for j, method in enumerate(METHODS):
            xs, means, lows, highs = [], [], [], []
            for level in private_levels:
                runs = [row for row in mine if row["method"] == method and row["level"] == level]
                if runs:
                    mean, low, high, _ = cell(runs, metric)
                    xs.append(float(np.mean([r["epsilon"] for r in runs])))
                    means.append(mean)
                    lows.append(max(0.0, mean if math.isnan(low) else low))  # the metrics lie in [0, 1]
                    highs.append(min(1.0, mean if math.isnan(high) else high))
            style = {"ls": "--" if method == "local" else "-", "marker": "o"}
            (line,) = axes.plot(xs, means, label=method, **style)
            axes.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.12)
            runs = [row for row in mine if row["method"] == method and row["level"] == "nodp"]
            if runs:
                mean, low, high, _ = cell(runs, metric)
                x = no_dp_x * 1.04 ** (j - 2)  # side by side, so the intervals do not hide each other
                spread = [[0.0], [0.0]] if math.isnan(low) else [[mean - max(0.0, low)], [min(1.0, high) - mean]]
                axes.errorbar([x], [mean], yerr=spread, color=line.get_color(), marker="s", capsize=3)
        axes.set_xscale("log")
        ticks = [LEVELS[level] for level in private_levels] + [no_dp_x]
        axes.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + [NO_DP_X])
        axes.minorticks_off()
        axes.set_ylim(0.0, 1.0)
        axes.set_xlabel("epsilon reached (delta 1e-5, largest over sites)")
        axes.set_ylabel(f"{metric} (test, last round, mean over sites)")
        data = "GENERATED data" if "GENERATED" in mine[0]["data"] else "real data (Wisconsin table)"
        seeds = sorted({row["seed"] for row in mine})
        axes.set_title(f"{setting}, DP-SGD at each site, {data}\nbands and bars: 95% t interval over seeds {seeds}, within [0, 1]", fontsize=9)
        axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "dp_utility.png", dpi=120)


def report(out: Path, docs: bool = False) -> None:
    rows = collect(out)
    if not rows:
        print(f"dp_utility: no finished run under {out}")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with (out / "dp_utility.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    text = tables(rows)
    (out / "dp_utility.md").write_text(f"# Utility against privacy: DP-SGD at each site\n\n{text}\n")
    print(text)
    write_figure(rows, out)
    print(f"dp_utility: wrote {out}/dp_utility.csv, dp_utility.md and dp_utility.png ({len(rows)} runs)")
    if docs:  # the measured tables into docs/privacy.md and the README, the figure into docs/figures
        replace_block(ROOT / "docs" / "privacy.md", "dp-utility", tables(rows, heading="###"))
        replace_block(ROOT / "README.md", "dp-utility", summary(rows))
        (ROOT / "docs" / "figures").mkdir(exist_ok=True)
        shutil.copyfile(out / "dp_utility.png", ROOT / "docs" / "figures" / "dp_utility.png")
        print("dp_utility: refreshed docs/privacy.md, README.md and docs/figures/dp_utility.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "dp_utility")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (compare --jobs)")
    parser.add_argument("--report", action="store_true", help="only the tables and figure, from the finished runs")
    parser.add_argument("--docs", action="store_true", help="also put them into docs/privacy.md, README.md and docs/figures/")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        run_grid(args.out, args.settings, args.seeds, args.jobs)
    report(args.out, docs=args.docs)


if __name__ == "__main__":
    main()
