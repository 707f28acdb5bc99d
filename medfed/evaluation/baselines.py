"""Trivial baselines on each site's evaluated split: what a learned method has to beat.

Two per task, each computed per site on the same split the run evaluates
(its test split, or its validation split with ``holdout: validation``) and
scored by the model's own metric code (:meth:`~medfed.models.base.FederatedModule.test_step`
on a copy of the prototype whose prediction is replaced by the rule's), so a
baseline's number means what a method's does:

Segmentation (a model with ``region_masks``, e.g. the BraTS U-Net)
    * ``all_foreground``: every pixel foreground (whole tumour; every region
      with ``task.regions: brats``). Its tumour IoU is the share of foreground
      pixels; its background IoU 0.
    * ``threshold``: one input channel and one threshold per site and
      region, ``pixel ∈ region ⇔ s · x_c > s · t`` (s = ±1), the (c, t, s)
      with the highest IoU of the region on the site's *training* patches
      (every pixel, accumulated as the metric accumulates; t runs over every
      distinct training value of channel c). A missing (zero-filled) channel
      has one value at a site that lacks it: its only rules are all or
      nothing.

Two-class classification (a :class:`~medfed.models.classification.BinaryClassifier`)
    * ``majority``: the class most frequent in the site's training labels,
      for every record (p(positive) 1 or 0: accuracy the share of that class,
      balanced accuracy 0.5, AUROC 0.5).
    * ``one_feature``: one feature and one threshold per site,
      ``positive ⇔ s · x_j > s · t``, the (j, t, s) of the highest training
      accuracy (t at the midpoints between distinct training values); the
      score for AUROC is ``s · x_j``.

Only the site's training split chooses a rule; the evaluated split is read
once, to score it. :func:`site_baselines` returns per baseline a description
of the rule at every site and the metrics (results.json ``baselines``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import DataLoader

BATCH = 256
"""Samples per batch when a baseline's predictions go through the model's metrics."""


def site_baselines(prototype: torch.nn.Module, sites: list[Any]) -> dict[str, dict[str, Any]]:
    """``{baseline: {"description": str, "rules": {site: str}, "metrics": {site: {metric: value}}}}`` for the task's model.

    Args:
        prototype: the run's model (not changed: a CPU copy scores the rules).
        sites: the federation's :class:`~medfed.data.federation.SiteData`.

    Returns:
        Empty for a model of no known kind (neither a segmenter nor a two-class classifier).
    """
    from medfed.models.classification import BinaryClassifier

    if hasattr(prototype, "region_masks"):
        kinds = {"all_foreground": _all_foreground_masks, "threshold": _threshold_masks}
        descriptions = {
            "all_foreground": "every pixel foreground",
            "threshold": "one input channel > or < one threshold per site and region, chosen on the site's training patches",
        }
        score = _segmentation_scores
    elif isinstance(prototype, BinaryClassifier):
        kinds = {"majority": _majority_scores, "one_feature": _one_feature_scores}
        descriptions = {
            "majority": "the site's most frequent training class for every record",
            "one_feature": "one feature > or < one threshold per site, chosen on the site's training records",
        }
        score = _classifier_scores
    else:
        return {}
    module = copy.deepcopy(prototype).cpu().eval()
    results: dict[str, dict[str, Any]] = {}
    for name, rule_of in kinds.items():
        rules, metrics = {}, {}
        for site in sites:
            x_train, y_train = (tensor.cpu() for tensor in site.train.tensors[:2])
            predict, rules[site.name] = rule_of(module, x_train, y_train)
            metrics[site.name] = score(module, predict, site.test)
        results[name] = {"description": descriptions[name], "rules": rules, "metrics": metrics}
    return results


# ---------------------------------------------------------------------------------------------- segmentation
def _region_targets(module: Any, y: torch.Tensor) -> torch.Tensor:
    """Bool ``(R, n, H, W)`` masks of the module's regions from its targets (class indices, or ``(n, R, H, W)`` masks)."""
    if getattr(module, "regions", "wt") == "wt":
        return (y == 1).unsqueeze(0)
    return y.bool().movedim(1, 0)


def _all_foreground_masks(module: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, str]:
    regions = len(getattr(module, "region_names", ("wt",)))
    return (lambda batch: torch.ones((len(batch), regions, *batch.shape[2:]), dtype=torch.bool, device=batch.device)), "all foreground"


