"""What secure aggregation costs a deployment: FedAvg's round time on a localhost federation with and without SecAgg+.

A SuperLink and, per site, a SuperNode and its runner on 127.0.0.1
(:class:`~medfed.deploy.local.LocalFederation`), the clinical task (the
embedded table, each site's rows in a folder of its own), FedAvg for
``--rounds`` rounds, runs alternating plain and ``deploy.secure_aggregation=true``
``--repeats`` times, one after the other on the same federation. Prints
each run's per-round times (``timing.round_s`` of results.json, round 1
included) and the mean ratio of SecAgg+'s to plain, measured side by side,
with the machine and its load average before and after.

    python benchmarks/bench_secagg.py [--sites 3] [--rounds 3] [--repeats 2] [--out outputs/bench_secagg]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from medfed.config import FederationConfig  # noqa: E402
from medfed.deploy.local import LocalFederation  # noqa: E402
from medfed.tasks import clinical  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_secagg")
    args = parser.parse_args()
    out = args.out.resolve()
    csv = out / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=args.sites), 0, out / "sites")
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"plain": [], "SecAgg+": []}
    with LocalFederation(out / "flwr", env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}) as local:
        local.start_superlink()
        for index, file in enumerate(files):
            local.start_supernode(index, file.parent, state_dir=str(out / f"state{index}"))
        for repeat in range(args.repeats):
            for label, extra in (("plain", ""), ("SecAgg+", " deploy.secure_aggregation=true")):
                name = f"{'secure' if extra else 'plain'}-{repeat}"
                overrides = (f"data.csv={csv} federation.n_sites={args.sites} federation.label_ratio=null strategy.name=fedavg "
                             f"trainer.rounds={args.rounds} trainer.num_threads=1 logger.wandb=disabled{extra}")
                log = local.run(REPO, {"config": str(REPO / "configs" / "clinical_delta1.yaml"), "overrides": overrides,
                                       "output-dir": str(out / name), "run-name": name, "reply-timeout-s": 120.0}, 900)
                results = out / name / "results.json"
                if not results.is_file():
                    sys.exit(f"{name} wrote no results.json; its log ends:\n{log[-2000:]}")
                rounds = [record["timing"]["round_s"] for record in json.loads(results.read_text())["history"]]
                times[label].extend(rounds)
                print(f"{label:8s} run {repeat}: round_s {', '.join(f'{t:.1f}' for t in rounds)}", flush=True)
    load_after = os.getloadavg()
    plain, secure = statistics.mean(times["plain"]), statistics.mean(times["SecAgg+"])
    print(f"\n{args.sites} sites, FedAvg, clinical, {args.rounds} rounds x {args.repeats} runs each; "
          f"{platform.machine()} {os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"mean round_s: plain {plain:.1f} s, SecAgg+ {secure:.1f} s, ratio {secure / plain:.2f}")


if __name__ == "__main__":
    main()
