"""The proximal term of a local objective, written once: ``weight / 2 * ||w_part - centre||^2``.

FedProx (mu, around the round's global model), Ditto (lambda, the personal
model around the received global one), FedAMP (lam / alpha, around the cloud
model) and FPFC (rho, the personal part around the ADMM centre) add this term
to their sites' loss. A :class:`ProximalSite` declares where the centre c
comes from, and names, per training plan, the slot, part and weight
(:meth:`ProximalSite.proximal`); it sets c, its declared loss state
``centre`` (:attr:`~medfed.federated.protocol.SiteHalfProtocol.loss_state`),
when a phase's message arrives and clears it after the phase's reply, and
adds the term on the live parameters
(:func:`~medfed.federated.strategies.live_parameters.proximal_term`), so its
gradient weight (w - c) reaches the optimiser. (SuPerFed's term mu ||w^f -
w^g||^2 is part of a mixture loss it writes itself.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from medfed.federated.protocol import MODEL, Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.base import SiteHalf
from medfed.federated.strategies.live_parameters import proximal_term


@dataclass(frozen=True)
class Proximal:
    """One proximal term: ``weight / 2 * ||w - centre||^2`` on ``part`` of ``slot``'s live parameters w.

    Attributes:
        slot: the model slot whose parameters the term acts on.
        part: a part of the model (``"all"``, ``"shared"``, ``"personal"``, ...), the centre's size.
        weight: the term's weight (> 0; a zero weight is no term: :meth:`ProximalSite.proximal` returns None).
    """

    slot: str
    part: str
    weight: float


class ProximalSite(SiteHalf):
    """A site half whose local objective adds :meth:`proximal`'s term around its ``centre`` to every step's loss.

    The centre c, ``(size(part),)``, is set when a phase's message arrives:
    the message's vector under :attr:`centre_key` (FedAMP's cloud model,
    FPFC's u_i), or where that is None :meth:`held_centre`, what the site
    holds then (FedProx's and Ditto's w^t, the global model the last delivery
    set); it is cleared after the phase's reply (a checkpoint never holds it).
    """

    loss_state = ("centre",)
    #: the message key whose vector is the centre, or None: :meth:`held_centre`
    centre_key: ClassVar[str | None] = None

    def held_centre(self, site: SiteView) -> torch.Tensor:
        """The centre where no message key carries it, read when the message arrives; default: the site's one model."""
        return site.get(MODEL, "all")

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().receive(site, ctx, payload)
        self.centre = payload[self.centre_key] if self.centre_key is not None else self.held_centre(site)

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal | None:
        """The proximal term of ``plan``'s steps; None: no term."""
        return None

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """``weight / 2 * ||w - centre||^2`` of :meth:`proximal` on the live parameters (gradient weight (w - centre)), or None."""
        term = self.proximal(ctx, plan)
        if term is None:
            return None
        return proximal_term(site.module(term.slot), term.part, self.centre, term.weight)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        self.centre = None  # only needed while training
        return super().reply(site, ctx)