def best_threshold(values: torch.Tensor, target: torch.Tensor) -> tuple[float, float, int]:
    """The ``(IoU, t, s)`` of the rule ``s · v > s · t`` (s = ±1) with the highest IoU against the bool ``target``.

    Every distinct value of ``values`` (flattened) is a candidate t (``v > t``: the pixels above it; ``v < t``:
    below it); of equal IoUs the first (s = +1, then the lowest t) wins. IoU = TP / (TP + FP + FN) over all pixels.
    """
    v, truth = values.reshape(-1).to(torch.float64), target.reshape(-1)
    order = torch.argsort(v)
    v, truth = v[order], truth[order].to(torch.float64)
    positives = truth.sum()
    last = torch.ones_like(v, dtype=torch.bool)
    last[:-1] = v[1:] != v[:-1]  # the last position of each distinct value: a cut between values
    best = (-1.0, float(v[-1]), 1)
    below_true = torch.cumsum(truth, 0)[last]  # targets at or below each distinct value
    below_all = torch.arange(1, len(v) + 1, dtype=torch.float64, device=v.device)[last]
    cuts = v[last]
    for sign in (1, -1):
        if sign == 1:  # predicted: strictly above the cut
            tp, predicted = positives - below_true, len(v) - below_all
        else:  # predicted: at or below the cut, as "v < t" with t just above it
            tp, predicted = below_true, below_all
        iou = tp / (positives + predicted - tp).clamp(min=1)
        index = int(torch.argmax(iou))
        if float(iou[index]) > best[0]:
            best = (float(iou[index]), float(cuts[index]), sign)
    return best


def _threshold_masks(module: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, str]:
    names = getattr(module, "region_names", ("wt",))
    rules = []
    for target in _region_targets(module, y):
        best = max(
            ((*best_threshold(x[:, channel], target), channel) for channel in range(x.shape[1])), key=lambda found: found[0]
        )
        rules.append(best)

    def predict(batch: torch.Tensor) -> torch.Tensor:
        masks = []
        for _, threshold, sign, channel in rules:
            masks.append(batch[:, channel] > threshold if sign == 1 else batch[:, channel] <= threshold)
        return torch.stack(masks, dim=1)

    text = "; ".join(
        f"{region}: channel {channel} {'>' if sign == 1 else '<='} {threshold:.4g} (training IoU {iou:.3f})"
        for region, (iou, threshold, sign, channel) in zip(names, rules)
    )
    return predict, text


def _segmentation_scores(module: Any, predict: Any, data: Any) -> dict[str, float]:
    """The module's test metrics of the bool ``(B, R, H, W)`` masks ``predict`` gives, over ``data``."""

    def outputs(batch: torch.Tensor) -> torch.Tensor:
        masks = predict(batch)
        if getattr(module, "regions", "wt") == "wt":  # two softmax logits whose argmax is the mask
            return torch.stack([(~masks[:, 0]).float(), masks[:, 0].float()], dim=1)
        return masks.float() * 2 - 1  # log-odds > 0 where the region is

    return _score(module, "forward", outputs, data)


# ---------------------------------------------------------------------------------------------- classification
def _majority_scores(module: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, str]:
    positive = int((y == 1).sum()) > int((y == 0).sum())
    return (lambda batch: torch.full((len(batch),), float(positive), dtype=torch.float64, device=batch.device)), f"class {int(positive)} for every record"


def _one_feature_scores(module: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, str]:
    x = x.reshape(len(x), -1).to(torch.float64)
    truth = (y == 1).to(torch.float64)
    best = (-1.0, 0.0, 1, 0)
    for feature in range(x.shape[1]):
        order = torch.argsort(x[:, feature])
        v, t = x[order, feature], truth[order]
        last = torch.ones_like(v, dtype=torch.bool)
        last[:-1] = v[1:] != v[:-1]
        below_positive = torch.cumsum(t, 0)[last]
        below_all = torch.arange(1, len(v) + 1, dtype=torch.float64, device=v.device)[last]
        n, positives = float(len(v)), float(t.sum())
        above = (positives - below_positive) + (below_all - below_positive)  # s = +1: positives above, negatives at or below
        cuts = torch.cat([(v[last][:-1] + v[last][1:]) / 2, v[last][-1:] + 1])  # midpoints; past the largest: all negative
        for sign, correct in ((1, above), (-1, n - above)):
            index = int(torch.argmax(correct))
            if float(correct[index]) / n > best[0]:
                best = (float(correct[index]) / n, float(cuts[index]), sign, feature)
    accuracy, threshold, sign, feature = best
    scale = float(x[:, feature].std()) or 1.0

    def predict(batch: torch.Tensor) -> torch.Tensor:
        value = batch.reshape(len(batch), -1)[:, feature].to(torch.float64)
        return torch.sigmoid(sign * (value - threshold) / scale)  # p > 1/2 exactly where s (x - t) > 0, in the order of s x for AUROC

    return predict, f"feature {feature} {'>' if sign == 1 else '<'} {threshold:.4g} (training accuracy {accuracy:.3f})"


def _classifier_scores(module: Any, predict: Any, data: Any) -> dict[str, float]:
    return _score(module, "positive_probability", predict, data)


def _score(module: Any, method: str, replacement: Any, data: Any) -> dict[str, float]:
    """The module's own metrics over ``data`` with its ``method`` replaced by ``replacement`` (on this copy only)."""
    setattr(module, method, replacement)
    try:
        module.test_metrics.reset()
        for index, batch in enumerate(DataLoader(data, batch_size=BATCH, shuffle=False)):
            module.test_step(batch, index)
        return module.test_results()
    finally:
        delattr(module, method)
