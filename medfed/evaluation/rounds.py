"""Evaluation during a run beyond the loop's own: whole volumes, and each site's validation split.

:class:`ValidationEvaluation` is a Fabric callback (``on_round_end``): after
every round it evaluates every site's current model on the site's validation
split (``SiteData.validation``, carved from its training subjects) exactly as
the loop evaluates the test split, and puts the metrics in the round's record
as ``record["validation"][site][metric]`` (so in the history of results.json
and in checkpoints), to choose a round without looking at the test split.

:class:`VolumeEvaluation` is a Fabric callback (``on_round_end``). On the
rounds it runs, it segments every evaluation volume of every site with that
site's model (:func:`~medfed.evaluation.volume.segment_volume`), makes the
prediction one label map and scores each region the model predicts per
patient (:func:`~medfed.evaluation.volume.patient_scores`: Dice, IoU, HD95
and, where ``brats-evaluation`` runs, the official lesion-wise Dice, NSD and
HD95). Each patient's scores go to ``record["volumes"][site][case]``; the
site means (``dice_wt``, ``lesion_dice_wt``, ..., and ``_tc``, ``_et`` for
``task.regions: brats``) and their mean over sites join the round's metrics
before the loop logs it, so they reach the loggers, the history, the final
table and results.json beside the patch metrics, and its time as
``record["timing"]["volume_eval_s"]``. The loop itself knows nothing of it.

:class:`PlateauStop` (``trainer.patience``), after the validation scores
joined the round, ends the run once its validation curve has not improved
for ``patience`` rounds: it sets the loop's ``stop_reason``, and the loop
stops after that round (checkpointed and logged as every round is);
``trainer.rounds`` is then the cap.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

from medfed.data.federation import VolumeSource
from medfed.models.base import unwrap
from medfed.evaluation.volume import mean_over_patients, nan_mean, patient_scores, segment_volume, segment_volumes, tumour_labels


class ValidationEvaluation:
    """After every round, every site's model on its own validation split: ``record["validation"][site][metric]``.

    The metrics are the module's own (``test_step`` / ``test_results``,
    e.g. ``auroc`` or ``iou``), computed in eval mode without gradients over
    a loader of the site's validation samples in order, with the batch size
    of its test loader. Sites without a validation split are left out.
    """

    def __init__(self) -> None:
        self.loaders: dict[int, DataLoader] = {}  # site index -> its validation loader, made on first use

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        record["validation"] = {site.name: site.evaluate(self.loader(site)) for site in loop.sites if site.data.validation is not None}

    def loader(self, site: Any) -> DataLoader:
        if site.index not in self.loaders:
            self.loaders[site.index] = DataLoader(site.data.validation, batch_size=site.test_loader.batch_size, shuffle=False)
        return self.loaders[site.index]


class PlateauStop:
    """End the run once the validation curve has plateaued: ``patience`` rounds without a gain over ``min_delta``.

    The curve is the mean over sites of each round's validation ``metric``
    (:func:`~medfed.compare_stats.validation_curve`, higher is better): the
    validation split's scores beside the test split's (``source``
    ``"validation"``), or the round's own scores when the evaluated split is
    the validation split (``"metrics"``, ``holdout: validation``: a tuning run). Its
    *best round* is the last round that beat every earlier best by more
    than ``min_delta``; the run stops after round r when ``r − best round >=
    patience``. It reads only the history (so a resumed run stops where it
    would have), and records the stop as ``record["stopped"]`` = ``{"best_round",
    "reason"}`` in the round it ends.
    """

    def __init__(self, metric: str, patience: int, min_delta: float = 0.0, source: str = "validation") -> None:
        self.metric = metric
        self.patience = patience
        self.min_delta = min_delta
        self.source = source

    def best_round(self, curve: list[float]) -> int:
        """The 1-based position of the curve's best round (0 for an empty curve)."""
        best, at = -float("inf"), 0
        for index, value in enumerate(curve, start=1):
            if value > best + self.min_delta:
                best, at = value, index
        return at

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        from medfed.compare_stats import validation_curve

        curve = validation_curve(loop.history, self.metric, self.source)
        best = self.best_round(curve)
        if curve and len(curve) - best >= self.patience:
            reason = (
                f"validation {self.metric} plateaued: no gain over {self.min_delta:g} on round {best}'s "
                f"{curve[best - 1]:.4f} in the {len(curve) - best} rounds after it (trainer.patience={self.patience})"
            )
            record["stopped"] = {"best_round": best, "reason": reason}
            loop.stop_reason = reason


