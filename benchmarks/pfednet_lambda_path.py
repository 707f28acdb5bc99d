"""pFedNet's lambda path: how much of the sites' spread the server step removes, and what it costs.

For each penalty norm p and each strength lam (a fraction of the fusion
threshold, ``strategy.pfednet.lam_scale=fusion``) the script trains pFedNet
on a config's federation with ``federation.holdout=validation`` (each site's
training subjects split again; the test split is never used, so the chosen
default is not fitted to it) and records

* ``spread_removed``: the fraction of the between-site spread of the personal
  parts that the server step removed, averaged over rounds (0 = independent
  personal parts, 1 = every connected component fused: the paper's "all z_n
  meet as lambda grows", Fig. 2);
* the mean over sites of the validation metric after the last round.

It writes ``lambda_path.csv`` and ``lambda_path.png`` (two panels against
lam, one line per p) under ``--out``. Results on generated data say so.

The server step alone is cheap to trace on a fine grid: with ``--static``
the script also takes the lam = 0 run's last checkpoint, whose personal
matrix is the sites' trained Z~ of the last round (at lam = 0 the server
step returns its centre), solves one server step per (p, lam) on it and
draws the fraction of spread removed as lines (``lambda_path_static.csv``).

Run from the repository root::

    python -m benchmarks.pfednet_lambda_path --config configs/brats_lack0.yaml --rounds 15
    python -m benchmarks.pfednet_lambda_path --plot-only   # redraw from the CSV
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from medfed.checkpoint import FOLDER, checkpoints, read_checkpoint
from medfed.config import load_config
from medfed.experiment import run

#: The metric a task's path is judged by (the mean over sites of the validation split).
METRIC = {"brats": "label_iou", "luna16": "accuracy", "clinical": "balanced_accuracy"}
COLUMNS = ["task", "p", "lam", "spread_removed", "metric", "value", "rounds", "seed", "generated", "description"]


def run_path(config: Path, lams: list[float], norms: list[str], rounds: int, seed: int, out: Path, extra: list[str]) -> list[dict]:
    """Train pFedNet once per (p, lam) on the validation split; returns one CSV row per run."""
    rows = []
    for p in norms:
        for lam in lams:
            overrides = [
                "strategy.name=pfednet",
                f"strategy.pfednet.lam={lam}",
                f"strategy.pfednet.p={p}",
                "strategy.pfednet.lam_scale=fusion",
                "federation.holdout=validation",
                f"trainer.rounds={rounds}",
                f"trainer.seed={seed}",
                "logger.wandb=disabled",
                f"output_dir={out / 'runs' / f'p{p}_lam{lam}'}",
                *extra,
            ]
            results = run(load_config(config, overrides), overwrite=True, progress=False)
            task = results["federation"]["task"]
            metric = METRIC[task] if METRIC[task] in results["mean"] else next(iter(results["mean"]))
            removed = [r["server"].get("spread_removed", 0.0) for r in results["history"]]
            row = {
                "task": task,
                "p": p,
                "lam": lam,
                "spread_removed": float(np.mean(removed)),
                "metric": metric,
                "value": results["mean"][metric],
                "rounds": rounds,
                "seed": seed,
                "generated": results["federation"]["generated"],
                "description": results["federation"]["description"],
            }
            print(f"p={p:>3} lam={lam:<6g} spread_removed={row['spread_removed']:.3f} validation {metric}={row['value']:.4f}", flush=True)
            rows.append(row)
    return rows


def static_path(checkpoint: Path, lams: list[float], norms: list[str]) -> list[dict]:
    """One server step on the stored Z~ for each (p, lam): the fraction of spread it removes."""
    import torch

    from medfed.federated.strategies.solvers.fusion import fusion_threshold, spread_removed
    from medfed.federated.strategies.solvers.graph import SimilarityGraph, connected_components
    from medfed.federated.strategies.solvers.network_lasso import solve_network_lasso

    server = read_checkpoint(checkpoint)["server"]
    centre = server["personal"].to(torch.float64)
    graph = SimilarityGraph.from_dict(server["graph"])
    components = connected_components(graph.edges, graph.n_sites)
    rows = []
    for p in norms:
        norm = float(p)
        threshold = fusion_threshold(centre, graph, 1.0, norm)
        for lam in lams:
            result = solve_network_lasso(centre, graph.incidence(), lam=lam * threshold, eta=1.0, p=norm, max_iter=2000)
            removed = spread_removed(centre, result.Z, components)
            rows.append({"p": p, "lam": lam, "spread_removed": removed, "iterations": result.iterations})
            print(f"static p={p:>3} lam={lam:<8g} spread_removed={removed:.3f} ({result.iterations} ADMM iterations)", flush=True)
    return rows


def plot_path(rows: list[dict], static: list[dict] | None = None) -> Figure:
    """Two panels against lam: the spread removed, and the validation metric; one line per p."""
    figure = Figure(figsize=(10, 3.8))
    spread_axis, metric_axis = figure.subplots(1, 2)
    positive = sorted({float(r["lam"]) for r in rows if float(r["lam"]) > 0})
    zero_at = positive[0] / 3 if positive else 1e-3  # lam = 0 drawn left of the smallest positive lam
    for p in sorted({r["p"] for r in rows}, key=str):
        mine = sorted((r for r in rows if r["p"] == p), key=lambda r: float(r["lam"]))
        lam = [float(r["lam"]) or zero_at for r in mine]
        spread_axis.plot(lam, [float(r["spread_removed"]) for r in mine], "o-", label=f"p = {p}")
        metric_axis.plot(lam, [float(r["value"]) for r in mine], "o-", label=f"p = {p}")
    for p in sorted({r["p"] for r in static or []}, key=str):
        mine = sorted((r for r in static if r["p"] == p), key=lambda r: float(r["lam"]))
        spread_axis.plot([float(r["lam"]) for r in mine], [float(r["spread_removed"]) for r in mine], "--",
                         label=f"p = {p}, one step on the trained Z~")
    spread_axis.legend(fontsize=7)
    for axis in (spread_axis, metric_axis):
        axis.set_xscale("log")
        axis.set_xlabel("lam (fraction of the fusion threshold; leftmost point: lam = 0)")
        axis.grid(alpha=0.3)
    spread_axis.set_ylabel("between-site spread removed per server step")
    spread_axis.set_ylim(-0.03, 1.03)
    metric_axis.set_ylabel(f"validation {rows[0]['metric']} (mean over sites)")
    metric_axis.legend()
    generated = str(rows[0]["generated"]) in ("True", "true", "1")
    figure.suptitle(
        f"pFedNet lambda path, {rows[0]['task']}, {rows[0]['rounds']} rounds, seed {rows[0]['seed']}"
        + ("; GENERATED data" if generated else ""),
        fontsize=10,
    )
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/brats_lack0.yaml"))
    parser.add_argument("--lams", type=float, nargs="+", default=[0.0, 0.03, 0.1, 0.3, 0.6, 1.0])
    parser.add_argument("--norms", nargs="+", default=["1", "2", "inf"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/lambda_path"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from an existing CSV")
    parser.add_argument("--static", action="store_true", help="also trace one server step on the lam = 0 run's trained Z~")
    parser.add_argument("--static-lams", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0])
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. strategy.pfednet.graph_space=model")
    args = parser.parse_args()
    csv_path = args.out / "lambda_path.csv"
    if args.plot_only:
        with csv_path.open() as handle:
            rows = list(csv.DictReader(handle))
    else:
        rows = run_path(args.config, args.lams, args.norms, args.rounds, args.seed, args.out, args.overrides)
        args.out.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    static = None
    static_csv = args.out / "lambda_path_static.csv"
    if args.static:
        newest = checkpoints(args.out / "runs" / f"p{rows[0]['p']}_lam0.0" / FOLDER)[-1]
        static = static_path(newest, args.static_lams, args.norms)
        with static_csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["p", "lam", "spread_removed", "iterations"])
            writer.writeheader()
            writer.writerows(static)
    elif static_csv.is_file():
        with static_csv.open() as handle:
            static = list(csv.DictReader(handle))
    figure = plot_path(rows, static)
    figure.savefig(args.out / "lambda_path.png", dpi=120)
    print(f"wrote {csv_path} and {args.out / 'lambda_path.png'}")


if __name__ == "__main__":
    main()
