"""The life cycle every federated algorithm follows, and its defaults.

A :class:`Strategy` holds both halves of one algorithm, coupled only by
payloads (``dict[str, Tensor]``) that cross the site boundary through a
:class:`~medfed.federated.link.Link` (which encodes them to real bytes):

* **server hooks** (``server_*``) see only the payloads sites send and the
  state the server keeps in ``self``; never a site's data or module;
* **site hooks** (``site_*``) see one :class:`~medfed.federated.site.Site`
  (its module, optimiser, loaders) and keep per-site state only in
  ``site.strategy_state``, which the site checkpoints.

Because of this separation the same object could run across a real network
(e.g. Flower): the server hooks on the server, the site hooks on each client.

One run, as :class:`~medfed.federated.loop.FederatedLoop` calls it::

    replies = {i: site_setup(site_i)}                 # e.g. a data sketch
    server_setup(initial, replies)                    # initial = {"shared", "personal", "all"} vectors
    deliver to every site                             # round 0
    for round in 1..R:
        for phase in phases:
            messages = {i: server_message(phase, i)}   # for each participating site i
            for each participating site i:
                site_receive(site_i, phase, messages[i])
                site_i trains the part site_trainable(phase) on site_loss(...)
                    for local_epochs * site_epoch_share(phase) epochs
                replies[i] = site_reply(site_i, phase)
            server_aggregate(phase, replies)          # not called when no reply came through

(The server's messages of a phase are all made before any site trains, as
they would be with sites training at the same time: ``server_message`` may
depend only on server state, and must not change it. A participant that
fails in a phase, see :mod:`medfed.federated.faults`, is missing from that
phase's replies and takes no part in the rest of the round; it is put back
to its start-of-round state and gets the delivery, so the server must treat
it as a site that did not take part from that phase on: whatever it
learns about a site, it learns from the replies.)
        for every site i: site_receive(site_i, "deliver", server_deliver(i))
        every site evaluates its model on its own test split

"Deliver" hands each site the model it is evaluated with (FedAvg: the
global model; pFedNet: M x + N z_i); strategies whose model never leaves
the site deliver nothing.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from medfed.models.split import ParameterSplit

if TYPE_CHECKING:
    from medfed.federated.site import Site

#: What crosses the site boundary: named flat tensors.
Payload = dict[str, torch.Tensor]

DELIVER = "deliver"


class Strategy(ABC):
    """Base class: defaults describe local training with nothing exchanged.

    Subclasses declare ``name``, an ``Options`` dataclass (the ``strategy``
    config group) and ``phases``, and override the hooks they need.

    Args:
        options: the validated ``Options`` instance.
        split: names and sizes of the model's shared and personal parts
            (the server knows the architecture, not the weights).
        n_sites: number of sites in the federation.
        seed: the run's seed, for any randomness the strategy needs.
    """

    name: ClassVar[str]
    phases: ClassVar[tuple[str, ...]] = ("fit",)
    #: payload keys carrying model-sized vectors, the only ones a (lossy) codec compresses, mapped to
    #: the initial vector their first message is coded against ("zeros" for gradients); "key/..."
    #: matches the prefix "key" (e.g. ``{"core": "all"}`` covers "core/0", "core/1", ...).
    coded_keys: ClassVar[dict[str, str]] = {"all": "all", "shared": "shared", "personal": "personal"}

    @dataclass
    class Options:
        """No options (the ``strategy.<name>`` group of a strategy that takes none)."""

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed

    # ------------------------------------------------------------------ server side
    def server_setup(self, initial: Payload, replies: dict[int, Payload]) -> None:
        """Called once before round 1 with the initial model vectors and every site's setup payload."""

    def server_message(self, phase: str, site_index: int) -> Payload:
        """What the server sends to a participating site before it trains in ``phase``."""
        return {}

    def server_aggregate(self, phase: str, replies: dict[int, Payload]) -> None:
        """Combine the replies of the sites that took part in ``phase`` (keys: site indices)."""

    def server_deliver(self, site_index: int) -> Payload:
        """What a site receives at the end of a round, to be evaluated with."""
        return {}

    def server_metrics(self) -> dict[str, float]:
        """Diagnostics of the last server step, logged each round (e.g. ADMM iterations)."""
        return {}

    def server_figures(self) -> dict[str, Any]:
        """Figures of the server's state to save with the run (``{file stem: matplotlib Figure}``)."""
        return {}

    def server_state_dict(self) -> dict[str, Any]:
        """Everything the server must remember across rounds (checkpointed)."""
        return {}

    def load_server_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`server_state_dict`."""

    # ------------------------------------------------------------------ site side
    def site_setup(self, site: Site) -> Payload:
        """Sent once before training (e.g. a data sketch that reveals no sample)."""
        return {}

    def site_receive(self, site: Site, phase: str, payload: Payload) -> None:
        """Load what the server sent into the site's module (phase ``"deliver"`` included)."""

    def site_epoch_share(self, phase: str) -> float:
        """The share of the round's ``trainer.local_epochs`` a site trains in ``phase`` (> 0).

        The default 1.0 trains every phase for all of them. A strategy with
        several training phases returns shares summing to 1 to take, over the
        round, the local steps a one-phase strategy takes (fair compute):
        phase k then trains local_epochs * share_k epochs, i.e.
        :meth:`~medfed.federated.site.Site.steps` of them after the epochs of
        the phases before it. Phases that train nothing (``site_trainable``
        ``None``) are not affected.
        """
        return 1.0

    def site_trainable(self, phase: str) -> str | None:
        """Which part trains in ``phase``: ``"all"``, ``"shared"``, ``"personal"`` or ``None``."""
        return "all"

    def site_loss(self, site: Site, phase: str, batch: Any) -> torch.Tensor:
        """The loss of one local step: the model's own loss plus :meth:`site_regularizer`."""
        loss = site.module.training_step(batch, 0)
        regularizer = self.site_regularizer(site, phase)
        return loss if regularizer is None else loss + regularizer

    def site_regularizer(self, site: Site, phase: str) -> torch.Tensor | None:
        """A term added to every local step's loss (e.g. a proximal term), or ``None``."""
        return None

    def site_reply(self, site: Site, phase: str) -> Payload:
        """What the site sends back after training in ``phase``."""
        return {}


def num_samples(site: Site) -> torch.Tensor:
    """The site's training-set size as a payload entry (for sample-weighted averaging)."""
    return torch.tensor([float(site.n_train)])
