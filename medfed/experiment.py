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

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from omegaconf import DictConfig
from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.assembly import RunAssembly, federated_loop, make_fabric
from medfed.checkpoint import FOLDER, BackgroundCheckpoints, resume_state
from medfed.components import ResolvedRun, resolve
from medfed.config import RunConfig, check_wandb_key
from medfed.errors import ConfigError, RunFailed, SiteFailure, warn
from medfed.evaluation.baselines import site_baselines
from medfed.evaluation.rounds import PlateauStop, ValidationEvaluation, VolumeEvaluation
from medfed.data.federation import Federation
from medfed.data.pooling import pooled_reference
from medfed.federated.attack import Attack
from medfed.federated.executor import planned_steps
from medfed.federated.loop import FederatedLoop
from medfed.federated.privacy import PrivacyBudgetSpent, PrivacyRecord, SiteDP, privacy_summary
from medfed.federated import fused
from medfed.federated.sites import InProcessSites, executor_for
from medfed.models.classification import BinaryClassifier
from medfed.output_dir import check_output_dir, finish_run, hold_output_dir, start_run
from medfed.results import format_table, learned_nothing, run_results, timing_summary, volume_metrics, write_json_atomic, write_results
from medfed.threads import ThreadChoice, choose_threads
from medfed.evaluation.imbalance import imbalance_warning, one_class_warning
from medfed.tracking import Tracker, classification_figures, test_scores
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
    """:func:`run` once this process holds ``output_dir``: build, train, report."""
    built = _build(resolved, output_dir, started, resume=resume, overwrite=overwrite, progress=progress, config_name=config_name)
    _train(built)
    return _report(built, resume=resume, overwrite=overwrite)


@dataclass
class _Run:
    """A run being built, trained and reported: what the three steps of :func:`_run` share."""

    resolved: ResolvedRun
    output_dir: Path
    started: float
    progress: bool
    threads: ThreadChoice
    federation: Federation
    assembly: RunAssembly
    tracker: Tracker
    fabric: Fabric
    sites: InProcessSites
    write_checkpoint: BackgroundCheckpoints
    #: the whole-volume evaluation callback, where the run has one (empty: none)
    volume_evaluation: list[VolumeEvaluation]
    #: each site's trivial predictors' test scores (:func:`~medfed.evaluation.baselines.site_baselines`)
    baselines: dict[str, Any]
    #: time of the steps outside the loop's rounds (results.json "timing")
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    loop: FederatedLoop | None = None
    bar: tqdm | None = None

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """The loop's checkpoint after a round, off the training path: the time taken here is the copy of the state
        (and a wait for the previous write); the writing is the writer thread's."""
        with _timed(self.seconds, "checkpoint_s"):
            self.write_checkpoint(state)

    def checkpoints_written(self) -> None:
        """Wait for the last checkpoint's write (its error raised); the writer's time into the timing."""
        with _timed(self.seconds, "checkpoint_s"):
            self.write_checkpoint.wait()
        self.seconds["checkpoint_write_s"] = self.write_checkpoint.write_s

    def results(self) -> dict[str, Any]:
        """results.json of the rounds run so far (:func:`~medfed.results.run_results`)."""
        loop, run_cfg = self.loop, self.resolved.run
        timing = timing_summary(loop.history, time.perf_counter() - self.started, self.fabric.device, self.seconds, self.tracker.seconds)
        results = run_results(
            loop,
            engine="simulator",
            federation=self.federation.summary(),
            timing={**timing, "num_threads_reason": self.threads.reason},
            config=self.resolved.config,
            executor=self.sites.record(),
            device=str(self.fabric.device),
            pooled=pooled_reference(self.federation.sites) if self.assembly.strategy.pools_data else None,
        )
        results["baselines"] = self.baselines
        if loop.history and "stopped" in loop.history[-1]:
            results["stopped"] = {"round": loop.history[-1]["round"], **loop.history[-1]["stopped"]}
        if self.volume_evaluation:
            results["volume_metrics"] = volume_metrics(loop.history, self.volume_evaluation[0].lesion_wise)
        if run_cfg.privacy.dp.enabled or run_cfg.privacy.client_dp.enabled:
            results["privacy"] = {**privacy_summary(loop.history), "model_changes": list(self.assembly.model_changes)}
        return results


