"""Tiny federations and models for strategy tests: two groups of sites, linear models, seconds per run.

* :func:`two_group_federation`: sites 0 .. N/2-1 label a point by the sign of
  <x, v>, the other half by the opposite sign (a flipped label rule), and the
  second group's inputs are also shifted; a good model for one group is the
  worst for the other.
* :class:`LinearClassifier` (softmax regression) and :class:`LinearRegressor`
  (least squares, analytic gradients for hand computations), both trained by
  plain SGD so one step is exactly ``theta - lr * gradient``.
* :class:`BatchNormClassifier`: a hidden layer with BatchNorm, for what
  strategies do with normalisation layers and running statistics;
  :class:`BodyHeadClassifier`: a shared body under a personal head;
  :class:`DropoutClassifier`, :class:`DropoutBodyHeadClassifier`: dropout,
  for what depends on global generators; :func:`with_a_body`: the two-layer
  twin of a one-layer model, for strategies that need a body under the last
  layer (FedBABU).
* :func:`build_loop`: a :class:`FederatedLoop` over a federation, with the
  strategy chosen and configured exactly as the ``strategy`` config group does;
  :func:`record_payloads`: what crosses its links.
* :func:`one_torch_thread`: an autouse fixture for the test modules that import
  it; tiny models run several times faster on one thread than on two
  contending ones (the tests' machine has two cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError

from medfed.assembly import RunAssembly
from medfed.data.federation import Federation, SiteData
from medfed.federated.loop import FederatedLoop
from medfed.federated.sites import InProcessSites
from medfed.federated.strategies import strategy_from_config
from medfed.federated.protocol import Payload
from medfed.models.base import FederatedModule


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run the test on one intra-op thread, then restore the previous setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass
class LinearOptions:
    lr: float = 0.5


class LinearClassifier(FederatedModule):
    """Softmax regression ``(B, F) -> (B, C)``; the bias is the personal part (pFedNet needs one)."""

    metric_names = ("accuracy",)
    default_personal_patterns = (r"^linear\.bias$",)

    def __init__(self, in_features: int, num_classes: int, options: LinearOptions | None = None) -> None:
        super().__init__()
        self.options = options or LinearOptions()
        self.num_classes = num_classes
        self.linear = nn.Linear(in_features, num_classes)
        self.test_metrics = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.configure_split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.test_metrics.update(self(x).argmax(dim=1), y)

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        return {"accuracy": self.test_metrics.compute()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.options.lr)


class DropoutClassifier(LinearClassifier):
    """:class:`LinearClassifier` with dropout (p = 0.5) on its inputs: training draws from torch's global generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.dropout(x, 0.5, self.training))


class BatchNormClassifier(LinearClassifier):
    """``(B, F) -> Linear(F, H) -> BatchNorm1d(H) -> ReLU -> Linear(H, C)``, SGD; the output bias is personal.

    Its float buffers are the BatchNorm running mean and variance, ``(H,)``
    each; ``num_batches_tracked`` is its only integer buffer.
    """

    default_personal_patterns = (r"^output\.bias$",)

    def __init__(self, in_features: int, num_classes: int, options: LinearOptions | None = None, hidden: int = 3) -> None:
        FederatedModule.__init__(self)
        self.options = options or LinearOptions()
        self.num_classes = num_classes
        self.hidden = nn.Linear(in_features, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.output = nn.Linear(hidden, num_classes)
        self.test_metrics = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.configure_split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.norm(self.hidden(x))))


