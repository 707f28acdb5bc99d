"""Peak memory of a federated run against the sites' model, gradient and Adam state.

Each setting (strategy x number of sites) runs in a fresh Python process: a
federation of N sites holding a few synthetic BraTS-sized patches each
(``--patches`` training and as many test patches of 4 x 64 x 64; about
0.9 MB per site at 8), one default BraTS U-Net per site (Adam), dense links,
``--rounds`` rounds with a checkpoint after each, exactly as ``medfed fit``
writes it (``--no-checkpoint`` leaves it out). The model state is then the
dominant per-site cost, and the process's peak resident set (``VmHWM`` in
``/proc/self/status``) grows with N at the per-site overhead::

    per site = (peak(N_max) - peak(N_min)) / (N_max - N_min)

printed beside the model + gradient + Adam bytes of one site (4 float32
vectors of the model's size) and their ratio. Torch runs on one thread.

Run from the repository root:

    python -m benchmarks.bench_memory [--sites 5 10 20] [--strategies fedavg pfednet] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20


def peak_rss_bytes() -> int:
    """The process's peak resident set size (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child(strategy: str, n_sites: int, patches: int, rounds: int, checkpoint: bool) -> dict:
    """One run in this process; returns its peak RSS and the model's size."""
    import torch
    from lightning.fabric import Fabric
    from torch.utils.data import TensorDataset

    from medfed.assembly import RunAssembly
    from medfed.checkpoint import save_checkpoint
    from medfed.data.federation import Federation, SiteData
    from medfed.federated.loop import FederatedLoop
    from medfed.federated.sites import InProcessSites
    from medfed.federated.strategies import strategy_from_config
    from medfed.models.segmentation import UNetSegmenter

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)

    def patches_of(n: int, site: int) -> TensorDataset:
        x = torch.randn(n, 4, 64, 64, generator=generator) + 0.1 * site
        y = (x[:, 0] > 1.0).long()
        return TensorDataset(x, y)

    sites = [SiteData(f"site{s}", patches_of(patches, s), patches_of(patches, s)) for s in range(n_sites)]
    federation = Federation("brats", sites, (4, 64, 64), 2, "GENERATED noise patches (memory benchmark)", True)
    torch.manual_seed(0)
    prototype = UNetSegmenter(4, 2, UNetSegmenter.Options(lr=0.003))
    strategy_cls, options = strategy_from_config({"name": strategy, "pfednet": {"min_sketch_samples": 2}})
    strategy_obj = strategy_cls(options, prototype.parameter_split, n_sites, 0)
    assembly = RunAssembly(prototype, strategy_obj, {"name": "dense"}, {"name": "dense"}, batch_size=16, seed=0)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[], callbacks=[])
    site_list = assembly.sites(fabric, federation)
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in site_list]
    with tempfile.TemporaryDirectory() as directory:
        save = (lambda state: save_checkpoint(Path(directory), state, keep=2)) if checkpoint else None
        loop = FederatedLoop(fabric, strategy_obj, InProcessSites(site_list, links), initial, 1, 1.0, 0, save_checkpoint=save)
        loop.fit(rounds)
    return {"peak": peak_rss_bytes(), "d": prototype.parameter_split.size("all")}


def measure(strategy: str, n_sites: int, patches: int, rounds: int, checkpoint: bool) -> dict:
    """Run :func:`child` in a fresh interpreter (so every peak starts from nothing)."""
    command = [sys.executable, "-m", "benchmarks.bench_memory", "--child", strategy, str(n_sites), str(patches), str(rounds)]
    if not checkpoint:
        command.append("--no-checkpoint")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "pfednet"])
    parser.add_argument("--patches", type=int, default=8, help="training (and test) patches per site")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-checkpoint", action="store_true", help="no checkpoint after each round")
    parser.add_argument("--child", nargs=4, metavar=("STRATEGY", "SITES", "PATCHES", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        strategy, n_sites, patches, rounds = args.child
        print(json.dumps(child(strategy, int(n_sites), int(patches), int(rounds), not args.no_checkpoint)))
        return

    sites = sorted(args.sites)
    peaks = {s: {n: measure(s, n, args.patches, args.rounds, not args.no_checkpoint) for n in sites} for s in args.strategies}
    d = next(iter(next(iter(peaks.values())).values()))["d"]
    state = 4 * 4 * d  # model + gradient + Adam's two moments, float32
    print(f"U-Net d = {d:,} parameters; model + gradient + Adam = {state / MIB:.1f} MiB per site; "
          f"{args.patches} + {args.patches} patches per site; {args.rounds} rounds; "
          f"checkpoint {'off' if args.no_checkpoint else 'after every round'}")
    print(f"{'peak RSS (MiB)':<16}" + "".join(f"{s:>12}" for s in args.strategies))
    for n in sites:
        print(f"{f'{n} sites':<16}" + "".join(f"{peaks[s][n]['peak'] / MIB:>12.0f}" for s in args.strategies))
    slopes = {s: (peaks[s][sites[-1]]["peak"] - peaks[s][sites[0]]["peak"]) / (sites[-1] - sites[0]) for s in args.strategies}
    print(f"{'per site (MiB)':<16}" + "".join(f"{slopes[s] / MIB:>12.1f}" for s in args.strategies))
    print(f"{'/ model+grad+Adam':<16}" + "".join(f"{slopes[s] / state:>11.2f}x" for s in args.strategies))


if __name__ == "__main__":
    main()