class VolumeEvaluation:
    """Evaluate every site on its whole evaluation volumes on chosen rounds.

    Args:
        volumes: the federation's :class:`~medfed.data.federation.VolumeSource`.
        patch_size: the training patch side (the sliding window), voxels.
        every: run on rounds divisible by ``every`` (0: only on the last round).
        last_round: the run's last round (``trainer.rounds``), always evaluated.
        batch_size: windows per forward pass.
        progress: show a progress bar (one step per patient) on stderr while it runs.
        lesion_wise: add the official lesion-wise scores (:mod:`medfed.evaluation.lesion_wise`).
        stacked: segment the sites' k-th volumes together (:func:`~medfed.evaluation.volume.segment_volumes`), where
            their models and volumes have one shape: the run's sites train stacked (the batched executor).
    """

    def __init__(
        self,
        volumes: VolumeSource,
        patch_size: int,
        every: int,
        last_round: int,
        batch_size: int,
        progress: bool = False,
        lesion_wise: bool = False,
        stacked: bool = False,
    ) -> None:
        self.volumes = volumes
        self.patch_size = patch_size
        self.every = every
        self.last_round = last_round
        self.batch_size = batch_size
        self.progress = progress
        self.lesion_wise = lesion_wise
        self.stacked = stacked

    def due(self, round_index: int, stopping: bool = False) -> bool:
        return stopping or round_index == self.last_round or (self.every > 0 and round_index % self.every == 0)

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        if not self.due(record["round"], getattr(loop, "stop_reason", None) is not None):  # a run's last round, also on a plateau
            return
        tic = time.perf_counter()
        n_patients = sum(self.volumes.n_volumes(site.index) for site in loop.sites)
        bar = tqdm(total=n_patients, desc=f"round {record['round']}: whole volumes", unit="patient", leave=False, disable=not self.progress)
        if self.stacked:
            per_patient = self.evaluate_stacked(list(loop.sites), bar)
        else:
            per_patient = {site.name: self.evaluate_site(site, bar) for site in loop.sites}
        bar.close()
        record["volumes"] = per_patient
        for name, patients in per_patient.items():
            record["metrics"][name].update(mean_over_patients(list(patients.values())))
        names = list(next(iter(record["metrics"].values())))
        volume = [name for name in names if name not in record["mean"]]
        record["mean"].update({name: nan_mean([record["metrics"][site][name] for site in per_patient]) for name in volume})
        record["timing"]["volume_eval_s"] = time.perf_counter() - tic  # the loop logs the record after its callbacks

    @torch.no_grad()
    def evaluate_site(self, site: Any, bar: Any = None) -> dict[str, dict[str, float]]:
        """Each of the site's evaluation patients' scores (:func:`~medfed.evaluation.volume.patient_scores`), by case id."""
        site.module.eval()
        regions = site.module.region_names
        scores = {}
        for volume in self.volumes.site_volumes(site.index):
            image = torch.from_numpy(volume.image).to(site.fabric.device)
            output = segment_volume(site.module, image, self.patch_size, self.batch_size)  # (K, X, Y, Z)
            scores[volume.case_id] = self._scores(site, volume, output, regions)
            if bar is not None:
                bar.update()
        return scores

    @torch.no_grad()
    def evaluate_stacked(self, sites: list[Any], bar: Any = None) -> dict[str, dict[str, dict[str, float]]]:
        """:meth:`evaluate_site` of every site, the k-th volumes of the sites whose models share a shape (and whose
        volumes do) segmented in one pass (:func:`~medfed.evaluation.volume.segment_volumes`); ``{site: {case: scores}}``."""
        groups: dict[Any, list[Any]] = {}
        for site in sites:
            site.module.eval()
            groups.setdefault(unwrap(site.module).shape_key(), []).append(site)
        scores: dict[str, dict[str, dict[str, float]]] = {site.name: {} for site in sites}
        for group in groups.values():
            regions = group[0].module.region_names
            for volumes in itertools.zip_longest(*(self.volumes.site_volumes(site.index) for site in group)):
                by_shape: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}
                for site, volume in zip(group, volumes):
                    if volume is not None:
                        by_shape.setdefault(volume.image.shape, []).append((site, volume))
                for members in by_shape.values():
                    images = [torch.from_numpy(volume.image).to(site.fabric.device) for site, volume in members]
                    outputs = segment_volumes([unwrap(site.module) for site, _ in members], images, self.patch_size, self.batch_size)
                    for (site, volume), output in zip(members, outputs):
                        scores[site.name][volume.case_id] = self._scores(site, volume, output, regions)
                        if bar is not None:
                            bar.update()
        return scores

    def _scores(self, site: Any, volume: Any, output: torch.Tensor, regions: Any) -> dict[str, float]:
        """One patient's scores of a site's model output ``(K, X, Y, Z)`` (:func:`~medfed.evaluation.volume.patient_scores`)."""
        masks = site.module.region_masks(output.movedim(-1, 0)).movedim(0, -1).cpu().numpy()  # (R, X, Y, Z)
        return patient_scores(tumour_labels(masks, regions), volume.label, volume.spacing_mm, regions, self.lesion_wise)
