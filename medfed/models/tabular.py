"""Logistic regression on tabular records (the clinical task), every parameter personal by default.

Input ``(B, f)`` float32 features scaled to [-1, 1]; output ``(B,)`` log-odds
of the event, w . x + b, from one linear layer f -> 1 trained with the binary
cross-entropy (:class:`~medfed.models.classification.BinaryClassifier` supplies
loss and metrics). One output rather than two logits keeps the parameters
identifiable: two softmax logits can shift both weight rows by the same
vector without changing the model, and pFedNet's graph penalty
lambda * ||z_i - z_j|| would then charge sites for differences that are no
difference. pFedNet makes every feature personal for clinical risk
prediction (section VI-A), so by default the shared part is empty and only
the graph penalty couples the sites.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from medfed.models.base import log_odds_shift
from medfed.models.classification import BinaryClassifier
from medfed.options.models import LogisticRegressionOptions

if TYPE_CHECKING:
    from medfed.data.federation import SiteData


class LogisticRegression(BinaryClassifier):
    """One linear layer ``linear`` (weight (1, f), bias (1,)), personal by default."""

    Options = LogisticRegressionOptions

    default_personal_patterns = (r"^linear\.",)

    def __init__(self, in_features: int, num_classes: int, options: Options | None = None) -> None:
        super().__init__(num_classes)
        options = options or self.Options()
        self.options = options
        self.linear = nn.Linear(in_features, 1)
        self.configure_split(options.personal_patterns, options.shared_patterns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, f)`` features -> ``(B,)`` log-odds of the positive class."""
        return self.linear(x).squeeze(-1)

    def log_odds(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def log_prior(self, data: SiteData) -> torch.Tensor:
        """log(n_1 / n_0) of the site's training labels, shape ``()``: the output is a log-odds."""
        labels = data.train.tensors[1]
        return self._like_parameters(log_odds_shift((labels == 1).sum(), labels.numel()))
