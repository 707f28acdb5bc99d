"""What limits a training step: operators (kernels on CUDA) per step, and dispatch against compute time.

For a model and N sites (benchmarks/throughput.py's GENERATED data, FedAvg, batch 16 a site), each executor's
training of one measured round runs under ``torch.profiler``:

* ``sequential``: the sites one after another (:meth:`Site.train`);
* ``batched``: the sites stacked, one vmapped step per batch shape (:mod:`medfed.federated.batched`);
* ``compiled``: the compiled static-shape step (:mod:`medfed.federated.stacked`; CUDA graphs on cuda).

Per optimiser step of the federation (all N sites' step t), it prints the wall time, the operators the
dispatcher ran (``aten::*`` calls, nested ones included: an upper bound of the kernel launches on CUDA), the CUDA kernels and the
GPU's busy time where there is a GPU, and the operators with the most self time. The same round at a tiny
size (U-Net of 2 x 2 channels on 8 x 8 patches, the same operators and launches, next to no arithmetic) gives
the step's fixed cost, its *dispatch* time; the rest of the full-size step is *compute*.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/step_profile.py [--model unet] [--sites 5] [--device cpu] [--executors sequential batched compiled]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_spec = importlib.util.spec_from_file_location("throughput", Path(__file__).with_name("throughput.py"))
throughput = importlib.util.module_from_spec(_spec)
sys.modules["throughput"] = throughput
_spec.loader.exec_module(throughput)

from medfed.assembly import RunAssembly, make_fabric  # noqa: E402
from medfed.federated.loop import FederatedLoop  # noqa: E402
from medfed.federated.sites import InProcessSites, executor_for  # noqa: E402
from medfed.federated.strategies import strategy_from_config  # noqa: E402


def _loop(setting: throughput.Setting, n_sites: int, executor: str) -> tuple[FederatedLoop, InProcessSites]:
    federation = setting.federation(n_sites)
    prototype = setting.prototype()
    strategy_cls, options = strategy_from_config({"name": "fedavg"})
    strategy = strategy_cls(options, prototype.parameter_split, n_sites, 0)
    compiled = executor == "compiled"
    assembly = RunAssembly(prototype, strategy, {"name": "dense"}, {"name": "dense"}, throughput.BATCH, 0, compile=compiled)
    fabric = make_fabric(setting.trainer(), loggers=[], callbacks=[])
    sites = assembly.sites(fabric, federation)
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in sites]
    option = "sequential" if executor == "sequential" else "batched"
    sites_part = InProcessSites(sites, links, executor_for(option, fabric.device, dp_sgd=False, compile=compiled))
    return FederatedLoop(fabric, strategy, sites_part, initial, 1, 1.0, 0), sites_part


def profiled_round(setting: throughput.Setting, n_sites: int, executor: str, warmup: int = 2) -> dict:
    """One round's training after ``warmup`` rounds, profiled: per step wall seconds, operators, kernels, GPU busy seconds."""
    loop, sites_part = _loop(setting, n_sites, executor)
    loop.fit(warmup)
    steps = loop.sites[0].batches_per_epoch  # every site the same size: N sites' step t is one federation step
    device = loop.fabric.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    timing: dict[str, float] = {}
    profiles = []
    work = sites_part.work

    def profiled(phase, messages, timing_here):  # the phase's work: receive, the training plans, reply
        with profile(activities=activities) as prof:
            results = work(phase, messages, timing_here)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        timing.update(timing_here)
        profiles.append(prof)
        return results

    sites_part.work = profiled
    loop.fit(warmup + 1)
    (prof,) = profiles
    events = prof.key_averages()
    operators = sum(e.count for e in events if e.key.startswith("aten::") and e.device_type.name == "CPU")
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    top = Counter({e.key: e.self_cpu_time_total for e in events if e.key.startswith("aten::")}).most_common(6)
    return {
        "train_s": timing["train_s"] / steps,
        "operators": operators / steps,
        "kernels": kernels / steps,
        "gpu_busy_s": busy / steps,
        "top": [(key, seconds / 1e6 / steps) for key, seconds in top],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=throughput.MODELS, default="unet")
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--patch", type=int, default=None, help="U-Net patch side (default 32 on the CPU, 64 on CUDA)")
    parser.add_argument("--executors", nargs="+", choices=("sequential", "batched", "compiled"), default=["sequential", "batched", "compiled"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    patch = args.patch or (32 if args.device == "cpu" else 64)
    full = throughput.Setting(args.model, args.device, 64, patch, None, "32", False, 1, 1, 0.0)
    tiny = throughput.Setting(args.model, args.device, 64, 8, (2, 2), "32", False, 1, 1, 0.0)
    print(f"# {throughput.machine()}")
    print(f"# {args.model}, N = {args.sites}, batch {throughput.BATCH} a site, {args.device}; per federation step (every site's step t)")
    print("| executor | step ms | operators | CUDA kernels | GPU busy ms | dispatch ms (tiny) | compute ms | top operators (self ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for executor in args.executors:
        measured = profiled_round(full, args.sites, executor)
        fixed = profiled_round(tiny, args.sites, executor) if args.model == "unet" else None
        dispatch = fixed["train_s"] if fixed else float("nan")
        top = ", ".join(f"{key.removeprefix('aten::')} {seconds * 1e3:.1f}" for key, seconds in measured["top"][:4])
        print(
            f"| {executor} | {measured['train_s'] * 1e3:.1f} | {measured['operators']:.0f} | {measured['kernels']:.0f} | "
            f"{measured['gpu_busy_s'] * 1e3:.1f} | {dispatch * 1e3:.1f} | {(measured['train_s'] - dispatch) * 1e3:.1f} | {top} |"
        )
    print(f"# {throughput.machine()}")


if __name__ == "__main__":
    main()
