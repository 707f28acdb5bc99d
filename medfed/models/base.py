"""The common shape of medfed's per-site models.

Every task's model is a LightningModule with the :class:`PersonalizationSplit`
mixin. The federated loop drives it through four standard Lightning hooks
(``configure_optimizers``, ``training_step``, ``test_step``) plus
:meth:`FederatedModule.test_results`, which returns the metrics accumulated
over the site's *whole* test split (never the last batch only: bug 4 of the
reference code) and resets them. Each site's copy first sees its own data
once, through :meth:`FederatedModule.prepare_for_site`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import lightning as L
import torch

from medfed.config import require
from medfed.models.split import PersonalizationSplit

if TYPE_CHECKING:
    from medfed.data.federation import SiteData


@dataclass
class ModelOptions:
    """Options every model takes (the ``model`` config group); models extend it with their own.

    Attributes:
        lr: Adam learning rate of local training.
        weight_decay: Adam weight decay.
        personal_patterns: regexes over parameter names that make a parameter
            personal (``None``: the model's default split).
        shared_patterns: regexes that make a parameter shared (``None``:
            everything not personal is shared).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    personal_patterns: list[str] | None = None
    shared_patterns: list[str] | None = None

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr", self.lr, "a positive learning rate")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")


class FederatedModule(PersonalizationSplit, L.LightningModule):
    """Base class: subclasses define the network, the loss and ``test_metrics``.

    Subclasses must set ``metric_names`` (the keys :meth:`test_results`
    returns, in display order), create ``self.test_metrics`` (torchmetrics
    objects that accumulate over batches), define
    ``compute_test_metrics() -> dict[str, Tensor]`` from them, and call
    ``configure_split``.
    """

    metric_names: ClassVar[tuple[str, ...]] = ()
    options: ModelOptions

    def prepare_for_site(self, data: SiteData) -> None:
        """Take from the site's own data what the model needs before training (e.g. class weights); nothing here.

        Called once for each site's copy, when the site is built (and so again
        on resume). It reads only that site's ``data``, and what it sets must
        be neither a parameter nor a buffer: strategies exchange those.
        """

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam over every parameter; frozen ones get no gradient and are skipped."""
        return torch.optim.Adam(self.parameters(), lr=self.options.lr, weight_decay=self.options.weight_decay)

    def test_results(self) -> dict[str, float]:
        """Metrics over every test batch seen since the last call; resets the accumulators."""
        results = self.compute_test_metrics()
        self.test_metrics.reset()
        return {name: float(results[name]) for name in self.metric_names}
