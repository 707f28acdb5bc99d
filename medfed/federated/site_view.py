"""What a strategy's site half sees: a narrow view of its site, and the context of each call.

A site half (:class:`~medfed.federated.strategies.base.SiteHalf`) never gets
the :class:`~medfed.federated.site.Site` itself, its loaders, optimisers or
Fabric. Every hook gets a :class:`SiteView`, which offers exactly what an
algorithm's local work needs:

* the model slots: a slot's module (for its forward pass and the live
  parameters of a loss term) and get/set of its parts as flat vectors
  (:data:`~medfed.models.split.PARTS`);
* the site's sample counts and its own data splits (sketches, class counts);
* :meth:`SiteView.step`, one optimiser step of a slot on a loss the half
  computed (pFedMe's inner steps, which is why pFedMe is not batchable);
* :meth:`SiteView.full_pass`, the batches of a whole split in a fixed order
  (PGFed's gradient estimate, IFCA's cluster losses);
* :meth:`SiteView.global_rng`, the site's seeded random streams;

and a :class:`RoundContext`: the round and the phase the call belongs to
(Flower's ``Strategy`` passes ``server_round`` the same way).

Every forward and backward pass the helpers make is counted (samples, in
epochs of the site's training split) for the run's compute accounting
(:mod:`medfed.federated.compute`); the loop's own training steps are counted
where they run. Counting reads batch shapes only: no device synchronisation.

This module imports neither the site nor the strategies, so both can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from medfed.data.federation import SiteData
from medfed.models.base import FederatedModule

#: the phase of a site half's ``setup`` (before round 1)
SETUP = "setup"
#: the phase of the end-of-round delivery (and of round 0's first one)
DELIVER = "deliver"
#: the phase of the adapt step, after the delivery and before the round's evaluation
ADAPT = "adapt"


@dataclass(frozen=True)
class RoundContext:
    """The round and the phase a hook is called in.

    Attributes:
        round: 1-based round index; 0 before round 1 (``setup`` and the first delivery).
        phase: one of the strategy's ``phases``, or :data:`SETUP` / :data:`DELIVER` / :data:`ADAPT`.
    """

    round: int
    phase: str


class SiteView(Protocol):
    """One site as its strategy half sees it (see the module docstring).

    Attributes:
        index: the site's 0-based position in the federation.
        name: its name (``site0``, ...).
        n_train: training samples (the unit of compute: one epoch).
        n_test: samples of the evaluated split.
        batch_size: mini-batch size of local training.
        eval_batch_size: batch size of evaluation passes (no gradients).
        data: the site's own splits (``train``, ``test``, ``validation``).
    """

    index: int
    name: str
    data: SiteData

    @property
    def n_train(self) -> int: ...

    @property
    def n_test(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def eval_batch_size(self) -> int: ...

    def module(self, slot: str) -> FederatedModule:
        """The module of model slot ``slot`` (Fabric-wrapped; forward, ``training_step``, live parameters)."""
        ...

    def get(self, slot: str, part: str) -> torch.Tensor:
        """``part`` of ``slot``'s model as a detached flat vector (``get_vector``)."""
        ...

    def set(self, slot: str, part: str, vector: torch.Tensor) -> None:
        """Load ``vector`` into ``part`` of ``slot``'s model (``set_vector``)."""
        ...

    def learning_rate(self, slot: str) -> float:
        """The learning rate of ``slot``'s optimiser (its first parameter group)."""
        ...

    def step(
        self,
        slot: str,
        loss: torch.Tensor,
        batch: Any,
        optimizer: torch.optim.Optimizer | None = None,
        stop_if: Callable[[], bool] | None = None,
    ) -> bool:
        """One optimiser step on ``loss``, a loss of ``batch`` computed by the half; counted as a pass of its samples.

        Frees ``slot``'s gradients, back-propagates ``loss`` (every tensor it
        depends on gets its gradient, e.g. a mixing weight), steps the
        optimiser and frees the gradients again.

        Args:
            slot: whose optimiser steps.
            loss: a scalar.
            batch: the device batch ``loss`` was computed on (its size is counted).
            optimizer: a half's own optimiser over the slot's parameters
                instead of the slot's (pFedMe's plain inner steps).
            stop_if: called after the backward pass: True skips the step
                (pFedMe's tolerance on the gradient norm).

        Returns:
            Whether the optimiser stepped.
        """
        ...

    def full_pass(
        self, split: str, name: str, backward: bool, batch_size: int | None = None
    ) -> Iterator[tuple[Any, int]]:
        """The device batches of a whole split, in order, each with its number of samples.

        The order is fixed (no shuffling), and neither the site's data order
        nor torch's global generator moves. Counted as ``aux/<name>``
        (forward and backward passes, ``backward``) or ``forward/<name>``.

        Args:
            split: ``"train"``, ``"test"`` or ``"validation"``.
            name: what the pass is for (its compute label).
            backward: whether the caller back-propagates each batch's loss.
            batch_size: None: the training batch size.
        """
        ...

    def global_rng(self, *stream: int) -> AbstractContextManager[None]:
        """Torch's, NumPy's and Python's global generators seeded from (run seed, site, ``*stream``) inside the block.

        The loop runs every phase of round r in stream ``(r, phase index)``;
        other streams (e.g. ``(0,)``, SuPerFed's local initialisation) are
        the half's to name.
        """
        ...


def split_of(data: SiteData, split: str) -> Dataset:
    """``data``'s split named ``split`` (``"train"``, ``"test"`` or ``"validation"``)."""
    if split not in ("train", "test", "validation") or getattr(data, split) is None:
        raise ValueError(f"{data.name} has no {split!r} split")
    return getattr(data, split)
