"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020): FedAvg with a proximal term in every local objective.

"Federated optimization in heterogeneous networks", Algorithm 2. In round t
the server holds w^t; each participant k, starting from w^t, finds an
inexact minimiser of

    h_k(w; w^t) = F_k(w) + mu / 2 * ||w - w^t||^2                       (eq. 2)

and the server averages the participants' results into w^{t+1}. Here the
inexact minimiser is the trainer's local steps of the site's optimiser on
h_k (the paper's gamma-inexactness is whatever those steps leave), and
everything else is FedAvg's (:mod:`~medfed.federated.strategies.fedavg`, whose
halves this module subclasses): sample-weighted averaging of the parameters
and floating-point buffers, the global model delivered to every site at the
end of the round, sites evaluated with it. w^t is the global model the site
holds when the round's training starts (what the last delivery loaded).

**Where medfed differs.** The paper samples devices with probability p_k
(their share of the data) and averages uniformly; medfed's participants are
a uniform seeded draw and the average is weighted by sample counts (FedAvg's
rule; the same in expectation, and identical with equal site sizes). The
paper's simulated stragglers (devices doing less local work) have no
counterpart: every participant takes the trainer's steps.

**Where medfed differs from PFLlib.** PFLlib adds mu (w - w^t) to the
gradient inside a custom SGD step (``PerturbedGradientDescent``). Here the
term is part of the loss, built on the live parameters
(:class:`~medfed.federated.strategies.proximal.ProximalSite`), so
the optimiser, whichever it is (the BraTS U-Net's Adam included), descends
h_k itself; with plain SGD both are the same step.

With mu = 0 no term is added at all: FedProx is then FedAvg, bit for bit.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.proximal import Proximal, ProximalSite


class FedProxSite(ProximalSite, FedAvgSite):
    """FedAvg's site half training on F_k(w) + mu / 2 ||w - w^t||^2."""

    def held_centre(self, site: SiteView) -> torch.Tensor:
        """w^t: the global model the round's training starts from (the last delivery's)."""
        return site.get(self.global_slot, self.averaged.parameters)

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal | None:
        """mu / 2 * ||w - w^t||^2 on the global model's parameters; none at mu = 0."""
        if self.options.mu == 0:
            return None
        return Proximal(self.global_slot, self.averaged.parameters, self.options.mu)


class FedProx(FedAvg):
    Site = FedProxSite