def _build(
    resolved: ResolvedRun, output_dir: Path, started: float, *, resume: bool, overwrite: bool, progress: bool, config_name: str | None
) -> _Run:
    """Everything the rounds need, from the checked output folder to the loop (resumed from its checkpoint with ``resume``)."""
    config, run_cfg = resolved.config, resolved.run
    trainer, dp = run_cfg.trainer, run_cfg.privacy.dp
    check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    resumed = resume_state(output_dir, config) if resume else None  # checked before any data is read
    threads = choose_threads(trainer.num_threads, resumed["num_threads"] if resumed is not None else None)
    torch.set_num_threads(threads.threads)
    if progress:
        _status(f"{threads.threads} torch thread(s) ({threads.reason}); results go to {output_dir}")
    seconds: dict[str, float] = defaultdict(float)
    with _timed(seconds, "data_s"):
        federation = resolved.task.build_federation(
            resolved.data_options, run_cfg.federation, trainer.seed, progress=progress, **resolved.task_inputs
        )
    assembly = RunAssembly.from_config(resolved, federation.input_shape, federation.num_classes, len(federation.sites), dp_compatible=dp.enabled)
    strategy = assembly.strategy
    for fix in assembly.model_changes:
        warn(f"privacy.dp: {fix}")
    if isinstance(assembly.prototype, BinaryClassifier):  # a classifier on, say, 5% positives may learn to say "negative" only
        skewed = imbalance_warning({site.name: site.train.tensors[1] for site in federation.sites}, _class_weight(resolved))
        if skewed is not None:
            warn(skewed)
    with _timed(seconds, "data_s"):
        baselines = site_baselines(assembly.prototype, federation.sites)  # the trivial predictors every table shows beside the methods
    if strategy.pools_data and run_cfg.federation.participation < 1:
        warn(f"strategy {strategy.name!r} pools the training data at one site: it trains only in the rounds that site takes part in")
    metric_names = assembly.prototype.metric_names
    watched = trainer.patience_metric or metric_names[0]  # checked before anything is written
    if trainer.patience is not None and watched not in metric_names:
        raise ConfigError(f"config key 'trainer.patience_metric' = {watched!r}: expected one of the model's metrics ({', '.join(metric_names)})")
    tracker = Tracker(run_cfg, config, federation, strategy.name, resume=resume, config_name=config_name, quiet=not progress)
    validation = [ValidationEvaluation()] if any(site.validation is not None for site in federation.sites) else []
    if trainer.patience is not None:  # beside the test split its validation scores, or the evaluated validation split's own
        source = "validation" if validation else "metrics" if federation.holdout == "validation" else None
        validation += [PlateauStop(watched, trainer.patience, trainer.min_delta, source)] if source else []
    privacy = [PrivacyRecord(dp.on_budget)] if dp.enabled else []
    volume_evaluation = _volume_evaluation(federation, run_cfg, progress)
    # scores join the round before the tracker logs; a plateau is seen before the volumes are, so a run's last round gets them
    callbacks = [*validation, *volume_evaluation, *privacy, tracker]
    fabric = make_fabric(trainer, loggers=tracker.loggers, callbacks=callbacks)
    sites = assembly.sites(fabric, federation)
    if dp.enabled:
        for site in sites:
            planned = planned_steps(site, strategy.phases, trainer.rounds, trainer.local_epochs)
            site.use_dp(SiteDP(dp, site.name, site.n_train, trainer.batch_size, planned, trainer.seed, site.index))
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in sites]
    # fused with other runs (medfed.compare's fused runs: medfed.federated.fused), its rows stack with theirs
    executor = executor_for(trainer.executor, fabric.device, dp.enabled, compile=trainer.compile, fused=fused.current())
    attack = Attack(run_cfg.attack, strategy.coded_keys, trainer.seed) if run_cfg.attack.sites else None  # evaluation only
    in_process = InProcessSites(sites, links, executor, attack)
    for evaluation in volume_evaluation:  # sites that train stacked are segmented stacked too
        evaluation.stacked = executor.name == "batched"
    run = _Run(
        resolved, output_dir, started, progress, threads, federation, assembly, tracker, fabric, in_process,
        BackgroundCheckpoints(output_dir, config, trainer.keep_checkpoints), volume_evaluation, baselines, seconds,
    )
    run.loop = federated_loop(run_cfg, fabric, strategy, in_process, initial, run.save_checkpoint, output_dir / FOLDER)
    if resumed is not None:
        run.loop.load_state_dict(resumed)
        del resumed  # the sites hold copies now: free the checkpoint's tensors
        if attack is not None:
            attack.resume(strategy.server, run.loop.round)
    else:
        start_run(output_dir, overwrite)
        write_json_atomic(output_dir / "config.json", config)
    tracker.start(run.loop.history)
    return run


