"""2-D tumour segmentation with MONAI's U-Net (the BraTS task).

Input patches are ``(B, 4, 64, 64)`` float32 (FLAIR, T1, T1ce, T2, each
z-scored per case); targets are ``(B, 64, 64)`` int64 with 1 = whole tumour,
0 = background. Metrics follow ``shared/design/algorithms.md`` (bug 3): IoU is
the mean Jaccard index over the two classes, label IoU the tumour Jaccard
index, both accumulated over the whole test split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from torchmetrics.classification import MulticlassJaccardIndex

from medfed.config import require
from medfed.models.base import FederatedModule, ModelOptions

#: MONAI's UNet nests ``Sequential(down, SkipConnection(submodule), up)``; index 2 at any depth is
#: an up-sampling (decoder) block. Everything else — down blocks and the bottom — is the encoder.
UNET_DECODER_PATTERN = r"^unet\.model\.(1\.submodule\.)*2\."


class UNetSegmenter(FederatedModule):
    """U-Net with the encoder shared and the decoder personal by default (pFedNet, section VI-A)."""

    @dataclass
    class Options(ModelOptions):
        channels: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
        strides: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
        num_res_units: int = 2
        dropout: float = 0.0

        def __post_init__(self) -> None:
            super().__post_init__()
            require(len(self.strides) == len(self.channels) - 1, "strides", self.strides, "one fewer entry than channels")
            require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")

    metric_names = ("iou", "label_iou")
    default_personal_patterns = (UNET_DECODER_PATTERN,)

    def __init__(self, in_channels: int, num_classes: int, options: Options | None = None) -> None:
        super().__init__()
        options = options or self.Options()
        self.options = options
        self.num_classes = num_classes
        self.unet = UNet(
            spatial_dims=2,
            in_channels=in_channels,
            out_channels=num_classes,
            channels=tuple(options.channels),
            strides=tuple(options.strides),
            num_res_units=options.num_res_units,
            dropout=options.dropout,
        )
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True)
        self.test_metrics = MulticlassJaccardIndex(num_classes=num_classes, average="none")
        self.configure_split(options.personal_patterns, options.shared_patterns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` patches -> ``(B, num_classes, H, W)`` logits."""
        return self.unet(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y.unsqueeze(1))

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.test_metrics.update(self(x).argmax(dim=1), y)

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        per_class = self.test_metrics.compute()
        return {"iou": per_class.mean(), "label_iou": per_class[1]}
