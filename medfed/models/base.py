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

import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING, ClassVar

import lightning as L
import torch
from lightning.fabric.wrappers import is_wrapped
from torch import nn

from medfed.models.split import PersonalizationSplit
from medfed.options.models import ModelOptions

if TYPE_CHECKING:
    from medfed.data.federation import SiteData


class FederatedModule(PersonalizationSplit, L.LightningModule):
    """Base class: subclasses define the network, the loss and ``test_metrics``.

    Subclasses must set ``metric_names`` (the keys :meth:`test_results`
    returns, in display order), create ``self.test_metrics`` (torchmetrics
    objects that accumulate over batches), define
    :meth:`update_test_metrics` (and :meth:`test_outputs` where the metrics
    take more than ``self(x)``) and ``compute_test_metrics() -> dict[str, Tensor]``
    from them, and call ``configure_split``.
    """

    metric_names: ClassVar[tuple[str, ...]] = ()
    #: whether ``training_step`` computes its loss as a mean of per-sample terms through
    #: :func:`medfed.models.padding.sample_mean`, so that a padded batch's padded samples change nothing
    pads: ClassVar[bool] = False
    options: ModelOptions

    def prepare_for_site(self, data: SiteData) -> None:
        """Take from the site's own data what the model needs before training (e.g. class weights); nothing here.

        Called once for each site's copy, when the site is built (and so again
        on resume). It reads only that site's ``data``, and what it sets must
        be neither a parameter nor a buffer: strategies exchange those.
        """

    def log_prior(self, data: SiteData) -> torch.Tensor:
        """The site's training-label frequencies as a shift of ``forward``'s output: the Balanced Softmax's log n_c.

        The Balanced Softmax loss (Ren et al., NeurIPS 2020; FedRoD's generic
        loss) is the model's usual loss of the shifted output
        ``forward(x) + shift``. Default: ``forward`` gives softmax logits
        ``(B, K, ...)`` over ``num_classes`` K and the training targets
        ``data.train.tensors[1]`` are class indices ``(n, ...)`` (per pixel
        for a segmentation: voxels are counted); the shift is log n_c shaped
        ``(K, 1, ..., 1)`` (one 1 per target dimension after the first).
        Models with a sigmoid (log-odds) output override it with
        :func:`log_odds_shift`. A class absent from the targets counts as 1
        (log 1 = 0, not -inf: the shift stays finite). In the parameters'
        dtype, on their device.
        """
        targets = data.train.tensors[1]
        counts = torch.bincount(targets.reshape(-1).long(), minlength=self.num_classes)
        shift = counts.clamp_min(1).to(torch.float64).log().reshape(-1, *([1] * (targets.ndim - 1)))
        return self._like_parameters(shift)

    def site_constants(self) -> Hashable:
        """What the loss reads of the site besides the parameters and buffers (e.g. class weights); default none.

        The batched executor (:mod:`medfed.federated.batched`) trains sites together only where these are equal.
        """
        return ()

    def shape_key(self) -> tuple[Hashable, ...]:
        """What models run stacked together (one vmapped forward over their tensors) share: the type, every
        parameter's and buffer's name, shape and dtype, and :meth:`site_constants`."""
        tensors = itertools.chain(self.named_parameters(), self.named_buffers())
        return (type(self), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors), self.site_constants())

    def _like_parameters(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in the parameters' dtype and on their device."""
        first = next(self.parameters())
        return tensor.to(device=first.device, dtype=first.dtype)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """``model.optimizer`` (Adam, or SGD with ``model.momentum``) over every parameter; frozen ones get no gradient and are skipped."""
        if self.options.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.options.lr, momentum=self.options.momentum, weight_decay=self.options.weight_decay)
        return torch.optim.Adam(self.parameters(), lr=self.options.lr, weight_decay=self.options.weight_decay)

    def test_step(self, batch, batch_idx: int) -> None:
        """Add one test batch to the metrics: :meth:`update_test_metrics` of :meth:`test_outputs`."""
        x, y = batch
        self.update_test_metrics(self.test_outputs(x), y)

    def test_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """What the test metrics are computed from, for inputs ``x``; a function of the parameters and buffers only
        (the batched executor evaluates a group of sites at once through it, :func:`~medfed.federated.stacked_evaluation.evaluate_group`)."""
        return self(x)

    def update_test_metrics(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Add ``outputs`` (:meth:`test_outputs` of a batch) and its targets ``y`` to the test metrics."""
        raise NotImplementedError

    def test_results(self) -> dict[str, float]:
        """Metrics over every test batch seen since the last call; resets the accumulators."""
        results = self.compute_test_metrics()
        self.test_metrics.reset()
        return {name: float(results[name]) for name in self.metric_names}


def log_odds_shift(positives: torch.Tensor, totals: torch.Tensor | int) -> torch.Tensor:
    """log(n_1 / n_0) of binary targets: the Balanced Softmax shift of a log-odds (sigmoid) output.

    Two softmax logits shifted by (log n_0, log n_1) have the log-odds
    l + log n_1 - log n_0. A count of 0 counts as 1, as in
    :meth:`FederatedModule.log_prior`.

    Args:
        positives: int64 counts of 1s (any shape, e.g. ``(R,)`` per region).
        totals: the number of targets each count is over.

    Returns:
        float64 tensor of ``positives``' shape.
    """
    negatives = totals - positives
    return positives.clamp_min(1).to(torch.float64).log() - negatives.clamp_min(1).to(torch.float64).log()


def unwrap(module: nn.Module) -> FederatedModule:
    """The user's module behind Fabric's wrapper (Fabric documents ``.module`` as the way to it)."""
    return module.module if is_wrapped(module) else module
