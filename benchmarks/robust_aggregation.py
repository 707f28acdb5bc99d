"""docs/robust.md's table: FedAvg's accuracy with one hostile site of five, under each aggregation rule, over seeds.

``python benchmarks/robust_aggregation.py run [--output outputs/robust] [--jobs 2]`` writes one grid per data
set (:data:`DATASETS`) and runs it with ``python -m medfed compare`` (resumable: the same command finishes an
interrupted grid), then prints the table; ``table`` prints it from the finished grids only, ``--write FILE``
rewrites FILE's ``robust-table`` block with it. Each grid's settings are (aggregation rule x attack): the rule
``aggregation.name`` (:mod:`medfed.federated.aggregate`) against no attack and against site 4 of 5 as the
evaluation-only hostile site (``attack.sites=[4]``, :mod:`medfed.federated.attack`), scaling its update by 100 or
flipping its sign. ``federation.update_norm_limit=null`` in every run: the server's outlier check (which
refuses a x100 update by its norm) is off, so that the rule alone is measured.

Each cell: the last round's metric, mean over the five sites, then mean ± std over the seeds and the 95% t
interval over seeds (:func:`medfed.compare_stats.summarise`), and the worst site's (mean over seeds). The
hostile site is counted among the five: it trains and is evaluated honestly, only its reply is altered.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import numpy as np

from medfed.compare_stats import summarise

RULES = ("mean", "median", "trimmed_mean")
ATTACKS = {"none": [], "scale100": ["attack.sites=[4]", "attack.kind=scale", "attack.factor=100"],
           "sign_flip": ["attack.sites=[4]", "attack.kind=sign_flip"]}
ATTACK_NAMES = {"none": "no attack", "scale100": "site 4 scales its update x100", "sign_flip": "site 4 flips its update's sign"}
DATASETS = {
    "clinical": {
        "config": "clinical_delta1", "metrics": ["accuracy", "balanced_accuracy"],
        "overrides": [], "label": "clinical_delta1 (REAL records: the Wisconsin breast-cancer table, 5 sites, logistic regression)",
    },
    "brats": {
        "config": "brats_lack0", "metrics": ["label_iou", "iou"],
        # sized down to fit the hour (see docs/robust.md): 10 rounds, 32 x 32 patches, no whole-volume evaluation
        "overrides": ["trainer.rounds=10", "data.patch_size=32", "evaluation.volume_every=null"],
        "label": "brats_lack0 (GENERATED phantoms, 5 sites, 2 without FLAIR, U-Net; 10 rounds, 32 x 32 patches)",
    },
}
SEEDS = (0, 1, 2)
COMMON = ["federation.update_norm_limit=null", "logger.wandb=disabled"]


def write_grid(dataset: str, output: Path) -> Path:
    """The grid file of ``dataset``: one setting per (rule, attack), FedAvg, :data:`SEEDS`."""
    spec = DATASETS[dataset]
    lines = ["configs:"]
    for rule in RULES:
        for attack, overrides in ATTACKS.items():
            lines += [f"  - name: {rule}-{attack}", f"    config: {spec['config']}",
                      f"    overrides: [{_quoted([f'aggregation.name={rule}', *overrides])}]"]
    lines += ["strategies: [fedavg]", f"seeds: [{', '.join(map(str, SEEDS))}]",
              f"overrides: [{_quoted([*COMMON, *spec['overrides']])}]", f"metrics: [{', '.join(spec['metrics'])}]",
              f"output: {output / dataset}"]
    path = output / f"{dataset}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _quoted(overrides: list[str]) -> str:
    """YAML flow-list items, each double-quoted (an override's own brackets, ``attack.sites=[4]``, stay text)."""
    return ", ".join(f'"{override}"' for override in overrides)


def table(output: Path) -> str:
    """The markdown tables of the finished grids in ``output`` (a dataset whose comparison.csv is missing is left out)."""
    parts = []
    for dataset, spec in DATASETS.items():
        path = output / dataset / "comparison.csv"
        if not path.is_file():
            continue
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        metric = spec["metrics"][0]
        head = f"**{spec['label']}**: last-round {metric}, FedAvg, {len(SEEDS)} seeds (mean ± std [95% t interval]; worst site)"
        lines = [head, "", "| aggregation | " + " | ".join(ATTACK_NAMES[a] for a in ATTACKS) + " |", "|---" * (len(ATTACKS) + 1) + "|"]
        for rule in RULES:
            cells = []
            for attack in ATTACKS:
                chosen = [row for row in rows if row["config"] == f"{rule}-{attack}" and row["strategy"] == "fedavg"]  # not the baselines
                per_seed: dict[str, list[float]] = {}
                for row in chosen:
                    per_seed.setdefault(row["seed"], []).append(float(row[f"last_{metric}"]))
                if not per_seed:
                    cells.append("—")
                    continue
                summary = summarise([float(np.mean(values)) for values in per_seed.values()])
                worst = float(np.mean([min(values) for values in per_seed.values()]))
                cells.append(f"{summary.mean:.3f} ± {summary.std:.3f} [{summary.low:.3f}, {summary.high:.3f}]; {worst:.3f} (n={summary.n})")
            lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "table"))
    parser.add_argument("--output", type=Path, default=Path("outputs/robust"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--write", type=Path, help="a markdown file whose robust-table block to rewrite")
    args = parser.parse_args(argv)
    if args.command == "run":
        from medfed.cli import main as medfed

        for dataset in DATASETS:
            grid = write_grid(dataset, args.output)
            status = medfed(["compare", "--grid", str(grid), "--jobs", str(args.jobs), "--quiet"])
            if status != 0:
                print(f"robust_aggregation: compare of {grid} ended with status {status}", file=sys.stderr)
    text = table(args.output)
    print(text)
    if args.write is not None:
        block = re.compile(r"(<!-- robust-table: [^\n]*-->\n).*?(\n<!-- /robust-table -->)", re.S)
        page = args.write.read_text()
        if not block.search(page):
            raise SystemExit(f"{args.write}: no robust-table block")
        args.write.write_text(block.sub(lambda m: m.group(1) + text + m.group(2), page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
