"""Coverage of compare's candidate 95% intervals on simulated comparisons whose sites share their seed.

Prints, as a markdown table, the share of simulated comparisons (true difference 0: the same algorithm twice) whose
interval contains 0, per interval method (:data:`medfed.compare_stats.INTERVALS`) and intra-seed correlation ρ
(:func:`medfed.compare_stats.coverage`); docs/compare.md quotes it, tests/test_compare_stats.py asserts it.

    python benchmarks/interval_coverage.py --seeds 5 --sites 5 --replicates 4000
"""

from __future__ import annotations

import argparse

from medfed.compare_stats import INTERVALS, coverage

NAMES = {
    "pairs_t": "t over the (seed, site) pairs (medfed's tables before)",
    "seeds_t": "t over the seeds' means (the tables now)",
    "seed_bootstrap": "percentile bootstrap resampling the seeds",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--replicates", type=int, default=4000)
    parser.add_argument("--correlations", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.7])
    args = parser.parse_args()
    header = f"| interval ({args.seeds} seeds x {args.sites} sites, {args.replicates} comparisons) | " + " | ".join(
        f"ρ = {rho:g}" for rho in args.correlations
    )
    print(header + " |\n|---|" + "---|" * len(args.correlations))
    for method in INTERVALS:
        cells = [f"{coverage(method, args.seeds, args.sites, rho, replicates=args.replicates):.3f}" for rho in args.correlations]
        print(f"| {NAMES[method]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
