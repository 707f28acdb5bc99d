"""Training throughput: samples/s over all sites, sites in turn vs stacked vs one centralised model (issue 21).

In one process, for each device (the CPU always, CUDA where present), model
and number of sites N, three columns measured side by side:

* ``sequential``: ``trainer.executor=sequential``, the sites of a FedAvg
  round training one after another (:class:`~medfed.federated.sites.InProcessSites`);
* ``batched``: ``trainer.executor=batched``, the sites stacked and trained by
  one vmapped step (measured where this medfed has the option; ``-`` otherwise);
* ``central``: the centralised reference, one model of the same kind
  trained on the pooled samples of all N sites at batch 16 x N.

Every column trains the same model with the same loss, optimiser (the
model's Adam), ``trainer.precision`` and ``trainer.compile``, built as
``medfed fit`` builds it (:class:`~medfed.assembly.RunAssembly`,
:func:`~medfed.assembly.make_fabric`). In a federated column every site
trains one local epoch at batch 16 per FedAvg round; its time is the
training time the executor reports for the round's phase
(``timing["train_s"]``: all the sites' training plans, one after another or
stacked; not the messages, the sites' receive and reply, the server step or
the evaluation), its samples those the sites report having trained
(:mod:`medfed.federated.compute`). The central column's time is its epochs'
training loop (:meth:`Site.train`), its samples the pooled set's. The first
``--warmup`` rounds (epochs) are not measured (allocation, compilation);
then ``--rounds`` are, and more until their training took ``--min-seconds``.
With ``--repeats k`` a row's columns are measured k times in turn and each
keeps its fastest (on a shared machine the others' load only slows one down).

The data are GENERATED (seeded Gaussian noise, labels at random): they
cost what real data of the same shapes cost, and nothing here measures
learning. ``clinical`` is the clinical task's model (logistic regression on
30 features, the breast-cancer table's width), ``unet`` the BraTS task's
default U-Net on 4 x P x P patches (``--patch``, 32 by default on a CPU).

Run from the repository root (nice'd on a shared machine):

    PYTHONPATH=$PWD nice python benchmarks/throughput.py [--quick] [--sites 5 20 50] [--models clinical unet] [--patch 32]
        [--samples-per-site 64] [--rounds 2] [--warmup 1] [--min-seconds 1] [--repeats 1] [--precision 32] [--compile] [--threads 1]

``--quick``: a CI-sized run (2 and 3 sites, a small U-Net on 16 x 16 patches, one measured round).
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from medfed.assembly import RunAssembly, make_fabric
from medfed.config import TrainerConfig
from medfed.data.federation import Federation, SiteData
from medfed.federated.compute import TRAIN
from medfed.federated.sites import InProcessSites, executor_for
from medfed.federated.loop import FederatedLoop
from medfed.federated.strategies import strategy_from_config
from medfed.models.base import FederatedModule
from medfed.models.segmentation import UNetSegmenter
from medfed.models.tabular import LogisticRegression
from medfed.options.models import LogisticRegressionOptions, UNetOptions

MODELS = ("clinical", "unet")
CLINICAL_FEATURES = 30
UNET_CHANNELS = 4
BATCH = 16
"""The sites' batch size; the centralised reference's is BATCH x N."""
EXECUTORS = ("sequential", "batched")


def executors_here() -> tuple[str, ...]:
    """The executors this medfed's simulator has (``batched`` where ``InProcessSites`` takes an ``executor``)."""
    return EXECUTORS if "executor" in inspect.signature(InProcessSites).parameters else ("sequential",)


