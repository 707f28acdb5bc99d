"""Utility against privacy: DP-SGD at each site (``privacy.dp``) at epsilon about 1, 3 and 8, against no DP.

For each setting (clinical_delta2 as shipped; brats_lack0_dp, a BraTS
setting chosen so that DP-SGD can learn: see ``SETTINGS`` and
docs/privacy.md) and each privacy level, one
``python -m medfed compare`` grid of the methods and seeds in
``<out>/<setting>/<level>`` (``level``: ``nodp``, ``eps1``, ``eps3``,
``eps8``), so the same command resumes an interrupted sitting (finished runs
are not run again; their checkpoints are deleted to save disk). A level
``epsK`` sets ``privacy.dp.target_epsilon=K`` (delta 1e-5, C the setting's ``clip``): each
site's noise multiplier is Opacus's ``get_noise_multiplier`` for the steps
it plans over the run, so epsilon is about K at the run's end (the reached
value is read back from each run's results.json). pFedNet builds its graph
in model space in every level (the setting DP-SGD fits; docs/privacy.md).

The seeds are the outer loop, so a sitting cut short still has every level
of its first seeds. Then ``--report`` (or the end of a full sitting) reads
every finished run and writes into ``<out>``:

* ``dp_utility.csv``: one row per run: setting, level, method, seed, the
  last round's test metrics (mean over sites, and the worst site's), the
  trivial baselines', epsilon reached (the largest over sites), the mean
  noise multiplier over sites, wall time; ``dp_utility_sites.csv``: one
  row per run and site;
* ``dp_utility.md``: per setting and metric, methods as rows and levels as
  columns, ``mean ± half-width`` of the 95% t interval over seeds, and the
  epsilon reached;
* ``dp_utility.png``: per setting, its first metric against epsilon reached
  (log axis), one line per method with its 95% interval over seeds as a
  band; no DP at the right, a point with its interval per method.

    python benchmarks/dp_utility.py --out bench_out/dp_utility            # run (resumes), then report
    python benchmarks/dp_utility.py --out bench_out/dp_utility --report   # tables and figure from finished runs
    python benchmarks/dp_utility.py --out bench_out/dp_utility --report --docs   # and into docs/privacy.md, docs/figures, docs/results
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from medfed.compare_stats import summarise

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [0, 1, 2, 3, 4]
#: level name -> target epsilon (None: no DP)
LEVELS = {"nodp": None, "eps8": 8.0, "eps3": 3.0, "eps1": 1.0}
DELTA = 1e-5
COMMON = [
    "federation.validation_fraction=0.2",  # compare needs a validation split (model selection is not used here: last round)
    "strategy.pfednet.graph_space=model",  # the DP-compatible pFedNet (its data-space sketches are computed on raw data)
    "logger.wandb=disabled",
    "trainer.keep_checkpoints=1",
]


@dataclass(frozen=True)
class Setting:
    """One panel: ``config`` with ``reductions`` (overrides, said under its table), the ``metrics`` tabulated, the
    ``methods`` run, whether each seed draws its own generated data set (compare's ``--new-data-per-seed``), and the
    per-sample clipping norm C of its private levels (``privacy.dp.max_grad_norm``)."""

    config: str
    reductions: list[str]
    metrics: list[str]
    methods: list[str]
    new_data_per_seed: bool = False
    clip: float = 1.0


#: setting -> what it runs. brats_lack0_dp is the DP BraTS setting chosen so that DP-SGD has a chance (docs/privacy.md):
#: many patches a site, a large batch, few parameters (the noise's norm grows as the square root of their number),
#: instance normalisation (per sample, so DP-SGD's per-sample gradients stay per sample).
SETTINGS = {
    "clinical_delta2": Setting("clinical_delta2", [], ["accuracy", "balanced_accuracy"], ["fedavg", "fedper", "ditto", "pfednet", "local"]),
    "brats_lack0_dp": Setting(
        "brats_lack0",
        [
            "data.generate.cases_per_site=16",
            "federation.test_fraction=0.25",
            "federation.validation_fraction=0.34",
            "data.patch_size=32",
            "data.tumour_patches_per_case=16",
            "data.background_patches_per_case=4",
            "model.channels=[4,8,16]",
            "model.strides=[2,2]",
            "model.num_res_units=0",
            "model.lr=0.03",  # chosen on validation at eps 8 (FedAvg, seed 0: 0.003, 0.01, 0.03, 0.09 tried; 0.03 inside)
            "trainer.batch_size=64",
            "trainer.local_epochs=2",
            "trainer.rounds=20",
            "evaluation.volume_every=null",
        ],
        ["label_iou"],
        ["fedavg", "pfednet", "local"],
        new_data_per_seed=True,
        clip=0.1,  # chosen on validation at eps 8 (FedAvg, seed 0, lr 0.03: C 10 .. 0.03; 0.1 and below equal, a plateau)
    ),
}
NO_DP_X = "no DP"


def level_overrides(level: str, clip: float) -> list[str]:
    epsilon = LEVELS[level]
    return [] if epsilon is None else [f"privacy.dp.target_epsilon={epsilon:g}", f"privacy.dp.delta={DELTA:g}", f"privacy.dp.max_grad_norm={clip:g}"]


def run_grid(out: Path, settings: list[str], seeds: list[int], levels: list[str], jobs: int) -> None:
    """Every (setting, seed, level) as a compare grid, seeds outer; finished runs are skipped by compare itself."""
    for name in settings:
        setting = SETTINGS[name]
        for seed in seeds:
            for level in levels:
                folder = out / name / level
                if all((folder / setting.config / method / f"seed{seed}" / "results.json").is_file() for method in setting.methods):
                    continue  # finished in an earlier sitting (compare would also skip it, unless medfed's config keys changed since)
                command = [
                    sys.executable, "-m", "medfed", "compare", "--config", setting.config, "--strategies", *setting.methods,
                    "--seeds", str(seed), "--output", str(folder), "--jobs", str(jobs), "--quiet", "--metrics", *setting.metrics,
                    *(["--new-data-per-seed"] if setting.new_data_per_seed else []), *COMMON, *setting.reductions, *level_overrides(level, setting.clip),
                ]
                print(f"dp_utility: {name} seed {seed} {level}", flush=True)
                code = subprocess.call(command, cwd=ROOT)
                if code != 0:
                    print(f"dp_utility: compare exited with {code} ({name} seed {seed} {level}); going on", flush=True)
                for results in folder.glob(f"{setting.config}/*/seed*/results.json"):  # finished: the tables read results.json only
                    shutil.rmtree(results.parent / "checkpoints", ignore_errors=True)


def _site_mean(metrics: dict[str, dict[str, float]], metric: str) -> float:
    return float(np.mean([site[metric] for site in metrics.values()])) if metrics else math.nan


def collect(out: Path) -> list[dict]:
    """One row per finished run under ``out``; the trivial baselines of its test split (results.json ``baselines``:
    the same for every method and level of a seed) as ``baseline:<name>:<metric>``, mean over sites."""
    rows = []
    for name, setting in SETTINGS.items():
        for level in LEVELS:
            for path in sorted((out / name / level).glob(f"{setting.config}/*/seed*/results.json")):
                results, _ = json.JSONDecoder().raw_decode(path.read_text())  # the integrity trailer follows the object
                dp = (results.get("privacy") or {}).get("dp_sgd", {})
                epsilons = [site["epsilon"] if site["epsilon"] is not None else math.inf for site in dp.values()]
                rows.append({
                    "setting": name,
                    "level": level,
                    "target_epsilon": LEVELS[level] if LEVELS[level] is not None else "",
                    "method": results["strategy"],
                    "seed": results["seed"],
                    **{metric: results["mean"].get(metric, math.nan) for metric in setting.metrics},
                    **{f"worst:{metric}": min(site.get(metric, math.nan) for site in results["sites"]) for metric in setting.metrics},
                    **{f"baseline:{baseline}:{metric}": _site_mean(values["metrics"], metric)
                       for baseline, values in (results.get("baselines") or {}).items() for metric in setting.metrics},
                    **{f"baseline-worst:{baseline}:{metric}": min(site[metric] for site in values["metrics"].values())
                       for baseline, values in (results.get("baselines") or {}).items() for metric in setting.metrics},
                    "epsilon": max(epsilons) if epsilons else "",
                    "noise_multiplier": float(np.mean([site["noise_multiplier"] for site in dp.values()])) if dp else "",
                    "dp_steps": int(np.mean([site["steps"] for site in dp.values()])) if dp else "",
                    "rounds": len(results["history"]),
                    "epochs_per_round": results["compute"]["mean_training_epochs_per_round"],
                    "wall_s": results["timing"]["wall_s"],
                    "data": results["federation"]["description"],
                })
    return rows


def site_rows(out: Path) -> list[dict]:
    """One row per (run, site) under ``out``: the site's test metrics and its trivial baselines' (the per-(seed, site) CSV)."""
    rows = []
    for name, setting in SETTINGS.items():
        for level in LEVELS:
            for path in sorted((out / name / level).glob(f"{setting.config}/*/seed*/results.json")):
                results, _ = json.JSONDecoder().raw_decode(path.read_text())
                for site in results["sites"]:
                    rows.append({
                        "setting": name, "level": level, "method": results["strategy"], "seed": results["seed"], "site": site["site"],
                        **{metric: site.get(metric, math.nan) for metric in setting.metrics},
                        **{f"baseline:{baseline}:{metric}": values["metrics"].get(site["site"], {}).get(metric, math.nan)
                           for baseline, values in (results.get("baselines") or {}).items() for metric in setting.metrics},
                        "n_test": site.get("n_test"),
                    })
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)


def cell(rows: list[dict], metric: str) -> tuple[float, float, float, int]:
    """(mean, low, high, n) over the seeds of ``rows``' ``metric``."""
    summary = summarise([row[metric] for row in rows])
    return summary.mean, summary.low, summary.high, summary.n


def baselines(rows: list[dict], metric: str) -> dict[str, list[dict]]:
    """Per trivial baseline: one row per seed (``metric`` = the baseline's value on that seed's test split, mean over sites)."""
    names = dict.fromkeys(key.split(":")[1] for row in rows for key in row if key.startswith("baseline:") and key.endswith(f":{metric}"))
    first = {row["seed"]: row for row in rows}  # a seed's baselines are the same in every run of it
    return {
        name: [{metric: row[f"baseline:{name}:{metric}"], f"worst:{metric}": row[f"baseline-worst:{name}:{metric}"]}
               for row in first.values() if f"baseline:{name}:{metric}" in row]
        for name in names
    }


def _formatted(runs: list[dict], metric: str) -> str:
    """``mean ± half-width (seeds)`` over seeds, and the worst site's value (mean over seeds) where the rows carry it."""
    mean, low, high, n = cell(runs, metric)
    half = "" if math.isnan(low) else f" ± {(high - low) / 2:.3f}"
    worst = f"; worst site {np.mean([run[f'worst:{metric}'] for run in runs]):.3f}" if runs and f"worst:{metric}" in runs[0] else ""
    return "–" if n == 0 else f"{mean:.3f}{half} ({n}){worst}"


def table(name: str, rows: list[dict], heading: str = "##") -> str:
    """One setting: its metrics (methods x levels, then the trivial baselines) and the epsilon reached with sigma."""
    setting, mine = SETTINGS[name], [row for row in rows if row["setting"] == name]
    data = mine[0]["data"]
    if setting.new_data_per_seed:  # each seed its own draw: say which, not the first run's seed alone
        data = re.sub(r", seed \d+$", f", data.generate.seed = the run's seed ({sorted({row['seed'] for row in mine})})", data)
    lines = [f"{heading} {name}", "", f"Data: {data}.", ""]
    if setting.reductions:
        lines += [f"Settings: {' '.join(setting.reductions)}" + (" (each seed its own generated data set)" if setting.new_data_per_seed else "") + f"; private levels: C = {setting.clip:g}.", ""]
    levels = [level for level in LEVELS if any(row["level"] == level for row in mine)]
    for metric in setting.metrics:
        header = ["method", *[(f"eps {LEVELS[level]:g}" if LEVELS[level] else "no DP") for level in levels]]
        lines += [f"{metric}, last round, test (mean over sites; mean ± 95% t half-width over seeds, seeds; the worst site's value, mean over seeds):", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for method in setting.methods:
            cells = [_formatted([row for row in mine if row["method"] == method and row["level"] == level], metric) for level in levels]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        for baseline, values in baselines(mine, metric).items():  # not trained, not private: the same in every column
            lines.append(f"| baseline: {baseline.replace('_', ' ')} | " + " | ".join([_formatted(values, metric)] * len(levels)) + " |")
        lines.append("")
    epochs = {method: np.mean([r["epochs_per_round"] for r in mine if r["method"] == method]) for method in setting.methods if any(r["method"] == method for r in mine)}
    lines += [
        "Training epochs per site and round (measured, mean over runs; the budget is whole mini-batches, so a method whose "
        "plans split an epoch may pass more samples): " + ", ".join(f"{method} {value:.2f}" for method, value in epochs.items()) + ".",
        "",
    ]
    lines += ["epsilon reached (delta 1e-5; largest over sites, mean over seeds), noise multiplier sigma (mean over sites and seeds) and DP-SGD steps a site:", ""]
    private = [level for level in levels if LEVELS[level] is not None]
    lines += ["| method | " + " | ".join(f"eps {LEVELS[level]:g}: reached, sigma, steps" for level in private) + " |", "|" + "---|" * (len(private) + 1)]
    for method in setting.methods:
        cells = []
        for level in private:
            runs = [row for row in mine if row["method"] == method and row["level"] == level]
            cells.append("–" if not runs else f"{np.mean([r['epsilon'] for r in runs]):.2f}, {np.mean([r['noise_multiplier'] for r in runs]):.2f}, "
                         f"{np.mean([r['dp_steps'] for r in runs]):.0f}")
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
    """Per setting: its first metric vs epsilon reached, one line and 95% band per method; no DP as a point with its
    interval at the right; each trivial baseline a dotted line."""
    panels = [(name, setting) for name, setting in SETTINGS.items() if any(r["setting"] == name for r in rows)]
    figure = Figure(figsize=(5.5 * len(panels), 4.4))
    private_levels = sorted((level for level in LEVELS if LEVELS[level] is not None), key=lambda level: LEVELS[level])
    no_dp_x = 20.0  # where "no DP" is drawn on the log axis
    for k, (name, setting) in enumerate(panels):
        metric = setting.metrics[0]
        axes = figure.add_subplot(1, len(panels), k + 1)
        mine = [row for row in rows if row["setting"] == name]
        for j, method in enumerate(setting.methods):
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
        for baseline, values in baselines(mine, metric).items():
            axes.axhline(cell(values, metric)[0], color="0.4", ls=":", lw=1)
            axes.annotate(f"baseline: {baseline.replace('_', ' ')}", (0.02, cell(values, metric)[0]), xycoords=("axes fraction", "data"),
                          fontsize=7, color="0.3", va="bottom")
        axes.set_xscale("log")
        ticks = [LEVELS[level] for level in private_levels] + [no_dp_x]
        axes.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + [NO_DP_X])
        axes.minorticks_off()
        axes.set_ylim(0.0, 1.0)
        axes.set_xlabel("epsilon reached (delta 1e-5, largest over sites)")
        axes.set_ylabel(f"{metric} (test, last round, mean over sites)")
        data = "GENERATED data" if "GENERATED" in mine[0]["data"] else "real data (Wisconsin table)"
        seeds = sorted({row["seed"] for row in mine})
        axes.set_title(f"{name}, DP-SGD at each site, {data}\nbands and bars: 95% t interval over seeds {seeds}, within [0, 1]", fontsize=9)
        axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "dp_utility.png", dpi=120)


