"""The common shape of medfed's per-site models.

Every task's model is a LightningModule with the :class:`PersonalizationSplit`
mixin. The federated loop drives it through four standard Lightning hooks
(``configure_optimizers``, ``training_step``, ``test_step``) plus
:meth:`FederatedModule.test_results`, which returns the metrics accumulated
over the site's *whole* test split (never the last batch only: bug 4 of the
reference code) and resets them.
"""

from __future__ import annotations

from typing import ClassVar

import lightning as L
import torch

from medfed.models.split import PersonalizationSplit


class FederatedModule(PersonalizationSplit, L.LightningModule):
    """Base class: subclasses define the network, the loss and ``test_metrics``.

    Subclasses must set ``metric_names`` (the keys :meth:`test_results`
    returns, in display order), create ``self.test_metrics`` (torchmetrics
    objects that accumulate over batches) and call ``configure_split``.
    """

    metric_names: ClassVar[tuple[str, ...]] = ()

    def test_results(self) -> dict[str, float]:
        """Metrics over every test batch seen since the last call; resets the accumulators."""
        results = self.compute_test_metrics()
        self.test_metrics.reset()
        return {name: float(results[name]) for name in self.metric_names}

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_test_metrics")