@dataclass(frozen=True)
class Setting:
    """What one row measures, besides N.

    Attributes:
        model: ``clinical`` or ``unet``.
        device: ``cpu`` or ``cuda``.
        samples_per_site: training samples of every site.
        patch: P, the U-Net's patch side.
        unet_channels: the U-Net's channels per level (None: the BraTS default).
        precision, compile: ``trainer.precision``, ``trainer.compile``.
        rounds, warmup: measured and unmeasured rounds (epochs, for the central column).
        min_seconds: more rounds are measured until their training took this long (short ones are noisy).
    """

    model: str
    device: str
    samples_per_site: int
    patch: int
    unet_channels: tuple[int, ...] | None
    precision: str
    compile: bool
    rounds: int
    warmup: int
    min_seconds: float = 1.0

    def trainer(self) -> TrainerConfig:
        return TrainerConfig(device=self.device, precision=self.precision, compile=self.compile, batch_size=BATCH)

    def prototype(self) -> FederatedModule:
        """The model every site copies, seeded."""
        with torch.random.fork_rng():
            torch.manual_seed(0)
            if self.model == "clinical":
                return LogisticRegression(CLINICAL_FEATURES, 2, LogisticRegressionOptions())
            options = UNetOptions() if self.unet_channels is None else UNetOptions(channels=list(self.unet_channels), strides=[2] * (len(self.unet_channels) - 1))
            return UNetSegmenter(UNET_CHANNELS, 2, options)

    def samples(self, n: int, generator: torch.Generator) -> TensorDataset:
        """``n`` GENERATED samples: clinical ``(n, 30)`` features and 0/1 labels; unet ``(n, 4, P, P)`` patches and 0/1 masks."""
        if self.model == "clinical":
            x = torch.rand(n, CLINICAL_FEATURES, generator=generator) * 2 - 1
            return TensorDataset(x, torch.randint(0, 2, (n,), generator=generator))
        x = torch.randn(n, UNET_CHANNELS, self.patch, self.patch, generator=generator)
        return TensorDataset(x, torch.randint(0, 2, (n, self.patch, self.patch), generator=generator))

    def federation(self, n_sites: int) -> Federation:
        """``n_sites`` sites of ``samples_per_site`` GENERATED training samples (and a few test samples) each."""
        generator = torch.Generator().manual_seed(n_sites)
        sites = [SiteData(f"site{i}", self.samples(self.samples_per_site, generator), self.samples(4, generator)) for i in range(n_sites)]
        shape = (CLINICAL_FEATURES,) if self.model == "clinical" else (UNET_CHANNELS, self.patch, self.patch)
        return Federation(self.model, sites, shape, 2, "GENERATED noise (benchmarks/throughput.py)", generated=True)


@dataclass(frozen=True)
class Measurement:
    """Samples trained over the measured seconds."""

    samples: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


def _synchronised(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trained_samples(executor: InProcessSites, results: dict) -> int:
    """The training samples the sites of one phase report (``SiteResult.compute``: epochs of their training split)."""
    total = 0.0
    for index, result in results.items():
        if result.error is not None:
            raise RuntimeError(f"{executor.names[index]} failed: {result.error}")
        total += sum(epochs for key, epochs in result.compute.items() if key.split("/", 1)[0] == TRAIN) * executor.sites[index].n_train
    return round(total)


def federated(setting: Setting, n_sites: int, executor: str) -> Measurement:
    """FedAvg rounds of ``n_sites`` sites under ``executor``: the sites' samples over the wall time of their part."""
    federation = setting.federation(n_sites)
    prototype = setting.prototype()
    strategy_cls, options = strategy_from_config({"name": "fedavg"})
    strategy = strategy_cls(options, prototype.parameter_split, n_sites, 0)
    assembly = RunAssembly(prototype, strategy, {"name": "dense"}, {"name": "dense"}, BATCH, 0, compile=setting.compile)
    fabric = make_fabric(setting.trainer(), loggers=[], callbacks=[])
    sites = assembly.sites(fabric, federation)
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in sites]
    sites_part = InProcessSites(sites, links, executor_for(executor, fabric.device, dp_sgd=False))
    measured: list[Measurement] = []
    work = sites_part.work

    def timed_work(phase, messages, timing):
        _synchronised(fabric.device)
        before = timing.get("train_s", 0.0)
        results = work(phase, messages, timing)
        measured.append(Measurement(trained_samples(sites_part, results), timing["train_s"] - before))
        return results

    sites_part.work = timed_work
    loop = FederatedLoop(fabric, strategy, sites_part, initial, 1, 1.0, 0)
    loop.fit(setting.warmup + setting.rounds)
    while sum(m.seconds for m in measured[setting.warmup :]) < setting.min_seconds:
        loop.fit(loop.round + 1)
    for plan, reason in sites_part.record().get("sequential_plans", {}).items():  # the batched executor's fallbacks
        print(f"  note: under {executor}, plan {plan} trained one site at a time: {reason}")
    kept = measured[setting.warmup :]
    return Measurement(sum(m.samples for m in kept), sum(m.seconds for m in kept))


def central(setting: Setting, n_sites: int) -> Measurement:
    """One model on the pooled samples of ``n_sites`` sites at batch BATCH x N: its samples over its epochs' training time."""
    federation = setting.federation(n_sites)
    pooled = TensorDataset(*(torch.cat(parts) for parts in zip(*(site.train.tensors for site in federation.sites))))
    prototype = setting.prototype()
    strategy_cls, options = strategy_from_config({"name": "local"})
    strategy = strategy_cls(options, prototype.parameter_split, 1, 0)
    assembly = RunAssembly(prototype, strategy, {"name": "dense"}, {"name": "dense"}, BATCH * n_sites, 0, compile=setting.compile)
    fabric = make_fabric(setting.trainer(), loggers=[], callbacks=[])
    site = assembly.site(fabric, 0, SiteData("pooled", pooled, federation.sites[0].test))
    slot = site.evaluated_slot

    def loss(batch):
        return site.slot(slot).module.training_step(batch, 0)

    samples, seconds, epoch = 0, 0.0, 0
    while epoch < setting.warmup + setting.rounds or seconds < setting.min_seconds:
        _synchronised(fabric.device)
        tic = time.perf_counter()
        site.train(site.steps(1.0), slot, "all", loss, compute=f"{TRAIN}/central")
        _synchronised(fabric.device)
        elapsed = time.perf_counter() - tic
        epochs = site.passes.take(site.n_train).get(f"{TRAIN}/central", 0.0)
        if epoch >= setting.warmup:
            samples += round(epochs * site.n_train)
            seconds += elapsed
        epoch += 1
    return Measurement(samples, seconds)


