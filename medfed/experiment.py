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

import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.assembly import RunAssembly, make_fabric
from medfed.checkpoint import FOLDER, resume_state, round_checkpoints
from medfed.components import ResolvedRun, resolve
from medfed.config import RunConfig, check_wandb_key
from medfed.errors import ConfigError, RunFailed, SiteFailure, warn
from medfed.evaluation.baselines import site_baselines
from medfed.evaluation.rounds import PlateauStop, ValidationEvaluation, VolumeEvaluation
from medfed.federated.executor import InProcessSites, executor_for, planned_steps
from medfed.federated.loop import FederatedLoop
from medfed.federated.privacy import ClientDP, PrivacyBudgetSpent, PrivacyRecord, SiteDP, privacy_summary
from medfed.data.federation import Federation
from medfed.data.pooling import pooled_reference
from medfed.models.classification import BinaryClassifier
from medfed.output_dir import check_output_dir, finish_run, hold_output_dir, start_run
from medfed.results import format_table, learned_nothing, run_results, timing_summary, write_json_atomic
from medfed.threads import choose_threads
from medfed.tracking import Tracker, classification_figures
from medfed.viz.plots import add_source, plot_learning_curves, plot_segmentation_examples, save_figure


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
    seconds: dict[str, float] = defaultdict(float)  # time of the steps outside the loop's rounds (results.json "timing")
    config, run_cfg = resolved.config, resolved.run
    trainer = run_cfg.trainer
    check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    resumed = resume_state(output_dir, config) if resume else None  # checked before any data is read
    threads = choose_threads(trainer.num_threads, resumed["num_threads"] if resumed is not None else None)
    torch.set_num_threads(threads.threads)
    if progress:
        _status(f"{threads.threads} torch thread(s) ({threads.reason}); results go to {output_dir}")

    with _timed(seconds, "data_s"):
        federation = resolved.task.build_federation(
            resolved.data_options, run_cfg.federation, trainer.seed, progress=progress, **resolved.task_inputs
        )
    dp = run_cfg.privacy.dp
    assembly = RunAssembly.from_config(resolved, federation.input_shape, federation.num_classes, len(federation.sites), dp_compatible=dp.enabled)
    prototype, strategy = assembly.prototype, assembly.strategy
    for fix in assembly.model_changes:
        warn(f"privacy.dp: {fix}")
    with _timed(seconds, "data_s"):
        baselines = site_baselines(prototype, federation.sites)  # the trivial predictors every table shows beside the methods
    if strategy.pools_data and run_cfg.federation.participation < 1:
        warn(f"strategy {strategy.name!r} pools the training data at one site: it trains only in the rounds that site takes part in")

    watched = trainer.patience_metric or prototype.metric_names[0]  # checked before anything is written
    if trainer.patience is not None and watched not in prototype.metric_names:
        raise ConfigError(f"config key 'trainer.patience_metric' = {watched!r}: expected one of the model's metrics ({', '.join(prototype.metric_names)})")
    tracker = Tracker(run_cfg, config, federation, strategy.name, resume=resume, config_name=config_name, quiet=not progress)
    validation = [ValidationEvaluation()] if any(site.validation is not None for site in federation.sites) else []
    if trainer.patience is not None:  # beside the test split its validation scores, or the evaluated validation split's own
        source = "validation" if validation else "metrics" if federation.holdout == "validation" else None
        validation += [PlateauStop(watched, trainer.patience, trainer.min_delta, source)] if source else []
    privacy = [PrivacyRecord(dp.on_budget)] if dp.enabled else []
    # scores join the round before the tracker logs; a plateau is seen before the volumes are, so a run's last round gets them
    callbacks = [*validation, *_volume_evaluation(federation, run_cfg, progress), *privacy, tracker]
    fabric = make_fabric(trainer, loggers=tracker.loggers, callbacks=callbacks)
    sites = assembly.sites(fabric, federation)
    if dp.enabled:
        for site in sites:
            planned = planned_steps(site, strategy.phases, trainer.rounds, trainer.local_epochs)
            site.use_dp(SiteDP(dp, site.name, site.n_train, trainer.batch_size, planned, trainer.seed, site.index))
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in sites]
    write_checkpoint = round_checkpoints(output_dir, config, trainer.keep_checkpoints)
    executor = InProcessSites(sites, links, executor_for(trainer.executor, fabric.device, dp.enabled))

    def save_checkpoint(state: dict[str, Any]) -> None:
        bar.set_description_str(f"{strategy.name} rounds (writing checkpoint)")
        with _timed(seconds, "checkpoint_s"):
            write_checkpoint(state)
        bar.set_description_str(f"{strategy.name} rounds")

    loop = FederatedLoop(
        fabric,
        sites,
        strategy,
        links,
        initial,
        local_epochs=trainer.local_epochs,
        participation=run_cfg.federation.participation,
        seed=trainer.seed,
        save_checkpoint=save_checkpoint,
        on_site_failure=run_cfg.federation.on_site_failure,
        update_norm_limit=run_cfg.federation.update_norm_limit,
        max_consecutive_failures=run_cfg.federation.max_consecutive_failures,
        scratch_dir=output_dir / FOLDER,
        executor=executor,
        client_dp=ClientDP(run_cfg.privacy.client_dp, trainer.seed) if run_cfg.privacy.client_dp.enabled else None,
    )
    if resumed is not None:
        loop.load_state_dict(resumed)
        del resumed  # the sites hold copies now: free the checkpoint's tensors
    else:
        start_run(output_dir, overwrite)
        write_json_atomic(output_dir / "config.json", config)
    tracker.start(loop.history)

    def results_so_far() -> dict[str, Any]:
        timing = timing_summary(loop.history, time.perf_counter() - started, fabric.device, seconds, tracker.seconds)
        results = run_results(
            loop,
            engine="simulator",
            federation=federation.summary(),
            timing={**timing, "num_threads_reason": threads.reason},
            config=config,
            executor=executor.record(),
            pooled=pooled_reference(federation.sites) if strategy.pools_data else None,
        )
        results["execution"] = {"device": str(fabric.device), "precision": trainer.precision, "compile": trainer.compile}
        results["baselines"] = baselines
        if loop.history and "stopped" in loop.history[-1]:
            results["stopped"] = {"round": loop.history[-1]["round"], **loop.history[-1]["stopped"]}
        if dp.enabled or run_cfg.privacy.client_dp.enabled:
            results["privacy"] = {**privacy_summary(loop.history), "model_changes": list(assembly.model_changes)}
        return results

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
    if loop.stop_reason is not None and progress:
        _status(f"stopped after round {loop.round} of at most {trainer.rounds}: {loop.stop_reason}")

    results = results_so_far()
    failed = learned_nothing(loop.history)
    write_json_atomic(output_dir / "results.json", results)
    title = f"{strategy.name} on {federation.task}, seed {trainer.seed}; data: {federation.description}"
    if strategy.pools_data:
        title += "; POOLED training data (centralised reference)"
    if federation.holdout != "test":
        title += f"; metrics on the {federation.holdout} split"
    if progress:
        _status("drawing the figures")
    with _timed(seconds, "figures_s"):
        figures = {"learning_curves": plot_learning_curves(loop.history, title), **strategy.server.figures()}
        examples = plot_segmentation_examples(sites, title, channel_names=tracker.channel_names)
        if examples is not None:
            figures["examples"] = examples
        if isinstance(prototype, BinaryClassifier):  # ROC curves and confusion matrices, not one number
            figures.update(classification_figures(sites, title, tracker.class_labels))
        for name, figure in figures.items():
            save_figure(add_source(figure, federation.description), output_dir / f"{name}.png")
    tracker.finish([output_dir / f"{name}.png" for name in figures], step=loop.round, exit_code=0 if failed is None else 1)
    results["timing"].update(timing_summary(loop.history, time.perf_counter() - started, fabric.device, seconds, tracker.seconds))
    write_json_atomic(output_dir / "results.json", results)  # again, with the figures' and the tracker's time
    if failed is not None:  # an --overwrite keeps the run it replaced
        raise RunFailed(
            f"{failed}: nothing was learned, the metrics in {output_dir / 'results.json'} are those of the initial models; "
            "fix the cause and start the run again with --overwrite"
        )
    if resume or overwrite:
        finish_run(output_dir)
    if progress:
        print(format_table(results))
        _status(f"results in {output_dir}: results.json, {', '.join(f'{name}.png' for name in figures)}, csv/ (per-round metrics)")
    return results


def _volume_evaluation(federation: Federation, run_cfg: RunConfig, progress: bool) -> list[VolumeEvaluation]:
    """The whole-volume evaluation callback, where the task has volumes and ``evaluation.volume_every`` is not null."""
    every = run_cfg.evaluation.volume_every
    if federation.volumes is None or every is None:
        return []
    patch_size = federation.input_shape[-1]
    return [
        VolumeEvaluation(federation.volumes, patch_size, every, run_cfg.trainer.rounds, run_cfg.evaluation.volume_batch_size, progress)
    ]


def _status(message: str) -> None:
    """One progress line on stderr (``medfed: ...``), beside the progress bars."""
    tqdm.write(f"medfed: {message}", file=sys.stderr)


@contextmanager
def _timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Adds the wall time of the block to ``seconds[key]``."""
    tic = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - tic
