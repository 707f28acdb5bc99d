"""Two-class classification: the common metrics and loss, and the nodule classifier (a MONAI DenseNet).

Every binary classifier in medfed produces the log-odds of the positive
class, ``(B,)`` float: the loss is the binary cross-entropy on those log-odds
(for a network with two output logits l0, l1 the log-odds are l1 - l0, and this
loss *is* the usual two-class cross-entropy), and the test metrics accumulate
over the site's whole test split (never the last batch only: bug 4 of the
reference code):

* ``accuracy``: share of correct predictions, predicted class 1 iff
  p(positive) > 0.5 (the argmax of two logits); what pFedNet reports;
* ``balanced_accuracy``: the mean of the two classes' recalls (multiclass
  macro recall), which a constant prediction cannot push above 0.5 however
  imbalanced the test split;
* ``auroc``: area under the ROC curve of p(positive), threshold-free.

Both classes must be present in a test split for balanced accuracy and AUROC
to be defined; the label-ratio federations guarantee it.

With ``model.class_weight: balanced`` the loss of a batch of B samples is

    (1/B) sum_i w_{y_i} l_i,   w_c = n / (2 n_c),

l_i the binary cross-entropy of sample i, n the site's training samples and
n_c those of class c, counted by each site on its own training split
(:meth:`BinaryClassifier.prepare_for_site`; no count leaves the site). Over
the split sum_i w_{y_i} = n, and each class carries half of it, so a site
with 6% positives can no longer minimise its loss by calling every sample
negative. The default, ``null``, weighs every sample 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from monai.networks.nets import DenseNet
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC, BinaryConfusionMatrix

from medfed.errors import DataError
from medfed.models.base import FederatedModule
from medfed.models.dropout import use_keyed_dropout
from medfed.models.padding import padded, sample_mean
from medfed.options.models import ClassifierOptions, DenseNetOptions

if TYPE_CHECKING:
    from medfed.data.federation import SiteData

#: MONAI's DenseNet holds its convolutional trunk in ``features`` and the final ReLU, pooling and
#: fully connected layer in ``class_layers``; only ``class_layers.out`` has parameters.
DENSENET_CLASSIFIER_PATTERN = r"^densenet\.class_layers\."


class BinaryClassifier(FederatedModule):
    """Base class of two-class models.

    Subclasses define ``log_odds(x) -> (B,)``: the float log-odds of the
    positive class for a batch of inputs.

    Attributes:
        class_weights: (w_0, w_1) of the loss, set by :meth:`prepare_for_site`
            under ``class_weight: balanced``; None otherwise. Plain floats, not
            a buffer, so no strategy ever averages or sends them.
    """

    metric_names = ("accuracy", "balanced_accuracy", "auroc")
    options: ClassifierOptions
    pads = True

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        if num_classes != 2:
            raise ValueError(f"{type(self).__name__} is a two-class model, got num_classes={num_classes}")
        self.num_classes = num_classes
        self.test_metrics = MetricCollection({"confusion": BinaryConfusionMatrix(), "auroc": BinaryAUROC()})
        self.class_weights: tuple[float, float] | None = None

    def prepare_for_site(self, data: SiteData) -> None:
        """Under ``class_weight: balanced``, w_c = n / (2 n_c) from ``data``'s training labels (n_c of class c).

        Raises:
            DataError: naming the site, when its training split lacks a class.
        """
        if self.options.class_weight is None:
            return
        labels = data.train.tensors[1]
        counts = [int((labels == label).sum()) for label in (0, 1)]
        if min(counts) == 0:
            raise DataError(
                f"{data.name}: model.class_weight=balanced needs training samples of both classes, "
                f"found {counts[0]} negative and {counts[1]} positive"
            )
        self.class_weights = (len(labels) / (2 * counts[0]), len(labels) / (2 * counts[1]))

    def site_constants(self) -> tuple[float, float] | None:
        """The site's class weights (None without ``class_weight``)."""
        return self.class_weights

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Binary cross-entropy of the log-odds, each sample weighted by its class's weight when there are any."""
        x, y = batch
        log_odds = self.log_odds(x)
        weight = None
        if self.options.class_weight is not None:
            if self.class_weights is None:
                raise RuntimeError(f"class_weight={self.options.class_weight!r}: call prepare_for_site before training")
            weight = torch.tensor(self.class_weights, dtype=log_odds.dtype, device=log_odds.device)[y]
        if padded():  # the mean over the real samples of a padded batch (medfed.models.padding)
            return sample_mean(F.binary_cross_entropy_with_logits(log_odds, y.to(log_odds.dtype), weight=weight, reduction="none"))
        return F.binary_cross_entropy_with_logits(log_odds, y.to(log_odds.dtype), weight=weight)

    def positive_probability(self, x: torch.Tensor) -> torch.Tensor:
        """p(positive) of each sample, ``(B,)`` float64: the score the test metrics, ROC curves and confusion matrices use."""
        # float64 keeps p(positive) below 1 up to log-odds ~36, so AUROC does not see false ties
        return torch.sigmoid(self.log_odds(x).to(torch.float64))

    def test_outputs(self, x: torch.Tensor) -> torch.Tensor:
        return self.positive_probability(x)

    def update_test_metrics(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        self.test_metrics.update(outputs, y)

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        results = self.test_metrics.compute()
        confusion = results["confusion"].to(torch.float64)  # rows: true class 0, 1; columns: predicted
        recall_per_class = confusion.diagonal() / confusion.sum(dim=1)
        return {
            "accuracy": confusion.trace() / confusion.sum(),
            "balanced_accuracy": recall_per_class.mean(),
            "auroc": results["auroc"],
        }


class NoduleClassifier(BinaryClassifier):
    """Compact 2-D DenseNet on candidate patches: features shared, classifier personal by default (pFedNet VI-A).

    Input ``(B, C, H, W)`` float32 patches (LUNA16: C = 1, H = W = 32); output
    ``(B, 2)`` logits (0 = not a nodule, 1 = nodule). MONAI's DenseNet stem
    (7x7 convolution with stride 2, 3x3 max-pooling with stride 2) divides the
    side by 4, each of the ``len(block_config) - 1`` transitions halves it, and
    a global average pooling feeds the linear classifier. The default
    (16 initial features, growth 12, three blocks of 4 layers) has 98,466
    parameters and leaves a 2 x 2 map of a 32 x 32 patch before the pooling;
    BatchNorm running statistics are buffers and stay at their site.
    """

    Options = DenseNetOptions

    default_personal_patterns = (DENSENET_CLASSIFIER_PATTERN,)

    def __init__(self, in_channels: int, num_classes: int, options: Options | None = None) -> None:
        super().__init__(num_classes)
        options = options or self.Options()
        self.options = options
        self.densenet = DenseNet(
            spatial_dims=2,
            in_channels=in_channels,
            out_channels=num_classes,
            init_features=options.init_features,
            growth_rate=options.growth_rate,
            block_config=tuple(options.block_config),
            bn_size=options.bn_size,
            dropout_prob=options.dropout,
        )
        if options.dropout > 0:
            use_keyed_dropout(self.densenet)  # masks both executors draw alike (medfed.models.dropout)
        self.configure_split(options.personal_patterns, options.shared_patterns)

    def min_input_side(self) -> int:
        """Smallest patch side whose feature map survives the stem and every transition (1 x 1 at least)."""
        # after the stem: ceil(side / 4); after k transitions: floor(. / 2 ** k) >= 1
        return 4 * (2 ** (len(self.options.block_config) - 1) - 1) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` patches -> ``(B, 2)`` logits."""
        if min(x.shape[-2:]) < self.min_input_side():
            raise ValueError(
                f"NoduleClassifier with block_config {self.options.block_config} needs patches of at least "
                f"{self.min_input_side()} x {self.min_input_side()} pixels, got {tuple(x.shape[-2:])}"
            )
        return self.densenet(x)

    def log_odds(self, x: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        return logits[:, 1] - logits[:, 0]
