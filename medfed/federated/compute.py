"""Compute accounting: the samples each site passes through its models, per round, in epochs of its training data.

A site counts every batch where it is passed (host-side batch shapes: no
device synchronisation), under a key that says what the pass was for:

* ``train/<phase>/<plan label>``: forward and backward passes of a training
  plan, the plan's own steps and those its loss makes through
  :meth:`~medfed.federated.protocol.SiteView.step` (APFL's local model,
  pFedMe's K inner steps per mini-batch, counted K times);
* ``aux/<name>``: forward and backward passes outside any plan (PGFed's
  gradient estimate over the training split);
* ``adapt/<plan label>``: forward and backward passes of the adapt step's
  plans, the fine-tuning before evaluation (FedBABU's head);
* ``forward/<name>``: forward-only passes of an algorithm (IFCA's cluster losses);
* ``evaluation``: the round's evaluation of the site's model on its evaluated split.

A round record's ``compute`` is ``{site: {key: epochs}}``, epochs = samples /
the site's training-set size; a phase that failed is not counted, nor is a
strategy half's ``setup`` (before round 1). :func:`compute_summary` adds
them up for ``results.json``.

**The budget.** ``trainer.local_epochs`` bounds the ``train/*`` passes, the
:func:`training_epochs` (see :mod:`medfed.federated.protocol` for why
``aux/*``, ``adapt/*`` and ``forward/*`` passes are not charged to it); the
others are reported beside it (:func:`auxiliary_epochs`), so that a table can
show the whole cost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

TRAIN, AUX, ADAPT, FORWARD, EVALUATION = "train", "aux", "adapt", "forward", "evaluation"
#: forward-and-backward passes outside the training plans: reported, not charged to the budget
AUXILIARY_KINDS = (AUX, ADAPT)


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (a shape: no device synchronisation)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return batch_samples(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return batch_samples(batch[0])
    raise TypeError(f"cannot count the samples of a batch of type {type(batch).__name__}")


class PassCounter:
    """Samples passed per key since the last :meth:`take` (one per site)."""

    def __init__(self) -> None:
        self.samples: Counter[str] = Counter()

    def add(self, key: str, samples: int) -> None:
        self.samples[key] += samples

    def take(self, n_train: int) -> dict[str, float]:
        """``{key: samples / n_train}`` since the last call, and start again from zero."""
        taken, self.samples = self.samples, Counter()
        return {key: samples / n_train for key, samples in sorted(taken.items())}


def merge(into: dict[str, float], more: dict[str, float]) -> None:
    """Add ``more``'s epochs to ``into``'s, key by key."""
    for key, epochs in more.items():
        into[key] = into.get(key, 0.0) + epochs


def training_epochs(counts: dict[str, float]) -> float:
    """The training plans' epochs of ``counts`` (``train/*``): what ``trainer.local_epochs`` budgets."""
    return sum(epochs for key, epochs in counts.items() if key.split("/", 1)[0] == TRAIN)


def auxiliary_epochs(counts: dict[str, float]) -> float:
    """The other forward-and-backward epochs of ``counts`` (``aux/*``, ``adapt/*``): reported beside the budget."""
    return sum(epochs for key, epochs in counts.items() if key.split("/", 1)[0] in AUXILIARY_KINDS)


def forward_epochs(counts: dict[str, float]) -> float:
    """The forward-only epochs of ``counts`` (``forward/*``: IFCA's cluster choice), reported beside the budget."""
    return sum(epochs for key, epochs in counts.items() if key.split("/", 1)[0] == FORWARD)


def compute_summary(history: Iterable[dict[str, Any]], site_names: list[str]) -> dict[str, Any]:
    """The ``compute`` section of ``results.json``, from the round records' ``compute``.

    Returns:
        ``unit``; ``per_round``: ``{site: [{"round": r, key: epochs, ...}]}``
        (rounds it passed samples in); ``totals``: ``{site: {key: epochs}}``
        over the run; ``per_plan``: ``{key: mean over sites of the totals}``;
        ``training_epochs`` and ``auxiliary_epochs``: ``{site: total over the
        run}`` (:func:`training_epochs`, :func:`auxiliary_epochs`);
        ``training_rounds``: ``{site: rounds it trained in}``;
        ``mean_training_epochs_per_round``: the training epochs of a site in a
        round it trained in, mean over those (site, round) pairs: the figure
        runs of equal budget share, ``trainer.local_epochs`` when the budget
        is kept, whatever the participation (a site that skips a round, or
        gave its data to a pool, trains in none of it);
        ``mean_auxiliary_epochs_per_round``, ``mean_forward_epochs_per_round``: the
        auxiliary (:func:`auxiliary_epochs`) and forward-only (:func:`forward_epochs`)
        epochs over the same pairs.
    """
    rounds = list(history)
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in site_names}
    totals: dict[str, dict[str, float]] = {name: {} for name in site_names}
    trained_in = dict.fromkeys(site_names, 0)
    for record in rounds:
        for name, counts in record.get("compute", {}).items():
            per_round[name].append({"round": record["round"], **counts})
            merge(totals[name], counts)
            trained_in[name] += training_epochs(counts) > 0
    keys = sorted({key for counts in totals.values() for key in counts})
    training = {name: training_epochs(counts) for name, counts in totals.items()}
    auxiliary = {name: auxiliary_epochs(counts) for name, counts in totals.items()}
    forward = {name: forward_epochs(counts) for name, counts in totals.items()}
    pairs = max(sum(trained_in.values()), 1)
    return {
        "unit": "epochs of each site's training split (samples passed / training samples)",
        "per_round": per_round,
        "totals": totals,
        "per_plan": {key: sum(counts.get(key, 0.0) for counts in totals.values()) / max(len(site_names), 1) for key in keys},
        "training_epochs": training,
        "auxiliary_epochs": auxiliary,
        "training_rounds": trained_in,
        "mean_training_epochs_per_round": sum(training.values()) / pairs,
        "mean_auxiliary_epochs_per_round": sum(auxiliary.values()) / pairs,
        "mean_forward_epochs_per_round": sum(forward.values()) / pairs,
    }
