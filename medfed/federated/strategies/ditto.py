"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a FedAvg global model and a personal model kept near it.

"Ditto: fair and robust federated learning through personalization",
Algorithm 1. Site k holds two models: the global model w, trained and
averaged as in FedAvg, and its personal model v_k, which never leaves it
and solves

    min_v  h_k(v; w*) = F_k(v) + lambda / 2 * ||v - w*||^2                 (eq. 2)

with w* the global model. In round t every participant k receives w^t and

1. trains w from w^t as FedAvg's local update does and sends it; the server
   averages the replies into w^{t+1} (FedAvg's halves, subclassed here);
2. takes the personal plan's steps on v_k, on h_k(v; w^t): gradient
   grad F_k(v) + lambda (v - w^t), w^t the global model it received this
   round (not the one it is training).

Sites are evaluated with v_k. A site that skips a round leaves v_k as it
is; the global model reaches every site at the end of each round (FedAvg's
delivery), so it trains from the newest one when it next takes part.

**Model slots and plans.** ``global`` (w, the slot FedAvg's site half
trains, replies and receives) and ``personal`` (v_k, evaluated). The
round's one phase has two training plans: the global plan, then the
personal plan (``personal_epochs`` or ``personal_steps`` set its length
outright, the paper's s local iterations). The personal plan draws its
batches from a data order of its own (``TrainingPlan.data_order``), so
neither model's batches depend on how long the other trains. It follows
that the global model is a FedAvg run's, bit for bit, whatever lambda, when
that run's budget is the global plan's; and that at lambda = 0 (no term is
added at all) the personal model is a Local run's, bit for bit, when that
run's budget is the personal plan's and whole epochs (the round's budget is
cut at whole mini-batches along one axis, so a half epoch after the global
plan's may end one mini-batch from where Local's would): its own steps on its own data in the
batch order a Local site draws, the optimiser state carried across rounds
(for models whose training draws nothing from the global generators, e.g.
without dropout: within a phase those are shared between the two plans). As
lambda grows the minimiser of eq. 2 tends to w^t, at distance
||(H + lambda I)^-1 grad F_k(w^t)|| for a quadratic F_k with Hessian H
(``tests/test_ditto.py`` checks both limits).

**Budget** (:mod:`medfed.federated.strategies.base`). By default (``preset:
equal``) the two plans share the round's budget E = ``trainer.local_epochs``
equally: E/2 epochs each (``global_share``, ``personal_share``), so a Ditto
round costs a FedAvg round's passes. ``preset: published`` is the paper's
protocol as medfed shipped it before: the global model E epochs, as FedAvg
trains, and the personal model as many again (2 E in all).

**BatchNorm buffers.** Each model keeps its own running statistics: w's are
averaged with w (FedAvg), v_k's are updated by v_k's own training steps.

**Where medfed differs.** The paper's global update may be any FedAvg-like
solver with uniform averaging over sampled devices; medfed's is FedAvg's
sample-weighted average over its uniformly drawn participants. PFLlib trains
the personal model first and puts lambda (v - w) inside a custom SGD step;
here the global model trains first (the order does not matter: the
personal term is anchored at the w^t received, kept aside) and the term is
part of the loss, so any optimiser descends h_k.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.proximal import Proximal, ProximalSite

GLOBAL, PERSONAL = "global", "personal"


class DittoSite(ProximalSite, FedAvgSite):
    """FedAvg's site half on the ``global`` slot, then the personal model's steps on h_k(v; w^t)."""

    global_slot = GLOBAL

    def held_centre(self, site: SiteView) -> torch.Tensor:
        """w^t: the global model the round starts from, before the global plan trains it."""
        return site.get(GLOBAL, "all")

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The global plan, then the personal plan in its own data order (their lengths: the module docstring's budget)."""
        options = self.options
        personal = TrainingPlan(
            slot=PERSONAL, share=options.personal_share, epochs=options.personal_epochs, steps=options.personal_steps, data_order=PERSONAL
        )
        return (TrainingPlan(slot=GLOBAL, share=options.global_share), personal)

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal | None:
        """lambda / 2 * ||v - w^t||^2 on the personal model; none for the global plan or at lambda = 0."""
        if plan.slot != PERSONAL or self.options.lam == 0:
            return None
        return Proximal(PERSONAL, "all", self.options.lam)


class Ditto(FedAvg):
    slots = (GLOBAL, PERSONAL)
    evaluated_slot = PERSONAL
    Site = DittoSite
