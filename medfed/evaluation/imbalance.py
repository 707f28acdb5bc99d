"""Warnings for a two-class model trained on strongly imbalanced labels: at the start, and when it ends predicting one class.

With ``model.class_weight: null`` every sample weighs 1 in the loss, so on
labels that are, say, 5.7% positive a model can reach 94% accuracy by never
predicting the positive class: balanced accuracy 0.5 at every site, with no
other sign of it. :func:`imbalance_warning` names the sites whose training
labels have a minority share under :data:`MINORITY_SHARE` before training;
:func:`one_class_warning` names, after training, the sites whose model
predicts the same class (p > 0.5 or not) for every test sample although both
classes are there. Both say what to change (``model.class_weight=balanced``
weighs class c by n / (2 n_c)).
"""

from __future__ import annotations

import torch

MINORITY_SHARE = 0.1
"""A minority class under this share of a site's training labels is strong imbalance."""
FIX = "model.class_weight=balanced weighs each class by n / (2 n_c) (docs/running.md)"


def imbalance_warning(train_labels: dict[str, torch.Tensor], class_weight: str | None) -> str | None:
    """The sites whose training labels (0/1) are strongly imbalanced, when the loss does not weigh the classes; else None."""
    if class_weight is not None:
        return None
    shares = {site: float(labels.float().mean()) for site, labels in train_labels.items() if len(labels)}
    skewed = {site: share for site, share in shares.items() if min(share, 1.0 - share) < MINORITY_SHARE}
    if not skewed:
        return None
    listed = ", ".join(f"{site} {share:.1%}" for site, share in skewed.items())
    return (
        f"strongly imbalanced training labels (positive share: {listed}) and model.class_weight null: every sample weighs 1, "
        f"so a model may learn to predict the majority class only; {FIX}"
    )


def one_class_warning(scores: dict[str, tuple[torch.Tensor, torch.Tensor]], class_weight: str | None, threshold: float = 0.5) -> str | None:
    """The sites whose model predicts one class for all of their test samples (which hold both classes); else None.

    Args:
        scores: ``{site: (p(positive), label)}`` of each test sample.
        class_weight: ``model.class_weight`` (the advice differs when it is already ``balanced``).
        threshold: predicted positive iff p > threshold, as the accuracy metrics count.
    """
    stuck = {}
    for site, (probability, label) in scores.items():
        predicted = probability > threshold
        if label.min() != label.max() and bool((predicted == predicted[0]).all()):
            stuck[site] = "positive" if bool(predicted[0]) else "negative"
    if not stuck:
        return None
    listed = ", ".join(f"{site} ({kind})" for site, kind in stuck.items())
    advice = FIX if class_weight is None else "the classes are weighed already: see the ROC curves for a better threshold"
    return f"the final model predicts one class for every test sample at {listed}: its balanced accuracy is 0.5 there; {advice}"
