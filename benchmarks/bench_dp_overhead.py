"""Wall time of DP-SGD per round against the same run without DP, side by side in one sitting.

For each config (clinical_delta2, a reduced brats_lack0) and strategy, runs
the non-private and the DP-SGD run (``privacy.dp.noise_multiplier``, C = 1)
alternately, ``--repeats`` times each, and prints the median per-round
training time (``timing.train_s``, the sites' local work) and whole-round time
(``timing.round_s``) of each, and their ratio. The runs go through the real
CLI into a temporary folder; the first round of each run is left out (warm-up).

    python benchmarks/bench_dp_overhead.py [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from medfed.cli import main as medfed

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("clinical_delta2", ["trainer.rounds=4"], ["fedavg", "pfednet"]),
    ("brats_lack0", ["trainer.rounds=2", "data.patch_size=32", "evaluation.volume_every=null"], ["fedavg"]),
]
DP = ["privacy.dp.noise_multiplier=1.0", "privacy.dp.max_grad_norm=1.0"]


def _per_round(config: str, overrides: list[str], strategy: str, private: bool, threads: int, folder: Path) -> tuple[float, float]:
    output = folder / f"{config}-{strategy}-{'dp' if private else 'plain'}"
    args = [
        "fit", "--config", str(ROOT / "configs" / f"{config}.yaml"), "--quiet", "--overwrite",
        f"output_dir={output}", "logger.wandb=disabled", f"trainer.num_threads={threads}", f"strategy.name={strategy}",
        "strategy.pfednet.graph_space=model",  # DP-SGD fits pFedNet in model space (docs/privacy.md)
        *overrides, *(DP if private else []),
    ]
    assert medfed(args) == 0, args
    history = json.loads((output / "results.json").read_text())["history"][1:]
    return statistics.mean(r["timing"]["train_s"] for r in history), statistics.mean(r["timing"]["round_s"] for r in history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor()} torch threads={args.threads}, {torch.__version__}")
    print(f"{'config':<16} {'strategy':<8} {'train_s plain':>13} {'train_s DP':>10} {'ratio':>6} {'round_s plain':>13} {'round_s DP':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for config, overrides, strategies in CASES:
            for strategy in strategies:
                times = {False: [], True: []}
                for _ in range(args.repeats):
                    for private in (False, True):  # alternate, so drifting load hits both alike
                        times[private].append(_per_round(config, overrides, strategy, private, args.threads, Path(tmp)))
                plain = [statistics.median(t[i] for t in times[False]) for i in (0, 1)]
                dp = [statistics.median(t[i] for t in times[True]) for i in (0, 1)]
                print(
                    f"{config:<16} {strategy:<8} {plain[0]:>13.3f} {dp[0]:>10.3f} {dp[0] / plain[0]:>6.2f} "
                    f"{plain[1]:>13.3f} {dp[1]:>10.3f} {dp[1] / plain[1]:>6.2f}"
                )


if __name__ == "__main__":
    main()