def report(out: Path, docs: bool = False) -> None:
    rows = collect(out)
    if not rows:
        print(f"dp_utility: no finished run under {out}")
        return
    write_csv(out / "dp_utility.csv", rows)
    write_csv(out / "dp_utility_sites.csv", site_rows(out))
    names = [name for name in SETTINGS if any(row["setting"] == name for row in rows)]
    text = "\n\n".join(table(name, rows) for name in names)
    (out / "dp_utility.md").write_text(f"# Utility against privacy: DP-SGD at each site\n\n{text}\n")
    print(text)
    write_figure(rows, out)
    print(f"dp_utility: wrote {out}/dp_utility.csv, dp_utility_sites.csv, dp_utility.md and dp_utility.png ({len(rows)} runs)")
    if docs:  # each measured setting's table into its block of docs/privacy.md, the figure into docs/figures
        for name in names:
            replace_block(ROOT / "docs" / "privacy.md", f"dp-utility-{name}", table(name, rows, heading="###"))
        (ROOT / "docs" / "figures").mkdir(exist_ok=True)
        shutil.copyfile(out / "dp_utility.png", ROOT / "docs" / "figures" / "dp_utility.png")
        for table_file in ("dp_utility.csv", "dp_utility_sites.csv"):
            shutil.copyfile(out / table_file, ROOT / "docs" / "results" / table_file)
        print("dp_utility: refreshed docs/privacy.md, docs/figures/dp_utility.png, docs/results/dp_utility.csv and dp_utility_sites.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "dp_utility")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (compare --jobs)")
    parser.add_argument("--report", action="store_true", help="only the tables and figure, from the finished runs")
    parser.add_argument("--docs", action="store_true", help="also put them into docs/privacy.md, docs/figures/ and docs/results/")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        run_grid(args.out, args.settings, args.seeds, args.levels, args.jobs)
    report(args.out, docs=args.docs)


if __name__ == "__main__":
    main()
