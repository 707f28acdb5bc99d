"""The price of federation: the pooled (centralised) reference against the best federated method, paired over seeds.

Reads two comparisons of the same settings and seeds (their comparison.csv): the grid's own, where the pooled
reference took ``trainer.local_epochs`` passes over the union of the sites' training data each round (equal
*samples*: every sample once per round, as every site's model; the union's B x n_sites steps a round against a
site's B), and one of ``pooled`` alone at ``trainer.local_epochs = 1 / n_sites`` (equal *optimiser steps*: as many
steps a round as one site's model). Both ran to their validation plateau when the grids say so.

For each setting and both pooled runs, prints the paired difference pooled - best federated method (the federated
method of the highest mean; ``local`` counts among them), per seed the mean over sites, with a 95% t interval over
seeds (:mod:`medfed.compare_stats`), as a markdown table.

    python benchmarks/pooled_gap.py outputs/compare/conclusive_brats/comparison.csv \\
        outputs/compare/conclusive_brats_pooled_steps/comparison.csv --column last_label_iou
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from medfed.compare_stats import pair_up, seed_values, site_values, summarise

NOT_FEDERATED = ("pooled",)


def read(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key, value in row.items():
            if key not in ("config", "strategy", "site", "tuned"):
                try:
                    row[key] = None if value == "" else float(value)
                except ValueError:
                    pass
    return rows


def gap_lines(grid_rows: list[dict], steps_rows: list[dict], column: str) -> list[str]:
    """The markdown table: per setting, the best federated method and each pooled reference's paired gap to it."""
    renamed = [{**row, "strategy": "pooled (equal steps)"} for row in steps_rows if row["strategy"] == "pooled"]
    rows = [*grid_rows, *renamed]
    values, means = site_values(rows, column), seed_values(rows, column)
    settings = list(dict.fromkeys(row["config"] for row in grid_rows))
    lines = [
        f"| setting | best federated ({column}) | pooled, equal samples | gap | pooled, equal steps | gap |",
        "|---|---|---|---|---|---|",
    ]
    for setting in settings:
        federated = {
            m: summarise(list(v.values())).mean for (s, m), v in means.items()
            if s == setting and m not in NOT_FEDERATED and not m.startswith("baseline:") and m != "pooled (equal steps)"
        }
        best = max(federated, key=federated.get)
        cells = [f"{best} {federated[best]:.3f}"]
        for pooled in ("pooled", "pooled (equal steps)"):
            if (setting, pooled) not in values:
                cells += ["—", "—"]
                continue
            paired = pair_up(values[(setting, pooled)], values[(setting, best)])
            interval = f" [{paired.low:+.3f}, {paired.high:+.3f}]" if math.isfinite(paired.low) else ""
            cells += [f"{summarise(list(means[(setting, pooled)].values())).mean:.3f}", f"{paired.mean:+.3f}{interval} ({paired.n} seeds)"]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the grid's comparison.csv (pooled at the grid's local_epochs among the methods)")
    parser.add_argument("steps", type=Path, help="comparison.csv of pooled alone at trainer.local_epochs = 1 / n_sites")
    parser.add_argument("--column", default="last_label_iou", help="the comparison.csv column (default last_label_iou)")
    args = parser.parse_args()
    print("\n".join(gap_lines(read(args.grid), read(args.steps), args.column)))


if __name__ == "__main__":
    main()
