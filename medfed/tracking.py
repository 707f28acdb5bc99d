"""What a run's loggers receive beyond the per-round scalars, and how a resumed run keeps its logs whole.

:class:`Tracker` owns the run's two loggers:

* CSV (``<output_dir>/csv/version_0/metrics.csv``), written to disk after
  every round; a resumed run rewrites it from the checkpointed rounds and
  carries on in the same file, so it holds every round once.
* W&B (offline by default): the full resolved config (every component
  default), the run grouped by task and config and tagged with task,
  strategy and seed; each site's test metrics and training loss per round
  (the loop logs them); segmentation overlays (``wandb.Image`` with the
  ground truth and prediction as masks, classes named) of a few fixed test
  patches per site every ``logger.image_every`` rounds and after the last;
  and the PNG figures of the run at the end. The run id is kept in
  ``<output_dir>/wandb_run_id`` so that ``--resume`` continues the same W&B
  run rather than starting a second one.

For the classification tasks, :func:`classification_figures` draws each
site's ROC curve and confusion matrix on its final test scores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.loggers import CSVLogger
from matplotlib.figure import Figure

from medfed.config import RunConfig
from medfed.data.federation import Federation
from medfed.federated.loop import FederatedLoop, _flatten_for_logging
from medfed.federated.site import Site
from medfed.viz.plots import displayed_channel, plot_confusion_matrices, plot_roc_curves

RUN_ID_FILE = "wandb_run_id"
"""The W&B run id, in the output directory: ``--resume`` reads it to continue the same W&B run."""

CHANNEL_NAMES = {"brats": ("FLAIR", "T1", "T1ce", "T2")}
"""Input channel names per task, in channel order (BraTS: :data:`medfed.data.brats.MODALITIES`)."""

CLASS_LABELS = {"brats": {0: "background", 1: "whole tumour"}, "luna16": {0: "not a nodule", 1: "nodule"}}
"""Target class names per task (the clinical task's come from ``data.positive``)."""
REGION_LABELS = {0: "background", 1: "whole tumour (WT)", 2: "tumour core (TC)", 3: "enhancing tumour (ET)"}
"""Overlay classes of ``task.regions: brats``: region r (WT, TC, ET) is drawn as class r + 1 in a mask of its own, so
each region has its own colour and the overlapping regions can be shown one at a time."""

EXAMPLES_PER_SITE = 4
"""Test patches per site shown as W&B segmentation overlays."""


class Tracker:
    """The run's CSV and W&B loggers; a Fabric callback that logs segmentation overlays.

    Args:
        run_cfg: the typed run config (``logger``, ``trainer``, ``output_dir``).
        config: the full resolved config (what config.json holds); W&B gets it whole.
        federation: the run's data (task, classes, provenance).
        strategy: the strategy's name (W&B tag and default run name).
        resume: continue the run in ``output_dir``: the same W&B run, the same metrics.csv.
        config_name: the config file's name, for the default W&B group.
        quiet: W&B prints nothing (``--quiet``); otherwise, offline, one line says where the W&B run is and how to sync
            it (W&B's own start lines and run summary are left out); online, W&B prints its own lines and the run's URL.

    ``seconds`` adds up the time spent logging images, starting and finishing the run.
    """

    def __init__(
        self,
        run_cfg: RunConfig,
        config: dict[str, Any],
        federation: Federation,
        strategy: str,
        *,
        resume: bool = False,
        config_name: str | None = None,
        quiet: bool = False,
    ) -> None:
        self.seconds = 0.0
        self.config = config
        self.output_dir = Path(run_cfg.output_dir)
        self.rounds = run_cfg.trainer.rounds
        self.image_every = run_cfg.logger.image_every
        self.class_labels = class_labels(config, federation.num_classes)
        self.segmentation = federation.sites[0].test.tensors[1].ndim in (3, 4)  # the targets are images: classes or region masks
        self.channel_names = CHANNEL_NAMES.get(federation.task, tuple(f"channel {c}" for c in range(federation.input_shape[0])))
        self.csv = CSVLogger(root_dir=self.output_dir, name="csv", version=0, flush_logs_every_n_steps=1)
        self.loggers: list = [self.csv]
        self.wandb = None
        self.mode, self.progress = run_cfg.logger.wandb, not quiet
        self.offline_line = run_cfg.logger.wandb == "offline" and not quiet
        if run_cfg.logger.wandb != "disabled":
            import wandb
            from lightning.pytorch.loggers import WandbLogger

            run_id_file = self.output_dir / RUN_ID_FILE
            seed = run_cfg.trainer.seed
            tags = [federation.task, strategy, f"seed={seed}", *(["generated data"] if federation.generated else [])]
            self.wandb = WandbLogger(
                project=run_cfg.logger.project,
                name=run_cfg.logger.run_name or f"{strategy} seed {seed}",
                group=run_cfg.logger.group or f"{federation.task}/{config_name or self.output_dir.name}",
                tags=[*tags, *run_cfg.logger.tags],
                save_dir=str(self.output_dir),
                offline=run_cfg.logger.wandb == "offline",
                id=run_id_file.read_text().strip() if resume and run_id_file.is_file() else None,
                # --quiet: nothing; offline (the default): quiet, no run summary (medfed's table follows, and finish() says
                # where the run is and how to sync it); online: W&B's own lines, with the run's URL.
                **({"settings": wandb.Settings(silent=True, quiet=True)} if quiet or run_cfg.logger.wandb == "offline" else {}),
            )
            # Lightning passes W&B's deprecated `anonymous` setting (as None) to wandb.init, which then warns on every
            # run about a setting medfed never sets; left out, W&B's default is the same.
            if getattr(self.wandb, "_wandb_init", {}).get("anonymous", False) is None:
                del self.wandb._wandb_init["anonymous"]
            self.loggers.append(self.wandb)

    def start(self, history: list[dict[str, Any]]) -> None:
        """Before the first round to train: the finished rounds (of a resumed run) back into metrics.csv, the config to W&B.

        Args:
            history: the rounds already trained (empty for a new run).
        """
        tic = time.perf_counter()
        metrics_csv = Path(self.csv.log_dir) / "metrics.csv"
        metrics_csv.unlink(missing_ok=True)  # (Lightning would too, warning of lost logs): the checkpoint's rounds come back
        for record in history:  # the rows exactly as the loop logged them
            self.csv.log_metrics(_flatten_for_logging(record), step=record["round"])
        if self.wandb is not None:
            from tqdm import tqdm

            bar = tqdm(total=1, desc=f"starting W&B ({self.mode})", unit="step", leave=False, disable=not self.progress, file=sys.stderr)
            self.wandb.log_hyperparams(self.config)  # a resumed run's segment gets it too (this starts W&B: seconds)
            (self.output_dir / RUN_ID_FILE).write_text(self.wandb.experiment.id + "\n")
            bar.update()
            bar.close()
        self.seconds += time.perf_counter() - tic

    def on_round_end(self, loop: FederatedLoop, record: dict[str, Any]) -> None:
        """Fabric callback: segmentation overlays to W&B after every ``image_every``-th round and after the last."""
        round_index = record["round"]
        if self.wandb is None or not self.segmentation:
            return
        if round_index == self.rounds or (self.image_every and round_index % self.image_every == 0):
            tic = time.perf_counter()
            overlays = {f"examples/{site.name}": segmentation_overlays(site, self.channel_names, self.class_labels) for site in loop.sites}
            self.wandb.log_metrics(overlays, step=round_index)
            self.seconds += time.perf_counter() - tic

    def finish(self, figures: Sequence[Path] = (), step: int | None = None, exit_code: int = 0) -> None:
        """End the run's logging: the PNG ``figures`` to W&B (as ``figures/<name>``), the W&B run closed.

        Args:
            figures: PNG files the run wrote.
            step: the last round.
            exit_code: 0 for a finished run; non-zero marks the W&B run as failed (interrupted).
        """
        tic = time.perf_counter()
        self.csv.finalize("success" if exit_code == 0 else "failed")
        if self.wandb is not None:
            import wandb

            if figures:
                self.wandb.log_metrics({f"figures/{path.stem}": wandb.Image(str(path), caption=path.name) for path in figures}, step=step)
            folder = Path(self.wandb.experiment.dir).parent  # <output_dir>/wandb/offline-run-<time>-<id>
            self.wandb.experiment.finish(exit_code=exit_code)
            if self.offline_line:
                _status(f"W&B run (offline) in {folder}; upload it with: wandb sync {folder}")
        self.seconds += time.perf_counter() - tic


def class_labels(config: dict[str, Any], num_classes: int) -> dict[int, str]:
    """Display names of the target classes (``class <k>`` for a class no table names)."""
    data = config["data"]
    if data["task"] == "clinical":
        named = {0: f"not {data['positive']}", 1: data["positive"]}
    elif config.get("task", {}).get("regions") == "brats":
        return REGION_LABELS
    else:
        named = CLASS_LABELS.get(data["task"], {})
    return {label: named.get(label, f"class {label}") for label in range(num_classes)}


def example_indices(n_samples: int, count: int = EXAMPLES_PER_SITE) -> list[int]:
    """``count`` indices spread evenly over ``n_samples`` (all of them when fewer): the same patches every round and run."""
    if n_samples <= count:
        return list(range(n_samples))
    return torch.linspace(0, n_samples - 1, count, device="cpu").round().long().tolist()


@torch.no_grad()
def segmentation_overlays(site: Site, channel_names: tuple[str, ...], labels: dict[int, str]) -> list:
    """``wandb.Image`` of each fixed test patch of ``site``: one MRI channel, ground truth and prediction as masks.

    The channel shown is the first (FLAIR for BraTS) unless it is all zero at
    the site (a missing sequence); the caption names it. Images are oriented
    as in ``examples.png`` (anterior up). With one region (the whole tumour)
    the ground truth and the prediction are one mask each; with the BraTS
    regions every region is a mask of its own (``truth WT``, ``prediction
    TC``, ...) holding class r + 1 of :data:`REGION_LABELS`, one colour per
    region, each shown or hidden on its own in W&B.
    """
    import wandb

    indices = example_indices(site.n_test)
    x, y = (tensor[indices] for tensor in site.data.test.tensors)
    site.module.eval()
    prediction = site.module.region_masks(site.module(site.fabric.to_device(x))).cpu()  # (B, R, P, P) bool
    truth = y.bool() if y.ndim == 4 else (y == 1).unsqueeze(1)
    regions = site.module.region_names
    shown = displayed_channel(x, 0)
    name = channel_names[shown] if shown == 0 else f"{channel_names[shown]} (no {channel_names[0]} at {site.name})"
    overlays = []
    for row, index in enumerate(indices):
        image = x[row, shown]
        low, high = image.min(), image.max()
        grey = ((image - low) / (high - low) * 255 if high > low else torch.zeros_like(image)).to(torch.uint8)
        if len(regions) == 1:
            masks = {
                "ground_truth": {"mask_data": _anterior_up(truth[row, 0]), "class_labels": labels},
                "prediction": {"mask_data": _anterior_up(prediction[row, 0]), "class_labels": labels},
            }
        else:
            masks = {
                f"{kind} {region.upper()}": {"mask_data": _anterior_up(mask[row, r] * (r + 1)), "class_labels": labels}
                for kind, mask in (("truth", truth), ("prediction", prediction))
                for r, region in enumerate(regions)
            }
        overlays.append(wandb.Image(_anterior_up(grey), caption=f"{site.name} test patch {index}: {name}", masks=masks))
    return overlays


def _anterior_up(image: torch.Tensor) -> np.ndarray:
    """An ``(X, Y)`` axial patch as an image array with Y up (what ``imshow(image.T, origin="lower")`` draws)."""
    return np.ascontiguousarray(np.flipud(image.numpy().astype(np.uint8).T))


@torch.no_grad()
def test_scores(site: Site) -> tuple[torch.Tensor, torch.Tensor]:
    """p(positive) (float64) and the label of every sample of ``site``'s test split, in order."""
    site.module.eval()
    scores, labels = [], []
    for x, y in site.test_loader:
        scores.append(site.module.positive_probability(site.fabric.to_device(x)).cpu())
        labels.append(y)
    return torch.cat(scores), torch.cat(labels)


def classification_figures(sites: list[Site], title: str, labels: dict[int, str]) -> dict[str, Figure]:
    """``roc_curves`` and ``confusion_matrices`` of every site's final model on its test split."""
    scores = {site.name: test_scores(site) for site in sites}
    return {
        "roc_curves": plot_roc_curves(scores, title),
        "confusion_matrices": plot_confusion_matrices(scores, title, (labels[0], labels[1])),
    }


def _status(message: str) -> None:
    """One line on stderr (``medfed: ...``), beside the progress bars."""
    from tqdm import tqdm

    tqdm.write(f"medfed: {message}", file=sys.stderr)