class BodyHeadClassifier(LinearClassifier):
    """``(B, F) -> body Linear(F, H) -> tanh -> head Linear(H, C)``, SGD: the body is shared, the head personal.

    The two parts body/head methods (FedPer, FedRep, FedRoD) tell apart:
    shared = ``body.weight`` (H, F) and ``body.bias`` (H,), personal =
    ``head.weight`` (C, H) and ``head.bias`` (C,); no buffers.
    """

    default_personal_patterns = (r"^head\.",)

    def __init__(self, in_features: int, num_classes: int, options: LinearOptions | None = None, hidden: int = 5) -> None:
        FederatedModule.__init__(self)
        self.options = options or LinearOptions()
        self.num_classes = num_classes
        self.body = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, num_classes)
        self.test_metrics = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.configure_split()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """z = tanh(body(x)), ``(B, H)``."""
        return torch.tanh(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DropoutBodyHeadClassifier(BodyHeadClassifier):
    """:class:`BodyHeadClassifier` with dropout (p = 0.5) on its features: training draws from torch's global generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.dropout(self.features(x), 0.5, self.training))


#: strategies whose model needs a body under its last layer, and the two-layer twin of each one-layer toy model
NEEDS_A_BODY = frozenset({"fedbabu"})
_TWO_LAYER_TWIN = {LinearClassifier: BodyHeadClassifier, DropoutClassifier: DropoutBodyHeadClassifier}


def with_a_body(strategy: str, model_cls: type) -> type:
    """``model_cls``, or its two-layer twin where ``strategy`` needs a body under the last layer (FedBABU's head)."""
    return _TWO_LAYER_TWIN.get(model_cls, model_cls) if strategy in NEEDS_A_BODY else model_cls


class LinearRegressor(FederatedModule):
    """theta in R^F, prediction <x, theta>, loss f(theta) = mean_k (<x_k, theta> - y_k)^2 / 2.

    The gradient over a batch is X^T (X theta - y) / n: hand computations
    in tests use exactly this.
    """

    metric_names = ("mse",)

    def __init__(self, in_features: int, options: LinearOptions | None = None) -> None:
        super().__init__()
        self.options = options or LinearOptions()
        self.linear = nn.Linear(in_features, 1, bias=False)
        self.test_metrics = MeanSquaredError()
        self.configure_split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return 0.5 * (self(x) - y).square().mean()

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.test_metrics.update(self(x), y)

    def compute_test_metrics(self) -> dict[str, torch.Tensor]:
        return {"mse": self.test_metrics.compute()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.options.lr)


def two_group_federation(n_sites: int = 6, n_train: int = 48, n_test: int = 48, n_features: int = 4, seed: int = 0) -> Federation:
    """Classification sites in two groups whose label rules are opposite (and inputs shifted).

    Site s draws x ~ N(shift_g, I) and labels y = 1[<x, v> > 0] in group 0
    (s < n_sites // 2) or y = 1[<x, v> < 0] in group 1, shift_1 = 0.5 * v.
    Different sites get different sample counts (n_train + 8 s) so that
    sample-weighted steps are exercised.
    """
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=n_features)
    direction /= np.linalg.norm(direction)
    sites = []
    for s in range(n_sites):
        group = int(s >= n_sites // 2)

        def draw(n: int) -> TensorDataset:
            x = rng.normal(size=(n, n_features)) + 0.5 * group * direction
            y = ((x @ direction > 0) != bool(group)).astype(np.int64)
            return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

        sites.append(SiteData(f"site{s}", draw(n_train + 8 * s), draw(n_test), {"group": group}))
    return Federation("toy", sites, (n_features,), 2, "GENERATED two-group toy data", True)


def regression_federation(n_sites: int = 3, n_features: int = 3, seed: int = 0) -> Federation:
    """Least-squares sites with different true parameters and sizes (for hand-computed PGFed rounds)."""
    rng = np.random.default_rng(seed)
    sites = []
    for s in range(n_sites):
        truth = rng.normal(size=n_features)
        n = 6 + 2 * s

        def draw(count: int) -> TensorDataset:
            x = rng.normal(size=(count, n_features))
            y = x @ truth + 0.1 * rng.normal(size=count)
            return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))

        sites.append(SiteData(f"site{s}", draw(n), draw(4)))
    return Federation("toy", sites, (n_features,), 1, "GENERATED least-squares toy data", True)


def build_loop(
    strategy: str | type,
    federation: Federation,
    model: FederatedModule,
    options: dict[str, Any] | None = None,
    participation: float = 1.0,
    local_epochs: int = 1,
    batch_size: int = 16,
    seed: int = 0,
    **faults: Any,
) -> FederatedLoop:
    """A loop as ``medfed.experiment.run`` builds it (:class:`~medfed.assembly.RunAssembly`; dense links, CPU), without files or loggers.

    Args:
        strategy: registered strategy name, or a ``Strategy`` subclass.
        federation: the sites' data.
        model: the prototype every site copies (its parameters are the initial model).
        options: that strategy's options (``strategy.<name>`` config group).
        participation: fraction of sites per round.
        local_epochs, batch_size, seed: as in ``trainer.*``.
        faults: the loop's ``on_site_failure``, ``update_norm_limit``,
            ``max_consecutive_failures`` (the ``federation.*`` keys).
    """
    if isinstance(strategy, str):
        strategy_cls, strategy_options = strategy_from_config({"name": strategy, **({strategy: options} if options else {})})
    else:  # a Strategy class defined by a test
        strategy_cls, strategy_options = strategy, strategy.Options(**(options or {}))
    strategy_obj = strategy_cls(strategy_options, model.parameter_split, len(federation.sites), seed)
    assembly = RunAssembly(model, strategy_obj, {"name": "dense"}, {"name": "dense"}, batch_size, seed)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[], callbacks=[])
    sites = assembly.sites(fabric, federation)
    initial = assembly.initial_values(fabric.device)
    links = [assembly.link(initial, fabric.device, site.name) for site in sites]
    return FederatedLoop(fabric, strategy_obj, InProcessSites(sites, links), initial, local_epochs, participation, seed, **faults)


def record_payloads(loop: FederatedLoop) -> list[tuple[int, str, Payload]]:
    """Wrap every link's ``send``: the returned list fills with ``(site index, direction, payload sent)``."""
    sent = []
    for index, link in enumerate(loop.links):
        def send(direction, payload, index=index, link_send=link.send):
            sent.append((index, direction, {key: value.clone() for key, value in payload.items()}))
            return link_send(direction, payload)

        link.send = send
    return sent


def seeded(model_cls, *args, seed: int = 0, **kwargs) -> FederatedModule:
    """``model_cls(*args, **kwargs)`` initialised under ``torch.manual_seed(seed)`` (global RNG restored)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_cls(*args, **kwargs)
