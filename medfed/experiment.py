"""One federated run from a validated config: build everything, train, report.

``run(cfg)`` is what ``python -m medfed fit`` calls: it builds the
federation of the chosen task, one model per site (all initialised from the
same seeded prototype), the strategy, the links and the loop; trains for
``trainer.rounds`` rounds with a progress bar, checkpointing after each
(:mod:`medfed.checkpoint`); and writes ``<output_dir>/results.json``
(per-site metrics and their mean, the resolved config, the seed and torch
thread count, the splits, the sites' failures and exclusions, bytes on the
wire, timings; with a validation split beside the test split, every round's
validation metrics, :class:`~medfed.evaluation.rounds.ValidationEvaluation`)
next to the CSV and W&B logs. The output folder is held by this run alone
while it runs; it and, with ``--resume``, the checkpoint are checked before
any data is read (:mod:`medfed.output_dir`).
"""

from __future__ import annotations

import copy
import platform
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from omegaconf import DictConfig
from tqdm.auto import tqdm

import medfed
from medfed.checkpoint import FOLDER, resume_state, round_checkpoints
from medfed.components import ResolvedRun, resolve
from medfed.config import RunConfig, check_wandb_key
from medfed.errors import RunFailed, SiteFailure, warn
from medfed.evaluation.rounds import ValidationEvaluation, VolumeEvaluation
from medfed.federated.compute import compute_summary
from medfed.federated.link import Link
from medfed.federated.loop import FederatedLoop
from medfed.federated.privacy import PrivacyBudgetSpent, PrivacyRecord, SiteDP, dp_compatible, planned_steps, privacy_summary
from medfed.federated.site import Site, Slot
from medfed.federated.strategies.base import Strategy
from medfed.data.federation import Federation
from medfed.data.pooling import pool_training_data, pooled_reference
from medfed.models.base import FederatedModule
from medfed.models.classification import BinaryClassifier
from medfed.models.split import PARTS
from medfed.output_dir import check_output_dir, finish_run, hold_output_dir, start_run
from medfed.results import communication_totals, format_table, learned_nothing, summarise, write_json_atomic
from medfed.tracking import Tracker, classification_figures
from medfed.viz.plots import plot_learning_curves, plot_segmentation_examples, save_figure


def run(
    cfg: DictConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True, config_name: str | None = None
) -> dict[str, Any]:
    """Train and evaluate one configured run; returns the results written to results.json.

    ``config_name`` (the config file's name) names the W&B group (:class:`~medfed.tracking.Tracker`).
    """
    started = time.perf_counter()
    resolved = resolve(cfg)  # every config key checked before any file is read or written
    output_dir = Path(resolved.run.output_dir)
    check_wandb_key(resolved.run.logger.wandb)
    with hold_output_dir(output_dir):  # one run at a time writes a run folder
        return _run(resolved, output_dir, started, resume=resume, overwrite=overwrite, progress=progress, config_name=config_name)


