"""One federation through three engines: medfed's simulator, Flower's simulation engine, a localhost Flower deployment.

The same config and seed (default: brats_lack0, fedavg and pfednet, 3
rounds; ``evaluation.volume_every=null`` because a deployment evaluates
patches only, ``trainer.num_threads=1`` so that every process computes
alike, and any further ``key=value`` overrides given) runs

* through the simulator (``python -m medfed fit``, every site in one process),
* through Flower's simulation engine (``flwr.simulation.run_simulation``
  with ray, ``pip install "flwr[simulation]>=1.41,<1.42"``: medfed's
  ServerApp and, per virtual node, medfed's ClientApp on that site's own
  folder; one CPU per ray actor, so a site's messages may go to different
  actors, each building the site from its state folder when it has not
  answered the site's previous message),
* through a localhost deployment (:class:`~medfed.deploy.local.LocalFederation`:
  a SuperLink, per site a SuperNode and its resident runner, ``flwr run``),

each site's data in a folder of its own (``site_cases`` / ``site_records``)
for the two Flower engines. Wall times are end to end per run (process
start to results written: imports, data, every round); the deployment's
federation (SuperLink, SuperNodes, runners) is started once before its runs
and timed apart. Each engine's per-site metrics and bytes are compared with
the simulator's. The table goes to stdout and ``<out>/bench_deploy.md``,
with the machine and its load average.

    python benchmarks/bench_deploy.py [--config configs/brats_lack0.yaml] [--strategies fedavg,pfednet]
        [--rounds 3] [--out outputs/bench_deploy] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from medfed.components import resolve
from medfed.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _site_folders(config: Path, overrides: list[str], out: Path) -> list[Path]:
    """Each site's own data folder (written once), as the simulator deals the sites."""
    resolved = resolve(load_config(config, overrides))
    task, run = resolved.task, resolved.run
    if task.name == "brats":
        from medfed.tasks.brats import site_cases

        return site_cases(resolved.data_options, run.federation, run.trainer.seed, out / "sites", progress=False)
    if task.name == "clinical":
        from medfed.tasks.clinical import site_records

        return [path.parent for path in site_records(resolved.data_options, run.federation, run.trainer.seed, out / "sites")]
    print(f"bench_deploy: error: config key 'data.task' = {task.name!r}: no per-site data writer for a rehearsal (clinical, brats)", file=sys.stderr)
    raise SystemExit(2)


def _simulator(config: Path, overrides: list[str], out: Path) -> tuple[float, dict]:
    """``python -m medfed fit`` in a child process: (wall s, results)."""
    tic = time.perf_counter()
    command = [sys.executable, "-m", "medfed", "fit", "--config", str(config), "--quiet", "--overwrite", *overrides, f"output_dir={out}"]
    subprocess.run(command, check=True)
    return time.perf_counter() - tic, json.loads((out / "results.json").read_text())


def _flower_simulation(config: Path, overrides: list[str], folders: list[Path], out: Path) -> tuple[float, dict]:
    """This script's ``--flower-simulation`` in a child process of its own session, its group stopped by pid after: (wall s, results)."""
    tic = time.perf_counter()
    arguments = ["--flower-simulation", json.dumps({"config": str(config), "overrides": overrides, "folders": [str(f) for f in folders], "out": str(out)})]
    popen = subprocess.Popen([sys.executable, __file__, *arguments], start_new_session=True)
    try:
        os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its pid, the group's id, stays taken
    finally:
        with contextlib.suppress(ProcessLookupError):  # the child if interrupted, and any of ray's processes that outlived it
            os.killpg(popen.pid, signal.SIGKILL)
        status = popen.wait()
    if status != 0:
        raise SystemExit(f"bench_deploy: error: Flower's simulation engine failed (status {status})")
    return time.perf_counter() - tic, json.loads((out / "results.json").read_text())


