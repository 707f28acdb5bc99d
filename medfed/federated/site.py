"""One hospital site: its model, optimiser, data and randomness, kept across rounds.

A site is built once per run and never rebuilt: its LightningModule, its
optimiser state (e.g. Adam moments) and its data-loader RNG survive from
round to round and go into every checkpoint, so a resumed run continues
exactly where the interrupted one stopped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from medfed.data.federation import SiteData
from medfed.models.base import FederatedModule


class Site:
    """A site of the federation, driven by the loop through Fabric.

    Args:
        index: 0-based position of the site in the federation.
        data: the site's train and test splits.
        module: the site's model (already moved/wrapped by ``fabric.setup``).
        optimizer: its optimiser (wrapped by ``fabric.setup``).
        fabric: the run's Fabric (device placement, backward).
        batch_size: mini-batch size of local training and evaluation.
        seed: seeds the site's shuffling generator (offset by ``index``).
    """

    def __init__(
        self,
        index: int,
        data: SiteData,
        module: FederatedModule,
        optimizer: torch.optim.Optimizer,
        fabric: Fabric,
        batch_size: int,
        seed: int,
    ) -> None:
        self.index = index
        self.name = data.name
        self.data = data
        self.module = module
        self.optimizer = optimizer
        self.fabric = fabric
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        self.train_loader = DataLoader(data.train, batch_size=batch_size, shuffle=True, generator=self.generator)
        self.test_loader = DataLoader(data.test, batch_size=batch_size * 4, shuffle=False)
        self.strategy_state: dict[str, Any] = {}

    @property
    def n_train(self) -> int:
        return len(self.data.train)

    @property
    def n_test(self) -> int:
        return len(self.data.test)

    def train(self, epochs: int, part: str | None, step_loss: Callable[[Any], torch.Tensor]) -> float | None:
        """Train ``part`` of the module for ``epochs`` passes over the training split.

        Args:
            epochs: local epochs.
            part: ``"all"``, ``"shared"``, ``"personal"`` or ``None`` (no training).
            step_loss: maps a device batch to the scalar loss of one step.

        Returns:
            Mean training loss over the steps, or ``None`` if nothing was
            trained (no part, or a part without parameters, e.g. the shared
            part of an all-personal logistic regression).
        """
        if part is None or self.module.parameter_split.size(part) == 0:
            return None
        self.module.set_trainable(part)
        self.module.train()
        total, steps = 0.0, 0
        for _ in range(epochs):
            for batch in self.train_loader:
                batch = self.fabric.to_device(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss = step_loss(batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{self.name}: training loss became {loss.item()} (learning rate too high?)")
                self.fabric.backward(loss)
                self.optimizer.step()
                total += loss.item()
                steps += 1
        self.module.set_trainable("all")
        return total / max(steps, 1)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The module's metrics over the whole test split."""
        self.module.eval()
        for batch_index, batch in enumerate(self.test_loader):
            self.module.test_step(self.fabric.to_device(batch), batch_index)
        return self.module.test_results()

    def state_dict(self) -> dict[str, Any]:
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "strategy_state": self.strategy_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.strategy_state = state["strategy_state"]
