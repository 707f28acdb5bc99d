"""One federated run from a validated config: build everything, train, report.

``run(cfg)`` is what ``python -m medfed fit`` calls: it builds the
federation of the chosen task, one model per site (all initialised from the
same seeded prototype), the strategy, the links and the loop; trains for
``trainer.rounds`` rounds with a progress bar, checkpointing atomically after
each; and writes ``<output_dir>/results.json`` (per-site metrics and their
mean, the resolved config, the seed and torch thread count, the splits, the
sites' failures and exclusions, bytes on the wire, timings) next to the CSV
and W&B logs.
"""

from __future__ import annotations

import copy
import platform
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from omegaconf import DictConfig
from tqdm.auto import tqdm

import medfed
from medfed.checkpoint import CHECKPOINT_NAME, config_differences, load_checkpoint, save_atomic
from medfed.components import resolve
from medfed.config import RunConfig
from medfed.errors import ConfigError
from medfed.federated.link import Link
from medfed.federated.loop import FederatedLoop
from medfed.federated.site import Site
from medfed.data.federation import Federation
from medfed.models.base import FederatedModule
from medfed.models.split import PARTS
from medfed.results import communication_totals, format_table, summarise, write_json_atomic
from medfed.viz.plots import plot_learning_curves, plot_segmentation_examples, save_figure