def _run(
    resolved: ResolvedRun, output_dir: Path, started: float, *, resume: bool, overwrite: bool, progress: bool, config_name: str | None
) -> dict[str, Any]:
    """:func:`run` once this process holds ``output_dir``."""
    config, run_cfg = resolved.config, resolved.run
    trainer = run_cfg.trainer
    check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    resumed = resume_state(output_dir, config) if resume else None  # checked before any data is read
    if trainer.num_threads is not None:
        torch.set_num_threads(trainer.num_threads)

    federation = resolved.task.build_federation(
        resolved.data_options, run_cfg.federation, trainer.seed, progress=progress, **resolved.task_inputs
    )
    with torch.random.fork_rng():
        torch.manual_seed(trainer.seed)
        prototype = resolved.model_cls(federation.input_shape[0], federation.num_classes, resolved.model_options)
    dp = run_cfg.privacy.dp
    dp_fixes: list[str] = []
    if dp.enabled:  # layers DP-SGD cannot train replaced before any site copies the prototype
        prototype, dp_fixes = dp_compatible(prototype)
        for fix in dp_fixes:
            warn(f"privacy.dp: {fix}")
    strategy = resolved.strategy_cls(resolved.strategy_options, prototype.parameter_split, len(federation.sites), trainer.seed)
    if strategy.pools_data and run_cfg.federation.participation < 1:
        warn(f"strategy {strategy.name!r} pools the training data at one site: it trains only in the rounds that site takes part in")

    tracker = Tracker(run_cfg, config, federation, strategy.name, resume=resume, config_name=config_name)
    validation = [ValidationEvaluation()] if any(site.validation is not None for site in federation.sites) else []
    privacy = [PrivacyRecord(dp.on_budget)] if dp.enabled else []
    callbacks = [*_volume_evaluation(federation, run_cfg), *validation, *privacy, tracker]  # scores join the round before the tracker logs
    fabric = Fabric(accelerator=trainer.device, devices=1, loggers=tracker.loggers, callbacks=callbacks)
    sites = build_sites(fabric, federation, prototype, strategy, trainer.batch_size, trainer.seed)
    if dp.enabled:
        for site in sites:
            planned = planned_steps(site, strategy.phases, trainer.rounds, trainer.local_epochs)
            site.use_dp(SiteDP(dp, site.name, site.n_train, trainer.batch_size, planned, trainer.seed, site.index))
    initial = strategy.initial_values(initial_vectors(prototype, fabric.device))
    links = [
        Link(run_cfg.codec.spec("up"), run_cfg.codec.spec("down"), strategy.coded_keys, initial, fabric.device, peer=site.name)
        for site in sites
    ]
    loop = FederatedLoop(
        fabric,
        sites,
        strategy,
        links,
        initial,
        local_epochs=trainer.local_epochs,
        participation=run_cfg.federation.participation,
        seed=trainer.seed,
        save_checkpoint=round_checkpoints(output_dir, config, trainer.keep_checkpoints),
        on_site_failure=run_cfg.federation.on_site_failure,
        update_norm_limit=run_cfg.federation.update_norm_limit,
        max_consecutive_failures=run_cfg.federation.max_consecutive_failures,
        scratch_dir=output_dir / FOLDER,
    )
    if resumed is not None:
        loop.load_state_dict(resumed)
        del resumed  # the sites hold copies now: free the checkpoint's tensors
    else:
        start_run(output_dir, overwrite)
        write_json_atomic(output_dir / "config.json", config)
    tracker.start(loop.history)

    def results_so_far() -> dict[str, Any]:
        return {
            "medfed_version": medfed.__version__,
            "strategy": strategy.name,
            "seed": trainer.seed,
            "num_threads": torch.get_num_threads(),
            "federation": federation.summary(),
            **({"pooled": pooled_reference(federation.sites)} if strategy.pools_data else {}),
            **summarise(loop.history, {site.name: site.n_test for site in sites}, federation.holdout),
            "failures": [failure for record in loop.history for failure in record["failures"]],
            "excluded": loop.excluded,
            "communication": communication_totals(links),
            "compute": compute_summary(loop.history, loop.site_names),
            **({"privacy": {**privacy_summary(loop.history), "model_changes": dp_fixes}} if dp.enabled else {}),
            "timing": _timing(loop.history, time.perf_counter() - started, fabric),
            "config": config,
            "history": loop.history,
        }

    bar = tqdm(total=trainer.rounds, initial=loop.round, desc=f"{strategy.name} rounds", unit="round", disable=not progress)
    try:
        loop.fit(trainer.rounds, progress=lambda record: (bar.set_postfix(record["mean"]), bar.update()))
    except BaseException as error:  # Ctrl-C included: the W&B run ends marked as failed, resumable
        tracker.finish(step=loop.round, exit_code=1)
        if isinstance(error, PrivacyBudgetSpent):  # the rounds so far are the run's results
            write_json_atomic(output_dir / "results.json", results_so_far())
            raise RunFailed(f"{error}; the {len(loop.history)} rounds' results are in {output_dir / 'results.json'}") from None
        if isinstance(error, SiteFailure) and loop.history and len(loop.excluded) == len(sites):
            write_json_atomic(output_dir / "results.json", results_so_far())  # what the rounds before the exclusions gave
            raise RunFailed(f"{error}; the {len(loop.history)} rounds' results are in {output_dir / 'results.json'}") from None
        raise
    bar.close()

    results = results_so_far()
    failed = learned_nothing(loop.history)
    if failed is not None:
        results["outcome"] = f"failed: {failed}"
    write_json_atomic(output_dir / "results.json", results)
    title = f"{strategy.name} on {federation.task}, seed {trainer.seed}; data: {federation.description}"
    if strategy.pools_data:
        title += "; POOLED training data (centralised reference)"
    if federation.holdout != "test":
        title += f"; metrics on the {federation.holdout} split"
    figures = {"learning_curves": plot_learning_curves(loop.history, title), **strategy.server.figures()}
    examples = plot_segmentation_examples(sites, title, channel_names=tracker.channel_names)
    if examples is not None:
        figures["examples"] = examples
    if isinstance(prototype, BinaryClassifier):  # ROC curves and confusion matrices, not one number
        figures.update(classification_figures(sites, title, tracker.class_labels))
    for name, figure in figures.items():
        save_figure(figure, output_dir / f"{name}.png")
    tracker.finish([output_dir / f"{name}.png" for name in figures], step=loop.round, exit_code=0 if failed is None else 1)
    if failed is not None:  # an --overwrite keeps the run it replaced
        raise RunFailed(
            f"{failed}: nothing was learned, the metrics in {output_dir / 'results.json'} are those of the initial models; "
            "fix the cause and start the run again with --overwrite"
        )
    if resume or overwrite:
        finish_run(output_dir)
    if progress:
        print(format_table(results))
    return results


def build_sites(
    fabric: Fabric, federation: Federation, prototype: FederatedModule, strategy: Strategy, batch_size: int, seed: int
) -> list[Site]:
    """One site per member of ``federation``: a copy of ``prototype`` with its optimiser per model slot, and its strategy half.

    For a strategy that ``pools_data`` (the pooled reference) the pool site's
    training split is the union of every site's (:mod:`medfed.data.pooling`).
    """
    sites = []
    for index, site_data in enumerate(pool_training_data(federation.sites) if strategy.pools_data else federation.sites):
        slots = {}
        for name in strategy.slots:
            module = copy.deepcopy(prototype)
            strategy.prepare_slot(name, module)
            slots[name] = Slot(*fabric.setup(module, module.configure_optimizers()))
        sites.append(Site(index, site_data, slots, strategy.evaluated_slot, strategy.site_half(index), fabric, batch_size, seed))
    return sites


def initial_vectors(prototype: FederatedModule, device: torch.device) -> dict[str, torch.Tensor]:
    """The initial model as ``{"shared", "personal", "all"}`` vectors (every site starts from it)."""
    return {part: prototype.get_vector(part).to(device) for part in PARTS}


def _volume_evaluation(federation: Federation, run_cfg: RunConfig) -> list[VolumeEvaluation]:
    """The whole-volume evaluation callback, where the task has volumes and ``evaluation.volume_every`` is not null."""
    every = run_cfg.evaluation.volume_every
    if federation.volumes is None or every is None:
        return []
    patch_size = federation.input_shape[-1]
    return [VolumeEvaluation(federation.volumes, patch_size, every, run_cfg.trainer.rounds, run_cfg.evaluation.volume_batch_size)]


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