@dataclass
class Row:
    setting: Setting
    n_sites: int
    columns: dict[str, Measurement | None]

    def ratio(self, numerator: str, denominator: str) -> float | None:
        top, bottom = self.columns.get(numerator), self.columns.get(denominator)
        return None if top is None or bottom is None else top.rate / bottom.rate


def measure(setting: Setting, n_sites: int, executors: tuple[str, ...], repeats: int = 1, say: Callable[[str], None] = print) -> Row:
    """One row: every executor here and the central reference, one after another in this process, ``repeats`` times
    in turn; each column keeps its fastest measurement (on a shared machine the others' load only slows a column down)."""
    columns: dict[str, Measurement | None] = {name: None for name in (*EXECUTORS, "central")}
    for _ in range(repeats):
        for name in (*executors, "central"):
            measured = central(setting, n_sites) if name == "central" else federated(setting, n_sites, name)
            say(f"  {setting.device} {setting.model} N={n_sites} {name}: {measured.rate:,.0f} samples/s")
            if columns[name] is None or measured.rate > columns[name].rate:
                columns[name] = measured
    return Row(setting, n_sites, columns)


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: samples/s per column and the ratios measured side by side."""
    lines = [
        "| device | model | N | sequential | batched | central | batched / sequential | sequential / central | batched / central |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        rates = [_number(None if row.columns[name] is None else row.columns[name].rate) for name in (*EXECUTORS, "central")]
        ratios = [_number(row.ratio(a, b), 2) for a, b in (("batched", "sequential"), ("sequential", "central"), ("batched", "central"))]
        lines.append(f"| {row.setting.device} | {row.setting.model} | {row.n_sites} | {' | '.join(rates)} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def machine() -> str:
    """The machine and its load, in one line."""
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    line = f"{platform.machine()} CPU, {os.cpu_count()} cores, load average {load}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    if torch.cuda.is_available():
        line += f"; {torch.cuda.get_device_name()}"
    return line


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: 2 and 3 sites, a small U-Net on 16 x 16 patches, one round")
    parser.add_argument("--sites", type=int, nargs="+", default=[5, 20, 50])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None, help="default: cpu, and cuda where present")
    parser.add_argument("--patch", type=int, default=None, help="U-Net patch side (default 32 on the CPU, 64 on CUDA)")
    parser.add_argument("--samples-per-site", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="measure more rounds until their training took this long")
    parser.add_argument("--repeats", type=int, default=1, help="measure the row's columns this many times in turn, keep each one's fastest")
    parser.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    args = parser.parse_args(argv)
    if args.quick:
        args.sites, args.samples_per_site, args.rounds, args.warmup, args.min_seconds = [2, 3], 20, 1, 1, 0.0
    torch.set_num_threads(args.threads)
    devices = args.devices or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    executors = executors_here()
    print(f"# {machine()}")
    if "batched" not in executors:
        print("# this medfed has no trainer.executor=batched: its column is '-'")
    rows = []
    for device in devices:
        for model in args.models:
            patch = args.patch or (16 if args.quick else 32 if device == "cpu" else 64)
            setting = Setting(
                model, device, args.samples_per_site, patch, (4, 8, 16) if args.quick else None,
                args.precision, args.compile, args.rounds, args.warmup, args.min_seconds,
            )
            for n_sites in args.sites:
                rows.append(measure(setting, n_sites, executors, args.repeats))
    print(f"\nsamples/s of training over all sites; batch {BATCH} per site, {BATCH} x N central; precision {args.precision}, "
          f"compile {args.compile}; U-Net patches {', '.join(sorted({f'{r.setting.patch}x{r.setting.patch} ({r.setting.device})' for r in rows if r.setting.model == 'unet'})) or '-'}; "
          f"{args.samples_per_site} samples per site, >= {args.rounds} measured round(s) (>= {args.min_seconds} s) after {args.warmup}; "
          f"the fastest of {args.repeats} measurement(s) in turn per column; one seed")
    print(table(rows))
    print(f"# {machine()}")
    return rows


if __name__ == "__main__":
    main()