def run(cfg: DictConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train and evaluate one configured run; returns the results written to results.json."""
    started = time.perf_counter()
    resolved = resolve(cfg)  # every config key checked before any file is read or written
    config, run_cfg = resolved.config, resolved.run
    trainer = run_cfg.trainer
    output_dir = Path(run_cfg.output_dir)
    checkpoint_path = output_dir / "checkpoints" / CHECKPOINT_NAME
    _check_output_dir(output_dir, checkpoint_path, resume, overwrite)
    if trainer.num_threads is not None:
        torch.set_num_threads(trainer.num_threads)

    federation = resolved.task.build_federation(resolved.data_options, run_cfg.federation, trainer.seed, progress=progress)
    with torch.random.fork_rng():
        torch.manual_seed(trainer.seed)
        prototype = resolved.model_cls(federation.input_shape[0], federation.num_classes, resolved.model_options)
    strategy = resolved.strategy_cls(resolved.strategy_options, prototype.parameter_split, len(federation.sites), trainer.seed)

    fabric = Fabric(accelerator=trainer.device, devices=1, loggers=_loggers(run_cfg, output_dir), callbacks=[strategy])
    sites = build_sites(fabric, federation, prototype, trainer.batch_size, trainer.seed)
    initial = initial_vectors(prototype, fabric.device)
    links = [Link(run_cfg.codec.spec("up"), run_cfg.codec.spec("down"), strategy.coded_keys, initial, fabric.device) for _ in sites]
    loop = FederatedLoop(
        fabric,
        sites,
        strategy,
        links,
        initial,
        local_epochs=trainer.local_epochs,
        participation=run_cfg.federation.participation,
        seed=trainer.seed,
        save_checkpoint=lambda state: save_atomic(fabric, checkpoint_path, {**state, "config": config}),
        on_site_failure=run_cfg.federation.on_site_failure,
        update_norm_limit=run_cfg.federation.update_norm_limit,
        max_consecutive_failures=run_cfg.federation.max_consecutive_failures,
        scratch_dir=checkpoint_path.parent,
    )
    if resume:
        state = load_checkpoint(fabric, checkpoint_path)
        changed = config_differences(state["config"], config)
        if changed:
            raise ConfigError(f"--resume: the config differs from the checkpoint's at {', '.join(changed)}")
        loop.load_state_dict(state)
    else:
        write_json_atomic(output_dir / "config.json", config)
        for logger in fabric.loggers:
            if not isinstance(logger, CSVLogger):  # the CSV logger has no hyper-parameters: config.json holds them
                logger.log_hyperparams(config)

    bar = tqdm(total=trainer.rounds, initial=loop.round, desc=f"{strategy.name} rounds", unit="round", disable=not progress)
    loop.fit(trainer.rounds, progress=lambda record: (bar.set_postfix(record["mean"]), bar.update()))
    bar.close()
    for logger in fabric.loggers:
        logger.finalize("success")

    results = {
        "medfed_version": medfed.__version__,
        "strategy": strategy.name,
        "seed": trainer.seed,
        "num_threads": torch.get_num_threads(),
        "federation": federation.summary(),
        **summarise(loop.history, {site.name: site.n_test for site in sites}, federation.holdout),
        "failures": [failure for record in loop.history for failure in record["failures"]],
        "excluded": loop.excluded,
        "communication": communication_totals(links),
        "timing": _timing(loop.history, time.perf_counter() - started, fabric),
        "config": config,
        "history": loop.history,
    }
    write_json_atomic(output_dir / "results.json", results)
    title = f"{strategy.name} on {federation.task}, seed {trainer.seed}; data: {federation.description}"
    if federation.holdout != "test":
        title += f"; metrics on the {federation.holdout} split"
    save_figure(plot_learning_curves(loop.history, title), output_dir / "learning_curves.png")
    examples = plot_segmentation_examples(sites, title)
    if examples is not None:
        save_figure(examples, output_dir / "examples.png")
    for name, figure in strategy.server_figures().items():
        save_figure(figure, output_dir / f"{name}.png")
    if progress:
        print(format_table(results))
    return results


def build_sites(fabric: Fabric, federation: Federation, prototype: FederatedModule, batch_size: int, seed: int) -> list[Site]:
    """One site per member of ``federation``, each with its own copy of ``prototype`` and its optimiser."""
    sites = []
    for index, site_data in enumerate(federation.sites):
        module = copy.deepcopy(prototype)
        module, optimizer = fabric.setup(module, module.configure_optimizers())
        sites.append(Site(index, site_data, module, optimizer, fabric, batch_size, seed))
    return sites


def initial_vectors(prototype: FederatedModule, device: torch.device) -> dict[str, torch.Tensor]:
    """The initial model as ``{"shared", "personal", "all"}`` vectors (every site starts from it)."""
    return {part: prototype.get_vector(part).to(device) for part in PARTS}


def _check_output_dir(output_dir: Path, checkpoint_path: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an earlier run unless asked to resume it or to overwrite it."""
    earlier = [p for p in (output_dir / "results.json", checkpoint_path) if p.exists()]
    if earlier and not (resume or overwrite):
        raise ConfigError(
            f"config key 'output_dir' = {str(output_dir)!r} already holds a run ({earlier[0].name}); "
            "pass --resume to continue it, --overwrite to replace it, or choose another output_dir"
        )


def _loggers(run_cfg: RunConfig, output_dir: Path) -> list:
    """CSV always; W&B offline by default (no network needed), online or disabled on request."""
    loggers = [CSVLogger(root_dir=output_dir, name="csv")]
    if run_cfg.logger.wandb != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(
            WandbLogger(
                project=run_cfg.logger.project,
                name=run_cfg.logger.run_name,
                save_dir=str(output_dir),
                offline=run_cfg.logger.wandb == "offline",
            )
        )
    return loggers


def _timing(history: list[dict[str, Any]], wall_s: float, fabric: Fabric) -> dict[str, Any]:
    round_s = sum(r["timing"]["round_s"] for r in history)
    server_s = sum(r["timing"]["server_s"] for r in history)
    codec_s = sum(r["timing"]["codec_s"] for r in history)
    return {
        "wall_s": wall_s,
        "rounds_s": round_s,
        "mean_round_s": round_s / max(len(history), 1),
        "server_step_s": server_s,
        "server_step_share": server_s / round_s if round_s else 0.0,
        "codec_s": codec_s,
        "codec_share": codec_s / round_s if round_s else 0.0,
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={torch.get_num_threads()} device={fabric.device}".strip(),
    }
