"""Record what a list of runs computes, and compare two such records exactly: a refactoring's behaviour check.

``record`` runs each run of a list (``python -m medfed fit`` in this process,
one torch thread, W&B off) and writes one JSON file holding, per run, the
``history`` of its results.json with every timing field removed (a round's
``timing``, and any ``*_s`` key of the server's metrics). ``compare`` reads two
such files and reports every run whose history differs, value by value: a
refactoring that keeps behaviour leaves them equal bit for bit on the CPU
(floats are compared as JSON writes them, the shortest repr that reads back
to the same double)::

    python benchmarks/behaviour_snapshot.py record before.json            # on the untouched code
    python benchmarks/behaviour_snapshot.py record after.json             # on the changed code
    python benchmarks/behaviour_snapshot.py compare before.json after.json

The runs (``--runs``): ``clinical`` (a 3-round clinical_delta1 run of every
registered strategy, sequential and batched executor), ``brats`` (a 2-round
brats_lack0 run), ``dp`` (3 rounds of three clinical_delta1 strategies, one
and two plans a phase, under DP-SGD), ``brats_small`` (a 2-round brats_lack0 run of every strategy
and executor at 32x32 patches, a quarter epoch a round, no whole volumes), or
``all``. Exit status 0: equal; 1: some differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the fixed overrides of every run: one thread (float sums split over threads may round differently), no W&B
COMMON = ("trainer.num_threads=1", "logger.wandb=disabled")


def runs(which: str) -> dict[str, tuple[str, list[str]]]:
    """``{run name: (config, overrides)}`` of the run set ``which``."""
    from medfed.components import STRATEGY_NAMES

    chosen: dict[str, tuple[str, list[str]]] = {}
    if which in ("clinical", "all"):
        for executor in ("sequential", "batched"):
            for name in STRATEGY_NAMES:
                chosen[f"clinical_delta1/{name}/{executor}"] = (
                    "clinical_delta1",
                    [f"strategy.name={name}", "trainer.rounds=3", f"trainer.executor={executor}"],
                )
    if which in ("dp", "all"):  # DP-SGD: its noise is seeded per training call of a phase (several plans a phase)
        for name in ("fedavg", "fedrep", "ditto"):
            chosen[f"clinical_delta1_dp/{name}"] = (
                "clinical_delta1", [f"strategy.name={name}", "trainer.rounds=3", "privacy.dp.noise_multiplier=0.5"],
            )
    if which in ("brats", "all"):
        chosen["brats_lack0/pfednet"] = ("brats_lack0", ["trainer.rounds=2"])
    if which in ("brats_small", "all"):  # a U-Net with shared and personal parts (the clinical model is all personal)
        for executor in ("sequential", "batched"):
            for name in STRATEGY_NAMES:
                chosen[f"brats_small/{name}/{executor}"] = (
                    "brats_lack0",
                    [
                        f"strategy.name={name}", "trainer.rounds=2", "trainer.local_epochs=0.25", "data.patch_size=32",
                        "evaluation.volume_every=null", f"trainer.executor={executor}",
                    ],
                )
    return chosen


def without_timing(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``history`` without the fields that measure time (they differ between any two runs)."""
    kept = []
    for record in history:
        record = {key: value for key, value in record.items() if key != "timing"}
        if isinstance(record.get("server"), dict):
            record["server"] = {key: value for key, value in record["server"].items() if not key.endswith("_s")}
        kept.append(record)
    return kept


def record(path: Path, which: str) -> None:
    """Run every run of ``which`` and write ``{run name: history without timing}`` to ``path``."""
    from medfed.fit import fit

    snapshot: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="medfed-snapshot-") as scratch:
        for index, (name, (config, overrides)) in enumerate(runs(which).items()):
            output = Path(scratch) / str(index)
            tic = time.perf_counter()
            status = fit(config, [*overrides, *COMMON, f"output_dir={output}"], quiet=True)
            if status != 0:
                snapshot[name] = {"exit_status": status}
            else:
                snapshot[name] = without_timing(json.loads((output / "results.json").read_text())["history"])
            print(f"{name}: {time.perf_counter() - tic:.1f} s", file=sys.stderr)
    path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")


def differences(before: Any, after: Any, where: str = "") -> list[str]:
    """Every place ``before`` and ``after`` differ (``key/index: before != after``), exactly (floats included)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = [f"{where}/{key}: only in {'before' if key in before else 'after'}" for key in sorted(set(before) ^ set(after))]
        for key in sorted(set(before) & set(after)):
            found += differences(before[key], after[key], f"{where}/{key}")
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [line for i, (b, a) in enumerate(zip(before, after)) for line in differences(b, a, f"{where}/{i}")]
    same = type(before) is type(after) and (before == after or (before != before and after != after))  # NaN == NaN here
    return [] if same else [f"{where}: {before!r} != {after!r}"]


def compare(before_path: Path, after_path: Path) -> int:
    """Print the runs whose histories differ (and the first differences); 0 where every run is equal, else 1."""
    before, after = json.loads(before_path.read_text()), json.loads(after_path.read_text())
    found = differences(before, after)
    for line in found[:40]:
        print(line)
    differing = sorted({line.split("/", 3)[1] + "/" + line.split("/", 3)[2] for line in found if line.count("/") >= 2})
    print(f"{len(before)} runs before, {len(after)} after; {len(found)} differences" + (f" in {', '.join(differing)}" if differing else ""))
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run the runs, write their histories")
    rec.add_argument("output", type=Path)
    rec.add_argument("--runs", choices=("clinical", "dp", "brats", "brats_small", "all"), default="all")
    cmp = commands.add_parser("compare", help="compare two recorded files exactly")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.output, args.runs)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
