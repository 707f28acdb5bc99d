"""The ``model`` option groups of every registered model: plain dataclasses, no torch.

Each model class takes its ``Options`` from here (``Options = UNetOptions``), so
:func:`medfed.components.resolve` checks a config's ``model`` group, fills in
its defaults and prints them before torch, Lightning or MONAI is imported;
:data:`MODEL_OPTIONS` names them by ``model.name`` (tests/test_registry.py
checks it against :data:`medfed.models.MODELS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medfed.config import require

CLASS_WEIGHTS = ("balanced",)
"""What ``model.class_weight`` may be besides null (two-class models)."""
OPTIMIZERS = ("adam", "sgd")
"""Local training's optimiser (``model.optimizer``): ``torch.optim.Adam`` or ``torch.optim.SGD`` (with ``model.momentum``)."""


MAX_LR = 10.0
"""The largest ``model.lr``: a local step of more than ten gradients (SGD) or ten units per parameter (Adam) diverges
at the first step of any of medfed's models (1e30 overflowed pFedNet's server step to an infinite penalty)."""


@dataclass
class ModelOptions:
    """Options every model takes (the ``model`` config group); models extend it with their own.

    Attributes:
        lr: learning rate of local training.
        weight_decay: the optimiser's weight decay (L2, added to the gradient).
        optimizer: ``adam`` (default) or ``sgd`` (the pFedNet authors' code: SGD, lr 1e-3, momentum 0.9).
        momentum: SGD's momentum (0: plain SGD); ``sgd`` only.
        personal_patterns: regexes over parameter names that make a parameter
            personal (``None``: the model's default split).
        shared_patterns: regexes that make a parameter shared (``None``:
            everything not personal is shared).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    personal_patterns: list[str] | None = None
    shared_patterns: list[str] | None = None
    optimizer: str = "adam"
    momentum: float = 0.0

    def __post_init__(self) -> None:
        require(0 < self.lr <= MAX_LR, "lr", self.lr, f"a learning rate > 0 and at most {MAX_LR:g}")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", self.weight_decay, "a finite number >= 0")
        require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        require(0.0 <= self.momentum < 1.0, "momentum", self.momentum, "a momentum in [0, 1)")
        require(self.optimizer == "sgd" or self.momentum == 0.0, "momentum", self.momentum, "0 with optimizer adam (momentum is sgd's)")


@dataclass
class ClassifierOptions(ModelOptions):
    """Options every two-class model takes.

    Attributes:
        class_weight: ``None``: every sample weighs 1; ``"balanced"``: class c
            weighs n / (2 n_c) in the loss, from the site's own training labels.
    """

    class_weight: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.class_weight is None or self.class_weight in CLASS_WEIGHTS,
            "class_weight",
            self.class_weight,
            f"null or {' or '.join(CLASS_WEIGHTS)}",
        )


@dataclass
class UNetOptions(ModelOptions):
    """The ``model`` group of ``unet`` (:class:`~medfed.models.segmentation.UNetSegmenter`)."""

    channels: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    strides: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    num_res_units: int = 2
    dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            len(self.channels) >= 2 and all(c >= 1 for c in self.channels),
            "channels",
            self.channels,
            "at least two positive channel counts (one per U-Net level)",
        )
        require(len(self.strides) == len(self.channels) - 1, "strides", self.strides, "one fewer entry than channels")
        require(all(s >= 1 for s in self.strides), "strides", self.strides, "positive integers")
        require(self.num_res_units >= 0, "num_res_units", self.num_res_units, "an integer >= 0")
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")

    def check_input_size(self, size: int, key: str) -> None:
        """Refuse a patch side ``size`` (config key ``key``) the U-Net cannot take back to its own size.

        Each level divides the side by its stride and the decoder multiplies it
        back, so the side must be a multiple of the strides' product, and the
        bottom level at least 2 pixels wide (batch norm needs more than one value).
        """
        total = math.prod(self.strides)
        require(
            size % total == 0 and size // total >= 2,
            key,
            size,
            f"a multiple of {total} (the product of model.strides {self.strides}) and at least {2 * total}",
        )


@dataclass
class DenseNetOptions(ClassifierOptions):
    """The ``model`` group of ``densenet`` (:class:`~medfed.models.classification.NoduleClassifier`)."""

    init_features: int = 16
    growth_rate: int = 12
    block_config: list[int] = field(default_factory=lambda: [4, 4, 4])
    bn_size: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.init_features >= 1, "init_features", self.init_features, "an integer >= 1")
        require(self.growth_rate >= 1, "growth_rate", self.growth_rate, "an integer >= 1")
        require(
            len(self.block_config) >= 1 and all(n >= 1 for n in self.block_config),
            "block_config",
            self.block_config,
            "a non-empty list of layer counts >= 1",
        )
        require(self.bn_size >= 1, "bn_size", self.bn_size, "an integer >= 1")
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")


@dataclass
class LogisticRegressionOptions(ClassifierOptions):
    """The ``model`` group of ``logreg`` (:class:`~medfed.models.tabular.LogisticRegression`)."""

    lr: float = 1e-2


MODEL_OPTIONS: dict[str, type] = {"unet": UNetOptions, "densenet": DenseNetOptions, "logreg": LogisticRegressionOptions}
"""Every registered model's ``Options``, by ``model.name``."""
