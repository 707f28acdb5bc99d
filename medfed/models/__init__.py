"""Per-site models (LightningModules with a personalisation split), registered by config name."""

from __future__ import annotations

from medfed.errors import ConfigError
from medfed.models.base import FederatedModule
from medfed.models.classification import NoduleClassifier
from medfed.models.segmentation import UNetSegmenter
from medfed.models.tabular import LogisticRegression

MODELS: dict[str, type[FederatedModule]] = {"unet": UNetSegmenter, "densenet": NoduleClassifier, "logreg": LogisticRegression}


def model_class(name: str) -> type[FederatedModule]:
    """The model registered as ``name`` (config key ``model.name``)."""
    if name not in MODELS:
        raise ConfigError(f"config key 'model.name' = {name!r}: expected one of {', '.join(sorted(MODELS))}")
    return MODELS[name]