def _train(run: _Run) -> None:
    """The rounds, with a progress bar; a run that stops early writes the rounds it has and says where, or re-raises.

    Raises:
        RunFailed: the privacy budget was spent (``on_budget: stop_run``), or every site was excluded after some rounds.
    """
    loop, trainer, name = run.loop, run.resolved.run.trainer, run.assembly.strategy.name
    run.bar = tqdm(total=trainer.rounds, initial=loop.round, desc=f"{name} rounds", unit="round", disable=not run.progress)
    set_up = loop.setup  # round 0 (the sites' setup replies, the server's setup, the first delivery) runs inside fit: label its wait

    def labelled_setup() -> None:
        run.bar.set_description_str(f"{name}: setting up the sites and the server (round 0)")
        with _timed(run.seconds, "setup_s"):
            set_up()
        run.bar.set_description_str(f"{name} rounds (round 1)")

    loop.setup = labelled_setup
    try:
        loop.fit(trainer.rounds, progress=lambda record: (run.bar.set_postfix(record["mean"]), run.bar.update()))
        run.checkpoints_written()
    except BaseException as error:  # Ctrl-C included: the W&B run ends marked as failed, resumable
        with contextlib.suppress(Exception):  # the rounds finished so far on disk (a write's own error: the earlier ones)
            run.write_checkpoint.wait()
        run.tracker.finish(step=loop.round, exit_code=1)
        stopped = isinstance(error, PrivacyBudgetSpent) or (
            isinstance(error, SiteFailure) and loop.history and len(loop.excluded) == len(run.sites)
        )
        if stopped:  # the rounds so far are the run's results
            write_results(run.output_dir / "results.json", run.results())
            raise RunFailed(f"{error}; the {len(loop.history)} rounds' results are in {run.output_dir / 'results.json'}") from None
        raise
    run.bar.close()
    if loop.stop_reason is not None and run.progress:
        _status(f"stopped after round {loop.round} of at most {trainer.rounds}: {loop.stop_reason}")


def _report(run: _Run, *, resume: bool, overwrite: bool) -> dict[str, Any]:
    """results.json, the figures, the tracker's end and the table; raises where nothing was learned."""
    loop, output_dir, federation = run.loop, run.output_dir, run.federation
    results = run.results()
    failed = learned_nothing(loop.history)
    write_results(output_dir / "results.json", results)
    if isinstance(run.assembly.prototype, BinaryClassifier):  # every site predicting one class: said, figures or not
        stuck = one_class_warning({site.name: test_scores(site) for site in run.sites}, _class_weight(run.resolved))
        if stuck is not None:
            warn(stuck)
    figures = {}
    if run.resolved.run.logger.figures:
        if run.progress:
            _status("drawing the figures")
        with _timed(run.seconds, "figures_s"):
            figures = _figures(run)
    run.tracker.finish([output_dir / f"{name}.png" for name in figures], step=loop.round, exit_code=0 if failed is None else 1)
    results["timing"].update(timing_summary(loop.history, time.perf_counter() - run.started, run.fabric.device, run.seconds, run.tracker.seconds))
    write_results(output_dir / "results.json", results)  # again, with the figures' and the tracker's time
    if failed is not None:  # an --overwrite keeps the run it replaced
        raise RunFailed(
            f"{failed}: nothing was learned, the metrics in {output_dir / 'results.json'} are those of the initial models; "
            "fix the cause and start the run again with --overwrite"
        )
    if resume or overwrite:
        finish_run(output_dir)
    if run.progress:
        print(format_table(results))
        _status(f"results in {output_dir}: results.json, {', '.join(f'{name}.png' for name in figures)}, csv/ (per-round metrics)")
    return results


def _figures(run: _Run) -> dict[str, Any]:
    """The run's figures, drawn and saved beside results.json: ``{file stem: Figure}``."""
    strategy, federation, trainer = run.assembly.strategy, run.federation, run.resolved.run.trainer
    title = f"{strategy.name} on {federation.task}, seed {trainer.seed}; data: {federation.description}"
    if strategy.pools_data:
        title += "; POOLED training data (centralised reference)"
    if federation.holdout != "test":
        title += f"; metrics on the {federation.holdout} split"
    figures = {"learning_curves": plot_learning_curves(run.loop.history, title), **strategy.server.figures()}
    examples = plot_segmentation_examples(list(run.sites), title, channel_names=run.tracker.channel_names)
    if examples is not None:
        figures["examples"] = examples
    if isinstance(run.assembly.prototype, BinaryClassifier):  # ROC curves and confusion matrices, not one number
        figures.update(classification_figures(list(run.sites), title, run.tracker.class_labels))
    for name, figure in tqdm(figures.items(), desc="writing the figures", unit="figure", leave=False, disable=not run.progress):
        save_figure(add_source(figure, federation.description), run.output_dir / f"{name}.png")
    return figures


def _volume_evaluation(federation: Federation, run_cfg: RunConfig, progress: bool) -> list[VolumeEvaluation]:
    """The whole-volume evaluation callback, where the task has volumes and ``evaluation.volume_every`` is not null."""
    evaluation = run_cfg.evaluation
    if federation.volumes is None or evaluation.volume_every is None:
        return []
    patch_size = federation.input_shape[-1]
    return [
        VolumeEvaluation(
            federation.volumes, patch_size, evaluation.volume_every, run_cfg.trainer.rounds, evaluation.volume_batch_size, progress,
            lesion_wise=evaluation.wants_lesion_wise(),
        )
    ]


def _class_weight(resolved: ResolvedRun) -> Any:
    """``model.class_weight`` where the model has one (a classifier's), else None."""
    return getattr(resolved.model_options, "class_weight", None)


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
