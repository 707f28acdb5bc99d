"""The proximal term of a local objective, written once: ``weight / 2 * ||w_part - centre||^2``.

FedProx (mu, around the round's global model), Ditto (lambda, the personal
model around the received global one), FedAMP (lam / alpha, around the cloud
model), FPFC (rho, the personal part around the ADMM centre) and SuPerFed
(2 mu, around the received global model) add this term to their sites' loss.
A :class:`ProximalSite` names, per training plan, the slot, part and weight
and the centre: a tensor of the half's declared loss state
(:attr:`~medfed.federated.protocol.SiteHalfProtocol.loss_state`), set when the
server's message arrives and cleared after the reply; the term itself is
:func:`~medfed.federated.strategies.live_parameters.proximal_term` on the live
parameters, so its gradient weight (w - centre) reaches the optimiser.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medfed.federated.protocol import RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.base import SiteHalf
from medfed.federated.strategies.live_parameters import proximal_term


@dataclass(frozen=True)
class Proximal:
    """One proximal term: ``weight / 2 * ||w - centre||^2`` on ``part`` of ``slot``'s live parameters w.

    Attributes:
        slot: the model slot whose parameters the term acts on.
        part: ``"all"``, ``"shared"`` or ``"personal"``.
        weight: the term's weight (> 0; a zero weight is no term: :meth:`ProximalSite.proximal` returns None).
        centre: ``(size(part),)``, an attribute of the half's declared loss state (no gradient flows to it).
    """

    slot: str
    part: str
    weight: float
    centre: torch.Tensor


class ProximalSite(SiteHalf):
    """A site half whose local objective adds :meth:`proximal`'s term to every step's loss (its :meth:`regularizer`)."""

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal | None:
        """The proximal term of ``plan``'s steps, its centre read from declared loss state; None: no term."""
        return None

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """``weight / 2 * ||w - centre||^2`` of :meth:`proximal` on the live parameters (gradient weight (w - centre)), or None."""
        term = self.proximal(ctx, plan)
        if term is None:
            return None
        return proximal_term(site.module(term.slot), term.part, term.centre, term.weight)
