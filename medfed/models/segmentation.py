"""2-D tumour segmentation with MONAI's U-Net (the BraTS task).

Input patches are ``(B, 4, 64, 64)`` float32 (FLAIR, T1, T1ce, T2, each
z-scored per case). ``regions`` (config ``task.regions``) picks what the model learns:

``wt`` (the paper's task)
    targets ``(B, 64, 64)`` int64, 1 = whole tumour, 0 = background; two
    softmax outputs, Dice + cross-entropy. Metrics follow
    ``shared/design/algorithms.md`` (bug 3): IoU is the mean Jaccard index
    over the two classes, label IoU the tumour Jaccard index, both
    accumulated over the whole test split.
``brats`` (the BraTS challenge's regions)
    targets ``(B, 3, 64, 64)`` uint8 masks of whole tumour, tumour core and
    enhancing tumour (:func:`medfed.data.brats.tumour_regions`); three
    sigmoid outputs, Dice + binary cross-entropy per region (MONAI's
    ``DiceCELoss`` would apply a softmax cross-entropy across the three
    channels, as if the regions excluded each other; they are nested). Metrics:
    label IoU (whole tumour, as for ``wt``), label IoU of TC and of ET.

:meth:`UNetSegmenter.region_masks` turns outputs into region masks for
whole-volume evaluation (:mod:`medfed.evaluation.volume`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from torchmetrics.classification import MulticlassJaccardIndex, MultilabelJaccardIndex

from medfed.data.brats import REGIONS
from medfed.models.base import FederatedModule, log_odds_shift
from medfed.models.dropout import use_keyed_dropout
from medfed.models.padding import padded, sample_mean
from medfed.options.models import UNetOptions

if TYPE_CHECKING:
    from medfed.data.federation import SiteData

#: MONAI's UNet nests ``Sequential(down, SkipConnection(submodule), up)``; index 2 at any depth is
#: an up-sampling (decoder) block. Everything else — down blocks and the bottom — is the encoder.
UNET_DECODER_PATTERN = r"^unet\.model\.(1\.submodule\.)*2\."

def soft_dice(probabilities: torch.Tensor, targets: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """MONAI's ``DiceLoss`` of each sample and channel before its reduction, ``(B, C)``, of ``(B, C, *spatial)`` probabilities
    and targets::

        1 - (2 sum(t p) + smooth) / (sum(t) + sum(p) + smooth)     sums over the spatial axes

    MONAI's own finds its axes through ``Tensor.tolist()``, which ``torch.compile`` cannot trace inside a stacked
    step (:mod:`medfed.federated.stacked`); the padded loss (:meth:`DiceCrossEntropy.per_sample`) uses this one.
    """
    spatial = tuple(range(2, probabilities.ndim))
    intersection = torch.sum(targets * probabilities, dim=spatial)
    denominator = torch.sum(targets, dim=spatial) + torch.sum(probabilities, dim=spatial)
    return 1.0 - (2.0 * intersection + smooth) / (denominator + smooth)


class DiceCrossEntropy(torch.nn.Module):
    """Dice (of softmax outputs) + cross-entropy of ``(B, K, H, W)`` logits against ``(B, H, W)`` class indices.

    MONAI's ``DiceCELoss(to_onehot_y=True, softmax=True)`` value for value, with the one-hot targets made by a
    comparison instead of MONAI's in-place ``scatter_`` into a fresh tensor, which ``torch.func.vmap`` (the batched
    executor, :mod:`medfed.federated.batched`) cannot run over a stack of sites.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dice = DiceLoss(softmax=True)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.dice(logits, self._one_hot(logits, labels)) + torch.nn.functional.cross_entropy(logits, labels.long())

    def per_sample(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's loss ``(B,)``: its Dice (mean over classes) + its cross-entropy (mean over pixels); their
        mean over the batch is :meth:`forward`."""
        dice = soft_dice(torch.softmax(logits, 1), self._one_hot(logits, labels)).mean(dim=1)
        return dice + torch.nn.functional.cross_entropy(logits, labels.long(), reduction="none").flatten(1).mean(dim=1)

    @staticmethod
    def _one_hot(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        classes = torch.arange(logits.shape[1], device=labels.device).reshape(1, -1, *([1] * (labels.ndim - 1)))
        return (labels.unsqueeze(1) == classes).to(logits.dtype)


class RegionLoss(torch.nn.Module):
    """Dice + binary cross-entropy of overlapping regions: ``(B, R, H, W)`` logits against 0/1 masks of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.dice = DiceLoss(sigmoid=True)
        self.cross_entropy = torch.nn.BCEWithLogitsLoss()

    def forward(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return self.dice(logits, masks) + self.cross_entropy(logits, masks)

    def per_sample(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Each sample's loss ``(B,)`` (Dice and cross-entropy each averaged over the sample's regions and pixels);
        their mean over the batch is :meth:`forward`."""
        dice = soft_dice(torch.sigmoid(logits), masks).mean(dim=1)
        return dice + torch.nn.functional.binary_cross_entropy_with_logits(logits, masks, reduction="none").flatten(1).mean(dim=1)


class UNetSegmenter(FederatedModule):
    """U-Net with the encoder shared and the decoder personal by default (pFedNet, section VI-A)."""

    Options = UNetOptions

    metric_names = ("iou", "label_iou")
    default_personal_patterns = (UNET_DECODER_PATTERN,)
    pads = True

    def __init__(self, in_channels: int, num_classes: int, options: Options | None = None, regions: str = "wt") -> None:
        super().__init__()
        options = options or self.Options()
        self.options = options
        self.num_classes = num_classes
        self.regions = regions
        if regions == "brats" and num_classes != len(REGIONS):
            raise ValueError(f"regions 'brats' needs {len(REGIONS)} outputs (WT, TC, ET), got num_classes={num_classes}")
        self.region_names = ("wt",) if regions == "wt" else REGIONS
        self.unet = UNet(
            spatial_dims=2,
            in_channels=in_channels,
            out_channels=num_classes,
            channels=tuple(options.channels),
            strides=tuple(options.strides),
            num_res_units=options.num_res_units,
            dropout=options.dropout,
        )
        if options.dropout > 0:
            use_keyed_dropout(self.unet)  # masks both executors draw alike (medfed.models.dropout)
        if regions == "wt":
            self.loss = DiceCrossEntropy()
            self.test_metrics = MulticlassJaccardIndex(num_classes=num_classes, average="none")
        else:
            self.metric_names = ("label_iou", "label_iou_tc", "label_iou_et")
            self.loss = RegionLoss()
            self.test_metrics = MultilabelJaccardIndex(num_labels=len(REGIONS), average="none")
        self.configure_split(options.personal_patterns, options.shared_patterns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` patches -> ``(B, num_classes, H, W)`` logits."""
        return self.unet(x)

    def region_masks(self, output: torch.Tensor) -> torch.Tensor:
        """``(B, K, H, W)`` outputs -> bool ``(B, R, H, W)`` masks of :attr:`region_names` (R = 1 or 3)."""
        if self.regions == "wt":
            return (output.argmax(dim=1) == 1).unsqueeze(1)
        return output > 0  # sigmoid(output) > 1/2

    def log_prior(self, data: SiteData) -> torch.Tensor:
        """``wt``: log n_c of the training pixels of each class, ``(2, 1, 1)``; ``brats``: log(n_1 / n_0) of
        each region's training pixels, ``(3, 1, 1)`` (its output is a log-odds per region)."""
        if self.regions == "wt":
            return super().log_prior(data)
        masks = data.train.tensors[1]  # (n, 3, P, P) 0/1
        positives = masks.to(torch.int64).sum(dim=(0, 2, 3))
        return self._like_parameters(log_odds_shift(positives, masks[:, 0].numel()).reshape(-1, 1, 1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The loss of the batch (of its real samples in a padded one: :mod:`medfed.models.padding`)."""
        x, y = batch
        target = y if self.regions == "wt" else y.float()
        if padded():
            return sample_mean(self.loss.per_sample(self(x), target))
        return self.loss(self(x), target)

    def update_test_metrics(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        if self.regions == "wt":
            self.test_metrics.update(outputs.argmax(dim=1), y)
        else:
            self.test_metrics.update(self.region_masks(outputs).long(), y.long())

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        per_class = self.test_metrics.compute()
        if self.regions == "wt":
            return {"iou": per_class.mean(), "label_iou": per_class[1]}
        return dict(zip(self.metric_names, per_class))