def _run_flower_simulation(spec: dict[str, Any]) -> None:
    """``run_simulation`` with medfed's ServerApp (its run config given here) and ClientApp on each site's folder."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from medfed.deploy import server_app
    from medfed.deploy.client_app import simulation_app

    out = Path(spec["out"])
    shutil.rmtree(out, ignore_errors=True)  # an earlier bench's checkpoints and site states would be refused
    run_config = {
        "config": spec["config"], "overrides": " ".join(spec["overrides"]), "run-name": "simulation", "output-dir": str(out),
        "reply-timeout-s": 3600.0, "resume": False,
    }
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = run_config  # run_simulation gives the ServerApp no run config of ours
        server_app.main(grid, context)

    folders = [Path(folder) for folder in spec["folders"]]
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": os.cpu_count() or 1}}
    run_simulation(server, simulation_app(folders, out / "state"), num_supernodes=len(folders), backend_config=backend)


def _deployment_runs(
    config: Path, strategies: list[str], overrides: list[str], folders: list[Path], out: Path
) -> tuple[float, dict[str, tuple[float, dict]]]:
    """A LocalFederation started once, then one ``flwr run`` per strategy: (start-up s, {strategy: (wall s, results)})."""
    from medfed.deploy.local import LocalFederation

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    runs = {}
    shutil.rmtree(out, ignore_errors=True)  # an earlier bench's checkpoints and site states would be refused
    with LocalFederation(out / "flwr", env=env) as local:
        tic = time.perf_counter()
        local.start_superlink()
        for index, folder in enumerate(folders):
            local.start_supernode(index, folder, state_dir=str(out / f"state{index}"))
        started = time.perf_counter() - tic
        for strategy in strategies:
            result = out / strategy
            run_config = {
                "config": str(config), "overrides": " ".join([*overrides, f"strategy.name={strategy}"]), "output-dir": str(result),
                "run-name": strategy, "reply-timeout-s": 3600.0,
            }
            tic = time.perf_counter()
            log = local.run(REPO, run_config, timeout_s=4 * 3600)
            if not (result / "results.json").is_file():
                raise SystemExit(f"bench_deploy: error: the deployed {strategy} run wrote no results; its log ends:\n{log[-2000:]}")
            runs[strategy] = time.perf_counter() - tic, json.loads((result / "results.json").read_text())
    return started, runs


def _same(results: dict, reference: dict) -> str:
    """Whether every round's per-site metrics (and bytes) equal the reference's."""
    metrics = [r["metrics"] for r in results["history"]] == [r["metrics"] for r in reference["history"]]
    traffic = [r["bytes"] for r in results["history"]] == [r["bytes"] for r in reference["history"]]
    return "yes" if metrics and traffic else ("metrics only" if metrics else "no")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "brats_lack0.yaml")
    parser.add_argument("--strategies", default="fedavg,pfednet")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_deploy")
    parser.add_argument("--flower-simulation", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.flower_simulation:
        _run_flower_simulation(json.loads(args.flower_simulation))
        return
    bad = [item for item in overrides if "=" not in item or item.startswith("-")]
    if bad:
        parser.error(f"expected key=value overrides, got {' '.join(bad)}")
    strategies = args.strategies.split(",")
    config = args.config.resolve()
    out = args.out.resolve()
    common = [f"trainer.rounds={args.rounds}", "trainer.num_threads=1", "evaluation.volume_every=null", "logger.wandb=disabled", *overrides]
    folders = _site_folders(config, common, out)

    rows = []
    simulated = {}
    for strategy in strategies:
        chosen = [*common, f"strategy.name={strategy}"]
        wall, simulated[strategy] = _simulator(config, chosen, out / "simulator" / strategy)
        rows.append((strategy, "medfed simulator", wall, simulated[strategy], "-"))
        wall, results = _flower_simulation(config, chosen, folders, out / "flower-simulation" / strategy)
        rows.append((strategy, "Flower simulation engine (ray)", wall, results, _same(results, simulated[strategy])))
    started, deployed = _deployment_runs(config, strategies, common, folders, out / "deployment")
    for strategy, (wall, results) in deployed.items():
        rows.append((strategy, "localhost deployment", wall, results, _same(results, simulated[strategy])))

    rows.sort(key=lambda row: strategies.index(row[0]))
    machine = f"{platform.node()}: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load average {os.getloadavg()}"
    lines = [
        f"{config.name}, {args.rounds} rounds, overrides: {' '.join(common)}; {machine}",
        "",
        "| strategy | engine | wall s (end to end) | x simulator | metrics and bytes equal the simulator's |",
        "|---|---|---|---|---|",
    ]
    for strategy, engine, wall, _, same in rows:
        reference = next(w for s, e, w, _, _ in rows if s == strategy and e == "medfed simulator")
        lines.append(f"| {strategy} | {engine} | {wall:.1f} | {wall / reference:.2f} | {same} |")
    lines += ["", f"The deployment's SuperLink, {len(folders)} SuperNodes and runners started in {started:.1f} s (once, before its runs)."]
    text = "\n".join(lines)
    print(text)
    (out / "bench_deploy.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
